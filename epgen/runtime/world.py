"""``EmulatedWorld``: every rank of an EP group on one GPU, each with its own buffers and
stream, running the generated dispatch kernels.

``skip_a2a`` (the reference instantiates it per device): ``EmulatedWorld(cfg, devices=D)`` runs ``D`` independent
devices, each with ``my_rank`` = its device id, its own buffers and pointer tables that hold only
its own buffers (whatever ``n_ranks`` and ``p2p_world_size``); inputs are one per device, with
global top-k ids, and the results compare with ``reference.dispatch(cfg, tokens, topk_ids,
ranks=list(range(D)))``.

The ordering between calls is ``RankWorld``'s (``rank_world.py``): each rank's stream waits on
the events recorded after every rank's previous ``dispatch_wait``.

``EmulatedWorld(cfg, fused=True)`` runs each round trip as the single fused launch
``ep_dispatch`` per rank (async and wait in one grid) with the same ordering: each rank's launch
of call N+1 waits on the events recorded after every rank's launch of call N. With
``cfg.fused_shared_expert`` the world always uses the fused kernel (the standalone kernels do
not take the shared expert) and refuses ``fused=False``.

``ep_final_layout`` (docs/final-layout.md): sources write each rank's grouped output and
header array directly, so the world allocates both per rank and passes every kernel the
tables of all ranks' pointers; the same event ordering also keeps a call's rows from being
overwritten by the next call before the host has read them. ``ep_prod_reserve``: every call
tags its early counts and mailboxes with a new generation, which the kernels keep in a word
of each rank's prod buffer and advance themselves (``layout.prod_gen_word_offset``), so the
prod buffers never need re-arming and the host passes nothing per call.

Everything but the placement lives in ``RankWorld`` (``rank_world.py``), which ``P2PWorld``
(``p2p_world.py``: one GPU per rank) and ``ShmemWorld`` (``shmem_world.py``: one process per
rank) share; the placement here is one GPU, one program, one error buffer, and every rank's
grid co-resident on it (``gpu_shares``).
"""

from __future__ import annotations

import ir

from ..kernels import build_module
from .graph import RoundTripGraph
from .placement import GpuShare, ordinal, ranks_in_words
from .rank_world import RankWorld
from .world_args import check_world_args


def participants(cfg, devices: int | None) -> list[int]:
    """The ``my_rank`` of each emulated participant: ranks ``0 .. n_ranks-1``, or under
    ``skip_a2a`` devices ``0 .. devices-1`` (default ``n_ranks``: one device per rank's slice
    of the experts, 1 in the per-device form). ``devices`` without ``skip_a2a`` is a
    ``ValueError``."""
    if not cfg.skip_a2a:
        if devices is not None:
            raise ValueError(f"EmulatedWorld: devices={devices!r} applies only with skip_a2a "
                             f"(independent devices); without it the world emulates "
                             f"n_ranks={cfg.n_ranks} ranks")
        return list(range(cfg.n_ranks))
    n = cfg.n_ranks if devices is None else devices
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"EmulatedWorld: devices must be a positive integer (skip_a2a "
                         f"devices on this GPU), got {devices!r}")
    if n * cfg.layout.n_local_experts > 65536:
        raise ValueError(f"EmulatedWorld: devices={n} x n_local_experts="
                         f"{cfg.layout.n_local_experts} global expert ids must be < 65536 "
                         f"(top-k ids travel as uint16)")
    return list(range(n))


