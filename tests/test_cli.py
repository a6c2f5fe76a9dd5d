"""The command line: ``info`` lists every op with its path, ``demo`` runs every stage on the CPU,
``bench`` forwards its arguments or exits 2 when its module is missing, ``precompile`` chooses its work list
(``--bench``: from ``tilefuse.bench.runner``) and hands it to ``tilefuse._jit.precompile``."""
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
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


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
