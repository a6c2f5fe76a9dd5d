"""Public RMSNorm (+ cast) ops (quant.md 5.11)."""

__all__: list[str] = []
