"""The checks of a world's constructor arguments that need no GPU, run before any device is
touched: a bad argument is a ``ValueError`` naming it on every machine, a GPU or not (only
then does a machine without one raise ``CudaUnavailableError``)."""

from __future__ import annotations

import operator

__all__ = ["check_world_args", "device_ordinal", "check_mask_args"]

#: the largest ``timeout_ns`` (a u64 launch argument)
TIMEOUT_NS_MAX = (1 << 64) - 1


def device_ordinal(world: str, name: str, value) -> int:
    """``value`` as a GPU ordinal (an integer >= 0, numpy's included, or a device object's
    ``device_id``), else ``ValueError`` naming ``world``'s parameter ``name``."""
    n = None
    if not isinstance(value, bool):
        try:
            n = operator.index(getattr(value, "device_id", value))
        except TypeError:
            pass
    if n is None or n < 0:
        raise ValueError(f"{world}: {name} = {value!r} is not a GPU ordinal (an integer >= 0)")
    return n


def check_world_args(world: str, *, timeout_ns=None, device=None) -> None:
    """``timeout_ns`` (None: the configuration's; else an integer in [0, 2**64), 0 =
    unbounded waits) and ``device`` (None: the current GPU; else an ordinal)."""
    if timeout_ns is not None and (isinstance(timeout_ns, bool) or not isinstance(timeout_ns, int)
                                   or not 0 <= timeout_ns <= TIMEOUT_NS_MAX):
        raise ValueError(f"{world}: timeout_ns must be None (the configuration's) or an integer "
                         f"in [0, 2**64) (0 = unbounded waits), got {timeout_ns!r}")
    if device is not None:
        device_ordinal(world, "device", device)


def check_mask_args(cfg, world: str, shrink, *, batched: bool = False) -> None:
    """The rank mask's (``ep_rank_mask``, docs/flags.md) constructor rules: ``shrink`` a
    bool, and True only with the flag; the flag not with ``batched`` (every rank's grid is
    one launch, so a rank cannot sit a call out). (Its SHMEM-transport rule is the
    configuration's: every destination of a masked world in one P2P group.)"""
    if not isinstance(shrink, bool):
        raise ValueError(f"{world}: shrink must be a bool, got {shrink!r}")
    if shrink and not cfg.ep_rank_mask:
        raise ValueError(f"{world}: shrink=True needs ep_rank_mask=True (the rank mask "
                         f"that an expired wait sets)")
    if cfg.ep_rank_mask and batched:
        raise ValueError(f"{world}: batched=True with ep_rank_mask=True: a batched launch "
                         f"runs every rank's grid at once, so a masked rank cannot sit a "
                         f"call out")
