"""distca.torch's `distca` backend: distca's CPU attention kernels (src/kernels, cpu.h) through the
native module. cad_attention with it on 2 gloo ranks against whole-document float64 attention
(every policy, ping-pong on and off, both backward modes, key-split rows); the kernel alone
against `reference` on hand-made server tasks (causal, non-causal, bottom-right, GQA 4:1, D 64
and 128, fp32 and bf16); bad inputs refused with a message; 1 and 2 threads bit-identical."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from distca.torch.spawn import run_ranks  # noqa: E402
from sizes import soak  # noqa: E402
from test_torch_cad import POLICIES, _max_rel, _run_layer  # noqa: E402
from torch_cases import (  # noqa: E402
    COST_MODEL, HKV, HQ, doc_data, local_rows, random_batch, sdpa_whole_documents, whole_document)

NUM_BATCHES = soak(20, 40)   # random batches (the quick ones are the soak's first: the same seeds)
TOLERANCE = 1e-5
MATRIX_D = 32   # the smallest head dim the kernels are built for (torch_cases' D = 16 is not one)


def distca_matrix_worker(rank, world, num_batches, seed):
    """test_torch_cad's matrix with backend `distca` (and `reference` beside it, on the same plans)."""
    from distca.torch import StepPlanner
    model = {"heads": HQ, "kv_heads": HKV, "head_dim": MATRIX_D}
    planners = {(policy, pingpong, backward): StepPlanner(
        model=model, cost_model=COST_MODEL, policy=policy, granularity=16 if policy in ("minmax", "minbytes") else None,
        pingpong=pingpong, backward=backward, state_budget=None, backend="distca")   # stateful: every call keeps its state
        for policy in POLICIES for pingpong in (False, True) for backward in ("stateful", "stateless")}
    rng = np.random.default_rng(seed)
    worst: dict = {}
    counts = {"cases": 0, "merged_entries": 0, "noncausal_tasks": 0, "pingpong_split": 0, "multi_layer": 0}
    for b in range(num_batches):
        lengths, ranks = random_batch(rng, world, spanning=b % 2 == 1)
        data = doc_data(lengths, seed * 100003 + b, head_dim=MATRIX_D)
        refs = [whole_document(*d) for d in data]
        pieces = ranks[rank]
        want = [local_rows([r[i] for r in refs], pieces) for i in range(4)]
        backward = "stateless" if b % 3 == 2 else "stateful"
        for policy in POLICIES:
            layouts = {pp: planners[policy, pp, backward].plan(pieces=pieces) for pp in (False, True)}
            stats = torch.tensor([sum(p.merge_entries.numel() for p in layouts[False].parts),
                                  sum(p.tasks.groups[1].num_tasks for p in layouts[False].parts)])
            dist.all_reduce(stats)
            counts["merged_entries"] += int(stats[0])
            counts["noncausal_tasks"] += int(stats[1])
            counts["pingpong_split"] += int(layouts[True].is_pingpong)
            reference = _run_layer(layouts[False], data, pieces, "reference")
            for pingpong in (False, True):
                got = _run_layer(layouts[pingpong], data, pieces, "distca")
                for key, base in ((f"distca{'+pingpong' if pingpong else ''}", want),
                                  (f"distca{'+pingpong' if pingpong else ''} vs reference", [x.double() for x in reference])):
                    errors = _max_rel(list(zip(got, base)))
                    worst[key] = [max(a, e) for a, e in zip(worst.get(key, [0.0] * 4), errors)]
                counts["cases"] += 1
            if b % 10 == 0 and policy == "minbytes":
                # One layout serves several layers (the kernel's task array is cached on it).
                data2 = doc_data(lengths, seed * 100003 + b + 7777, head_dim=MATRIX_D)
                want2 = [local_rows([whole_document(*d)[i] for d in data2], pieces) for i in range(4)]
                errors = _max_rel(list(zip(_run_layer(layouts[True], data2, pieces, "distca"), want2)))
                worst["distca second layer"] = [max(a, e) for a, e in zip(worst.get("distca second layer", [0.0] * 4),
                                                                          errors)]
                counts["multi_layer"] += 1
    return {"worst": worst, "counts": counts}


