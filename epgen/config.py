"""``EPConfig``: the parameters of the reference ``EPDispatchKernel[...]`` and their validation.

Every parameter of the reference page exists here under the same name with the same default
(the page's ``token_fmt_type`` is the ``token_fmt`` instance; ``token_fmt_type`` is an alias).
``timeout_ns`` is ours (every spin-wait is bounded, docs/design.md "The reliability contract";
0 = unbounded, as in the reference).

Construction validates every constraint (the reference's plus ours) and raises
``EPConfigError`` (a ``ValueError``) listing each violated rule with the parameters it names.

``skip_a2a`` keeps the reference page's parameters: ``n_ranks = R`` and ``n_experts = E`` as
without it, ``L = E // R`` experts per device, and the device with ``my_rank = d`` (a launch
argument) owns global experts ``[L * d, L * d + L)``; ``topk_ids`` stay global (any id below
65536: an id no device owns is dropped). Every derived member keeps its formula in ``E`` and
``R`` (``epgen.layout``); the rank coordinate of the receive layouts is forced to 0. The
reference host's own instantiation, ``n_ranks = 1`` and ``n_experts`` = one device's experts,
is the ``R = 1`` case of the same formulas (docs/flags.md, ``skip_a2a``).
"""

from __future__ import annotations

import functools
import numbers

import attrs
import numpy as np

from .formats.base import TokenFormat
from .layout import MAX_GPUS_PER_NODE, WARP_SIZE, Layout, ceildiv
from .tuning import Tuning, tuning_from_dict

#: Every element index the kernels compute in 32-bit arithmetic stays below this
#: (``EPConfig.index_extents``).
INDEX_LIMIT = 2**31
#: Most threads per block on NVIDIA, and the reference's ``WARP_SIZE**2`` bound on E.
MAX_THREADS = 1024
INT_PARAMS = ("num_threads", "n_sms", "n_experts", "n_ranks", "max_tokens_per_rank",
              "p2p_world_size")
BOOL_PARAMS = ("use_shmem", "fused_shared_expert", "skip_a2a", "has_rank_flag", "ep_ord_r",
               "ep_final_layout", "ep_prod_reserve", "ep_copy_role_split", "ep_send_join_named",
               "ep_rank_mask", "ep_rank_dedup")


class EPConfigError(ValueError):
    """An invalid ``EPConfig``. ``violations`` is a list of ``(parameters, rule)``."""

    def __init__(self, violations: list[tuple[tuple[str, ...], str]]):
        self.violations = list(violations)
        lines = [f"{', '.join(p)}: {rule}" for p, rule in self.violations]
        head = "invalid EPConfig" + (f" ({len(lines)} violations)" if len(lines) > 1 else "")
        super().__init__(head + ":\n  " + "\n  ".join(lines))


#: The flags the SHMEM send path does not take yet (``use_shmem`` with a destination outside
#: the P2P group), and why.
SHMEM_EXCLUSIVE = {
    "ep_final_layout": "the final layout writes peers' output rows and reserves on their "
                       "cursors with peer stores and atomics, which have no SHMEM path yet",
    "ep_prod_reserve": "the early counts and mailboxes are peer stores, which have no SHMEM "
                       "path yet",
    "fused_shared_expert": "the fused kernel's shared-expert send path has no SHMEM fan-out "
                           "yet",
    "ep_copy_role_split": "the publisher warps' fan-out has no SHMEM cross-group fan-out yet",
}


class EPFlagNoEffect(UserWarning):
    """A flag set on a configuration where the build does not use it, so the kernels are
    those built without it (``EPConfig.inert_flags`` says which and why);
    ``epgen.kernels.build_module`` warns with it, the CLI prints it to stderr."""


#: What the CLI and ``epgen inspect`` say of ``use_shmem=True`` without a remote destination.
SHMEM_ALL_P2P_NOTE = ("use_shmem=true but every destination is in the P2P group: no NVSHMEM "
                      "call")


def _to_int(v):
    return int(v) if isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) \
        else v


def _to_bool(v):
    return bool(v) if isinstance(v, np.bool_) else v


