"""CPU tests of the developer tools under tools/ that parse device output."""
import importlib.util
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


def test_ncu_cases_picks_bench_rows_by_label():
    """The profiler driver imports the bench's runner (no GPU needed to load it) and reads case labels without
    building inputs."""
    n = _load("ncu_cases")
    quick = n.select_cases(True, ["per_channel_cast"])
    assert [n.case_label(c) for c in quick] == ["bf16 8064x7168 npt128 round"]
