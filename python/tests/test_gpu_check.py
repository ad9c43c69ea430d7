"""scripts/gpu-check.sh without a GPU: its refusals (one line on stderr and exit 2, before it looks for
a GPU: the nvidia-smi on PATH here records being run), "no GPU: skipped", and the steps a run takes
(GPU_CHECK_LIST=1) in the order issue 78's preset asks for; scripts/gpu_report.py, the report
writer, on step outputs made here; bench_cuda_attention.py's --kernel-names on profiler events
made here (the GPU run profiles real ones)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
REPORT = ROOT / "scripts" / "gpu_report.py"
BENCH = ROOT / "python" / "bench" / "bench_cuda_attention.py"
VARIANTS = ["cudnn-variant-default", "cudnn-variant-top-left", "cudnn-variant-no-max-total",
            "cudnn-variant-exact-batch", "cudnn-variant-dense", "cudnn-variant-dense+top-left",
            "cudnn-variant-dense+top-left+head-major-lse"]


@pytest.fixture
def gpu_check(tmp_path):
    """Runs gpu-check.sh with only the given GPU_CHECK_* settings, an nvidia-smi first on PATH that
    writes a mark and fails (a machine without a GPU, whatever this one has); returns (run, probed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mark = tmp_path / "probed"
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ntouch '{mark}'\nexit 9\n")
    smi.chmod(0o755)

    def run(*args: str, **settings: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "PYTHON"}
        env.update(settings, PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
        done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, env=env,
                              cwd=tmp_path)
        return done, mark.exists()
    return run


def test_no_argument_is_the_usage_and_exit_2(gpu_check):
    done, probed = gpu_check()
    assert done.returncode == 2 and done.stderr.startswith("usage: scripts/gpu-check.sh OUT_DIR") and not probed


def test_help_is_the_usage_and_exit_0(gpu_check):
    done, probed = gpu_check("--help")
    assert done.returncode == 0, done.stderr
    assert "usage: scripts/gpu-check.sh OUT_DIR" in done.stderr and "GPU_CHECK_PRESET=cudnn-speed" in done.stderr
    assert not probed


@pytest.mark.parametrize("settings, message", [
    ({"GPU_CHECK_SECONDS": "abc"}, "GPU_CHECK_SECONDS must be a whole number of seconds, not 'abc'"),
    ({"GPU_CHECK_PRESET": "nope"}, "GPU_CHECK_PRESET must be cudnn-speed (the one preset) or unset, not 'nope'"),
    ({"GPU_CHECK_PRESET": "cudnn-speed", "GPU_CHECK_STEPS": "probe"}, "GPU_CHECK_PRESET and GPU_CHECK_STEPS together"),
    ({"GPU_CHECK_LIST": "yes"}, "GPU_CHECK_LIST must be 1"),
])
def test_a_bad_setting_is_one_line_and_exit_2_before_any_gpu_probe(gpu_check, tmp_path, settings, message):
    done, probed = gpu_check(str(tmp_path / "out"), **settings)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpu-check: ") and message in done.stderr, done.stderr
    assert not probed and not done.stdout and not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_refused(gpu_check, tmp_path):
    out = tmp_path / "out"
    out.write_text("not a folder")
    done, probed = gpu_check(str(out))
    assert done.returncode == 2 and done.stderr == f"gpu-check: {out} exists and is not a folder\n" and not probed


@pytest.mark.parametrize("settings", [{}, {"GPU_CHECK_PRESET": "cudnn-speed"},
                                      {"GPU_CHECK_PRESET": "cudnn-speed", "GPU_CHECK_SECONDS": "100"}])
def test_without_a_gpu_it_is_skipped(gpu_check, tmp_path, settings):
    done, probed = gpu_check(str(tmp_path / "out"), **settings)
    assert done.returncode == 0 and done.stdout == "gpu-check: no GPU: skipped\n" and probed, done.stderr
    assert not (tmp_path / "out").exists()


def planned(gpu_check, **settings) -> list:
    done, probed = gpu_check(GPU_CHECK_LIST="1", **settings)   # no OUT_DIR: nothing is written
    assert done.returncode == 0 and not done.stderr and not probed, done.stderr
    return done.stdout.splitlines()


def test_the_preset_takes_its_steps_in_issue_78s_order(gpu_check):
    steps = planned(gpu_check, GPU_CHECK_PRESET="cudnn-speed")
    assert steps == ["probe", "configure-cuda", "build-cuda", "ctest-cuda", "ctest-hopper-dq-pass", "memcheck-hopper",
                     *VARIANTS, "cudnn-autotune", "cudnn-autotune-cached", "cuda-attention",
                     "cuda-attention-hopper-dq-pass", "kernel-table"]
    at = steps.index
    hopper_tests, timing = ["ctest-cuda", "ctest-hopper-dq-pass"], ["cuda-attention", "cuda-attention-hopper-dq-pass"]
    assert at("build-cuda") < min(map(at, hopper_tests)) and max(map(at, hopper_tests)) < at("memcheck-hopper")
    assert at("memcheck-hopper") < min(map(at, VARIANTS)) and max(map(at, VARIANTS)) < at("cudnn-autotune")
    assert at("cudnn-autotune") + 1 == at("cudnn-autotune-cached") < min(map(at, timing))
    assert max(map(at, timing)) < at("kernel-table") == len(steps) - 1


def test_without_the_preset_the_list_is_todays_run_and_follows_gpu_check_steps(gpu_check, tmp_path):
    steps = planned(gpu_check)
    assert steps[:4] == ["probe", "configure-cuda", "build-cuda", "ctest-cuda"] and steps[-1] == "torchtitan-cuda"
    # The variants, then the pool's release threshold at CUDA's default against the variants' first.
    assert steps[steps.index("cuda-attention-mha") + 1:steps.index("cuda-attention-d64")] == [*VARIANTS, "cudnn-pool-release"]
    assert "cudnn-autotune" not in steps and len(steps) == len(set(steps)) == 31
    assert planned(gpu_check, GPU_CHECK_STEPS="kernel-table cudnn-variants torch-cuda") == \
        ["probe", "configure-cuda", "build-cuda", "torch-cuda", *VARIANTS, "kernel-table"]
    done, _ = gpu_check(str(tmp_path / "out"), GPU_CHECK_LIST="1")   # OUT_DIR given: still nothing written
    assert done.stdout.splitlines() == steps and not (tmp_path / "out").exists()


# The report writer.

def write_report(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPORT), str(out), *args], capture_output=True, text=True, timeout=30)


