"""CPU tests of the developer tools under tools/ that parse device output."""
import importlib.util
import json
import pathlib

_TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ncu_summary_one_line_per_kernel():
    """Units are honoured (DRAM bytes in Gbyte -> MB), write sectors become MB, 'selected' is not a stall, and the
    stalls come largest first."""
    s = _load("ncu_summary")
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    header = ["Kernel Name", *s._COLS.values(), stall.format("barrier"), stall.format("selected"),
              stall.format("long_scoreboard"), stall.format("wait")]
    units = ["", "us", "cycle", "cycle", "%", "%", "%", "Gbyte", "Mbyte", "sector", "register/thread", "", "",
             "%", "%", "inst", "", "", "", ""]
    row = ["k_kernel", "25.0", "40,000", "50,000", "32.5", "81.0", "39.5", "0.036", "31.5", "1,000,000", "40",
           "528", "128", "62.5", "91.0", "1,500,000", "4.3", "9.0", "9.3", "1.5"]
    lines = s.summarize([header, units, row])
    assert len(lines) == 2
    cells = [c.strip() for c in lines[1].split("|")]
    assert cells[:14] == ["k_kernel", "25.0", "80.0", "32.5", "81.0", "39.5", "91.0", "36.0", "31.5", "32.0", "40",
                          "528 x 128", "62.5", "1.5"]
    assert cells[14] == "long_scoreboard 9.3, barrier 4.3, wait 1.5"


def test_bench_markdown_renders_a_bench_json(tmp_path, capsys):
    """Rows of ``python -m tilefuse bench --json`` (bytes and µs, no GB/s of their own) become table rows with their
    target; a failed row is listed with its error."""
    m = _load("bench_markdown")
    rows = [{"op": "per_token_cast", "shape": "8001x7168", "bytes": 150e6, "us": 40.0, "pct_ceiling": 93.8},
            {"op": "cast_back", "shape": "small", "bytes": 10e6, "us": 5.0, "pct_ceiling": 50.0},
            {"op": "per_block_cast", "shape": "8001x7168", "bytes": 100e6, "us": 30.0, "pct_ceiling": 83.0},
            {"op": "transpose", "shape": "x", "error": "boom"}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "date": "2026-11-30 11:39 UTC", "copy_ceiling_gbs": 4000.0,
                                "rows": rows}))
    assert m.main(str(path)) == 0
    out = capsys.readouterr().out
    assert "**4000 GB/s** (NVIDIA H200, 2026-11-30 11:39 UTC)" in out
    assert "| per_token_cast | 8001x7168 | 40.0 | 3750 | 93.8 | >= 92%: met |" in out
    assert "| cast_back | small | 5.0 | 2000 | 50.0 | < 64 MB: reported (10.0 MB) |" in out
    assert "| per_block_cast | 8001x7168 | 30.0 | 3333 | 83.0 | >= 90%: not met |" in out
    assert "| transpose | x | boom | | | |" in out
