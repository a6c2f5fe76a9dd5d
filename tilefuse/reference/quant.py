"""Reference casts: cast, cast_back, E5M6, per-channel fused cast (quant.md sections 1-3)."""

__all__: list[str] = []
