"""The bench cases (tilefuse/bench/) on the CPU: every case builds at a tiny scale, runs through its public op
(the CPU reference) and counts the tensors quant.md 7.3 lists, so a broken case fails here, not on the GPU; each
case's declared shapes (what ``--list`` prints) match the tensors it builds."""
import random

import pytest
import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensorMode)

from tilefuse import _registry
from tilefuse.bench import cli, core, runner

TINY = 1 / 64  # 8001 x 7168 -> 125 x 128

# Tensors counted per benchmark (quant.md 7.3; a pair counts as its two tensors). Ops the table does not list
# count every input and output the same way.
COUNTED = {
    "per_token_cast": 3,                      # x, out, out_sf
    "per_token_cast_with_sf_only": 2,         # x, out_sf
    "per_token_cast_with_precomputed_sf": 3,  # x, sf, out
    "per_block_cast": 3,                      # x, out, sf
    "per_block_cast_with_sf_only": 2,         # x, sf
    "per_block_cast_with_precomputed_sf": 3,  # x, sf, out
    "per_block_cast_lossless": 4,             # input pair, output pair
    "per_channel_cast": 3,
    "per_channel_cast_and_transpose": 3,
    "cast_back": 3,                           # data, sf, output (stand-in: the original x)
    "per_token_cast_back": 3,
    "unpack_from_e2m1fn_x2": 2,
    "per_token_cast_to_e5m6": 3,              # x, packed, sf
    "cast_back_e5m6": 3,                      # packed, sf, output
    "swiglu_backward_and_per_token_cast": 11,  # x pair, grad, weights, 2 maps, out, fp8 pair, x_grad, weight_grad
    "per_channel_cast_fused-1": 3,            # x, out, sf (no gather)
    "per_channel_cast_fused-2": 4,            # x, pos_to_token, out, sf
    "per_channel_cast_fused-3": 5,            # x pair, pos_to_token, out, sf
    "swiglu_forward_and_per_channel_cast_and_transpose": 3,
    "batched_transpose_weight_sf": 6,         # 2 weights: sf, sf0_out, sf1_out each
    "swiglu_forward_and_per_token_cast": 5,   # x, out, sf (quant.md 7.3) + the routing map and weights (0.1 MB)
    "norm_forward": 3,                        # x, weight, out
    "randn": 1,                               # the output (its one input is the device)
    # mHC (tilefuse/bench/mhc.py): inputs with the destination buffer, plus the destination returned
    "expand_to_mhc_fwd": 3,                   # x, o, o
    "expand_to_mhc_bwd": 3,                   # o_grad, x_grad, x_grad
    "mhc_pre_apply_mix_fwd": 4,               # x, mix, o, o
    "mhc_pre_apply_mix_bwd": 6,               # o_grad, x, mix, x_grad; x_grad, mix_grad
    "mhc_post_fwd": 6,                        # x, residual, post, comb, out; out
    "mhc_post_bwd": 9,                        # x, residual, post, comb, d_o; d_x, d_residual, d_post, d_comb
    "mhc_pre_split_mixes_fwd": 9,             # logits, scale, base, pre, post, comb; pre, post, comb
    "mhc_pre_split_mixes_bwd": 13,            # 3 grads, logits, post, scale, base, 3 destinations; the 3 again
    "mhc_head_compute_mix_fwd": 5,            # logits, scale, base, out; out
    "mhc_head_compute_mix_bwd": 10,           # d_out, logits, scale, base, 3 destinations; the 3 again
    "mhc_pre_big_fuse_fwd": 11,               # partials, sqrsum, scale, base, residual, 3 destinations; the 3 again
    "mhc_multilayer_recompute": 81,           # residual, 6 lists of 10 (pre, out, post, comb, inputs, residuals);
                                              # the 2 written lists again
    "mhc_multilayer_steps": 81,               # the same tensors (the unfused apply and post steps)
    "mhc_sinkhorn_fwd": 3,                    # x, out, out
    "mhc_sinkhorn_bwd": 4,                    # d_out, x, d_x, d_x
    "mhc_fn_normw_merge_fwd": 4,              # fn, normw, out_fn; out_fn
    "mhc_fn_normw_merge_bwd": 7,              # fn, normw, out_fn_grad, fn_grad, normw_grad; the 2 accumulated
    "mhc_reduce_partials_and_rmsnorm_fwd": 8,  # 2 partials, 3 destinations; the 3 again
    "mhc_reduce_partials_and_rmsnorm_bwd": 7,  # out_grad, out_mul, sqrsum, 2 destinations; the 2 again
    "mhc_pre_norm_fn": 3,                     # residual, fn; out
    "mhc_layer_step": 7,                      # residual, fn, scale, base, grad; new residual, residual grad
    "mhc_pre_norm_fn_bwd": 7,                 # d_mul, d_sq, x, fn, x_grad; x_grad, d_fn
    "norm_forward_and_per_token_cast": 4,     # x, weight, out, sf
    "norm_backward": 6,                       # out_grad, x, weight, rstd, x_grad, weight_grad
    "per_token_cast_and_cast_back": 2,        # x read, x written in place
    "batched_transpose": 2,
    "transpose": 2,
    # MoE routing (moe.md; tilefuse/bench/moe.py)
    "topk_gate": 2,                           # scores, topk_idx
    "top2_sum_gate": 4,                       # logits, bias, topk_idx, topk_weights
    "topk_sum_and_topk_group_idx": 2,         # scores, group_idx
    "moe_topk_gate_forward-1": 4,             # logits, bias, topk_idx, topk_weights
    "moe_topk_gate_forward-2": 5,             # ... + scores (an output of the training call)
    "moe_topk_gate": 4,
    "moe_topk_gate_backward-1": 5,            # scores, topk_idx, topk_weights, grad_topk_weights, grad_logits
    "moe_topk_gate_backward-2": 7,            # ... + mask, grad_scores_sum
    "normalize_weight": 3,                    # weights, denominator, normalized
    "get_fused_mapping": 8,                   # topk_idx + the seven maps (the count list is no tensor)
    "expand_to_fused": 4,                     # x, token_topk_to_pos, pos_to_expert, out
    "expand_to_fused_with_sf": 6,             # data, sf, token_topk_to_pos, pos_to_expert, out, out_sf
    "reduce_fused-1": 4,                      # x, weights, token_topk_to_pos, out
    "reduce_fused-2": 6,                      # x, x_sf, weights, token_topk_to_pos, sf, out (e4m3)
    "reduce_fused-3": 4,
    "reduce_fused-4": 6,
    "aux_fi": 2,
    "group_count": 2,
    "inplace_unique_group_indices": 2,        # read, written in place
    "mask_indices_by_tp": 2,
    # rotary embedding (transform.md 9; tilefuse/bench/transform.py): q, cache, k[, positions][, Liger's cos, sin]
    # read, q and k written in place (the bytes are the case's own rule, test_rotary_bytes_by_hand)
    "apply_rotary-1": 7,
    "apply_rotary-2": 8,
    "apply_rotary-3": 7,
    "apply_rotary-4": 5,
    "apply_rotary-5": 6,
    "apply_rotary-6": 6,
    # Engram (tilefuse/bench/engram.py): in-place results returned and counted as written
    "engram_gate_fwd-1": 8,                   # x, kv, w; out, dot, gate, rstd_x, rstd_k (H = 4096, saved)
    "engram_gate_fwd-2": 4,                   # x, kv, w; out (H = 4096, not saved)
    "engram_gate_fwd-3": 8,                   # H = 7168, saved
    "engram_gate_fwd-4": 4,                   # H = 7168, not saved
    "engram_gate_bwd": 17,                    # grad_out, x, kv, w, 4 statistics, w_h, w_e, 2 accumulators;
                                              # grad_x, grad_k, grad_v, the 2 accumulators
    "grad_w_reduce": 7,                       # partial, w_h, w_e, 2 accumulators; the 2 accumulators
    "engram_hash": 5,                         # ids, multipliers, vocab_sizes, offsets; indices
    "fused_weight": 3,                        # w_h, w_e; w
    "engram_sinkhorn_momentum_update": 4,     # grad, buffer; buffer, output
    "engram_sinkhorn_step": 6,                # matrix, row_scale, col_scale; row_norm, partial, row_scale
    "engram_sinkhorn_step_reduce": 3,         # partial, col_sumsq; col_sumsq
    "engram_sinkhorn_finalize": 4,            # matrix, row_scale, col_scale; out
    "engram_gate_step": 11,                   # x, kv, w_h, w_e, grad; out, x, k, v, w_h, w_e gradients
}

