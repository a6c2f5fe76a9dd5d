"""CPU tests of ``bench --compare``: the grid's coverage, its references and peer calls, the output comparison,
and the tables built from saved results."""
import re
import types

import pytest
import torch

from tilefuse import _registry, moe, quant, transpose
from tilefuse.bench import core, report, runner
from tilefuse.bench import moe as bench_moe
from tilefuse.bench import peers as _peers
from tilefuse.bench.quant import HIDDEN, TOKENS

GRID = runner.select_cases(False, None)
MOE_GRID = [c for c in GRID if c.name in bench_moe.OPS]
QT_GRID = [c for c in GRID if runner.area_of(c.name) in ("quant", "transpose")]  # the hidden-size grid
# the small cases of the grid, run on the CPU (each op's reference path)
SMALL = [c for c in GRID if c.tokens == 128 and ("x1536" in c.key or " 1536)" in c.key or "x3072" in c.key)]


def test_every_quant_and_transpose_kernel_op_is_in_the_grid():
    kernel_ops = {name.split(".", 1)[1] for name, rec in _registry.load_all().items()
                  if rec["path"] == "kernel" and name.split(".")[0] in ("quant", "transpose")}
    # batched_transpose_weight_sf converts weight sf (G, N/128, K/128), not activations: its rows are --quick's
    assert kernel_ops - {c.name for c in GRID} == {"batched_transpose_weight_sf"}


def test_grid_spans_hidden_sizes_and_token_counts():
    assert len(HIDDEN) >= 5 and min(HIDDEN) == 1536 and max(HIDDEN) == 18432
    for name in {c.name for c in QT_GRID}:
        tokens = {c.tokens for c in QT_GRID if c.name == name}
        keys = {c.key for c in QT_GRID if c.name == name}
        assert tokens >= {128, 4096} and tokens <= set(TOKENS), name
        assert len(keys) >= 5, name  # five hidden sizes (times the flag sets)
    ptc = {c.key.split("|")[1] for c in GRID if c.name == "per_token_cast"}
    for flags in (" e4m3 col round ue8m0", " e4m3 round", " e2m1", "fp32 "):
        assert any(flags in k for k in ptc), flags


def test_every_grid_case_names_a_peer_or_a_reference():
    for c in GRID:
        assert c.ref is not None and (c.peers or c.name in ("per_token_cast_and_cast_back",)), c.key
        assert c.key and c.tokens in runner.area_module(runner.area_of(c.name)).TOKENS


@pytest.mark.parametrize("case", SMALL, ids=[c.key for c in SMALL])
def test_reference_and_peer_calls_compute_our_op(case):
    """On the CPU our op takes its reference: the case's torch.compile reference and its peer calls (here against
    a stand-in module holding our own ops) must give the same outputs, bitwise where the spec is exact."""
    torch.manual_seed(0)
    _, inputs = case.make("cpu", 1.0)
    ours = case.run(*core._clone(inputs))
    ok, text = _peers.agree(ours, case.ref(*core._clone(inputs)), case.exact)
    assert ok, f"reference: {text}"
    stand_in = types.SimpleNamespace(quant=quant, transpose=transpose)
    for peer, call in (case.peers or {}).items():
        ok, text = _peers.agree(ours, call(stand_in, *core._clone(inputs)), case.exact)
        assert ok, f"{peer}: {text}"


def test_agree_is_bitwise_and_reads_strided_views_logically():
    a = torch.randn(8, 4)
    col = a.t().contiguous().t()  # the same values, column-major strides
    assert _peers.agree((a,), (col,), True) == (True, "bitwise")
    b = a.clone()
    b[3, 1] = -b[3, 1]
    ok, text = _peers.agree(a, b, True)
    assert not ok and text == "output 0: 1 bytes differ"  # the sign byte
    ok, text = _peers.agree(a, a + 1e-9, False)
    assert ok and text.startswith("calc_diff") or text == "bitwise"
    assert not _peers.agree(a, a + 1.0, False)[0]
    assert not _peers.agree(a, a[:4], True)[0]
    assert not _peers.agree((a, a), (a,), True)[0]
    assert _peers.agree(a.to(torch.float8_e4m3fn), a.to(torch.float8_e4m3fn), True)[0]


