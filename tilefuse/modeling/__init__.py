"""Autograd layers composed from the public ops: the level most users call."""
