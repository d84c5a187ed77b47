"""The device error buffer that bounded waits report into, and its host-side check."""

from __future__ import annotations

import attrs
import numpy as np

from ir import diag

from ..errors import EPTimeoutError


@attrs.frozen
class DiagReport:
    """What one error buffer held (``DiagBuffer.take_report``)."""

    expired: bool
    timeouts: list
    masks: list


class DiagBuffer:
    """One zeroed error buffer (``ir.diag`` layout) shared by every launch of a group (e.g.
    all ranks of a world), so one expired wait makes every other wait of the group give up.
    ``cuda``: the backend that allocates it (default ``backends.cuda``)."""

    def __init__(self, device=None, stream=None, cuda=None):
        if cuda is None:
            from backends import cuda
        self.array = cuda.zeros(diag.BUFFER_WORDS, np.uint32, device=device, stream=stream)

    @property
    def ptr(self) -> int:
        return self.array.ptr

    def take(self, kernels) -> list | None:
        """The decoded records if any wait expired (the caller has synchronised the
        launches), None if none did; a used buffer is re-armed (zeroed) before returning."""
        words = self.array.to_host()
        if words[diag.ABORT_WORD] == 0 and words[diag.COUNT_WORD] == 0:
            return None
        self.array.zero()
        self.array.to_host()
        return diag.decode(words, kernels)

    def take_report(self, kernels) -> DiagReport:
        """Everything recorded since the last take (the caller has synchronised the
        launches), the buffer re-armed (zeroed) if anything was: ``expired`` (a wait expired:
        the abort word, or a timeout record), its ``timeouts`` and the ``masks`` (rank masks
        under shrink: a wait that ended by masking its rank, which is no failure)."""
        words = self.array.to_host()
        if words[diag.ABORT_WORD] == 0 and words[diag.COUNT_WORD] == 0:
            return DiagReport(False, [], [])
        self.array.zero()
        self.array.to_host()
        timeouts = diag.decode(words, kernels)
        masks = diag.decode_masks(words, kernels)
        return DiagReport(bool(words[diag.ABORT_WORD]) or bool(timeouts)
                          or not masks, timeouts, masks)

    def check(self, kernels, context: str = "") -> None:
        """Raise ``EPTimeoutError`` with the decoded records if any wait expired (the caller
        has synchronised the launches); the buffer is re-armed first."""
        records = self.take(kernels)
        if records is not None:
            raise EPTimeoutError(records, context)