def test_calc_diff():
    x = torch.randn(100)
    assert _peers.calc_diff(x, x) == pytest.approx(0.0, abs=1e-12)
    assert _peers.calc_diff(x, -x) == pytest.approx(2.0)


def _row(op, shape, us, peer_us, nbytes=64 << 20, peer="tk2", agree=True):
    return {"op": op, "shape": shape, "bytes": nbytes, "us": us, "copy_us": us * 0.9,
            "peers": {peer: {"us": peer_us, "speedup": peer_us / us, "agree": agree, "check": "bitwise"}}}


def test_summary_judges_large_cases_where_both_ran():
    res = {"rows": [_row("a", "bf16 4096x7168", 10, 20), _row("a", "bf16 16384x7168", 10, 9),
                    _row("b", "bf16 4096x7168", 10, 5), _row("b", "bf16 1x7168", 10, 1, nbytes=1 << 20),
                    {"op": "c", "shape": "x", "error": "boom", "peers": {}}]}
    s = report.summary(res, "tk2")
    assert s["cases"] == 3
    assert s["geomean"] == pytest.approx((2.0 * 0.9 * 0.5) ** (1 / 3))
    assert s["ops"]["a"]["min"] == pytest.approx(0.9)
    assert s["ops"]["a"]["below_0.97"] == [(0.9, "bf16 16384x7168")]
    assert "b" in s["ops"] and "c" not in s["ops"]
    assert any("geomean speedup 1.1" in line or "geomean speedup 0.9" in line for line in report.summary_lines(s))


def test_pivot_groups_token_counts_of_one_case():
    res = {"rows": [_row("a", f"bf16 {t}x2048 npc128", 10, 10 * s) for t, s in ((1, 1.5), (128, 1.0), (4096, 0.9))]
           + [_row("a", "bf16 16384x2048 npc128", 10, 11, agree=False)]}
    res["rows"].append(_row("a", "bf16 4096x7168 npc128", 10, 20))
    res["rows"].append({"op": "a", "shape": "bf16 1x7168 npc128", "bytes": 1, "us": 1.0, "copy_us": 1.0,
                        "peers": {"tk2": {"error": "AssertionError"}}})
    lines = report.pivot(res)
    assert len(lines) == 3
    assert lines[0] == "| op | case | peer | H: T=1,128,4096,16384 | H: T=1,128,4096,16384 |"
    assert lines[2] == "| a | bf16 TxH npc128 | TK 2.1.0 | 2048: 1.50 1.00 0.90 1.10≠ | 7168: x - 2.00 - |"
    assert report._grid_cell("bf16 (8, 4096, 7168)") == ("bf16 (8, T, H)", 4096, 7168)
    # a second shape of the same rows (unpack's int8 view) does not split the case by token count
    assert report._grid_cell("e2m1 4096x1536 (int8 4096x768) -> bf16") == ("e2m1 TxH (int8 TxW) -> bf16", 4096, 1536)
    assert report._grid_cell("e2m1 128x2048 (int8 128x1024) -> bf16")[0] == "e2m1 TxH (int8 TxW) -> bf16"


def test_merge_lets_later_runs_replace_rows():
    first = {"gpu": "G", "date": "d1", "copy_ceiling_gbs": None, "rows": [_row("a", "s1", 10, 10), _row("a", "s2", 10, 10)]}
    second = {"gpu": "G", "date": "d2", "copy_ceiling_gbs": 4000.0, "rows": [_row("a", "s2", 5, 10)]}
    m = report.merge([first, second])
    assert [r["us"] for r in m["rows"]] == [10, 5]
    assert [r["date"] for r in m["runs"]] == ["d1", "d2"]
    assert "pct_ceiling" in m["rows"][1] and "pct_ceiling" not in m["rows"][0]


def test_compile_sample_takes_one_case_per_op():
    picked = [GRID[i] for i in runner.compile_sample(GRID, False)]
    assert sorted(c.name for c in picked) == sorted({c.name for c in GRID})
    assert all(c.tokens == 4096 for c in picked if c in QT_GRID or c in MOE_GRID)
    assert runner.compile_sample(GRID[:5], True) == set(range(5))


