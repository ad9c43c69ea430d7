#!/usr/bin/env bash
# The one command a session with a GPU runs (the device tool: `scripts/gpu-check.sh $OUT`): one
# build of distca with CUDA for the device (build-gpu/, sm_90a unless DISTCA_CUDA_ARCHS says
# otherwise: the distca binary, the CUDA tests and the Python module against the device's own
# Python and PyTorch; nothing can be fetched there), then the CUDA tests (NcclComm and
# CudaServerKernel on the GPU), compute-sanitizer memcheck on a small attention case, `distca bench
# attention --device cuda --json` (which checks the kernels against the CPU reference first and
# writes the measured profile $OUT/profiles/<device>.json), `distca simulate --paper` with that
# profile; then, with the package staged from that build, distca.torch's CUDA checks in one process
# (every server kernel against `reference` in bf16 on a plan with key-split tasks, cad_attention end
# to end, kernel speed timed with CUDA events), distca's kernels beside PyTorch's, the trainer on
# one GPU (tokens/s), the framework adapters' GPU checks where the device has the frameworks, and
# writes report.json and report.md into the folder given. Without a GPU it prints "no GPU: skipped"
# and exits 0. CI does not run it.
#
# Everything runs inside one time budget (GPU_CHECK_SECONDS, default 540: a device call's 10 minutes
# less the transfers): each step gets what is left, at most its own limit, and a step with under 15 s
# left is recorded as skipped ("out of time"), so the report is always written. GPU_CHECK_STEPS
# names the steps to run (e.g. "torch-cuda memcheck"; the probe, configure and build always run).
#
# usage: scripts/gpu-check.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ] || [ "$1" = "--help" ] || [ "$1" = "-h" ]; then
  echo "usage: scripts/gpu-check.sh OUT_DIR   (writes report.json, report.md and the logs there; GPU_CHECK_SECONDS: the budget, default 540)" >&2
  [ $# -eq 1 ] && exit 0 || exit 2
fi
out="$1"
if [ -e "$out" ] && [ ! -d "$out" ]; then
  echo "gpu-check: $out exists and is not a folder" >&2
  exit 2
fi
budget="${GPU_CHECK_SECONDS:-540}"
case "$budget" in ''|*[!0-9]*) echo "gpu-check: GPU_CHECK_SECONDS must be a whole number of seconds, not '$budget'" >&2; exit 2;; esac
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no GPU: skipped"
  exit 0
