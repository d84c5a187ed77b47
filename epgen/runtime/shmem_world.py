"""``ShmemWorld``: one process per PE (rank), NVSHMEM between them.

Start N processes with ``epgen launch -n N -- CMD`` or torchrun; each builds
``ShmemWorld(cfg)`` and calls ``dispatch`` with its own inputs, getting its own result.
Destinations inside the rank's P2P group (``p2p_world_size`` consecutive ranks) are written
directly through the peer addresses NVSHMEM maps (``nvshmem_ptr``); the others through the
kernels' SHMEM path (puts into the symmetric receive buffer, a signal on the symmetric count
word), which needs ``use_shmem=True``.

Everything per rank (buffers, launches, the ordering of one rank's calls, the timeout check,
re-arming, results) is ``RankWorld`` (``rank_world.py``) with one rank; this module gives
its placement interface:

- **Rank and GPU**: ``rank`` (default ``RANK``) of ``WORLD_SIZE == cfg.n_ranks``; the GPU
  ``LOCAL_RANK % device_count`` (or ``device``). Several PEs may share a GPU (one GPU runs the
  whole group, best under MPS).
- **Session** (``shmem_session.py``): NVSHMEM initialises once per process. A
  ``ShmemSession`` is that initialisation; ``ShmemWorld(cfg, session=s)`` runs on it, and
  several worlds may share one (each with its own kernels and symmetric allocations). Without
  ``session=`` the world makes a private session and finalises it at ``close``.
- **Bootstrap** (``bootstrap.py``): rank 0 takes an NVSHMEM unique id, the launcher's files
  (or ``torch.distributed`` under torchrun, or a given process group) carry it to the others,
  every PE initialises with it (``nvshmemx_hostlib_init_attr``). NVSHMEM's own host
  collectives are never used (they abort without full multi-process-per-GPU support); host
  barriers go through the bootstrap.
  Before init, ``NVSHMEM_DISABLE_NVLS=1`` is set when absent (on one node set
  ``NVSHMEM_REMOTE_TRANSPORT=none`` too: no NIC transport is needed).
- **Symmetric memory**: every buffer a peer writes or a put reads (send buffer, receive
  buffer, receive-count words; with ``ep_final_layout`` the grouped output, its scales, the
  header array and the prod buffer) comes from ``nvshmem_malloc``, the same sizes in the same
  order on every PE; the rest is local. The pointer tables of the P2P group hold each peer's
  ``nvshmem_ptr`` address (NULL: the world refuses, naming the peers; a P2P group needs peer
  access between its GPUs).
- **Kernels**: loaded once; a module that links NVSHMEM's device library gets
  ``nvshmemx_cumodule_init`` before its first launch.
- **Host barriers**: after setup (every PE's buffers armed before any kernel writes to
  them), after every call (no PE's next call may write a receive buffer a peer is still
  draining: across processes there are no shared events) and at ``close``.
- **Combine** (``combine``, docs/combine.md): this rank's expert outputs, weights and
  residual in, its reduced tokens out. The combine receive buffer, the arrival words and the
  expert outputs (the source of the puts) come from ``nvshmem_malloc`` too, allocated on
  every PE's first ``combine`` in the same order; the P2P group's tables hold their
  ``nvshmem_ptr`` addresses, the other entries this PE's own (the symmetric address of a
  put or signal). A host barrier follows the allocation (every PE's words armed before any
  peer writes them) and every call, as for dispatch.
- **Failures**: a peer that dies or never starts leaves the others' bounded waits to expire:
  ``dispatch`` raises ``EPTimeoutError`` (as in the other worlds) and the world can still be
  closed; a barrier that a peer never reaches raises ``BootstrapTimeoutError`` naming it.
- **Rank masks** (``ep_rank_mask``, every destination in one P2P group; ``shrink=True`` for
  DeepEP's shrink): the host barriers meet the live PEs only (``live_ranks``: every PE less
  the ones this PE's mask gave up on). Under shrink a dead PE is masked by the kernels whose
  waits for it expire, and the call completes without it; one that dies after the kernels
  is masked when it misses the end-of-call barrier (``meet_live``). Once a PE is masked,
  ``close`` skips the collective steps (the session is marked lost), as the masked PE will
  not meet the others again.
- **Close**: ``close()`` (or leaving ``with ShmemWorld(cfg) as world:``) synchronises, meets
  the others at a barrier, frees the world's symmetric buffers collectively and, with a
  private session, finalises NVSHMEM (a shared session's ``close`` does); idempotent. When
  the barrier fails (a peer is gone), the collective free and finalize are skipped (they
  would wait for the dead peer), the session is marked lost (its other worlds then close
  without collectives) and the error is raised unless another one is already propagating.
  A world dropped without ``close`` warns (``ResourceWarning``) and frees nothing.
"""

