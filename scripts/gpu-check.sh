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
# writes report.json and report.md into the folder given (scripts/gpu_report.py, from steps.txt and
# the steps' outputs). Without a GPU it prints "no GPU: skipped" and exits 0. CI does not run it.
#
# Everything runs inside one time budget (GPU_CHECK_SECONDS, default 540: a device call's 10 minutes
# less the transfers): each step gets what is left, at most its own limit, and a step with under 15 s
# left is recorded as skipped ("out of time"), so the report is always written. GPU_CHECK_STEPS
# names the steps to run (e.g. "torch-cuda memcheck"; the probe, configure and build always run).
#
# GPU_CHECK_PRESET=cudnn-speed (issue 78) is one prepared device call of at most 420 s instead (the
# budget is 420 unless GPU_CHECK_SECONDS is smaller; not with GPU_CHECK_STEPS): the build, the sm_90a
# kernels' tests and memcheck, cuDNN's backward over the graph variants with cuDNN's logs and the
# kernels' names, the autotuned engines (timed, then read from their cache file), the sm_90a kernels
# timed beside cuDNN and varlen with dQ both ways, and the kernel table: `plan` below, with each
# step's limit. GPU_CHECK_LIST=1 prints the steps a run would take, one name a line in run order, and
# exits 0 without a GPU and without running anything (OUT_DIR may then be left out).
#
# usage: scripts/gpu-check.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
refuse() { echo "gpu-check: $*" >&2; exit 2; }
list="${GPU_CHECK_LIST:-}"
case "$list" in ''|0|1) ;; *) refuse "GPU_CHECK_LIST must be 1 (print the steps and exit) or 0, not '$list'" ;; esac
if [ $# -gt 1 ] || { [ $# -eq 0 ] && [ "$list" != 1 ]; } || [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  echo "usage: scripts/gpu-check.sh OUT_DIR   (writes report.json, report.md and the logs there; GPU_CHECK_SECONDS: the budget, default 540; GPU_CHECK_STEPS: these steps only; GPU_CHECK_PRESET=cudnn-speed: issue 78's 420 s call; GPU_CHECK_LIST=1: print the steps and exit)" >&2
  [ $# -eq 1 ] && exit 0 || exit 2
fi
out="${1:-}"
if [ -e "$out" ] && [ ! -d "$out" ]; then
  refuse "$out exists and is not a folder"
fi
budget="${GPU_CHECK_SECONDS:-540}"
case "$budget" in ''|*[!0-9]*) refuse "GPU_CHECK_SECONDS must be a whole number of seconds, not '$budget'" ;; esac
budget=$((10#$budget))   # leading zeros are not octal in the arithmetic below
only="${GPU_CHECK_STEPS:-}"   # e.g. "torch-cuda bench-cuda": just these (and the probe, configure and build)
preset="${GPU_CHECK_PRESET:-}"
case "$preset" in
  '') ;;
  cudnn-speed)
    [ -z "$only" ] || refuse "GPU_CHECK_PRESET and GPU_CHECK_STEPS together: the preset runs its own steps; set one of them"
    if [ -z "${GPU_CHECK_SECONDS:-}" ] || [ "$budget" -gt 420 ]; then budget=420; fi ;;
  *) refuse "GPU_CHECK_PRESET must be cudnn-speed (the one preset) or unset, not '$preset'" ;;
esac

