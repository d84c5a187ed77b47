"""Every derived member of the reference ``EPDispatchKernel`` (its comptime members and layout
methods), plus the sizes of the buffers and counter regions they index.

``cfg.layout`` is a ``Layout``. Each reference member keeps its name and formula (the reference's
documented members are the contract); the few members that are ours are marked "ours" and
documented where they are defined.

The layout methods (``recv_buf_layout``, ``recv_count_layout``, ``send_buf_layout``,
``rank_flag_offset``) are plain arithmetic on their coordinates, so they accept Python ints,
numpy integer arrays and IR expressions alike; coordinates that are concrete integers are
range-checked.

Words of the counter array are Int32 (``EPLocalSyncCounters``); words of the receive-count
buffer are UInt64.

``skip_a2a`` changes no formula: ``n_experts`` and ``n_ranks`` stay global (``L = E // R`` per
device), and ``recv_buf_layout`` / ``recv_count_layout`` force the rank coordinate to 0.
What a device actually uses is said by members of ours, the one place the kernels read the
flag's mapping from: ``n_sources`` (1: itself), ``n_monitored_experts`` (its ``L`` experts)
and ``monitored_expert``, ``rank_coord`` (the rank coordinate written: 0), ``peer_index`` (the
pointer-table entry: 0, its own) and ``crosses_devices`` (false: no peer memory, ``gpu``
scope).

``ep_final_layout`` / ``ep_prod_reserve`` (ours; docs/final-layout.md) add,
per rank: a header array row-parallel to the grouped output (``hdr_*``, peer-visible), the
reservation cursors ``[rc_cursor_base, +L)`` of the receive-count buffer (initialised 0), the
block-base hand-off words of ``final_layout_region`` in the counter array (rank-local), and,
with ``ep_prod_reserve``, a peer-visible prod buffer of ``2E`` UInt64 words (``prod_*``: the
early counts a destination receives, then the mailboxes a source receives).
"""

from __future__ import annotations

import numbers

import attrs
import numpy as np

WARP_SIZE = 32                 # reference ``_resolve_warp_size()`` on NVIDIA
MAX_GPUS_PER_NODE = 8          # sizes the rank-completion counters; bounds p2p_world_size
EP_COPY_SRC_WIDTH = 8          # elements per copy item of the role split
EP_DATA_READY_FLAG = 1024      # value of the dispatch_wait ready flag (Region E)
RECV_COUNT_SENTINEL = 2**64 - 1   # "not yet published" (``UInt64.MAX_FINITE``)
REGION_ALIGN_WORDS = 32        # ours: counter regions start on a 128-byte line