def test_match_selects_grid_cases_by_their_label():
    """``case_label`` is the label ``make`` builds (checked on the one-token cases, cheap to build), and
    ``--match`` keeps exactly the cases whose label the regex finds."""
    one = [c for c in GRID if c.tokens == 1]
    assert one and all(runner.case_label(c) == c.make("cpu", 1.0)[0] for c in one)
    picked = runner.select_cases(False, ["cast_back"], match=r"^e4m3 16384x\d+ block128x1 ")
    assert picked and all(c.name == "cast_back" and c.tokens == 16384 and "block128x1 " in runner.case_label(c)
                          for c in picked)
    assert len(picked) == sum(1 for c in GRID if c.name == "cast_back" and c.tokens == 16384
                              and " block128x1 " in runner.case_label(c) and runner.case_label(c).startswith("e4m3"))


def test_report_renders_saved_runs(tmp_path):
    import json

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"gpu": "G", "date": "d", "copy_ceiling_gbs": 4000.0,
                                "rows": [_row("per_token_cast", "bf16 4096x7168 npc128 e4m3", 10, 12)]}))
    out = tmp_path / "t.md"
    assert report.report_main([str(path)], str(out)) == 0
    text = out.read_text()
    assert "geomean speedup 1.200x" in text and "| per_token_cast | bf16 TxH npc128 e4m3 | TK 2.1.0 | 7168: - - 1.20 - |" in text


def test_report_side_by_side_puts_each_run_in_a_column(tmp_path, capsys):
    """The first run's cases in order, each run's µs of the case and its speedup over the first run's 2.1.0 time; a
    case a later run lacks shows '-'."""
    import json

    a, b = tmp_path / "base.json", tmp_path / "wide.json"
    a.write_text(json.dumps({"rows": [_row("cast_back", "e4m3 4096x2048 block128x1 -> bf16", 10, 12),
                                      _row("cast_back", "e4m3 16384x2048 block128x1 -> bf16", 40, 36)]}))
    b.write_text(json.dumps({"rows": [{"op": "cast_back", "shape": "e4m3 4096x2048 block128x1 -> bf16", "us": 8.0}]}))
    assert report.report_main([str(a), str(b)], None, variants=True) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| op | case | MB | peer µs | base µs | wide µs | base speedup | wide speedup |")
    assert lines[2].endswith("| 12.0 | 10.0 | 8.0 | 1.20x | 1.50x |")
    assert lines[3].endswith("| 36.0 | 40.0 | - | 0.90x | - |")


def test_peer_load_names_the_variable(monkeypatch):
    monkeypatch.delenv("TILEFUSE_PEER_TK2", raising=False)
    monkeypatch.setattr(_peers, "_LOADED", {})
    with pytest.raises(RuntimeError, match="TILEFUSE_PEER_TK2"):
        _peers.load("tk2")
    with pytest.raises(ValueError, match="peer must be one of"):
        _peers.load("nope")


# ---------------------------------------------------------------------------------------------------------------
# MoE routing cases (tilefuse/bench/moe.py)
# ---------------------------------------------------------------------------------------------------------------

MOE_ONE = [c for c in MOE_GRID if c.tokens == 1]  # one-token cases: cheap to build and run on the CPU
# the off-grid families (no one-token row) at their fewest tokens: small enough for the CPU too
_ONE_KEYS = {c.key for c in MOE_ONE}
MOE_OFF = list({c.key: c for c in MOE_GRID
                if c.key not in _ONE_KEYS and c.tokens == min(bench_moe.OFF_TOKENS)}.values())
# the ops with rows off the issue shapes (issue 34 item 9)
OFF_OPS = ("topk_gate", "top2_sum_gate", "moe_topk_gate_forward", "moe_topk_gate_backward", "normalize_weight",
           "get_fused_mapping")


