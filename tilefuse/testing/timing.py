"""Wall-clock timing for quick measurements (the demo, host-overhead checks). Kernel benchmarks with
CUDA events and L2 flushing live in ``tilefuse.bench.core``."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

__all__ = ["synchronize", "time_ms"]


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued work on ``device`` when it is a CUDA device; no-op otherwise."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], *, warmup: int = 1, iters: int = 3,
            device: torch.device | str | None = None) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``iters`` calls after ``warmup`` calls, with the
    device synchronised around every timed call."""
    if iters < 1:
        raise ValueError(f"time_ms: iters must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
