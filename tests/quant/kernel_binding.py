"""Compile-tier helpers shared by the kernel test files: check a launcher's arguments against its kernel's
parameters without a GPU, and evaluate a kernel's integer/float expressions with C semantics on the CPU."""
from collections import namedtuple

import numpy as np

from tilefuse import _jit

Call = namedtuple("Call", "name cfg env")


def bind(func, args):
    """Assert that ``args`` fit the parameters of prim_func ``func``: tensors their buffers (dtype, rank, static
    dims and strides, one consistent value per symbolic dimension or stride), Python numbers its scalars;
    returns the symbol values."""
    import tvm

    env = {}

    def match(expr, got, what):
        if isinstance(expr, tvm.tirx.IntImm):
            assert int(expr) == got, what
        elif isinstance(expr, tvm.tirx.Var):
            assert env.setdefault(expr.name, got) == got, (what, env[expr.name])

    assert len(func.params) == len(args), (len(func.params), len(args))
    for param, t in zip(func.params, args):
        if param not in func.buffer_map:  # a scalar parameter takes a Python number of its kind
            want = float if str(param.dtype).startswith("float") else int
            assert type(t) is want, (param.name, param.dtype, type(t).__name__)
            continue
        buf = func.buffer_map[param]
        assert str(buf.dtype) == str(t.dtype).replace("torch.", ""), (buf.name, buf.dtype, t.dtype)
        assert len(buf.shape) == t.dim(), (buf.name, buf.shape, t.shape)
        for i, dim in enumerate(buf.shape):
            match(dim, t.size(i), (buf.name, "dim", i, t.shape))
        if buf.strides:
            for i, stride in enumerate(buf.strides):
                if t.size(i) > 1:  # a size-1 dimension's stride is never used
                    match(stride, t.stride(i), (buf.name, "stride", i, t.stride()))
        else:
            assert t.is_contiguous(), buf.name
    return env


def fake_jit(monkeypatch) -> list:
    """Replace ``_jit.get`` by a checker that binds each launch's arguments to the registered factory's
    prim_func (``bind``); returns the list of ``Call(name, cfg, env)`` it records."""
    calls = []

    def get(name, cfg):
        func = _jit._FACTORIES[name][0](*cfg)
        return lambda *args: calls.append(Call(name, cfg, bind(func, args)))

    monkeypatch.setattr(_jit, "get", get)
    return calls


def tir_eval(e, env):
    """numpy evaluation of a TIR expression with C integer semantics (wrapping, logical shifts on unsigned)."""
    t = type(e).__name__
    dt = str(e.dtype)
    npdt = np.bool_ if dt == "bool" else np.dtype(dt)
    ev = lambda x: tir_eval(x, env)
    if t == "IntImm":
        return np.array(e.value).astype(npdt)
    if t == "FloatImm":
        return np.array(e.value, dtype=npdt)
    if t == "Var":
        return env[e.name]
    if t == "Cast":
        return ev(e.value).astype(npdt)
    if t in ("Add", "Sub", "Mul", "Max", "Min", "EQ", "NE", "LT", "LE", "GT", "GE", "And", "Or",
             "FloorDiv", "FloorMod"):
        a, b = ev(e.a), ev(e.b)
        with np.errstate(over="ignore"):
            f = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Max": np.maximum, "Min": np.minimum,
                 "EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal, "GT": np.greater,
                 "GE": np.greater_equal, "And": np.logical_and, "Or": np.logical_or,
                 "FloorDiv": np.floor_divide, "FloorMod": np.mod}[t]
            return f(a, b).astype(npdt)
    if t == "Not":
        return np.logical_not(ev(e.a))
    if t == "Select":
        return np.where(ev(e.condition), ev(e.true_value), ev(e.false_value)).astype(npdt)
    if t == "Call":
        name = e.op.name.split(".")[-1]
        args = [ev(a) for a in e.args]
        if name == "if_then_else":
            return np.where(args[0], args[1], args[2]).astype(npdt)
        if name == "reinterpret":
            return np.ascontiguousarray(args[0]).view(npdt)
        if name == "shift_left":
            return np.left_shift(args[0], args[1].astype(args[0].dtype)).astype(npdt)
        if name == "shift_right":
            return np.right_shift(args[0], args[1].astype(args[0].dtype)).astype(npdt)
        if name == "bitwise_and":
            return (args[0] & args[1]).astype(npdt)
        if name == "bitwise_or":
            return (args[0] | args[1]).astype(npdt)
        if name == "fabs":
            return np.abs(args[0])
        if name == "isnan":
            return np.isnan(args[0])
    raise NotImplementedError(t, getattr(getattr(e, "op", None), "name", None))
