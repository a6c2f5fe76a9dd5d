"""Static configs of the mix-kernel GPU tests (split mixes, head mix), listed once: the GPU tests launch them and
the compile tier builds each for sm_90. The kernel module registers only the bench's configs (n = 4, token block
32); these compile on first use."""

MULTS = (2, 4, 8)          # multiplicities the GPU tests run (spec §0.3: split/head mix are written for any n)
KNOB_MULTS = (1,) + MULTS  # multiplicities of the SPLIT_FWD_FLAT / SUM_WARP / BWD_STAGED knob tests
HEAD_BLOCKS = (32, 8, 50)  # token_block_size values of the head-mix backward tests (0 means 32)


def mix_configs() -> list[tuple[str, tuple]]:
    """``(kernel name, config)`` of every launch of the GPU tests."""
    cfgs = [("mhc_partials_sum", ())]
    for n in KNOB_MULTS:
        cfgs += [("mhc_split_mixes_fwd", (n,)), ("mhc_split_mixes_bwd", (n, 32))]
        cfgs += [("mhc_head_mix_fwd", (n,))] if n in MULTS else []
        cfgs += [("mhc_head_mix_bwd", (n, tb)) for tb in HEAD_BLOCKS]
    return cfgs
