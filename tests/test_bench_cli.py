"""``python -m tilefuse bench``'s arguments: each bad one is refused before anything runs, in one line on stderr
(``python -m tilefuse bench: error: ...``) with exit status 2 and no traceback; ``--help`` describes the command;
``--list`` answers in seconds."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tilefuse.bench import cli, runner

REPO = Path(__file__).resolve().parents[1]
PREFIX = "python -m tilefuse bench: error: "


def _refused(capsys, argv: list[str]) -> str:
    """Run ``main(argv)``: it must exit 2 with one stderr line and print nothing; returns that line's message."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
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
    assert message.startswith("--ops: unknown name(s) nosuchop; areas: quant, transpose, moe; ops: ")
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
