"""Static configs of the gate forward kernel that the tests launch (test-only; the package registers the bench's in
``tilefuse/engram/_gate_fwd_kernel.py``)."""

TOKENS = (0, 1, 7, 4001, 8192)
GRID_M = (4, 2)
GRID_H = (512, 1024, 4096, 7168)
# an odd branch count with an odd chunk count (the load groups' guards), and the largest H the kernel takes
ODD = ((3, 768), (1, 12288))
# shapes the default token schedule does not take, so the dispatch keeps the row schedule: more branches than
# TOKEN_MAX_M, and x stages over TOKEN_SMEM_MAX (4 x 7168 bf16 = 56 KiB, the bench's; 8 x 7168 = 112 KiB)
ROW_SHAPES = ((9, 512), (4, 7168), (8, 7168))


def gate_fwd_configs() -> list[tuple]:
    """Every ``(M, H, save)`` the tests of the gate forward kernel build or launch."""
    shapes = list(dict.fromkeys([(m, h) for m in GRID_M for h in GRID_H] + list(ODD) + list(ROW_SHAPES)))
    return [(m, h, save) for m, h in shapes for save in (True, False)]


# The row schedule (``TOKEN_CTA = False``): the baseline every token-schedule knob set is compared against
ROW_KNOBS = {"TOKEN_CTA": False}
# The token schedule (``_gate_fwd_kernel.token_schedule``): the knob sets the tests build and launch (the bench's
# variant sweep; each names its TOKEN_CTA, TOKEN_STAGE_V and stage limit, so none depends on the defaults: the
# 96 KiB limit takes the bench's H = 7168 too), and the shapes they launch it at (the bench's, odd branch and chunk
# counts, the largest H, T not a multiple of TOKEN_ROWS)
_SWEPT = {"TOKEN_CTA": True, "TOKEN_SMEM_MAX": 96 * 1024}
TOKEN_KNOBS = ({**_SWEPT, "TOKEN_STAGE_V": True}, {**_SWEPT, "TOKEN_STAGE_V": False},
               {**_SWEPT, "TOKEN_STAGE_V": True, "TOKEN_ROWS": 2},
               {**_SWEPT, "TOKEN_STAGE_V": True, "LOADS_AHEAD": 7, "TOKEN_MIN_WARPS": 12},
               {**_SWEPT, "TOKEN_STAGE_V": True, "LOADS_AHEAD": 8, "TOKEN_MIN_WARPS": 20})
TOKEN_SHAPES = ((8192, 4, 4096), (8192, 4, 7168), (4001, 2, 512), (1001, 3, 768), (7, 1, 12288), (1, 4, 1024))


def token_variant_cases() -> list[tuple[dict, tuple]]:
    """``(knobs, (T, M, H))`` of ``TOKEN_KNOBS`` x ``TOKEN_SHAPES`` where the knobs select the variant (a larger x
    stage than ``TOKEN_SMEM_MAX`` keeps the row schedule, which ``ROW_SHAPES`` covers)."""
    from unittest import mock

    from tilefuse.engram import _gate_fwd_kernel as K

    cases = []
    for knobs in TOKEN_KNOBS:
        with mock.patch.multiple(K, **knobs):
            cases += [(knobs, shape) for shape in TOKEN_SHAPES if K.token_schedule(*shape[1:])]
    return cases
