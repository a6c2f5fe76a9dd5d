"""Reference Engram hash, gate and Sinkhorn helpers (engram.md)."""

__all__: list[str] = []
