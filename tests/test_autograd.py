"""The public ops' autograd entry (``tilefuse._autograd``): ``Function.apply`` where autograd records the call, the
forward alone elsewhere, with the same outputs."""
import pytest
import torch

from tilefuse import _autograd, mhc
from tilefuse.mhc import _functions as F
from tilefuse.modeling import engram as engram_layer


class _Double(torch.autograd.Function):
    contexts = []

    @staticmethod
    def forward(ctx, x, scale):
        _Double.contexts.append(type(ctx).__name__)
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * (2 * scale)

    @staticmethod
    def backward(ctx, grad):
        return grad * (2 * ctx.scale), None


@pytest.mark.parametrize("requires_grad, grad_mode, recorded", [(False, True, False), (True, True, True),
                                                                 (True, False, False)])
def test_apply_records_only_where_autograd_would(requires_grad, grad_mode, recorded):
    _Double.contexts.clear()
    x = torch.arange(4.0, requires_grad=requires_grad)
    with torch.set_grad_enabled(grad_mode):
        y = _autograd.apply(_Double, x, 3.0)
    assert torch.equal(y.detach(), torch.arange(4.0) * 6)
    assert _autograd.records(x, 3.0) == (requires_grad and torch.is_grad_enabled())
    assert y.requires_grad == recorded and (_Double.contexts[0] == "_NoContext") != recorded
    if recorded:
        y.sum().backward()
        assert torch.equal(x.grad, torch.full((4,), 6.0))


def _mhc_calls(requires_grad: bool) -> dict:
    """``{op: (fn, args)}``: one small CPU call of each mHC public op behind an autograd Function, its tensor inputs
    requiring grad or not (the same values either way)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32, positive=False):
        x = torch.randn(*shape, generator=g)
        return (x.sigmoid() if positive else x).to(dtype).requires_grad_(requires_grad)

    n, c = 4, 64
    m = n * (n + 2)
    bf = torch.bfloat16
    return {
        "expand_to_mhc": (lambda h: mhc.expand_to_mhc(h, n), (t(2, 3, c, dtype=bf),)),
        "mhc_pre_norm_fn": (lambda r, f, w: mhc.mhc_pre_norm_fn(r, f, w, 1e-6),
                            (t(2, 3, n, c, dtype=bf), t(m, n * c), t(n * c))),
        "mhc_pre_split_mixes": (lambda a, s, b: mhc.mhc_pre_split_mixes(a, s, b, n, 2.0, 1e-2), (t(2, 3, m), t(3), t(m))),
        "sinkhorn_normalize": (lambda x: mhc.sinkhorn_normalize(x, 5, 1e-6), (t(2, 3, n, n),)),
        "mhc_pre_apply_mix": (mhc.mhc_pre_apply_mix, (t(2, 3, n, c, dtype=bf), t(2, 3, n, 1, positive=True))),
        "mhc_post": (mhc.mhc_post, (t(2, 3, c, dtype=bf), t(2, 3, n, c, dtype=bf), t(2, 3, n, 1), t(2, 3, n, n))),
        "mhc_head_compute_mix": (lambda a, s, b: mhc.mhc_head_compute_mix(a, s, b, 1e-2), (t(2, 3, n), t(1), t(n))),
    }


def _call(op: str, requires_grad: bool, compile_: bool = False) -> list:
    fn, args = _mhc_calls(requires_grad)[op]
    if compile_:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="eager")
    return _outputs(fn(*args))


def _outputs(result) -> list:
    return [o.detach() for o in (result if isinstance(result, tuple) else (result,))]


@pytest.mark.parametrize("op", list(_mhc_calls(False)))
def test_mhc_ops_without_autograd_skip_the_function_with_the_same_outputs(op, monkeypatch):
    """Inputs that require no grad (or grad mode off) take the Function's forward alone: Function.apply is never
    called, and the outputs are the recorded call's bits."""
    recorded = _call(op, True)
    for name in dir(F):
        if name.endswith("Fn"):
            monkeypatch.setattr(getattr(F, name), "apply", None)  # calling it would raise
    assert all(torch.equal(a, b) for a, b in zip(_call(op, False), recorded, strict=True))
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(_call(op, True), recorded, strict=True))


def test_engram_gate_without_autograd_matches_the_recorded_output(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x, k = (torch.randn(2, 3, 4, 512, generator=g).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(2, 3, 512, generator=g).to(torch.bfloat16)
    wh, we = (torch.randn(4, 512, generator=g).to(torch.bfloat16) for _ in range(2))
    leaves = [t.clone().requires_grad_(True) for t in (x, k, v, wh, we)]
    recorded = engram_layer.engram_gate(*leaves, 1e-6, 1e-20)
    assert recorded.requires_grad
    monkeypatch.setattr(engram_layer.EngramGateFn, "apply", None)
    assert torch.equal(engram_layer.engram_gate(x, k, v, wh, we, 1e-6, 1e-20), recorded.detach())
    with torch.no_grad():
        assert torch.equal(engram_layer.engram_gate(*leaves, 1e-6, 1e-20), recorded.detach())


@pytest.mark.parametrize("op", list(_mhc_calls(False)))
def test_the_no_record_path_compiles_as_one_graph(op):
    """Dynamo traces the forward-alone path as one graph (backend "eager": no codegen) and gives the eager bits."""
    got = _call(op, False, compile_=True)
    assert all(torch.equal(a, b) for a, b in zip(got, _call(op, False), strict=True))
