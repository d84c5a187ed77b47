"""``P2PWorld``: one GPU per rank, all ranks in one process, each rank's kernels writing its
peers' buffers directly through CUDA peer access (NVLink, or a PCIe peer path).

Everything the worlds share (buffers per rank, pointer tables per P2P group, the launches of
a round trip, the ordering between calls, re-arming, results) is ``RankWorld``
(``rank_world.py``); this module gives its placement interface:

- **Devices** (``assign_devices``): rank ``r`` runs on GPU ``r`` by default (the world
  refuses, naming the count, when there are fewer GPUs than ranks); ``devices=[...]`` places
  the ranks explicitly. Several ranks may share a GPU (e.g. ``devices=[0, 0]`` on a one-GPU
  machine): their grids must then be co-resident there, which the capacity check covers.
- **Peer access** (``peer_pairs``, ``check_peer_access``): every ordered pair of distinct GPUs
  whose ranks share a P2P group must reach each other (``cuDeviceCanAccessPeer``); all pairs
  are checked before anything is allocated, and a ``PeerAccessError`` names every pair that
  cannot, with the ranks on each side. Then ``cuCtxEnablePeerAccess`` for every such pair
  (covers ``cuMemAlloc``-style memory, e.g. a caller's buffers), and every buffer a peer
  writes (receive buffers, receive-count words; with ``ep_final_layout`` the grouped output and
  its scales, the header array and the prod buffer) is allocated from a memory pool of its
  GPU whose access list holds every peer GPU (``backends.cuda.peer_memory_resource``:
  stream-ordered pool allocations are not covered by ``cuCtxEnablePeerAccess``). Everything
  else (inputs, send buffer, counters, the rest of the outputs, pointer tables) is local.
- **Kernels**: the IR module is built and lowered once (per architecture) and loaded as one
  ``Program`` per GPU (``RankWorld.load``: ``placement.RankPrograms``); each rank launches
  through its GPU's program on its own stream, created on its GPU.
- **Ordering between calls**: as in ``EmulatedWorld``: a rank's ``dispatch_async`` (or fused
  launch) of call N+1 waits on the events recorded after every rank's ``dispatch_wait`` of
  call N. Here those are cross-device waits (``cuStreamWaitEvent`` accepts an event of another
  GPU's context), so no host synchronisation is needed between calls.
- **Co-residency** (``gpu_shares``; the rule is ``placement.residency_problems``): each
  rank's grid only waits on its peers' grids,
  which run on other GPUs, so nothing needs to be co-resident across GPUs; but every block of
  each rank's grid must be resident on its own GPU at once (the roles wait on each other),
  so the world checks, per GPU and kernel, ``ranks on it x n_sms <= blocks per SM x SMs`` from
  the driver's occupancy answer, and refuses with the numbers otherwise; the kernels ask ptxas
  for that many resident blocks per SM where ranks share a GPU (``placement.co_resident``).
- **Timeouts and the abort word**: one ``DiagBuffer`` per GPU; every kernel reports into its
  own GPU's buffer (``err_buf``). An expired wait raises the abort word of that buffer only,
  so the other waits *on that GPU* give up at once, as in ``EmulatedWorld``. Ranks on other
  GPUs do not see it: a rank waiting on a peer that gave up times out on its own deadline
  (``timeout_ns``, default 2 s) and reports its own record; a wait that does not depend on the
  failed peer completes normally. So a failed call still ends on every GPU, within about one
  deadline per kernel of a rank's stream (``dispatch_async`` then ``dispatch_wait``: at most
  about twice ``timeout_ns``), never a hang (unless ``timeout_ns=0``, unbounded, as in the
  reference). ``check()`` synchronises every rank, reads every GPU's buffer, re-arms each used
  one and raises one ``EPTimeoutError`` holding the records of all GPUs (each record names
  its rank), then re-arms the world (``reset``). A single shared buffer would propagate the
  abort across GPUs, but the record slots are claimed with a gpu-scope atomic, which is not
  atomic between GPUs.
- **Inputs**: host arrays are copied to each rank's GPU; a device array given for rank ``r``
  must live on rank ``r``'s GPU (checked before anything is copied).
- **Combine** (``combine``, docs/combine.md; ``runtime.combine.Combiner`` through the same
  placement interface): the combine kernels are loaded once per GPU as
  the dispatch kernels are; each rank's combine receive buffer and arrival words come from
  its GPU's peer-accessible pool (its P2P peers write them), the rest is local; every rank's
  tables hold its P2P peers' buffers (and, for a source outside the group on the simulator's
  SHMEM model, its own). The grids are checked for residency per GPU as above.
"""