fi
mkdir -p "$out"
python="${PYTHON:-python3}"
status=0
only="${GPU_CHECK_STEPS:-}"   # e.g. "torch-cuda bench-cuda": just these (and the probe, configure and build)
step() {  # step NAME LIMIT_S COMMAND...: runs it within min(LIMIT_S, what is left), logs to $out/NAME.log
  local name="$1" limit="$2"; shift 2
  local asked=0  # "cudnn-variants" asks for every cudnn-variant-* step
  case " probe configure-cuda build-cuda $only " in *" $name "*) asked=1 ;; esac
  [[ $name == cudnn-variant-* && " $only " == *" cudnn-variants "* ]] && asked=1
  if [ -n "$only" ] && [ "$asked" -eq 0 ]; then
    echo "== gpu-check: $name not asked (GPU_CHECK_STEPS)"
    return 0
  fi
  local left=$((budget - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    echo "== gpu-check: $name skipped: out of time"
    echo "$name skipped 0" >>"$out/steps.txt"
    status=1
    return 1
  fi
  echo "== gpu-check: $name (at most ${limit} s)"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "gpu-check: $name ran past its ${limit} s and was stopped" >>"$out/$name.log"
  tail -25 "$out/$name.log"
  echo "$name $rc $((SECONDS - start))" >>"$out/steps.txt"
  [ $rc -eq 0 ] || status=1
  return $rc
}
: >"$out/steps.txt"
nvidia-smi -L | tee "$out/device.txt"
# What the device offers, for the report (and for whoever fixes a step that cannot build there).
probe() {
  ldd --version | head -1; cmake --version | head -1; nvcc --version | tail -1; nproc
  command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
  command -v mpirun || echo "mpirun: not on PATH"
  "$python" -c "import sys, sysconfig, os; inc = sysconfig.get_paths()['include']; print(sys.executable, sys.version.split()[0], 'headers', inc, os.path.exists(os.path.join(inc, 'Python.h')))"
  "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  "$python" -m pybind11 --cmakedir || echo "pybind11: not importable"
  for pkg in fmt nlohmann_json CLI11 GTest MPI; do
    if cmake --find-package -DNAME=$pkg -DCOMPILER_ID=GNU -DLANGUAGE=CXX -DMODE=EXIST >/dev/null 2>&1; then
      echo "$pkg: found"; else echo "$pkg: not found"; fi
  done
  ls /usr/lib/x86_64-linux-gnu/libopenblas* /usr/lib/x86_64-linux-gnu/openblas*/libopenblas.so 2>/dev/null | head -2 ||
    echo "OpenBLAS: not found"
  echo "NCCL: ${nccl_lib:-not found} ${nccl_inc:-}"
}
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
# NCCL: the CUDA toolkit's when it has one, else the one PyTorch's wheels bring (nvidia-nccl-*).
nccl_lib="" nccl_inc=""
for dir in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu \
           $("$python" -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])" 2>/dev/null)/lib; do
  for f in "$dir/libnccl.so" "$dir/libnccl.so.2"; do
    if [ -z "$nccl_lib" ] && [ -e "$f" ]; then nccl_lib="$f"; fi
  done
done
for dir in /usr/local/cuda/include /usr/include "$(dirname "${nccl_lib:-/x/x}")/../include"; do
  if [ -z "$nccl_inc" ] && [ -e "$dir/nccl.h" ]; then nccl_inc="$(cd "$dir" && pwd)"; fi
done
nccl_defs=()
if [ -n "$nccl_lib" ] && [ -n "$nccl_inc" ]; then
  nccl_defs=(-DNCCL_LIBRARY="$nccl_lib" -DNCCL_INCLUDE_DIR="$nccl_inc")
  export LD_LIBRARY_PATH="$(dirname "$nccl_lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# cuDNN: the CUDA toolkit's when it has one, else the one PyTorch's wheels bring (nvidia-cudnn-*).
cudnn_defs=()
if [ ! -e /usr/local/cuda/include/cudnn.h ]; then
  cudnn_root=$("$python" -c "import nvidia.cudnn, os; print(os.path.dirname(nvidia.cudnn.__file__) if nvidia.cudnn.__file__ else list(nvidia.cudnn.__path__)[0])" 2>/dev/null || true)
  if [ -n "$cudnn_root" ] && [ -d "$cudnn_root/lib" ]; then
    cudnn_defs=(-DCUDNN_ROOT="$cudnn_root")
    export LD_LIBRARY_PATH="$cudnn_root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi
probe_cudnn() {
  ls /usr/local/cuda/include/cudnn.h 2>/dev/null || echo "cudnn.h: not in /usr/local/cuda/include"
  echo "cuDNN from: ${cudnn_defs[*]:-the CUDA toolkit}"; ls "${cudnn_root:-/nonexistent}"/include/cudnn.h "${cudnn_root:-/nonexistent}"/lib 2>&1 | head -12
  ls build/gpu-deps/cudnn-frontend/include/cudnn_frontend.h 2>&1
}
export -f probe probe_cudnn
export python nccl_lib nccl_inc cudnn_root
step probe 60 bash -c 'probe; probe_cudnn'
# One build (build-gpu/, Ninja, every core) of what the checks run: the distca binary, the GPU
# tests, and the Python module _distca against the device's own Python and PyTorch (nothing can
# be fetched there), which the Python steps import from a staged copy of the package; a second
# build through pip would double the device time spent compiling.
archs="${DISTCA_CUDA_ARCHS:-90a-real}"
pybind11_dir=$("$python" -m pybind11 --cmakedir 2>/dev/null || true)
py_include=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['include'])" 2>/dev/null || true)
pkg="$PWD/build-gpu/python-package"
python_defs=(-DDISTCA_BUILD_PYTHON=OFF)
targets=(distca runtime_cuda_test runtime_cuda_gpu_test kernels_cuda_host_test)
if [ -n "$pybind11_dir" ] && [ -f "$py_include/Python.h" ]; then
  python_defs=(-DDISTCA_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$python")" -Dpybind11_DIR="$pybind11_dir")
  targets+=(_distca)