def test_moe_grid_covers_every_op_at_the_issue_shapes():
    """Every MoE op (the alias is a --quick row only) at T in {1, 4096, 8192, 16384}, the gates, the weights and
    the mapping also at the off-grid token counts; the gates at 72, 256 and 384 experts and the off-grid widths;
    the fused-layout and counting ops on the whole expert set and on an EP receive side."""
    assert {c.name for c in MOE_GRID} == set(bench_moe.OPS) - {"moe_topk_gate"}
    quick = [c for c in runner.select_cases(True, None) if c.name in bench_moe.OPS]
    assert {c.name for c in quick} == set(bench_moe.OPS) and all(c.tokens == 8192 for c in quick)
    registered = {name.split(".", 1)[1] for name in _registry.load_all() if name.startswith("moe.")}
    assert registered == set(bench_moe.OPS)
    for name in {c.name for c in MOE_GRID}:
        off = {300, 777, 3000} if name in OFF_OPS else set()
        assert {c.tokens for c in MOE_GRID if c.name == name} == {1, 4096, 8192, 16384} | off, name
    for gate in ("topk_gate", "top2_sum_gate", "moe_topk_gate_forward", "moe_topk_gate_backward"):
        widths = {report._grid_cell(runner.case_label(c))[2] for c in MOE_GRID if c.name == gate}
        assert widths == {64, 72, 128, 160, 256, 384} | ({96} if gate == "top2_sum_gate" else set()), gate
    v1 = [runner.case_label(c) for c in quick if c.name == "top2_sum_gate"]
    assert v1 and all("8192x256 top8 groups 8/4" in label for label in v1)
    assert any("sqrtsoftplus +bias" in runner.case_label(c) for c in quick if c.name == "moe_topk_gate_forward")
    for name in ("get_fused_mapping", "expand_to_fused", "expand_to_fused_with_sf", "reduce_fused", "group_count"):
        labels = [runner.case_label(c) for c in MOE_GRID if c.name == name]
        assert any("EP 1/8 recv" in label for label in labels) and any("256 experts" in label for label in labels)
    sync = [runner.case_label(c) for c in MOE_GRID if c.name == "get_fused_mapping"]
    assert any("host sync" in label for label in sync) and any("force_no_sync" in label for label in sync)
    assert any("-> e4m3" in runner.case_label(c) for c in MOE_GRID if c.name == "reduce_fused")


def _parsed(name: str, pattern: str) -> set[tuple]:
    """The groups of ``pattern`` in the grid labels of ``name`` (labels it does not match left out)."""
    found = (re.match(pattern, runner.case_label(c)) for c in MOE_GRID if c.name == name)
    return {m.groups() for m in found if m}


