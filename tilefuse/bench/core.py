"""The bench's core: the case type, the bytes a case moves, the two timers, the copy ceiling and the input
helpers the case modules share. It imports only torch: the case modules (``tilefuse.bench.quant``,
``.transpose``, ``.moe``) build on it, the runner drives them.

Timers (named in every table):

- ``isolated`` (:func:`isolated_us`; the default, every speedup uses it): each call alone. Before each timed call
  a 256 MB buffer is zeroed (L2 flushed) and a device-side sleep is queued, so the host has enqueued the call
  before the GPU reaches the start event; samples where the GPU got there first are dropped. Median of the
  samples.
- ``stream`` (:func:`median_us`): back-to-back calls over rotating input sets. It flatters kernels that overlap
  their neighbours (PDL), so it is never used for a speedup.

The ceiling of a row is a device copy of the same number of bytes (:func:`copy_us`, bytes read + written), timed
the same way in the same run; the 2 GiB copy is reported beside it. A case's bytes count each input tensor read
once and each output tensor written once (:func:`counted_bytes`, decimal MB/GB in the tables).
"""
from __future__ import annotations

import math
import statistics
from typing import Callable, NamedTuple

import torch

_L2_ROTATE_BYTES = 512 << 20
_SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU time queued ahead of each timed batch (doubled while too short)


def median_us(fn: Callable[[int], object], n_sets: int, warmup: int = 5, iters: int = 30,
              calls: int = 10) -> float:
    """Median µs per call: each sample times ``calls`` back-to-back calls between one pair of CUDA events,
    call ``i`` using input set ``i % n_sets``. A device-side sleep is queued before the start event, so the
    host enqueues all the calls while the GPU is still asleep and the events time the kernels back to back:
    host launch, validation and allocation time stay out of the figure. If the GPU reached the start event
    before the host had enqueued the last call (the sleep was shorter than the host's work), the sample is
    discarded and the sleep doubled."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    k = 0
    sleep = _SLEEP_CYCLES
    while len(times) < iters:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep)
        start.record()
        for _ in range(calls):
            fn(k % n_sets)
            k += 1
        late = start.query()  # the GPU already passed the start: it may have waited for the host
        end.record()
        end.synchronize()
        if late and sleep < 64 * _SLEEP_CYCLES:
            sleep *= 2
            continue
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)



def tensors(obj) -> list[torch.Tensor]:
    """The tensors of a nested tuple/list, in order (``None`` skipped)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors(item)]
    return []


def _nbytes(*objs) -> int:
    """Bytes of the logical elements of every tensor in ``objs`` (strided views count visible elements)."""
    return sum(t.numel() * t.element_size() for t in tensors(objs))


def counted_bytes(inputs: tuple, outputs) -> int:
    """Bench bytes of one call: each input tensor read once plus each output tensor written once
    (quant.md 7.3; every bench case passes exactly the tensors the spec's table counts as inputs)."""
    return _nbytes(inputs) + _nbytes(outputs)


class Case(NamedTuple):
    """One bench row. ``make(device, scale) -> (shape label, input tensors)`` builds the inputs at the spec's
    benchmark shape times ``scale`` (each dimension kept on its alignment); ``run(*inputs)`` calls the public
    op; ``ref(*inputs)``, where given, is the reference timed under ``torch.compile``; ``peers`` maps a peer
    (``tilefuse.bench.peers``) to ``fn(peer_module, *inputs)``, the same op in the peer's API; ``exact``: the spec
    makes the outputs bit-exact (else peers are compared by ``calc_diff``); ``check`` maps a peer to its own
    comparison ``fn(ours, theirs) -> (ok, text)`` where ``peers.agree(exact)`` is not the rule (e.g.
    get_fused_mapping's order-free one); ``in_place``: the op writes its inputs, so the isolated timer restores
    them from a pristine copy before each timed call (outside the timed region). ``describe() -> (label, input
    specs, output specs)`` declares, at scale 1, the label ``make`` returns and the shape and dtype of each tensor
    :func:`counted_bytes` counts (:data:`Spec`): ``--list`` reads it and builds nothing (a CPU test holds each
    declaration to the built tensors; a case without one is built on fake tensors instead, see :func:`describe`).
    ``nbytes(inputs, outputs)``, where the spec counts bytes otherwise than "each tensor once" (a table read row
    by row, tensors rotated in place), replaces :func:`counted_bytes` for the case; its ``describe`` then declares
    tensors of those bytes (the CPU test holds the two equal)."""
    name: str
    make: Callable[[str, float], tuple[str, tuple]]
    run: Callable[..., object]
    ref: Callable[..., object] | None = None
    peers: dict | None = None
    exact: bool = True
    key: str = ""  # cases with one key launch the same kernels (they differ in the token count only)
    tokens: int = 0  # the grid's token count
    check: dict | None = None
    in_place: bool = False
    describe: Callable[[], tuple[str, list, list]] | None = None
    nbytes: Callable[[tuple, object], int] | None = None


