"""``python -m tilefuse bench``: the command line. It parses and checks every argument before anything runs (a bad
one raises ``tilefuse._cli_errors.UsageError``, which ``python -m tilefuse`` prints as one ``prog: error: ...`` line on
stderr with exit status 2), then hands the work to the runner
(``tilefuse.bench.runner``), the tables (``.report``) and the optional measurements (``.extras``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from tilefuse._cli_errors import ArgumentParser

DESCRIPTION = ("Time every op's kernel against a device copy of the same bytes and, with --compare, against its "
               "peers (TileKernels 2.1.0 and 1.0.0, Liger-Kernel, torch.compile of the reference) on the same inputs; "
               "--list and --report need no GPU.")


def _save(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def _parse_tiles(parser, text: str) -> list[tuple[int, ...]]:
    """``--tiles``: comma-separated tiles of 2 to 5 non-negative integers joined by ``x``, the first two positive
    (``tilefuse.quant._per_token_cast_kernel``: threads, vectors per thread[, lanes[, slot order[, CTAs/SM]]])."""
    from tilefuse.bench.extras import parse_tiles

    try:
        tiles = parse_tiles(text)
    except ValueError:
        tiles = []
    if not tiles or any(not 2 <= len(t) <= 5 or min(t[:2]) <= 0 or min(t) < 0 for t in tiles):
        parser.error(f"--tiles must be THREADSxVECTORS[xLANES[xORDER[xCTAS]]] tiles joined by commas, e.g. "
                     f"256x4,512x8; got {text!r}")
    return tiles


def _check(parser, args) -> tuple[tuple[str, ...], list[str]]:
    """Every check that needs no GPU, before anything runs: the timers and peers of the run."""
    from tilefuse.bench import peers as P
    from tilefuse.bench import runner

    if args.ops is not None:
        valid = runner.valid_names()
        unknown = [o for o in args.ops if o not in valid]
        if unknown or not args.ops:
            what = f"unknown name(s) {', '.join(unknown)}" if unknown else "give at least one name"
            ops = ", ".join(valid[len(runner.AREAS):])
            parser.error(f"--ops: {what}; areas: {', '.join(runner.AREAS)}; ops: {ops}")
    if args.report:
        for path in args.report:
            if not os.path.isfile(path):
                parser.error(f"--report: no such file {path!r}")
            if not os.access(path, os.R_OK):
                parser.error(f"--report: cannot read {path!r}")
    elif args.side_by_side:
        parser.error("--side-by-side needs --report")
    if args.match is not None:
        try:
            re.compile(args.match)
        except re.error as exc:
            parser.error(f"--match: not a regular expression ({exc}): {args.match!r}")
    timers = tuple(t for t in args.timer.split(",") if t)
    if not timers or any(t not in ("isolated", "stream") for t in timers):
        parser.error(f"--timer must be isolated, stream or isolated,stream, got {args.timer!r}")
    if args.warm_jobs < 0:
        parser.error(f"--warm-jobs must be >= 0, got {args.warm_jobs}")
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in P.PEER_NAMES]
    if unknown:
        parser.error(f"--peers: unknown {', '.join(unknown)}; choose from {', '.join(sorted(P.PEER_NAMES))}")
    for flag in ("json", "markdown", "plot", "child_json"):
        path = getattr(args, flag)
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            parser.error(f"--{flag.replace('_', '-')}: no such directory {folder!r} for {path!r}")
    if args.tiles is not None:
        args.tiles = _parse_tiles(parser, args.tiles)
    if args.tile_cases is not None and args.tiles is None:
        parser.error("--tile-cases needs --tiles")
    if not args.compare:
        peers = [] if args.no_compile_ref else ["compile"]
    return timers, peers


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m tilefuse bench", description=DESCRIPTION)
    parser.add_argument("--list", action="store_true",
                        help="print the cases (op, shape, bytes) without running them (no GPU needed)")
    parser.add_argument("--ops", nargs="*", default=None, help="op names or areas (quant, transpose, moe)")
    parser.add_argument("--quick", action="store_true",
                        help="only the showcase rows (one per op and flag set) instead of the whole grid")
    parser.add_argument("--match", default=None, metavar="REGEX",
                        help="only the cases whose label the regex finds, e.g. 'block128x1 ' or '^e4m3 16384x'")
    parser.add_argument("--compare", action="store_true",
                        help="also run every peer that has the op (--peers), same inputs, same process, same timer")
    parser.add_argument("--peers", default="tk2,tk1,liger,compile",
                        help="peers of --compare, comma-separated: tk2, tk1 (second process), liger, compile")
    parser.add_argument("--timer", default="isolated",
                        help="isolated (each call alone after an L2 flush; speedups use it), stream "
                             "(back-to-back calls), or isolated,stream")
    parser.add_argument("--warm-jobs", type=int, default=0,
                        help="compile every kernel of the run in N processes before timing (0: compile on first use)")
    parser.add_argument("--json", default=None, help="write the results as JSON")
    parser.add_argument("--markdown", default=None, help="write the table and the summary as markdown")
    parser.add_argument("--plot", default=None, help="write a PNG of the speedup over each peer")
    parser.add_argument("--report", nargs="+", default=None, metavar="JSON",
                        help="print (and with --markdown write) the tables of saved runs, merged in order; no GPU")
    parser.add_argument("--side-by-side", action="store_true",
                        help="with --report: one column per saved run (the same cases under other TILEFUSE_KNOBS)")
    parser.add_argument("--child-json", default=None, help=argparse.SUPPRESS)  # the TileKernels 1.0.0 process
    parser.add_argument("--host-overhead", action="store_true", help="also time one-row calls on the host")
    parser.add_argument("--no-compile-ref", action="store_true",
                        help="without --compare: skip torch.compile of the references")
    parser.add_argument("--cold-start", action="store_true",
                        help="also time a second process's first per_token_cast call (warm disk cache)")
    parser.add_argument("--tile-cases", default=None, help="sweep only the per_token_cast cases whose label "
                        "contains this text (e.g. 'e2m1')")
    parser.add_argument("--tiles", default=None,
                        help="per_token_cast tile sweep, e.g. 256x4,512x8 (threads x pairs per thread)")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    timers, peers = _check(parser, args)
    from tilefuse.bench import report as C
    from tilefuse.bench import runner

    if args.report:
        try:
            return C.report_main(args.report, args.markdown, args.side_by_side)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a file that is no saved run
            parser.error(f"--report: {type(exc).__name__}: {exc}")
    if args.list:
        print("| op | shape | MB |\n| --- | --- | ---: |")
        for r in runner.list_cases(ops=args.ops, quick=args.quick, match=args.match):
            print(f"| {r['op']} | {r['shape']} | {r['bytes'] / 1e6:.1f} |")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("python -m tilefuse bench: error: timing needs a CUDA GPU (--list and --report do not)", file=sys.stderr)
        return 1
    done_rows: list = []

    def progress(i, n, r):
        done_rows.append(r)
        if args.json and len(done_rows) % 50 == 0:  # a run cut short keeps what it measured
            _save({"partial": True, "gpu": torch.cuda.get_device_name(),
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": done_rows}, args.json + ".partial")
        if "error" in r:
            print(f"  [{i + 1}/{n}] {r['op']} | {r.get('shape')} | fails: {r['error']}", flush=True)
            return
        us = r.get("us", r.get("stream_us"))
        cells = "".join(f" | {p} " + (f"{e['us']:.1f} us {e['speedup']:.2f}x{'' if e['agree'] else ' DIFFERS'}"
                                      if "speedup" in e else e.get("error", e.get("check", ""))[:60])
                        for p, e in r["peers"].items())
        print(f"  [{i + 1}/{n}] {r['op']} | {r['shape']} | {us:.1f} us{cells}", flush=True)

    child = args.child_json is not None
    result = runner.run(args.quick, args.ops, peers, timers, args.warm_jobs, child, progress, args.match)
    if child:
        _save(result, args.child_json)
        return 0
    lines = [f"{result['gpu']}, {result['date']}; timer: {args.timer}; copy ceiling (2 GiB) "
             f"{result['copy_ceiling_gbs']:.0f} GB/s", "", *C.table(result, peers)]
    if "tk2" in peers:
        result["summary_tk2"] = C.summary(result, "tk2")
        lines += ["", *C.summary_lines(result["summary_tk2"])]
    if result.get("tk1_error"):
        lines += ["", f"TileKernels 1.0.0: {result['tk1_error']}"]
    print("\n" + "\n".join(lines))
    _save(result, args.json)
    if args.json and os.path.exists(args.json + ".partial"):  # the whole run is in args.json now
        os.remove(args.json + ".partial")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.plot:
        C.plot(result, peers, args.plot)
    if args.host_overhead:
        from tilefuse import _native
        from tilefuse.bench.extras import host_overhead, host_overhead_table

        result["host_overhead"] = host_overhead()
        result["native_launcher"] = _native.module() is not None
        print("\n" + "\n".join(host_overhead_table(result["host_overhead"])))
        print("native launcher:", "on" if result["native_launcher"] else f"off ({_native.error()})")
        _save(result, args.json)
    if args.cold_start:
        from tilefuse.bench.extras import cold_start

        result["cold_start"] = cold_start()
        print("\ncold start (second process, warm disk cache):", result["cold_start"])
        _save(result, args.json)
    if args.tiles:
        from tilefuse.bench.extras import tile_sweep

        result["tile_sweep"] = tile_sweep(args.tiles, only=args.tile_cases)
        print("\n| per_token_cast case | tile | µs | % ceiling | bitwise equal |\n| --- | --- | ---: | ---: | --- |")
        for r in result["tile_sweep"]:
            if "error" in r:
                print(f"| {r['shape']} | {r['tile']} | error: {r['error'][:80]} | | |")
            else:
                print(f"| {r['shape']} | {r['tile']} | {r['us']:.1f} | "
                      f"{100 * r['gbs'] / result['copy_ceiling_gbs']:.1f} | {r['bitwise_equal']} |")
        _save(result, args.json)
    return 0