def test_moe_grid_holds_the_off_grid_shapes():
    """Issue 34 item 9: rows at token counts that are not powers of two (hundreds and low thousands); the gates and
    the mapping (with and without the host sync) at 64, 128 and 160 experts, top-6 and top-8, each at a few hundred
    and a few thousand tokens; the v1 gate at group widths that are not powers of two (sigmoid and softmax) and
    with softmax from 64 to 256 experts."""
    off = [c for c in MOE_GRID if c.tokens in bench_moe.OFF_TOKENS]
    assert off and all(c.tokens & (c.tokens - 1) for c in off)  # none a power of two
    assert {c.tokens for c in off} == {300, 777, 3000} and {c.name for c in off} == set(OFF_OPS)
    shapes = {(t, e, k) for t in ("300", "3000") for e in ("64", "128", "160") for k in ("6", "8")}
    for gate in ("topk_gate", "top2_sum_gate", "moe_topk_gate_forward", "moe_topk_gate_backward"):
        assert _parsed(gate, r"fp32 (\d+)x(\d+) top(\d+)\b") >= shapes, gate
    for sync in ("host sync", "force_no_sync"):
        got = _parsed("get_fused_mapping", rf"int64 (\d+)x(\d+) \((\d+) experts\) align128 .*{sync}")
        assert {(t, e, k) for t, k, e in got} >= shapes, sync
    assert {t for t, k in _parsed("normalize_weight", r"fp32 (\d+)x(\d+)$") if k == "6"} == {"300", "777", "3000"}
    v1_label = r"fp32 (\d+)x(\d+) top(\d+) (?:groups (\d+)/4|no groups) (\w+)"
    v1 = [(int(t), int(e), int(k), int(g or 0), s) for t, e, k, g, s in _parsed("top2_sum_gate", v1_label)]
    widths = {e // g for t, e, k, g, s in v1 if g and t in (300, 3000)}
    assert {9, 12, 20} <= widths and any(w & (w - 1) == 0 for w in widths)  # powers of two or not
    for scoring in ("sigmoid", "softmax"):  # the issue's rows: 160 experts in 8 groups of 20, top-6
        assert {(t, 160, 6, 8, scoring) for t in (300, 3000)} <= set(v1), scoring
    assert {e for t, e, k, g, s in v1 if s == "softmax" and t == 300} >= {64, 128, 160}
    assert {e for t, e, k, g, s in v1 if s == "softmax"} >= {64, 128, 160, 256}
    # moe.md 2.2's limits hold for every v1 row (the CPU run below validates them through the public op too)
    assert all(e % 4 == 0 and (not g or (e % g == 0 and g <= 32 and e // g <= 32 and k <= 4 * e // g))
               for t, e, k, g, s in v1)


def test_moe_labels_are_unique_and_match_selects_them():
    labels = [(c.name, runner.case_label(c)) for c in MOE_GRID]
    assert len(set(labels)) == len(labels)
    quick = runner.select_cases(True, ["moe"])
    assert len({(c.name, runner.case_label(c)) for c in quick}) == len(quick)
    assert all(runner.case_label(c) == c.make("meta", 1.0)[0] for c in quick)
    picked = runner.select_cases(False, ["moe"], match=r"^int64 16384x8 \(EP 1/8 recv")
    assert picked and all(c.tokens == 16384 and c.name in bench_moe.OPS for c in picked)
    assert {c.name for c in picked} == {"get_fused_mapping", "aux_fi", "group_count"}
    assert [c.key for c in runner.select_cases(False, ["reduce_fused"], match="-> e4m3")] == [
        c.key for c in MOE_GRID if c.name == "reduce_fused" and "-> e4m3" in runner.case_label(c)]
    assert [c.name for c in runner.select_cases(True, ["topk_gate"], match="8192x256")] == ["topk_gate"]
    # a 1.0.0 process keeps the v1 ops only
    tk1 = {c.name for c in runner.select_cases(True, ["moe"], ["tk1"])}
    assert tk1 == set(bench_moe.PEER_FUNCTIONS["tk1"])


class _Recorder:
    """A stand-in peer module: ``.moe`` is ours, recording which functions a peer adapter calls."""

    def __init__(self):
        self.called: list[str] = []
        recorder = self

        class Moe:
            def __getattr__(self, name):
                recorder.called.append(name)
                return getattr(moe, name)

        self.moe = Moe()


@pytest.mark.parametrize("case", MOE_ONE + MOE_OFF, ids=[f"{c.key}@{c.tokens}" for c in MOE_ONE + MOE_OFF])
def test_moe_reference_and_peer_adapters_compute_our_op(case):
    """One-token cases and the off-grid families at 300 tokens on the CPU: the torch.compile reference and each
    peer adapter (against a stand-in module holding our ops) give our outputs by the case's own comparison, and
    each adapter calls the peer function of the op's name, one that the peer has."""
    torch.manual_seed(0)
    _, inputs = case.make("cpu", 1.0)
    ours = case.run(*core._clone(inputs))
    ok, text = runner._agree(case, "compile", ours, case.ref(*core._clone(inputs)))
    assert ok, f"reference: {text}"
    assert case.peers
    for peer, call in case.peers.items():
        stand_in = _Recorder()
        ok, text = runner._agree(case, peer, ours, call(stand_in, *core._clone(inputs)))
        assert ok, f"{peer}: {text}"
        assert stand_in.called == [case.name] and case.name in bench_moe.PEER_FUNCTIONS[peer], peer


def test_moe_peer_adapters_cover_each_peers_ops():
    """The quick rows' adapters, recorded: TileKernels 2.1.0 is asked for its five MoE functions, 1.0.0 for its
    twelve, and no case asks a peer for a function it lacks."""
    asked: dict[str, set] = {}
    for case in runner.select_cases(True, None):
        if case.name not in bench_moe.OPS:
            continue
        _, inputs = case.make("cpu", 1 / 64)
        for peer, call in case.peers.items():
            stand_in = _Recorder()
            call(stand_in, *core._clone(inputs))
            asked.setdefault(peer, set()).update(stand_in.called)
    assert asked == {p: set(names) for p, names in bench_moe.PEER_FUNCTIONS.items()}


def test_routing_draw_is_gate_like():
    rows, local = bench_moe.routing(2000)
    assert local == 256 and len(rows) == 2000
    assert all(len(set(r)) == 8 and all(0 <= e < 256 for e in r) for r in rows)
    recv, local = bench_moe.routing(2000, 8)
    assert local == 32 and len(recv) == 2000
    assert all(any(e >= 0 for e in r) and all(-1 <= e < 32 for e in r) for r in recv)
    assert any(-1 in r for r in recv)
    kept = [e for r in recv for e in r if e >= 0]
    assert len(set(kept)) == 32 and all(len({e for e in r if e >= 0}) == sum(e >= 0 for e in r) for r in recv)
    assert bench_moe.routing(100, 8) == bench_moe.routing(100, 8)  # rebuilt inputs have the same shapes


def test_fused_mapping_agree_ignores_only_the_in_segment_order():
    """Upstream's row order (the reference's num_sms order model) agrees order-free with ours; a map that points a
    slot at another row of its segment, or different segments, does not."""
    from tilefuse.reference import moe as R

    rows, local = bench_moe.routing(300, 8, seed=3)
    idx = torch.tensor(rows, dtype=torch.int64)
    ours = moe.get_fused_mapping(idx, local, 0, 16)
    upstream = R.get_fused_mapping(idx, local, 0, 16, num_sms=7)
    assert not _peers.agree(ours[:7], upstream[:7], True)[0]  # the order differs ...
    assert _peers.fused_mapping_agree(ours, upstream) == (True, "bitwise up to the row order inside segments")
    assert _peers.fused_mapping_agree(ours, ours) == (True, "bitwise")
    bound = (idx.numel() + 15 * local) // 16 * 16
    no_sync = moe.get_fused_mapping(idx, local, bound, 16, True)
    assert _peers.fused_mapping_agree(no_sync, R.get_fused_mapping(idx, local, bound, 16, True, num_sms=132))[0]
    bad = list(upstream)
    tt2p = bad[3].clone()
    a, b = [(t, k) for t in range(idx.size(0)) for k in range(8) if rows[t][k] == 0][:2]
    tt2p[a], tt2p[b] = upstream[3][b], upstream[3][a]  # two slots of expert 0 swap rows: the maps disagree
    bad[3] = tt2p
    assert not _peers.fused_mapping_agree(ours, tuple(bad))[0]
    assert not _peers.fused_mapping_agree(ours, moe.get_fused_mapping(idx, local, 0, 32))[0]


def test_in_place_cases_are_restored_outside_the_timed_call():
    case = next(c for c in bench_moe.quick_cases() if c.name == "inplace_unique_group_indices")
    assert case.in_place
    _, inputs = case.make("cpu", 1 / 64)
    original = core._clone(inputs)
    restore = runner._restorer(case, inputs)
    out = case.run(*inputs)
    assert out is inputs[0] and not torch.equal(inputs[0], original[0])  # the draw has repeated groups
    restore()
    assert torch.equal(inputs[0], original[0])
    assert runner._restorer(MOE_ONE[0], MOE_ONE[0].make("cpu", 1.0)[1]) is None


# ---------------------------------------------------------------------------------------------------------------
# mHC cases (tilefuse/bench/mhc.py)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", runner.select_cases(True, ["mhc"]), ids=lambda c: c.name)
def test_mhc_reference_and_peer_calls_compute_our_op(case):
    """On the CPU our op takes its reference: each mHC case's torch.compile reference and its TileKernels 2.1.0
    call (against a stand-in ``tile_kernels`` holding our ``tilefuse.mhc``: the same v2.1 API) give our outputs,
    shapes included. (The 1.0.0 calls of the projection reach into 1.0.0's own modules: no stand-in.)"""
    import tilefuse.mhc

    _, inputs = case.make("cpu", 0.02)
    ours = case.run(*core._clone(inputs))
    ok, text = runner._agree(case, "compile", ours, case.ref(*core._clone(inputs)))
    assert ok, f"reference: {text}"
    stand_in = types.SimpleNamespace(mhc=tilefuse.mhc)
    for peer, call in case.peers.items():
        if peer == "tk2":
            ok, text = runner._agree(case, peer, ours, call(stand_in, *core._clone(inputs)))
            assert ok, f"{peer}: {text}"


# ---------------------------------------------------------------------------------------------------------------
# Engram cases (tilefuse/bench/engram.py)
# ---------------------------------------------------------------------------------------------------------------

def _engram_v21_stand_in():
    """A stand-in ``tile_kernels`` with TileKernels 2.1.0's Engram API (``engram`` and ``modeling.engram``) made of
    our v1 ops: the packed ``kv (T, M+1, H)`` read through the views ``kv[:, :M]``, ``kv[:, M]``, ``grad_kv`` packed
    from ``grad_k`` and ``grad_v``; the autograd gate takes the flat ``kv [T, (M+1) H]``."""
    from tilefuse import engram as E
    from tilefuse.modeling import engram as layer

    def gate_fwd(x, kv, w, eps, clamp, save_for_backward=True, image_token_mask=None, inplace=False):
        assert image_token_mask is None and not inplace
        m = x.shape[1]
        return E.engram_gate_fwd(x, kv[:, :m], kv[:, m], w, eps, clamp, save_for_backward)

    def gate_bwd(grad, x, kv, w, dot, g, rx, rk, clamp, image_token_mask=None):
        assert image_token_mask is None
        m = x.shape[1]
        gx, gk, gv, partial = E.engram_gate_bwd(grad, x, kv[:, :m], kv[:, m], w, dot, g, rx, rk, clamp)
        return gx, torch.cat((gk, gv.unsqueeze(1)), 1), partial

    def gate(x, kv, wh, we, clamp, eps, image_token_mask):
        assert image_token_mask is None
        m, h = x.shape[-2:]
        packed = kv.view(-1, m + 1, h)
        return layer.engram_gate(x, packed[:, :m], packed[:, m], wh, we, clamp, eps)

    ops = {name: getattr(E, name) for name in E.__all__}
    ops.update(engram_gate_fwd=gate_fwd, engram_gate_bwd=gate_bwd)
    return types.SimpleNamespace(engram=types.SimpleNamespace(**ops),
                                 modeling=types.SimpleNamespace(engram=types.SimpleNamespace(engram_gate=gate)))


@pytest.mark.parametrize("case", runner.select_cases(False, ["engram"]), ids=lambda c: f"{c.name}|{c.key}")
def test_engram_reference_and_peer_calls_compute_our_op(case):
    """On the CPU our op takes its reference: each Engram case's torch.compile reference, its TileKernels 2.1.0 call
    (against a stand-in ``tile_kernels`` holding our ops behind the v2.1 API, the packed ``kv`` included) and its
    1.0.0 call (against our own modules: the v1 API is ours) give our outputs by the case's own comparison, which
    maps 2.1.0's ``grad_kv`` to our ``grad_k``, ``grad_v``."""
    torch.manual_seed(0)
    _, inputs = case.make("cpu", 0.02)
    ours = case.run(*core._clone(inputs))
    ok, text = runner._agree(case, "compile", ours, case.ref(*core._clone(inputs)))
    assert ok, f"reference: {text}"
    import tilefuse.engram
    import tilefuse.modeling.engram

    v1 = types.SimpleNamespace(engram=tilefuse.engram, modeling=types.SimpleNamespace(engram=tilefuse.modeling.engram))
    stand_ins = {"tk2": _engram_v21_stand_in(), "tk1": v1}
    sinkhorn = case.name.startswith("engram_sinkhorn")  # v2.1 helpers: 1.0.0 has none
    assert set(case.peers) == ({"tk2"} if sinkhorn else {"tk2", "tk1"})
    for peer, call in case.peers.items():
        ok, text = runner._agree(case, peer, ours, call(stand_ins[peer], *core._clone(inputs)))
        assert ok, f"{peer}: {text}"


def test_engram_checks_map_the_packed_gradient_and_hold_the_bounds():
    """The gate backward's check reads TileKernels' ``grad_kv`` rows ``0..M-1`` as ``grad_k`` and row ``M`` as
    ``grad_v``: swapped rows or a gradient off by more than the bound fail."""
    from tilefuse.bench import engram as bench_engram

    case = next(c for c in bench_engram.quick_cases() if c.name == "engram_gate_bwd")
    _, inputs = case.make("cpu", 0.02)
    ours = case.run(*core._clone(inputs))
    gx, gk, gv, ah, ae = ours
    packed = torch.cat((gk, gv.unsqueeze(1)), 1)
    check = case.check["tk2"]
    assert check(ours, (gx, packed, ah, ae)) == (True, "bitwise")
    swapped = torch.cat((gv.unsqueeze(1), gk), 1)
    assert not check(ours, (gx, swapped, ah, ae))[0]
    ok, text = check(ours, (gx, packed, ah * (1 + 1e-3), ae))
    assert not ok and text.startswith("calc_diff")
    ok, text = check(ours, (gx, packed, ah * (1 + 1e-6), ae))
    assert ok and text.startswith("calc_diff")
