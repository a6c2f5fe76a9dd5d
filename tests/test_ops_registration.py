"""The ``torch.ops.tilefuse`` operators (``tilefuse._ops.kernel_op``): each is defined with a CUDA kernel and
a fake, its schema is the one ``torch.library.custom_op`` would infer, and the decorator refuses what it does
not support. (Their results under ``torch.compile`` and CUDA graphs are GPU-tier tests of each op.)"""
import pytest
import torch

import tilefuse.engram  # noqa: F401  (registers the ops)
import tilefuse.mhc  # noqa: F401
import tilefuse.moe  # noqa: F401
import tilefuse.quant  # noqa: F401
import tilefuse.transform  # noqa: F401
import tilefuse.transpose  # noqa: F401
from tilefuse import _ops
from tilefuse.quant import _per_token_cast_kernel as K


def _tilefuse_ops() -> list[str]:
    return sorted({s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith("tilefuse::")})


def test_every_op_has_cuda_and_fake_kernels():
    from torch._library.simple_registry import singleton

    ops = _tilefuse_ops()
    assert len(ops) == 69, ops  # quant and transpose 21, moe 15, transform 1, mhc 22 (sinkhorn 2, post 3,
    # mixes 5, expand 2, apply_mix 2, normw 2, reduce_norm 2, norm_fn 2, recompute 1, pre_mixes 1), engram 10 (hash 1, sinkhorn
    # helpers 4, gate forward 2, fused weight 1, gate backward 1, grad_w_reduce 1)
    for name in ops:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), name
        assert singleton.find(name).fake_impl.kernel is not None, name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"), name


def test_schema_is_the_inferred_one():
    schema = torch.ops.tilefuse.per_token_cast.default._schema
    assert str(schema) == "tilefuse::per_token_cast" + torch.library.infer_schema(
        K._per_token_cast_op.__wrapped__, mutates_args=())
    mutating = torch.ops.tilefuse.per_token_cast_and_cast_back.default._schema
    assert [a.name for a in mutating.arguments if a.is_write] == ["x"]


def test_fake_kernel_gives_output_metadata():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.empty(5, 7168, dtype=torch.bfloat16))
        out, sf = torch.ops.tilefuse.per_token_cast(x, None, "e4m3", 128, None, True, True, True)
    assert out.shape == (5, 7168) and out.dtype == torch.float8_e4m3fn
    assert sf.shape == (5, 14) and sf.stride() == (1, 8) and sf.dtype == torch.int32


def test_cpu_tensors_are_refused():
    with pytest.raises(NotImplementedError, match="CPU"):
        torch.ops.tilefuse.batched_transpose(torch.zeros(1, 64, 64))


def test_decorator_refuses_other_namespaces_and_devices():
    with pytest.raises(ValueError, match="tilefuse::<name>"):
        _ops.kernel_op("other::x", mutates_args=())
    with pytest.raises(ValueError, match="cuda only"):
        _ops.kernel_op("tilefuse::x", mutates_args=(), device_types="cpu")