CASES = runner.select_cases(True, None)


def _ids():
    seen: dict[str, int] = {}
    ids = []
    for case in CASES:
        seen[case.name] = seen.get(case.name, 0) + 1
        ids.append(f"{case.name}-{seen[case.name]}")
    return ids


def test_every_kernel_op_has_a_case():
    """Every op with a kernel has a quick row, or runs the kernels of one that has (mHC's v1 autograd ops)."""
    from tilefuse.bench import mhc as bench_mhc

    kernel_ops = {name.split(".", 1)[1] for name, rec in _registry.load_all().items() if rec["path"] == "kernel"}
    names = {case.name for case in CASES}
    assert kernel_ops - set(bench_mhc.SAME_KERNELS) <= names
    assert {bench_mhc.SAME_KERNELS[op] for op in kernel_ops & set(bench_mhc.SAME_KERNELS)} <= names


@pytest.mark.parametrize("case, case_id", list(zip(CASES, _ids())), ids=_ids())
def test_case_runs_on_cpu_and_counts_the_listed_tensors(case, case_id):
    shape, inputs = case.make("cpu", TINY)
    outputs = case.run(*inputs)
    tensors = core.tensors(inputs) + core.tensors(outputs)
    assert len(tensors) == COUNTED.get(case_id, COUNTED.get(case.name)), shape
    assert all(t.device.type == "cpu" and t.numel() > 0 for t in tensors), shape
    if case.nbytes is None:  # a case with its own byte rule is checked by hand below (test_rotary_bytes_by_hand)
        assert core.counted_bytes(inputs, outputs) == sum(t.numel() * t.element_size() for t in tensors)
    # each rotated input set is a fresh build of the same shapes
    again = case.make("cpu", TINY)
    assert again[0] == shape
    assert [t.shape for t in core.tensors(again[1])] == [t.shape for t in core.tensors(inputs)]


