"""The command line: ``info`` lists every op with its path and the native launcher's state, ``demo`` runs every
stage on the CPU, ``bench`` forwards its arguments or exits 2 when its module is missing, ``precompile`` chooses
its work list (``--bench``: from ``tilefuse.bench.runner``) and hands it to ``tilefuse._jit.precompile``. A bad argument
of any command is one line on stderr and exit status 2, never a traceback."""
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tilefuse import cli

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO.parent / "shared" / "spec" / "api.json"
AREAS = ("engram", "mhc", "moe", "quant", "rand", "transpose")
# A small demo keeps the test fast; hidden stays at the Engram backward's minimum (1024).
DEMO_TOKENS = 16


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "tilefuse", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _spec_ops() -> set[str]:
    """Every public op of the areas per the spec (aliases share their target's registry entry)."""
    spec = json.loads((SPEC if SPEC.exists() else REPO / "tests" / "api.json").read_text())
    return {f"{area}.{name}" for area in AREAS for name, entry in spec[area].items()
            if not entry.get("note", "").startswith("alias of")}


def _info_ops(stdout: str) -> dict[str, str]:
    """Parse the per-area op table of ``info``: {"area.name": path}."""
    ops, area = {}, None
    for line in stdout.splitlines():
        if m := re.fullmatch(r"\[(\w+)\]", line):
            area = m.group(1)
        elif area and (m := re.fullmatch(r"  (\w+) +(kernel|reference|torch)", line)):
            ops[f"{area}.{m.group(1)}"] = m.group(2)
    return ops


def test_info_lists_every_op_with_a_path():
    result = _run("info")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for label in ("tilefuse", "torch", "tilelang", "cache"):
        assert re.search(rf"^{label} ", out, re.M), f"info has no {label} line"
    assert re.search(r"^native +(ready|not built|failed|no compiler|disabled): \S", out, re.M), out
    from tilefuse._registry import load_all

    listed = _info_ops(out)
    assert listed == {key: entry["path"] for key, entry in load_all().items()}
    missing = _spec_ops() - set(listed)
    assert not missing, f"public ops missing from the registry (no @public?): {sorted(missing)}"


def test_info_reports_the_tilelang_cache_dir(monkeypatch, capsys):
    monkeypatch.setenv("TILELANG_CACHE_DIR", "/some/cache/dir")
    assert cli.main(["info"]) == 0
    assert re.search(r"^cache +/some/cache/dir$", capsys.readouterr().out, re.M)
    monkeypatch.delenv("TILELANG_CACHE_DIR")
    assert cli.tilelang_cache_dir() == os.path.expanduser("~/.tilelang/cache")


def test_forwarded_commands(monkeypatch, capsys):
    fake = types.ModuleType("tilefuse_fake_bench")
    fake.main = lambda argv: 7 if argv == ["--ops", "quant"] else 0
    monkeypatch.setitem(sys.modules, "tilefuse_fake_bench", fake)
    monkeypatch.setitem(cli._FORWARDED, "bench", ("tilefuse_fake_bench", "main"))
    assert cli.main(["bench", "--ops", "quant"]) == 7
    monkeypatch.setitem(cli._FORWARDED, "bench", ("tilefuse._no_such_module", "main"))
    assert cli.main(["bench"]) == 2
    assert "tilefuse._no_such_module is missing" in capsys.readouterr().err
    monkeypatch.setitem(cli._FORWARDED, "bench", ("tilefuse_fake_bench", "no_such_function"))
    assert cli.main(["bench"]) == 2


