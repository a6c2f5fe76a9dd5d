"""Public batched_transpose_weight_sf (quant.md 5.13)."""

__all__: list[str] = []
