"""Autograd Engram gate: EngramGateFn and engram_gate (engram.md 2.7)."""

__all__: list[str] = []
