"""Which backend a world runs on: ``"cuda"`` (``backends.cuda``, a GPU) or ``"sim"``
(``backends.sim``: the kernels' IR interpreted on the CPU), and the size limit of the
simulator.

``resolve(backend, cfg, world, ...)`` returns the object a world uses where it would use the
``backends.cuda`` module: that module, or a ``backends.sim.Machine`` (made here for
``"sim"``, or passed in). A simulated world is refused, before anything is built, when its
configuration would take too long to interpret (``sim_work``, ``SIM_WORK_LIMIT``).
"""

from __future__ import annotations

from backends import cuda as cuda_backend
from backends import sim as sim_backend

BACKENDS = ("cuda", "sim")

#: ``sim_work`` of the ``small`` preset (2 ranks x 9 blocks x 256 threads, 32 tokens of
#: H=256, top-4): about 1.4 s per round trip on one core of a 2-core development machine
SMALL_PRESET_WORK = 8_704

#: the largest ``sim_work`` a simulated world accepts: about 34 x the ``small`` preset,
#: roughly half a minute and 1.5 GB per round trip (measured: 274,432 units, 540k threads,
#: took 26 s and 1.25 GB; docs/sim.md). The ``default`` preset (8 x 132 x 1024 threads, 128
#: tokens of H=7168, top-8) is 4,751,360.
SIM_WORK_LIMIT = 300_000


def sim_work(cfg, participants: int | None = None) -> int:
    """The work of one simulated round trip, in units that each cost the interpreter about
    75-95 us (measured: the cost grows about linearly in both terms): every thread of every
    participant's grid (``participants`` x ``n_sms`` x ``num_threads``), plus half of every
    16-byte vector of the token rows sent (``participants`` x ``max_tokens_per_rank`` x
    ``top_k`` x ``hid_dim`` / 8 vectors, each costing about half a thread)."""
    fmt = cfg.token_fmt
    n = cfg.n_ranks if participants is None else participants
    threads = n * cfg.n_sms * cfg.num_threads
    vectors = n * cfg.max_tokens_per_rank * fmt.top_k * fmt.hid_dim // 8
    return threads + vectors // 2


def check_sim_size(cfg, world: str, participants: int | None = None,
                   limit: int = SIM_WORK_LIMIT) -> None:
    """``ValueError`` naming the configuration's size when ``sim_work`` exceeds ``limit``."""
    fmt = cfg.token_fmt
    n = cfg.n_ranks if participants is None else participants
    work = sim_work(cfg, n)
    if work > limit:
        raise ValueError(
            f"{world}: backend='sim': this configuration is too large to simulate: "
            f"{n} ranks x n_sms={cfg.n_sms} x num_threads={cfg.num_threads} threads + "
            f"{n} x {cfg.max_tokens_per_rank} tokens x top_k={fmt.top_k} x "
            f"hid_dim={fmt.hid_dim} / 16 = {work:,} work units, over the simulator's "
            f"limit of {limit:,} (the small preset is {SMALL_PRESET_WORK:,}); lower n_sms, "
            f"num_threads, max_tokens_per_rank or hid_dim, or run on a GPU (backend='cuda')")


def resolve(backend, cfg, world: str, *, participants: int | None = None,
            sim_seed: int | None = None, n_gpus: int = 1):
    """The backend object of a world (module docstring). ``backend``: ``"cuda"``, ``"sim"``
    or a ``backends.sim.Machine``; ``sim_seed`` (the simulator's interleaving, an integer
    >= 0, default 0) only with ``"sim"``; ``n_gpus``: the GPUs of a machine made here."""
    if isinstance(backend, str):
        if backend not in BACKENDS:
            raise ValueError(f"{world}: backend must be one of {', '.join(map(repr, BACKENDS))}"
                             f" or a backends.sim.Machine, got {backend!r}")
        if backend == "cuda":
            if sim_seed is not None:
                raise ValueError(f"{world}: sim_seed={sim_seed!r} applies only with "
                                 f"backend='sim'")
            return cuda_backend
        if sim_seed is not None and (isinstance(sim_seed, bool)
                                     or not isinstance(sim_seed, int)):
            raise ValueError(f"{world}: sim_seed must be an integer, got {sim_seed!r}")
        if sim_seed is not None and sim_seed < 0:
            # random.Random(-s) is random.Random(s): a negative seed would repeat another's run
            raise ValueError(f"{world}: sim_seed must be >= 0, got {sim_seed}")
        check_sim_size(cfg, world, participants)
        return sim_backend.Machine(seed=0 if sim_seed is None else sim_seed, n_gpus=n_gpus)
    if not getattr(backend, "RUNS_IR", False):
        raise ValueError(f"{world}: backend must be one of {', '.join(map(repr, BACKENDS))} "
                         f"or a backends.sim.Machine, got {backend!r}")
    if sim_seed is not None:
        raise ValueError(f"{world}: sim_seed applies only with backend='sim' (a Machine "
                         f"passed in has its own seed)")
    check_sim_size(cfg, world, participants)
    return backend
