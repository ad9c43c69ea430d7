#!/usr/bin/env python3
"""The GPU check's report: report.json and report.md in OUT_DIR, from its steps.txt (a line a step,
NAME EXIT SECONDS; EXIT is `skipped` for a step that had under 15 s of the budget left) and what the
steps left there (NAME.log, their JSON reports). scripts/gpu-check.sh runs it last, also when every
step was skipped. The standard library only: it runs on the device's own Python.

    python3 scripts/gpu_report.py OUT_DIR [--preset NAME]

--preset: the GPU_CHECK_PRESET the check ran (the report's "preset"; null without). Exit status 2,
with one line on stderr: OUT_DIR missing or not a folder, no steps.txt, or a steps.txt line that
is not NAME EXIT SECONDS.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

# Version 3 added to version 2's fields each step's status, and skipped, preset, cudnn_autotune,
# cudnn_engine_cache, kernel_names and cudnn_logs.
FORMAT, VERSION = "distca-gpu-check", 3
STEP_LINE = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9+._-]*) (?P<rc>[0-9]+|skipped) (?P<seconds>[0-9]+)")
SKIPPED = "skipped: out of time"
AUTOTUNE_STEPS = ("cudnn-autotune", "cudnn-autotune-cached")
# report.md's section per step log, in this order (the cuDNN graph variants follow, one each).
TITLES = (("probe", "what the device offers"), ("configure-cuda", "configure"), ("build-cuda", "the CUDA build"),
          ("ctest-cuda", "CUDA tests on the GPU (NcclComm, CudaServerKernel with distca's, cuDNN's and the sm_90a kernels)"),
          ("ctest-cudnn-exact", "the cuDNN tests with DISTCA_CUDNN_GRAPH=exact-batch"),
          ("ctest-hopper-dq-pass", "the sm_90a tests with dQ in its own pass (DISTCA_HOPPER_DQ=pass)"),
          ("memcheck", "compute-sanitizer memcheck"),
          ("bench-cuda", "distca bench attention --device cuda"), ("simulate-paper", "simulate --paper, measured profile"),
          ("torch-cuda", "distca.torch on CUDA"),
          ("cuda-attention", "distca's CUDA kernels beside PyTorch's (bench_cuda_attention.py)"),
          ("kernel-table", "the measured kernel table auto uses (distca.torch.kernel_table)"),
          ("cuda-attention-mha", "the same with K/V heads = query heads (is GQA cuDNN's backward gap?)"),
          ("cuda-attention-hopper-dq-pass", "the sm_90a backward with dQ in its own pass (DISTCA_HOPPER_DQ=pass)"),
          ("cuda-attention-d64", "the kernels at D 64 (bench_cuda_attention.py --head-dim 64)"),
          ("memcheck-hopper", "compute-sanitizer memcheck on the sm_90a kernels"),
          ("racecheck-hopper", "compute-sanitizer racecheck on the sm_90a kernels"),
          ("ncu-hopper", "Nsight Compute on the sm_90a forward and backward (hopper_kernel)"),
          ("torch-multirank", "distca.torch on 2 and 4 processes sharing the GPU (check_torch_multirank.py)"),
          ("torch-kernels", "server kernels (bench_torch_kernels)"),
          ("train-cuda", "the trainer on one GPU (python -m distca.torch.train --device cuda)"),
          ("megatron-cuda", "Megatron Core adapter"), ("torchtitan-cuda", "TorchTitan adapter"),
          ("cudnn-autotune", "cuDNN with its engines timed and the fastest kept (DISTCA_CUDNN_AUTOTUNE=1)"),
          ("cudnn-autotune-cached", "the same, the engines read from the cache file the step before wrote"))


class ReportError(Exception):
    """What keeps the report from being written, in one line."""


def status(rc: str) -> str:
    if rc == "skipped":
        return SKIPPED
    return {"0": "passed", "124": "timed out"}.get(rc, "failed")


def read_steps(out: pathlib.Path) -> list:
    path = out / "steps.txt"
    if not path.is_file():
        raise ReportError(f"{path}: no such file (scripts/gpu-check.sh writes it)")
    steps = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        match = STEP_LINE.fullmatch(line)
        if match is None:
            raise ReportError(f"{path} line {number}: expected 'NAME EXIT SECONDS', got {line[:80]!r}")
        step = match.groupdict()
        steps.append({**step, "status": status(step["rc"])})
    return steps


def report_of(out: pathlib.Path, preset) -> dict:
    steps = read_steps(out)
    device = out / "device.txt"
    report = {"format": FORMAT, "version": VERSION, "device": device.read_text().strip() if device.exists() else None,
              "preset": preset, "steps": steps, "skipped": [s["name"] for s in steps if s["status"] == SKIPPED]}

    def load(name):  # a step's JSON, or what kept it from being read (a step stopped mid-write)
        path = out / name
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return {"unreadable": str(e)}

    bench_log = out / "bench-cuda.log"
    if bench_log.exists():
        text = bench_log.read_text(errors="replace")
        start = text.find("{")   # progress lines go to stderr first; the JSON report follows
        try:
            report["bench_attention_cuda"] = json.loads(text[start:]) if start >= 0 else None
        except json.JSONDecodeError as e:
            report["bench_attention_cuda"] = {"unreadable": str(e)}
    profiles = sorted((out / "profiles").glob("*.json")) if (out / "profiles").exists() else []
    report["profiles"] = [str(p.relative_to(out)) for p in profiles]
    report["cuda_attention"] = load("cuda-attention.json")
    report["cuda_attention_hopper_dq_pass"] = load("cuda-attention-hopper-dq-pass.json")
    report["cuda_attention_d64"] = load("cuda-attention-d64.json")
    report["torch_cuda"] = load("torch-cuda.json")
    report["torch_kernels"] = load("torch-kernels.json")
    report["kernel_table"] = load("kernel-table.json")
    report["torch_multirank"] = load("torch-multirank.json")
    train = load("train-cuda.json")
    # The train-cuda step runs distca.torch.train, whose --json is distca-torch-train version 1; a
    # file of another format or version (e.g. distca train's distca-train) is named in one line.
    train_format = ("distca-torch-train", 1)
    if train and "unreadable" not in train and (train.get("format"), train.get("version")) != train_format:
        print(f"train-cuda.json is {train.get('format')} version {train.get('version')}, this script reads "
              f"{train_format[0]} version {train_format[1]}: rerun python -m distca.torch.train --json")
        report["train_cuda"] = {"unreadable": f"{train.get('format')} version {train.get('version')}"}
    elif train and "summary" in train:
        summary = train["summary"]
        report["train_cuda"] = {name: {"tokens_per_second": b["tokens_per_second"], "step_seconds": b["step_seconds"],
                                       "loss_first": b["loss_first"], "loss_last": b["loss_last"]}
                                for name, b in summary["backends"].items()}
        report["train_cuda"]["loss_max_rel_diff"] = summary["loss_max_rel_diff"]
    # Per cuDNN graph variant: cudnn's TFLOP/s over sdpa-cudnn's on each shape (bench_cuda_attention.py).
    variants = {}
    for path in sorted(out.glob("cudnn-variant-*.json")):
        bench = load(path.name)
        variants[path.stem.removeprefix("cudnn-variant-")] = bench.get("vs_sdpa_cudnn") if isinstance(bench, dict) else None
    if variants:
        report["cudnn_variants"] = variants
    # The autotuned runs: the engine cuDNN's timing chose per graph key (the bench's cudnn_graphs),
    # the seconds spent timing (none where the cache file had the choice), the speed beside SDPA's.
    autotune = {}
    for name in AUTOTUNE_STEPS:
        bench = load(f"{name}.json")
        if isinstance(bench, dict) and "unreadable" not in bench:
            graphs = bench.get("cudnn_graphs") or {}
            autotune[name] = {"engines": graphs.get("engines"), "autotune_seconds": graphs.get("autotune_seconds"),
                              "graphs_built": graphs.get("graphs_built"), "vs_sdpa_cudnn": bench.get("vs_sdpa_cudnn")}
        elif bench is not None:
            autotune[name] = bench
    if autotune:
        report["cudnn_autotune"] = autotune
    cache = load("cudnn-engines.json")   # DISTCA_CUDNN_ENGINE_CACHE of the autotune steps
    if cache is not None:
        report["cudnn_engine_cache"] = cache
    # torch.profiler's device kernels per backend, from every bench run with --kernel-names.
    kernels = {}
    for path in sorted(out.glob("*.json")):
        bench = load(path.name)
        if isinstance(bench, dict) and "kernel_names" in bench:
            kernels[path.stem] = bench["kernel_names"]
    if kernels:
        report["kernel_names"] = kernels
    logs = sorted((out / "cudnn-logs").glob("*.log")) if (out / "cudnn-logs").is_dir() else []
    if logs:   # cuDNN's own logs (frontend info, backend warnings): named with their size, too long to inline
        report["cudnn_logs"] = {str(p.relative_to(out)): p.stat().st_size for p in logs}
    return report


def markdown(out: pathlib.Path, report: dict) -> str:
    lines = ["# distca GPU check", "", f"device: {report['device']}", ""]
    if report["preset"]:
        lines += [f"preset: {report['preset']}", ""]
    lines += ["| step | exit | seconds |", "|---|---|---|"]
    lines += [f"| {s['name']} | {s['rc']} | {s['seconds']} |" for s in report["steps"]]
    if report["skipped"]:
        lines += ["", f"{SKIPPED}: {', '.join(report['skipped'])}"]
    for name, entry in report.get("cudnn_autotune", {}).items():
        if isinstance(entry.get("engines"), dict):
            lines += ["", f"## the engines {name} ran ({entry.get('autotune_seconds')} s timing them)", ""]
            lines += [f"- `{key}`: {engine}" for key, engine in entry["engines"].items()] or ["- none"]
    for name, title in TITLES:
        log = out / f"{name}.log"
        if log.exists():
            lines += ["", f"## {title}", "", "```", log.read_text(errors="replace").rstrip(), "```"]
    for log in sorted(out.glob("cudnn-variant-*.log")):
        lines += ["", f"## cuDNN graph variant {log.stem.removeprefix('cudnn-variant-')} (DISTCA_CUDNN_GRAPH)", "", "```",
                  log.read_text(errors="replace").rstrip(), "```"]
    return "\n".join(lines) + "\n"


class Parser(argparse.ArgumentParser):
    def error(self, message):   # one line and exit status 2, as the other refusals
        print(f"gpu_report: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> int:
    parser = Parser(prog="scripts/gpu_report.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", metavar="OUT_DIR", help="the GPU check's folder (steps.txt and the steps' outputs)")
    parser.add_argument("--preset", default=None, help="the GPU_CHECK_PRESET the check ran")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    try:
        if not out.is_dir():
            raise ReportError(f"{out}: {'not a folder' if out.exists() else 'no such folder'}")
        report = report_of(out, args.preset or None)
    except ReportError as e:
        print(f"gpu_report: {e}", file=sys.stderr)
        return 2
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(out, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
