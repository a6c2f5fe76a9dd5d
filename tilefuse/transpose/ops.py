"""Public transpose and batched_transpose (quant.md 3.15)."""

__all__: list[str] = []
