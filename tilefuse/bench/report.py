"""The tables of ``python -m tilefuse bench``: a run's table and its summary against a peer, and ``--report``'s
tables of saved runs (merged, the grid pivot, side by side), without a GPU; ``--plot``'s PNG."""
from __future__ import annotations

import json
import math
import os
import re

from tilefuse.bench.peers import PEER_NAMES

JUDGED_BYTES = 32 << 20      # speed targets judge cases of at least this many bytes (issue 24, item 4)


def _cell(entry: dict | None) -> tuple[str, str]:
    if entry is None:
        return "", ""
    if "error" in entry:
        return "fails", ""
    us = entry.get("us", entry.get("stream_us"))
    sp = f"{entry['speedup']:.2f}x" if "speedup" in entry else ""
    if not entry.get("agree", True):
        sp += " ≠"
    return f"{us:.1f}", sp


def table(result: dict, peers: list[str]) -> list[str]:
    """The markdown lines of a run: one row per case; ``≠`` marks outputs that disagree with ours."""
    timer = "isolated" if "isolated" in result["timers"] else "stream"
    head = f"| op | shape | MB | µs ({timer}) | % copy (same bytes) | % 2 GiB copy |"
    rule = "| --- | --- | ---: | ---: | ---: | ---: |"
    if "stream" in result["timers"] and timer == "isolated":
        head += " µs (stream) |"
        rule += " ---: |"
    for p in peers:
        head += f" {PEER_NAMES[p]} µs | speedup |"
        rule += " ---: | ---: |"
    lines = [head, rule]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['op']} | {r.get('shape', '?')} | | fails: {r['error'][:80]} |" + " |" * (3 + 2 * len(peers)))
            continue
        us = r.get("us", r.get("stream_us"))
        pct = (f"{r['pct_copy']:.1f} | {r['pct_ceiling']:.1f}" if "pct_copy" in r else " | ")
        line = f"| {r['op']} | {r['shape']} | {r['bytes'] / 1e6:.1f} | {us:.1f} | {pct} |"
        if "stream" in result["timers"] and timer == "isolated":
            line += f" {r['stream_us']:.1f} |"
        for p in peers:
            a, b = _cell(r["peers"].get(p))
            line += f" {a} | {b} |"
        lines.append(line)
    return lines


def summary(result: dict, peer: str = "tk2", min_bytes: int = JUDGED_BYTES) -> dict:
    """Item 4 of issue 24 over the rows of at least ``min_bytes`` where both ran: per op the lowest speedup and
    the cases under 0.97x, and the geomean of all those cases."""
    per_op: dict[str, list] = {}
    for r in result["rows"]:
        e = r.get("peers", {}).get(peer)
        if r.get("bytes", 0) >= min_bytes and e and "speedup" in e:
            per_op.setdefault(r["op"], []).append((e["speedup"], r["shape"]))
    every = [s for v in per_op.values() for s, _ in v]
    return {"peer": peer, "cases": len(every),
            "geomean": math.exp(sum(map(math.log, every)) / len(every)) if every else None,
            "ops": {op: {"cases": len(v), "min": min(v)[0], "below_0.97": [(round(s, 3), sh) for s, sh in v if s < 0.97]}
                    for op, v in sorted(per_op.items())}}


def summary_lines(s: dict) -> list[str]:
    if not s["cases"]:
        return [f"no case of >= {JUDGED_BYTES >> 20} MiB ran on both tilefuse and {PEER_NAMES[s['peer']]}"]
    lines = [f"against {PEER_NAMES[s['peer']]}, cases of >= {JUDGED_BYTES >> 20} MiB where both run: "
             f"{s['cases']} cases, geomean speedup {s['geomean']:.3f}x",
             "| op | cases | lowest speedup | cases under 0.97x |", "| --- | ---: | ---: | --- |"]
    for op, v in s["ops"].items():
        under = "; ".join(f"{sh} {sp:.2f}x" for sp, sh in v["below_0.97"]) or "-"
        lines.append(f"| {op} | {v['cases']} | {v['min']:.2f}x | {under} |")
    return lines


