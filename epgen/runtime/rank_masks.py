"""The host side of the rank mask (``ep_rank_mask``; docs/design.md, "Rank masks") of a
world: every held rank's mask words (``RankBuffers.rank_mask``, ``kernels.rank_mask``), the
tables of its peers' masks that the kernels push through, the shrink switch, and the ranks the
world has given up on.

A rank's mask is its own view: word ``q`` non-zero, it sends nothing to rank ``q`` and waits
for nothing from it. ``update(rank, masked, on=None)`` writes word ``rank`` of the views of
the held ranks ``on`` (default: every one); with ``on`` None the world also takes ``rank``
out of its calls (``dead``: not launched, its results None) or, unmasking it, back in
(``rejoin``; a rank the world gave up on also rejoins once no held rank it launches masks
it any more, each view cleared on its own). The kernels mask a rank themselves when a wait for it expires under shrink
(``shrink``), and record it; ``note`` reads those records after a call: the ranks they name
join ``dead`` and are the call's ``last``.

Unmasking is the one moment the world touches words a late rank may still write: it first
synchronises every held rank (a rank whose work is still queued, e.g. held on the simulator,
is refused: ``RuntimeError``), so every late store has landed, then re-arms every word the
others read from that rank (its count words to the sentinel, its arrival words to 0, the
final layout's cursors to 0) and the rank's own receive state, and sets its view to the
world's ``dead`` set.
"""

from __future__ import annotations

import numpy as np

from ..kernels.rank_mask import MASK_PARAM, PEERS_PARAM, mask_words, shrink_word
from .placement import p2p_group


