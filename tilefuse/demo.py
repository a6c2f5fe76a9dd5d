"""``python -m tilefuse demo``: a miniature DeepSeek-V4-style block on random data, through the public API.

One block, forward then backward, with the specs' shapes (mhc.md 1.1/1.1a, engram.md 1-2, moe.md 1.5 and
2, quant.md 3.12-3.13):

* embedding -> ``n`` residual streams (``mhc.expand_to_mhc``);
* Engram: hash the token n-grams, look the rows up and project them (user code), gate the streams;
* mHC pre: RMSNorm + projection to the mix logits, split into pre/post/residual mixes, Sinkhorn, apply
  the pre mix to get the sub-layer input ``u``;
* MoE FFN: gate scores (user code), top-k, weight normalisation, fused expert-major mapping, expand,
  expert up-projection (user code), SwiGLU + per-token FP8 cast with the routing weights, cast back,
  down-projection (user code), ``reduce_fused`` back to tokens; an identity shared expert adds ``u``;
* mHC post: the new residual streams;
* backward: the same block through the autograd layers (``tilefuse.modeling``) and ``loss.backward()``,
  then the MoE backward by hand (expand the gradient, down-projection transpose, SwiGLU backward + FP8).

Each stage prints its outputs' shapes, a checksum (float64 sum of absolute values; padding rows of the
fused layout, whose content is unspecified, are left out), its wall time and the path it took: ``kernel``
or ``reference`` (from the op registry for CUDA tensors; CPU tensors always take the reference) or
``torch`` for user code. Weights come from a seeded generator on the CPU, so checksums agree across
devices up to the kernels' rounding.
"""
from __future__ import annotations

import re
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

import tilefuse
from tilefuse import engram, mhc, moe, quant
from tilefuse._cli_errors import ArgumentParser
from tilefuse.modeling import engram as modeling_engram, mhc as modeling_mhc
from tilefuse.testing import calc_diff, synchronize

__all__ = ["Config", "STAGES", "run_demo", "main"]

# Stage names in the order they run; every one prints one row.
STAGES = (
    "embed.expand", "engram.hash", "engram.lookup", "engram.gate",
    "mhc.norm_fn", "mhc.split_mixes", "mhc.sinkhorn", "mhc.apply_mix",
    "moe.scores", "moe.topk", "moe.normalize", "moe.fused_mapping", "moe.expand", "moe.up_proj",
    "quant.swiglu_fp8", "quant.cast_back", "moe.down_proj", "moe.reduce", "mhc.post",
    "backward.autograd", "backward.moe_down", "backward.swiglu_fp8",
)

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e4m3fn: "e4m3"}


@dataclass(frozen=True)
class Config:
    """Model sizes. ``hidden`` must satisfy the Engram backward (a multiple of 512, at least 1024;
    engram.md 2.5.1) and ``intermediate`` SwiGLU's ``% 128`` (quant.md 3.12)."""

    tokens: int = 64
    hidden: int = 1024
    mhc_mult: int = 4
    num_experts: int = 8
    num_topk: int = 2
    intermediate: int = 256
    max_ngram: int = 3          # engram N: id columns fed to the hash
    engram_heads: int = 4       # engram K: tables per n-gram order
    engram_dim: int = 32        # width of one table row
    vocab: int = 1000           # token ids are drawn from [0, vocab)
    num_per_channels: int = 128  # FP8 group size of the per-token casts
    alignment: int = 32         # fused-layout segment alignment
    norm_eps: float = 1e-6
    pre_eps: float = 1e-6
    sinkhorn_eps: float = 1e-6
    sinkhorn_repeat: int = 10
    post_mult_value: float = 1.0
    engram_eps: float = 1e-20
    engram_clamp: float = 1e-6
    seed: int = 0


