"""Errors of the NVPTX backend."""


class LoweringError(Exception):
    """An IR construct the NVPTX lowering cannot express (or that the target cannot run)."""
