"""TILEFUSE_KNOBS: tuning overrides of kernel-module constants for benchmark sweeps (``_jit.knobs``)."""
import subprocess
import sys

import pytest

from tilefuse import _jit

_MOD = "tilefuse.quant._per_block_cast_kernel"


def test_knobs_parse_only_the_named_module(monkeypatch):
    monkeypatch.setenv("TILEFUSE_KNOBS", f"{_MOD}.E2M1_32_WARPS=2; tilefuse.quant._norm_kernel._RB=(1, 2) ;")
    assert _jit.knobs(_MOD) == {"E2M1_32_WARPS": 2}
    assert _jit.knobs("tilefuse.quant._norm_kernel") == {"_RB": (1, 2)}
    assert _jit.knobs("tilefuse.quant._swiglu_kernel") == {}
    monkeypatch.delenv("TILEFUSE_KNOBS")
    assert _jit.knobs(_MOD) == {}


def _probe(knobs: str | None) -> subprocess.CompletedProcess:
    code = (f"import tilefuse.quant._per_block_cast_kernel as K; from tilefuse import _jit; "
            f"print(K.E2M1_32_WARPS, _jit._module_digest('{_MOD}'))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    if knobs is not None:
        env["TILEFUSE_KNOBS"] = knobs
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_knob_sets_the_constant_and_changes_the_cache_key():
    base, tuned = _probe(None), _probe(f"{_MOD}.E2M1_32_WARPS=7")
    assert base.returncode == 0 and tuned.returncode == 0, base.stderr + tuned.stderr
    (pipe0, digest0), (pipe1, digest1) = base.stdout.split(), tuned.stdout.split()
    assert pipe1 == "7" and pipe0 != "7"
    assert digest0 != digest1


def test_an_unknown_knob_is_an_error():
    bad = _probe(f"{_MOD}.NO_SUCH_KNOB=1")
    assert bad.returncode != 0 and "has no constant NO_SUCH_KNOB" in bad.stderr


def test_a_modules_own_helpers_are_part_of_its_digest(monkeypatch):
    """A helper module named in a kernel module's ``KERNEL_HELPERS`` is part of that module's cache key (and not of
    every other kernel's, as ``SHARED_KERNEL_MODULES`` would make it)."""
    from tilefuse import _jit
    from tilefuse.mhc import _expand_kernel as K

    monkeypatch.setattr(_jit, "_DIGESTS", {})
    with_helper = _jit._module_digest(K.__name__)
    monkeypatch.setattr(K, "KERNEL_HELPERS", ())
    _jit._DIGESTS.clear()
    assert _jit._module_digest(K.__name__) != with_helper
    assert "tilefuse.mhc._rows" not in _jit.SHARED_KERNEL_MODULES