def bench(**extra) -> dict:
    return {"format": "distca-bench-cuda-attention", "version": 2, "rows": [], **extra}


def test_the_report_has_each_steps_status_the_skipped_steps_the_engines_and_the_kernels(tmp_path):
    out = tmp_path / "out"
    (out / "cudnn-logs").mkdir(parents=True)
    (out / "device.txt").write_text("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-x)\n")
    (out / "steps.txt").write_text("probe 0 6\nbuild-cuda 0 71\nctest-cuda 8 12\ncudnn-variant-default 124 20\n"
                                   "cudnn-autotune 0 24\ncuda-attention 0 25\ncuda-attention-hopper-dq-pass skipped 0\n"
                                   "kernel-table skipped 0\n")
    (out / "ctest-cuda.log").write_text("2 tests failed: Shapes/CudaServerKernelVsCpu.X/hopper_mha4_d128_bf16\n")
    vs = [{"backend": "cudnn", "layout": "whole", "tokens": 16384, "shard": None, "fwd": 0.9, "bwd": 0.6}]
    attention = bench(rows=[{"backend": "hopper", "layout": "whole", "tokens": 16384}])
    (out / "cuda-attention.json").write_text(json.dumps(attention))
    engines = {"fwd q16384 kv16384": "eng8_k2=1", "bwd q16384 kv16384": "eng4_k3=2"}
    (out / "cudnn-autotune.json").write_text(json.dumps(bench(vs_sdpa_cudnn=vs, cudnn_graphs={
        "graphs_built": 6, "build_seconds": 1.5, "calls": 40, "autotune_seconds": 3.25, "engines": engines})))
    (out / "cudnn-engines.json").write_text(json.dumps({"format": "distca-cudnn-engines", "version": 1, "engines": {}}))
    kernels = {"cudnn": [{"name": "cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "cuda_ms": 41.5}],
               "sdpa-cudnn": [{"name": "cudnn_generated_fort_native_sdpa_sm90_knob_7", "cuda_ms": 20.0}]}
    (out / "cudnn-variant-default.json").write_text(json.dumps(bench(vs_sdpa_cudnn=vs, kernel_names=kernels)))
    (out / "cudnn-variant-default.log").write_text("gpu-check: cudnn-variant-default ran past its 20 s and was stopped\n")
    (out / "cudnn-logs" / "cudnn-variant-default.frontend.log").write_text("INFO: graph\n")
    done = write_report(out, "--preset", "cudnn-speed")
    assert done.returncode == 0 and not done.stderr, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert (report["format"], report["version"], report["preset"]) == ("distca-gpu-check", 3, "cudnn-speed")
    assert report["device"] == "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-x)"
    assert [(s["name"], s["rc"], s["seconds"], s["status"]) for s in report["steps"]] == [
        ("probe", "0", "6", "passed"), ("build-cuda", "0", "71", "passed"), ("ctest-cuda", "8", "12", "failed"),
        ("cudnn-variant-default", "124", "20", "timed out"), ("cudnn-autotune", "0", "24", "passed"),
        ("cuda-attention", "0", "25", "passed"),
        ("cuda-attention-hopper-dq-pass", "skipped", "0", "skipped: out of time"),
        ("kernel-table", "skipped", "0", "skipped: out of time")]
    assert report["skipped"] == ["cuda-attention-hopper-dq-pass", "kernel-table"]
    assert report["cuda_attention"] == attention and report["kernel_table"] is None
    assert report["cudnn_autotune"] == {"cudnn-autotune": {"engines": engines, "autotune_seconds": 3.25,
                                                           "graphs_built": 6, "vs_sdpa_cudnn": vs}}
    assert report["cudnn_engine_cache"]["format"] == "distca-cudnn-engines"
    assert report["kernel_names"] == {"cudnn-variant-default": kernels}
    assert report["cudnn_variants"] == {"default": vs}
    assert report["cudnn_logs"] == {"cudnn-logs/cudnn-variant-default.frontend.log": 12}
    md = (out / "report.md").read_text()
    assert "preset: cudnn-speed" in md and "| ctest-cuda | 8 | 12 |" in md
    assert "skipped: out of time: cuda-attention-hopper-dq-pass, kernel-table" in md
    assert "`fwd q16384 kv16384`: eng8_k2=1" in md and "hopper_mha4_d128_bf16" in md
    assert "## cuDNN graph variant default (DISTCA_CUDNN_GRAPH)" in md and "INFO: graph" not in md


def test_the_report_is_written_when_every_step_was_skipped(tmp_path):
    (tmp_path / "steps.txt").write_text("probe skipped 0\nconfigure-cuda skipped 0\nbuild-cuda skipped 0\n")
    done = write_report(tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["preset"] is None and report["device"] is None
    assert report["skipped"] == ["probe", "configure-cuda", "build-cuda"]
    assert {s["status"] for s in report["steps"]} == {"skipped: out of time"}
    assert "cudnn_autotune" not in report and "kernel_names" not in report
    assert "skipped: out of time: probe, configure-cuda, build-cuda" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("case, message", [
    ("missing", "no such folder"),
    ("file", "not a folder"),
    ("no steps", "steps.txt: no such file"),
    ("two fields", "steps.txt line 2: expected 'NAME EXIT SECONDS', got 'ctest-cuda 0'"),
    ("bad exit", "steps.txt line 2: expected 'NAME EXIT SECONDS', got 'ctest-cuda maybe 3'"),
])
def test_a_bad_folder_or_steps_line_is_one_line_and_exit_2(tmp_path, case, message):
    out = tmp_path / "out"
    if case == "file":
        out.write_text("")
    elif case != "missing":
        out.mkdir()
        if case != "no steps":
            second = {"two fields": "ctest-cuda 0", "bad exit": "ctest-cuda maybe 3"}[case]
            (out / "steps.txt").write_text(f"probe 0 6\n{second}\n")
    done = write_report(out)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, (done.returncode, done.stderr)
    assert done.stderr.startswith("gpu_report: ") and message in done.stderr, done.stderr
    assert not (out / "report.json").exists()


# bench_cuda_attention.py --kernel-names.

def load_bench():
    spec = importlib.util.spec_from_file_location("bench_cuda_attention_for_gpu_check", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_takes_kernel_names():
    done = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--kernel-names" in done.stdout, done.stderr
    parser = load_bench().build_parser()
    assert parser.parse_args(["--kernel-names"]).kernel_names and not parser.parse_args([]).kernel_names


def test_kernel_names_sum_the_device_events_by_name_longest_first():
    pytest.importorskip("torch")
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent
    bench = load_bench()

    def event(name, start_us, end_us, device_type):
        return FunctionEvent(id=start_us, name=name, thread=0, start_us=start_us, end_us=end_us, device_type=device_type)
    events = [event("cudnn_bprop", 0, 1500, DeviceType.CUDA), event("cudaLaunchKernel", 0, 9000, DeviceType.CPU),
              event("dq_pass", 2000, 2250, DeviceType.CUDA), event("cudnn_bprop", 3000, 3500, DeviceType.CUDA)]
    work = bench.device_work(events)
    assert work == {"cudnn_bprop": 2.0, "dq_pass": 0.25}, work
    per_backend: dict = {}
    bench.add_work(per_backend.setdefault("cudnn", {}), work)
    bench.add_work(per_backend["cudnn"], {"dq_pass": 0.25, "memset": 0.5})
    assert bench.kernel_names_report(per_backend) == {"cudnn": [
        {"name": "cudnn_bprop", "cuda_ms": 2.0}, {"name": "dq_pass", "cuda_ms": 0.5}, {"name": "memset", "cuda_ms": 0.5}]}