else  # the C++ checks still run
  echo "== gpu-check: the Python module cannot be built here (pybind11: ${pybind11_dir:-not found}; Python.h in ${py_include:-?}: not found)"
fi
step configure-cuda 120 cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DDISTCA_WITH_CUDA=ON \
    -DDISTCA_CUDA_ARCHS="$archs" -DDISTCA_BUILD_BENCH=OFF -DDISTCA_BUILD_TESTS=ON "${python_defs[@]}" "${nccl_defs[@]}" \
    "${cudnn_defs[@]}"
if [ -f build-gpu/build.ninja ] && grep -q "comm_nccl_gpu_test" build-gpu/build.ninja; then
  targets+=(comm_nccl_test comm_nccl_gpu_test)
fi
if [ -f build-gpu/build.ninja ] && step build-cuda 360 cmake --build build-gpu -j "$(nproc)" --target "${targets[@]}"; then
  # Only the built tests: -L gpu (NcclComm, CudaServerKernel on the device), and the CUDA tests without
  # the label (on a GPU machine they run; without one they check that create() says why).
  step ctest-cuda 180 ctest --test-dir build-gpu --output-on-failure -R "^(NcclComm|Cuda|Shapes/Cuda|Cudnn)" -E "NOT_BUILT|Np2" --timeout 120
  # cuDNN with exactly as many sequence slots as tasks (no empty slots): tells a failure of the
  # bucketed batch's empty slots apart from one of the kernel itself.
  step ctest-cudnn-exact 60 env DISTCA_CUDNN_GRAPH=exact-batch ctest --test-dir build-gpu --output-on-failure \
    -R "cudnn|Cudnn" --timeout 60
  # The sm_90a backward with dQ in a pass of its own instead of atomic adds (DISTCA_HOPPER_DQ=pass).
  step ctest-hopper-dq-pass 60 env DISTCA_HOPPER_DQ=pass ctest --test-dir build-gpu --output-on-failure \
    -R "hopper" --timeout 60
  if command -v compute-sanitizer >/dev/null 2>&1; then
    step memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 1 build-gpu/src/tools/distca bench attention \
      --device cuda --docs 300,1000 --shard-doc 1000 --shards 64,128 --heads 8 --kv-heads 2 --repeats 1 --json
  else
    echo "== gpu-check: memcheck skipped: compute-sanitizer is not on the device's PATH"
  fi
  mkdir -p "$out/profiles"
  device_slug=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
  step bench-cuda 150 build-gpu/src/tools/distca bench attention --device cuda --json \
    --profile-out "$out/profiles/$device_slug.json"
  [ -f "$out/profiles/$device_slug.json" ] &&
    step simulate-paper 60 build-gpu/src/tools/distca simulate --paper --profile "$out/profiles/$device_slug.json"
  rm -rf "$pkg"
  if ls build-gpu/python/_distca*.so >/dev/null 2>&1; then
    mkdir -p "$pkg" && cp -r python/distca "$pkg/" && cp build-gpu/python/_distca*.so "$pkg/distca/" &&
      echo "== gpu-check: the package staged in $pkg"
  fi
