"""Public per-token / per-block / per-channel casts, cast-back and E5M6 (quant.md sections 3, 5)."""

__all__: list[str] = []
