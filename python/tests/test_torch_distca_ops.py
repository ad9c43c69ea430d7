"""distca.torch.kernels.ops: distca's attention kernels as the custom operators distca::attention_fwd and
distca::attention_bwd. On CPU: torch.library.opcheck (schema, fake tensors, autograd registration,
AOT dispatch with dynamic shapes), the fake (meta) implementations' shapes and checks, autograd
through attention_fwd against `reference`, torch.compile with fullgraph=True equal to eager. The
CUDA path without a GPU: every reason it cannot run is precise (not built / no device / dtype /
head dim / compute capability / architecture), the native CudaAttention raises instead of
crashing, and the CUDA-only argument checks refuse bad input before any device is touched. Its
numbers are checked on a GPU by python/tests/gpu/check_torch_cuda.py."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from distca import _distca  # noqa: E402
from distca.torch.kernels import ops  # noqa: E402
from distca.torch.kernels.backends import get_backend  # noqa: E402
from distca.torch.kernels.native import DistcaKernel  # noqa: E402
from distca.torch.kernels.pytorch import ReferenceKernel  # noqa: E402
from test_torch_distca_kernel import CAUSAL, NONCAUSAL, inputs, rel, server_tasks  # noqa: E402

TOLERANCE = 1e-5


def sample(hq=4, hkv=2, d=32, dtype=torch.float32, seed=0):
    """A server's tasks (causal, bottom-right, non-causal, one-row) and inputs for them, with the
    task tensor the operators take."""
    tasks = server_tasks(CAUSAL, NONCAUSAL)
    q, k, v, do = inputs(tasks, hq, hkv, d, dtype, seed)
    return tasks, ops.task_tensor(DistcaKernel.task_array(tasks)), q, k, v, do


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_forward_and_backward(dtype):
    _, t, q, k, v, do = sample(dtype=dtype)
    fwd_args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), t, 0.2, 1)
    for name, result in torch.library.opcheck(torch.ops.distca.attention_fwd.default, fwd_args).items():
        assert result == "SUCCESS", (name, result)
    with torch.no_grad():
        o, lse = torch.ops.distca.attention_fwd(q, k, v, t, 0.2, 1)
    bwd_args = (do, q.detach(), k.detach(), v.detach(), o, lse, t, 0.2, 1)
    for name, result in torch.library.opcheck(torch.ops.distca.attention_bwd.default, bwd_args).items():
        assert result == "SUCCESS", (name, result)


def test_the_operators_equal_the_backend_and_autograd_equals_reference():
    tasks, t, q, k, v, do = sample(hq=8, hkv=2, d=64, seed=4)
    scale = 0.125
    want_o, want_lse = ReferenceKernel().forward(q, k, v, tasks, scale)
    o, lse = torch.ops.distca.attention_fwd(q, k, v, t, scale)
    b_o, b_lse = DistcaKernel().forward(q, k, v, tasks, scale)
    assert torch.equal(o, b_o) and torch.equal(lse, b_lse)
    assert rel(o, want_o) <= TOLERANCE and rel(lse, want_lse) <= TOLERANCE
    # Autograd through attention_fwd: q, k, v get the reference's gradients; lse carries none.
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = ops.attention_fwd(*leaves, t, scale)
    assert o.requires_grad and not lse.requires_grad
    o.backward(do)
    want = ReferenceKernel().backward(do, q, k, v, want_o, want_lse, tasks, scale)
    for name, x, w in zip(("dq", "dk", "dv"), leaves, want):
        assert x.grad.dtype == x.dtype and rel(x.grad, w) <= TOLERANCE, (name, rel(x.grad, w))
    dq, dk, dv = torch.ops.distca.attention_bwd(do, q, k, v, o.detach(), lse, t, scale)
    assert dq.dtype == q.dtype and dk.dtype == dv.dtype == torch.float32
    assert torch.equal(dq, leaves[0].grad) and torch.equal(dk, leaves[1].grad)


def test_fake_implementations_give_shapes_and_check_inputs():
    meta = torch.device("meta")
    q, do = (torch.empty(300, 8, 128, dtype=torch.bfloat16, device=meta) for _ in range(2))
    k, v = (torch.empty(500, 2, 128, dtype=torch.bfloat16, device=meta) for _ in range(2))
    t = torch.empty(7, 5, dtype=torch.int64, device=meta)
    o, lse = torch.ops.distca.attention_fwd(q, k, v, t, None)
    assert o.device == meta and o.shape == q.shape and o.dtype == torch.bfloat16
    assert lse.shape == (300, 8) and lse.dtype == torch.float32
    dq, dk, dv = torch.ops.distca.attention_bwd(do, q, k, v, o, lse, t, None)
    assert dq.shape == q.shape and dq.dtype == torch.bfloat16
    assert dk.shape == dv.shape == k.shape and dk.dtype == dv.dtype == torch.float32
    # The fake implementations refuse what the real ones would.
    with pytest.raises(ValueError, match="head dim 96 is not one"):
        torch.ops.distca.attention_fwd(*(x[..., :96] for x in (q, k, v)), t, None)
    with pytest.raises(ValueError, match="not a multiple of 3"):
        torch.ops.distca.attention_fwd(q, torch.empty(500, 3, 128, dtype=torch.bfloat16, device=meta), v, t, None)
    with pytest.raises(ValueError, match=r"lse has shape \(300, 4\), expected \(300, 8\)"):
        torch.ops.distca.attention_bwd(do, q, k, v, o, lse[:, :4], t, None)
    with pytest.raises(ValueError, match=r"tasks must be an \(n, 5\) int64 tensor"):
        torch.ops.distca.attention_fwd(q, k, v, t[:, :4], None)


def test_torch_compile_fullgraph_equals_eager():
    """The operators trace into one graph (no break) and run what eager runs, gradients included."""
    import torch._dynamo
    tasks, t, q, k, v, do = sample(hq=4, hkv=1, d=64, seed=9)

    def step(q, k, v):
        o, lse = torch.ops.distca.attention_fwd(q, k, v, t, 0.125)
        return (o * do).sum() + lse.sum().detach()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (step, compiled):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        loss = fn(*leaves)
        loss.backward()
        grads.append([loss.detach()] + [x.grad for x in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_task_tensor_checks():
    _, t, q, k, v, _ = sample()
    cases = [(t.int(), r"int64 tensor .* got torch.int32"), (t[:, :4], r"\(n, 5\)"), (t.T.contiguous().T, "not contiguous"),
             (t.numpy().tolist(), "must be an .n, 5. int64 CPU tensor, got list")]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            ops.check_inputs(q, k, v, bad)
    with pytest.raises(ValueError, match="overlap in Q rows"):   # the C++ side's own checks
        torch.ops.distca.attention_fwd(q, k, v, torch.tensor([[0, 20, 0, 20, 1], [10, 20, 0, 30, 1]]), None)
    assert ops.task_tensor(DistcaKernel.task_array(server_tasks(CAUSAL, NONCAUSAL))).dtype == torch.int64


def test_pairs_and_flops_count_causal_triangles():
    t = torch.tensor([[0, 4, 0, 4, 1], [4, 2, 4, 5, 1], [6, 3, 9, 7, 0], [9, 0, 16, 3, 0]])
    # square causal 4: 10 pairs; bottom-right 2 x 5: 4 + 5; non-causal 3 x 7: 21; an empty query range: 0.
    assert ops.pairs(t) == 10 + 9 + 21
    fwd, bwd = ops.flops(t, num_q_heads=8, head_dim=64)
    assert fwd == 4 * 64 * 8 * 40 and bwd == 2.5 * fwd


# --- The CUDA path, without a GPU. ---

def test_cuda_kernels_build_is_reported():
    built, archs = _distca.cuda_kernels_built(), _distca.cuda_kernels_archs()
    assert isinstance(built, bool)
    assert (archs != "") == built, (built, archs)
    if built:   # CMake's entries, e.g. "80-real,90a-real": each one ops understands
        entries = [a for a in archs.replace(";", ",").split(",") if a]
        assert all(any(ops._arch_runs(a, major, minor) for major, minor in ((8, 0), (8, 6), (9, 0), (10, 0)))
                   for a in entries), archs


@pytest.mark.parametrize("entry,capability,runs", [
    ("80-real", (8, 0), True), ("80-real", (8, 6), True), ("80-real", (8, 9), True), ("80-real", (9, 0), False),
    ("80-real", (7, 5), False), ("86-real", (8, 0), False), ("90a-real", (9, 0), True), ("90a-real", (10, 0), False),
    ("90-real", (9, 0), True), ("80-virtual", (10, 0), True), ("80-virtual", (7, 5), False), ("80", (12, 0), True),
    ("sm_80", (8, 6), True), ("compute_90", (10, 0), True), ("compute_90", (8, 0), False), ("banana", (9, 0), False),
])
def test_arch_entries_run_where_cuda_runs_them(entry, capability, runs):
    assert ops._arch_runs(entry, *capability) is runs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers of a machine without a CUDA device")
def test_cuda_unavailable_says_why_without_a_device():
    from distca.torch import BackendUnavailable
    cuda = torch.device("cuda")
    if _distca.cuda_kernels_built():
        want = "no CUDA device is visible to torch"
        # The native object refuses with the C++ Status, never a crash.
        with pytest.raises((ValueError, RuntimeError), match="no CUDA device"):
            _distca.CudaAttention()
        with pytest.raises((ValueError, RuntimeError), match="no CUDA device"):
            _distca.CudaAttention(0)
    else:
        want = "this build of distca has no CUDA kernels"
        with pytest.raises(ValueError, match="has no CUDA kernels"):
            _distca.CudaAttention()
    with pytest.raises(ValueError, match="device -2 is not a CUDA device index"):
        _distca.CudaAttention(-2)
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(BackendUnavailable, match=want):
            get_backend("distca", cuda, dtype)
    with pytest.raises(BackendUnavailable, match="take bfloat16 or float16 on cuda, not torch.float32"):
        get_backend("distca", cuda, torch.float32)
    # auto on CUDA: distca after PyTorch's FlashAttention-2 kernels, before sdpa (as an H100 measured them).
    order = __import__("distca.torch.kernels.backends", fromlist=["_AUTO_ORDER"])._AUTO_ORDER["cuda"]
    assert order.index("varlen") < order.index("distca") < order.index("sdpa")


def test_cuda_reasons_for_a_device(monkeypatch):
    """The reasons a present device can still not run the kernels, from a faked device query."""
    import distca.torch.kernels.ops as ops_module
    if not _distca.cuda_kernels_built():
        pytest.skip("this build has no CUDA kernels: the device reasons come after that one")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Fake GPU")
    capability = [(7, 5)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability[0])
    assert "compute capability 7.5; distca's CUDA kernels need 8.0 or newer" in ops_module.unavailable(cuda, torch.bfloat16)
    capability[0] = (12, 0)
    why = ops_module.unavailable(cuda, torch.float16)
    assert "no code for Fake GPU (sm_120)" in why and "DISTCA_CUDA_ARCHS" in why, why
    assert "there is no CUDA device 3 (torch sees 1)" in ops_module.unavailable(torch.device("cuda", 3), torch.bfloat16)
    # A device the archs cover gets as far as the native object, whose own reason is passed on.
    capability[0] = (9, 0)
    why = ops_module.unavailable(cuda, torch.bfloat16)
    assert why is not None and "no CUDA device" in why, why


def test_cuda_only_checks_refuse_before_any_device_is_touched():
    """What the CUDA operators refuse from metadata alone, on meta tensors laid out as on CUDA."""
    meta = torch.device("meta")
    t = torch.zeros(1, 5, dtype=torch.int64)
    q = torch.empty(8, 4, 64, dtype=torch.float16)
    k = torch.empty(8, 1, 64, dtype=torch.float16)
    # float16 is a CUDA dtype: on CPU it is refused with the device's list.
    with pytest.raises(ValueError, match="q is torch.float16; the kernels take float32 or bfloat16 on cpu"):
        ops.check_inputs(q, k, k, t)
    with pytest.raises(ValueError, match="tasks is on meta; the task list is host memory"):
        ops.check_inputs(q.bfloat16(), k.bfloat16(), k.bfloat16(), t.to(meta))
    with pytest.raises(ValueError, match="q is on meta; the kernels run on cpu and cuda"):
        ops.check_inputs(q.to(meta), k.to(meta), k.to(meta), t)
    with pytest.raises(ValueError, match="k is on meta, q on cpu"):
        ops.check_inputs(q.bfloat16(), k.bfloat16().to(meta), k.bfloat16(), t)
    # Head dims: 32 runs on CPU, not on CUDA (64 and 128 only).
    assert DistcaKernel.head_dims(torch.device("cuda")) == (64, 128)
    assert 32 in DistcaKernel.head_dims(torch.device("cpu"))
    np.testing.assert_array_equal(DistcaKernel.task_array(server_tasks([(3, 5)], [])), [[0, 3, 0, 5, 1]])