def _full_scale_bytes(name: str, shape_prefix: str) -> tuple[int, tuple]:
    """counted_bytes of the named case at the benchmark shape, on fake tensors (nothing computed)."""
    case = next(c for c in CASES if c.name == name and c.describe()[0].startswith(shape_prefix))
    with FakeTensorMode():
        shape, inputs = case.make("cpu", 1.0)
        return core.counted_bytes(inputs, case.run(*inputs)), inputs


def test_per_channel_cast_bytes_by_hand():
    # bf16 x (8064, 7168) read, e4m3 out (8064, 7168) and fp32 sf (8064/128, 7168) written
    got, _ = _full_scale_bytes("per_channel_cast", "bf16 8064x7168")
    assert got == 8064 * 7168 * 2 + 8064 * 7168 * 1 + 63 * 7168 * 4


def test_per_token_cast_bytes_by_hand():
    # bf16 x (8192, 7168); e4m3 out; row-major fp32 sf (8192, 7168 / 128)
    got, _ = _full_scale_bytes("per_token_cast", "bfloat16 8192x7168 npc128 e4m3 round")
    assert got == 8192 * 7168 * 2 + 8192 * 7168 + 8192 * 56 * 4


def test_swiglu_backward_bytes_by_hand():
    # quant.md 3.13 shapes: x pair e4m3 (Te, 2H) + fp32 (Te, 2H/128); grad bf16 (Te, H); weight fp32 (T, K);
    # pos_to_token_topk int32 (Te,); token_topk_to_pos int32 (T, K); out bf16 (Te, H); x_grad_fp8 pair like x;
    # x_grad bf16 (Te, 2H); weight_grad fp32 (T, K)
    got, inputs = _full_scale_bytes("swiglu_backward_and_per_token_cast", "e4m3 pair")
    (data, _), _, weight, _, _ = inputs
    te, h, (t, k) = data.size(0), data.size(1) // 2, weight.shape
    assert (h, k) == (7168, 6) and te % 128 == 0
    pair = te * 2 * h + te * (2 * h // 128) * 4
    assert got == pair + te * h * 2 + t * k * 4 + te * 4 + t * k * 4 + te * h * 2 + pair + te * 2 * h * 2 + t * k * 4


def test_list_prints_shapes_and_megabytes(capsys):
    assert cli.main(["--list", "--quick", "--ops", "per_channel_cast"]) == 0
    out = capsys.readouterr().out
    assert "| per_channel_cast | bf16 8064x7168 npt128 round | 175.2 |" in out
    assert "per_block_cast" not in out


def test_bench_configs_are_registered():
    """The bench's kernel configs, traced on fake CUDA tensors, are all in the static-config registries, so the
    compile tier builds (and ``precompile`` packs) every kernel the bench launches."""
    from tilefuse import _jit

    traced = runner.bench_configs(grid=False)
    registered = _jit.registered()
    assert len(traced) > 20
    missing = [(name, cfg) for name, cfg in traced if cfg not in registered[name]]
    assert not missing, missing
    assert {name for name, _ in traced} >= {"per_token_cast", "per_block_cast", "cast_back", "batched_transpose"}
    assert runner.bench_configs(["per_token_cast"]) and all(
        name == "per_token_cast" for name, _ in runner.bench_configs(["per_token_cast"]))


# kernels whose modules register exactly the configs the bench launches (the tests' own compile on first use).
# Not listed: batched_transpose (every element size it handles: 1, 2, 4; the bench launches 2 and 1) and
# batched_transpose_weight_sf (every block size x outputs per launch: 4; the bench launches one) register the
# whole small set of configs their kernels can take.
BENCH_REGISTERED = ("per_token_cast", "per_block_cast", "per_block_cast_lossless", "per_channel_cast",
                    "per_token_cast_to_e5m6", "cast_back", "unpack_from_e2m1fn_x2", "per_token_cast_and_cast_back",
                    "swiglu_fwd_ptc", "swiglu_bwd_ptc", "swiglu_fwd_pcc", "norm_forward", "norm_backward",
                    "norm_weight_grad_reduce", "apply_rotary", "expand_to_fused", "reduce_fused",
                    "topk_gate", "topk_sum_and_topk_group_idx", "normalize_weight", "top2_sum_gate",
                    "moe_topk_gate_forward", "moe_topk_gate_backward", "moe_count_partial", "moe_count_finish",
                    "moe_unique_group_indices", "moe_mask_indices_by_tp", "moe_fused_mapping_count",
                    "moe_fused_mapping_scan", "moe_fused_mapping_scatter", "mhc_expand_fwd", "mhc_expand_bwd",
                    "mhc_apply_mix_fwd", "mhc_apply_mix_bwd", "mhc_normw_merge_fwd", "mhc_normw_merge_bwd",
                    "mhc_reduce_rmsnorm_fwd", "mhc_reduce_rmsnorm_bwd", "mhc_norm_fn_fwd", "mhc_norm_fn_bwd",
                    "mhc_norm_fn_dw_sum", "mhc_norm_fn_tf32_round", "mhc_multilayer_recompute", "mhc_pre_mixes_fwd", "engram_gate_fwd",
                    "engram_fused_weight", "engram_hash", "engram_sinkhorn_momentum", "engram_sinkhorn_step", "engram_sinkhorn_step_reduce",
                    "engram_sinkhorn_finalize", "engram_gate_bwd", "engram_grad_w_reduce")


def test_registration_is_what_the_bench_launches():
    """Each of these kernels registers the configs of the bench's quick rows and grid, traced on fake CUDA tensors,
    and nothing else: ``precompile`` builds what the bench needs, and test-only configs stay in tests/."""
    from tilefuse import _jit

    traced = runner.bench_configs()
    registered = _jit.registered()
    for name in BENCH_REGISTERED:
        assert len(registered[name]) == len(set(registered[name])), name
        assert set(registered[name]) == {cfg for n, cfg in traced if n == name}, name


def test_host_overhead_table_ratios_per_group():
    """Ratios are to the same group's bare call (and allocating bare call); a group without one shows '-'."""
    from tilefuse.bench.extras import host_overhead_table

    rows = [{"group": "row", "call": "bare TileLang kernel call (JITKernel, preallocated outputs)", "us": 8.0},
            {"group": "row", "call": "bare TileLang kernel call allocating its outputs (JITKernel, out_idx)",
             "us": 16.0},
            {"group": "row", "call": "tilefuse.quant.per_token_cast (public op)", "us": 10.0},
            {"group": "other public ops", "call": "norm_forward (weight)", "us": 12.0}]
    lines = host_overhead_table(rows)
    assert lines[4] == "| row | tilefuse.quant.per_token_cast (public op) | 10.00 | 1.25x | 0.62x |"
    assert lines[5] == "| other public ops | norm_forward (weight) | 12.00 | - | - |"


def _decode_groups(device: str) -> dict:
    """The mHC and Engram one-token host calls, run once each: ``{group: [(call name, output copy)]}``."""
    from tilefuse.bench import engram as bench_engram, mhc as bench_mhc

    groups = {}
    for group, name, fn in bench_mhc.host_calls(device) + bench_engram.host_calls(device):
        groups.setdefault(group, []).append((name, fn().clone()))
    return groups


def test_decode_host_calls_run_on_the_cpu():
    """The one-token mHC / Engram host calls are valid public-op calls (the reference path on the CPU): one token's
    output each, and the calls of a group compute the same bits."""
    groups = _decode_groups("cpu")
    assert set(groups) == {"mhc_post_fwd, n=4 C=4096, 1 token", "mhc_pre_apply_mix_fwd, n=4 C=4096, 1 token",
                           "other public ops", "engram_gate_fwd, M=4 H=4096, no save, 1 token"}
    for group, outputs in groups.items():
        for name, out in outputs:
            assert out.dtype == torch.bfloat16 and out.numel() in (4096, 4 * 4096), (group, name, out.shape)
            assert torch.equal(out, outputs[0][1]), (group, name)


@pytest.mark.gpu
def test_decode_host_calls_agree_on_the_gpu():
    """On CUDA each timed group has its bare TileLang call, and the bare call and the public ops write the same bits
    (so the host-overhead rows time the same work)."""
    groups = _decode_groups("cuda")
    for group, outputs in groups.items():
        names = [name for name, _ in outputs]
        if group != "other public ops":
            assert names[0].startswith("bare TileLang kernel call"), (group, names)
        for name, out in outputs:
            assert out.is_cuda and torch.isfinite(out.float()).all(), (group, name)
            assert torch.equal(out, outputs[0][1]), (group, name)


def test_moe_bytes_by_hand():
    """MoE rows at T = 8192, 256 experts, top-8, hidden 7168: each input read once, each output written once."""
    from tilefuse.bench import moe as bench_moe

    t, k, e, h = 8192, 8, 256, 7168
    got, _ = _full_scale_bytes("top2_sum_gate", "fp32 8192x256 top8 groups 8/4 sigmoid")
    assert got == t * e * 4 + e * 4 + t * k * 8 + t * k * 4  # logits, bias -> topk_idx int64, topk_weights fp32
    got, _ = _full_scale_bytes("get_fused_mapping", "int64 8192x8 (256 experts) align128 force_no_sync")
    bound = (t * k + 127 * e) // 128 * 128  # the caller's upper bound of the aligned total
    assert got == t * k * 8 + 3 * bound * 4 + t * k * 4 + 3 * e * 4
    rows, _ = bench_moe.routing(t)
    n = bench_moe._aligned_total(rows, e, 128)
    got, _ = _full_scale_bytes("expand_to_fused", "bf16 8192x7168 -> fused rows (top8, 256 experts")
    assert got == t * h * 2 + t * k * 4 + n * 4 + n * h * 2  # x, token_topk_to_pos, pos_to_expert -> (N, H)
    recv, _ = bench_moe.routing(t, 8)
    routed = sum(v >= 0 for r in recv for v in r)  # alignment 1: the fused buffer holds exactly the routed rows
    got, _ = _full_scale_bytes("reduce_fused", "fused rows -> 8192x7168 (top8, EP 1/8 recv: 32 local, align1) bf16 "
                                               "+ x_sf")
    assert got == routed * h * 2 + routed * 4 + t * k * 4 + t * k * 4 + 4 + t * h  # x, x_sf, w, map, sf -> e4m3


def test_moe_cases_list_without_a_gpu(capsys):
    assert cli.main(["--list", "--quick", "--ops", "moe"]) == 0
    out = capsys.readouterr().out
    assert "| topk_gate | fp32 8192x256 top8 | 8.9 |" in out
    assert out.count("| get_fused_mapping |") == 4 and "per_token_cast" not in out


# ---------------------------------------------------------------------------------------------------------------
# --list builds nothing: each case's declared shapes (Case.describe) must be the tensors it builds
# ---------------------------------------------------------------------------------------------------------------

def _built(case):
    """``(label, input (shape, dtype) list, output list, bytes)`` of ``case`` at scale 1 on fake tensors (real CPU
    tensors where an op reads data to size its output); the bytes by the case's own rule where it has one."""
    def build():
        label, inputs = case.make("cpu", 1.0)
        outputs = case.run(*inputs)
        specs = [[(tuple(t.shape), t.dtype) for t in core.tensors(x)] for x in (inputs, outputs)]
        return label, specs[0], specs[1], (case.nbytes or core.counted_bytes)(inputs, outputs)

    try:
        with FakeTensorMode():
            return build()
    except (DataDependentOutputException, DynamicOutputShapeException):
        return build()


def _check_described(case):
    label, inputs, outputs, nbytes = _built(case)
    described = case.describe()
    assert described[0] == label
    assert core.described_bytes(case) == nbytes, label
    if case.nbytes is None:  # else the declared tensors only carry the case's bytes (Case.nbytes)
        assert [(tuple(s), d) for s, d in described[1]] == inputs, label
        assert [(tuple(s), d) for s, d in described[2]] == outputs, label


@pytest.mark.parametrize("case", CASES, ids=_ids())
def test_quick_case_declares_the_tensors_it_builds(case):
    _check_described(case)


GRID = runner.select_cases(False, None)
# every grid case family at its fewest tokens and narrowest width, and a fixed random sample of the rest
_FIRST: dict[str, object] = {}
for _c in GRID:
    _FIRST.setdefault(_c.key, _c)
GRID_SAMPLE = list(_FIRST.values()) + random.Random(0).sample(GRID, 40)


@pytest.mark.parametrize("case", GRID_SAMPLE, ids=[f"{c.key}@{c.tokens}" for c in GRID_SAMPLE])
def test_grid_case_declares_the_tensors_it_builds(case):
    _check_described(case)


def test_every_case_declares_its_shapes_and_an_undeclared_one_is_built_instead():
    """The areas' cases all declare (``--list`` builds nothing for them); a case without a declaration (a new
    case module) is listed from its tensors built on fake tensors, with the same label and bytes."""
    assert all(c.describe is not None for c in CASES + GRID)
    for case in [c for c in CASES if c.name in ("per_channel_cast", "get_fused_mapping")]:
        bare = case._replace(describe=None)
        label, inputs, outputs = case.describe()
        assert core.describe(bare) == (label, [(tuple(s), d) for s, d in inputs], [(tuple(s), d) for s, d in outputs])
        assert core.described_bytes(bare) == core.described_bytes(case)


def test_list_prints_the_declared_bytes(capsys):
    """``--list`` of the whole grid: one row per case, each the case's declared label and bytes."""
    assert cli.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["| op | shape | MB |", "| --- | --- | ---: |"] and len(lines) == len(GRID) + 2
    for line, case in zip(lines[2:], GRID):
        assert line == f"| {case.name} | {case.describe()[0]} | {core.described_bytes(case) / 1e6:.1f} |"


def test_rotary_bytes_by_hand():
    """transform.md 9: q and k read and written, positions read, one D-wide fp32 cache row per distinct row used."""
    from tilefuse.bench import transform as bt

    rows = [(c, c.make("meta", 1.0)) for c in CASES if c.name == "apply_rotary"]
    got = {shape.split(" bf16")[0].split(" q ")[0]: c.nbytes(inputs, (inputs[0], inputs[2])) for c, (shape, inputs)
           in rows}
    assert got["LLaMA-3-8B prefill"] == 171_966_464
    assert got["LLaMA-3-8B batched prefill"] == 168_820_736
    assert got["DeepSeek-V3 prefill"] == 272_629_760
    distinct = len(set(bt._positions(128, 8192, 1)))
    assert got["LLaMA-3-8B decode"] == 2 * (128 * 40 * 128) * 2 + 128 * 8 + distinct * 128 * 4 <= 2_688_000
    distinct = len(set(bt._positions(128, 32768, 2)))
    assert got["DeepSeek-V3 decode"] == 2 * (128 * 129 * 64) * 2 + 128 * 8 + distinct * 64 * 4 <= 4_260_864
    distinct = len(set(bt._positions(4001, 8192, 3)))
    assert got["fp32"] == (
        2 * (4001 * 18 * 64) * 4 + 4001 * 4 + distinct * 64 * 4) <= 37_913_476


def test_engram_bytes_by_hand():
    """engram.md 4 at T = 8192, M = 4: the gate forward counts x, k, v, w, the output and (saved) the four (T, M)
    statistics; the backward grad_out, x, k, v, w, the statistics, grad_x, grad_k, grad_v and the two fp32 weight
    gradients, plus what grad_w_reduce reads besides the partials (w_h, w_e, the accumulators it adds to)."""
    from tilefuse.bench import engram as bench_engram

    t, m = 8192, 4
    rows = {(c.name, c.describe()[0]): core.described_bytes(c) for c in bench_engram.quick_cases()}
    for h in (4096, 7168):
        x, v, w, stat = t * m * h * 2, t * h * 2, m * h * 4, t * m * 4
        assert rows["engram_gate_fwd", f"T={t} M={m} H={h} kv packed, no save"] == 3 * x + v + w
        assert rows["engram_gate_fwd", f"T={t} M={m} H={h} kv packed, save"] == 3 * x + v + w + 4 * stat
        spec = 5 * x + 2 * v + w + 4 * stat + 2 * m * h * 4
        bwd = rows["engram_gate_bwd", f"T={t} M={m} H={h} kv packed + grad_w_reduce P=132"]
        assert bwd == spec + 2 * m * h * 2 + 2 * m * h * 4
        assert rows["fused_weight", f"M={m} H={h}"] == 32 * h
        assert rows["grad_w_reduce", f"P=132 M={m} H={h}"] == 132 * m * h * 4 + 2 * m * h * 2 + 2 * 2 * m * h * 4
    assert rows["engram_hash", "T=8192 N=3 L=2 K=8"] == t * 3 * 4 + 2 * 3 * 8 + 2 * 2 * 8 * 4 + 2 * 16 * 4 + 2 * t * 16 * 4
