"""The runner of ``python -m tilefuse bench``: which cases run, and how each is measured (DESIGN.md, Benchmarks).

Cases come from the area modules named in :data:`AREAS` (``tilefuse.bench.<area>``: ``OPS``, ``quick_cases()``,
``grid_cases()``); adding an area is one entry there. Each case is timed on us and on every peer that has the op
(``tilefuse.bench.peers``), in one process, on the same inputs, with the same timer (``tilefuse.bench.core``).

In-place cases (``Case.in_place``: ``inplace_unique_group_indices``) are restored from a pristine copy before each
isolated call, ahead of the flush (untimed); the stream timer cannot do that, so its back-to-back calls after the
first see an already de-duplicated input (the same reads, fewer writes).

TileKernels 1.0.0 runs in a second process (both releases are ``tile_kernels``), which times its cases on us and
on 1.0.0 the same way; its rows are merged by case. ``--list`` reads each case's declared shapes
(``Case.describe``) and builds nothing; :func:`bench_configs` traces the kernels the cases launch on fake CUDA
tensors, without a GPU.
"""
from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import time

import torch

from tilefuse.bench import peers as _peers
from tilefuse.bench.core import (_COPY_CACHE, _L2_ROTATE_BYTES, _clone, _nbytes, copy_us, counted_bytes, describe,
                                 isolated_us, median_us, spec_bytes, tensors)

AREAS = ("quant", "transpose", "moe", "transform", "mhc", "engram", "rand")  # the case modules tilefuse.bench.<area>, in the order their rows run


def area_module(area: str):
    return importlib.import_module(f"tilefuse.bench.{area}")


def area_of(name: str) -> str:
    """The area whose case module has op ``name``."""
    for area in AREAS:
        if name in area_module(area).OPS:
            return area
    raise KeyError(name)


def valid_names() -> list[str]:
    """What ``--ops`` accepts: the areas and every op of their case modules."""
    return [*AREAS, *(op for area in AREAS for op in area_module(area).OPS)]


_COMPILED: dict[int, object] = {}


def _peer_fn(case, peer: str):
    """The callable ``fn(*inputs)`` of ``peer`` for ``case``, or None where the peer has no such op."""
    if peer == "compile":
        if case.ref is None:
            return None
        fn = _COMPILED.get(id(case.ref))
        if fn is None:
            fn = _COMPILED[id(case.ref)] = torch.compile(case.ref, dynamic=True)
        return fn
    if not case.peers or peer not in case.peers:
        return None
    module, call = _peers.load(peer), case.peers[peer]
    return lambda *inputs: call(module, *inputs)


def _restorer(case, inputs):
    """For an in-place case, ``setup()`` copying a pristine clone back into ``inputs`` (None otherwise)."""
    if not getattr(case, "in_place", False):
        return None
    pairs = list(zip(tensors(inputs), tensors(_clone(inputs))))

    def setup():
        for work, pristine in pairs:
            work.copy_(pristine)
    return setup


def _agree(case, peer: str, ours, theirs) -> tuple[bool, str]:
    """The case's comparison for ``peer`` (``Case.check``), else ``_peers.agree`` with the case's exactness."""
    check = (getattr(case, "check", None) or {}).get(peer)
    return check(ours, theirs) if check is not None else _peers.agree(ours, theirs, case.exact)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"


def _setup_compile() -> None:
    import torch._dynamo

    # one reference lambda serves every case of a flag set: let dynamo keep a graph per set instead of falling
    # back to eager after its default 8 recompiles of one code object
    torch._dynamo.config.cache_size_limit = 1024
    torch._dynamo.config.accumulated_cache_size_limit = 4096


