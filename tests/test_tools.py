"""CPU tests of the developer tools under tools/ that parse device output."""
import importlib.util
import pathlib
import shutil

import pytest
import torch

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
    units = ["", "us", "cycle", "cycle", "%", "%", "%", "Gbyte", "Mbyte", "sector", "register/thread", "", "", "", ""]
    row = ["k_kernel", "25.0", "40,000", "50,000", "32.5", "81.0", "39.5", "0.036", "31.5", "1,000,000", "40",
           "4.3", "9.0", "9.3", "1.5"]
    lines = s.summarize([header, units, row])
    assert len(lines) == 2
    cells = [c.strip() for c in lines[1].split("|")]
    assert cells[:10] == ["k_kernel", "25.0", "80.0", "32.5", "81.0", "39.5", "36.0", "31.5", "32.0", "40"]
    assert cells[10] == "long_scoreboard 9.3, barrier 4.3, wait 1.5"


def test_lossless_shapes_stream_check():
    """The stream kernels' check accepts their definition (output vector k of a thread = its input vector k mod 5M,
    first word xor k) for each CTA shape, and rejects a shifted output."""
    s = _load("lossless_shapes")
    for kind, (nt, m) in s._STREAM_SHAPES.items():
        x = torch.randint(-2**31, 2**31 - 1, (2 * 5 * m * nt, 4), dtype=torch.int32)
        v = x.view(-1, 5 * m, nt, 4)
        out = torch.stack([v[:, k % (5 * m)] ^ torch.tensor([k, 0, 0, 0], dtype=torch.int32)
                           for k in range(8 * m)], 1).reshape(-1, 4)
        assert s._stream_ok(kind, x, out)
        assert not s._stream_ok(kind, x, out.roll(1, 0))


def test_lossless_shapes_kernels_compile(tmp_path):
    """tools/_lossless_shapes.cu builds for sm_90 (the device builds it the same way)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    lib = _load("lossless_shapes").compile_kernels(str(tmp_path / "ls.so"), nvcc)
    assert pathlib.Path(lib).stat().st_size > 0
