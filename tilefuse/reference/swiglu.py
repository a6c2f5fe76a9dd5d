"""Reference SwiGLU forward/backward (quant.md 3.11-3.14)."""

__all__: list[str] = []