def test_precompile_chooses_the_work_list(monkeypatch, capsys):
    from tilefuse import _jit

    calls = []
    monkeypatch.setattr(_jit, "precompile", lambda work, **kw: calls.append((work, kw)) or 0)
    fake_bench = types.ModuleType("tilefuse.bench.runner")
    fake_bench.bench_configs = lambda ops: [("per_token_cast", ("from the bench", tuple(ops or ())))]
    monkeypatch.setitem(sys.modules, "tilefuse.bench.runner", fake_bench)

    assert cli.main(["precompile", "--bench", "--ops", "per_token_cast", "--arch", "sm_90", "--jobs", "3",
                     "--force", "--no-native"]) == 0
    assert calls == [([("per_token_cast", ("from the bench", ("per_token_cast",)))],
                      {"arch": "sm_90", "jobs": 3, "force": True, "native": False})]

    calls.clear()
    assert cli.main(["precompile", "--ops", "batched_transpose"]) == 0
    (work, kw), = calls
    assert work == _jit.select(["batched_transpose"])
    assert work and all(name.startswith("batched_transpose") for name, _ in work)
    assert kw == {"arch": None, "jobs": kw["jobs"], "force": False, "native": True} and kw["jobs"] >= 1

    calls.clear()
    capsys.readouterr()
    assert cli.main(["precompile", "--list", "--ops", "batched_transpose"]) == 0
    assert calls == []
    assert capsys.readouterr().out.splitlines() == [f"{name} {cfg}" for name, cfg in work]


def test_usage_and_unknown_command(capsys):
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert cli.main([]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "python -m tilefuse: error: a command is needed: info, demo, bench or precompile (python -m tilefuse --help)"]
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