def _init(cfg: Config, device: torch.device) -> dict[str, torch.Tensor]:
    """Random inputs and parameters, drawn on the CPU from one seeded generator, then moved to ``device``."""
    g = torch.Generator().manual_seed(cfg.seed)
    T, C, n, E, I = cfg.tokens, cfg.hidden, cfg.mhc_mult, cfg.num_experts, cfg.intermediate
    M, K = n * (n + 2), n * C
    N, heads, d = cfg.max_ngram, cfg.engram_heads, cfg.engram_dim

    def randn(*shape, std=1.0, mean=0.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g) * std + mean).to(dtype)

    tokens = torch.randint(0, cfg.vocab, (T,), generator=g, dtype=torch.int32)
    ngram_ids = torch.full((T, N), -1, dtype=torch.int32)  # column j: the token j positions earlier
    for j in range(N):
        ngram_ids[j:, j] = tokens[:T - j]
    vocab_sizes = torch.randint(500, 1000, (1, N - 1, heads), generator=g, dtype=torch.int32)
    p = {
        "embedding": randn(1, T, C, dtype=torch.bfloat16),
        "ngram_ids": ngram_ids,
        "multipliers": torch.randint(1, 2 ** 40, (1, N), generator=g, dtype=torch.int64) * 2 + 1,
        "vocab_sizes": vocab_sizes,
        "offsets": tilefuse.reference.make_offsets(vocab_sizes),
        "table": randn(int(vocab_sizes.sum()), d),
        "w_k": randn((N - 1) * heads * d, K, std=((N - 1) * heads * d) ** -0.5),
        "w_v": randn((N - 1) * heads * d, C, std=((N - 1) * heads * d) ** -0.5),
        "w_hidden": randn(n, C, std=0.1, mean=1.0, dtype=torch.bfloat16),
        "w_embed": randn(n, C, std=0.1, mean=1.0, dtype=torch.bfloat16),
        "mhc_fn": randn(M, K, std=K ** -0.5),
        "mhc_norm_weight": randn(K, std=0.1, mean=1.0),
        "mhc_scale": torch.tensor([0.5, 0.5, 0.5]),
        "mhc_base": randn(M, std=0.1),
        "w_gate": randn(C, E, std=C ** -0.5),
        "w_up": randn(E, C, 2 * I, std=C ** -0.5),
        "w_down": randn(E, I, C, std=I ** -0.5),
        "grad_residual": randn(1, T, n, C, std=T ** -0.5),  # the loss is sum(grad_residual * new residual)
    }
    return {name: t.to(device) for name, t in p.items()}