from __future__ import annotations

import itertools
import os
import warnings

import numpy as np

from backends import cuda as cuda_backend

from .. import reference
from ..errors import EPInputError, EPTimeoutError
from ..kernels import build_module
from . import bootstrap as bootstrap_mod
from . import call_args
from .placement import GpuShare, PeerAccessError
from .rank_world import RankWorld
# NVSHMEM_ENV_DEFAULTS and set_env_defaults stay importable from here too
from .shmem_session import (  # noqa: F401
    NVSHMEM_ENV_DEFAULTS, ShmemSession, default_barrier_timeout, local_sharers, resolve_device,
    set_env_defaults)
from .world_args import check_world_args

_WORLD_INDEX = itertools.count()      # worlds of this process: names of their bootstrap files


def resolve_rank(cfg, rank: int | None, world_size: int | None = None) -> int:
    """This process's rank: ``rank``, else ``RANK``; ``WORLD_SIZE`` (or ``world_size``) must
    equal ``cfg.n_ranks``. A one-rank configuration needs neither."""
    env_rank, env_size = bootstrap_mod.env_rank()
    size = world_size if world_size is not None else env_size
    if rank is None:
        rank = env_rank
    if rank is None:
        if cfg.n_ranks == 1:
            return 0
        raise ValueError(f"ShmemWorld: no rank (RANK unset): start {cfg.n_ranks} processes "
                         f"with 'epgen launch -n {cfg.n_ranks} -- CMD' or torchrun, or pass "
                         f"rank=")
    if size is None and cfg.n_ranks > 1:
        raise ValueError(f"ShmemWorld: WORLD_SIZE is unset; the configuration has "
                         f"n_ranks={cfg.n_ranks} (one process per rank)")
    if size is not None and size != cfg.n_ranks:
        raise ValueError(f"ShmemWorld: WORLD_SIZE={size} processes, but the configuration has "
                         f"n_ranks={cfg.n_ranks}: start one process per rank")
    if not 0 <= rank < cfg.n_ranks:
        raise ValueError(f"ShmemWorld: rank {rank} is not in [0, n_ranks={cfg.n_ranks})")
    return int(rank)


def check_transport(cfg) -> None:
    """What the world refuses: ``skip_a2a`` (nothing leaves the device: ``EmulatedWorld``),
    and destinations outside a P2P group without ``use_shmem``."""
    if cfg.skip_a2a:
        raise ValueError("ShmemWorld: skip_a2a configurations send nothing off the device; "
                         "run them with EmulatedWorld")
    if cfg.needs_shmem and not cfg.use_shmem:
        raise ValueError(f"ShmemWorld: p2p_world_size={cfg.p2p_world_size} < n_ranks="
                         f"{cfg.n_ranks} reaches ranks outside the P2P group through the "
                         f"SHMEM transport: set use_shmem=True")


def uses_nvshmem(ptx: str | None) -> bool:
    """Whether a module's PTX links NVSHMEM's device library (its device state global)."""
    return bool(ptx) and "nvshmemi_device_state_d" in ptx