class RankMasks:
    """The rank masks of ``world`` (module docstring); ``shrink``: the shrink switch's first
    setting."""

    def __init__(self, world, shrink: bool):
        self.world = world
        cfg = world.cfg
        self.n_ranks = cfg.n_ranks
        self.shrink = bool(shrink)
        #: ranks the world no longer launches (masked for every held rank, or by a kernel)
        self.dead: set[int] = set()
        #: the ranks the kernels masked in the last call ``note`` read
        self.last: list[int] = []
        self.peer_tables = {}
        self.build_tables()
        for rk in world.ranks:
            self._write(rk, self._fresh_view(rk.rank))

    def build_tables(self) -> None:
        """Each held rank's table of its P2P group's mask words (``world.pointer_table``),
        where its kernels push their masks (``world.build_pointer_tables`` rebuilds it)."""
        w, cfg = self.world, self.world.cfg
        for i, rk in enumerate(w.ranks):
            self.peer_tables[rk.rank] = w.pointer_table(
                i, p2p_group(cfg, rk.rank), [x.rank_mask for x in w.ranks])

    # -- launch arguments -----------------------------------------------------------------
    def args(self, rk, waits: bool) -> dict:
        """Rank ``rk``'s arguments of the flag's kernel parameters: ``rank_mask``, and for a
        kernel that waits for other ranks (``waits``) ``rank_mask_ptrs``."""
        out = {MASK_PARAM: rk.rank_mask}
        if waits:
            out[PEERS_PARAM] = self.peer_tables[rk.rank]
        return out

    # -- the views ----------------------------------------------------------------------------
    def _fresh_view(self, rank: int) -> np.ndarray:
        """The words of a rank (re)joining: the world's ``dead`` ranks masked (never
        itself), the shrink switch."""
        words = np.zeros(mask_words(self.world.cfg), np.uint32)
        for q in self.dead - {rank}:
            words[q] = 1
        words[shrink_word(self.world.cfg)] = int(self.shrink)
        return words

    def _write(self, rk, words: np.ndarray) -> None:
        rk.rank_mask.copy_from_host(np.ascontiguousarray(words, np.uint32))

    def _holders(self, on) -> list:
        """The held ranks ``on`` names (None: every one), ``ValueError`` for another."""
        if on is None:
            return list(self.world.ranks)
        ids = [on] if isinstance(on, int) and not isinstance(on, bool) else list(on)
        held = {rk.rank: rk for rk in self.world.ranks}
        bad = [q for q in ids if q not in held]
        if bad:
            raise ValueError(f"on: ranks {bad} are not held by this world "
                             f"(it holds {sorted(held)})")
        return [held[q] for q in ids]

    def _check_rank(self, rank) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) \
                or not 0 <= rank < self.n_ranks:
            raise ValueError(f"rank: must be a rank in [0, {self.n_ranks}), got {rank!r}")
        return int(rank)

    def _quiescent(self, what: str) -> None:
        """Synchronise the world; ``RuntimeError`` when a held rank still has work queued
        (a simulator hold), whose late stores could land after what ``what`` writes."""
        self.world.synchronize()
        held = getattr(self.world.cuda, "held", None)
        if held is None:
            return
        busy = [rk.rank for rk in self.world.ranks if held(rk.stream)]
        if busy:
            raise RuntimeError(f"{what}: rank(s) {busy} still have launches held back "
                               f"(backends.sim Machine.hold): release them first, so that "
                               f"their late stores land before the words are re-armed")

    def update(self, rank, masked: bool = True, on=None) -> None:
        """Set (``masked``) or clear word ``rank`` in the views of the held ranks ``on``
        (None: every held rank, and the world's ``dead`` set follows: module docstring)."""
        rank = self._check_rank(rank)
        if not isinstance(masked, (bool, np.bool_)):
            raise ValueError(f"masked: must be a bool, got {masked!r}")
        holders = self._holders(on)
        self._quiescent("update_mask")
        if on is None and not masked:
            self.rejoin(rank)
            return
        for rk in holders:
            words = rk.rank_mask.to_host()
            words[rank] = int(bool(masked))
            self._write(rk, words)
        if on is None:
            self.dead.add(rank)
        elif not masked:
            self._rejoin_unmasked()

    def _rejoin_unmasked(self) -> None:
        """Every ``dead`` rank that no live held rank masks any more rejoins (views cleared
        one at a time: each process of a DeepEP group unmasks in its own buffer)."""
        for q in sorted(self.dead):
            live = [rk for rk in self.world.ranks if rk.rank not in self.dead]
            if live and not any(rk.rank_mask.to_host()[q] for rk in live):
                self.rejoin(q)

    def rejoin(self, rank: int) -> None:
        """``rank`` back in every held rank's calls (after ``_quiescent``): the words the
        others read from it re-armed, its own receive state re-armed if the world holds it,
        its view the world's ``dead`` ranks, word ``rank`` cleared in every other view."""
        w, cfg = self.world, self.world.cfg
        lay = cfg.layout
        self.dead.discard(rank)
        comb = w.combiner_if_built()
        for i, rk in enumerate(w.ranks):
            if rk.rank == rank:
                rk.recv_count.copy_from_host(lay.recv_count_initial())
                rk.counters.zero()
                if comb is not None:
                    comb.bufs[i].arrival.zero()
                self._write(rk, self._fresh_view(rank))
                continue
            words = rk.recv_count.to_host()
            initial = lay.recv_count_initial()
            for e in range(lay.n_local_experts):
                words[e * cfg.n_ranks + rank] = initial[e * cfg.n_ranks + rank]
            if cfg.ep_final_layout:      # its cursor adds, wherever they landed
                words[lay.rc_cursor_base:lay.rc_cursor_base + lay.n_local_experts] = 0
            rk.recv_count.copy_from_host(words)
            if comb is not None:
                arr = comb.bufs[i].arrival.to_host()
                arr[rank] = 0
                comb.bufs[i].arrival.copy_from_host(arr)
            view = rk.rank_mask.to_host()
            view[rank] = 0
            self._write(rk, view)
        w.synchronize()

    def clean(self, on=None) -> None:
        """Clear every rank's word in the views of the held ranks ``on`` (None: every one;
        then every ``dead`` rank rejoins)."""
        holders = self._holders(on)
        self._quiescent("clean_mask")
        if on is None:
            for q in sorted(self.dead):
                self.rejoin(q)
        for rk in holders:
            words = rk.rank_mask.to_host()
            words[:self.n_ranks] = 0
            self._write(rk, words)
        if on is not None:
            self._rejoin_unmasked()

    def query(self, rank=None) -> np.ndarray:
        """``[n_ranks]`` int32, 1 where masked: held rank ``rank``'s view, or (None) the
        ranks some rank the world still launches masks, with the ``dead`` ones. Reads the
        device (synchronises)."""
        self.world.synchronize()
        if rank is not None:
            rk = self._holders([self._check_rank(rank)])[0]
            return (rk.rank_mask.to_host()[:self.n_ranks] != 0).astype(np.int32)
        out = np.zeros(self.n_ranks, np.int32)
        out[sorted(self.dead)] = 1
        for rk in self.world.ranks:
            if rk.rank not in self.dead:
                out |= (rk.rank_mask.to_host()[:self.n_ranks] != 0).astype(np.int32)
        return out

    def set_shrink(self, on: bool) -> None:
        """The shrink switch of every held rank (synchronises)."""
        if not isinstance(on, (bool, np.bool_)):
            raise ValueError(f"shrink: must be a bool, got {on!r}")
        self.world.synchronize()
        self.shrink = bool(on)
        for rk in self.world.ranks:
            words = rk.rank_mask.to_host()
            words[shrink_word(self.world.cfg)] = int(self.shrink)
            self._write(rk, words)

    # -- after a call -----------------------------------------------------------------------
    def note(self, records) -> list[int]:
        """The mask records (``ir.diag.MaskRecord``) of a call just checked: the ranks they
        name join ``dead``; returns them, sorted (also ``last``)."""
        self.last = sorted({int(rec.masked) for rec in records})
        self.dead.update(self.last)
        return list(self.last)


__all__ = ["RankMasks"]