from __future__ import annotations

from backends.cuda.errors import CudaUnavailableError

from ..kernels import build_module
from .placement import GpuShare, PeerAccessError, ordinal, p2p_group, ranks_in_words
from .rank_world import RankWorld
from .world_args import check_world_args, device_ordinal


def check_devices(n_ranks: int, devices) -> tuple[int, ...] | None:
    """``devices`` as GPU ordinals, one per rank (None stays None), whatever the machine:
    ``ValueError`` naming the entry that is not an ordinal, or the count."""
    if devices is None:
        return None
    try:
        out = tuple(device_ordinal("P2PWorld", f"devices[{r}]", d)
                    for r, d in enumerate(devices))
    except TypeError:
        raise ValueError(f"P2PWorld: devices = {devices!r} is not a sequence of GPU "
                         f"ordinals") from None
    if len(out) != n_ranks:
        raise ValueError(f"P2PWorld: devices has {len(out)} entries, one per rank is "
                         f"{n_ranks}")
    return out


def assign_devices(n_ranks: int, devices, n_devices: int) -> tuple[int, ...]:
    """The GPU ordinal of every rank: ``devices`` (one ordinal per rank; ranks may share a
    GPU), or rank ``r`` on GPU ``r`` when ``devices`` is None. ``devices`` itself is checked
    first (``ValueError`` naming the entry), then the machine: ``CudaUnavailableError``
    without a GPU (``n_devices`` 0), ``ValueError`` naming the problem when its GPUs cannot
    hold the ranks."""
    out = check_devices(n_ranks, devices)
    if n_devices < 1:
        raise CudaUnavailableError("P2PWorld: no usable CUDA GPU here "
                                   "(backends.cuda.device_count() is 0); P2PWorld needs one "
                                   "GPU per rank")
    if out is None:
        if n_devices < n_ranks:
            raise ValueError(
                f"P2PWorld: n_ranks={n_ranks} needs {n_ranks} GPUs (one per rank), this "
                f"machine has {n_devices}; pass devices=[...] to place the ranks (several "
                f"ranks may share a GPU) or use EmulatedWorld (every rank on one GPU)")
        return tuple(range(n_ranks))
    for r, d in enumerate(out):
        if d >= n_devices:
            raise ValueError(f"P2PWorld: devices[{r}] = {d} is not a GPU of this machine "
                             f"(ordinals 0..{n_devices - 1})")
    return out


def sim_gpus(cfg, devices) -> int:
    """The GPUs of the machine a ``backend="sim"`` world simulates: one per rank, or more if
    ``devices`` names a higher ordinal (a malformed ``devices`` is ``assign_devices``'s to
    refuse)."""
    try:
        return max([cfg.n_ranks, *(int(d) + 1 for d in devices or ())])
    except (TypeError, ValueError):
        return cfg.n_ranks


def peer_pairs(cfg, devices) -> list[tuple[int, int]]:
    """Ordered pairs ``(a, b)`` of distinct GPUs where a rank on ``a`` writes the buffers of
    a rank on ``b`` (they share a P2P group), so ``a`` must access ``b``'s memory."""
    pairs = set()
    for r in range(cfg.n_ranks):
        for q in p2p_group(cfg, r):
            if devices[r] != devices[q]:
                pairs.add((devices[r], devices[q]))
    return sorted(pairs)


def peers_of(cfg, devices) -> dict[int, list[int]]:
    """For every GPU of ``devices``, the other GPUs whose ranks write its memory."""
    out = {d: set() for d in devices}
    for a, b in peer_pairs(cfg, devices):
        out[b].add(a)
    return {d: sorted(s) for d, s in out.items()}


def check_peer_access(cfg, devices, can_access_peer) -> None:
    """Raise ``PeerAccessError`` naming every pair of ``peer_pairs`` for which
    ``can_access_peer(a, b)`` is False (with the ranks on each side); nothing is enabled."""
    bad = [(a, b) for a, b in peer_pairs(cfg, devices) if not can_access_peer(a, b)]
    if not bad:
        return

    def ranks(d):
        on = [r for r in range(cfg.n_ranks) if devices[r] == d]
        return f"rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))}"

    lines = [f"GPU {a} ({ranks(a)}) cannot access the memory of GPU {b} ({ranks(b)})"
             for a, b in bad]
    raise PeerAccessError(
        "P2PWorld: " + "; ".join(lines) + ": cuDeviceCanAccessPeer is false, so those ranks "
        "cannot write each other's receive buffers. Every pair of GPUs of a P2P group needs "
        "an NVLink or PCIe peer path ('nvidia-smi topo -m' shows them); place the ranks on "
        "GPUs that reach each other (devices=[...]) or use EmulatedWorld on one GPU")