def ceildiv(a: int, b: int) -> int:
    return -(-a // b)


def _align(x: int, a: int) -> int:
    return ceildiv(x, a) * a


def _is_concrete(v) -> bool:
    return isinstance(v, (numbers.Integral, np.ndarray)) and not isinstance(v, bool)


def _check_coord(method: str, name: str, value, bound: int) -> None:
    """Range-check a concrete coordinate (int or integer array); IR expressions pass."""
    if not _is_concrete(value):
        return
    arr = np.asarray(value)
    if arr.size and (arr.min() < 0 or arr.max() >= bound):
        raise IndexError(f"{method}: {name}={value!r} outside [0, {bound})")


@attrs.frozen
class CounterRegion:
    """A named range of Int32 words in the counter array: ``[offset, offset + size)``."""

    name: str
    offset: int
    size: int
    doc: str = ""

    @property
    def end(self) -> int:
        return self.offset + self.size


@attrs.frozen
class EPRoleSplit:
    """Reference ``EPRoleSplit[block_size, n_items, flag]`` (the copy/publisher warp split).

    Warps ``[0, n_copy_warps)`` form the copy role (threads ``tid < n_copy_threads`` run the
    quantize loop, ``n_trips`` items each); the last ``n_publisher_warps`` warps publish. The
    split is used only when ``enabled``.
    """

    block_size: int
    n_items: int
    flag: bool

    n_publisher_warps = 4
    n_trips = 3

    @property
    def n_warps(self) -> int:
        return self.block_size // WARP_SIZE

    @property
    def n_copy_warps(self) -> int:
        return self.n_warps - self.n_publisher_warps

    @property
    def n_copy_threads(self) -> int:
        return WARP_SIZE * self.n_copy_warps

    @property
    def enabled(self) -> bool:
        return bool(self.flag and self.n_copy_warps >= 1
                    and self.n_items == self.n_trips * self.n_copy_threads)

    def is_publisher(self, warp):
        """True for a publisher-role warp (``warp >= n_copy_warps``)."""
        return warp >= self.n_copy_warps

    def publisher_idx(self, warp):
        """Index of publisher warp ``warp`` in ``[0, n_publisher_warps)``: its P2P fan-out
        takes top-k slots ``publisher_idx, publisher_idx + 4, ...``."""
        if _is_concrete(warp):
            _check_coord("publisher_idx", "warp", np.asarray(warp) - self.n_copy_warps,
                         self.n_publisher_warps)
        return warp - self.n_copy_warps

    def describe(self) -> dict:
        return {"enabled": self.enabled, "flag": self.flag, "block_size": self.block_size,
                "n_items": self.n_items, "n_publisher_warps": self.n_publisher_warps,
                "n_copy_warps": self.n_copy_warps, "n_copy_threads": self.n_copy_threads,
                "n_trips": self.n_trips}


@attrs.frozen
class Layout:
    """The derived members of ``EPDispatchKernel[...]`` for one ``EPConfig``."""

    cfg: object = attrs.field(repr=False)

    # ---- short names used in the formulas below ------------------------------------------
    @property
    def _E(self) -> int:
        return self.cfg.n_experts

    @property
    def _R(self) -> int:
        return self.cfg.n_ranks

    @property
    def _L(self) -> int:
        return self.n_local_experts

    # ---- reference comptime members (page order within each group) -----------------------
    @property
    def n_local_experts(self) -> int:
        """``n_experts // n_ranks``."""
        return self.cfg.n_experts // self.cfg.n_ranks

    @property
    def n_sources(self) -> int:
        """Ours: the source ranks a destination receives from, the extent of the rank
        coordinate actually written: ``n_ranks``, or 1 under ``skip_a2a``, where the device is
        its own only source and every receive layout forces the rank coordinate to 0 (the
        words and slots of coordinates ``1 .. n_ranks-1`` stay unused)."""
        return 1 if self.cfg.skip_a2a else self.cfg.n_ranks

    @property
    def n_monitored_experts(self) -> int:
        """Ours: the dispatch_async monitor warps that count and signal, ``expert_idx <
        n_monitored_experts``: every expert, ``n_experts``; under ``skip_a2a`` the device's
        own ``n_local_experts`` (warp ``e`` owns global expert ``e + L * my_rank``; no token
        leaves the device, so nobody waits for the other experts' counts)."""
        return self._L if self.cfg.skip_a2a else self.cfg.n_experts

    def monitored_expert(self, expert_idx, my_rank):
        """Ours: the global expert of dispatch_async monitor warp ``expert_idx`` (an int or
        IR expression): itself; under ``skip_a2a`` ``expert_idx + L * my_rank`` (the device
        ``my_rank``'s own experts)."""
        return expert_idx + self._L * my_rank if self.cfg.skip_a2a else expert_idx

    def rank_coord(self, rank):
        """Ours: the rank coordinate a receive layout (receive buffer, count words, rank
        flags) uses for source or destination ``rank`` (an int or IR expression): ``rank``;
        0 under ``skip_a2a``, where the device is its own only source."""
        return 0 if self.cfg.skip_a2a else rank

    def peer_index(self, rank):
        """Ours: the entry of a P2P pointer table (one per rank of the sender's P2P group)
        that reaches ``rank``: ``rank % p2p_world_size``; 0 under ``skip_a2a``, where a
        device's tables hold only its own buffers."""
        return 0 if self.cfg.skip_a2a else rank % self.cfg.p2p_world_size

    @property
    def crosses_devices(self) -> bool:
        """Ours: whether other devices write this one's receive buffers and count words (peer
        memory, ``sys``-scope signals): true, false under ``skip_a2a`` (``gpu`` scope)."""
        return not self.cfg.skip_a2a

    @property
    def n_warps(self) -> int:
        """``num_threads // WARP_SIZE``."""
        return self.cfg.num_threads // WARP_SIZE

    @property
    def hid_dim(self) -> int:
        """``token_fmt_type.hid_dim``."""
        return self.cfg.token_fmt.hid_dim

    @property
    def top_k(self) -> int:
        """``token_fmt_type.top_k``."""
        return self.cfg.token_fmt.top_k

    @property
    def msg_bytes(self) -> int:
        """``token_fmt_type.msg_size()``."""
        return self.cfg.token_fmt.msg_size()

    @property
    def NB_SEND(self) -> int:  # noqa: N802 (the reference's name)
        """``3``: named-barrier id of the per-token send join (``ep_send_join_named``)."""
        return 3

    @property
    def role_split(self) -> EPRoleSplit:
        """``EPRoleSplit[num_threads, hid_dim // 8, ep_copy_role_split]``."""
        return EPRoleSplit(self.cfg.num_threads, self.hid_dim // EP_COPY_SRC_WIDTH,
                           bool(self.cfg.ep_copy_role_split))

    @property
    def n_signal_sms(self) -> int:
        """``ceildiv(n_experts, num_threads // WARP_SIZE)``: dispatch_async aux blocks, one
        warp per expert."""
        return ceildiv(self.cfg.n_experts, self.cfg.num_threads // WARP_SIZE)

    @property
    def n_offset_sms(self) -> int:
        """``1``: the dispatch_wait aux block."""
        return 1

    @property
    def n_dispatch_async_comm_sms(self) -> int:
        """``n_sms - ceildiv(n_experts, num_threads // WARP_SIZE)``."""
        return self.cfg.n_sms - ceildiv(self.cfg.n_experts, self.cfg.num_threads // WARP_SIZE)

    @property
    def n_dispatch_wait_comm_sms(self) -> int:
        """``n_sms - 1``."""
        return self.cfg.n_sms - 1

    # dispatch_wait counter words (offsets relative to the dispatch_wait region)
    @property
    def rank_prefix_offset(self) -> int:
        """``2 * n_experts``: Region B, within-expert inclusive prefix over source ranks."""
        return 2 * self._E

    @property
    def work_counter_offset(self) -> int:
        """``3 * n_experts``: Region C, per-local-expert tile-claim counters."""
        return 3 * self._E

    @property
    def cleanup_counter_offset(self) -> int:
        """``4 * n_experts``: Region D, the comm blocks' cleanup countdown."""
        return 4 * self._E

    @property
    def ready_flag_offset(self) -> int:
        """``4 * n_experts + 1``: Region E, the ready flag (``1024`` = offsets published)."""
        return 4 * self._E + 1

    @property
    def send_buf_ready_offset(self) -> int:
        """``4 * n_experts + 2``: Region F (fused shared expert)."""
        return 4 * self._E + 2

    @property
    def shared_expert_started_offset(self) -> int:
        """``4 * n_experts + 3``: Region G (fused shared expert)."""
        return 4 * self._E + 3

    @property
    def sm_schedule_offset(self) -> int:
        """``6 * n_experts + 7``: first word of the ``n_sms``-entry SM schedule table."""
        return 6 * self._E + 7

    @property
    def l2_pool_cursor_slots(self) -> int:
        """``2 * n_local_experts + 2``.

        The ticket and the pool cursors are words the reference reserves for a fused
        consumer's own scheduling. Here they are placement only: no kernel reads, writes or
        re-arms them (they stay at the counters' initial 0), ``assert_l1_vslot_ticket_layout``
        checks that they overlap no word a kernel does use, and a consumer fused next to the
        dispatch that takes them owns their protocol and their re-arming.
        """
        return 2 * self._L + 2

    @property
    def l1_vslot_ticket_offset(self) -> int:
        """``3E + L`` if ``1 + l2_pool_cursor_slots <= E - L`` else ``4E + 4``.

        The first branch places the ticket and the pool cursors in the unused tail
        ``[3E + L, 4E)`` of Region C; when they do not fit there, the ticket goes right
        after Region G (``4E + 4``) and the cursors follow it.
        """
        if (1 + self.l2_pool_cursor_slots) <= (self._E - self._L):
            return 3 * self._E + self._L
        return 4 * self._E + 4

    @property
    def l2_pool_cursor_offset(self) -> int:
        """``l1_vslot_ticket_offset + 1``."""
        return self.l1_vslot_ticket_offset + 1

    # receive-count buffer (UInt64 words)
    @property
    def rank_flag_base(self) -> int:
        """``n_local_experts * n_ranks``: start of the ORD-R rank-flag tail."""
        return self._L * self._R

    @property
    def rc_cursor_base(self) -> int:
        """``rank_flag_base + n_ranks``: start of the per-local-expert reservation cursors."""
        return self.rank_flag_base + self._R

    @property
    def shmem_arrival_base(self) -> int:
        """``rc_cursor_base + L`` (ours): start of the SHMEM arrival words, ``[L, R]`` UInt64
        words after the reservation cursors, present only when some destination is reached
        through NVSHMEM (``cfg.needs_shmem``; ``shmem_arrival_words``). Word ``e * R + src``
        counts the messages of block ``(e, src)`` that a source outside this rank's P2P group
        has delivered: each one's put-with-signal adds 1 after its data (kernels/shmem_send.py);
        initialised 0, re-armed to 0 by dispatch_wait."""
        return self.rc_cursor_base + self._L

    @property
    def shmem_arrival_words(self) -> int:
        """``L * R`` under the SHMEM transport (``cfg.needs_shmem``), else 0."""
        return self._L * self._R if self.cfg.needs_shmem else 0

    # ---- reference methods ---------------------------------------------------------------
    def rank_flag_offset(self, src_rank):
        """Offset (UInt64 words into the destination's recv_count) of ``src_rank``'s
        rank-completion flag: ``rank_flag_base + src_rank``. Needs ``has_rank_flag`` (a
        compile-time error in the reference)."""
        if not self.cfg.has_rank_flag:
            raise ValueError("rank_flag_offset requires has_rank_flag=True (the ORD-R rank "
                             "flags are only meaningful with has_rank_flag and ep_ord_r)")
        _check_coord("rank_flag_offset", "src_rank", src_rank, self._R)
        return self.rank_flag_base + src_rank

    def recv_count_size(self) -> int:
        """Receive-count buffer words, both tails included: the ``[L, R]`` count grid, the
        ``R`` ORD-R rank flags and the ``L`` reservation cursors, ``L*R + R + L``.

        The page says the cursors "are always reserved" and puts them at ``rc_cursor_base =
        rank_flag_base + R``; for the cursors to lie inside the buffer the ``R`` flag words
        are therefore always reserved too, with or without ``has_rank_flag`` (the reference's
        index table's ``L*R (+R)`` is superseded by its member list). The buffer itself may
        hold more: ``recv_count_words``."""
        return self.rc_cursor_base + self._L

    @property
    def recv_count_words(self) -> int:
        """Words of the receive-count buffer as allocated (ours): ``recv_count_size()`` and,
        under the SHMEM transport, the ``L*R`` arrival words after it
        (``shmem_arrival_base``)."""
        return self.recv_count_size() + self.shmem_arrival_words

    @property
    def block_capacity(self) -> int:
        """Message slots per (local expert, source) block of the receive buffer (ours):
        ``max_tokens_per_rank`` as in the reference, or ``cfg.recv_block_capacity`` to bound
        the buffer's memory (routings that overflow a block are refused on the host). With
        ``ep_final_layout`` there is no staging buffer to bound, so ``recv_block_capacity``
        has no effect there: ``max_tokens_per_rank``."""
        if self.cfg.ep_final_layout:
            return self.cfg.max_tokens_per_rank
        return self.cfg.recv_block_capacity or self.cfg.max_tokens_per_rank

    def recv_buf_layout(self, e, r, slot, byte=0):
        """Byte offset of ``(e, r, slot, byte)`` in the row-major receive buffer
        ``[L, R, max_tokens_per_rank, msg_bytes]`` (the slot extent is ``block_capacity``):
        ``((e * R + r) * block_capacity + slot) * msg_bytes + byte``; ``r`` is forced to 0
        under ``skip_a2a`` (the expert stride stays ``R * block_capacity``)."""
        self._check_recv("recv_buf_layout", e, r)
        _check_coord("recv_buf_layout", "slot", slot, self.block_capacity)
        _check_coord("recv_buf_layout", "byte", byte, self.msg_bytes)
        r = self.rank_coord(r)
        return ((e * self._R + r) * self.block_capacity + slot) * self.msg_bytes + byte

    def recv_count_layout(self, e, r):
        """Word offset ``e * n_ranks + r`` in the row-major ``[L, R]`` count grid; ``r`` is
        forced to 0 under ``skip_a2a`` (word ``e * R``)."""
        self._check_recv("recv_count_layout", e, r)
        return e * self._R + self.rank_coord(r)

    def send_buf_layout(self, t, byte=0):
        """Byte offset of ``(t, byte)`` in the row-major send buffer
        ``[max_tokens_per_rank, send_buf_row_bytes]`` (``msg_bytes`` without
        ``ep_rank_dedup``)."""
        _check_coord("send_buf_layout", "t", t, self.cfg.max_tokens_per_rank)
        _check_coord("send_buf_layout", "byte", byte, self.send_buf_row_bytes)
        return t * self.send_buf_row_bytes + byte

    def _check_recv(self, method, e, r):
        _check_coord(method, "e", e, self._L)
        # Under skip_a2a the reference passes the real device id here (then forces it to 0),
        # so only a negative rank is an error there.
        if not self.cfg.skip_a2a:
            _check_coord(method, "r", r, self._R)
        elif _is_concrete(r) and np.asarray(r).size and np.asarray(r).min() < 0:
            raise IndexError(f"{method}: r={r!r} is negative")

    def dispatch_wait_words(self) -> list[CounterRegion]:
        """Every named word or range of the dispatch_wait counter region (offsets relative to
        the region), in address order. Region C's tail ``[3E + L, 4E)`` is unused by the
        tile claim and hosts the L1 ticket and the L2 pool cursors when they fit (words
        reserved for a fused consumer; no kernel here uses them: ``l2_pool_cursor_slots``)."""
        E, L = self._E, self._L
        words = [
            CounterRegion("region_A_pair_end_count", 0, 2 * E,
                          "per (e, src): [2w] = 1024 + end row, [2w+1] = count; combine_async"),
            CounterRegion("rank_prefix", self.rank_prefix_offset, E,
                          "Region B: within-expert inclusive prefix over source ranks"),
            CounterRegion("work_counter", self.work_counter_offset, L,
                          "Region C: per-local-expert tile-claim counter"),
            CounterRegion("cleanup_counter", self.cleanup_counter_offset, 1, "Region D"),
            CounterRegion("ready_flag", self.ready_flag_offset, 1, "Region E"),
            CounterRegion("send_buf_ready", self.send_buf_ready_offset, 1, "Region F"),
            CounterRegion("shared_expert_started", self.shared_expert_started_offset, 1,
                          "Region G"),
            CounterRegion("l1_vslot_ticket", self.l1_vslot_ticket_offset, 1,
                          "L1 virtual-slot ticket: reserved for a fused consumer, unused "
                          "here"),
            CounterRegion("l2_pool_cursor", self.l2_pool_cursor_offset,
                          self.l2_pool_cursor_slots, "L2 ready-pool cursors: reserved for a "
                          "fused consumer, unused here"),
            CounterRegion("sm_schedule", self.sm_schedule_offset, self.cfg.n_sms,
                          "first expert of each comm SM"),
        ]
        return sorted(words, key=lambda w: w.offset)

    def assert_l1_vslot_ticket_layout(self) -> None:
        """Reference ``assert_l1_vslot_ticket_layout``: static guarantees for the ticket and
        the pool-cursor words. Checks, raising ``AssertionError`` with the failing rule:

        1. ``l2_pool_cursor_offset == l1_vslot_ticket_offset + 1`` (cursors follow the ticket);
        2. the ticket and all ``l2_pool_cursor_slots`` cursors lie inside the dispatch_wait
           counter region;
        3. they overlap none of the other named words or ranges of that region: Region A
           ``[0, 2E)``, Region B ``[2E, 3E)``, the live part of Region C ``[3E, 3E + L)``,
           Regions D-G ``4E .. 4E+3`` and the SM schedule ``[6E + 7, 6E + 7 + n_sms)``;
        4. in the first branch of ``l1_vslot_ticket_offset`` they end at or before ``4E``
           (inside Region C's unused tail).
        """
        t, c, n = self.l1_vslot_ticket_offset, self.l2_pool_cursor_offset, \
            self.l2_pool_cursor_slots
        size = self.dispatch_wait_region.size
        if c != t + 1:
            raise AssertionError("l2_pool_cursor_offset must be l1_vslot_ticket_offset + 1")
        if not (0 <= t and c + n <= size):
            raise AssertionError(
                f"l1_vslot_ticket [{t}] and l2_pool_cursor [{c}, {c + n}) must lie inside the "
                f"dispatch_wait counter region [0, {size})")
        mine = {"l1_vslot_ticket", "l2_pool_cursor"}
        for w in self.dispatch_wait_words():
            if w.name in mine:
                continue
            if w.offset < c + n and t < w.end:
                raise AssertionError(
                    f"l1_vslot_ticket/l2_pool_cursor [{t}, {c + n}) overlap {w.name} "
                    f"[{w.offset}, {w.end})")
        if t == 3 * self._E + self._L and c + n > 4 * self._E:
            raise AssertionError("the ticket and the cursors must fit in Region C's unused "
                                 f"tail [3E + L, 4E) = [{t}, {4 * self._E})")

    def check(self) -> None:
        """Every static layout check (run by ``EPConfig`` at construction): the ticket and
        cursor guarantees, the named dispatch_wait words pairwise disjoint and inside their
        region, and the receive-count tails inside ``recv_count_size()``."""
        self.assert_l1_vslot_ticket_layout()
        words = self.dispatch_wait_words()
        for a, b in zip(words, words[1:]):
            if a.end > b.offset:
                raise AssertionError(f"dispatch_wait words {a.name} [{a.offset}, {a.end}) and "
                                     f"{b.name} [{b.offset}, {b.end}) overlap")
        if words[-1].end > self.dispatch_wait_region.size:
            raise AssertionError(f"{words[-1].name} ends past the dispatch_wait region")
        if self.rc_cursor_base + self._L != self.recv_count_size():
            raise AssertionError("the reservation cursors must end the reference part of the "
                                 "recv_count buffer")
        if self.shmem_arrival_base + self.shmem_arrival_words != self.recv_count_words:
            raise AssertionError("the SHMEM arrival words must end the recv_count buffer")
        regions = list(self.counter_regions().values())
        for a, b in zip(regions, regions[1:]):
            if a.end > b.offset:
                raise AssertionError(f"counter regions {a.name} and {b.name} overlap")

    # ---- counter array (ours: the reference regions, sized to cover every offset) ------------
    @property
    def dispatch_async_region(self) -> CounterRegion:
        """``2E + MAX_GPUS_PER_NODE`` words: reserved ``[0, E)``, finished ``[E, 2E)``,
        rank-completion ``[2E, 2E + 8)``."""
        return CounterRegion("dispatch_async", 0, 2 * self._E + MAX_GPUS_PER_NODE,
                             "reserved[E], finished[E], rank_completion[8]")

    @property
    def dispatch_wait_region(self) -> CounterRegion:
        """Regions A-G, the L1 ticket, the L2 cursors and the SM schedule table:
        ``6E + 8 + n_sms`` words (V-IDX's ``4E + 4`` does not reach ``sm_schedule_offset =
        6E + 7``). The ticket and the cursors end by ``4E + 2L + 7 <= 6E + 7`` in either
        branch of ``l1_vslot_ticket_offset``; ``check()`` asserts that every named word lies
        inside, rather than growing the region to fit a misplaced word. combine_async uses
        this same region (it reads Region A)."""
        size = max(4 * self._E + 4, 6 * self._E + 8 + self.cfg.n_sms)
        return CounterRegion("dispatch_wait", _align(self.dispatch_async_region.end,
                                                     REGION_ALIGN_WORDS), size,
                             "Regions A-G, L1 ticket, L2 cursors, SM schedule; == combine_async")

    @property
    def combine_async_region(self) -> CounterRegion:
        """The dispatch_wait region (combine_async reads Region A that dispatch_wait wrote)."""
        return self.dispatch_wait_region

    @property
    def combine_wait_region(self) -> CounterRegion:
        """``max(2E, n_sms)`` words: one data-ready flag per reduce block. The reference's
        ``2E`` overflows when ``grid > 2E``."""
        return CounterRegion("combine_wait", _align(self.dispatch_wait_region.end,
                                                    REGION_ALIGN_WORDS),
                             max(2 * self._E, self.cfg.n_sms), "per-reduce-block ready flags")

    @property
    def combine_rank_completion_region(self) -> CounterRegion:
        """Ours: the combine's own ``MAX_GPUS_PER_NODE`` rank-completion
        counters, zeroed, instead of aliasing dispatch_wait Region B."""
        return CounterRegion("combine_rank_completion",
                             _align(self.combine_wait_region.end, REGION_ALIGN_WORDS),
                             MAX_GPUS_PER_NODE, "combine_async rank-completion counters")

    @property
    def final_layout_region(self) -> CounterRegion:
        """Ours (``ep_final_layout``, docs/final-layout.md), always reserved: ``E`` Int32 words,
        the block bases the dispatch_async monitor warps hand to their comm warps in the
        capacity-strided layout. Word ``e * R + dst_rank`` (indexed like the dispatch_async
        counters) holds ``first_row | FINAL_BASE_VALID`` (bit 31) while expert ``e`` of
        ``dst_rank`` has a reserved block in this call; released and acquired at gpu scope
        (the word never leaves this rank), re-armed to 0 by the monitor once the block is
        written. See ``epgen/kernels/final_layout.py`` and docs/final-layout.md."""
        return CounterRegion("final_layout",
                             _align(self.combine_rank_completion_region.end, REGION_ALIGN_WORDS),
                             self._E, "final-layout block-base hand-off (monitor -> comm warps)")

    @property
    def final_base_offset(self) -> int:
        """Ours: offset of the base hand-off words inside ``final_layout_region``."""
        return 0

    # ---- ep_final_layout / ep_prod_reserve buffers (ours, docs/final-layout.md) ------
    @property
    def hdr_bytes(self) -> int:
        """Ours: bytes of one row of the final-layout header array: the message's header
        fields as they are staged (``msg_size() - token_size``): int32 source token index at
        0, int32 source rank at ``hdr_src_rank_offset`` (the padding of the source-index
        field), uint16 top-k ids from ``hdr_topk_offset``; then, for a format with transposed
        output scales, the row's scales (``hdr_scale_bytes`` at ``hdr_scales_offset``). A
        multiple of 16."""
        return self.hdr_scales_offset + self.hdr_scale_bytes

    @property
    def hdr_scales_offset(self) -> int:
        """Ours: byte offset of the row's scales in a header row (after the header fields)."""
        fmt = self.cfg.token_fmt
        return fmt.msg_size() - fmt.src_info_offset

    @property
    def hdr_scale_bytes(self) -> int:
        """Ours: bytes of a header row that hold the row's scales, row-major as in the message
        (rounded up to 16), for a format whose output scales are transposed (BlockwiseFP8,
        ``[groups, M]``): a sender's K rows' scales land 4 bytes each in ``groups`` places
        ``4 M`` bytes apart, so the senders leave them here and dispatch_wait's header pass
        writes each tile's scales transposed, 32 adjacent rows per warp store
        (``header_pass.copy_headers``). 0 for other formats."""
        fmt = self.cfg.token_fmt
        if not getattr(fmt, "scales_transposed", False):
            return 0
        return _align(fmt.n_scale_groups * fmt.scale_bytes, 16)

    @property
    def hdr_src_rank_offset(self) -> int:
        """Ours: byte offset of the int32 source rank in a header row (and in a staged
        message's source-index field, ``src_info_offset + 4``)."""
        return 4

    @property
    def hdr_topk_offset(self) -> int:
        """Ours: byte offset of the uint16 top-k ids in a header row."""
        fmt = self.cfg.token_fmt
        return fmt.topk_info_offset - fmt.src_info_offset

    @property
    def hdr_buf_bytes(self) -> int:
        """Ours: bytes of one rank's header array (``max_out_rows`` rows of ``hdr_bytes``,
        row-parallel to the grouped output; peer-visible); 0 without ``ep_final_layout``."""
        return self.max_out_rows * self.hdr_bytes if self.cfg.ep_final_layout else 0

    @property
    def prod_early_count_offset(self) -> int:
        """Ours: UInt64 word offset of the early counts in the prod buffer. Destination side:
        word ``e * R + src`` is ``count | gen << 32``, the tokens source ``src`` routes to
        local expert ``e`` in generation ``gen`` (st.release.sys by the source's monitor)."""
        return 0

    @property
    def prod_mailbox_offset(self) -> int:
        """Ours: UInt64 word offset of the mailboxes in the prod buffer. Source side: word
        ``e * R + dst`` is ``base | gen << 32``, the first output row destination ``dst``
        reserved for this source's block of its local expert ``e`` (st.release.sys by
        ``dst``'s reserver); the source's comm warps poll it (``prod_gen_p``)."""
        return self._E

    @property
    def prod_gen_word_offset(self) -> int:
        """Ours: UInt64 word offset, in the prod buffer, of the rank's generation word (its
        low 32 bits: the last call's generation tag, 0 before the first call). dispatch_async
        reads it, dispatch_wait's aux block advances it (1, 2, ..., skipping 0 on a wrap)."""
        return 2 * self._E

    @property
    def prod_buf_words(self) -> int:
        """Ours: UInt64 words of one rank's prod buffer (``ep_prod_reserve``; peer-visible,
        zeroed once at allocation, never re-armed: the kernels advance the generation every
        call): ``E`` early counts, ``E`` mailboxes, then the generation word; 0 without
        ``ep_prod_reserve``."""
        return 2 * self._E + 1 if self.cfg.ep_prod_reserve else 0

    @property
    def prod_buf_bytes(self) -> int:
        return 8 * self.prod_buf_words

    def counter_regions(self) -> dict[str, CounterRegion]:
        """Every region of the counter array, in address order."""
        return {r.name: r for r in (self.dispatch_async_region, self.dispatch_wait_region,
                                    self.combine_wait_region,
                                    self.combine_rank_completion_region,
                                    self.final_layout_region)}

    @property
    def counter_words(self) -> int:
        """Int32 words of the whole counter array (zeroed once at allocation)."""
        return self.final_layout_region.end

    # ---- buffer and output sizes (ours) -------------------------------------------------
    @property
    def n_groups(self) -> int:
        """Groups of the grouped output: the local experts, plus the shared expert (group 0)
        with ``fused_shared_expert``."""
        return self._L + int(bool(self.cfg.fused_shared_expert))

    @property
    def max_recv_tokens(self) -> int:
        """Routed rows a destination can receive: every source sends each token at most
        ``min(top_k, L)`` times to it, and each (expert, source) block holds at most
        ``block_capacity`` (the reference sizes ``L * R * max_tokens_per_rank``, which is never
        smaller), from each of ``n_sources`` sources (one under ``skip_a2a``); plus
        ``max_tokens_per_rank`` shared-expert rows with ``fused_shared_expert``."""
        se = self.cfg.max_tokens_per_rank if self.cfg.fused_shared_expert else 0
        per_source = min(self.cfg.max_tokens_per_rank * min(self.top_k, self._L),
                         self._L * self.block_capacity)
        return self.n_sources * per_source + se

    @property
    def capacity_strided(self) -> bool:
        """True for ``ep_final_layout`` without ``ep_prod_reserve``: group ``j`` of the
        output starts at row ``j * R * max_tokens_per_rank`` (docs/final-layout.md)."""
        return bool(self.cfg.ep_final_layout and not self.cfg.ep_prod_reserve)

    @property
    def max_out_rows(self) -> int:
        """Rows to allocate for the grouped output (and ``src_info``): ``max_recv_tokens``
        plus ``expert_m_padding - 1`` per group (each group's count is rounded up); in the
        capacity-strided layout, ``n_groups * R * max_tokens_per_rank``."""
        if self.capacity_strided:
            return self.n_groups * self._R * self.cfg.max_tokens_per_rank
        pad = self.cfg.token_fmt.expert_m_padding - 1
        return self.max_recv_tokens + self.n_groups * pad

    @property
    def send_buf_row_bytes(self) -> int:
        """Ours: the stride of a send-buffer row: ``msg_bytes``, or ``dedup_row_bytes`` with
        ``ep_rank_dedup`` (the staged message, then the token's weights)."""
        return self.dedup_row_bytes if self.cfg.ep_rank_dedup else self.msg_bytes

    @property
    def send_buf_bytes(self) -> int:
        return self.cfg.max_tokens_per_rank * self.send_buf_row_bytes

    @property
    def recv_buf_bytes(self) -> int:
        """Bytes of the staging receive buffer; 0 with ``ep_final_layout``, where sources
        write the grouped output directly and nothing is staged. With ``ep_rank_dedup`` the
        message area, the index table and the slot table after it (``dedup_slot_offset`` +
        ``dedup_slot_bytes``)."""
        if self.cfg.ep_final_layout:
            return 0
        if self.cfg.ep_rank_dedup:
            return self.dedup_slot_offset + self.dedup_slot_bytes
        return self._L * self._R * self.block_capacity * self.msg_bytes

    # ---- ep_rank_dedup's receive buffer (ours, docs/flags.md) ---------------------------
    @property
    def dedup_msg_rows(self) -> int:
        """Ours (``ep_rank_dedup``): message rows of the receive buffer's message area, one
        per (source rank, source token): ``n_ranks * max_tokens_per_rank``; 0 without the
        flag. The message of source ``src``'s token ``t`` is row ``dedup_msg_row(src, t)``,
        written once by the source whatever number of the token's experts live here."""
        return self._R * self.cfg.max_tokens_per_rank if self.cfg.ep_rank_dedup else 0

    def dedup_msg_row(self, src, t):
        """Ours (``ep_rank_dedup``): the message-area row of source ``src``'s token ``t``:
        ``src * max_tokens_per_rank + t`` (an int or IR expression); no cursor, nothing to
        re-arm."""
        _check_coord("dedup_msg_row", "src", src, self._R)
        _check_coord("dedup_msg_row", "t", t, self.cfg.max_tokens_per_rank)
        return src * self.cfg.max_tokens_per_rank + t

    @property
    def dedup_weights_offset(self) -> int:
        """Ours (``ep_rank_dedup``): byte offset, inside a message-area row, of the token's
        ``K`` float32 router weights (weight ``k`` at ``+ 4 k``), right after the format's
        message: ``msg_bytes`` rounded up to 16. The partial-reduce combine reads them."""
        return _align(self.msg_bytes, 16)

    @property
    def dedup_row_bytes(self) -> int:
        """Ours (``ep_rank_dedup``): the stride of a message-area row (and of a send-buffer
        row under the flag): the message, then the weights, rounded up to 16
        (``dedup_weights_offset + 4 K``)."""
        return _align(self.dedup_weights_offset + 4 * self.top_k, 16)

    @property
    def dedup_row_map_words(self) -> int:
        """Ours (``ep_rank_dedup``): u32 words of a rank's row map, one per (message-area
        row, top-k slot): ``dedup_msg_rows * K``; 0 without the flag. dispatch_wait's copy
        pass stores word ``msg_row * K + k`` := the grouped-output row it filled for slot
        ``k`` of that message (receiver-local); the partial-reduce combine reads it."""
        return self.dedup_msg_rows * self.top_k

    @property
    def dedup_index_offset(self) -> int:
        """Ours (``ep_rank_dedup``): byte offset of the index table in the receive buffer,
        right after the message area (``dedup_msg_rows * dedup_row_bytes``, a multiple of
        16)."""
        return _align(self.dedup_msg_rows * self.dedup_row_bytes, 16)

    @property
    def dedup_index_words(self) -> int:
        """Ours (``ep_rank_dedup``): u32 words of the index table, one per (local expert,
        source, slot): ``L * R * block_capacity``; 0 without the flag. Word
        ``dedup_index_word(e, src, j)`` holds the source token index of slot ``j`` of block
        ``(e, src)``, whose message is then row ``dedup_msg_row(src, token)``."""
        return self._L * self._R * self.block_capacity if self.cfg.ep_rank_dedup else 0

    @property
    def dedup_index_bytes(self) -> int:
        """Ours (``ep_rank_dedup``): bytes of the index table, ``4 * dedup_index_words``
        rounded up to 16."""
        return _align(4 * self.dedup_index_words, 16)

    def dedup_index_word(self, e, src, j):
        """Ours (``ep_rank_dedup``): the index-table word of slot ``j`` of block ``(e,
        src)``: ``(e * n_ranks + src) * block_capacity + j`` (its byte offset in the receive
        buffer: ``dedup_index_offset + 4 *`` this)."""
        _check_coord("dedup_index_word", "e", e, self._L)
        _check_coord("dedup_index_word", "src", src, self._R)
        _check_coord("dedup_index_word", "j", j, self.block_capacity)
        return (e * self._R + src) * self.block_capacity + j

    @property
    def dedup_slot_offset(self) -> int:
        """Ours (``ep_rank_dedup``): byte offset of the slot table in the receive buffer,
        right after the index table (``dedup_index_offset + dedup_index_bytes``)."""
        return self.dedup_index_offset + self.dedup_index_bytes

    @property
    def dedup_slot_words(self) -> int:
        """Ours (``ep_rank_dedup``): u32 words of the slot table, one per (message-area row,
        top-k slot): ``dedup_msg_rows * K``; 0 without the flag. Word ``dedup_slot_word(src,
        t, k)`` holds the row ``j`` that slot ``k`` of source ``src``'s token ``t`` took in
        its block ``(e, src)``, so that the receive can expand the message into every row it
        selects while reading it once. Only the words of slots whose expert lives here are
        written (and read)."""
        return self.dedup_msg_rows * self.top_k

    @property
    def dedup_slot_bytes(self) -> int:
        """Ours (``ep_rank_dedup``): bytes of the slot table, ``4 * dedup_slot_words``
        rounded up to 16."""
        return _align(4 * self.dedup_slot_words, 16)

    def dedup_slot_word(self, src, t, k):
        """Ours (``ep_rank_dedup``): the slot-table word of top-k slot ``k`` of source
        ``src``'s token ``t``: ``dedup_msg_row(src, t) * K + k`` (its byte offset in the
        receive buffer: ``dedup_slot_offset + 4 *`` this)."""
        _check_coord("dedup_slot_word", "k", k, self.top_k)
        return self.dedup_msg_row(src, t) * self.top_k + k

    @property
    def recv_count_bytes(self) -> int:
        return 8 * self.recv_count_words

    @property
    def counter_bytes(self) -> int:
        return 4 * self.counter_words

    def recv_count_initial(self) -> np.ndarray:
        """The receive-count buffer's required state at allocation: the count grid and the
        rank flags at the sentinel, the reservation cursors (and the SHMEM arrival words) at
        0."""
        words = np.full(self.recv_count_words, RECV_COUNT_SENTINEL, dtype=np.uint64)
        words[self.rc_cursor_base:] = 0
        return words

    def sizes(self) -> dict:
        """Buffer and output sizes, for the runtime and ``epgen inspect``."""
        fmt = self.cfg.token_fmt
        return {
            "send_buf_bytes": self.send_buf_bytes, "recv_buf_bytes": self.recv_buf_bytes,
            "recv_count_words": self.recv_count_words, "recv_count_bytes": self.recv_count_bytes,
            "counter_words": self.counter_words, "counter_bytes": self.counter_bytes,
            "n_groups": self.n_groups, "max_recv_tokens": self.max_recv_tokens,
            "max_out_rows": self.max_out_rows,
            "out_tokens_shape": [self.max_out_rows, *fmt.out_row_shape],
            "row_offsets_len": self.n_groups + 1, "expert_ids_len": self.n_groups,
            "src_info_shape": [self.max_out_rows, 2],
            "hdr_buf_bytes": self.hdr_buf_bytes, "prod_buf_words": self.prod_buf_words,
        }

    def members(self) -> dict:
        """Every comptime member and sizing method of the reference page, in the page's
        order, with its value (``role_split`` as a dict)."""
        names = ["cleanup_counter_offset", "hid_dim", "l1_vslot_ticket_offset",
                 "l2_pool_cursor_offset", "l2_pool_cursor_slots", "msg_bytes",
                 "n_dispatch_async_comm_sms", "n_dispatch_wait_comm_sms", "n_local_experts",
                 "n_offset_sms", "n_signal_sms", "n_warps", "NB_SEND", "rank_flag_base",
                 "rank_prefix_offset", "rc_cursor_base", "ready_flag_offset", "role_split",
                 "send_buf_ready_offset", "shared_expert_started_offset", "sm_schedule_offset",
                 "top_k", "work_counter_offset"]
        out = {n: getattr(self, n) for n in names}
        out["role_split"] = self.role_split.describe()
        out["recv_count_size()"] = self.recv_count_size()
        out["rank_flag_offset(src)"] = (f"{self.rank_flag_base} + src"
                                        if self.cfg.has_rank_flag else None)
        out["recv_buf_layout"] = (f"[{self._L}, {self._R}, {self.cfg.max_tokens_per_rank}, "
                                  f"{self.msg_bytes}] row-major bytes"
                                  + (", rank coord 0" if self.cfg.skip_a2a else ""))
        out["recv_count_layout"] = (f"[{self._L}, {self._R}] row-major words"
                                    + (", rank coord 0" if self.cfg.skip_a2a else ""))
        out["send_buf_layout"] = (f"[{self.cfg.max_tokens_per_rank}, "
                                  f"{self.send_buf_row_bytes}] row-major bytes")
        return out
