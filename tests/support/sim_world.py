"""The real ``epgen.EmulatedWorld`` on the CPU for the simulator tests: a world on a
``backends.sim.Machine``, the simulator knobs the tests need (``max_spins``, ``timeouts``)
passed through.

    with sim_world(cfg, seed) as world:
        got = world.dispatch(tokens, topk_ids)

``world.sim`` is the interpreter, ``world.cuda`` the machine, ``world.program.loaded.launched``
the (kernel, programmatic) of every launch.
"""

from __future__ import annotations

import contextlib

from backends import sim as sim_backend
from epgen.runtime import world as world_mod


@contextlib.contextmanager
def sim_world(cfg, seed: int = 0, max_spins: int = 20000, timeouts: bool = False,
              **world_kwargs):
    """An ``EmulatedWorld`` of ``cfg`` on ``backends.sim.Machine(seed)``."""
    machine = sim_backend.Machine(seed, max_spins=max_spins, timeouts=timeouts)
    world = world_mod.EmulatedWorld(cfg, backend=machine, **world_kwargs)
    world.sim = machine.sim
    yield world


def launch_wait_with_l1(world, prog, kernel, n_counters: int) -> list:
    """After ``world.dispatch_async()``: launch ``kernel`` (a dispatch_wait built with L1
    releases, in ``prog``) on every rank's stream with the world's wait arguments and a
    fresh zeroed u32 counter array of ``n_counters`` (``l1_arrival_ptr``), each rank's
    ``wait_done`` recorded after it; then synchronise. Returns the counters, rank order."""
    import numpy as np
    counters = []
    for rk in world.ranks:
        counters.append(world.cuda.zeros(n_counters, np.uint32, device=world.device,
                                         stream=rk.stream))
        prog.launch(kernel.name, world.cfg.n_sms, {**world.wait_args(rk),
                                                   "l1_arrival_ptr": counters[-1]}, rk.stream)
        rk.wait_done = rk.stream.record()
    world.synchronize()
    return counters

