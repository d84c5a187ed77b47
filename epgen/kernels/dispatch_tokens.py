"""``ep_dispatch_wait_tokens``: the token-major receive of the deduplicated dispatch
(``ep_rank_dedup``, docs/flags.md), DeepEP's normal-mode layout (docs/deepep.md, "Normal
mode"). The send side is ``ep_dispatch_async`` of the same configuration, unchanged; this
kernel takes the place of ``ep_dispatch_wait``.

Where ``ep_dispatch_wait`` expands each received message into one grouped row per local
expert, this kernel gives each received *token* one row: the tokens that have at least one
expert on this rank, source-major (source rank 0's first), in source token order inside a
source. Per row it writes the payload (``out_x``), the token's top-k ids as this rank's
local expert ids (``out_topk``, int64, ``-1`` where the slot's expert lives elsewhere or the
slot is masked), the token's top-k weights from the message row (``out_weights``, float32,
``0.0`` where the local id is ``-1``: DeepEP's ``recv_topk_weights``) and ``(source rank,
source token)`` (``out_src``); and per call the
``meta`` words (``TokensLayout``): the row count, the inclusive per-source row prefix (DeepEP's
``rank_prefix_matrix`` column of this rank) and the per-local-expert counts.

The last block (aux) waits for every count word ``(e, src)`` (they order the index words and
messages before them), marks each source's received tokens in a bitmap from the index table
(a token with several local experts appears several times: ``red.or``), scans the bitmap's
popcounts into each bitmap word's first row, writes ``meta`` and raises the ready flag. The
other blocks (copy) take bitmap words, one warp each, and copy every marked token's message
to its row; then they write ``-1`` top-k ids, ``0.0`` weights and ``(-1, -1)`` sources
into the padding rows ``[n_rows, pad_rows)`` (DeepEP's ``num_worst_tokens``). Everything is re-armed by the kernel: the count words to the
sentinel (aux, as ``ep_dispatch_wait``'s aux does), each bitmap word to 0 (the warp that
copied it), the ready flag to 0 (the last copy block), so consecutive calls need no host
reset. The message rows are read with the stride ``message_row_bytes``.
"""

from __future__ import annotations

import attrs

import ir
from ir import AtomOp, CmpOp, Scope, Sem
from ir import types as T

from .common import (DATA_READY_FLAG, SENTINEL, block_inclusive_scan, comm_sync,
                     copy_vectors, exit_if_aborted, lowest_set_bit, signal_scope)
from .common import word as _word

KERNEL_NAME = "ep_dispatch_wait_tokens"
#: the scratch words before the prefix table: the ready flag, the cleanup countdown
READY_WORD, CLEANUP_WORD, SCRATCH_HEADER_WORDS = 0, 1, 32


def message_row_bytes(lay) -> int:
    """The byte stride of the message area's rows: the message and the token's top-k weights
    after it (``layout.dedup_row_bytes``)."""
    return lay.dedup_row_bytes