def test_cad_attention_with_the_distca_backend_equals_whole_document_attention():
    results = run_ranks(distca_matrix_worker, 2, NUM_BATCHES, 29, timeout=600)
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    counts, worst = results[0]["result"]["counts"], results[0]["result"]["worst"]
    print(f"\n2 ranks, distca backend: {counts}\nworst relative error (O, dQ, dK, dV): {worst}")
    assert counts["cases"] == NUM_BATCHES * len(POLICIES) * 2
    for key, errs in worst.items():
        assert max(errs) <= TOLERANCE, f"{key}: {errs}"
    assert counts["merged_entries"] > 0, "no plan split a row's keys: the merged-O/LSE backward went untested"
    assert counts["noncausal_tasks"] > 0, counts
    assert counts["pingpong_split"] >= NUM_BATCHES * len(POLICIES) // 2, counts
    assert counts["multi_layer"] == NUM_BATCHES // 10


def distca_bf16_worker(rank, world, num_batches, seed):
    """bf16 CAD with the distca backend against float64 truth, beside bf16 whole-document SDPA."""
    from distca.torch import StepPlanner
    planner = StepPlanner(model={"heads": HQ, "kv_heads": HKV, "head_dim": MATRIX_D}, cost_model=COST_MODEL,
                          policy="minbytes", granularity=16, pingpong=True, backend="distca")
    rng = np.random.default_rng(seed)
    worst = []
    for b in range(num_batches):
        lengths, ranks = random_batch(rng, world, spanning=b % 2 == 1)
        data = doc_data(lengths, seed + b, torch.bfloat16, head_dim=MATRIX_D)
        pieces = ranks[rank]
        want = [local_rows([whole_document(*d)[i] for d in data], pieces) for i in range(4)]
        base = sdpa_whole_documents(data)
        base_local = [local_rows([r[i] for r in base], pieces) for i in range(4)]
        got = _run_layer(planner.plan(pieces=pieces), data, pieces, "distca", torch.bfloat16)
        worst.append({"cad": _max_rel(list(zip(got, want))), "baseline": _max_rel(list(zip(base_local, want)))})
    return worst


def test_bf16_cad_attention_within_the_bound_of_test_torch_cad():
    results = run_ranks(distca_bf16_worker, 2, 10, 5, timeout=300)
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    for case in results[0]["result"]:
        for name, cad, base in zip(("O", "dQ", "dK", "dV"), case["cad"], case["baseline"]):
            bound = 2 * base + 2 ** -8   # test_torch_cad.test_bf16_within_a_derived_bound's
            assert cad <= bound, f"{name}: {cad:.3g} > {bound:.3g} (baseline {base:.3g})"


# --- The kernel alone, on hand-made server tasks. ---

def server_tasks(causal, noncausal):
    """ServerTasks of (Lq, Lk) causal tasks then (Lq, Lk) non-causal ones, each with its own key rows."""
    from distca.torch.kernels.server import ServerTasks, TaskGroup
    groups, q_at, k_at = [], 0, 0
    for is_causal, shapes in ((True, causal), (False, noncausal)):
        cu_q = np.concatenate([[0], np.cumsum([s[0] for s in shapes], dtype=np.int64)]).astype(np.int64)
        cu_k = np.concatenate([[0], np.cumsum([s[1] for s in shapes], dtype=np.int64)]).astype(np.int64)
        groups.append(TaskGroup(is_causal, q_at, k_at, cu_q, cu_k, max([s[0] for s in shapes], default=0),
                                max([s[1] for s in shapes], default=0)))
        q_at, k_at = q_at + int(cu_q[-1]), k_at + int(cu_k[-1])
    return ServerTasks((groups[0], groups[1]), q_at, k_at, torch.device("cpu"))


# Square and bottom-right causal tasks (a shard with its key prefix, single rows, several blocks),
# non-causal key pieces (a row's earlier keys, as key-split plans hand them out).
CAUSAL = [(64, 64), (37, 200), (1, 1), (1, 90), (130, 207), (300, 300)]
NONCAUSAL = [(50, 300), (7, 3), (129, 64)]


