"""``RankDedupDestination``: the destination strategy of ``ep_rank_dedup`` (ours, docs/flags.md):
each token crosses to a destination rank once, however many of its experts live there.

The receive buffer holds a *message area* of ``n_ranks * max_tokens_per_rank`` message rows
(source ``src``'s token ``t`` at row ``layout.dedup_msg_row(src, t)``: fixed, no cursor,
nothing to re-arm) and an *index table* of u32 words after it, one per (local expert, source,
slot) (``layout.dedup_index_word``): the source token index of that slot.

Send side: every top-k slot that takes a slot reserves its row ``j`` on the source-local
counter of ``(e, dst)`` as the staged layout does (``take_slot``), stores the token index
into index word ``(e, my_rank, j)`` of the destination, and counts its copy finished as
before. Only the slot that *leads* its (token, destination rank), the lowest ``k`` whose
expert lives there (``leads``), stores the message (payload and header) into the message
area; the others' destination address is 0, so the send paths store nothing for them. The
monitor, the count words and the aux block are the staged layout's: a block's count is still
its number of top-k slots.

Ordering: a token's message stores, whichever slot's thread or warp makes them, come before
the release of every finished counter of that token's slots on that rank: on the warp path
the warp's stores, ``bar.warp.sync``, then each lane's release; on the block-staged broadcast
the block's stores, the send join, then the releases; on the send-buffer path the leader
warp handles every slot of its (token, rank) itself (``send_slot``: the message, each slot's
reservation and index word, ``bar.warp.sync``, each slot's release). Each index word is
stored by the thread that releases that slot's counter, before the release. The monitor
acquires the finished counter and releases the count word, so a destination that acquires
count word ``(e, src)`` sees every index word of the block and every message they name.

Destinations outside the P2P group (``cfg.needs_shmem``, docs/shmem.md): the leader's warp
puts the message once, fences, then puts each slot's index word with a put-with-signal on
its block's arrival word (``put_slot_to_remote``), so the destination's count-then-arrival
wait is the staged layout's.

Wait side: the copy pass reads slot ``j``'s index word and copies message row
``dedup_msg_row(src, t)`` (``message_address``); ``src_info``'s ``k`` comes from the header's
top-k ids as before.

Weights and the row map (for the partial-reduce combine, docs/combine.md): a message-area row
is ``layout.dedup_row_bytes`` long, the format's message then, at ``dedup_weights_offset``,
the token's ``K`` float32 router weights (dispatch_async's ``topk_weights`` parameter, ``[T,
K]``). The thread whose slot leads a (token, rank) stores them with the message
(``reserve_slot``: its own stores, before the same join or warp barrier as the message's);
on the send-buffer path threads ``k < K`` stage weight ``k`` in the send-buffer row
(``stage_slot``), which the leader's warp copies (or puts) whole. The copy pass's lane that
writes ``src_info[row] = (t, k)`` also stores ``row_map[dedup_msg_row(src, t) * K + k] :=
row`` (dispatch_wait's ``row_map`` parameter, ``layout.dedup_row_map_words`` u32 words,
``record_row``).
"""

from __future__ import annotations

import contextlib

import ir
from ir import AtomOp, CacheHint, Scope, Sem, ShflMode, nvshmem
from ir import types as T

from .. import fanout
from . import rank_mask
from .common import comm_sync, copy_vectors, load_pointer
from .common import word as _word
from .shmem_send import arrival_address, is_remote
from .staged import StagedDestination