def gpu_shares(devices) -> list[GpuShare]:
    """The co-residency of ``devices`` (the GPU of each rank): one ``GpuShare`` per GPU, in
    the order of the ranks' first use of it, with the ranks it runs."""
    out = []
    for d in dict.fromkeys(devices):
        on = [r for r, x in enumerate(devices) if x == d]
        out.append(GpuShare(d, len(on), ranks_in_words(on), "put fewer ranks on it"))
    return out


class P2PWorld(RankWorld):
    """Rank ``r`` on GPU ``devices[r]`` (default: GPU ``r``), one process; the module
    docstring says how. ``dispatch(tokens, topk_ids)`` runs one round trip and returns, per
    rank, the same ``reference.RankResult`` as ``EmulatedWorld`` (and
    ``epgen.reference.dispatch``); ``fused``, ``timeout_ns`` and ``input_scale`` as there.

    Attributes: ``devices`` (the GPU of each rank), ``device_ids`` (the GPUs used, sorted),
    ``programs`` and ``errs`` (the ``Program`` and ``DiagBuffer`` of each GPU), ``pools``
    (each GPU's peer-accessible memory resource), ``device`` (rank 0's GPU) and ``program``
    (its program, for the IR module).

    ``backend="sim"`` runs it on simulated GPUs (``backends.sim``, as ``EmulatedWorld``
    does; ``sim_seed`` the interleaving), one per rank unless ``devices`` says otherwise.
    ``shrink`` and the rank masks (``ep_rank_mask``) as ``EmulatedWorld``'s: each rank's mask
    words in its GPU's peer-accessible pool, which its peers' kernels write."""

    def __init__(self, cfg, arch: str | None = None, devices=None,
                 timeout_ns: int | None = None, fused: bool | None = None,
                 input_scale: float = 1.0, backend="cuda", sim_seed: int | None = None,
                 shrink: bool = False):
        check_world_args("P2PWorld", timeout_ns=timeout_ns)
        check_devices(cfg.n_ranks, devices)
        self._init_common(cfg, fused, "P2PWorld", timeout_ns, input_scale, backend, sim_seed,
                          participants=cfg.n_ranks, n_gpus=sim_gpus(cfg, devices),
                          shrink=shrink)
        cuda = self.cuda
        self.devices = assign_devices(cfg.n_ranks, devices, cuda.device_count())
        self.device_ids = sorted(set(self.devices))
        check_peer_access(cfg, self.devices, cuda.can_access_peer)
        for a, b in peer_pairs(cfg, self.devices):
            cuda.enable_peer_access(a, b)
        self.rank_ids = list(range(cfg.n_ranks))
        self._load_dispatch(self.co_resident(build_module(cfg)), arch)
        peers = peers_of(cfg, self.devices)
        self.pools = {d: cuda.peer_memory_resource(d, peers[d]) for d in self.device_ids}
        self._allocate(self.devices)

    # -- placement -----------------------------------------------------------------------------
    def gpu_shares(self) -> list[GpuShare]:
        """Every GPU of ``devices`` with the ranks placed on it (``gpu_shares``)."""
        return gpu_shares(self.devices)

    def memory_of(self, device) -> dict:
        """The buffers peers write come from ``device``'s peer-accessible pool."""
        return {"peer_memory": self.pools[ordinal(device)]}

    # -- inputs ------------------------------------------------------------------------------------
    def load_inputs(self, tokens, topk_ids):
        """As ``RankWorld.load_inputs``, after checking that every device array given for a
        rank lives on that rank's GPU (nothing is copied otherwise)."""
        for r, x in enumerate(tokens if isinstance(tokens, (list, tuple)) else ()):
            if r < len(self.devices) and hasattr(x, "__cuda_array_interface__"):
                d = self.cuda.pointer_device(x)
                if d is not None and d != self.devices[r]:
                    raise ValueError(f"P2PWorld: tokens[{r}] is in the memory of GPU {d}, but "
                                     f"rank {r} runs on GPU {self.devices[r]}: pass each "
                                     f"rank's tokens on its own GPU (or as a host array)")
        super().load_inputs(tokens, topk_ids)
