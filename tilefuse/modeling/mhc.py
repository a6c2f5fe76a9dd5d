"""Autograd mHC layers: mhc_pre, mhc_head, expand_from_embedding (mhc.md 2.10)."""

__all__: list[str] = []