class EmulatedWorld(RankWorld):
    """All ``cfg.n_ranks`` ranks on one GPU (under ``skip_a2a``: ``devices`` independent
    devices, see the module docstring). ``dispatch(tokens, topk_ids)`` runs one round
    trip (dispatch_async then dispatch_wait on every rank, or the fused ``ep_dispatch`` with
    ``fused=True``; default: fused exactly when ``cfg.fused_shared_expert``) and returns, per
    rank, the same ``reference.RankResult`` structure as ``epgen.reference.dispatch`` (with
    the output scales of the quantising formats; compare against ``reference.dispatch(...,
    input_scale=world.input_scale)``).

    ``batched=True`` launches every rank's grid of a kernel as one grid (``ir.batch_ranks``:
    each rank's arguments travel by value in one table; ``Program.launch_ranks``) on the
    first rank's stream, instead of one launch per rank stream. On one GPU the eight launches
    of a call start their blocks one after another, about 1.5 us apart on the H200 (measured
    with the trace points), a delay that ranks on their own GPUs do not have; one launch starts every
    rank's blocks together.

    ``backend="sim"`` runs the same kernels' IR on the CPU (``backends.sim``; ``sim_seed``
    fixes the simulator's interleaving, default 0), with the same results; a configuration
    too large to simulate is refused with a ``ValueError`` (``runtime.backend.sim_work``).
    ``backend`` may also be a ``backends.sim.Machine``.

    ``ep_rank_mask`` (docs/design.md, "Rank masks"): ``update_mask``, ``query_mask``,
    ``clean_mask``, ``masked_ranks``; ``shrink=True``, a wait for another rank that expires
    masks it instead of aborting, and ``check()`` returns the ranks masked; a rank whose
    inputs are None sits the call out (not launched, results None)."""

    def __init__(self, cfg, arch: str | None = None, device=None, timeout_ns: int | None = None,
                 fused: bool | None = None, input_scale: float = 1.0,
                 devices: int | None = None, batched: bool = False, backend="cuda",
                 sim_seed: int | None = None, shrink: bool = False):
        check_world_args("EmulatedWorld", timeout_ns=timeout_ns, device=device)
        self.rank_ids = participants(cfg, devices)
        if not isinstance(batched, bool):
            raise ValueError(f"EmulatedWorld: batched must be a bool, got {batched!r}")
        self.batched = batched
        self._init_common(cfg, fused, "EmulatedWorld", timeout_ns, input_scale, backend,
                          sim_seed, participants=len(self.rank_ids), shrink=shrink)
        self.device = self.cuda.get_device(device)
        module = self.co_resident(build_module(cfg))
        if batched:
            module = ir.batch_ranks(module, len(self.rank_ids), cfg.n_sms)
        self._load_dispatch(module, arch)
        self._allocate([self.device] * len(self.rank_ids))
        #: the error buffer of the one GPU
        self.err = self.errs[ordinal(self.device)]

    def gpu_shares(self) -> list[GpuShare]:
        """One GPU running every rank's grid."""
        return [GpuShare(ordinal(self.device), len(self.rank_ids),
                         ranks_in_words(self.rank_ids))]

    def capture_moe(self, calls: int = 1, stream=None, *, weighted: bool = True,
                    residual: bool = False, fp8: bool = False) -> RoundTripGraph:
        """A ``RoundTripGraph`` of ``calls`` dispatch + combine round trips of every rank
        (``graph.py``; docs/combine.md "CUDA graphs"): per call the launches of
        ``enqueue_round_trip`` then those of ``Combiner.enqueue``, in one graph. ``weighted``
        / ``residual``: the combine's launch arguments frozen into it (each replay's
        ``graph.combiner.load`` must make the same choice). ``fp8``: the FP8 combine's
        kernels (docs/combine.md, "FP8 combine"; its buffers are made before the capture),
        each replay's ``load`` passing ``fp8=True``. ``ValueError`` for a configuration
        combine does not take (``runtime.combine.check_supported``; ``fp8``: ``hid_dim`` a
        multiple of 128)."""
        if not all(isinstance(v, bool) for v in (weighted, residual, fp8)):
            raise ValueError(f"capture_moe: weighted, residual and fp8 must be bools, got "
                             f"{weighted!r}, {residual!r}, {fp8!r}")
        if residual and not weighted:
            raise ValueError("capture_moe: residual=True needs weighted=True (the unreduced "
                             "rows take no residual)")
        comb = self.combiner()
        if fp8:
            comb.prepare_fp8()          # no allocation may happen while capturing
        comb.weighted, comb.has_residual, comb.fp8 = weighted, residual, fp8
        comb.partial = False      # a graph of the partial-reduce combine: not built
        return RoundTripGraph(self, calls, stream, combiner=comb)


__all__ = ["EmulatedWorld", "participants"]