fi
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}"
if [ -f "$pkg/distca/__init__.py" ]; then
  step torch-cuda 150 "$python" python/tests/gpu/check_torch_cuda.py --require-distca --json "$out/torch-cuda.json"
  # The whole multi-rank path on the one GPU: 2 and 4 processes, kernels on CUDA, the exchange over gloo
  # through host memory (StepPlanner host_staging), against whole-document attention.
  step torch-multirank 150 "$python" python/tests/gpu/check_torch_multirank.py --json "$out/torch-multirank.json"
  # distca's CUDA kernels beside PyTorch's (varlen, SDPA flash and cuDNN) on the same shapes, one process and run.
  step cuda-attention 200 "$python" python/bench/bench_cuda_attention.py --tokens 8192,16384,32768,65536 \
    --shards 128,1024 --repeats 5 --json "$out/cuda-attention.json"
  # cuDNN's backward runs at half of PyTorch's cuDNN SDPA with GQA 4:1 (2026-11-27): the same
  # shapes with as many K/V heads as query heads tell whether GQA is the cause.
  step cuda-attention-mha 60 "$python" python/bench/bench_cuda_attention.py --tokens 16384,32768 --shards 1024 \
    --kv-heads 32 --plan-ranks 0 --repeats 5 --backends distca,cudnn,sdpa-cudnn --json "$out/cuda-attention-mha.json"
  # cuDNN's backward behind our interface runs at half of PyTorch's cuDNN SDPA (2026-11-27), through
  # the same cuDNN. Our graph differs from PyTorch's in its bottom-right causal mask, its workspace
  # bound (set_max_total_seq_len), its bucketed batch and its ragged offsets with a padding mask
  # (dense: none, on one-sequence calls; with top-left and head-major-lse, PyTorch's graph): each
  # variant (DISTCA_CUDNN_GRAPH, same results) timed beside SDPA on a whole document and on the
  # plan's server list, one process each.
  for variant in default top-left no-max-total exact-batch dense dense,top-left dense,top-left,head-major-lse; do
    graph=$([ "$variant" = default ] && echo "" || echo "$variant")
    step "cudnn-variant-${variant//,/+}" 45 env DISTCA_CUDNN_GRAPH="$graph" "$python" python/bench/bench_cuda_attention.py \
      --tokens 16384 --shards 1024 --repeats 3 --backends distca,cudnn,sdpa-cudnn \
      --json "$out/cudnn-variant-${variant//,/+}.json"
  done
  # D 64 (issue 53 asks for 0.85x cuDNN SDPA both ways there): whole documents and 128-token shards.
  step cuda-attention-d64 120 "$python" python/bench/bench_cuda_attention.py --head-dim 64 --tokens 16384,65536 \
    --shards 128 --plan-ranks 0 --repeats 5 --backends distca,hopper,cudnn,sdpa-cudnn,varlen \
    --json "$out/cuda-attention-d64.json"
  # The sm_90a backward's dQ: atomic adds from the K/V blocks (the cuda-attention step's hopper rows)
  # against a pass of its own, on the same shapes.
  step cuda-attention-hopper-dq-pass 120 env DISTCA_HOPPER_DQ=pass "$python" python/bench/bench_cuda_attention.py \
    --tokens 16384,65536 --shards 128 --repeats 5 --backends distca,hopper,sdpa-cudnn \
    --json "$out/cuda-attention-hopper-dq-pass.json"
  # The measured kernel table `auto` uses on this device (commit it as
  # python/distca/torch/kernel_tables/<device>.json once the rows are trusted).
  [ -f "$out/cuda-attention.json" ] && step kernel-table 30 "$python" -m distca.torch.kernel_table \
    "$out/cuda-attention.json" --out "$out/kernel-table.json"
  # The sm_90a kernels under compute-sanitizer on a small case (memcheck, racecheck), forward and
  # backward: a 300-token document in shards of 77 rows sharing its K/V.
  if command -v compute-sanitizer >/dev/null 2>&1; then
    for tool in memcheck racecheck; do
      step "$tool-hopper" 90 compute-sanitizer --tool "$tool" --error-exitcode 1 --target-processes all \
        "$python" python/bench/hopper_profile_case.py --tokens 300 --shard 77 --head-dim 64 --runs 1
    done
  fi
  # A short profile of the sm_90a forward and backward (issue 53): tensor-core use, memory
  # throughput, stalls; the second run's two launches (the kernels are hopper_kernel<FwdPass<..>>
  # and hopper_kernel<BwdPass<..>>, matched on their demangled names).
  if command -v ncu >/dev/null 2>&1; then
    step ncu-hopper 90 ncu --target-processes all --kernel-name-base demangled \
      --kernel-name "regex:hopper_kernel<.*(Fwd|Bwd)Pass" --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats \
      "$python" python/bench/hopper_profile_case.py --tokens 16384
  else
    echo "== gpu-check: ncu-hopper skipped: ncu is not on the device's PATH"
  fi
  step torch-kernels 90 "$python" python/bench/bench_torch_kernels.py --device cuda --tokens 16384 \
    --heads 32 --kv-heads 8 --head-dim 128 --repeats 5 --json "$out/torch-kernels.json"
  # The trainer on one GPU (CAD with one rank is the plain path: every task served locally), both
  # backends compared step by step: tokens/s and the loss curve.
  step train-cuda 120 "$python" -m distca.torch.train --device cuda --preset demo --compare --steps 12 \
    --skip 2 --json "$out/train-cuda.json"
  # The framework adapters' GPU checks, where the device has the frameworks (it cannot fetch them).
  if "$python" -c "import megatron.core" >/dev/null 2>&1; then
    step megatron-cuda 90 "$python" python/tests/megatron_cases.py --device cuda --json "$out/megatron-cuda.json"
  else
    echo "== gpu-check: megatron-cuda skipped: megatron-core is not installed on the device"
  fi
  if "$python" -c "import torchtitan" >/dev/null 2>&1; then
    step torchtitan-cuda 90 "$python" python/tests/torchtitan_cases.py --reference flex
  else
    echo "== gpu-check: torchtitan-cuda skipped: torchtitan is not installed on the device"
  fi