HIDDEN_RULE = "--hidden must be a multiple of 512 and >= 1024 (the Engram backward's rule)"
# (arguments, what the one stderr line says after "python -m tilefuse CMD: error: ")
BAD_INVOCATIONS = [
    (["demo", "--repeat", "0"], "--repeat must be >= 1, got 0"),
    (["demo", "--repeat", "-1"], "--repeat must be >= 1, got -1"),
    (["demo", "--hidden", "1000"], f"{HIDDEN_RULE}, got 1000"),
    (["demo", "--hidden", "512"], f"{HIDDEN_RULE}, got 512"),
    (["demo", "--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["demo", "--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["demo", "--seed", "-1"], "--seed must be in [0, 2**64), got -1"),
    (["demo", "--tokens", "many"], "argument --tokens: invalid int value: 'many'"),
    (["precompile", "--ops", "nosuchop"], "--ops: no kernel name starts with 'nosuchop'; the kernels are: "),
    (["precompile", "--ops"], "--ops needs at least one name"),
    (["precompile", "--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["precompile", "--arch", "90"], "--arch must look like sm_90 (sm_ and the compute capability), got '90'"),
    (["info", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("argv,message", BAD_INVOCATIONS, ids=" ".join)
def test_bad_arguments_are_one_line_and_exit_2(argv, message):
    """Checked before any work: the whole stderr is one line naming the command, no traceback, exit status 2."""
    result = _run(*argv)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"python -m tilefuse {argv[0]}: error: {message}"), lines[0]
    assert result.stdout == ""


def test_unknown_precompile_ops_list_the_kernels(capsys):
    from tilefuse import _jit

    assert cli.main(["precompile", "--ops", "per_token_cast", "nosuchop", "alsonot"]) == 2
    line, = capsys.readouterr().err.splitlines()
    kernels = ", ".join(sorted(_jit.registered()))
    assert f"no kernel name starts with 'nosuchop', 'alsonot'; the kernels are: {kernels}" in line


def test_run_demo_needs_a_repeat_of_at_least_one():
    import torch

    from tilefuse.demo import Config, run_demo

    for repeat in (0, -1, True):
        with pytest.raises(ValueError, match=f"run_demo: repeat must be an int >= 1, got {repeat!r}"):
            run_demo(Config(tokens=4), torch.device("cpu"), repeat)


def test_demo_without_cuda_is_a_usage_error(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["demo", "--device", "cuda:0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "python -m tilefuse demo: error: --device cuda:0: no CUDA device is available (use --device cpu)"]


def test_a_command_module_can_raise_a_usage_error(monkeypatch, capsys):
    """The mechanism a forwarded command (bench) uses: raising _cli_errors.UsageError, or an error of its
    _cli_errors.ArgumentParser, gives the same one line and exit status 2."""
    from tilefuse._cli_errors import ArgumentParser, UsageError

    def fake_main(argv):
        parser = ArgumentParser(prog="python -m tilefuse bench")
        parser.add_argument("--report", nargs="+")
        args = parser.parse_args(argv)
        raise UsageError(f"python -m tilefuse bench: error: --report: no such file\n{args.report[0]}")

    fake = types.ModuleType("tilefuse_fake_bench")
    fake.main = fake_main
    monkeypatch.setitem(sys.modules, "tilefuse_fake_bench", fake)
    monkeypatch.setitem(cli._FORWARDED, "bench", ("tilefuse_fake_bench", "main"))
    assert cli.main(["bench", "--report", "missing.json"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "python -m tilefuse bench: error: --report: no such file missing.json"]
    assert cli.main(["bench", "--nope"]) == 2
    assert capsys.readouterr().err.splitlines() == ["python -m tilefuse bench: error: unrecognized arguments: --nope"]


@pytest.mark.parametrize("state,detail,line", [
    ("ready", "/c/tilefuse_native-x.so", "native      ready: /c/tilefuse_native-x.so"),
    ("not built", "it builds on first use (15-25 s)", "native      not built: it builds on first use (15-25 s); "
                                                      "python -m tilefuse info --native builds it now"),
    ("failed", "RuntimeError: c++ -std=c++20 failed on _native.cc: x.h:1:2: error: boom",
     "native      failed: RuntimeError: c++ -std=c++20 failed on _native.cc: x.h:1:2: error: boom"),
    ("no compiler", "c++ is not on the PATH (set CXX): the launchers take their Python path",
     "native      no compiler: c++ is not on the PATH (set CXX): the launchers take their Python path"),
])
def test_info_reports_the_native_launcher_without_building_it(monkeypatch, capsys, state, detail, line):
    from tilefuse import _native

    monkeypatch.setattr(_native, "status", lambda: (state, detail))
    monkeypatch.setattr(_native, "module", lambda: pytest.fail("plain info must not build the extension"))
    assert cli.main(["info"]) == 0
    assert line in capsys.readouterr().out.splitlines()


def test_info_native_builds_then_reports(monkeypatch, capsys):
    from tilefuse import _native

    built = []
    monkeypatch.setattr(_native, "module", lambda: built.append(1))
    monkeypatch.setattr(_native, "status", lambda: ("ready", "/c/x.so") if built else ("not built", "later"))
    monkeypatch.delenv("TILEFUSE_NATIVE", raising=False)
    assert cli.main(["info", "--native"]) == 0
    assert built == [1]
    assert re.search(r"^native      ready: /c/x\.so \(built or loaded in \d+\.\d s\)$", capsys.readouterr().out, re.M)


def test_demo_runs_every_stage_on_cpu():
    from tilefuse.demo import STAGES

    result = _run("demo", "--device", "cpu", "--tokens", str(DEMO_TOKENS))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        if m := re.match(r"(\S+) +(\d\.\d{6}e[+-]\d+) +(\d+\.\d+) +(reference|kernel|torch) +\w+ \(", line):
            rows[m.group(1)] = (float(m.group(2)), m.group(4))
    assert list(rows) == list(STAGES)
    for stage, (checksum, path) in rows.items():
        assert checksum > 0, f"{stage}: all-zero outputs"
        assert path in ("reference", "torch"), f"{stage}: CPU tensors must take the reference, got {path}"
    assert f"demo: {DEMO_TOKENS} tokens" in result.stdout
    assert "bitwise equal" in result.stdout


@pytest.mark.gpu
def test_demo_runs_on_gpu():
    result = _run("demo", "--device", "cuda", "--tokens", "64", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