class RankDedupDestination(StagedDestination):
    """One message per (token, destination rank) (module docstring). ``side``: the
    strategy's own parameter (``topk_weights`` on the send side, ``row_map`` on the wait
    side)."""

    def __init__(self, cfg, p, side=None):
        super().__init__(cfg, p)
        self.side = side
        self._starts = self._prefixes = None     # the copy role's scratch (start_copies)

    @classmethod
    def declare_send(cls, kb: ir.KernelBuilder, cfg, p) -> RankDedupDestination:
        """The send side, with its ``topk_weights`` parameter (f32 ``[T, K]``: the router
        weights the messages carry)."""
        return cls(cfg, p, kb.param("topk_weights", T.ptr_global))

    @classmethod
    def declare_wait(cls, kb: ir.KernelBuilder, cfg, p) -> RankDedupDestination:
        """The wait side, with its ``row_map`` parameter (u32 ``[dedup_msg_rows, K]``)."""
        return cls(cfg, p, kb.param("row_map", T.ptr_global))

    # ---- send side ----------------------------------------------------------------------------
    def leads(self, r: ir.RoleBuilder, t, k, dst_rank) -> ir.Expr:
        """Whether top-k slot ``k`` of token ``t`` leads its destination ``dst_rank`` (a valid
        rank): no earlier slot ``j < k`` of the token has an expert there (``topk_ids[t, j] //
        L != dst_rank``; a ``-1`` id or the id check's sentinel ``n_experts`` is never a valid
        rank). The token's first ``K - 1`` ids, ``ld.global.nc``, all in flight at once."""
        K, L = self.cfg.layout.top_k, self.cfg.layout.n_local_experts
        k, dst_rank = ir.as_expr(k), ir.as_expr(dst_rank)
        earlier = ir.Const(0, T.pred)
        for j in range(K - 1):
            gj = r.load(_word(self.p.topk_ids, t * K + j), T.u32, cache=CacheHint.NC,
                        name="lead_id")
            earlier = earlier | ((k > j) & (gj // L).eq(dst_rank))
        return r.let("leads", ~earlier)

    def _recv(self, r: ir.RoleBuilder, dst_rank) -> ir.Var:
        """``dst_rank``'s receive buffer (the P2P pointer table's entry)."""
        lay = self.cfg.layout
        return load_pointer(r, self.p.recv_buf_ptrs, lay.peer_index(dst_rank), "recv_dst",
                            peer=lay.crosses_devices)

    def _live(self, r: ir.RoleBuilder, dst_rank) -> ir.Expr:
        """Whether anything is stored to ``dst_rank`` (``ep_rank_mask``: not a masked rank)."""
        mp = getattr(self.p, "mask", None)
        return ir.Const(1, T.pred) if mp is None else rank_mask.live(r, mp, dst_rank)

    def _message_at(self, recv, t) -> ir.Expr:
        """This rank's token ``t``'s row in the message area of receive buffer ``recv``."""
        lay = self.cfg.layout
        row = lay.dedup_msg_row(self.p.my_rank, t).cast(T.u64)
        return recv + row * lay.dedup_row_bytes

    def _store_weights(self, r: ir.RoleBuilder, at, t) -> None:
        """One thread: token ``t``'s ``K`` weights (``ld.global.nc.f32``, all issued first)
        into the message row at ``at`` (u64), from ``dedup_weights_offset``."""
        K, off = self.cfg.layout.top_k, self.cfg.layout.dedup_weights_offset
        ws = [r.load(_word(self.side, t * K + k), T.f32, cache=CacheHint.NC, name=f"w_msg{k}")
              for k in range(K)]
        for k, w in enumerate(ws):
            r.store(ir.Cast(T.ptr_global, at + (off + 4 * k)), w)

    def _slot_word_at(self, recv, t, k) -> ir.Expr:
        """The address of slot-table word ``(my_rank, t, k)`` of receive buffer ``recv``."""
        lay = self.cfg.layout
        w = lay.dedup_slot_word(self.p.my_rank, t, k).cast(T.u64)
        return recv + (w * 4 + lay.dedup_slot_offset)

    def _store_slot(self, r: ir.RoleBuilder, recv, e, slot, t, k, live) -> None:
        """Top-k slot ``k`` of token ``t`` took row ``slot`` of block ``(e, my_rank)`` of
        receive buffer ``recv``: slot-table word ``(my_rank, t, k)`` := ``slot`` and index word
        ``(e, my_rank, slot)`` := ``t``; nothing when the destination is masked (``live``
        false), and no index word when ``slot`` is past the block's capacity (device guard,
        as the staged layout's; the slot word still says so, for the receive to skip it)."""
        lay = self.cfg.layout
        with r.if_(live):
            r.store(self._slot_word_at(recv, t, k), ir.as_expr(slot))
            with r.if_(slot < lay.block_capacity):
                w = lay.dedup_index_word(e, self.p.my_rank, slot).cast(T.u64)
                r.store(recv + (w * 4 + lay.dedup_index_offset), ir.as_expr(t))

    def reserve_slot(self, r: ir.RoleBuilder, g, dst_rank, co_word, slot, addr, token=None):
        """The staged reservation (``co_word``, ``slot``), then the slot's slot and index
        words (``_store_slot``) and, for the slot that ``leads`` its rank, ``addr`` := the token's
        message row (0 otherwise: nothing sent). ``token``: ``(t, k)``, required."""
        if token is None:
            raise ValueError("RankDedupDestination.reserve_slot needs token=(t, k)")
        t, k = token
        e = r.let("e", g % self.cfg.layout.n_local_experts)
        with self.slot_counter(r, g, dst_rank, e) as co:
            r.assign(co_word, co)
            r.assign(slot, self.take_slot(r, co))
            recv = self._recv(r, dst_rank)
            live = r.let("dst_live", self._live(r, dst_rank))
            self._store_slot(r, recv, e, slot, t, k, live)
            with r.if_(live & self.leads(r, t, k, dst_rank)):
                r.assign(addr, ir.Cast(T.u64, self._message_at(recv, t)))
                self._store_weights(r, addr, t)

    def send_slot(self, r: ir.RoleBuilder, msg, t, k, g, dst_rank, e) -> None:
        """The send-buffer path's warp of top-k slot ``k`` of token ``t``: when the slot
        ``takes_slot`` and ``leads`` its rank, the warp does the whole (token, rank): it
        copies the staged message ``msg`` into the message area (``copy_to_message_area``),
        lane 0 reserves a row for every slot ``k' >= k`` of the token whose expert lives on
        ``dst_rank`` and stores its index word (``reserve_rank_slots``), ``bar.warp.sync``,
        then lane 0 counts each of those copies finished (``count_rank_slots``). A slot that
        does not lead does nothing: its leader's warp did it."""
        with r.if_(self.takes_slot(g, dst_rank) & self.leads(r, t, k, dst_rank)):
            recv = self._recv(r, dst_rank)
            live = r.let("dst_live", self._live(r, dst_rank))
            self.copy_to_message_area(r, msg, recv, t, live)
            self.reserve_rank_slots(r, recv, t, k, dst_rank, live)
            r.warp_sync()
            self.count_rank_slots(r, t, k, dst_rank)

    def stage_slot(self, r: ir.RoleBuilder, msg, t, k) -> None:
        """Thread ``k`` of the send-buffer staging: weight ``k`` of token ``t`` into the
        row's weights (``dedup_weights_offset``)."""
        w = r.load(_word(self.side, t * self.cfg.layout.top_k + k), T.f32, cache=CacheHint.NC,
                   name="w_stage")
        r.store(msg + self.cfg.layout.dedup_weights_offset + (k * 4).cast(T.u64), w)

    def copy_to_message_area(self, r: ir.RoleBuilder, msg, recv, t, live) -> None:
        """The whole warp: the staged row ``msg`` (message and weights) to token ``t``'s row
        of receive buffer ``recv``'s message area when ``live`` (``copy_vectors``: 16-byte
        stores)."""
        lay = self.cfg.layout
        with r.if_(live):
            dst = r.let("dst", self._message_at(recv, t), peer=lay.crosses_devices)
            copy_vectors(r, dst, msg, lay.dedup_row_bytes // 16, r.lane, 32, tag="fan")

    @contextlib.contextmanager
    def _rank_slots(self, r: ir.RoleBuilder, name: str, t, k, dst_rank):
        """Lane 0, ``with`` body once per slot ``k' >= k`` of token ``t`` whose expert lives
        on ``dst_rank``: the body gets ``(k', that expert's local index)``."""
        K, L = self.cfg.layout.top_k, self.cfg.layout.n_local_experts
        with r.if_(r.lane.eq(0)):
            with r.for_range(name, k, K, 1) as kk:
                g = r.load(_word(self.p.topk_ids, t * K + kk), T.u32, cache=CacheHint.NC,
                           name=f"g_{name}")
                with r.if_((g // L).eq(dst_rank)):
                    yield kk, r.let(f"e_{name}", g % L)

    def reserve_rank_slots(self, r: ir.RoleBuilder, recv, t, k, dst_rank, live) -> None:
        """Lane 0: a row (``take_slot``) and its slot and index words (``_store_slot``) for
        every slot ``k' >= k`` of token ``t`` on ``dst_rank``."""
        R = self.cfg.n_ranks
        with self._rank_slots(r, "k_same", t, k, dst_rank) as (kk, e):
            slot = self.take_slot(r, e * R + self.cfg.layout.rank_coord(dst_rank))
            self._store_slot(r, recv, e, slot, t, kk, live)

    def count_rank_slots(self, r: ir.RoleBuilder, t, k, dst_rank) -> None:
        """Lane 0: every slot ``k' >= k`` of token ``t`` on ``dst_rank`` counted finished
        (``red.release.gpu.add`` on its finished counter)."""
        finished = _word(self.p.counters, self.cfg.n_experts)
        with self._rank_slots(r, "k_done", t, k, dst_rank) as (_, e):
            co = e * self.cfg.n_ranks + self.cfg.layout.rank_coord(dst_rank)
            r.red(AtomOp.ADD, _word(finished, co), 1, Sem.RELEASE, Scope.GPU)

    def put_slot_to_remote(self, r: ir.RoleBuilder, msg, t, k, g, dst_rank, e, issued) -> None:
        """The send-buffer path's warp of top-k slot ``k`` of token ``t`` (staged in
        send-buffer row ``msg``) when ``dst_rank`` is outside the P2P group and the slot
        ``leads`` its rank: the warp does the whole (token, rank) through NVSHMEM. It puts the
        message once into the token's row of ``dst_rank``'s message area
        (``nvshmemx_putmem_nbi_warp``); then for every slot ``k' >= k`` of the token on
        ``dst_rank`` lane 0 reserves its row ``j`` (``take_slot``) and stores it into slot-table
        word ``(my_rank, t, k')`` of this rank's own receive buffer (a word this rank never
        reads: slot ``k'``'s expert lives on ``dst_rank``), ``bar.warp.sync``, and the warp
        puts that word to the same word of ``dst_rank`` (``nvshmemx_putmem_nbi_warp``, 4
        bytes). Lane 0 calls ``nvshmem_fence()`` (the message and the slot words reach
        ``dst_rank`` before the warp's later puts). Then for each of those slots: unless its
        ``j`` (read back from the own word) is past the block's capacity the warp puts its
        index word with a signal (``nvshmemx_putmem_signal_nbi_warp``: 4 bytes from the staged
        header's source index, which is ``t``, then 1 added to the arrival word of block
        ``(e', my_rank)`` there); lane 0 counts the slot issued (``red.release.gpu.add``).
        ``issued`` := 1 (the warp's ``nvshmem_quiet`` after its last token completes them:
        ``complete_remote_puts``). Each slot's signal is delivered after its index word (the
        put-with-signal) and after the message and slot words (the fence), so the
        destination's wait is unchanged: the count word, then the arrival word up to it.
        Symmetric addresses are this rank's own (``recv_buf_ptrs[my_rank % P]``), as in
        ``shmem_send.put_to_remote``. A slot that does not lead does nothing."""
        cfg, p, lay = self.cfg, self.p, self.cfg.layout
        R, P = cfg.n_ranks, cfg.p2p_world_size
        finished = _word(p.counters, cfg.n_experts)
        remote = is_remote(cfg, dst_rank, p.my_rank) & (g < cfg.n_experts)
        with r.if_(remote & self.leads(r, t, k, dst_rank)):
            own = load_pointer(r, p.recv_buf_ptrs, p.my_rank % P, "recv_sym")
            nvshmem.putmem_nbi_warp(r, ir.Cast(T.u64, self._message_at(own, t)),
                                    ir.Cast(T.u64, msg), lay.dedup_row_bytes, dst_rank)
            with self._remote_slots(r, "k_rs", t, k, dst_rank) as (k2, e2):
                word_at = r.let("slot_word", ir.Cast(T.u64, self._slot_word_at(own, t, k2)))
                with r.if_(r.lane.eq(0)):
                    slot = self.take_slot(r, e2 * R + dst_rank)
                    r.store(ir.Cast(T.ptr_global, word_at), slot)
                r.warp_sync()
                nvshmem.putmem_nbi_warp(r, word_at, word_at, 4, dst_rank)
            with r.if_(r.lane.eq(0)):
                nvshmem.fence(r)
            staged_index = ir.Cast(T.u64, msg + cfg.token_fmt.src_info_offset)
            with self._remote_slots(r, "k_rm", t, k, dst_rank) as (k2, e2):
                slot_b = r.load(ir.Cast(T.ptr_global, self._slot_word_at(own, t, k2)), T.u32,
                                name="slot_rm")
                with r.if_(slot_b < lay.block_capacity):
                    w = lay.dedup_index_word(e2, p.my_rank, slot_b).cast(T.u64)
                    at = ir.Cast(T.u64, own) + (w * 4 + lay.dedup_index_offset)
                    nvshmem.putmem_signal_nbi_warp(r, at, staged_index, 4,
                                                   arrival_address(r, cfg, p, e2), 1,
                                                   nvshmem.SIGNAL_ADD, dst_rank)
                with r.if_(r.lane.eq(0)):
                    r.red(AtomOp.ADD, _word(finished, e2 * R + dst_rank), 1, Sem.RELEASE,
                          Scope.GPU)
            r.assign(issued, 1)

    @contextlib.contextmanager
    def _remote_slots(self, r: ir.RoleBuilder, name: str, t, k, dst_rank):
        """The whole warp, ``with`` body once per slot ``k' >= k`` of token ``t`` whose
        expert lives on ``dst_rank`` (a warp-uniform loop): the body gets ``(k', that
        expert's local index)``."""
        K, L = self.cfg.layout.top_k, self.cfg.layout.n_local_experts
        with r.for_range(name, k, K, 1) as kk:
            g = r.load(_word(self.p.topk_ids, t * K + kk), T.u32, cache=CacheHint.NC,
                       name=f"g_{name}")
            with r.if_((g // L).eq(dst_rank)):
                yield kk, r.let(f"e_{name}", g % L)

    # ---- wait side ----------------------------------------------------------------------------
    def message_token(self, r: ir.RoleBuilder, e, src_rank, j) -> ir.Var:
        """Index word ``(e, src_rank, j)`` (``ld.global``; ordered by the ready flag's
        acquire, as the messages are): the source token ``t`` of slot ``j`` of block ``(e,
        src_rank)``."""
        lay = self.cfg.layout
        w = lay.dedup_index_word(e, src_rank, j).cast(T.u64)
        return r.load(self.p.recv_buf_p + (w * 4 + lay.dedup_index_offset), T.u32,
                      name="msg_token")

    def message_address(self, r: ir.RoleBuilder, e, src_rank, j, token=None) -> ir.Expr:
        """The message of slot ``j`` of block ``(e, src_rank)``: row ``dedup_msg_row(src,
        t)`` of the message area, ``t`` the slot's index word (``message_token``, or
        ``token`` when the caller read it)."""
        lay = self.cfg.layout
        t = self.message_token(r, e, src_rank, j) if token is None else token
        return self.p.recv_buf_p + lay.dedup_msg_row(src_rank, t).cast(T.u64) \
            * lay.dedup_row_bytes

    def start_copies(self, r: ir.RoleBuilder, expand: bool) -> None:
        """With ``expand``: the whole role copies the aux block's row starts
        (``row_offsets[e]``, ``L`` words) and per-source prefixes (``E = L * R`` words of the
        counter buffer from ``rank_prefix_offset``) into its scratch (``ld.global`` then
        ``st.shared.u32``, thread-strided), then the role's barrier: ``output_rows`` reads
        every local expert's rows from there, with no global round trip per message."""
        if not expand:
            return
        cfg, p, lay = self.cfg, self.p, self.cfg.layout
        L, E = lay.n_local_experts, cfg.n_experts
        se = int(bool(cfg.fused_shared_expert))
        self._starts = r.scratch("fan_starts", 4 * L)
        self._prefixes = r.scratch("fan_prefixes", 4 * E)
        with r.for_range("fan_pi", r.tid, E, r.n_threads) as i:
            r.store(_word(self._prefixes, i),
                    r.load(_word(p.atomic_counter, lay.rank_prefix_offset + i), T.u32,
                           name="fan_pfx_ld"))
        with r.for_range("fan_si", r.tid, L, r.n_threads) as i:
            r.store(_word(self._starts, i),
                    r.load(_word(p.row_offsets, i + se if se else i), T.u32,
                           name="fan_start_ld"))
        comm_sync(r)

    def output_rows(self, r: ir.RoleBuilder, e, src_rank, token, row, gid, expand: bool):
        """The message-major receive: the message of source ``src_rank``'s token ``token``
        is read once, by the warp of the slot that *copies* it, and stored into the grouped
        rows of all of the token's slots here. Each lane ``k < K`` whose top-k id ``gid``
        is a local expert ``e'`` loads slot-table word ``(src, t, k)``, the row ``j'`` that
        slot took in block ``(e', src)`` (the other lanes' words are not this call's: a
        source stages its remote slots' words in its own table); a slot *fits* when ``j' < block_capacity`` (the host
        refuses routings past it; a slot past it has no row). The copying slot is the lowest
        ``k`` that fits (``vote.sync.ballot``; no lower fitting lane than this slot's own,
        the lane whose id is this expert). Each fitting lane's row is ``start(e') +
        prefix(e', src - 1) + j'`` from the role's scratch (``start_copies``), as the tile's
        own rows, and the rows travel to every lane by ``shfl.sync.idx``. Returns
        ``(RowFan, copies)``: row ``k`` written when slot ``k`` fits, the copy made only
        when ``copies``. ``expand`` False (the L1 release publishes each tile's rows as they
        land): ``(row, None)``, every slot copies its own row."""
        if not expand:
            return row, None
        if self._starts is None:
            raise RuntimeError("RankDedupDestination.output_rows needs start_copies first")
        cfg, p, lay = self.cfg, self.p, self.cfg.layout
        K, L, R = lay.top_k, lay.n_local_experts, cfg.n_ranks
        g0 = r.let("fan_g0", p.my_rank * L)
        g32 = r.let("fan_gid", gid.cast(T.u32))
        local = r.let("fan_local", (r.lane < K) & (g32 >= g0) & (g32 < g0 + L))
        j_k = r.var("fan_j", T.u32, lay.block_capacity)
        with r.if_(local):      # only a local slot's word is written for this call
            w = lay.dedup_slot_word(src_rank, token, r.lane).cast(T.u64)
            r.assign(j_k, r.load(p.recv_buf_p + (w * 4 + lay.dedup_slot_offset), T.u32,
                                 name="fan_j_ld"))
        own = r.ballot(local & g32.eq(g0 + e), name="fan_own")
        fits = r.let("fan_fits", local & (j_k < lay.block_capacity))
        mask = r.ballot(fits, name="fan_mask")
        copies = r.let("fan_copies", own.ne(0) & (mask & (own - 1)).eq(0))
        row_k = r.var("fan_row", T.u32, 0)
        with r.if_(copies & fits):
            e2 = r.let("fan_e", g32 - g0)
            base = r.var("fan_base", T.u32, 0)
            with r.if_(src_rank > 0):
                r.assign(base, r.load(_word(self._prefixes, e2 * R + src_rank - 1), T.u32,
                                      name="fan_base_ld"))
            r.assign(row_k, r.load(_word(self._starts, e2), T.u32, name="fan_start")
                     + base + j_k)
        rows = tuple(r.shfl(ShflMode.IDX, row_k, k, name=f"fan_row{k}") for k in range(K))
        live = tuple(((mask >> k) & 1).ne(0) for k in range(K))
        return fanout.RowFan(rows, live), copies

    @classmethod
    def copy_scratch_bytes(cls, cfg, n_threads: int) -> int:
        """The staged copy's scratch, then ``start_copies``' row starts and prefixes (``L``
        and ``E`` u32 words, each rounded up to 16 bytes)."""
        lay = cfg.layout
        return super().copy_scratch_bytes(cfg, n_threads) \
            + -(-4 * lay.n_local_experts // 16) * 16 + -(-4 * cfg.n_experts // 16) * 16

    def record_row(self, r: ir.RoleBuilder, src_rank, src_token, k, row) -> None:
        """``row_map[dedup_msg_row(src_rank, src_token) * K + k] := row`` (``st.global``;
        read by the next kernel, the combine)."""
        m = self.cfg.layout.dedup_msg_row(src_rank, src_token)
        r.store(_word(self.side, m * self.cfg.layout.top_k + k), ir.as_expr(row))


__all__ = ["RankDedupDestination"]