@attrs.frozen
class TokensLayout:
    """The buffers of the token-major receive for ``cfg`` (sizes in elements):

    - ``rows``: ``n_ranks * max_tokens_per_rank`` output rows (every source's every token);
    - ``words_per_source``: bitmap words of one source, ``ceil(max_tokens_per_rank / 32)``;
    - ``scratch_words``: u32 words of the scratch buffer (zeroed once at allocation; each
      call leaves every word but the prefix table, which it overwrites, at 0): the ready flag (word ``READY_WORD``), the cleanup countdown
      (``CLEANUP_WORD``), then from ``prefix_offset`` each bitmap word's first row, then from
      ``bitmap_offset`` the bitmap (word ``src * words_per_source + t // 32``, bit ``t % 32``:
      source ``src``'s token ``t`` is received);
    - ``meta_words``: int32 words of ``meta``: the row count (``N_ROWS``), from
      ``rank_prefix_offset`` the inclusive row prefix per source rank, from
      ``expert_count_offset`` the received ``(token, slot)`` pairs per local expert."""

    cfg: object = attrs.field(repr=False)

    N_ROWS = 0

    @property
    def rows(self) -> int:
        return self.cfg.n_ranks * self.cfg.max_tokens_per_rank

    @property
    def words_per_source(self) -> int:
        return -(-self.cfg.max_tokens_per_rank // 32)

    @property
    def bitmap_words(self) -> int:
        return self.cfg.n_ranks * self.words_per_source

    @property
    def prefix_offset(self) -> int:
        return SCRATCH_HEADER_WORDS

    @property
    def bitmap_offset(self) -> int:
        return self.prefix_offset + -(-self.bitmap_words // 32) * 32

    @property
    def scratch_words(self) -> int:
        return self.bitmap_offset + self.bitmap_words

    @property
    def rank_prefix_offset(self) -> int:
        return 1

    @property
    def expert_count_offset(self) -> int:
        return 1 + self.cfg.n_ranks

    @property
    def meta_words(self) -> int:
        return self.expert_count_offset + self.cfg.layout.n_local_experts


def check_supported(cfg) -> None:
    """``ValueError`` naming the parameter for a configuration the token-major receive does
    not take: it needs ``ep_rank_dedup`` (the message area it reads) and BF16 tokens (the
    payload is the output row; DeepEP's normal mode takes BF16, or pre-quantised FP8, for
    which epgen has no pass-through format); not yet ``ep_ord_r`` (it waits for the count
    words), ``ep_rank_mask``, the SHMEM transport (``use_shmem`` with ``p2p_world_size <
    n_ranks``), nor ``fused_shared_expert``; and ``num_threads >= n_experts`` (a thread per
    count word)."""
    why = []
    if not cfg.ep_rank_dedup:
        why.append("ep_rank_dedup=False (the token-major receive reads the deduplicated "
                   "message area)")
    if cfg.token_fmt.name != "BF16":
        why.append(f"token_fmt={cfg.token_fmt.name} (the token-major receive copies BF16 "
                   f"payloads; a pre-quantised FP8 payload has no pass-through format)")
    for flag, text in (("ep_ord_r", "its rank flags replace the count words this kernel "
                                    "waits for"),
                       ("ep_rank_mask", "the wait does not consult the rank mask yet"),
                       ("needs_shmem", "use_shmem with p2p_world_size < n_ranks: the arrival "
                                       "words are not waited for yet"),
                       ("fused_shared_expert", "the shared expert's rows have no place in "
                                               "the token-major layout")):
        if getattr(cfg, flag):
            why.append(f"{flag}=True ({text})")
    if cfg.num_threads < cfg.n_experts:
        why.append(f"num_threads={cfg.num_threads} < n_experts={cfg.n_experts} (one aux "
                   f"thread per count word)")
    if cfg.n_sms < 2:
        why.append(f"n_sms={cfg.n_sms} (an aux block and at least one copy block)")
    if why:
        raise ValueError("ep_dispatch_wait_tokens: not supported for this configuration: "
                         + "; ".join(why))


@attrs.frozen
class TokensParams:
    """Kernel parameters of ``ep_dispatch_wait_tokens``."""

    recv_buf_p: ir.Param
    recv_count_p: ir.Param
    scratch: ir.Param
    out_x: ir.Param
    out_topk: ir.Param
    out_weights: ir.Param
    out_src: ir.Param
    meta: ir.Param
    pad_rows: ir.Param
    my_rank: ir.Param
    err_buf: ir.Param


def declare_params(kb: ir.KernelBuilder, cfg) -> TokensParams:
    """The kernel's parameters on ``kb`` and its diagnostics (``err_buf``, ``timeout_ns``,
    ``my_rank``)."""
    peer = cfg.layout.crosses_devices
    p = TokensParams(
        recv_buf_p=kb.param("recv_buf_p", T.ptr_global, peer=peer),
        recv_count_p=kb.param("recv_count_p", T.ptr_global, peer=peer),
        scratch=kb.param("scratch", T.ptr_global),
        out_x=kb.param("out_x", T.ptr_global),
        out_topk=kb.param("out_topk", T.ptr_global),
        out_weights=kb.param("out_weights", T.ptr_global),
        out_src=kb.param("out_src", T.ptr_global),
        meta=kb.param("meta", T.ptr_global),
        pad_rows=kb.param("pad_rows", T.u32),
        my_rank=kb.param("my_rank", T.u32),
        err_buf=kb.param("err_buf", T.ptr_global),
    )
    kb.diagnostics(err_buf=p.err_buf, rank=p.my_rank)
    return p


def wait_and_number_tokens(r: ir.RoleBuilder, cfg, p: TokensParams) -> None:
    """Aux block. Thread ``w < E`` waits (bounded, ``ld.acquire.sys``) until count word ``w =
    e * R + src`` is published and keeps it in shared memory; the role's barrier, then every
    thread leaves if a wait expired. For each block ``(e, src)`` in turn the threads read its
    index words ``j < count`` (``ld.global``) and set bit ``t`` of source ``src``'s bitmap
    (``red.relaxed.gpu.or``), skipping a token index past ``max_tokens_per_rank``. After a
    barrier the bitmap words' popcounts (``popc``) are scanned block-wide, a chunk of
    ``num_threads`` words at a time (``block_inclusive_scan``), into each word's first row;
    ``meta`` gets the row count, the inclusive row prefix per source and the count per local
    expert (the sum of its count words). Thread 0 stores the cleanup countdown (the copy
    blocks) and raises the ready flag (``st.release.gpu``); then each count word is re-armed
    to the sentinel (``st.global.u64``)."""
    lay, tl = cfg.layout, TokensLayout(cfg)
    E, L, R, W = cfg.n_experts, lay.n_local_experts, cfg.n_ranks, tl.words_per_source
    tid, n = r.tid, r.n_threads
    counts = r.scratch("tokens_counts", 4 * E)
    totals = r.scratch("tokens_warp_totals", 4 * 32)
    carry_s = r.scratch("tokens_carry", 16)
    prefix = _word(p.scratch, tl.prefix_offset)
    bitmap = _word(p.scratch, tl.bitmap_offset)
    with r.if_(tid < E):
        seen = r.spin_wait(_word(p.recv_count_p, tid, 8), T.u64, CmpOp.NE, SENTINEL,
                           buffer="recv_count", index=tid, sem=Sem.ACQUIRE,
                           scope=signal_scope(cfg))
        r.store(_word(counts, tid), seen.cast(T.u32))
    comm_sync(r)
    exit_if_aborted(r, p.err_buf)
    with r.for_range("blk", 0, E) as b:
        cb = r.load(_word(counts, b), T.u32, name="blk_count")
        e, src = r.let("blk_e", b // R), r.let("blk_src", b % R)
        with r.for_range("ent", tid, cb, n) as j:
            w = lay.dedup_index_word(e, src, j).cast(T.u64)
            t = r.load(p.recv_buf_p + (w * 4 + lay.dedup_index_offset), T.u32, name="ent_t")
            with r.if_(t < cfg.max_tokens_per_rank):
                r.red(AtomOp.OR, _word(bitmap, src * W + t // 32),
                      ir.Const(1, T.u32) << (t % 32), Sem.RELAXED, Scope.GPU)
    comm_sync(r)
    carry = r.var("carry", T.u32, 0)
    with r.for_range("wbase", 0, tl.bitmap_words, n) as base:
        i = r.let("wi", base + tid)
        v = r.var("wpop", T.u32, 0)
        with r.if_(i < tl.bitmap_words):
            bits = r.load(_word(bitmap, i), T.u32, name="wbits")
            r.assign(v, ir.UnOp(ir.UnOpKind.POPC, bits))
        incl = block_inclusive_scan(r, v, totals, n // 32, "wincl")
        with r.if_(i < tl.bitmap_words):
            r.store(_word(prefix, i), carry + incl - v)
        with r.if_(tid.eq(n - 1)):
            r.store(carry_s, carry + incl)
        comm_sync(r)
        r.assign(carry, r.load(carry_s, T.u32, name="carry_ld"))
    with r.if_(tid.eq(0)):
        r.store(_word(p.meta, tl.N_ROWS), carry)
    with r.if_(tid < R):
        end = r.var("src_end", T.u32, carry)
        with r.if_(tid + 1 < R):
            r.assign(end, r.load(_word(prefix, (tid + 1) * W), T.u32, name="next_first"))
        r.store(_word(p.meta, tl.rank_prefix_offset + tid), end)
    with r.if_(tid < L):
        total = r.var("e_total", T.u32, 0)
        with r.for_range("e_src", 0, R) as s:
            r.assign(total, total + r.load(_word(counts, tid * R + s), T.u32, name="e_cnt"))
        r.store(_word(p.meta, tl.expert_count_offset + tid), total)
    comm_sync(r)
    with r.if_(tid.eq(0)):
        r.store(_word(p.scratch, CLEANUP_WORD), r.n_blocks - 1)
        r.store(_word(p.scratch, READY_WORD), DATA_READY_FLAG, Sem.RELEASE, Scope.GPU)
    with r.if_(tid < E):
        r.store(_word(p.recv_count_p, tid, 8), ir.Const(SENTINEL, T.u64))


def local_expert_id(r: ir.RoleBuilder, cfg, p: TokensParams, gid16) -> ir.Var:
    """The int64 local expert id of a message's u16 top-k id ``gid16``: ``g - my_rank * L``
    when expert ``g`` lives on this rank, else ``-1`` (a masked slot's ``0xffff`` included)."""
    L = cfg.layout.n_local_experts
    g = r.let("g32", gid16.cast(T.u32))
    local = r.var("local_id", T.s64, ir.Const(-1, T.s64))
    with r.if_((g < cfg.n_experts) & (g // L).eq(p.my_rank)):
        r.assign(local, (g - p.my_rank * L).cast(T.s64))
    return local


def copy_tokens(r: ir.RoleBuilder, cfg, p: TokensParams) -> None:
    """Copy blocks. Thread 0 waits (bounded, ``ld.acquire.gpu``, 32 ns back-off) for the ready
    flag, the role's barrier, every thread leaves if a wait expired. Warp ``w`` of the copy
    blocks takes bitmap words ``w, w + n_copy_warps, ...``: for each set bit ``t`` (lowest
    first: ``popc``) of source ``src``'s word, the warp copies message row
    ``dedup_msg_row(src, t)``'s payload to row ``first + i`` of ``out_x``
    (``copy_vectors``: 16-byte ``ld.global.v4`` / ``st.global.v4``), lanes ``k < K`` load
    the header's top-k id ``k`` (``ld.global.u16``) and the row's weight ``k``
    (``dedup_weights_offset``, ``ld.global.f32``) and store the local id
    (``local_expert_id``, ``st.global.s64``) and the weight, ``0.0`` where the local id is
    ``-1`` (``st.global.f32``), lane 0 stores ``(src, t)``; then
    ``bar.warp.sync`` (every lane has read the word) and lane 0 clears the bitmap word.
    Then the padding rows ``[n_rows, pad_rows)`` get ``-1`` ids, ``0.0`` weights and ``(-1,
    -1)`` sources,
    the role's barrier, and thread 0 counts the block done (``atom.relaxed.gpu.add`` of -1 on the
    cleanup countdown); the last one lowers the ready flag."""
    lay, fmt, tl = cfg.layout, cfg.token_fmt, TokensLayout(cfg)
    K, W = fmt.top_k, tl.words_per_source
    row_bytes = message_row_bytes(lay)
    n_warps = r.n_threads // 32
    prefix = _word(p.scratch, tl.prefix_offset)
    bitmap = _word(p.scratch, tl.bitmap_offset)
    with r.if_(r.tid.eq(0)):
        r.spin_wait(_word(p.scratch, READY_WORD), T.u32, CmpOp.EQ, DATA_READY_FLAG,
                    buffer="tokens_ready", index=READY_WORD, sem=Sem.ACQUIRE,
                    scope=Scope.GPU, backoff_ns=32)
    comm_sync(r)
    exit_if_aborted(r, p.err_buf)
    n_copy = r.let("n_copy", r.n_blocks - 1)
    first_warp = r.let("first_warp", r.block * n_warps + r.warp)
    with r.for_range("bw", first_warp, tl.bitmap_words, n_copy * n_warps) as w:
        bits = r.var("bits", T.u32, r.load(_word(bitmap, w), T.u32, name="bits_ld"))
        row = r.var("row", T.u32, r.load(_word(prefix, w), T.u32, name="first_row"))
        src = r.let("src", w // W)
        with r.while_(bits.ne(0)):
            t = r.let("tok", (w % W) * 32 + lowest_set_bit(r, bits, "bit"))
            msg = r.let("msg", p.recv_buf_p + lay.dedup_msg_row(src, t).cast(T.u64) * row_bytes,
                        peer=lay.crosses_devices)
            copy_vectors(r, p.out_x + row.cast(T.u64) * fmt.out_row_bytes, msg,
                         fmt.out_row_bytes // 16, r.lane, 32, tag="tok")
            with r.if_(r.lane < K):
                gid = r.load(msg + fmt.topk_info_offset + (r.lane * 2).cast(T.u64), T.u16,
                             name="gid16")
                local = local_expert_id(r, cfg, p, gid)
                r.store(_word(p.out_topk, row * K + r.lane, 8), local)
                wt = r.load(msg + lay.dedup_weights_offset + (r.lane * 4).cast(T.u64), T.f32,
                            name="wt_ld")
                r.store(_word(p.out_weights, row * K + r.lane),
                        ir.Select(local.eq(ir.Const(-1, T.s64)), ir.Const(0.0, T.f32), wt))
            with r.if_(r.lane.eq(0)):
                r.store(_word(p.out_src, row * 2), src)
                r.store(_word(p.out_src, row * 2 + 1), t)
            r.assign(row, row + 1)
            r.assign(bits, bits & (bits - 1))
        r.warp_sync()       # every lane has loaded the word before lane 0 clears it
        with r.if_(r.lane.eq(0)):
            r.store(_word(bitmap, w), 0)
    n_rows = r.let("n_rows", r.load(_word(p.meta, tl.N_ROWS), T.u32, name="n_rows_ld"))
    with r.for_range("pad", n_rows * K + r.block * r.n_threads + r.tid, p.pad_rows * K,
                     n_copy * r.n_threads) as q:
        r.store(_word(p.out_topk, q, 8), ir.Const(-1, T.s64))
        r.store(_word(p.out_weights, q), ir.Const(0.0, T.f32))
        with r.if_((q % K).eq(0)):
            r.store(_word(p.out_src, (q // K) * 2), ir.Const(-1, T.s32))
            r.store(_word(p.out_src, (q // K) * 2 + 1), ir.Const(-1, T.s32))
    comm_sync(r)
    with r.if_(r.tid.eq(0)):
        old = r.atomic(AtomOp.ADD, _word(p.scratch, CLEANUP_WORD), 0xFFFFFFFF, Sem.RELAXED,
                       Scope.GPU, name="cleanup_old")
        with r.if_(old.eq(1)):
            r.store(_word(p.scratch, READY_WORD), 0)


def build_dispatch_wait_tokens(cfg) -> ir.Kernel:
    """The ``ep_dispatch_wait_tokens`` entry point: the last block is the aux block
    (``wait_and_number_tokens``), the others copy (``copy_tokens``). ``ValueError`` for a
    configuration it does not take (``check_supported``)."""
    check_supported(cfg)
    kb = ir.KernelBuilder(KERNEL_NAME, cfg.num_threads)
    p = declare_params(kb, cfg)
    last = ir.SRegRead(ir.SReg.NCTAID_X) - 1
    with kb.role("copy", blocks=(0, last)) as r:
        copy_tokens(r, cfg, p)
    with kb.role("aux", blocks=(last, None)) as r:
        wait_and_number_tokens(r, cfg, p)
    return kb.build()


def build_dispatch_tokens_module(cfg) -> ir.Module:
    """``ep_dispatch_wait_tokens`` in a module of its own (the dispatch module, and its
    goldens, unchanged)."""
    return ir.Module("ep_dispatch_tokens", (build_dispatch_wait_tokens(cfg),))


__all__ = ["KERNEL_NAME", "TokensLayout", "build_dispatch_tokens_module",
           "build_dispatch_wait_tokens", "check_supported", "message_row_bytes"]
