"""What distca.torch says of a C++ kernel (its dtypes, head dims, whether this build has it) is the
C++ kernel registry's (src/kernels/include/distca/kernels/registry.h, through _distca.kernels()):
the constants match it, the answers follow it when it changes, and distca.torch's files do not
state those facts themselves."""
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from distca import _distca  # noqa: E402
from distca.torch.kernels import ops  # noqa: E402
from distca.torch.kernels.backends import get_backend  # noqa: E402
from distca.torch.kernels.native import CudnnKernel, DistcaKernel, HopperKernel  # noqa: E402
from distca.torch.kernels.server import BackendUnavailable  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU = torch.device("cpu")


def registry() -> dict:
    return {k["name"]: k for k in _distca.kernels()}


def test_the_registry_lists_every_cpp_kernel_with_its_facts():
    reg = registry()
    assert list(reg) == ["reference", "cpu", "gemm", "distca", "cudnn", "hopper"]
    for k in reg.values():
        assert k["device"] in ("cpu", "cuda")
        assert k["dtypes"] and all(d in TORCH_DTYPES for d in k["dtypes"])
        assert all(isinstance(d, int) and d > 0 for d in k["head_dims"])
        assert isinstance(k["built"], bool) and (k["not_built"] == "") == k["built"]
        assert k["summary"]
    assert reg["gemm"]["has_backward"] is False
    assert reg["distca"]["built"] == _distca.cuda_kernels_built()
    assert reg["cudnn"]["built"] == _distca.cudnn_built()


def test_distca_torch_constants_are_the_registry():
    reg = registry()
    assert ops.REGISTRY == reg
    assert ops.CUDA_KERNELS == tuple(n for n, k in reg.items() if k["device"] == "cuda")
    assert ops.DTYPES["cpu"] == tuple(TORCH_DTYPES[d] for d in reg["cpu"]["dtypes"])
    assert ops.HEAD_DIMS["cpu"] == reg["cpu"]["head_dims"]
    for name in ops.CUDA_KERNELS:   # one contract: CudaAttention's
        assert ops.DTYPES["cuda"] == tuple(TORCH_DTYPES[d] for d in reg[name]["dtypes"])
        assert ops.HEAD_DIMS["cuda"] == reg[name]["head_dims"]
    assert DistcaKernel.HEAD_DIMS == reg["cpu"]["head_dims"]
    assert DistcaKernel.CUDA_HEAD_DIMS == reg["distca"]["head_dims"]
    cuda = torch.device("cuda")
    for kernel in (DistcaKernel, CudnnKernel, HopperKernel):
        assert kernel.head_dims(CPU) == reg["cpu"]["head_dims"]
        assert kernel.head_dims(cuda) == reg[kernel.cuda_kernel]["head_dims"]
        assert kernel.not_built() == (None if reg[kernel.cuda_kernel]["built"] else reg[kernel.cuda_kernel]["not_built"])


def test_the_answers_follow_the_registry(monkeypatch):
    """A registry that said otherwise would change what distca.torch answers: the head dims a
    backend is chosen for and refused for, and whether a CUDA implementation is built."""
    changed = {name: dict(k) for name, k in ops.REGISTRY.items()}
    changed["cpu"]["head_dims"] = (64,)
    changed["cudnn"].update(built=False, not_built="no cuDNN here (a test's registry)")
    monkeypatch.setattr(ops, "REGISTRY", changed)
    assert DistcaKernel.head_dims(CPU) == (64,)
    assert get_backend("distca", CPU, torch.float32, head_dim=64).name == "distca"
    with pytest.raises(BackendUnavailable, match="built for head dims 64 on cpu, not 32"):
        get_backend("distca", CPU, torch.float32, head_dim=32)
    assert CudnnKernel.not_built() == "no cuDNN here (a test's registry)"
    assert CudnnKernel().unavailable(torch.device("cuda"), torch.bfloat16) is not None


@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_distca_backend_on_cpu_refuses_what_the_registry_refuses(head_dim, dtype):
    tasks = np.array([[0, 4, 0, 4, 1], [4, 3, 0, 7, 1]], np.int64)
    said = _distca.kernel_supports("cpu", tasks, (7, 7, 2, 1, head_dim), dtype)
    q = torch.randn(7, 2, head_dim).to(TORCH_DTYPES[dtype])
    k = torch.randn(7, 1, head_dim).to(TORCH_DTYPES[dtype])
    try:
        DistcaKernel(num_threads=1).forward_tasks(q, k, k.clone(), tasks, None)
        ran = None
    except ValueError as e:
        ran = str(e)
    assert (said is None) == (ran is None), (said, ran)


def test_kernel_supports_names_the_reason():
    tasks = np.array([[0, 4, 0, 4, 1]], np.int64)
    assert _distca.kernel_supports("reference", tasks, (4, 4, 1, 1, 48), "float32") is None
    assert "no backward" in _distca.kernel_supports("gemm", tasks, (4, 4, 1, 1, 64), "float32", backward=True)
    assert "head dims 32, 64, 128 and 256, got D = 48" in _distca.kernel_supports("cpu", tasks, (4, 4, 1, 1, 48), "float32")
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
        _distca.kernel_supports("flash", tasks, (4, 4, 1, 1, 64), "float32")
    with pytest.raises(ValueError, match="unknown dtype"):
        _distca.kernel_supports("cpu", tasks, (4, 4, 1, 1, 64), "float64")


def test_distca_torch_does_not_restate_the_cpp_kernels_facts():
    """The head-dim lists of the C++ kernels appear in no distca.torch file that chooses or checks
    them: they are the registry's."""
    root = Path(ops.__file__).resolve().parents[1]          # distca/torch
    lists = [", ".join(map(str, k["head_dims"])) for k in registry().values() if k["head_dims"]]
    for name in ("kernels/backends.py", "kernel_table.py", "kernels/native.py", "kernels/pytorch.py", "kernels/ops.py"):
        text = (root / name).read_text()
        for dims in lists:
            assert not re.search(r"\(" + re.escape(dims) + r"\)", text), f"{name} restates head dims ({dims})"
