"""Public MoE routing ops (moe.md)."""

__all__: list[str] = []