def _int_field(**kw):
    return attrs.field(converter=_to_int, **kw)


def _bool_field(default: bool):
    return attrs.field(default=default, converter=_to_bool)


@attrs.frozen(kw_only=True)
class EPConfig:
    """Parameters of ``EPDispatchKernel`` (keyword arguments; see the reference page)."""

    num_threads: int = _int_field()
    n_sms: int = _int_field()
    n_experts: int = _int_field()
    n_ranks: int = _int_field()
    max_tokens_per_rank: int = _int_field()
    p2p_world_size: int = _int_field()
    token_fmt: TokenFormat = attrs.field()
    use_shmem: bool = _bool_field(True)
    fused_shared_expert: bool = _bool_field(False)
    skip_a2a: bool = _bool_field(False)
    has_rank_flag: bool = _bool_field(False)
    ep_ord_r: bool = _bool_field(False)
    ep_final_layout: bool = _bool_field(False)
    ep_prod_reserve: bool = _bool_field(False)
    ep_copy_role_split: bool = _bool_field(False)
    ep_send_join_named: bool = _bool_field(False)
    #: ours, not a reference parameter: the device-side rank mask (docs/flags.md)
    ep_rank_mask: bool = _bool_field(False)
    #: ours, not a reference parameter: one message per (token, destination rank)
    #: (docs/flags.md)
    ep_rank_dedup: bool = _bool_field(False)
    timeout_ns: int = _int_field(default=2_000_000_000)
    recv_block_capacity: int | None = attrs.field(default=None)
    #: ours, not a reference parameter: the code-generation choices (``epgen.tuning``)
    tuning: Tuning = attrs.field(factory=Tuning, converter=tuning_from_dict)

    def __attrs_post_init__(self):
        bad = self._type_violations()
        if bad:
            raise EPConfigError(bad)
        bad = self._rule_violations()
        if bad:
            raise EPConfigError(bad)
        self.layout.check()

    # ---- validation -------------------------------------------------------------------
    def _type_violations(self):
        bad = []
        for name in INT_PARAMS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad.append(((name,), f"must be a positive integer, got {v!r}"))
        v = self.timeout_ns
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            bad.append((("timeout_ns",), f"must be an integer >= 0 (0 = unbounded waits), "
                                         f"got {v!r}"))
        v = self.recv_block_capacity
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)
                              or not 1 <= v <= self.max_tokens_per_rank):
            bad.append((("recv_block_capacity",), f"must be None (= max_tokens_per_rank) or an "
                        f"integer in [1, max_tokens_per_rank], got {v!r}"))
        for name in BOOL_PARAMS:
            v = getattr(self, name)
            if not isinstance(v, bool):
                bad.append(((name,), f"must be a bool, got {v!r}"))
        if not isinstance(self.token_fmt, TokenFormat):
            bad.append((("token_fmt",), f"must be a TokenFormat instance (e.g. "
                                        f"BF16Format(hid_dim, top_k)), got {self.token_fmt!r}"))
        return bad

    def _rule_violations(self):
        E, R, P = self.n_experts, self.n_ranks, self.p2p_world_size
        K = self.token_fmt.top_k
        bad = []

        def rule(ok, params, text):
            if not ok:
                bad.append((params, text))

        rule(self.num_threads % WARP_SIZE == 0, ("num_threads",),
             f"must be a multiple of the warp size {WARP_SIZE}, got {self.num_threads}")
        rule(self.num_threads <= MAX_THREADS, ("num_threads",),
             f"must be <= {MAX_THREADS} threads per block, got {self.num_threads}")
        rule(E % R == 0, ("n_experts", "n_ranks"),
             f"n_experts must be a multiple of n_ranks (n_local_experts = n_experts // "
             f"n_ranks), got n_experts={E}, n_ranks={R}")
        rule(R % P == 0, ("p2p_world_size", "n_ranks"),
             f"p2p_world_size must divide n_ranks, got p2p_world_size={P}, n_ranks={R}")
        rule(P <= MAX_GPUS_PER_NODE, ("p2p_world_size",),
             f"must be <= {MAX_GPUS_PER_NODE} (the rank-completion counters have "
             f"{MAX_GPUS_PER_NODE} slots), got {P}")
        rule(E <= self.num_threads, ("n_experts", "num_threads"),
             f"n_experts must be <= num_threads (the dispatch_wait aux block polls one count "
             f"word per thread), got n_experts={E}, num_threads={self.num_threads}")
        rule(E <= WARP_SIZE * WARP_SIZE, ("n_experts",),
             f"must be <= {WARP_SIZE * WARP_SIZE} (two-level warp prefix sum over the count "
             f"words), got {E}")
        rule(E < 65536, ("n_experts",),
             f"global expert ids travel as uint16: n_experts must be < 65536, got {E}")
        rule(R <= WARP_SIZE, ("n_ranks",),
             f"must be <= {WARP_SIZE} (per-rank prefix and lanes in dispatch_wait), got {R}")
        rule(K <= WARP_SIZE, ("token_fmt.top_k",),
             f"top_k must be <= {WARP_SIZE} (one lane per top-k slot), got {K}")
        if not self.skip_a2a:  # under skip_a2a a token may have ids on other devices only
            rule(K <= E, ("token_fmt.top_k", "n_experts"),
                 f"top_k must be <= n_experts (top-k ids are unique per token), got top_k={K}, "
                 f"n_experts={E}")
        if E % R == 0:
            L = E // R
            rule(L <= self.n_sms - 1, ("n_experts", "n_ranks", "n_sms"),
                 f"n_local_experts must be <= n_sms - 1 (one dispatch_wait comm SM per local "
                 f"expert at least), got n_local_experts={L}, n_sms={self.n_sms}")
        n_warps = self.num_threads // WARP_SIZE
        if n_warps:
            n_sig = ceildiv(E, n_warps)
            rule(n_sig < self.n_sms, ("n_sms", "n_experts", "num_threads"),
                 f"n_signal_sms = ceildiv(n_experts, num_threads // 32) = {n_sig} must be < "
                 f"n_sms = {self.n_sms} (dispatch_async needs at least one comm SM)")
        if self.p2p_world_size < R and not self.skip_a2a:
            rule(self.use_shmem, ("use_shmem", "p2p_world_size", "n_ranks"),
                 f"use_shmem=False with p2p_world_size={self.p2p_world_size} < n_ranks={R}: "
                 f"destinations outside the sender's P2P group are reached only through the "
                 f"SHMEM transport (NVSHMEM); set use_shmem=True, or p2p_world_size=n_ranks")
            if self.use_shmem:
                for flag in SHMEM_EXCLUSIVE:
                    rule(not getattr(self, flag), ("use_shmem", "p2p_world_size", flag),
                         f"use_shmem with p2p_world_size={self.p2p_world_size} < n_ranks={R} "
                         f"(destinations reached through NVSHMEM) and {flag} are exclusive: "
                         f"{SHMEM_EXCLUSIVE[flag]}")
        rule(self.ep_final_layout or not self.ep_prod_reserve,
             ("ep_prod_reserve", "ep_final_layout"),
             "ep_prod_reserve requires ep_final_layout")
        rule(not (self.ep_final_layout and not self.ep_prod_reserve and self.ep_ord_r),
             ("ep_ord_r", "ep_final_layout", "ep_prod_reserve"),
             "ep_ord_r with ep_final_layout needs ep_prod_reserve (the capacity-strided layout "
             "carries each block's offset in its count word, which the rank-flag consumer "
             "does not read)")
        rule(not (self.ep_final_layout and self.fused_shared_expert),
             ("ep_final_layout", "fused_shared_expert"),
             "ep_final_layout and fused_shared_expert are exclusive (the shared expert lives in "
             "the fused single-launch kernel, which does not take ep_final_layout yet)")
        rule(not (self.ep_final_layout and self.skip_a2a), ("ep_final_layout", "skip_a2a"),
             "ep_final_layout and skip_a2a are exclusive (ep_final_layout has every source "
             "write into its peers' grouped outputs; skip_a2a keeps each device's tokens on "
             "that device, so nothing is laid out across ranks)")
        rule(not self.ep_final_layout or E * self.max_tokens_per_rank < 2**31,
             ("ep_final_layout", "n_experts", "max_tokens_per_rank"),
             f"with ep_final_layout, n_experts * max_tokens_per_rank must be < 2**31 (output "
             f"rows travel as 31-bit block bases), got {E * self.max_tokens_per_rank}")
        rule(self.has_rank_flag == self.ep_ord_r, ("has_rank_flag", "ep_ord_r"),
             f"has_rank_flag requires ep_ord_r (and vice versa), got has_rank_flag="
             f"{self.has_rank_flag}, ep_ord_r={self.ep_ord_r}")
        if self.ep_rank_mask:
            for params, text in self._rank_mask_violations():
                rule(False, params, text)
        if self.ep_rank_dedup:
            for params, text in self._rank_dedup_violations():
                rule(False, params, text)
        for params, text in self.token_fmt.check_config(self):
            rule(False, tuple(params), text)
        if not bad:     # the extents come from the layout, which needs the rules above
            for params, what, value in self.index_extents():
                rule(value < INDEX_LIMIT, params,
                     f"{what} = {value} must be < 2**31: the kernels compute these indices "
                     f"in 32-bit arithmetic (byte offsets are 64-bit)")
        return bad

    def _rank_mask_violations(self):
        """The combinations ``ep_rank_mask`` does not take (docs/flags.md), each
        ``(parameters, rule)``."""
        bad = []
        if self.p2p_world_size < self.n_ranks and not self.skip_a2a:
            bad.append((("ep_rank_mask", "use_shmem", "p2p_world_size"),
                        f"ep_rank_mask with use_shmem and p2p_world_size={self.p2p_world_size} "
                        f"< n_ranks={self.n_ranks}: the SHMEM send paths (NVSHMEM puts and "
                        f"signals) do not consult the rank mask yet; use p2p_world_size="
                        f"n_ranks (every destination by P2P stores)"))
        excluded = {
            "skip_a2a": "skip_a2a sends nothing off the device, so there is no other rank to "
                        "mask",
            "ep_ord_r": "ORD-R's per-rank flags are waited for as a whole, not per source "
                        "rank",
            "ep_prod_reserve": "the early counts and mailboxes make dispatch_async wait for "
                               "every source, which the mask does not cover yet",
            "fused_shared_expert": "the shared expert needs the fused single-launch kernel, "
                                   "which does not take the rank mask",
        }
        for flag, why in excluded.items():
            if getattr(self, flag):
                bad.append((("ep_rank_mask", flag),
                            f"ep_rank_mask and {flag} are exclusive: {why}"))
        return bad

    def _rank_dedup_violations(self):
        """The combinations ``ep_rank_dedup`` does not take (docs/flags.md), each
        ``(parameters, rule)``."""
        excluded = {
            "ep_final_layout": "the final layout writes each (token, expert) row in place at "
                               "the destination, with no receive pass that could expand one "
                               "message into several rows",
            "skip_a2a": "skip_a2a keeps every top-k slot on its own device, so nothing "
                        "crosses a link and there is nothing to deduplicate",
        }
        return [(("ep_rank_dedup", flag), f"ep_rank_dedup and {flag} are exclusive: {why}")
                for flag, why in excluded.items() if getattr(self, flag)]

    def index_extents(self) -> list[tuple[tuple[str, ...], str, int]]:
        """The element extents the kernels index in 32-bit arithmetic, each ``(parameters,
        what, largest index + 1)``; ``EPConfig`` requires every one to be ``< 2**31``
        (``INDEX_LIMIT``). Byte offsets are computed in 64 bits from these indices."""
        lay, K = self.layout, self.token_fmt.top_k
        return [
            (("n_experts", "max_tokens_per_rank", "recv_block_capacity"),
             "receive-buffer slots n_local_experts * n_ranks * block_capacity",
             lay.n_local_experts * self.n_ranks * lay.block_capacity),
            (("n_experts", "n_ranks", "max_tokens_per_rank", "token_fmt",
              "fused_shared_expert"),
             "src_info words 2 * max_out_rows", 2 * lay.max_out_rows),
            (("max_tokens_per_rank", "token_fmt.top_k"),
             "top-k ids max_tokens_per_rank * top_k", self.max_tokens_per_rank * K),
        ] + ([(("n_ranks", "max_tokens_per_rank", "ep_rank_dedup"),
                "ep_rank_dedup message-area rows n_ranks * max_tokens_per_rank",
                lay.dedup_msg_rows),
               (("n_ranks", "max_tokens_per_rank", "token_fmt.top_k", "ep_rank_dedup"),
                "ep_rank_dedup slot-table words n_ranks * max_tokens_per_rank * top_k",
                lay.dedup_slot_words)] if self.ep_rank_dedup else [])

    # ---- derived --------------------------------------------------------------------------
    @functools.cached_property
    def layout(self) -> Layout:
        """Every derived member of the reference page (``epgen.layout.Layout``)."""
        return Layout(self)

    @property
    def token_fmt_type(self) -> TokenFormat:
        """The reference page's name for ``token_fmt``."""
        return self.token_fmt

    @property
    def needs_shmem(self) -> bool:
        """The SHMEM decision, the one predicate the kernels and worlds ask: some destination
        is outside this rank's P2P group (``p2p_world_size < n_ranks and not skip_a2a``), so
        it is reached through NVSHMEM. A valid configuration then has ``use_shmem`` (the rules
        refuse it without); ``use_shmem`` alone decides nothing."""
        return self.p2p_world_size < self.n_ranks and not self.skip_a2a

    @property
    def shmem_all_p2p(self) -> bool:
        """A report, not a decision: ``use_shmem`` is set but every destination is in the P2P
        group (``p2p_world_size == n_ranks``, without ``skip_a2a``, where ``inert_flags``
        reports it): the kernels are the P2P ones, no NVSHMEM call."""
        return bool(self.use_shmem) and not self.skip_a2a and not self.needs_shmem

    def effective_flags(self) -> dict:
        """What the build makes of the flags where it differs from their face value (plain
        data, for ``epgen inspect``): ``use_shmem`` without a remote destination builds the
        P2P kernels; with one, the remote destinations go through NVSHMEM; and every flag of
        ``inert_flags``."""
        out = {}
        if self.shmem_all_p2p:
            out["use_shmem"] = ("the P2P kernels, no NVSHMEM call (every destination is in "
                                "the P2P group)")
        elif self.needs_shmem:
            out["use_shmem"] = (f"NVSHMEM puts and signals to the destinations outside the "
                                f"sender's P2P group (p2p_world_size={self.p2p_world_size} "
                                f"of n_ranks={self.n_ranks}); peer stores inside it")
        out.update(self.inert_flags())
        return out

    def inert_flags(self) -> dict:
        """The flags that are set but build nothing different here, each with why (the
        kernels are the ones without the flag): ``use_shmem`` with ``skip_a2a`` (nothing
        leaves the device; the reference declares both with ``use_shmem=True`` by default),
        and ``ep_copy_role_split`` on a geometry the reference's split rule rejects
        (``layout.role_split.enabled`` false)."""
        out = {}
        if self.use_shmem and self.skip_a2a:
            out["use_shmem"] = ("no effect (the kernels are those without it): skip_a2a sends "
                                "nothing off the device")
        split = self.layout.role_split
        if self.ep_copy_role_split and not split.enabled:
            out["ep_copy_role_split"] = (
                f"no effect (the kernels are those without it): the copy/publisher split needs "
                f"hid_dim // 8 == {split.n_trips} * n_copy_threads with n_copy_threads = "
                f"num_threads - {32 * split.n_publisher_warps} > 0, got hid_dim // 8 = "
                f"{split.n_items} and n_copy_threads = {split.n_copy_threads}")
        return out

    def replace(self, **changes) -> EPConfig:
        """A copy with ``changes`` applied (validated again)."""
        return attrs.evolve(self, **changes)

    def describe(self) -> dict:
        """Plain-data view of every parameter, for the CLI and reports."""
        out = {}
        for f in attrs.fields(type(self)):
            v = getattr(self, f.name)
            out[f.name] = v.describe() if isinstance(v, (TokenFormat, Tuning)) else v
        return out
