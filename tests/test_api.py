"""The public API matches spec/api.json: every name exists as ``tilefuse.<module>.<name>``, is callable,
and its parameters start with the listed names in order (keyword-only ones as listed). Extra parameters
may follow, but only with defaults."""
import importlib
import inspect
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_SPEC = REPO.parent / "shared" / "spec" / "api.json"
LOCAL_SPEC = REPO / "tests" / "api.json"
EXPECTED_COUNT = 122


def _load_spec() -> dict:
    return json.loads((SHARED_SPEC if SHARED_SPEC.exists() else LOCAL_SPEC).read_text())


SPEC = _load_spec()
ENTRIES = [(module, name, entry) for module, names in sorted(SPEC.items()) for name, entry in sorted(names.items())]
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _alias_target(entry: dict) -> str | None:
    note = entry.get("note", "")
    return note.split("alias of ", 1)[1].strip() if note.startswith("alias of ") else None


def test_spec_copies_agree():
    if not SHARED_SPEC.exists():
        pytest.skip("no shared spec next to the repository; tests/api.json is the reference")
    assert json.loads(SHARED_SPEC.read_text()) == json.loads(LOCAL_SPEC.read_text())


def test_spec_has_all_names():
    assert len(ENTRIES) == EXPECTED_COUNT


@pytest.mark.parametrize("module,name,entry", ENTRIES, ids=[f"{m}.{n}" for m, n, _ in ENTRIES])
def test_public_name(module, name, entry):
    mod = importlib.import_module(f"tilefuse.{module}")
    assert hasattr(mod, name), f"tilefuse.{module} has no attribute {name}"
    obj = getattr(mod, name)
    assert callable(obj), f"tilefuse.{module}.{name} is not callable"
    target = _alias_target(entry)
    if target is not None:  # an alias must take the parameters of its target
        entry = SPEC[module][target]
    if not entry["params"] and not entry["kwonly"]:
        return
    params = list(inspect.signature(obj).parameters.values())
    positional = [p.name for p in params if p.kind in POSITIONAL]
    kwonly = [p.name for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY]
    want, want_kw = entry["params"], entry["kwonly"]
    assert positional[:len(want)] == want, f"{module}.{name}: positional parameters {positional}, spec {want}"
    assert kwonly[:len(want_kw)] == want_kw, f"{module}.{name}: keyword-only parameters {kwonly}, spec {want_kw}"
    listed = set(want) | set(want_kw)
    extra = [p.name for p in params if p.name not in listed and p.kind in (*POSITIONAL, inspect.Parameter.KEYWORD_ONLY)
             and p.default is inspect.Parameter.empty]
    assert not extra, f"{module}.{name}: parameters beyond the spec must have defaults: {extra}"


@pytest.mark.parametrize("module", sorted(SPEC))
def test_module_all_exports_the_spec_names(module):
    mod = importlib.import_module(f"tilefuse.{module}")
    exported = set(getattr(mod, "__all__", ()))
    if module == "reference":  # the reference table of API.md is the whole of tilefuse.reference
        assert exported == set(SPEC[module])
    else:
        assert set(SPEC[module]) <= exported, f"missing from tilefuse.{module}.__all__: {set(SPEC[module]) - exported}"


def test_engram_gate_fn_is_an_autograd_function():
    from tilefuse.modeling.engram import EngramGateFn

    assert issubclass(EngramGateFn, torch.autograd.Function)


def test_readme_quickstart_and_examples():
    """The README's quickstart is exactly the two documented commands, and its API-tour examples run."""
    import re

    readme = (REPO / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("```", 2)[1].strip().splitlines()
    assert quickstart == ['pip install -e ".[dev]" && python -m tilefuse demo', "python -m pytest -n 2 -q"]
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", readme, re.S):
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["back"].shape == namespace["x"].shape
    assert namespace["R"].shape == (1, 8, 4, 256)



def test_meta_tensors_infer_shapes_or_are_refused():
    """A tensor on the meta device (no data): an op that computes only shapes returns meta outputs with the CPU
    call's shapes and dtypes; an op that reads values on the host refuses it, ValueError naming the op and the
    argument, where raw torch errors came before (Cannot copy out of meta tensor; Tensor.item())."""
    import tilefuse.moe as moe
    import tilefuse.quant as quant

    x = torch.randn(4, 256)
    for got, want in zip(quant.per_token_cast(x.to("meta"), "e4m3", 128), quant.per_token_cast(x, "e4m3", 128)):
        assert got.is_meta and (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
    idx = torch.tensor([[0, 1], [2, -1], [1, 3], [0, 2]])
    bound = 4 * 2 + 8 * 31  # routed slots plus the worst-case alignment padding
    got = moe.get_fused_mapping(idx.to("meta"), 8, bound, 32, True)
    want = moe.get_fused_mapping(idx, 8, bound, 32, True)
    assert [(t.shape, t.dtype) for t in got[:7]] == [(t.shape, t.dtype) for t in want[:7]]
    with pytest.raises(ValueError, match=r"^get_fused_mapping: topk_idx must be on a CPU or CUDA device: with "
                                         r"num_expanded_tokens == 0 .* a tensor on the meta device has no data$"):
        moe.get_fused_mapping(idx.to("meta"), 8, 0, 32)
    data = torch.zeros(128, 64, dtype=torch.int8)  # e2m1 pairs of a (128, 128) tensor
    sf = torch.ones(128, 4)  # per (1, 32) block
    quant.per_block_cast_lossless((data, sf), "e4m3", (1, 32), (128, 128))
    with pytest.raises(ValueError, match=r"^per_block_cast_lossless: x must be on a CPU or CUDA device: its "
                                         r"exactness rule .* is read on the host, and a tensor on the meta device"):
        quant.per_block_cast_lossless((data.to("meta"), sf.to("meta")), "e4m3", (1, 32), (128, 128))