# The cuDNN graph variants (DISTCA_CUDNN_GRAPH), a step each: cudnn-variant-<variant, commas as +>.
variants=(default top-left no-max-total exact-batch dense dense,top-left dense,top-left,head-major-lse)
variant_steps=("${variants[@]//,/+}")
variant_steps=("${variant_steps[@]/#/cudnn-variant-}")
# The steps in run order, NAME:LIMIT (seconds); run_step below says what each runs and needs.
if [ "$preset" = cudnn-speed ]; then
  # Issue 78's one device call. The limits sum to the preset's 420 s; the times measured on the
  # H100 are in reports/gpu/2026-11-25-h100 and 2026-11-27-h100-cudnn-speed.
  plan=(
    probe:15                      # 6-10 s measured
    configure-cuda:15             # 5-9 s
    build-cuda:90                 # 33 s, 73 s once cuDNN was in
    ctest-cuda:15                 # the sm_90a kernels' GPU cases only (all 59 CUDA tests took 10 s)
    ctest-hopper-dq-pass:15       # the same cases with dQ in its own pass
    memcheck-hopper:25            # a 300-token document in 77-row shards sharing its K/V
    "${variant_steps[@]/%/:20}"   # 7 x 20 s: one process each, 3 backends on the preset's shapes
    cudnn-autotune:25             # the same bench with every engine of a graph timed (0.5 s a graph at most)
    cudnn-autotune-cached:20      # the same again, the engines read from the first one's cache file
    cuda-attention:25             # the sm_90a kernels, dQ by atomic adds, beside cudnn, sdpa-cudnn and varlen
    cuda-attention-hopper-dq-pass:20  # the sm_90a kernels with dQ in its own pass, beside sdpa-cudnn
    kernel-table:15               # 6 s measured
  )   # 15 + 15 + 90 + 15 + 15 + 25 + 7 x 20 + 25 + 20 + 25 + 20 + 15 = 420
else
  plan=(probe:60 configure-cuda:120 build-cuda:360
        ctest-cuda:180 ctest-cudnn-exact:60 ctest-hopper-dq-pass:60 memcheck:120 bench-cuda:150 simulate-paper:60
        torch-cuda:150 torch-multirank:150 cuda-attention:200 cuda-attention-mha:60 "${variant_steps[@]/%/:45}"
        cudnn-pool-release:45
        cuda-attention-d64:120 cuda-attention-hopper-dq-pass:120 kernel-table:30 memcheck-hopper:90
        racecheck-hopper:90 ncu-hopper:90 torch-kernels:90 train-cuda:120 megatron-cuda:90 torchtitan-cuda:90)
fi
asked() {  # asked NAME: whether this run takes step NAME ("cudnn-variants" in GPU_CHECK_STEPS: every cudnn-variant-*)
  [ -z "$only" ] && return 0
  case " probe configure-cuda build-cuda $only " in *" $1 "*) return 0 ;; esac
  [[ $1 == cudnn-variant-* && " $only " == *" cudnn-variants "* ]]
}
if [ "$list" = 1 ]; then
  for entry in "${plan[@]}"; do
    asked "${entry%:*}" && echo "${entry%:*}"
  done
  exit 0
fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no GPU: skipped"
  exit 0
fi
mkdir -p "$out"
python="${PYTHON:-python3}"
status=0
step() {  # step NAME LIMIT COMMAND...: runs it within min(LIMIT, what is left), logs to $out/NAME.log
  local name="$1" limit="$2"; shift 2
  if ! asked "$name"; then
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
device_slug=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}"

# What a step needs besides its turn: the build (the C++ steps), the package staged from it (the
# Python steps; when it is missing that is said once and the check fails, the Python steps being
# part of it), a tool on the device's PATH.
built=0
said_no_package=0
needs_build() { [ "$built" -eq 1 ]; }
needs_package() {
  [ -f "$pkg/distca/__init__.py" ] && return 0
  if [ "$said_no_package" -eq 0 ]; then
    echo "== gpu-check: the Python steps skipped: the module _distca was not built"
    said_no_package=1 status=1
  fi
  return 1
}
needs_tool() {  # needs_tool STEP TOOL
  command -v "$2" >/dev/null 2>&1 && return 0
  echo "== gpu-check: $1 skipped: $2 is not on the device's PATH"
  return 1
}
# The preset's runs of bench_cuda_attention.py: whole documents of 16K and 64K tokens and the plan's
# server list (the plan case, on by default). The bench always times a shard layout too; its shards
# are the correctness check's own 2048-token document in 128-row shards, whose graphs the check has
# built already, so they cost little. No warm-up: each pass has run once (outputs(), then the
# retained graph's backward()) before the timed calls.
preset_bench=(--tokens 16384,65536 --check-tokens 2048 --shard-doc 2048 --shards 128 --repeats 3 --warmup 0)