else
  echo "== gpu-check: the Python steps skipped: the module _distca was not built"
  status=1
fi
"$python" - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
steps = [dict(zip(("name", "rc", "seconds"), line.split())) for line in (out / "steps.txt").read_text().splitlines()]
report = {"format": "distca-gpu-check", "version": 2, "device": (out / "device.txt").read_text().strip(), "steps": steps}


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
    text = bench_log.read_text()
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
(out / "report.json").write_text(json.dumps(report, indent=1))
lines = [f"# distca GPU check", "", f"device: {report['device']}", "", "| step | exit | seconds |", "|---|---|---|"]
lines += [f"| {s['name']} | {s['rc']} | {s['seconds']} |" for s in steps]
for name, title in (("probe", "what the device offers"), ("configure-cuda", "configure"), ("build-cuda", "the CUDA build"),
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
                    ("torch-multirank", "distca.torch on 2 and 4 processes sharing the GPU (check_torch_multirank.py)"), ("torch-kernels", "server kernels (bench_torch_kernels)"),
                    ("train-cuda", "the trainer on one GPU (python -m distca.torch.train --device cuda)"),
                    ("megatron-cuda", "Megatron Core adapter"), ("torchtitan-cuda", "TorchTitan adapter")):
    log = out / f"{name}.log"
    if log.exists():
        lines += ["", f"## {title}", "", "```", log.read_text().rstrip(), "```"]
for log in sorted(out.glob("cudnn-variant-*.log")):
    lines += ["", f"## cuDNN graph variant {log.stem.removeprefix('cudnn-variant-')} (DISTCA_CUDNN_GRAPH)", "", "```",
              log.read_text().rstrip(), "```"]
(out / "report.md").write_text("\n".join(lines) + "\n")
PY
echo "gpu-check: $([ $status -eq 0 ] && echo ok || echo FAILED): report in $out/report.md"
exit $status
