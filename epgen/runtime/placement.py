"""The rules of where a world's ranks run, each in one place, for every world
(``EmulatedWorld``, ``P2PWorld``, ``ShmemWorld``) and both backends:

- **P2P groups** (``p2p_group``): which ranks a rank's pointer tables reach.
- **Co-residency** (``GpuShare``, ``co_resident``, ``residency_problems``): the blocks of
  every grid a GPU runs for one call must be resident at once, since the roles of a grid
  wait on each other and a grid waits on its peers' grids. ``co_resident`` asks ptxas for
  enough resident blocks per SM, ``residency_problems`` checks the driver's occupancy
  answer; a world raises ``CapacityError`` with the numbers.
- **Programs** (``RankPrograms``): an IR module loaded on every GPU that runs one of the
  world's ranks, lowered once per architecture.

The worlds' placement interface itself (what a rank's buffers, pointer tables, programs,
streams and checks are) is ``rank_world.RankWorld``'s documented public members.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

import ir

from .program import Program


class CapacityError(ValueError):
    """The ranks' grids cannot all be resident on their GPUs at once (their spin-waits could
    deadlock): the message names the parameters to change."""


class PeerAccessError(RuntimeError):
    """Two GPUs whose ranks share a P2P group cannot access each other's memory."""


def p2p_group(cfg, r: int) -> range:
    """The ranks of rank ``r``'s P2P group (``p2p_world_size`` consecutive ranks): the order
    of the entries of ``r``'s pointer tables (entry ``q % p2p_world_size`` is rank ``q``).
    Under ``skip_a2a`` a device reaches only itself, whatever ``p2p_world_size``: ``[r]``."""
    if cfg.skip_a2a:
        return range(r, r + 1)
    P = cfg.p2p_world_size
    return range((r // P) * P, (r // P) * P + P)


def ordinal(device) -> int:
    """The GPU ordinal of ``device`` (an ordinal, or a device object of either backend)."""
    return int(getattr(device, "device_id", device))


@attrs.frozen
class GpuShare:
    """The grids of one kernel that one GPU runs at once for a call: ``device`` (its
    ordinal), ``grids`` (how many ranks' grids), ``who`` (those ranks, in words, for the
    messages) and ``spread`` (how to put fewer of them on the GPU, in words; "" when the
    world cannot)."""

    device: int
    grids: int
    who: str
    spread: str = ""


def ranks_in_words(ranks) -> str:
    """``rank 3`` or ``3 ranks (0, 1, 2)``: a ``GpuShare.who`` of ranks known by id."""
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"{len(ranks)} ranks ({', '.join(map(str, ranks))})"


def blocks_per_sm_needed(cfg, shares, sm_count) -> int:
    """The resident blocks per SM the busiest GPU of ``shares`` needs: ``ceil(grids x n_sms /
    SMs)`` (``sm_count(device)``)."""
    return max(-(-s.grids * cfg.n_sms // sm_count(s.device)) for s in shares)


def co_resident(module, cfg, shares, sm_count):
    """``module`` with every kernel asking ptxas for ``blocks_per_sm_needed`` resident
    blocks per SM (``.minnctapersm``; it caps registers accordingly) when one per SM cannot
    hold the grids of the busiest GPU of ``shares``; otherwise ``module`` itself."""
    per_sm = blocks_per_sm_needed(cfg, shares, sm_count)
    if per_sm <= 1:
        return module
    return ir.Module(module.name, tuple(attrs.evolve(k, min_blocks_per_sm=per_sm)
                                        for k in module.kernels))


def residency_problems(cfg, shares, kernels, blocks_per_sm, sm_count) -> list[str]:
    """Why the grids cannot all be resident: for every GPU of ``shares`` and every kernel
    name of ``kernels``, ``grids x n_sms`` blocks must fit ``blocks_per_sm(kernel, device) x
    sm_count(device)``. One message per violation (empty: everything fits)."""
    out = []
    for s in shares:
        sms = sm_count(s.device)
        for name in kernels:
            per_sm = blocks_per_sm(name, s.device)
            capacity = per_sm * sms
            need = s.grids * cfg.n_sms
            if need <= capacity:
                continue
            fix = f"lower n_sms to at most {capacity // s.grids} or num_threads"
            if s.grids > 1 and s.spread:
                fix += f", or {s.spread}"
            out.append(f"GPU {s.device}: {s.who} x n_sms={cfg.n_sms} blocks of {name} need "
                       f"{need} co-resident blocks, but the GPU holds {capacity} ({per_sm} "
                       f"per SM x {sms} SMs at num_threads={cfg.num_threads}); {fix}")
    return out


class RankPrograms(Mapping):
    """An IR module loaded on GPUs, one ``Program`` per GPU ordinal (a read-only mapping),
    lowered once per architecture: ``devices`` (what each GPU is to the backend: an ordinal
    or a device object), ``arch_of(device)`` the architecture to lower for (None: the
    device's own), ``backend`` the world's backend. ``of(rk)`` is the program that launches
    rank ``rk``'s kernels (the one of ``rk.device``); ``first`` the first device's, whose
    ``module`` is the one every program loaded."""

    def __init__(self, module, devices, backend, arch_of=lambda device: None):
        self.module = module
        self.programs: dict[int, Program] = {}
        by_arch: dict = {}
        for device in devices:
            arch = arch_of(device)
            first = by_arch.get(arch) if arch is not None else None
            program = Program(module, arch=arch, device=device,
                              ptx=first.ptx if first is not None else None, backend=backend)
            self.programs.setdefault(ordinal(program.device), program)
            by_arch.setdefault(program.arch, program)
        self.first = next(iter(self.programs.values()))

    def of(self, rk) -> Program:
        """The program of rank ``rk``'s GPU."""
        return self.programs[ordinal(rk.device)]

    def blocks_per_sm(self, name: str, device, shmem: int = 0) -> int:
        """How many blocks of kernel ``name`` one SM of ``device`` holds at once (the
        driver's occupancy answer; ``shmem`` dynamic shared-memory bytes per block)."""
        return self.programs[ordinal(device)].blocks_per_sm(name, shmem)

    def __getitem__(self, device) -> Program:
        return self.programs[ordinal(device)]

    def __iter__(self):
        return iter(self.programs)

    def __len__(self) -> int:
        return len(self.programs)


__all__ = ["CapacityError", "PeerAccessError", "p2p_group", "ordinal", "GpuShare",
           "ranks_in_words", "blocks_per_sm_needed", "co_resident", "residency_problems",
           "RankPrograms"]
