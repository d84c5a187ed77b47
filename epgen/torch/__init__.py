"""The device-side API for inference engines: dispatch and combine on torch tensors, on the
caller's CUDA stream, with no host synchronisation (``EPBuffer``; docs/torch.md). torch is
an optional dependency, imported when an ``EPBuffer`` is made."""

from .buffer import DispatchOutput, EPBuffer

__all__ = ["EPBuffer", "DispatchOutput"]
