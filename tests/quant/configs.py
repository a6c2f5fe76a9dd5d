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

# norm_forward: (x dtype, hidden, weight, residual, quant, sf layout, round_sf, bf16 copy, rstd, mega-MoE sf)
NORM_FORWARD = [cfg for xd in ("bfloat16", "float32") for cfg in (
    (xd, 7168, True, True, False, "row", False, False, True, 0),
    (xd, 576, False, False, False, "row", False, False, True, 0),
    *((xd, 7168, True, True, True, layout, rnd, True, True, 0)
      for layout, rnd in (("row", False), ("col", False), ("col_packed", True))))] + [
    ("bfloat16", 576, True, False, True, "col_packed", True, False, True, 0),
    ("bfloat16", 7168, True, False, True, "row", True, False, True, 64),
    ("bfloat16", 7168, True, False, True, "row_packed", True, False, True, 0)]
# norm_backward: (x dtype, hidden, weight, residual)
NORM_BACKWARD = [(xd, h, w, r) for xd in ("bfloat16", "float32")
                 for h, w, r in ((7168, True, True), (576, False, False))]

# per_block_cast and per_block_cast_lossless: the GPU tests' block shapes and flag sets
PER_BLOCK_FLAG_SETS = ((False, True, False), (True, True, True))  # (col, round_sf, packed), quant.md 7.1
PER_BLOCK_BLOCKS = ((128, 128), (32, 32))                         # quant.md 7.2
LOSSLESS_OUT_BLOCKS = ((1, 128), (32, 32), (128, 128))            # lossless output blocks, in block (1, 32)


def _layout(col: bool, packed: bool) -> str:
    return ("col_packed" if packed else "col") if col else "row"


# per_block_cast: (x dtype, format, hidden, bm, bk, round_sf, sf layout, mode). Every block x format x flag set at
# H = 576 (a partial 128-channel block and a partial CTA tile), (128,128) at H = 7168, the mixed blocks with plain
# fp32 sf (row and col), fp32 input (its 128 x 128 CTA tile in every mode), sf-only and precomputed.
PER_BLOCK_CAST = [("bfloat16", fmt, 576, bm, bk, rnd, _layout(col, packed), "cast")
                  for bm, bk in PER_BLOCK_BLOCKS for fmt in ("e4m3", "e2m1")
                  for col, rnd, packed in PER_BLOCK_FLAG_SETS] + [
    ("bfloat16", fmt, 7168, 128, 128, True, "col_packed", "cast") for fmt in ("e4m3", "e2m1")] + [
    ("bfloat16", "e4m3", 2048, 32, 128, False, "row", "cast"),
    ("bfloat16", "e2m1", 2048, 128, 32, False, "col", "cast"),
    ("float32", "e4m3", 576, 128, 128, True, "col_packed", "cast"),
    ("float32", "e4m3", 1536, 128, 128, False, "row", "cast"),  # fp32, 128-row blocks at the 128 x 128 CTA tile
    ("float32", "e2m1", 576, 128, 128, True, "col_packed", "cast"),
    ("float32", "e2m1", 2048, 128, 32, False, "col", "cast"),
    ("float32", "e4m3", 576, 128, 128, True, "col_packed", "sf_only"),
    ("float32", "e4m3", 576, 128, 128, False, "row", "precomputed"),
    ("bfloat16", "e2m1", 576, 128, 128, True, "col_packed", "sf_only"),
    ("bfloat16", "e4m3", 576, 32, 32, False, "row", "precomputed"),
    ("bfloat16", "e2m1", 576, 128, 128, False, "row", "precomputed")]
# per_block_cast_lossless: (hidden, in bm, in bk, out bm, out bk, packed input sf, sf layout). Input block (1, 32);
# each output block with (fp32 row-major sf in, row-major sf out) and (packed col sf in, packed col sf out) at
# H = 576; fp32 col sf out; and (1, 128) packed at H = 7168.
PER_BLOCK_LOSSLESS = [(576, 1, 32, obm, obk, packed, "col_packed" if packed else "row")
                      for obm, obk in LOSSLESS_OUT_BLOCKS for packed in (False, True)] + [
    (576, 1, 32, 32, 32, True, "col"), (7168, 1, 32, 1, 128, True, "col_packed")]

# per_token_cast: (x dtype, format, hidden, npc, round_sf, sf layout, mode[, x_sf block rows, columns, packed x_sf])
PER_TOKEN_HIDDEN = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # quant.md 7.1: bf16 e4m3 with packed column sf
PER_TOKEN_ROW_WALK_HIDDEN = (1536, 2048, 18432)  # row-walk CTAs of several rows (1536, 2048), a part of a row (18432)
PER_TOKEN = list(dict.fromkeys(
    [("bfloat16", "e4m3", h, 128, True, "col_packed", "cast") for h in PER_TOKEN_HIDDEN]
    + [(xd, fmt, h, 128, rnd, layout, "cast") for h in (576, 7168) for xd in ("bfloat16", "float32")
       for fmt in ("e4m3", "e2m1") for rnd, layout in ((True, "row"), (True, "col_packed"), (False, "col"))]
    + [("bfloat16", "e4m3", 2048, npc, False, "row", "cast") for npc in (16, 32, 64, 2048)]
    # the row-walk tiles with row-major sf (``row_walk_threads``)
    + [(xd, "e4m3", h, 128, rnd, "row", "cast") for h in PER_TOKEN_ROW_WALK_HIDDEN
       for xd in ("bfloat16", "float32") for rnd in (False, True)]
    + [("bfloat16", fmt, 2048, 128, True, "row", "sf_only") for fmt in ("e4m3", "e2m1")]
    + [("bfloat16", fmt, 2048, 128, False, "row", "precomputed") for fmt in ("e4m3", "e2m1")]
    + [(xd, fmt, 2048, 128, True, "col_packed", "cast", 128, 128, True)
       for xd in ("float8_e4m3fn", "e2m1") for fmt in ("e4m3", "e2m1")]
    + [("float8_e4m3fn", "e4m3", 2048, 32, False, "row", "cast", 32, 32, False)]))
