"""Importing tilefuse (and every area) imports no TileLang/TVM module and compiles nothing; the runtime
(``tilefuse._jit``) never imports the bench; the import overhead over ``import torch`` is measured and reported,
not asserted."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AREAS = ["quant", "transpose", "moe", "engram", "mhc", "rand", "transform", "modeling", "modeling.engram", "modeling.mhc",
         "reference", "testing", "formats", "cli"]
FORBIDDEN = ("tilelang", "tvm", "tvm_ffi")

# Runs in a fresh interpreter: imports torch, then tilefuse, then each area; after each step records
# any forbidden module and the number of frames torch.compile (dynamo) has processed.
PROBE = r"""
import importlib, json, sys, time
FORBIDDEN = %r
def leaked():
    return sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
def compiled_frames():
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    return 0 if dynamo_utils is None else int(dynamo_utils.counters["frames"]["total"])
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
steps = []
import tilefuse
steps.append(["tilefuse", leaked(), compiled_frames()])
t2 = time.perf_counter()
for area in %r:
    importlib.import_module("tilefuse." + area)
    steps.append(["tilefuse." + area, leaked(), compiled_frames()])
from tilefuse._registry import load_all
load_all()
steps.append(["tilefuse._registry.load_all()", leaked(), compiled_frames()])
t3 = time.perf_counter()
print(json.dumps({"steps": steps, "torch_ms": (t1 - t0) * 1e3, "tilefuse_ms": (t2 - t1) * 1e3,
                  "all_areas_ms": (t3 - t1) * 1e3}))
"""


def _probe(tmp_path):
    cache = tmp_path / "tilelang-cache"
    env = dict(os.environ, TILELANG_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", PROBE % (FORBIDDEN, AREAS)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), cache


def test_import_loads_no_tilelang_and_compiles_nothing(tmp_path, record_property, capsys):
    report, cache = _probe(tmp_path)
    for step, leaked, frames in report["steps"]:
        assert leaked == [], f"import {step} loaded {leaked}"
        assert frames == 0, f"import {step} ran torch.compile on {frames} frames"
    assert not cache.exists() or not any(cache.iterdir()), "importing wrote to the TileLang cache"
    line = (f"import overhead: torch {report['torch_ms']:.0f} ms; + tilefuse {report['tilefuse_ms']:.1f} ms; "
            f"+ every area {report['all_areas_ms']:.0f} ms")
    record_property("import_overhead", line)
    with capsys.disabled():
        print(f"\n[test_import] {line}")


def test_runtime_does_not_import_the_bench(tmp_path):
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path / "tilelang-cache"), PYTHONPATH=str(REPO))
    code = ("import sys, tilefuse._jit; tilefuse._jit.registered(); "
            "assert 'tilefuse.bench' not in sys.modules, sorted(m for m in sys.modules if m.startswith('tilefuse'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    source = (REPO / "tilefuse" / "_jit.py").read_text()
    assert "tilefuse.bench" not in source and "import bench" not in source


def _bench_imports() -> dict[str, set[str]]:
    """``module -> the tilefuse.bench modules it imports`` for each module of tilefuse/bench/ (every import
    statement, at module level or inside a function)."""
    import ast

    found = {}
    for path in sorted((REPO / "tilefuse" / "bench").glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names |= {f"{node.module}.{a.name}" for a in node.names}
        found[path.stem] = {n.split(".")[2] for n in names if n.startswith("tilefuse.bench.")}
    return found


def test_bench_arrows_point_one_way():
    """cli -> runner (report, extras) -> case modules -> core (peers); nothing imports back up, and the runner
    collects the case modules from its one list of areas."""
    from tilefuse.bench import runner

    imports = _bench_imports()
    cases = set(runner.AREAS)
    assert cases <= set(imports), sorted(imports)
    for area in cases:
        assert imports[area] <= {"core", "peers"}, (area, imports[area])
    assert imports["core"] == set() and imports["peers"] <= {"core"}
    assert imports["runner"] <= {"core", "peers"}  # its case modules come from AREAS (importlib)
    assert imports["report"] <= {"core", "peers"} and imports["extras"] <= {"core", *cases}
    assert "cli" not in set().union(*(v for k, v in imports.items() if k != "cli"))
    assert imports["__init__"] == set()
