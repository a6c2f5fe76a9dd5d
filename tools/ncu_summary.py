"""One line per kernel from an Nsight Compute raw CSV: the counters that tell a kernel's limiter apart (memory,
issue, latency, partial-sector stores).

    ncu --import prof.ncu-rep --page raw --csv > raw.csv      # on the device, after tools/ncu_cases.py
    python3 tools/ncu_summary.py raw.csv

Columns: duration; SM active / elapsed cycles (below ~95%: launch ramp, tail or idle SMs); issue-slot use while
active; L2 throughput and L2 tag lookups (% of peak); DRAM throughput (% of peak); DRAM read / write MB; L2 write
sectors from the SMs in MB (32 bytes each: above the output size means partial-sector stores); registers; grid and
block size; achieved occupancy (warps, % of the SM's 64); warp instructions executed (millions); the three largest
warp stall reasons (cycles per issued instruction).
"""
from __future__ import annotations

import csv
import sys

_STALL = "smsp__average_warps_issue_stalled_"
_COLS = {
    "us": "gpu__time_duration.sum",
    "sm_active": "sm__cycles_active.avg",
    "sm_elapsed": "sm__cycles_elapsed.avg",
    "issue": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "l2": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "tag": "lts__t_tag_requests.avg.pct_of_peak_sustained_elapsed",
    "dram_rd": "dram__bytes_read.sum",
    "dram_wr": "dram__bytes_write.sum",
    "l2_wr_sectors": "lts__t_sectors_srcunit_tex_op_write.sum",
    "regs": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    "occ": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "dram": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "inst": "smsp__inst_executed.sum",
}


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def summarize(rows: list[list[str]]) -> list[str]:
    """``rows``: the raw CSV (a header row, a units row, then one row per kernel launch)."""
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: header.index(metric) if metric in header else None for name, metric in _COLS.items()}
    scale = {"dram_rd": 1.0, "dram_wr": 1.0}
    for name in scale:  # bytes columns come in the unit ncu chose: report MB
        i = col[name]
        unit = units[i] if i is not None else ""
        scale[name] = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}.get(unit, 1.0)
    stalls = [(h[len(_STALL):-len("_per_issue_active.ratio")], i) for i, h in enumerate(header)
              if h.startswith(_STALL) and h.endswith("_per_issue_active.ratio")
              and h != _STALL + "selected_per_issue_active.ratio"]  # issuing, not a stall
    out = ["kernel | us | SM active % | issue % | L2 % | L2 tags % | DRAM % | DRAM rd MB | DRAM wr MB | L2 wr MB | regs"
           " | grid x block | occupancy % | M inst | top stalls"]
    for r in data:
        get = {name: (_num(r[i]) if i is not None else float("nan")) for name, i in col.items()}
        top = sorted(((_num(r[i]), name) for name, i in stalls), reverse=True)[:3]
        out.append(" | ".join([
            r[header.index("Kernel Name")][:40],
            f"{get['us']:.1f}",
            f"{100 * get['sm_active'] / get['sm_elapsed']:.1f}",
            f"{get['issue']:.1f}",
            f"{get['l2']:.1f}",
            f"{get['tag']:.1f}",
            f"{get['dram']:.1f}",
            f"{get['dram_rd'] * scale['dram_rd']:.1f}",
            f"{get['dram_wr'] * scale['dram_wr']:.1f}",
            f"{get['l2_wr_sectors'] * 32e-6:.1f}",
            f"{get['regs']:.0f}",
            f"{get['grid']:.0f} x {get['block']:.0f}",
            f"{get['occ']:.1f}",
            f"{get['inst'] * 1e-6:.1f}",
            ", ".join(f"{name} {v:.1f}" for v, name in top),
        ]))
    return out


def main(argv: list[str]) -> int:
    with open(argv[0], newline="") as f:
        rows = list(csv.reader(f))
    print("\n".join(summarize(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
