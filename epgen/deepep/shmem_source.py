"""Where a process-group ``Buffer``'s ports come from: one ``ShmemWorld`` per (shape,
result slot) of this process's rank, all on one ``ShmemSession`` (one NVSHMEM
initialisation, bootstrapped through the group: ``bootstrap.from_group``).

- **The group** is used for the rank, the size, the NVSHMEM unique-id exchange and the host
  barriers of world creation and close; any backend works (gloo, NCCL). Several ranks on
  one GPU cannot share an NCCL group: give them a gloo one.
- **The GPU** is the current CUDA device when the buffer is made (engines set it first).
- **Transport**: the ranks of one P2P group (``p2p_world_size`` consecutive ranks, default
  ``LOCAL_WORLD_SIZE`` when it divides the group size, else the whole group) store directly
  into each other's buffers (``nvshmem_ptr``); the others would get NVSHMEM puts. DeepEP's
  receive layout is epgen's final layout, which the put path does not take yet
  (``config.SHMEM_EXCLUSIVE``), so for now the whole group must be one P2P group (one
  node, or ranks sharing GPUs): a smaller ``p2p_world_size``, or DeepEP's
  ``allow_nvlink_for_low_latency_mode=False`` (every peer by puts), is refused by name.
- **Worlds** (low-latency, ``port``, and normal-mode, ``normal_port``: DeepEP's
  ``dispatch`` and ``combine`` on ``ep_rank_dedup``) are made on the first call of each
  shape, collectively (every rank calls with
  the same shapes in the same order, as DeepEP requires); ``close`` closes them and the
  session.
"""

from __future__ import annotations

import os

from backends.cuda import sm_count

from ..config import SHMEM_EXCLUSIVE
from ..errors import EPInputError
from ..runtime import bootstrap
from ..runtime.shmem_session import ShmemSession, default_barrier_timeout
from ..runtime.shmem_world import ShmemWorld
from . import normal
from .ports import DevicePort


def default_p2p_world_size(size: int) -> int:
    """``LOCAL_WORLD_SIZE`` when set and a divisor of ``size``, else ``size``."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
    return local if local and size % local == 0 else size


class ShmemSource:
    """This process's rank of ``group`` (module docstring)."""

    on_cuda = True

    def __init__(self, group, *, n_sms: int | None, num_threads: int | None,
                 timeout_ns: int | None, allow_nvlink: bool = True,
                 p2p_world_size: int | None = None, barrier_timeout_s: float | None = None,
                 shrink: bool = False):
        import torch

        self.rank, self.size = group.rank(), group.size()
        if p2p_world_size is None:
            p2p_world_size = default_p2p_world_size(self.size) if allow_nvlink else 1
        if p2p_world_size < 1 or self.size % p2p_world_size:
            raise EPInputError(f"p2p_world_size: {p2p_world_size} must divide the group size "
                               f"({self.size})")
        if p2p_world_size < self.size:
            why = ("allow_nvlink_for_low_latency_mode=False" if not allow_nvlink
                   else f"p2p_world_size={p2p_world_size}")
            raise EPInputError(
                f"{why}: every rank of the group must be in one P2P group ({self.size} ranks): "
                f"DeepEP's receive layout is epgen's final layout, which the NVSHMEM put path "
                f"does not take yet ({SHMEM_EXCLUSIVE['ep_final_layout']})")
        self.p2p_world_size = p2p_world_size
        self.n_sms, self.num_threads, self.timeout_ns = n_sms, num_threads, timeout_ns
        timeout = barrier_timeout_s or default_barrier_timeout()
        self.session = ShmemSession(bootstrap=bootstrap.from_group(group, timeout_s=timeout),
                                    device=torch.cuda.current_device(),
                                    barrier_timeout_s=timeout)
        self.ports = {}
        #: shrink mode (DeepEP's ``enable_shrink``): the low-latency worlds have rank masks
        #: (``ep_rank_mask``, ``shrink=True``); ``masked``: the ranks this rank's buffer masked
        self.shrink, self.masked = bool(shrink), set()

    def port(self, torch, shape, slot: int) -> DevicePort:
        key = (shape, slot)
        port = self.ports.get(key)
        if port is None:
            P = self.p2p_world_size
            cfg = shape.config(n_sms=self.n_sms, num_threads=self.num_threads,
                               p2p_world_size=P, use_shmem=P < self.size,
                               rank_mask=self.shrink)
            world = ShmemWorld(cfg, rank=self.rank, session=self.session,
                               timeout_ns=self.timeout_ns, fused=False, shrink=self.shrink)
            for q in sorted(self.masked):        # a new world starts with this rank's mask
                world.update_mask(q, True)
            port = self.ports[key] = DevicePort(torch, world, self.rank)
        return port

    # -- shrink mode: this rank's mask over every low-latency world -------------------------
    def _mask_worlds(self) -> list:
        return [p.world for key, p in self.ports.items() if key[0] != "normal"]

    @staticmethod
    def _drain() -> None:
        """Wait for this rank's work on the current stream (the mask words are read and
        written from the host)."""
        import torch

        torch.cuda.current_stream().synchronize()

    def update_mask(self, q: int, masked: bool) -> None:
        """Mask (``masked``) or unmask rank ``q`` in this rank's view of every low-latency
        world, now and in the worlds made later (each ``ShmemWorld.update_mask``, after this
        rank's work on the current stream)."""
        self._drain()
        for world in self._mask_worlds():
            world.update_mask(q, masked)
        (self.masked.add if masked else self.masked.discard)(q)

    def masked_ranks(self) -> set[int]:
        """The ranks this rank masks: those its buffer masked and those its worlds' kernels
        masked when a wait for them expired (each world's view, read: synchronises)."""
        self._drain()
        out = set(self.masked)
        for world in self._mask_worlds():
            out |= {int(q) for q in world.query_mask(self.rank).nonzero()[0]}
        return out

    def clean_mask(self) -> None:
        """Unmask every rank in every low-latency world's view of this rank."""
        self._drain()
        for world in self._mask_worlds():
            world.clean_mask()
        self.masked.clear()

    def normal_port(self, torch, shape, slot: int):
        """This rank's port of the normal-mode world of ``shape`` (a ``normal.NormalShape``)
        for result slot ``slot``: a ``ShmemWorld`` of the shape's configuration (one P2P
        group, ``ep_rank_dedup``), made collectively on first use like the low-latency
        worlds (``normal.device_port``)."""
        key = ("normal", shape, slot)
        port = self.ports.get(key)
        if port is None:
            n_sms = self.n_sms
            if n_sms is None:           # this GPU's SMs shared by its PEs, two blocks each
                n_sms = max(1, 2 * sm_count(self.session.device_id) // self.session.sharers)
            n_sms, threads = shape.grid(n_sms, self.num_threads, sim=False)
            world = ShmemWorld(shape.config(n_sms, threads), rank=self.rank,
                               session=self.session, timeout_ns=self.timeout_ns, fused=False)
            port = self.ports[key] = normal.device_port(torch, world, self.rank)
        return port

    def close(self) -> None:
        """Close every world, then the session (collective; idempotent)."""
        self.ports.clear()
        self.session.close()


__all__ = ["ShmemSource", "default_p2p_world_size"]