class ShmemWorld(RankWorld):
    """This process's rank of an EP group of one process per PE (module docstring).
    ``dispatch(tokens, topk_ids)`` takes this rank's inputs (``[T, hid_dim]`` tokens,
    ``[T, top_k]`` ids) and returns this rank's ``reference.RankResult`` (compare with
    ``reference.dispatch(cfg, all_tokens, all_ids)[rank]``). ``fused``, ``timeout_ns`` and
    ``input_scale`` as in the other worlds.

    ``session`` (a ``ShmemSession``): the NVSHMEM initialisation to run on, shared with other
    worlds; the world takes its rank, GPU, backend, bootstrap and host (``rank``, ``device``
    and ``backend`` may repeat the session's, ``bootstrap`` and ``host`` may not be given;
    ``cfg.n_ranks`` must be its PE count). Without it the world makes a private session of
    ``bootstrap`` (default ``bootstrap.from_env``), ``host`` (default
    ``backends.cuda.nvshmem_host.NvshmemHost()``), ``device`` and ``backend`` (default
    ``"cuda"``). ``barrier_timeout_s`` bounds the close barrier (default: the session's,
    else ``EPGEN_BARRIER_TIMEOUT_S`` or 120 s).

    Attributes: ``rank``, ``device`` (its GPU), ``program``, ``err``, ``session``,
    ``owns_session``, ``host``, ``bootstrap``, ``pool`` (the symmetric allocations),
    ``ranks`` (this rank's buffers, one entry)."""

    def __init__(self, cfg, rank: int | None = None, *, device: int | None = None,
                 arch: str | None = None, timeout_ns: int | None = None,
                 fused: bool | None = None, input_scale: float = 1.0, bootstrap=None,
                 host=None, barrier_timeout_s: float | None = None, backend=None,
                 session: ShmemSession | None = None, shrink: bool = False):
        self._closed = True                  # nothing to release until NVSHMEM is up
        check_world_args("ShmemWorld", timeout_ns=timeout_ns, device=device)
        if session is not None:
            if not isinstance(session, ShmemSession):
                raise ValueError(f"ShmemWorld: session= must be a ShmemSession, got "
                                 f"{type(session).__name__}")
            session.check_world(cfg, rank=rank, device=device, bootstrap=bootstrap,
                                host=host, backend=backend)
            self.rank = session.rank
        else:
            self.rank = resolve_rank(cfg, rank, getattr(bootstrap, "world_size", None))
        check_transport(cfg)
        if backend is None:
            backend = "cuda" if session is None else session.backend
        self._init_common(cfg, fused, "ShmemWorld", timeout_ns, input_scale, backend,
                          participants=1, shmem_ok=True, shrink=shrink)
        if barrier_timeout_s is None:
            barrier_timeout_s = (session.barrier_timeout_s if session is not None
                                 else default_barrier_timeout())
        self.barrier_timeout_s = barrier_timeout_s
        if session is None:
            n_dev = self.cuda.device_count()
            self.device_id = resolve_device(device, n_dev, bootstrap_mod.local_rank())
            self.sharers = local_sharers(self.device_id, n_dev, int(
                os.environ.get("LOCAL_WORLD_SIZE") or 1)) if device is None else 1
        else:
            self.device_id, self.sharers = session.device_id, session.sharers
        self.index = next(_WORLD_INDEX)
        #: whether the world made its session (and finalises it at close)
        self.owns_session = session is None
        if session is None:
            session = ShmemSession(
                self.rank, cfg.n_ranks, device=self.device_id, bootstrap=bootstrap,
                host=host, barrier_timeout_s=barrier_timeout_s,
                backend="cuda" if self.cuda is cuda_backend else self.cuda,
                name=f"w{self.index}")
        self.session = session
        self.bootstrap, self.host = session.bootstrap, session.host
        self._closed = False
        self._failed = False
        self.ranks = []
        session.register(self)
        try:
            self._setup(cfg, arch)
            self.bootstrap.barrier(f"w{self.index}-ready")
        except BaseException:
            self._failed = True
            self.close(_raise=False)
            raise

    def _setup(self, cfg, arch):
        self.rank_ids = [self.rank]
        self._load_dispatch(self.co_resident(build_module(cfg)), arch)
        self.pool = self.host.symmetric_resource()
        self._allocate([self.device])
        #: the error buffer of this PE's GPU
        self.err = self.errs[self.device_id]

    # -- placement ------------------------------------------------------------------------------
    def gpu_shares(self) -> list[GpuShare]:
        """This PE's GPU, running the grids of ``sharers`` PEs (this one and the other
        processes of this node on the same GPU)."""
        who = "this PE" if self.sharers == 1 else f"{self.sharers} PEs"
        return [GpuShare(self.device_id, self.sharers, who, "run fewer PEs on it")]

    def memory_of(self, device) -> dict:
        """Every buffer a peer writes or a put reads comes from the symmetric heap."""
        return {"peer_memory": self.pool, "send_memory": self.pool}

    def load(self, module, arch_of=None):
        """As ``RankWorld.load``; a module that links NVSHMEM's device library gets
        ``nvshmemx_cumodule_init`` before its first launch."""
        programs = super().load(module, arch_of)
        for program in programs.values():
            if uses_nvshmem(program.ptx):
                self.host.cumodule_init(program.loaded.cumodule())
        return programs

    def pointer_table(self, i: int, peers, buffers):
        """The address of this PE's buffer (``buffers[0]``) on every PE of ``peers``, as this
        process reaches it (``nvshmem_ptr``; its own: the local address). A NULL address is a
        ``PeerAccessError`` naming every unreachable PE."""
        own = buffers[0].ptr
        ptrs = [own if q == self.rank else self.host.ptr(own, q) for q in peers]
        unreachable = [q for q, p in zip(peers, ptrs) if not p]
        if unreachable:
            raise PeerAccessError(
                f"ShmemWorld: rank {self.rank} cannot load and store the memory of PE(s) "
                f"{', '.join(map(str, unreachable))} of its P2P group (nvshmem_ptr is NULL): "
                f"a P2P group (p2p_world_size={self.cfg.p2p_world_size}) needs peer access "
                f"between its GPUs; lower p2p_world_size (use_shmem=True reaches the others "
                f"by SHMEM puts) or place the group on GPUs with an NVLink/PCIe peer path")
        return self.cuda.to_device(np.array(ptrs, np.uint64), device=self.device,
                                   stream=self.ranks[i].stream)

    # -- the per-rank API --------------------------------------------------------------------------
    def load_inputs(self, tokens, topk_ids):
        """Validate and copy this rank's inputs (one ``[T, hid_dim]`` tokens array and its
        ``[T, top_k]`` ids; host or device arrays). Forgets the last dispatch's weights
        (``last_weights``), as ``RankWorld.load_inputs``."""
        self.last_weights = None
        K = self.cfg.token_fmt.top_k
        if isinstance(tokens, (list, tuple)) or isinstance(topk_ids, (list, tuple)):
            raise TypeError(f"ShmemWorld: dispatch takes this rank's own inputs (one tokens "
                            f"array and one topk_ids array), not a list per rank")
        all_t = [tokens if q == self.rank else tokens[:0] for q in range(self.cfg.n_ranks)]
        all_i = [topk_ids if q == self.rank else np.zeros((0, K), np.int32)
                 for q in range(self.cfg.n_ranks)]
        counts = reference.validate_inputs(self.cfg, all_t, all_i)
        self._load_rank(self.ranks[0], tokens, topk_ids, counts[self.rank])

    def _require_open(self):
        if self._closed:
            raise RuntimeError("ShmemWorld: the world is closed")

    def _after_call(self, run, meet_on=()):
        """``run()``, then the host barrier that ends a call of every PE. An expired wait
        skips the barrier (the others fail on their own deadlines) and marks the world
        failed; an exception of ``meet_on`` (raised once the kernels have finished
        everywhere) still meets the others at the barrier, then propagates."""
        self._require_open()
        try:
            out = run()
        except EPTimeoutError:
            self._failed = True
            raise
        except meet_on:
            self.meet_live("call")
            raise
        self.meet_live("call")
        return out

    def live_ranks(self) -> list[int]:
        """The PEs this one still meets: every PE, less those its rank mask gave up on
        (``ep_rank_mask``: masked by hand or, under shrink, by its kernels)."""
        dead = set() if self.masks is None else self.masks.dead
        return [q for q in range(self.cfg.n_ranks) if q not in dead]

    def meet_live(self, name: str) -> None:
        """The host barrier that ends a call, over ``live_ranks``. Under shrink a PE that
        never arrives (it died after the kernels, which did not need it) is masked as its
        kernels would have masked it, within ``mask_barrier_timeout_s``, and the call goes
        on; otherwise ``BootstrapTimeoutError`` as for any barrier."""
        if self.masks is None:
            self.barrier(name)
            return
        live = self.live_ranks()
        shrink = self.masks.shrink
        try:
            self.bootstrap.barrier(f"w{self.index}-{name}", ranks=live,
                                   timeout_s=self.mask_barrier_timeout_s if shrink else None)
        except bootstrap_mod.BootstrapTimeoutError as e:
            if not (shrink and e.missing):
                raise
            for q in e.missing:
                self.update_mask(q, True)

    @property
    def mask_barrier_timeout_s(self) -> float:
        """Under shrink, how long the end-of-call barrier waits for a PE before masking it:
        three of the kernels' deadlines (a live PE's kernels finish within two: one to mask
        a dead PE, one for the copy blocks' ready flag), at least 5 s."""
        return max(5.0, 3 * self.timeout_ns / 1e9)

    def mark_failed(self) -> None:
        """Record that this PE's call failed although no wait expired here (a check of its
        results did): ``close`` then waits for the others at its barrier only as long as
        their bounded waits take to fail too."""
        self._failed = True

    def dispatch(self, tokens, topk_ids, input_scale: float | None = None, *,
                 topk_weights=None):
        """One round trip of every PE (each calls it with its own inputs): this rank's
        ``reference.RankResult``. Returns after every PE's round trip has finished (a host
        barrier), so the next call may start. ``topk_weights``: this rank's ``[T, K]``
        (``ep_rank_dedup`` only, as ``RankWorld.dispatch``)."""
        return self._after_call(lambda: super(ShmemWorld, self).dispatch(
            tokens, topk_ids, input_scale, topk_weights=topk_weights)[0])

    def check_weights(self, topk_weights, topk_ids) -> list | None:
        """This rank's ``topk_weights`` checked as ``RankWorld.check_weights`` checks one
        rank's (named ``topk_weights[<rank>]``)."""
        if topk_weights is None:
            return None
        if isinstance(topk_weights, (list, tuple)):
            raise TypeError("ShmemWorld: dispatch takes this rank's own topk_weights (one "
                            "array), not a list per rank")
        return super().check_weights([topk_weights], [topk_ids])

    def dispatch_replayed(self, tokens, topk_ids, graph=None) -> tuple:
        """``dispatch`` as a replay of this rank's captured round trip: ``(graph, result)``."""
        def run():
            g, res = super(ShmemWorld, self).dispatch_replayed(tokens, topk_ids, graph)
            return g, res[0]
        return self._after_call(run)

    def combine(self, expert_out, topk_weights=None, residual=None, *, fp8: bool = False,
                partial_reduce: bool = False, _src_info=None):
        """Combine this PE's part of the last ``dispatch`` (every PE calls it; docs/combine.md):
        ``expert_out`` ``[rows, H]`` BF16, one row per row of this rank's grouped output;
        ``topk_weights`` ``[T, K]`` float32 or None; ``residual`` ``[T, H]`` BF16 or None.
        Returns this rank's ``[T, H]`` BF16 bits (None weights: the unreduced ``[T, K, H]``),
        as ``reference.combine(cfg, ...)[rank]``, after a host barrier of every PE (also
        when a row was refused: ``EPInputError`` after it). ``fp8``: the FP8 combine (every
        PE passes the same; its first use allocates the FP8 buffers collectively, then the PEs
        meet at a barrier). ``partial_reduce``: the partial-reduce combine (every PE passes
        the same; as ``RankWorld.combine``; its first use allocates its staging, then the PEs
        meet at a barrier). ``_src_info``: test hook, this rank's replacement ``src_info``."""
        self._require_open()
        if any(isinstance(a, (list, tuple)) for a in (expert_out, topk_weights, residual)):
            raise TypeError("ShmemWorld: combine takes this rank's own arrays (expert_out, "
                            "topk_weights, residual), not a list per rank")
        one = lambda a: None if a is None else [a]  # noqa: E731
        call_args.combine_fp8_flag(self.cfg, fp8)
        call_args.combine_partial_flag(self.cfg, partial_reduce, topk_weights, fp8,
                                       self.last_weights is not None)
        call_args.check_combine(self, [expert_out], one(topk_weights), one(residual),
                                reduced=partial_reduce)
        comb = self.prepare_combine(fp8, partial_reduce)
        comb.load([expert_out], one(topk_weights), one(residual), src_info=one(_src_info),
                  fp8=fp8, partial_reduce=partial_reduce)

        def run():
            comb.enqueue()
            return comb.finish()[0]
        return self._after_call(run, meet_on=(EPInputError,))

    def sides_built(self, names: list) -> None:
        """Every PE built the same combine sides now (``prepare_combine``; the symmetric
        allocations are collective): once this PE's buffers are armed, meet the others, so
        that no peer's kernel writes into them first (a row or an arrival word the arming
        would wipe)."""
        if names:
            self.synchronize()
        for name in names:
            self.meet_live("combine-ready" if name == "combine" else f"combine-{name}-ready")

    def barrier(self, name: str = "user") -> None:
        """A host barrier of every PE (the bootstrap's)."""
        self.bootstrap.barrier(f"w{self.index}-{name}")

    # -- close ------------------------------------------------------------------------------------
    def close(self, _raise: bool = True) -> None:
        """Synchronise, meet every PE at a barrier, free the world's symmetric buffers
        (collectively, in order) and, when the world made its own session, finalise
        NVSHMEM (a shared session stays up: ``ShmemSession.close`` finalises it).
        Idempotent. If a peer never reaches the barrier, the collective steps are skipped
        (they would wait for it), the session is marked lost and ``BootstrapTimeoutError``
        is raised (unless ``_raise`` is False, e.g. while another error propagates). On a
        session already lost the barrier and the free are skipped, with a warning."""
        if self._closed:
            return
        self._closed = True
        session = self.session
        if self.masks is not None and self.masks.dead:
            # a masked PE never meets the others again: the collective free and finalize
            # would wait for it
            session.mark_lost()
        error = None
        try:
            self.synchronize()
        except Exception as e:        # a faulted context: still try to leave in step
            error = e
        left_up = " and NVSHMEM not finalised" if self.owns_session else ""
        if session.lost:              # a peer is gone: nothing collective can finish
            self.ranks = []
            session.release(self)
            warnings.warn(f"ShmemWorld.close: a peer of the session was lost earlier; "
                          f"symmetric buffers not freed{left_up}", RuntimeWarning, stacklevel=2)
            if error is not None and _raise:
                raise error
            return
        timeout = self.barrier_timeout_s
        if self._failed:              # the others are failing too: each within ~2 deadlines
            timeout = min(timeout, max(5.0, 3 * self.timeout_ns / 1e9))
        try:
            self._barrier_bounded(f"w{self.index}-close", timeout)
        except bootstrap_mod.BootstrapTimeoutError as e:
            self.ranks = []
            session.mark_lost()
            session.release(self)
            if _raise:
                raise
            warnings.warn(f"ShmemWorld.close: {e}; symmetric buffers not freed{left_up}",
                          RuntimeWarning, stacklevel=2)
            return
        self.ranks = []
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.free_all()
        session.release(self)
        if self.owns_session:
            session.close(barrier=False)   # the barrier above was the last collective wait
        if error is not None and _raise:
            raise error

    def _barrier_bounded(self, name: str, timeout_s: float) -> None:
        self.bootstrap.barrier(name, timeout_s=timeout_s)

    @property
    def finalized(self) -> bool:
        """Whether NVSHMEM was shut down (its session's ``finalized``)."""
        return self.session.finalized

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(_raise=exc_type is None)
        return False

    def __del__(self):
        if not getattr(self, "_closed", True):
            warnings.warn("ShmemWorld was not closed: its symmetric buffers are freed only "
                          "by close() (use 'with ShmemWorld(cfg) as world:')",
                          ResourceWarning, stacklevel=1)
