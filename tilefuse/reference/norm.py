"""Reference RMSNorm forward/backward (quant.md 5.11)."""

__all__: list[str] = []