def plot(result: dict, peers: list[str], path: str) -> None:
    """A PNG of the speedup over each peer, case by case, one panel per peer (log scale, 1.0 marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [p for p in peers if any(p in r.get("peers", {}) and "speedup" in r["peers"][p] for r in result["rows"])]
    if not shown:
        return
    ops = sorted({r["op"] for r in result["rows"]})
    colors = {op: plt.cm.tab20(i % 20) for i, op in enumerate(ops)}
    fig, axes = plt.subplots(len(shown), 1, figsize=(14, 4 * len(shown)), squeeze=False)
    for ax, p in zip(axes[:, 0], shown):
        for op in ops:
            pts = [(i, r["peers"][p]["speedup"]) for i, r in enumerate(result["rows"])
                   if r["op"] == op and "speedup" in r.get("peers", {}).get(p, {})]
            if pts:
                ax.scatter(*zip(*pts), s=8, color=colors[op], label=op)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(f"speedup over {PEER_NAMES[p]}")
        ax.set_xlabel("case (grid order)")
    axes[0, 0].legend(fontsize=6, ncol=4, loc="upper left")
    axes[0, 0].set_title(f"tilefuse on {result['gpu']}, {result['date']}, isolated timer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merge(results: list[dict]) -> dict:
    """Several runs' results as one: a later run's row replaces an earlier one of the same op and shape. The
    first run's header fields are kept; ``runs`` lists each run's date, copy ceiling and row count."""
    out = dict(results[0], rows=[], runs=[])
    rows: dict[tuple, dict] = {}
    for res in results:
        ceiling = res.get("copy_ceiling_gbs")
        for r in res["rows"]:
            r = dict(r)
            if "us" in r and "copy_us" in r:
                r["pct_copy"] = 100 * r["copy_us"] / r["us"]
                if ceiling:
                    r["pct_ceiling"] = 100 * r["bytes"] / r["us"] / 1e3 / ceiling
            rows[(r["op"], r.get("shape"))] = r
        out["runs"].append({"date": res.get("date"), "copy_ceiling_gbs": ceiling, "rows": len(res["rows"])})
    out["rows"] = list(rows.values())
    return out


_SHAPE = re.compile(r"(\d+)x(\d+)|\((\d+), (\d+), (\d+)\)")


def _grid_cell(shape: str) -> tuple[str, int, int] | None:
    """``(case with the shape blanked, tokens, hidden)`` of a grid label, from its first ``TxH`` or ``(B, T, H)``
    (later ``TxW`` shapes of the same token count blanked as well)."""
    m = _SHAPE.search(shape)
    if m is None:
        return None
    if m.group(1):
        t, h, blank = int(m.group(1)), int(m.group(2)), "TxH"
        # a second shape of the same rows (e.g. unpack's "(int8 4096x768)") is blanked too
        return shape[:m.start()] + blank + re.sub(rf"\b{t}x\d+", "TxW", shape[m.end():]), t, h
    t, h, blank = int(m.group(4)), int(m.group(5)), f"({m.group(3)}, T, H)"
    return shape[:m.start()] + blank + shape[m.end():], t, h


def pivot(result: dict, tokens=(1, 128, 4096, 16384)) -> list[str]:
    """The grid as one line per op and case: for each of its widths (``H:``, the ``x`` dimension of the label),
    the speedups over the TileKernels release that has the op at each token count in ``tokens`` (``≠``: outputs
    disagree; ``-``: not run; ``x``: the peer fails)."""
    groups: dict[tuple, dict] = {}
    for r in result["rows"]:
        cell = _grid_cell(r.get("shape", ""))
        if cell is None or "error" in r:
            continue
        case, t, h = cell
        peer = "tk2" if "tk2" in r["peers"] else ("tk1" if "tk1" in r["peers"] else None)
        groups.setdefault((r["op"], case, peer), {})[(h, t)] = r
    width = max((len({h for h, _ in cells}) for cells in groups.values()), default=0)
    lines = ["| op | case | peer | " + " | ".join(f"H: T={','.join(map(str, tokens))}" for _ in range(width)) + " |",
             "| --- | --- | --- |" + " --- |" * width]
    for (op, case, peer), cells in groups.items():
        row = []
        for h in sorted({h for h, _ in cells}):
            parts = []
            for t in tokens:
                e = cells[(h, t)]["peers"].get(peer, {}) if (h, t) in cells and peer else {}
                if "speedup" in e:
                    parts.append(f"{e['speedup']:.2f}" + ("" if e.get("agree", True) else "≠"))
                else:
                    parts.append("x" if "error" in e else "-")
            row.append(f"{h}: " + " ".join(parts))
        row += [""] * (width - len(row))
        name = PEER_NAMES[peer].replace("TileKernels ", "TK ") if peer else "-"
        lines.append(f"| {op} | {case} | {name} | " + " | ".join(row) + " |")
    return lines


def side_by_side(results: list[dict], names: list[str]) -> list[str]:
    """One line per case of the first run: our µs in each run (e.g. the same cases under several TILEFUSE_KNOBS),
    and each run's speedup over the first run's TileKernels time of the case (2.1.0, else 1.0.0), where it has one."""
    others = [{(r["op"], r.get("shape")): r for r in res["rows"]} for res in results]
    lines = ["| op | case | MB | peer µs | " + " | ".join(f"{n} µs" for n in names) + " | "
             + " | ".join(f"{n} speedup" for n in names) + " |",
             "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in names * 2) + " |"]
    for row in results[0]["rows"]:
        key = (row["op"], row.get("shape"))
        peer = next((row.get("peers", {}).get(p, {}).get("us") for p in ("tk2", "tk1")
                     if row.get("peers", {}).get(p, {}).get("us")), None)
        us = [o.get(key, {}).get("us") for o in others]
        cells = [f"{u:.1f}" if u else "-" for u in us]
        speed = [f"{peer / u:.2f}x" if u and peer else "-" for u in us]
        lines.append(f"| {row['op']} | {row.get('shape')} | {row.get('bytes', 0) / 1e6:.0f} | "
                     f"{f'{peer:.1f}' if peer else '-'} | " + " | ".join(cells + speed) + " |")
    return lines


def report_main(paths: list[str], markdown: str | None, variants: bool = False) -> int:
    """``bench --report A.json [B.json ...]``: the tables of saved runs (merged in order), without a GPU; with
    ``variants`` (``--side-by-side``) one column per run instead (``side_by_side``)."""
    results = []
    for p in paths:
        with open(p) as f:
            results.append(json.load(f))
    lines = (side_by_side(results, [os.path.splitext(os.path.basename(p))[0] for p in paths]) if variants
             else report_lines(merge(results)))
    print("\n".join(lines))
    if markdown:
        with open(markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def report_lines(res: dict) -> list[str]:
    """The tables of a merged result: the summaries, the grid pivot and the torch.compile sample."""
    peers = [p for p in ("tk2", "tk1", "liger", "compile") if any(p in r.get("peers", {}) for r in res["rows"])]
    runs = "; ".join(f"{r['date']} ({r['rows']} rows, 2 GiB copy {r['copy_ceiling_gbs']:.0f} GB/s)"
                     if r["copy_ceiling_gbs"] else f"{r['date']} ({r['rows']} rows)" for r in res["runs"])
    lines = [f"{res.get('gpu', '?')}; runs: {runs}; timer: isolated", ""]
    for peer in ("tk2", "tk1"):
        if peer in peers:
            lines += [*summary_lines(summary(res, peer)), ""]
    lines += pivot(res)
    sampled = [r for r in res["rows"] if "compile" in r.get("peers", {})]
    if sampled:
        lines += ["", "| op | case | µs | torch.compile(reference) µs | speedup | outputs |",
                  "| --- | --- | ---: | ---: | ---: | --- |"]
        for r in sampled:
            e = r["peers"]["compile"]
            if "speedup" in e:
                lines.append(f"| {r['op']} | {r['shape']} | {r['us']:.1f} | {e['us']:.1f} | {e['speedup']:.2f}x | "
                             f"{e['check']} |")
            else:
                lines.append(f"| {r['op']} | {r['shape']} | {r.get('us', 0):.1f} | fails: {e.get('error', '')[:60]} | | |")
    return lines