Spec = tuple  # one counted tensor, declared: (shape tuple, dtype)


def spec_bytes(specs) -> int:
    """Bytes of declared tensors (:data:`Spec`), counted as :func:`counted_bytes` counts built ones."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs)


def describe(case: Case) -> tuple[str, list, list]:
    """``case.describe()``; for a case that declares nothing, the same read off its inputs and outputs built on
    fake tensors at scale 1 (shapes only; real CPU tensors where an op reads data to size its output): slow, but
    a new case module lists truthfully before it declares its shapes."""
    if case.describe is not None:
        return case.describe()
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode)

    def build():
        label, inputs = case.make("cpu", 1.0)
        outputs = case.run(*inputs)
        return label, *([(tuple(t.shape), t.dtype) for t in tensors(x)] for x in (inputs, outputs))

    try:
        with FakeTensorMode():
            return build()
    except (DataDependentOutputException, DynamicOutputShapeException):
        return build()


def described_bytes(case: Case) -> int:
    """The bench bytes of ``case`` from its declared shapes (:func:`describe`)."""
    _, inputs, outputs = describe(case)
    return spec_bytes(inputs) + spec_bytes(outputs)


def _dim(n: int, scale: float, align: int = 1) -> int:
    """``n * scale`` rounded to a multiple of ``align``, at least ``align``."""
    return max(align, round(n * scale / align) * align)


_SHORT = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e4m3fn: "e4m3"}


def _flag_names(col: bool, rnd: bool, packed: bool) -> str:
    return "".join(f" {n}" for n, on in (("col", col), ("round", rnd), ("ue8m0", packed)) if on)


def _randn(shape, dtype, device) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


def _clone(obj):
    """A deep copy of the tensors of ``obj`` (in-place ops must see the same input on every implementation); a
    leaf that requires grad is copied as a fresh leaf (an autograd step reads its ``.grad``)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone().requires_grad_(obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_clone(o) for o in obj)
    return obj


# ---- the isolated timer and the copy ceiling ----

_FLUSH_BYTES = 256 << 20
_ISO_SLEEP_CYCLES = 200_000  # about 0.1 ms queued after the flush: the host's enqueue time of the timed call
_FLUSH = None
_COPY_CACHE: dict[int, float] = {}


def isolated_us(fn, reps: int = 25, warmup: int = 2, setup=None) -> float:
    """Median µs of ``fn()`` timed alone after an L2 flush (see the module docstring). ``setup()``, where given,
    runs before each call's flush, outside the timed region (an in-place op's inputs restored)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    torch.cuda.synchronize()
    sleep, times = _ISO_SLEEP_CYCLES, []
    while len(times) < reps:
        marks = []
        for _ in range(reps - len(times)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if setup is not None:
                setup()
            _FLUSH.zero_()
            torch.cuda._sleep(sleep)
            start.record()
            fn()
            late = start.query()  # the GPU was already past the start event: it may have waited for the host
            end.record()
            marks.append((start, end, late))
        torch.cuda.synchronize()
        good = [s.elapsed_time(e) * 1e3 for s, e, late in marks if not late]
        times += good
        if len(good) < len(marks):
            if sleep >= 64 * _ISO_SLEEP_CYCLES:
                times += [s.elapsed_time(e) * 1e3 for s, e, late in marks if late]  # give up waiting: keep them
            sleep *= 2
    return statistics.median(times)


def copy_us(nbytes: int) -> float:
    """Isolated µs of a device-to-device copy moving ``nbytes`` (read + written), cached per size."""
    half = max(1, nbytes // 2)
    if half not in _COPY_CACHE:
        src = torch.empty(half, dtype=torch.uint8, device="cuda").random_(0, 255)
        dst = torch.empty_like(src)
        _COPY_CACHE[half] = isolated_us(lambda: dst.copy_(src))
        del src, dst
    return _COPY_CACHE[half]

