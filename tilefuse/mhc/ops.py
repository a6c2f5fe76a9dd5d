"""Public mHC ops (mhc.md)."""

__all__: list[str] = []
