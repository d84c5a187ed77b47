"""One loaded value stored into several output rows: the receive of ``ep_rank_dedup`` reads a
message once and writes every grouped-output row it selects on this rank.

A ``RowFan`` is a static list of candidate rows, each with the predicate that says whether it
is written. The formats' copy emitters take a plain row (a u32 expression) or a ``RowFan``
wherever they take an output row: ``each_row`` maps the row to an address (an ``ir.Expr``, or
a ``FanAddress`` for a fan), ``FanAddress + offset`` and ``select`` keep the fan, and
``store`` emits one store per live row. A plain row takes none of these paths, so its code is
unchanged.

PTX Mapping: ``store(r, fan_address, v)`` is, per candidate row ``i``, ``@p_i
st.global.v4.b32 [base_i + off], v`` (one ``setp``-guarded store per row); the value's load
is issued once.
"""

from __future__ import annotations

import attrs

import ir


@attrs.frozen
class RowFan:
    """Rows ``rows[i]`` (u32 expressions), row ``i`` written when ``live[i]`` (pred
    expressions)."""

    rows: tuple
    live: tuple

    def __attrs_post_init__(self):
        if len(self.rows) != len(self.live) or not self.rows:
            raise ValueError(f"RowFan needs one predicate per row and at least one row, got "
                             f"{len(self.rows)} rows and {len(self.live)} predicates")


@attrs.frozen
class FanAddress:
    """The addresses of a ``RowFan``'s rows (u64 expressions), each with its row's
    predicate."""

    bases: tuple
    live: tuple

    def __add__(self, offset) -> FanAddress:
        return FanAddress(tuple(b + offset for b in self.bases), self.live)


def each_row(row, address_of):
    """``address_of(row)`` for a plain row; for a ``RowFan`` the ``FanAddress`` of
    ``address_of`` applied to each of its rows."""
    if isinstance(row, RowFan):
        return FanAddress(tuple(address_of(x) for x in row.rows), row.live)
    return address_of(row)


def select(cond, a, b):
    """``ir.Select(cond, a, b)`` on addresses; on two ``FanAddress`` of the same fan, row by
    row."""
    if isinstance(a, FanAddress) or isinstance(b, FanAddress):
        if not (isinstance(a, FanAddress) and isinstance(b, FanAddress)) \
                or a.live != b.live:
            raise TypeError("fanout.select needs two addresses of the same RowFan")
        return FanAddress(tuple(ir.Select(cond, x, y) for x, y in zip(a.bases, b.bases)),
                          a.live)
    return ir.Select(cond, a, b)


def store(r: ir.RoleBuilder, address, value) -> None:
    """``st.global`` of ``value`` at ``address``; at each live row of a ``FanAddress``."""
    if not isinstance(address, FanAddress):
        r.store(address, value)
        return
    for base, live in zip(address.bases, address.live):
        with r.if_(live):
            r.store(base, value)


__all__ = ["RowFan", "FanAddress", "each_row", "select", "store"]
