#!/usr/bin/env bash
# The one command a session with a GPU runs (the device tool: `scripts/gpu-check.sh $OUT`): builds
# distca with CUDA for the device (build-gpu/, sm_90a unless DISTCA_CUDA_ARCHS says otherwise) and
# runs the CUDA targets' tests (ctest -L gpu and the host-side kernel tests), compute-sanitizer
# memcheck on a small attention case, `distca bench attention --device cuda --json` (which checks
# the kernels against the CPU reference first and writes the measured profile
# $OUT/profiles/<device>.json), `distca simulate --paper` with that profile; installs the Python
# package against the device's own PyTorch (nothing can be fetched there:
# --no-build-isolation), runs distca.torch's CUDA checks in one process (every server kernel against
# `reference` in bf16 on a plan with key-split tasks, cad_attention end to end, kernel speed timed
# with CUDA events), the trainer on one GPU (tokens/s), the framework adapters' GPU checks where
# the device has the frameworks, and writes report.json and report.md into the folder given. Without a GPU it
# prints "no GPU: skipped" and exits 0. CI does not run it.
#
# usage: scripts/gpu-check.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ] || [ "$1" = "--help" ] || [ "$1" = "-h" ]; then
  echo "usage: scripts/gpu-check.sh OUT_DIR   (writes report.json, report.md and the logs there)" >&2
  [ $# -eq 1 ] && exit 0 || exit 2
fi
out="$1"
if [ -e "$out" ] && [ ! -d "$out" ]; then
  echo "gpu-check: $out exists and is not a folder" >&2
  exit 2
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no GPU: skipped"
  exit 0
fi
mkdir -p "$out"
python="${PYTHON:-python3}"
status=0
step() {  # step NAME COMMAND...: runs it, logs to $out/NAME.log, records its exit code
  local name="$1"; shift
  echo "== gpu-check: $name"
  local start=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -40 "$out/$name.log"
  echo "$name $rc $((SECONDS - start))" >>"$out/steps.txt"
  [ $rc -eq 0 ] || status=1
  return $rc
}
: >"$out/steps.txt"
nvidia-smi -L | tee "$out/device.txt"
# What the device offers, for the report (and for whoever fixes a step that cannot build there).
probe() {
  ldd --version | head -1; cmake --version | head -1; nvcc --version | tail -1
  command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
  "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  for pkg in fmt nlohmann_json CLI11 GTest MPI; do
    if cmake --find-package -DNAME=$pkg -DCOMPILER_ID=GNU -DLANGUAGE=CXX -DMODE=EXIST >/dev/null 2>&1; then
      echo "$pkg: found"; else echo "$pkg: not found"; fi
  done
  ls /usr/lib/x86_64-linux-gnu/libopenblas* /usr/lib/x86_64-linux-gnu/openblas*/libopenblas.so 2>/dev/null | head -2 ||
    echo "OpenBLAS: not found"
}
step probe probe
# Libraries the device lacks come from build/gpu-deps when a session carried it there
# (scripts/gpu-deps.sh prepares it from Debian's packages).
if [ -d build/gpu-deps/usr ]; then
  deps="$PWD/build/gpu-deps/usr"
  blas_dir="$deps/lib/x86_64-linux-gnu/openblas-pthread"
  export CMAKE_PREFIX_PATH="$deps${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$blas_dir:$deps/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # FindBLAS searches it too
  export CXXFLAGS="-isystem $deps/include/x86_64-linux-gnu/openblas-pthread ${CXXFLAGS:-}"
  echo "== gpu-check: using the libraries in build/gpu-deps"
fi
# distca's own CUDA kernels and NcclComm: configure, build what the checks run, test, sanitize, measure.
archs="${DISTCA_CUDA_ARCHS:-90a-real}"
step configure-cuda cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DDISTCA_WITH_CUDA=ON \
    -DDISTCA_CUDA_ARCHS="$archs" -DDISTCA_BUILD_BENCH=OFF &&
  step build-cuda cmake --build build-gpu -j "$(nproc)" &&
  {
    step ctest-cuda ctest --test-dir build-gpu --output-on-failure -L gpu -R . --timeout 300
    step ctest-cuda-host ctest --test-dir build-gpu --output-on-failure -R "Cuda|kernels_cuda" --timeout 300
    if command -v compute-sanitizer >/dev/null 2>&1; then
      step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 build-gpu/src/tools/distca bench attention \
        --device cuda --docs 300,1000 --shard-doc 1000 --shards 64,128 --heads 8 --kv-heads 2 --repeats 1 --json
    else
      echo "== gpu-check: memcheck skipped: compute-sanitizer is not on the device's PATH"
    fi
    mkdir -p "$out/profiles"
    device_slug=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
    step bench-cuda build-gpu/src/tools/distca bench attention --device cuda --json \
      --profile-out "$out/profiles/$device_slug.json"
    cp "$out/bench-cuda.log" "$out/bench-cuda.txt"
    step simulate-paper build-gpu/src/tools/distca simulate --paper --profile "$out/profiles/$device_slug.json"
  }
# The package into a venv that sees the device's PyTorch, pybind11 and scikit-build-core.
if [ ! -x build/gpu-venv/bin/python ]; then
  "$python" -m venv --system-site-packages build/gpu-venv
fi
step install build/gpu-venv/bin/python -m pip install --no-build-isolation --no-deps --disable-pip-version-check \
    --config-settings=cmake.define.DISTCA_WITH_CUDA=ON --config-settings=cmake.define.DISTCA_CUDA_ARCHS="$archs" . &&
  step torch-cuda build/gpu-venv/bin/python python/tests/gpu/check_torch_cuda.py --require-distca --json "$out/torch-cuda.json"
# distca's CUDA kernels beside PyTorch's (varlen, SDPA flash and cuDNN) on the same shapes, one process and run.
step cuda-attention build/gpu-venv/bin/python python/bench/bench_cuda_attention.py --json "$out/cuda-attention.json"
step torch-kernels build/gpu-venv/bin/python python/bench/bench_torch_kernels.py --device cuda --tokens 16384 \
  --heads 32 --kv-heads 8 --head-dim 128 --repeats 5 --json "$out/torch-kernels.json"
# The trainer on one GPU (CAD with one rank is the plain path: every task served locally), both
# backends compared step by step: tokens/s and the loss curve.
step train-cuda build/gpu-venv/bin/python -m distca.torch.train --device cuda --preset demo --compare --steps 12 \
  --skip 2 --json "$out/train-cuda.json"
# The framework adapters' GPU checks, where the device has the frameworks (it cannot fetch them).
if build/gpu-venv/bin/python -c "import megatron.core" >/dev/null 2>&1; then
  step megatron-cuda build/gpu-venv/bin/python python/tests/megatron_cases.py --device cuda --json "$out/megatron-cuda.json"
else
  echo "== gpu-check: megatron-cuda skipped: megatron-core is not installed on the device"
fi
if build/gpu-venv/bin/python -c "import torchtitan" >/dev/null 2>&1; then
  step torchtitan-cuda build/gpu-venv/bin/python python/tests/torchtitan_cases.py --reference flex
else
  echo "== gpu-check: torchtitan-cuda skipped: torchtitan is not installed on the device"
fi
build/gpu-venv/bin/python - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
steps = [dict(zip(("name", "rc", "seconds"), line.split())) for line in (out / "steps.txt").read_text().splitlines()]
report = {"format": "distca-gpu-check", "version": 1, "device": (out / "device.txt").read_text().strip(), "steps": steps}
bench_log = out / "bench-cuda.log"
if bench_log.exists():
    text = bench_log.read_text()
    start = text.find("{")   # progress lines go to stderr first; the JSON report follows
    try:
        report["bench_attention_cuda"] = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError as e:
        report["bench_attention_cuda"] = {"unreadable": str(e)}
profiles = sorted((out / "profiles").glob("*.json")) if (out / "profiles").exists() else []
report["profiles"] = [str(p.relative_to(out)) for p in profiles]
ca = out / "cuda-attention.json"
report["cuda_attention"] = json.loads(ca.read_text()) if ca.exists() else None
torch_json = out / "torch-cuda.json"
if torch_json.exists():
    report["torch_cuda"] = json.loads(torch_json.read_text())
train_json = out / "train-cuda.json"
if train_json.exists():
    summary = json.loads(train_json.read_text())["summary"]
    report["train_cuda"] = {name: {"tokens_per_second": b["tokens_per_second"], "step_seconds": b["step_seconds"],
                                   "loss_first": b["loss_first"], "loss_last": b["loss_last"]}
                            for name, b in summary["backends"].items()}
    report["train_cuda"]["loss_max_rel_diff"] = summary["loss_max_rel_diff"]
(out / "report.json").write_text(json.dumps(report, indent=1))
lines = [f"# distca GPU check", "", f"device: {report['device']}", "", "| step | exit | seconds |", "|---|---|---|"]
lines += [f"| {s['name']} | {s['rc']} | {s['seconds']} |" for s in steps]
for name, title in (("build-cuda", "the CUDA build"), ("ctest-cuda", "GPU tests (ctest -L gpu)"),
                    ("ctest-cuda-host", "CUDA kernels' host-side tests"), ("memcheck", "compute-sanitizer memcheck"),
                    ("bench-cuda", "distca bench attention --device cuda"), ("simulate-paper", "simulate --paper, measured profile"),
                    ("torch-cuda", "distca.torch on CUDA"),
                    ("cuda-attention", "distca's CUDA kernels beside PyTorch's (bench_cuda_attention.py)"), ("torch-kernels", "server kernels (bench_torch_kernels)"),
                    ("train-cuda", "the trainer on one GPU (python -m distca.torch.train --device cuda)"),
                    ("megatron-cuda", "Megatron Core adapter"), ("torchtitan-cuda", "TorchTitan adapter")):
    log = out / f"{name}.log"
    if log.exists():
        lines += ["", f"## {title}", "", "```", log.read_text().rstrip(), "```"]
(out / "report.md").write_text("\n".join(lines) + "\n")
PY
echo "gpu-check: $([ $status -eq 0 ] && echo ok || echo FAILED): report in $out/report.md"
exit $status
