"""``python -m tilefuse bench``'s arguments: each bad one is refused before anything runs, in one line on stderr
(``python -m tilefuse bench: error: ...``) with exit status 2 and no traceback; ``--help`` describes the command;
``--list`` answers in seconds."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tilefuse import cli as tilefuse_cli
from tilefuse.bench import cli, runner

REPO = Path(__file__).resolve().parents[1]
PREFIX = "python -m tilefuse bench: error: "


def _refused(capsys, argv: list[str]) -> str:
    """Run ``python -m tilefuse bench ARGV`` in-process: it must exit 2 with one stderr line and print nothing;
    returns that line's message."""
    assert tilefuse_cli.main(["bench", *argv]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), err
    assert "Traceback" not in err and out == ""
    return lines[0][len(PREFIX):]


def test_report_of_a_missing_file(capsys, tmp_path):
    missing = tmp_path / "missing.json"
    assert _refused(capsys, ["--report", str(missing)]) == f"--report: no such file {str(missing)!r}"


def test_report_of_a_file_that_is_no_saved_run(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert _refused(capsys, ["--report", str(bad)]).startswith("--report: JSONDecodeError: ")
    bad.write_text('{"rows": 3}')
    assert _refused(capsys, ["--report", str(bad)]).startswith("--report: TypeError: ")


def test_unknown_op_names_list_the_valid_ones(capsys):
    message = _refused(capsys, ["--ops", "nosuchop", "quant", "--list"])
    assert message.startswith(f"--ops: unknown name(s) nosuchop; areas: {', '.join(runner.AREAS)}; ops: ")
    assert all(name in message for name in runner.valid_names())
    assert "give at least one name" in _refused(capsys, ["--ops", "--list"])


@pytest.mark.parametrize("argv, message", [
    (["--compare", "--peers", "tk3,tk2"], "--peers: unknown tk3; choose from compile, liger, tk1, tk2"),
    (["--peers", "nope"], "--peers: unknown nope; choose from compile, liger, tk1, tk2"),
    (["--timer", "wall"], "--timer must be isolated, stream or isolated,stream, got 'wall'"),
    (["--warm-jobs", "-1"], "--warm-jobs must be >= 0, got -1"),
    (["--warm-jobs", "many"], "argument --warm-jobs: invalid int value: 'many'"),
    (["--tiles", "256"], "--tiles must be THREADSxVECTORS[xLANES[xORDER[xCTAS]]] tiles joined by commas, e.g. "
                         "256x4,512x8; got '256'"),
    (["--tiles", "256x4,0x8"], "--tiles must be THREADSxVECTORS[xLANES[xORDER[xCTAS]]] tiles joined by commas, "
                               "e.g. 256x4,512x8; got '256x4,0x8'"),
    (["--tile-cases", "e2m1"], "--tile-cases needs --tiles"),
    (["--side-by-side"], "--side-by-side needs --report"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_arguments_are_one_line(capsys, argv, message):
    assert _refused(capsys, argv) == message


def test_bad_regex_and_missing_output_folder(capsys, tmp_path):
    assert _refused(capsys, ["--list", "--match", "(x"]).startswith("--match: not a regular expression (")
    target = tmp_path / "no" / "run.json"
    assert _refused(capsys, ["--json", str(target)]) == (f"--json: no such directory {str(target.parent)!r} for "
                                                         f"{str(target)!r}")


def test_help_describes_the_command(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m tilefuse bench")
    assert " ".join(cli.DESCRIPTION.split()) in " ".join(out.split())


def test_command_line_errors_end_the_process_in_one_line(tmp_path):
    """The same through ``python -m tilefuse``: exit status 2, one stderr line, no traceback."""
    for argv in (["--report", str(tmp_path / "missing.json")], ["--ops", "nosuchop", "--list"]):
        done = subprocess.run([sys.executable, "-m", "tilefuse", "bench", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 2 and done.stdout == "", done.stderr
        assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(PREFIX), done.stderr


def test_list_of_the_whole_grid_answers_in_seconds(capsys):
    """Listing builds no input (``Case.describe``): the whole grid (about 2000 cases) in well under a minute on a
    shared CPU, where building each case's inputs on fake tensors took minutes."""
    t0 = time.perf_counter()
    assert cli.main(["--list"]) == 0
    seconds = time.perf_counter() - t0
    assert len(capsys.readouterr().out.splitlines()) > 2000
    assert seconds < 30, seconds


def test_a_run_prints_its_table_and_report_rebuilds_it(monkeypatch, capsys, tmp_path):
    """The measured path end to end on the CPU: the cases built at 1/64 scale on CPU tensors, the GPU timers
    replaced by stand-ins (10 µs a call, a 4000 GB/s copy), TileKernels 2.1.0 replaced by our own ops. The run
    prints one progress line per case and the table with its peer columns, saves its JSON, and ``--report``
    rebuilds the tables from that file."""
    import types

    import torch

    from tilefuse import moe, quant, transpose
    from tilefuse.bench import peers

    real_select = runner.select_cases

    def on_cpu(*args, **kwargs):
        return [c._replace(make=lambda device, scale, make=c.make: make("cpu", 1 / 64))
                for c in real_select(*args, **kwargs)]

    def isolated_us(fn, reps=25, warmup=2, setup=None):
        if setup is not None:
            setup()
        fn()
        return 10.0

    monkeypatch.setattr(runner, "select_cases", on_cpu)
    monkeypatch.setattr(runner, "isolated_us", isolated_us)
    monkeypatch.setattr(runner, "copy_us", lambda nbytes: nbytes / 4e6)
    monkeypatch.setattr(peers, "load", lambda peer: types.SimpleNamespace(quant=quant, moe=moe, transpose=transpose))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "stand-in GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    saved = tmp_path / "run.json"
    assert cli.main(["--quick", "--ops", "per_channel_cast", "topk_gate", "--compare", "--peers", "tk2",
                     "--json", str(saved)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["  [1/2] per_channel_cast | bf16 128x128 npt128 round | 10.0 us | tk2 10.0 us 1.00x",
                       "  [2/2] topk_gate | fp32 128x256 top8 | 10.0 us | tk2 10.0 us 1.00x"], out
    assert out[3].startswith("stand-in GPU, ") and out[3].endswith("; timer: isolated; copy ceiling (2 GiB) 4000 GB/s")
    assert out[5] == ("| op | shape | MB | µs (isolated) | % copy (same bytes) | % 2 GiB copy | TileKernels 2.1.0 µs "
                      "| speedup |")
    nbytes = 128 * 128 * 2 + 128 * 128 + 128 * 4  # bf16 x read, e4m3 out and one fp32 sf row written
    pct = 100 * nbytes / 4e6 / 10.0  # the same-size copy and the 2 GiB copy both move 4000 GB/s here
    assert out[7] == (f"| per_channel_cast | bf16 128x128 npt128 round | {nbytes / 1e6:.1f} | 10.0 | {pct:.1f} | "
                      f"{pct:.1f} | 10.0 | 1.00x |")
    assert out[10].startswith("no case of >= 32 MiB ran on both tilefuse and TileKernels 2.1.0")
    assert cli.main(["--report", str(saved)]) == 0
    report = capsys.readouterr().out
    assert "| per_channel_cast | bf16 TxH npt128 round | TK 2.1.0 | 128: - 1.00 - - |" in report
    # both timers, no peer: the stream column follows the isolated one
    monkeypatch.setattr(runner, "median_us", lambda fn, n_sets, **kw: (fn(0), 12.0)[1])
    assert cli.main(["--quick", "--ops", "transpose", "--match", "row stride", "--timer", "isolated,stream",
                     "--no-compile-ref"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "  [1/1] transpose | e4m3 128x128 row stride 2H | 10.0 us"
    assert out[4] == "| op | shape | MB | µs (isolated) | % copy (same bytes) | % 2 GiB copy | µs (stream) |"
    assert out[6].startswith("| transpose | e4m3 128x128 row stride 2H | 0.0 | 10.0 | ") and out[6].endswith(" 12.0 |")
