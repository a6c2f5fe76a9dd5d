"""Render a ``python -m tilefuse bench --json`` file as the markdown tables of docs/BENCHMARKS.md, with each row's
target (issue #3: the per-token rows it names >= 92% and batched_transpose >= 92%; issue #4: every other quant row
>= 90% where it moves >= 64 MB, otherwise reported only).

    python tools/bench_markdown.py bench.json > table.md
"""
from __future__ import annotations

import json
import sys

_ISSUE3 = ("per_token_cast", "batched_transpose")


def _us(row: dict) -> float:
    """The row's µs by the run's first timer (``us``: isolated, ``stream_us``: stream)."""
    return row.get("us", row.get("stream_us"))


def _gbs(row: dict) -> float:
    """The row's GB/s: the bench counts ``bytes`` (each input read once, each output written once) over ``us``."""
    return row["gbs"] if "gbs" in row else row["bytes"] / _us(row) / 1e3


def target(row: dict) -> str:
    mb = _gbs(row) * _us(row) / 1e3
    pct = row["pct_ceiling"]
    if row["op"] in _ISSUE3:
        return f">= 92%: {'met' if pct >= 92 else 'not met'}"
    if row["op"] == "transpose":
        return "(no target)"
    if mb < 64:
        return f"< 64 MB: reported ({mb:.1f} MB)"
    return f">= 90%: {'met' if pct >= 90 else 'not met'}"


def main(path: str) -> int:
    d = json.load(open(path))
    print(f"Copy ceiling in this run: **{d['copy_ceiling_gbs']:.0f} GB/s** ({d['gpu']}, {d['date']}).\n")
    print("| op | shape | µs | GB/s | % ceiling | target |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for r in d["rows"]:
        if _us(r) is None:  # a failed row
            print(f"| {r['op']} | {r.get('shape', '')} | {r.get('error', 'no time')} | | | |")
            continue
        print(f"| {r['op']} | {r['shape']} | {_us(r):.1f} | {_gbs(r):.0f} | {r['pct_ceiling']:.1f} | {target(r)} |")
    if d.get("host_overhead"):
        from tilefuse.bench import host_overhead_table

        print("\n" + "\n".join(host_overhead_table(d["host_overhead"])))
    if d.get("cold_start"):
        print(f"\nCold start: {d['cold_start']}")
    if d.get("tile_sweep"):
        print("\n| per_token_cast case | tile | µs | % ceiling | bitwise equal |\n| --- | --- | ---: | ---: | --- |")
        for r in d["tile_sweep"]:
            if "error" in r:
                print(f"| {r['shape']} | {tuple(r['tile'])} | error | | |")
                continue
            print(f"| {r['shape']} | {tuple(r['tile'])} | {r['us']:.1f} | "
                  f"{100 * r['gbs'] / d['copy_ceiling_gbs']:.1f} | {r['bitwise_equal']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
