"""Static configs of the quant GPU tests, listed once: the GPU tests launch them and the compile tier builds each
for sm_90. The kernel modules register only the bench's configs; these compile on first use."""
from tilefuse.quant import _swiglu_kernel as swiglu

# per_channel_cast, by role: (x_kind, hidden, npt, round_sf, transpose, gather)
PER_CHANNEL = {
    "cast_bf16": ("bfloat16", 576, 128, True, False, False),
    "cast_fp32": ("float32", 576, 128, False, False, False),
    "transpose32": ("bfloat16", 576, 32, False, True, False),
    "transpose128": ("bfloat16", 576, 128, True, True, False),
    "gather": ("bfloat16", 200, 128, False, False, True),       # partial channel tile
    "gather_fp32": ("float32", 200, 128, True, False, True),    # 32-byte row loads
    "pair_gather": ("pair", 2048, 128, False, False, True),     # pre-quantized pair + gather
    "pair": ("pair", 2048, 128, True, False, False),            # pre-quantized pair, no gather
}

# per_token_cast_to_e5m6: (x dtype, hidden, round_sf, sf layout); (col, round, packed) = FTF and TTT, and a
# non-rounded row and column sf
E5M6_CAST = [(xd, h, r, lay) for xd in ("bfloat16", "float32") for h in (576, 7168)
             for r, lay in ((True, "row"), (True, "col_packed"))] + [
    ("bfloat16", 2048, False, "row"), ("bfloat16", 2048, False, "col"), ("bfloat16", 2048, True, "col")]
# the E5M6 cast-back launches of cast_back: (format, out, hidden, block rows, block columns, packed sf)
E5M6_CAST_BACK = [("e5m6", out, h, 1, h, packed) for out in ("bf16", "fp32") for h in (576, 7168)
                  for packed in (False, True)]

# cast_back: (format, out, hidden, block rows, block columns, packed sf)
CAST_BACK = [(dfmt, out, h, 1, npc, packed) for dfmt in ("e4m3", "e2m1") for out in ("bf16", "fp32")
             for h, npc, packed in ((576, 128, False), (576, 128, True), (2048, 2048, False))] + [
    ("e4m3", out, 2048, 128, bk, False) for out in ("bf16", "fp32") for bk in (1, 128)] + [
    ("e4m3", "fp32", 2048, 128, 128, True), ("e2m1", "bf16", 2048, 32, 32, False)]

# per_token_cast_and_cast_back: (x dtype, format, hidden, npc, sf mode)
CAST_AND_CAST_BACK = [(xd, fmt, 2048, 128, mode) for xd in ("bfloat16", "float32") for fmt in ("e4m3", "e2m1")
                      for mode in ("plain", "round", "e4m3")] + [
    ("bfloat16", "e4m3", 2048, npc, "plain") for npc in (16, 32, 64)] + [
    ("float32", "e2m1", 2048, 16, "round"),
    # wide rows (tile: a part-filled last vector slot, R = 7, three CTAs per row, five with an idle tail)
    ("bfloat16", "e4m3", 1536, 128, "plain"), ("bfloat16", "e4m3", 7168, 128, "plain"),
    ("bfloat16", "e2m1", 7168, 128, "e4m3"), ("bfloat16", "e4m3", 18432, 128, "round"),
    ("float32", "e2m1", 18432, 128, "plain")]

# SwiGLU forward per-token cases: (x dtype, H, npc, col, round_sf, packed, weighted, skip, clamp, count)
SWIGLU_FWD = (
    ("bfloat16", 1024, 128, True, True, True, False, False, None, False),
    ("bfloat16", 1280, 128, False, True, False, True, True, 0.5, True),
    ("bfloat16", 1536, 1536, False, False, False, True, False, 10.0, True),
    ("float32", 1024, 128, True, False, False, False, True, None, False),
)
SWIGLU_BWD = ((2048, 128, True, None), (2560, 32, False, 0.5), (7168, 128, False, 10.0))  # (H, npc, round, clamp)
SWIGLU_PCC = ((576, 32, True, True, None), (2048, 128, False, True, 0.5), (576, 128, True, False, 10.0))
# (H, npt, round_sf, transpose, clamp)


def swiglu_kernel_configs() -> list[tuple[str, tuple]]:
    """Every ``(kernel name, config)`` of the SwiGLU cases above."""
    return ([("swiglu_fwd_ptc", swiglu._fwd_ptc_cfg(*c)) for c in SWIGLU_FWD]
            + [("swiglu_bwd_ptc", swiglu._bwd_ptc_cfg(*c)) for c in SWIGLU_BWD]
            + [("swiglu_fwd_pcc", swiglu._pcc_cfg(*c)) for c in SWIGLU_PCC])
