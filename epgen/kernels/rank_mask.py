"""The rank mask (``ep_rank_mask``, docs/flags.md; the protocol in docs/design.md, "Rank
masks"): IR blocks every kernel that sends to or waits for another rank uses when the flag is
set.

Each rank has ``n_ranks + 1`` u32 words of its own (``rank_mask``, in its own memory): word
``q`` non-zero means this rank treats rank ``q`` as masked (it sends nothing to it and waits
for nothing from it); word ``n_ranks`` (``shrink_word``) is the shrink switch: non-zero, a
bounded wait for another rank that expires masks that rank instead of aborting the launch
group. The host sets the words between calls; a kernel sets word ``q`` itself when its wait
for ``q`` expires under shrink (``wait_for_rank``), and then also sets word ``my_rank`` of
``q``'s mask (``rank_mask_ptrs``, the P2P peers' masks): the push, so a rank that was only
late and runs after being masked sends nothing to the ranks that masked it. A word only goes
from 0 to 1 while kernels run (the host alone clears it), so a later read of a word never
sees less than an earlier one.
"""

from __future__ import annotations

import contextlib

import attrs

import ir
from ir import AtomOp, Scope, Sem, diag
from ir import types as T

from .common import load_pointer, word

#: the kernel parameters of the flag
MASK_PARAM = "rank_mask"
PEERS_PARAM = "rank_mask_ptrs"


def mask_words(cfg) -> int:
    """u32 words of one rank's mask buffer: one per rank, then the shrink switch."""
    return cfg.n_ranks + 1


def shrink_word(cfg) -> int:
    """Index of the shrink switch in a rank's mask buffer."""
    return cfg.n_ranks


@attrs.frozen
class MaskParams:
    """The flag's kernel parameters: ``mask`` (this rank's mask words) and, on a kernel that
    waits for other ranks, ``peers`` (the table of every P2P peer's mask words, the push)."""

    mask: ir.Param
    peers: ir.Param | None = None


def declare(kb: ir.KernelBuilder, cfg, *, waits: bool) -> MaskParams | None:
    """The flag's parameters on ``kb`` (None without ``ep_rank_mask``); ``waits``: the kernel
    waits for other ranks (it takes the peers' table too)."""
    if not cfg.ep_rank_mask:
        return None
    mask = kb.param(MASK_PARAM, T.ptr_global)
    return MaskParams(mask, kb.param(PEERS_PARAM, T.ptr_global) if waits else None)


def masked(r: ir.RoleBuilder, mp: MaskParams, rank, name: str = "masked") -> ir.Var:
    """Whether this rank treats ``rank`` as masked (a u32 0/1): ``ld.relaxed.sys`` of its mask
    word (a peer's push writes it from another GPU)."""
    w = r.load(word(mp.mask, rank), T.u32, Sem.RELAXED, Scope.SYS, name=f"{name}_w")
    return r.let(name, ir.Cast(T.u32, w.ne(0)))


def live(r: ir.RoleBuilder, mp: MaskParams, rank) -> ir.Expr:
    """A predicate: this rank does not treat ``rank`` as masked (``masked``)."""
    return masked(r, mp, rank).eq(0)


@contextlib.contextmanager
def if_live(r: ir.RoleBuilder, mp: MaskParams | None, rank):
    """``with if_live(r, mp, rank):`` the body runs only while ``rank`` is not masked; without
    the flag's parameters (``mp`` None) it runs as it is, no IR added."""
    if mp is None:
        yield
        return
    with r.if_(live(r, mp, rank)):
        yield


def wait_for_rank(r: ir.RoleBuilder, cfg, mp: MaskParams, addr, dtype, until, expected, *,
                  buffer: str, index, rank, my_rank, err_buf, kernel_name: str,
                  sem: Sem = Sem.ACQUIRE, scope: Scope = Scope.SYS, name: str = "seen"):
    """A bounded wait for a word that rank ``rank`` writes, under the mask: none when
    ``rank`` is masked already; else ``spin_wait_or_give_up`` that ends early when ``rank``
    gets masked (its mask word is the ``give_up`` word) and, with the shrink switch on, at
    expiry without aborting. On that expiry this thread masks ``rank`` (``atom.exch`` of 1 on
    its word), pushes the mask to ``rank`` (``st.relaxed.sys`` of 1 into word ``my_rank`` of
    ``rank``'s mask, through ``rank_mask_ptrs``) and records it (``record_mask``). Returns
    ``(seen, arrived)``: the last value seen and a u32 var, 1 only when the condition held
    (the word came)."""
    lay = cfg.layout
    seen = r.var(name, dtype, ir.Const(0, dtype))
    arrived = r.var(f"{name}_arrived", T.u32, 0)
    mask_word = word(mp.mask, rank)
    with r.if_(masked(r, mp, rank, name=f"{name}_pre").eq(0)):
        shrink = r.load(word(mp.mask, shrink_word(cfg)), T.u32, Sem.RELAXED, Scope.SYS,
                        name=f"{name}_shrink")
        got, status = r.spin_wait_or_give_up(addr, dtype, until, expected, buffer=buffer,
                                             index=index, give_up=mask_word, shrink=shrink,
                                             sem=sem, scope=scope, name=f"{name}_w")
        site_id = r.kb.sites[-1].site_id
        r.assign(seen, got)
        r.assign(arrived, ir.Cast(T.u32, status.eq(ir.SPIN_MET)))
        with r.if_(status.eq(ir.SPIN_EXPIRED)):
            old = r.atomic(AtomOp.EXCH, mask_word, 1, Sem.RELAXED, Scope.SYS,
                           name=f"{name}_was")
            peer = load_pointer(r, mp.peers, lay.peer_index(rank), f"{name}_peer")
            r.store(word(peer, my_rank), 1, Sem.RELAXED, Scope.SYS)
            with r.if_(old.eq(0)):      # one record per rank masked
                record_mask(r, err_buf, my_rank, kernel_name, site_id, index, rank,
                            got.cast(T.u32))
    return seen, arrived


def record_mask(r: ir.RoleBuilder, err_buf, my_rank, kernel_name: str, site_id: int, index,
                rank, last_seen):
    """This thread claims a record of the error buffer (``atom.relaxed.sys.add`` on its count
    word) and, if one is left, stores a ``diag.MASK_MAGIC`` record: kernel tag, wait site,
    ``my_rank``, block, thread, warp, ``index``, ``expected`` = the rank masked,
    ``last_seen``. The abort word is not raised."""
    slot = r.atomic(AtomOp.ADD, word(err_buf, diag.COUNT_WORD), 1, Sem.RELAXED, Scope.SYS,
                    name="mask_slot")
    with r.if_(slot < diag.MAX_RECORDS):
        base = r.let("mask_rec", slot * diag.RECORD_WORDS + diag.HEADER_WORDS)
        F = diag.FIELDS
        vals = {"magic": ir.Const(diag.MASK_MAGIC, T.u32),
                "kernel_tag": ir.Const(diag.kernel_tag(kernel_name), T.u32),
                "site_id": ir.Const(site_id, T.u32), "rank": ir.as_expr(my_rank),
                "block": r.block, "thread": r.tid, "warp": r.warp,
                "index": ir.as_expr(index).cast(T.u32), "expected": ir.as_expr(rank),
                "last_seen": ir.as_expr(last_seen)}
        for name, v in vals.items():
            r.store(word(err_buf, base + F[name]), v)


__all__ = ["MaskParams", "declare", "masked", "live", "if_live", "wait_for_rank", "record_mask",
           "mask_words", "shrink_word", "MASK_PARAM", "PEERS_PARAM"]