def measure(case, peers: list[str], timers: tuple[str, ...], with_compile: bool = True) -> dict:
    """One row: our time, the size-matched copy, and each peer's time, speedup and agreement."""
    row: dict = {"op": case.name, "peers": {}}
    try:
        row["shape"], inputs = case.make("cuda", 1.0)
        ours = case.run(*_clone(inputs))
        nbytes = (case.nbytes or counted_bytes)(inputs, ours)
        row["bytes"] = nbytes
        restore = _restorer(case, inputs)  # in-place ops: each isolated call sees the original input
        if "isolated" in timers:
            row["us"] = isolated_us(lambda: case.run(*inputs), setup=restore)
            row["copy_us"] = copy_us(nbytes)
        if "stream" in timers:
            sets = [inputs] + [case.make("cuda", 1.0)[1]
                               for _ in range(min(3, -(-_L2_ROTATE_BYTES // max(1, _nbytes(inputs))) - 1))]
            row["stream_us"] = median_us(lambda i: case.run(*sets[i % len(sets)]), len(sets))
            del sets
        if restore is not None:
            restore()  # the peers see the original input too
    except Exception as exc:  # our op failed on this case: say so, keep going
        row.setdefault("shape", "?")
        row["error"] = _error(exc)
        return row
    for peer in peers:
        if peer == "compile" and not with_compile:
            continue
        try:
            fn = _peer_fn(case, peer)
            if fn is None:
                continue
            theirs = fn(*_clone(inputs))
            ok, text = _agree(case, peer, ours, theirs)
            entry = {"agree": ok, "check": text}
            if "isolated" in timers:
                entry["us"] = isolated_us(lambda: fn(*inputs), setup=restore)
                entry["speedup"] = entry["us"] / row["us"]
            else:
                entry["stream_us"] = median_us(lambda i: fn(*inputs), 1)
            if restore is not None:
                restore()
            del theirs
        except Exception as exc:  # a peer that fails on a case gets a row that says so
            entry = {"error": _error(exc)}
        row["peers"][peer] = entry
    del inputs, ours
    return row


_WORKER_CASES: dict[tuple, list] = {}


def _warm_worker(args) -> int:
    """Run each case of ``indices`` once on us and on the in-process peers, so that the kernels of every
    implementation are compiled into the disk caches before anything is timed; returns the failures."""
    quick, ops, indices, peers, child, compile_idx, match = args
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    _setup_compile()
    key = (quick, tuple(ops or ()), child, match)
    if key not in _WORKER_CASES:  # a worker process serves many keys: select the cases once
        _WORKER_CASES[key] = select_cases(quick, ops, ["tk1"] if child else None, match)
    cases = _WORKER_CASES[key]
    failures = 0
    for i in indices:
        case = cases[i]
        try:
            _, inputs = case.make("cuda", 1.0)
            case.run(*_clone(inputs))
            for peer in peers:
                fn = None if peer == "compile" and i not in compile_idx else _peer_fn(case, peer)
                if fn is not None:
                    try:
                        fn(*_clone(inputs))
                    except Exception:
                        failures += 1
            torch.cuda.synchronize()
            del inputs
        except Exception:
            failures += 1
    return failures


def warm(quick: bool, ops, peers: list[str], cases: list, jobs: int, child: bool, compile_idx: set,
         match: str | None = None) -> None:
    """Compile everything the run will launch, in ``jobs`` spawned processes (TileLang and inductor compile on
    the CPU; their disk caches serve the timing process). The cases of one key (the same kernels at other token
    counts) are one task, so no kernel is compiled twice at once; each finished task is reported on stderr."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    t0 = time.perf_counter()
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(cases):
        groups.setdefault(c.key or str(i), []).append(i)
    failures = 0
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        tasks = {pool.submit(_warm_worker, (quick, ops, idx, peers, child, compile_idx, match)): idx
                 for idx in groups.values()}
        for k, done in enumerate(as_completed(tasks), 1):
            failures += done.result()
            first = cases[tasks[done][0]]
            print(f"  warm-up [{k}/{len(tasks)}] {first.name} {case_label(first)} ({len(tasks[done])} cases, "
                  f"{time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(f"warm-up: {len(cases)} cases in {jobs} processes, {time.perf_counter() - t0:.0f} s "
          f"({failures} calls failed; their rows will say why)", flush=True)


def case_label(case) -> str:
    """A case's shape label without building its inputs (``Case.describe``)."""
    return describe(case)[0]


def select_cases(quick: bool, ops, peers: list[str] | None = None, match: str | None = None) -> list:
    """The cases of a run: the ``--quick`` rows or the grid of each area in ``AREAS`` (of those ``ops`` names, by
    op or area); in a TileKernels 1.0.0 process only the cases that 1.0.0 has; with ``match`` only the cases
    whose label (``case_label``) the regex finds."""
    cases = []
    for area in AREAS:
        module = area_module(area)
        if ops and area not in ops and not any(o in module.OPS for o in ops):
            continue
        built = module.quick_cases() if quick else module.grid_cases()
        cases += [c for c in built if not ops or area in ops or c.name in ops]
    if peers == ["tk1"]:
        cases = [c for c in cases if c.peers and "tk1" in c.peers]
    if match:
        pattern = re.compile(match)
        cases = [c for c in cases if pattern.search(case_label(c))]
    return cases


def compile_sample(cases: list, quick: bool) -> set:
    """The cases that time ``torch.compile``: every quick row; in the grid one case per op (4096 tokens at 7168
    channels where it has one), since inductor compiles each flag set anew (tens of seconds each)."""
    if quick:
        return set(range(len(cases)))
    picked: dict[str, int] = {}
    for i, c in enumerate(cases):
        if c.ref is None:
            continue
        score = (c.tokens == 4096) + ("x7168" in c.key or " 7168)" in c.key)
        if c.name not in picked or score > picked[c.name][0]:
            picked[c.name] = (score, i)
    return {i for _, i in picked.values()}


def run(quick: bool, ops, peers: list[str], timers: tuple[str, ...], warm_jobs: int = 0,
        child: bool = False, on_row=None, match: str | None = None) -> dict:
    """Time every case on us and on ``peers`` (TileKernels 1.0.0 in a second process unless ``child``)."""
    in_process = [p for p in peers if p != "tk1" or child]
    if "compile" in in_process:
        _setup_compile()
    cases = select_cases(quick, ops, ["tk1"] if child else None, match)
    for p in in_process:
        if p != "compile":
            _peers.load(p)  # fail early, naming the variable, if a peer folder is missing
    compile_idx = compile_sample(cases, quick)
    if warm_jobs > 0:
        warm(quick, ops, in_process, cases, warm_jobs, child, compile_idx, match)
    ceiling = 2 * (1 << 30) / copy_us(2 << 30) / 1e3  # the 2 GiB copy (read + written), isolated
    _COPY_CACHE.pop(1 << 30, None)  # the 2 GiB copy is no case's ceiling
    torch.cuda.empty_cache()
    rows = []
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        row = measure(case, in_process, timers, i in compile_idx)
        rows.append(row)
        if on_row:
            on_row(i, len(cases), row)
        torch.cuda.empty_cache()
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "copy_ceiling_gbs": ceiling, "timers": list(timers), "peers": peers, "quick": quick, "rows": rows,
              "seconds": time.perf_counter() - t0}
    for row in rows:
        if "us" in row:
            row["pct_copy"] = 100 * row["copy_us"] / row["us"]
        if "us" in row or "stream_us" in row:  # of the 2 GiB copy, by the run's first timer
            row["pct_ceiling"] = 100 * row["bytes"] / row.get("us", row.get("stream_us")) / 1e3 / ceiling
    if "tk1" in peers and not child:
        merge_child(result, run_child(quick, ops, timers, warm_jobs, match))
    return result


def run_child(quick: bool, ops, timers, warm_jobs: int, match: str | None = None) -> dict:
    """The TileKernels 1.0.0 cases in a second process; its JSON."""
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "tilefuse", "bench", "--compare", "--peers", "tk1", "--child-json", path,
           "--timer", ",".join(timers), "--warm-jobs", str(warm_jobs)]
    if quick:
        cmd.append("--quick")
    if ops:
        cmd += ["--ops", *ops]
    if match:
        cmd += ["--match", match]
    print(f"TileKernels 1.0.0 in a second process: {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, check=False)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"error": f"the TileKernels 1.0.0 process exited with {done.returncode} and wrote no result"}
    finally:
        os.unlink(path)


def merge_child(result: dict, child: dict) -> None:
    """Put the 1.0.0 process's peer entries on our rows (matched by op and shape); its own time of our op is
    kept beside them (``ours_us``), and its speedup is computed within that process."""
    if "error" in child:
        result["tk1_error"] = child["error"]
        return
    by_case = {(r["op"], r.get("shape")): r for r in result["rows"]}
    for r in child["rows"]:
        mine = by_case.get((r["op"], r.get("shape")))
        if mine is None:
            continue
        entry = dict(r["peers"].get("tk1", {"error": r.get("error", "no result")}))
        if "us" in r:
            entry["ours_us"] = r["us"]
        mine["peers"]["tk1"] = entry


def list_cases(ops: list[str] | None = None, quick: bool = True, match: str | None = None) -> list[dict]:
    """Each case's name, shape label and bench bytes from its declared shapes (``Case.describe``): no input is
    built, no op is called, no GPU is needed."""
    rows = []
    for case in select_cases(quick, ops, match=match):
        label, inputs, outputs = describe(case)
        rows.append({"op": case.name, "shape": label, "bytes": spec_bytes(inputs) + spec_bytes(outputs)})
    return rows


def bench_configs(ops: list[str] | None = None, grid: bool = True) -> list[tuple[str, tuple]]:
    """The ``(kernel, static config)`` pairs the bench rows and the grid launch, found without a GPU, so ``precompile
    --bench`` can build exactly those (e.g. for a ``TILEFUSE_KNOBS`` variant). The trace runs in a child
    process: launchers cache what ``_jit.get`` returned, and the trace's recorder must not stay behind."""
    code = ("import sys; from tilefuse.bench import runner; "
            "print(repr(runner._trace_configs(sys.argv[2:] or None, sys.argv[1] == '1')))")
    done = subprocess.run([sys.executable, "-c", code, str(int(grid)), *(ops or [])], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        raise RuntimeError(f"bench_configs: the trace failed:\n{done.stderr[-2000:]}")
    from tilefuse import _jit

    _jit.registered()  # the kernel modules, imported here too: callers look configs up (``_jit._lib_path``)
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def _trace_configs(ops: list[str] | None, grid: bool = True) -> list[tuple[str, tuple]]:
    """``bench_configs`` in this process: each case runs on fake CUDA tensors (shapes only) with ``_jit.get``
    replaced by a recorder."""
    import warnings

    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode)

    from tilefuse import _jit, _registry

    registry = _registry.load_all()
    seen: dict[tuple[str, tuple], None] = {}
    real_get, real_getitem = _jit.get, torch.Tensor.__getitem__

    def getitem(t, index):
        """Basic indexing (ints, unit-step slices, None) as select/narrow/unsqueeze: Python indexing of a fake
        CUDA tensor asks for a CUDA device guard, which a CPU-only torch lacks."""
        if not isinstance(index, tuple):
            index = (index,)
        if not all(i is None or isinstance(i, int) or (isinstance(i, slice) and i.step in (None, 1)) for i in index):
            return real_getitem(t, index)
        dim = 0
        for i in index:
            if i is None:  # a new axis (e.g. a row mask broadcast as mask[:, None])
                t = t.unsqueeze(dim)
                dim += 1
            elif isinstance(i, int):
                t = t.select(dim, i)
            else:
                start, stop, _ = i.indices(t.size(dim))
                t = t.narrow(dim, start, max(0, stop - start))
                dim += 1
        return t

    def record(name, config):
        seen[(name, config)] = None
        return lambda *args: None

    def contiguous(t, memory_format=torch.contiguous_format):
        return t if t.is_contiguous(memory_format=memory_format) else t.clone(memory_format=memory_format)

    # ``~t`` and ``t.contiguous()`` of a fake CUDA tensor ask for the device guard too; these spellings do not
    real = (torch.Tensor.__getitem__, torch.Tensor.__invert__, torch.Tensor.contiguous)
    _jit.get = record
    torch.Tensor.__getitem__, torch.Tensor.__invert__, torch.Tensor.contiguous = (
        getitem, lambda t: torch.bitwise_not(t), contiguous)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # data_ptr() of a fake tensor (the launchers' alignment checks)
            quick = select_cases(True, ops)
            for case in quick + (select_cases(False, ops) if grid else []):
                if registry.get(f"{area_of(case.name)}.{case.name}", {}).get("path") == "reference":
                    continue  # no kernel yet: CUDA tensors take the reference, which launches nothing to trace
                try:
                    with FakeTensorMode(allow_non_fake_inputs=True):
                        inputs = case.make("cuda", 1.0)[1]
                        if any(t.requires_grad for t in tensors(inputs)):
                            continue  # an autograd step (autograd aborts on fake CUDA tensors): its ops' rows trace it
                        case.run(*inputs)
                except (DataDependentOutputException, DynamicOutputShapeException):
                    # the op syncs with the host (get_fused_mapping with N = 0 reads the counts back): shapes alone
                    # cannot run it; its kernels are the ones the same op's no-sync case traces
                    continue
                except Exception as exc:  # a launcher step fake CUDA tensors cannot take: say which case
                    if case in quick:  # the grid's cases that make inputs with our ops are compiled on first use
                        raise RuntimeError(f"bench_configs: the {case.name} case failed on fake CUDA tensors: "
                                           f"{type(exc).__name__}: {exc}") from exc
    finally:
        _jit.get = real_get
        torch.Tensor.__getitem__, torch.Tensor.__invert__, torch.Tensor.contiguous = real
    return list(seen)