def _flat_tensors(out) -> list[tuple[str, torch.Tensor]]:
    items = []
    for name, value in out.items():
        if isinstance(value, torch.Tensor):
            items.append((name, value))
        elif isinstance(value, (tuple, list)):
            items += [(f"{name}[{i}]", t) for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
    return items


def _checksum(tensors: list[tuple[str, torch.Tensor]], valid_rows: torch.Tensor | None) -> float:
    total = 0.0
    for _, t in tensors:
        if valid_rows is not None and t.dim() > 0 and t.size(0) == valid_rows.numel():
            t = t[valid_rows]
        if t.dtype.is_floating_point and t.element_size() == 1:
            t = t.float()
        total += float(t.double().abs().sum())
    return total


def _describe(tensors: list[tuple[str, torch.Tensor]]) -> str:
    return ", ".join(f"{name} {tuple(t.shape)} {_DTYPE_NAMES.get(t.dtype, str(t.dtype).replace('torch.', ''))}"
                     for name, t in tensors)


@dataclass
class Row:
    stage: str
    outputs: str
    checksum: float
    ms: float
    path: str


class _Runner:
    """Runs stages, timing each and recording one row."""

    def __init__(self, device: torch.device, registry: dict[str, dict]):
        self.device, self.registry, self.rows = device, registry, []
        self.forward_diff: float | None = None  # autograd-layer forward vs op-by-op forward

    def path(self, ops: tuple[str, ...]) -> str:
        if not ops:
            return "torch"
        if self.device.type != "cuda":
            return "reference"
        paths = {self.registry[op]["path"] if op in self.registry else "reference" for op in ops}
        return paths.pop() if len(paths) == 1 else "kernel+reference"

    def run(self, stage: str, ops: tuple[str, ...], fn: Callable[[], dict], valid_rows=None) -> dict:
        synchronize(self.device)
        start = time.perf_counter()
        out = fn()
        synchronize(self.device)
        ms = (time.perf_counter() - start) * 1e3
        tensors = _flat_tensors(out)
        self.rows.append(Row(stage, _describe(tensors), _checksum(tensors, valid_rows), ms, self.path(ops)))
        return out


def _per_expert(x: torch.Tensor, weights: torch.Tensor, starts: list[int], ends: list[int], width: int,
                transpose: bool = False) -> torch.Tensor:
    """User code: one matmul per expert segment of the fused layout (a stand-in for a grouped GEMM), fp32
    accumulation, bf16 result; padding rows are zero."""
    out = torch.zeros(x.size(0), width, dtype=torch.bfloat16, device=x.device)
    for e, (s, t) in enumerate(zip(starts, ends)):
        if t > s:
            w = weights[e].t() if transpose else weights[e]
            out[s:t] = (x[s:t].float() @ w).bfloat16()
    return out


def _block(cfg: Config, p: dict[str, torch.Tensor], r: _Runner) -> None:
    """Run every stage once, appending one row per stage to ``r.rows``."""
    T, C, n, E, K, I = cfg.tokens, cfg.hidden, cfg.mhc_mult, cfg.num_experts, cfg.num_topk, cfg.intermediate
    npc = cfg.num_per_channels

    # ---- embedding and Engram ------------------------------------------------------------------
    R0 = r.run("embed.expand", ("mhc.expand_to_mhc",),
               lambda: {"residual": mhc.expand_to_mhc(p["embedding"], n)})["residual"]
    idx = r.run("engram.hash", ("engram.engram_hash",),
                lambda: {"indices": engram.engram_hash(p["ngram_ids"], p["multipliers"], p["vocab_sizes"],
                                                       p["offsets"])})["indices"]

    def lookup():
        rows = p["table"][idx[0].long()].reshape(T, -1)  # (T, C_idx * d): gather + concatenate
        return {"k": (rows @ p["w_k"]).view(1, T, n, C).bfloat16(), "v": (rows @ p["w_v"]).view(1, T, C).bfloat16()}

    kv = r.run("engram.lookup", (), lookup)

    def gate():
        w_fused = engram.fused_weight(p["w_hidden"], p["w_embed"])
        out = engram.engram_gate_fwd(R0.view(T, n, C), kv["k"].view(T, n, C), kv["v"].view(T, C), w_fused,
                                     cfg.engram_eps, cfg.engram_clamp, False)[0]
        return {"residual": out.view(1, T, n, C)}

    R1 = r.run("engram.gate", ("engram.fused_weight", "engram.engram_gate_fwd"), gate)["residual"]

    # ---- mHC pre -----------------------------------------------------------------------------------
    mixes = r.run("mhc.norm_fn", ("mhc.mhc_pre_norm_fn",),
                  lambda: {"mixes": mhc.mhc_pre_norm_fn(R1, p["mhc_fn"], p["mhc_norm_weight"], cfg.norm_eps)})["mixes"]
    split = r.run("mhc.split_mixes", ("mhc.mhc_pre_split_mixes",),
                  lambda: dict(zip(("pre", "post", "comb_logits"), mhc.mhc_pre_split_mixes(
                      mixes, p["mhc_scale"], p["mhc_base"], n, cfg.post_mult_value, cfg.pre_eps))))
    comb = r.run("mhc.sinkhorn", ("mhc.sinkhorn_normalize",),
                 lambda: {"comb": mhc.sinkhorn_normalize(split["comb_logits"], cfg.sinkhorn_repeat,
                                                         cfg.sinkhorn_eps)})["comb"]
    u = r.run("mhc.apply_mix", ("mhc.mhc_pre_apply_mix",),
              lambda: {"layer_input": mhc.mhc_pre_apply_mix(R1, split["pre"])})["layer_input"]

    # ---- MoE routing and experts ---------------------------------------------------------------------
    scores = r.run("moe.scores", (), lambda: {"scores": torch.sigmoid(u.view(T, C).float() @ p["w_gate"])})["scores"]
    topk_idx = r.run("moe.topk", ("moe.topk_gate",), lambda: {"topk_idx": moe.topk_gate(scores, K)})["topk_idx"]
    weights = r.run("moe.normalize", ("moe.normalize_weight",),
                    lambda: dict(zip(("denominator", "weights"),
                                     moe.normalize_weight(scores.gather(1, topk_idx)))))["weights"]
    names = ("pos_to_expert", "pos_to_token", "pos_to_token_topk", "token_topk_to_pos", "expert_start",
             "expert_end", "num_tokens_per_expert")
    fm = r.run("moe.fused_mapping", ("moe.get_fused_mapping",),
               lambda: dict(zip(names, moe.get_fused_mapping(topk_idx, E, 0, cfg.alignment)[:7])))
    starts, ends = fm["expert_start"].tolist(), fm["expert_end"].tolist()
    valid = fm["pos_to_expert"] >= 0  # padding rows of the fused layout have unspecified content
    xe = r.run("moe.expand", ("moe.expand_to_fused",),
               lambda: {"expanded": moe.expand_to_fused(u.view(T, C), fm["token_topk_to_pos"],
                                                         fm["pos_to_expert"])})["expanded"]
    h = r.run("moe.up_proj", (), lambda: {"gate_up": _per_expert(xe, p["w_up"], starts, ends, 2 * I)})["gate_up"]
    act = r.run("quant.swiglu_fp8", ("quant.swiglu_forward_and_per_token_cast",),
                lambda: dict(zip(("act", "act_sf"), quant.swiglu_forward_and_per_token_cast(
                    h, "e4m3", npc, fm["pos_to_token_topk"], weights, fm["pos_to_expert"]))), valid)
    a = r.run("quant.cast_back", ("quant.per_token_cast_back",),
              lambda: {"act": quant.per_token_cast_back((act["act"], act["act_sf"]), "bf16", npc)}, valid)["act"]
    ye = r.run("moe.down_proj", (), lambda: {"expert_out": _per_expert(a, p["w_down"], starts, ends, C)},
               valid)["expert_out"]
    y_routed = r.run("moe.reduce", ("moe.reduce_fused",),
                     lambda: {"moe_out": moe.reduce_fused(ye, None, fm["token_topk_to_pos"])})["moe_out"]

    # ---- mHC post: sub-layer output = routed experts + identity shared expert --------------------------
    R2 = r.run("mhc.post", ("mhc.mhc_post",),
               lambda: {"residual": mhc.mhc_post(u + y_routed.view(1, T, C), R1, split["post"], comb)})["residual"]

    # ---- backward through the autograd layers --------------------------------------------------------
    leaves = {}

    def autograd_backward():
        names = ("embedding", "w_hidden", "w_embed", "mhc_fn", "mhc_norm_weight", "mhc_scale", "mhc_base")
        leaves.update({name: p[name].detach().clone().requires_grad_() for name in names})
        leaves["k"] = kv["k"].detach().clone().requires_grad_()
        leaves["v"] = kv["v"].detach().clone().requires_grad_()
        leaves["moe_out"] = y_routed.view(1, T, C).detach().clone().requires_grad_()
        with torch.enable_grad():
            res0 = modeling_mhc.expand_from_embedding(leaves["embedding"], n)
            res1 = modeling_engram.engram_gate(res0, leaves["k"], leaves["v"], leaves["w_hidden"], leaves["w_embed"],
                               cfg.engram_clamp, cfg.engram_eps)
            layer_input, (post, comb_mix) = modeling_mhc.mhc_pre(
                res1, leaves["mhc_fn"], leaves["mhc_scale"], leaves["mhc_base"],
                norm_weight=leaves["mhc_norm_weight"], norm_eps=cfg.norm_eps, mhc_mult=n,
                post_mult_value=cfg.post_mult_value, pre_eps=cfg.pre_eps, sinkhorn_eps=cfg.sinkhorn_eps,
                sinkhorn_repeat=cfg.sinkhorn_repeat)
            res2 = mhc.mhc_post(layer_input + leaves["moe_out"], res1, post, comb_mix)
            (res2.float() * p["grad_residual"]).sum().backward()
        leaves["residual"] = res2.detach()
        return {f"d_{name}": leaves[name].grad for name in ("embedding", "k", "v", "w_hidden", "w_embed", "mhc_fn",
                                                            "mhc_norm_weight", "mhc_scale", "mhc_base", "moe_out")}

    grads = r.run("backward.autograd", ("mhc.expand_to_mhc_bwd", "engram.engram_gate_bwd", "engram.grad_w_reduce",
                                        "mhc.mhc_fn_normw_merge_bwd", "mhc.mhc_pre_split_mixes_bwd",
                                        "mhc.mhc_sinkhorn_bwd", "mhc.mhc_pre_apply_mix_bwd", "mhc.mhc_post_bwd"),
                  autograd_backward)
    r.forward_diff = 0.0 if torch.equal(leaves["residual"], R2) else calc_diff(leaves["residual"], R2)

    g_exp = r.run("backward.moe_down", ("moe.expand_to_fused",), lambda: {"d_act": _per_expert(
        moe.expand_to_fused(grads["d_moe_out"].view(T, C), fm["token_topk_to_pos"], fm["pos_to_expert"]),
        p["w_down"], starts, ends, I, transpose=True)})["d_act"]

    def swiglu_backward():
        h_fp8 = quant.per_token_cast(h, "e4m3", npc)
        out, d_fp8, d_gate_up, d_weights = quant.swiglu_backward_and_per_token_cast(
            h_fp8, g_exp, weights, fm["pos_to_token_topk"], fm["token_topk_to_pos"], npc)
        return {"act": out, "d_gate_up_fp8": d_fp8, "d_gate_up": d_gate_up, "d_weights": d_weights}

    r.run("backward.swiglu_fp8", ("quant.per_token_cast", "quant.swiglu_backward_and_per_token_cast"),
          swiglu_backward)


def run_demo(cfg: Config, device: torch.device, repeat: int = 1, rows: list[Row] | None = None) -> _Runner:
    """Run the block ``repeat`` (>= 1) times (the first run on a GPU compiles kernels) and return the runner
    holding the rows of the last run. Raises whatever a stage raises; ``rows``, when given, receives the
    rows of the current run as they complete (to show how far a failing run got)."""
    from tilefuse._registry import load_all

    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"run_demo: repeat must be an int >= 1, got {repeat!r}")

    registry = load_all()
    p = _init(cfg, device)
    for _ in range(repeat):
        runner = _Runner(device, registry)
        if rows is not None:
            rows.clear()
            runner.rows = rows
        with torch.no_grad():
            _block(cfg, p, runner)
    return runner


