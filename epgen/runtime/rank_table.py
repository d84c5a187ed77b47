"""The by-value table of a rank-batched launch (``ir.RankBatch``): ``pack`` lays out every
rank's launch arguments as the lowering reads them (row ``q``: rank ``q``'s arguments, one
8-byte slot per parameter in declaration order; integers and pointers zero-extended, floats
as their bits in the low bytes); ``unpack`` reads a table back (the simulator launches from
it)."""

from __future__ import annotations

import numpy as np

from ir import nodes as N
from ir import types as T

_FLOAT_BITS = {16: (np.float16, np.uint16), 32: (np.float32, np.uint32),
               64: (np.float64, np.uint64)}


def _slot(p: N.Param, value) -> int:
    """The 8-byte slot of ``value`` (already converted for ``p``'s type: an int, or a
    float for a float parameter)."""
    if isinstance(p.dtype, T.PtrType):
        return int(value) & (2**64 - 1)
    if p.dtype.kind == "f":
        ftype, utype = _FLOAT_BITS[p.dtype.bits]
        return int(np.array(value, ftype).view(utype))
    return int(value) & ((1 << p.dtype.bits) - 1)


def pack(kernel: N.Kernel, rows: list[dict], convert) -> np.ndarray:
    """The table (u64 ``[ranks * n_params]``) of ``rows`` (one dict of launch arguments per
    rank, keyed by parameter name); ``convert(param, value)`` turns an argument into an int
    (a float for float parameters), e.g. a device array into its address. ``TypeError``
    names a missing or unknown argument; the row count must be the kernel's ranks."""
    batch = kernel.rank_batch
    if batch is None or len(rows) != batch.ranks:
        want = "a rank-batched kernel" if batch is None else f"{batch.ranks} rows"
        raise ValueError(f"kernel {kernel.name}: rank table of {len(rows)} rows, needs {want}")
    names = [p.name for p in kernel.params]
    table = np.zeros((batch.ranks, len(names)), np.uint64)
    for q, args in enumerate(rows):
        missing = [n for n in names if n not in args]
        extra = sorted(set(args) - set(names))
        if missing or extra:
            raise TypeError(f"kernel {kernel.name}, rank row {q}: missing arguments "
                            f"{missing}, unknown {extra}")
        for i, p in enumerate(kernel.params):
            table[q, i] = _slot(p, convert(p, args[p.name]))
    return table.reshape(-1)


def unpack(kernel: N.Kernel, table: np.ndarray) -> list[dict]:
    """Every rank's arguments from a table: ints, and floats for float parameters."""
    batch = kernel.rank_batch
    rows = np.asarray(table, np.uint64).reshape(batch.ranks, len(kernel.params))
    out = []
    for row in rows:
        args = {}
        for p, word in zip(kernel.params, row):
            if not isinstance(p.dtype, T.PtrType) and p.dtype.kind == "f":
                ftype, utype = _FLOAT_BITS[p.dtype.bits]
                args[p.name] = float(np.array(int(word) & ((1 << p.dtype.bits) - 1),
                                              utype).view(ftype))
            else:
                args[p.name] = int(word)
        out.append(args)
    return out


__all__ = ["pack", "unpack"]
