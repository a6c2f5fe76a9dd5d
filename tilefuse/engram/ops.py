"""Public Engram ops (engram.md)."""

__all__: list[str] = []