def inputs(tasks, hq, hkv, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(tasks.num_q, hq, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(tasks.num_k, hkv, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, do


def rel(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("hq,hkv", [(4, 1), (8, 2)])
@pytest.mark.parametrize("d", [64, 128])
def test_kernel_equals_reference_fp32(hq, hkv, d):
    from distca.torch.kernels.native import DistcaKernel
    from distca.torch.kernels.pytorch import ReferenceKernel
    tasks = server_tasks(CAUSAL, NONCAUSAL)
    q, k, v, do = inputs(tasks, hq, hkv, d)
    scale = d ** -0.5
    ref, kernel = ReferenceKernel(), DistcaKernel()
    want_o, want_lse = ref.forward(q, k, v, tasks, scale)
    o, lse = kernel.forward(q, k, v, tasks, scale)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32 and o.shape == q.shape and lse.shape == q.shape[:2]
    assert rel(o, want_o) <= TOLERANCE and rel(lse, want_lse) <= TOLERANCE
    # The backward on a merged O and LSE other than the kernel's own (a key-split row's): exact too.
    other_lse = want_lse + torch.rand(want_lse.shape) - 0.5
    merged_lse = torch.logaddexp(want_lse, other_lse)
    merged_o = torch.exp(want_lse - merged_lse)[..., None] * want_o + \
        torch.exp(other_lse - merged_lse)[..., None] * torch.randn(q.shape)
    for o_in, lse_in in ((want_o, want_lse), (merged_o, merged_lse)):
        want = ref.backward(do, q, k, v, o_in, lse_in, tasks, scale)
        got = kernel.backward(do, q, k, v, o_in, lse_in, tasks, scale)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert g.shape == w.shape and g.dtype == (torch.float32), name
            assert rel(g, w) <= TOLERANCE, (name, rel(g, w))
    assert rel(o, want_o) <= TOLERANCE


@pytest.mark.parametrize("d", [64, 128])
def test_kernel_bf16_within_a_derived_bound(d):
    """bf16 against fp32 truth on the same (bf16) inputs, beside `reference` run in bf16. Both read
    the same rounded inputs and accumulate in fp32; outputs stored in bf16 round once more (at most
    2^-9 of the largest value, one half ulp), and the kernel also stores dK/dV in bf16 where the
    reference keeps them fp32: so allow the reference's error plus one bf16 ulp (2^-8)."""
    from distca.torch.kernels.native import DistcaKernel
    from distca.torch.kernels.pytorch import ReferenceKernel
    tasks = server_tasks(CAUSAL, NONCAUSAL)
    q, k, v, do = inputs(tasks, 8, 2, d, torch.bfloat16, seed=3)
    scale = d ** -0.5
    ref, kernel = ReferenceKernel(), DistcaKernel()
    truth_o, truth_lse = ref.forward(*(x.float() for x in (q, k, v)), tasks, scale)
    base_o, _ = ref.forward(q, k, v, tasks, scale)
    o, lse = kernel.forward(q, k, v, tasks, scale)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rel(o, truth_o) <= rel(base_o, truth_o) + 2 ** -8
    assert rel(lse, truth_lse) <= 1e-5
    truth = ref.backward(do.float(), q.float(), k.float(), v.float(), o.float(), lse, tasks, scale)
    base = ref.backward(do, q, k, v, o, lse, tasks, scale)
    got = kernel.backward(do, q, k, v, o, lse, tasks, scale)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == got[2].dtype == torch.float32
    for name, g, b, t in zip(("dq", "dk", "dv"), got, base, truth):
        bound = rel(b, t) + 2 ** -8
        assert rel(g, t) <= bound, (name, rel(g, t), bound)


def test_bf16_storage_is_torch_bfloat16():
    """One query seeing one key returns V itself: bf16 values come back bit for bit, so
    torch.bfloat16 and distca::bf16 are the same bit pattern (the top half of an IEEE float)."""
    from distca.torch.kernels.native import DistcaKernel
    tasks = server_tasks([(1, 1)] * 5, [(1, 1)] * 3)
    q, k, v, _ = inputs(tasks, 4, 1, 32, torch.bfloat16)
    v = (v * torch.tensor([1e-30, 1e30, -3.0, 0.1]).repeat(8).to(torch.bfloat16)).contiguous()
    o, lse = DistcaKernel().forward(q, k, v, tasks, 0.1)
    assert torch.equal(o.view(torch.int16), v.expand(-1, 4, -1).contiguous().view(torch.int16))
    want_lse = (q.float() * k.float()).sum(-1) * 0.1
    assert rel(lse, want_lse) <= 1e-6


def test_threads_give_identical_results_and_objects_are_shared():
    from distca.torch.kernels.backends import get_backend
    from distca.torch.kernels.native import DistcaKernel
    tasks = server_tasks(CAUSAL, NONCAUSAL)
    q, k, v, do = inputs(tasks, 8, 2, 64, seed=5)
    runs = []
    for threads in (1, 2):
        kernel = DistcaKernel(num_threads=threads)
        assert kernel.native().num_threads == threads and kernel.native() is DistcaKernel(threads).native()
        o, lse = kernel.forward(q, k, v, tasks, 0.125)
        runs.append((o, lse) + tuple(kernel.backward(do, q, k, v, o, lse, tasks, 0.125)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    # get_backend's kernel follows torch's thread count.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert get_backend("distca", torch.device("cpu"), torch.float32).native().num_threads == 2
    finally:
        torch.set_num_threads(before)
    # The task array is built once per ServerTasks.
    assert DistcaKernel.task_array(tasks) is DistcaKernel.task_array(tasks)
    assert DistcaKernel.task_array(tasks).shape == (len(CAUSAL) + len(NONCAUSAL), 5)


def test_empty_server():
    from distca.torch.kernels.native import DistcaKernel
    tasks = server_tasks([], [])
    q, k, v, do = inputs(tasks, 4, 1, 64)
    o, lse = DistcaKernel().forward(q, k, v, tasks, 0.125)
    dq, dk, dv = DistcaKernel().backward(do, q, k, v, o, lse, tasks, 0.125)
    assert o.shape == (0, 4, 64) and lse.shape == (0, 4) and dq.shape == (0, 4, 64) and dk.shape == (0, 1, 64)


def test_unavailable_says_why():
    from distca.torch import BackendUnavailable, backend_names, get_backend
    assert "distca" in backend_names()
    with pytest.raises(BackendUnavailable, match="take bfloat16 or float16 on cuda, not torch.float32"):
        get_backend("distca", torch.device("cuda"), torch.float32)
    with pytest.raises(BackendUnavailable, match="run on cpu and cuda, not meta"):
        get_backend("distca", torch.device("meta"), torch.float32)
    with pytest.raises(BackendUnavailable, match="take float32 or bfloat16 on cpu, not torch.float64"):
        get_backend("distca", torch.device("cpu"), torch.float64)
    with pytest.raises(BackendUnavailable, match="built for head dims 32, 64, 128, 256 on cpu, not 16"):
        get_backend("distca", torch.device("cpu"), torch.float32, head_dim=16)
    # The CUDA path's reasons are tested in test_torch_distca_ops.py.


def test_hopper_backend_is_named_says_why_it_cannot_run_here_and_is_not_in_autos_default_order():
    from distca.torch import BackendUnavailable, backend_names, get_backend, kernel_table
    from distca.torch.kernels import backends
    assert "hopper" in backend_names()
    with pytest.raises(BackendUnavailable, match="compute capability 9.0, not cpu"):
        get_backend("hopper", torch.device("cpu"), torch.bfloat16)
    # Not yet run on a GPU: auto's default order never names it; only a kernel table measured on a
    # device, where its bench checks passed, can (test_kernel_table.py).
    assert all("hopper" not in order for order in backends._AUTO_ORDER.values())
    assert "hopper" in kernel_table.TABLE_BACKENDS


def test_cudnn_backend_says_why_it_cannot_run_and_refuses_unknown_kernels():
    from distca import _distca
    from distca.torch import BackendUnavailable, backend_names, get_backend
    from distca.torch.kernels import ops
    assert "cudnn" in backend_names()
    with pytest.raises(BackendUnavailable, match="the cudnn backend runs on CUDA devices, not cpu"):
        get_backend("cudnn", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="unknown CUDA kernel 'flash': expected distca, cudnn or hopper"):
        _distca.CudaAttention(0, "flash")
    with pytest.raises(ValueError, match="kernel must be one of distca, cudnn, hopper"):
        ops.cuda_native(0, "flash")
    assert isinstance(_distca.cudnn_built(), bool)
    assert bool(_distca.cudnn_version()) == _distca.cudnn_built()


def test_native_module_exports_nothing_of_its_static_libraries():
    """_distca shares a process with PyTorch, whose libraries carry their own cudnn-frontend: an
    exported instantiation of a frontend type binds one version's calls to the other's code (a crash
    in cuDNN graph validation on an H100). The module exports PyInit and no frontend symbol."""
    import shutil
    import subprocess
    from distca import _distca
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", "-C", _distca.__file__], capture_output=True, text=True,
                         check=True).stdout
    assert "PyInit__distca" in out
    leaked = [line for line in out.splitlines() if "cudnn_frontend" in line]
    assert not leaked, leaked[:5]


def _force_fast_build(monkeypatch):
    from distca import _distca
    fast = [isa for isa in _distca.cpu_isas_supported() if isa in ("avx512", "avx2")]
    if not fast:
        pytest.skip("this CPU runs neither the avx512 nor the avx2 build")
    monkeypatch.setenv("DISTCA_CPU_ISA", fast[-1])


def test_auto_picks_distca_on_cpu_where_it_is_built_for_the_head_dim(monkeypatch):
    """auto on CPU where the avx512 or avx2 build runs: distca for float32/bfloat16 and head dims
    32-256 (faster than sdpa there, python/bench/bench_cpu_kernels.py), else sdpa; without a head
    dim, distca with sdpa behind it for the head dims it is not built for, equal to sdpa bit for bit."""
    from distca.torch.kernels.backends import get_backend
    from distca.torch.kernels.native import DistcaKernel
    from distca.torch.kernels.pytorch import SdpaKernel
    _force_fast_build(monkeypatch)
    cpu = torch.device("cpu")
    assert get_backend("auto", cpu, torch.float32, head_dim=64).name == "distca"
    assert get_backend("auto", cpu, torch.bfloat16, head_dim=128).name == "distca"
    assert get_backend("auto", cpu, torch.float32, head_dim=16).name == "sdpa"
    assert get_backend("auto", cpu, torch.float16, head_dim=64).name == "sdpa"
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        get_backend("auto", cpu, torch.float32, head_dim=0)
    kernel = get_backend("auto", cpu, torch.float32)
    assert isinstance(kernel, DistcaKernel) and isinstance(kernel.fallback, SdpaKernel)
    tasks = server_tasks(CAUSAL, NONCAUSAL)
    q, k, v, do = inputs(tasks, 4, 2, 16)
    o, lse = kernel.forward(q, k, v, tasks, 0.25)
    want_o, want_lse = SdpaKernel().forward(q, k, v, tasks, 0.25)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    got = kernel.backward(do, q, k, v, o, lse, tasks, 0.25)
    want = SdpaKernel().backward(do, q, k, v, o, lse, tasks, 0.25)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # A head dim it is built for runs distca's own kernel (not sdpa's, whose rounding differs).
    q, k, v, do = inputs(tasks, 4, 2, 64)
    assert torch.equal(kernel.forward(q, k, v, tasks, 0.125)[0], DistcaKernel().forward(q, k, v, tasks, 0.125)[0])


def test_auto_picks_sdpa_where_only_the_portable_build_runs(monkeypatch):
    """The portable build (SSE2 on x86-64, NEON on aarch64) is slower than PyTorch's kernel: auto
    puts sdpa first there, and names distca only where asked."""
    from distca.torch.kernels.backends import get_backend
    from distca.torch.kernels.native import DistcaKernel
    from distca.torch.kernels.pytorch import SdpaKernel
    monkeypatch.setenv("DISTCA_CPU_ISA", "portable")
    cpu = torch.device("cpu")
    assert isinstance(get_backend("auto", cpu, torch.float32, head_dim=64), SdpaKernel)
    assert isinstance(get_backend("auto", cpu, torch.bfloat16), SdpaKernel)
    named = get_backend("distca", cpu, torch.float32, head_dim=64)
    assert isinstance(named, DistcaKernel) and named.native().isa == "portable"


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_every_build_the_cpu_runs_equals_reference(isa, monkeypatch):
    """DISTCA_CPU_ISA forces a build of the kernels; each one this CPU runs passes the fp32 and bf16
    checks above (GQA 4:1, D 64 and 128)."""
    from distca import _distca
    from distca.torch.kernels.native import DistcaKernel
    if isa not in _distca.cpu_isas_supported():
        pytest.skip(f"this CPU does not run the {isa} build (it runs {_distca.cpu_isas_supported()})")
    monkeypatch.setenv("DISTCA_CPU_ISA", isa)
    assert DistcaKernel().native().isa == isa
    for d in (64, 128):
        test_kernel_equals_reference_fp32(4, 1, d)
        test_kernel_bf16_within_a_derived_bound(d)


def test_a_build_the_cpu_cannot_run_is_refused_with_the_choices(monkeypatch):
    from distca import _distca
    from distca.torch.kernels.backends import get_backend
    from distca.torch.kernels.native import DistcaKernel
    monkeypatch.setenv("DISTCA_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="DISTCA_CPU_ISA=avx9000: no 'avx9000' build .* portable"):
        DistcaKernel().native()
    with pytest.raises(ValueError, match="DISTCA_CPU_ISA=avx9000"):
        get_backend("auto", torch.device("cpu"), torch.float32)
    monkeypatch.delenv("DISTCA_CPU_ISA")
    with pytest.raises(ValueError, match="no 'neon' build"):
        _distca.CpuAttention(1, "neon")
    assert _distca.cpu_isa() == _distca.cpu_isas_supported()[0]
    assert _distca.CpuAttention(1, "portable").isa == "portable"


def _bad_cases():
    """(what, call(kernel, tasks, q, k, v, do, o, lse), message) for inputs the kernel must refuse."""
    def fwd(**change):
        def call(kern, tasks, q, k, v, do, o, lse):
            x = dict(q=q, k=k, v=v)
            x.update({n: f(x[n]) for n, f in change.items()})
            return kern.forward(x["q"], x["k"], x["v"], tasks, 0.125)
        return call

    def bwd(**change):
        def call(kern, tasks, q, k, v, do, o, lse):
            x = dict(do=do, q=q, k=k, v=v, o=o, lse=lse)
            x.update({n: f(x[n]) for n, f in change.items()})
            return kern.backward(x["do"], x["q"], x["k"], x["v"], x["o"], x["lse"], tasks, 0.125)
        return call

    return [
        ("q not contiguous", fwd(q=lambda x: x.transpose(0, 1).contiguous().transpose(0, 1)), "q is not contiguous"),
        ("v not contiguous", fwd(v=lambda x: torch.cat([x, x], -1)[..., ::2]), "v is not contiguous"),
        ("do not contiguous", bwd(do=lambda x: torch.cat([x, x], 1)[:, ::2]), "do is not contiguous"),
        ("q float64", fwd(q=lambda x: x.double()), "q is torch.float64"),
        ("k bf16 with q fp32", fwd(k=lambda x: x.bfloat16()), "k is torch.bfloat16, expected torch.float32"),
        ("lse bf16", bwd(lse=lambda x: x.bfloat16()), "lse is torch.bfloat16, expected torch.float32"),
        ("q rows", fwd(q=lambda x: x[:-1].contiguous()), "the tasks address"),
        ("k rows", fwd(k=lambda x: x[:-1].contiguous()), "the tasks address"),
        ("v rows", fwd(v=lambda x: x[:-1].contiguous()), "v has shape"),
        ("v heads", fwd(v=lambda x: torch.cat([x, x], 1)), "v has shape"),
        ("o shape", bwd(o=lambda x: x[:, :2].contiguous()), "o has shape"),
        ("lse shape", bwd(lse=lambda x: x[:, :1].contiguous()), "lse has shape"),
        ("head dim 16", fwd(q=lambda x: x[..., :16].contiguous(), k=lambda x: x[..., :16].contiguous(),
                            v=lambda x: x[..., :16].contiguous()), "head dim 16 is not one"),
        ("head dims differ", fwd(k=lambda x: x[..., :32].contiguous()), "q has head dim 64, k 32"),
        ("gqa", fwd(k=lambda x: torch.cat([x] * 3, 1), v=lambda x: torch.cat([x] * 3, 1)), "not a multiple"),
        ("2-d q", fwd(q=lambda x: x.flatten(1)), "must be [rows, heads, D]"),
        ("meta k", fwd(k=lambda x: x.to("meta")), "k is on meta"),
        ("sparse v", fwd(v=lambda x: x.to_sparse()), "v has layout"),
        ("not a tensor", fwd(v=lambda x: x.numpy()), "v must be a torch.Tensor"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())), ids=[c[0] for c in _bad_cases()])
def test_bad_inputs_are_refused(case):
    from distca.torch.kernels.native import DistcaKernel
    what, call, message = _bad_cases()[case]
    tasks = server_tasks(CAUSAL, NONCAUSAL)
    q, k, v, do = inputs(tasks, 4, 2, 64)
    kernel = DistcaKernel()
    o, lse = kernel.forward(q, k, v, tasks, 0.125)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(kernel, tasks, q, k, v, do, o, lse)


def test_bad_tasks_and_addresses_are_refused_by_the_native_side():
    """Task arrays the C++ side checks (kernels::validate): ValueError, never a crash."""
    from distca import _distca
    from distca.torch.kernels.native import DistcaKernel
    kernel = DistcaKernel(num_threads=1)
    q, k, v, do = (torch.randn(40, 4, 32) for _ in range(4))
    k, v = k[:, :1].contiguous(), v[:, :1].contiguous()

    def tasks(*rows):
        return np.array(rows, dtype=np.int64).reshape(-1, 5)
    cases = [
        (tasks([0, 20, 0, 20, 1], [10, 20, 0, 30, 1]), "overlap in Q rows"),
        (tasks([0, 20, 30, 20, 1]), "exceed Tkv = 40"),
        (tasks([30, 20, 0, 20, 0]), "exceed Tq = 40"),
        (tasks([0, 20, 0, 10, 1]), "q_len <= kv_len"),
        (tasks([0, -1, 0, 10, 0]), "must be >= 0"),
        (tasks([0, 20, 0, 20, 2]), "is_causal must be 0 or 1"),
        (np.zeros((2, 4), np.int64), r"\(n, 5\)"),
    ]
    for array, message in cases:
        with pytest.raises(ValueError, match=message):
            kernel.forward_tasks(q, k, v, array, 0.1)
    o, lse = kernel.forward_tasks(q, k, v, tasks([0, 40, 0, 40, 1]), None)
    with pytest.raises(ValueError, match="overlap in Q rows"):
        kernel.backward_tasks(do, q, k, v, o, lse, tasks([0, 20, 0, 20, 1], [10, 20, 0, 30, 1]), 0.1)
    native = _distca.CpuAttention(1)
    good = tasks([0, 40, 0, 40, 1])
    with pytest.raises(ValueError, match="Q is null"):
        native.forward(0, k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), (40, 40, 4, 1, 32), good, None,
                       "float32")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), (40, 40, 4, 1, 32),
                       good, None, "float16")
    with pytest.raises(ValueError, match="not a multiple"):
        native.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), (40, 40, 4, 3, 32),
                       good, None, "float32")
    with pytest.raises(ValueError, match="num_threads"):
        _distca.CpuAttention(-1)
    with pytest.raises(ValueError, match="num_threads"):
        DistcaKernel(num_threads=0)
    assert native.isa in ("avx512", "avx2", "portable") and native.num_threads == 1