def _print_rows(rows: list[Row]) -> None:
    """One line per stage: stage, checksum, ms, path, then the outputs (the widest column) last."""
    w_stage = max(len("stage"), *(len(row.stage) for row in rows))
    w_path = max(len("path"), *(len(row.path) for row in rows))
    print(f"{'stage':<{w_stage}}  {'checksum':>12}  {'ms':>9}  {'path':<{w_path}}  outputs")
    for row in rows:
        print(f"{row.stage:<{w_stage}}  {row.checksum:>12.6e}  {row.ms:>9.2f}  {row.path:<{w_path}}  {row.outputs}")


def _parse(argv: list[str] | None):
    """The demo's options, each checked before any work (a bad one raises ``_cli_errors.UsageError``, which
    ``python -m tilefuse`` prints as one line with exit status 2). Returns ``(cfg, device, repeat)``."""
    parser = ArgumentParser(prog="python -m tilefuse demo",
                            description="Run a miniature DeepSeek-V4-style block through the public API.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--tokens", type=int, default=Config.tokens, help="number of tokens (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=Config.hidden,
                        help="hidden size, a multiple of 512 and >= 1024 (default %(default)s)")
    parser.add_argument("--seed", type=int, default=Config.seed, help="seed of the random data (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="runs of the block; the last one is reported (default: 2 on CUDA, 1 on CPU)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        parser.fail(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.fail(f"--device {args.device}: no CUDA device is available (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.fail(f"--device {args.device}: there are {torch.cuda.device_count()} CUDA devices")
    if args.tokens < 1:
        parser.fail(f"--tokens must be >= 1, got {args.tokens}")
    if args.hidden < 1024 or args.hidden % 512:
        parser.fail(f"--hidden must be a multiple of 512 and >= 1024 (the Engram backward's rule), got {args.hidden}")
    if not 0 <= args.seed < 2 ** 64:
        parser.fail(f"--seed must be in [0, 2**64), got {args.seed}")
    if args.repeat is not None and args.repeat < 1:
        parser.fail(f"--repeat must be >= 1, got {args.repeat}")
    repeat = args.repeat if args.repeat is not None else (2 if device.type == "cuda" else 1)
    return Config(tokens=args.tokens, hidden=args.hidden, seed=args.seed), device, repeat


def main(argv: list[str] | None = None) -> int:
    cfg, device, repeat = _parse(argv)
    print(f"tilefuse {tilefuse.__version__} demo: {cfg.tokens} tokens, hidden {cfg.hidden}, mhc_mult {cfg.mhc_mult}, "
          f"{cfg.num_experts} experts top-{cfg.num_topk}, intermediate {cfg.intermediate}, device {device}")
    rows: list[Row] = []
    try:
        runner = run_demo(cfg, device, repeat, rows)
    except Exception:
        if rows:
            _print_rows(rows)
        failed = STAGES[len(rows)] if len(rows) < len(STAGES) else "setup"
        print(f"demo failed in stage {failed}:", file=sys.stderr)
        traceback.print_exc()
        return 1
    _print_rows(runner.rows)
    total = sum(row.ms for row in runner.rows)
    print(f"total {total:.1f} ms over {len(runner.rows)} stages")
    if runner.forward_diff == 0.0:
        print("check: the autograd layers' forward is bitwise equal to the op-by-op forward")
    else:
        print(f"check: the autograd layers' forward differs from the op-by-op forward (calc_diff "
              f"{runner.forward_diff:.3e})")
    return 0
