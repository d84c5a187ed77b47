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