run_step() {  # run_step NAME LIMIT: step NAME's command, where what it needs is there
  local name="$1" limit="$2"
  case "$name" in
    probe) step probe "$limit" bash -c 'probe; probe_cudnn' ;;
    configure-cuda)
      step configure-cuda "$limit" cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DDISTCA_WITH_CUDA=ON \
        -DDISTCA_CUDA_ARCHS="$archs" -DDISTCA_BUILD_BENCH=OFF -DDISTCA_BUILD_TESTS=ON "${python_defs[@]}" "${nccl_defs[@]}" \
        "${cudnn_defs[@]}"
      if [ -f build-gpu/build.ninja ] && grep -q "comm_nccl_gpu_test" build-gpu/build.ninja; then
        targets+=(comm_nccl_test comm_nccl_gpu_test)
      fi ;;
    build-cuda)
      rm -rf "$pkg"   # the Python steps never import a module of an earlier build
      [ -f build-gpu/build.ninja ] || return 0
      step build-cuda "$limit" cmake --build build-gpu -j "$(nproc)" --target "${targets[@]}" || return 0
      built=1
      if ls build-gpu/python/_distca*.so >/dev/null 2>&1; then
        mkdir -p "$pkg" && cp -r python/distca "$pkg/" && cp build-gpu/python/_distca*.so "$pkg/distca/" &&
          echo "== gpu-check: the package staged in $pkg"
      fi ;;
    ctest-cuda)
      needs_build || return 0
      # Only the built tests: -L gpu (NcclComm, CudaServerKernel on the device), and the CUDA tests without
      # the label (on a GPU machine they run; without one they check that create() says why). The
      # preset: the sm_90a kernel's cases of CudaServerKernelVsCpu (.../hopper_<shape>_<dtype>).
      local filter="^(NcclComm|Cuda|Shapes/Cuda|Cudnn)"
      [ -n "$preset" ] && filter="hopper"
      step ctest-cuda "$limit" ctest --test-dir build-gpu --output-on-failure -R "$filter" -E "NOT_BUILT|Np2" --timeout 120 ;;
    ctest-cudnn-exact)
      needs_build || return 0
      # cuDNN with exactly as many sequence slots as tasks (no empty slots): tells a failure of the
      # bucketed batch's empty slots apart from one of the kernel itself.
      step ctest-cudnn-exact "$limit" env DISTCA_CUDNN_GRAPH=exact-batch ctest --test-dir build-gpu --output-on-failure \
        -R "cudnn|Cudnn" --timeout 60 ;;
    ctest-hopper-dq-pass)
      needs_build || return 0
      # The sm_90a backward with dQ in a pass of its own instead of atomic adds (DISTCA_HOPPER_DQ=pass).
      step ctest-hopper-dq-pass "$limit" env DISTCA_HOPPER_DQ=pass ctest --test-dir build-gpu --output-on-failure \
        -R "hopper" --timeout 60 ;;
    memcheck)
      needs_build && needs_tool memcheck compute-sanitizer || return 0
      step memcheck "$limit" compute-sanitizer --tool memcheck --error-exitcode 1 build-gpu/src/tools/distca bench attention \
        --device cuda --docs 300,1000 --shard-doc 1000 --shards 64,128 --heads 8 --kv-heads 2 --repeats 1 --json ;;
    bench-cuda)
      needs_build || return 0
      mkdir -p "$out/profiles"
      step bench-cuda "$limit" build-gpu/src/tools/distca bench attention --device cuda --json \
        --profile-out "$out/profiles/$device_slug.json" ;;
    simulate-paper)
      needs_build && [ -f "$out/profiles/$device_slug.json" ] || return 0
      step simulate-paper "$limit" build-gpu/src/tools/distca simulate --paper --profile "$out/profiles/$device_slug.json" ;;
    torch-cuda)
      needs_package || return 0
      step torch-cuda "$limit" "$python" python/tests/gpu/check_torch_cuda.py --require-distca --json "$out/torch-cuda.json" ;;
    torch-multirank)
      needs_package || return 0
      # The whole multi-rank path on the one GPU: 2 and 4 processes, kernels on CUDA, the exchange over gloo
      # through host memory (StepPlanner host_staging), against whole-document attention.
      step torch-multirank "$limit" "$python" python/tests/gpu/check_torch_multirank.py --json "$out/torch-multirank.json" ;;
    cuda-attention)
      needs_package || return 0
      if [ -n "$preset" ]; then
        # The sm_90a kernels with dQ by atomic adds (the default) beside cuDNN's (ours and SDPA's)
        # and varlen: the kernel table's input, and cuda-attention-hopper-dq-pass's counterpart.
        step cuda-attention "$limit" env DISTCA_HOPPER_DQ=atomic "$python" python/bench/bench_cuda_attention.py \
          "${preset_bench[@]}" --backends distca,hopper,cudnn,sdpa-cudnn,varlen --json "$out/cuda-attention.json"
      else
        # distca's CUDA kernels beside PyTorch's (varlen, SDPA flash and cuDNN) on the same shapes, one process and run.
        step cuda-attention "$limit" "$python" python/bench/bench_cuda_attention.py --tokens 8192,16384,32768,65536 \
          --shards 128,1024 --repeats 5 --json "$out/cuda-attention.json"
      fi ;;
    cuda-attention-mha)
      needs_package || return 0
      # cuDNN's backward runs at half of PyTorch's cuDNN SDPA with GQA 4:1 (2026-11-27): the same
      # shapes with as many K/V heads as query heads tell whether GQA is the cause.
      step cuda-attention-mha "$limit" "$python" python/bench/bench_cuda_attention.py --tokens 16384,32768 --shards 1024 \
        --kv-heads 32 --plan-ranks 0 --repeats 5 --backends distca,cudnn,sdpa-cudnn --json "$out/cuda-attention-mha.json" ;;
    cudnn-variant-*)
      needs_package || return 0
      # cuDNN's backward behind our interface runs at half of PyTorch's cuDNN SDPA (2026-11-27), through
      # the same cuDNN. Our graph differs from PyTorch's in its bottom-right causal mask, its workspace
      # bound (set_max_total_seq_len), its bucketed batch and its ragged offsets with a padding mask
      # (dense: none, on one-sequence calls; with top-left and head-major-lse, PyTorch's graph): each
      # variant (DISTCA_CUDNN_GRAPH, same results) timed beside SDPA on a whole document and on the
      # plan's server list, one process each.
      local variant="${name#cudnn-variant-}"
      variant="${variant//+/,}"
      [ "$variant" = default ] && variant=""
      if [ -n "$preset" ]; then
        # With cuDNN's own account of each graph: the frontend's info log (graphs, heuristics, plans)
        # and the backend's warnings and errors (its info level would log every call's parameters,
        # the timed calls' too), and the kernels' names from torch.profiler beside SDPA-cuDNN's. Two
        # copies of the frontend write the log, ours in _distca and PyTorch's, each opening the file
        # by name, so at one path each would overwrite the other; through a pipe (a process
        # substitution, read into the file) their lines follow one another. The backend log goes the
        # same way, for a device where our cuDNN and PyTorch's are two libraries.
        mkdir -p "$out/cudnn-logs"
        step "$name" "$limit" env DISTCA_CUDNN_GRAPH="$variant" CUDNN_FRONTEND_LOG_INFO=1 \
          CUDNN_FRONTEND_LOG_FILE=>(cat >"$out/cudnn-logs/$name.frontend.log") CUDNN_LOGLEVEL_DBG=2 \
          CUDNN_LOGDEST_DBG=>(cat >"$out/cudnn-logs/$name.backend.log") "$python" python/bench/bench_cuda_attention.py \
          "${preset_bench[@]}" --backends distca,cudnn,sdpa-cudnn --kernel-names --json "$out/$name.json"
      else
        step "$name" "$limit" env DISTCA_CUDNN_GRAPH="$variant" "$python" python/bench/bench_cuda_attention.py \
          --tokens 16384 --shards 1024 --repeats 3 --backends distca,cudnn,sdpa-cudnn --json "$out/$name.json"
      fi ;;
    cudnn-pool-release)
      needs_package || return 0
      # The stream-ordered pool returning its memory to the driver at every synchronisation (CUDA's
      # default, DISTCA_CUDA_POOL_KEEP_MIB=0) against keeping it (distca's default): the same bench
      # as cudnn-variant-default, so the two JSONs' cudnn rows compare directly.
      step cudnn-pool-release "$limit" env DISTCA_CUDA_POOL_KEEP_MIB=0 "$python" python/bench/bench_cuda_attention.py \
        --tokens 16384 --shards 1024 --repeats 3 --backends distca,cudnn,sdpa-cudnn --json "$out/cudnn-pool-release.json" ;;
    cudnn-autotune|cudnn-autotune-cached)
      needs_package || return 0
      # cuDNN's heuristics' first engine is what runs unless the engines are timed: with
      # DISTCA_CUDNN_AUTOTUNE=1 each graph's are, on its first use, and the fastest is kept in the
      # cache file (the bench's cudnn_graphs names the engines). The second step reads that file
      # instead of timing again: the chosen engines' speed without the tuning, and a check that the
      # file is read back; without the file it would tune afresh, so it does not run. The default
      # graphs and the variants' shapes and backends, so both compare with cudnn-variant-default.
      if [ "$name" = cudnn-autotune-cached ] && [ ! -f "$out/cudnn-engines.json" ]; then
        echo "== gpu-check: cudnn-autotune-cached skipped: cudnn-autotune wrote no $out/cudnn-engines.json"
        return 0
      fi
      step "$name" "$limit" env DISTCA_CUDNN_GRAPH= DISTCA_CUDNN_AUTOTUNE=1 DISTCA_CUDNN_ENGINE_CACHE="$out/cudnn-engines.json" \
        "$python" python/bench/bench_cuda_attention.py "${preset_bench[@]}" --backends distca,cudnn,sdpa-cudnn \
        --kernel-names --json "$out/$name.json" ;;
    cuda-attention-d64)
      needs_package || return 0
      # D 64 (issue 53 asks for 0.85x cuDNN SDPA both ways there): whole documents and 128-token shards.
      step cuda-attention-d64 "$limit" "$python" python/bench/bench_cuda_attention.py --head-dim 64 --tokens 16384,65536 \
        --shards 128 --plan-ranks 0 --repeats 5 --backends distca,hopper,cudnn,sdpa-cudnn,varlen \
        --json "$out/cuda-attention-d64.json" ;;
    cuda-attention-hopper-dq-pass)
      needs_package || return 0
      # The sm_90a backward's dQ: atomic adds from the K/V blocks (the cuda-attention step's hopper rows)
      # against a pass of its own, on the same shapes.
      if [ -n "$preset" ]; then
        step cuda-attention-hopper-dq-pass "$limit" env DISTCA_HOPPER_DQ=pass "$python" python/bench/bench_cuda_attention.py \
          "${preset_bench[@]}" --backends distca,hopper,sdpa-cudnn --json "$out/cuda-attention-hopper-dq-pass.json"
      else
        step cuda-attention-hopper-dq-pass "$limit" env DISTCA_HOPPER_DQ=pass "$python" python/bench/bench_cuda_attention.py \
          --tokens 16384,65536 --shards 128 --repeats 5 --backends distca,hopper,sdpa-cudnn \
          --json "$out/cuda-attention-hopper-dq-pass.json"
      fi ;;
    kernel-table)
      # The measured kernel table `auto` uses on this device (commit it as
      # python/distca/torch/kernel_tables/<device>.json once the rows are trusted).
      needs_package && [ -f "$out/cuda-attention.json" ] || return 0
      step kernel-table "$limit" "$python" -m distca.torch.kernel_table "$out/cuda-attention.json" --out "$out/kernel-table.json" ;;
    memcheck-hopper|racecheck-hopper)
      # The sm_90a kernels under compute-sanitizer on a small case (memcheck, racecheck), forward and
      # backward: a 300-token document in shards of 77 rows sharing its K/V.
      needs_package && needs_tool "$name" compute-sanitizer || return 0
      step "$name" "$limit" compute-sanitizer --tool "${name%-hopper}" --error-exitcode 1 --target-processes all \
        "$python" python/bench/hopper_profile_case.py --tokens 300 --shard 77 --head-dim 64 --runs 1 ;;
    ncu-hopper)
      # A short profile of the sm_90a forward and backward (issue 53): tensor-core use, memory
      # throughput, stalls; the second run's two launches (the kernels are hopper_kernel<FwdPass<..>>
      # and hopper_kernel<BwdPass<..>>, matched on their demangled names).
      needs_package && needs_tool ncu-hopper ncu || return 0
      step ncu-hopper "$limit" ncu --target-processes all --kernel-name-base demangled \
        --kernel-name "regex:hopper_kernel<.*(Fwd|Bwd)Pass" --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        "$python" python/bench/hopper_profile_case.py --tokens 16384 ;;
    torch-kernels)
      needs_package || return 0
      step torch-kernels "$limit" "$python" python/bench/bench_torch_kernels.py --device cuda --tokens 16384 \
        --heads 32 --kv-heads 8 --head-dim 128 --repeats 5 --json "$out/torch-kernels.json" ;;
    train-cuda)
      needs_package || return 0
      # The trainer on one GPU (CAD with one rank is the plain path: every task served locally), both
      # backends compared step by step: tokens/s and the loss curve.
      step train-cuda "$limit" "$python" -m distca.torch.train --device cuda --preset demo --compare --steps 12 \
        --skip 2 --json "$out/train-cuda.json" ;;
    megatron-cuda|torchtitan-cuda)
      # The framework adapters' GPU checks, where the device has the frameworks (it cannot fetch them).
      needs_package || return 0
      if [ "$name" = megatron-cuda ]; then
        if "$python" -c "import megatron.core" >/dev/null 2>&1; then
          step megatron-cuda "$limit" "$python" python/tests/megatron_cases.py --device cuda --json "$out/megatron-cuda.json"
        else
          echo "== gpu-check: megatron-cuda skipped: megatron-core is not installed on the device"
        fi
      elif "$python" -c "import torchtitan" >/dev/null 2>&1; then
        step torchtitan-cuda "$limit" "$python" python/tests/torchtitan_cases.py --reference flex
      else
        echo "== gpu-check: torchtitan-cuda skipped: torchtitan is not installed on the device"
      fi ;;
    *) echo "gpu-check: the plan names a step run_step does not know: $name" >&2; status=1 ;;
  esac
}
for entry in "${plan[@]}"; do
  run_step "${entry%:*}" "${entry##*:}"
done
"$python" scripts/gpu_report.py "$out" ${preset:+--preset "$preset"} || { echo "gpu-check: the report was not written"; status=1; }
echo "gpu-check: $([ $status -eq 0 ] && echo ok || echo FAILED): report in $out/report.md"
exit $status
