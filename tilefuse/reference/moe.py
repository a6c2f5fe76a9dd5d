"""Reference MoE routing (moe.md)."""

__all__: list[str] = []
