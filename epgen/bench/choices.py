"""The fixed choices of a benchmark run's options, apart from ``plan`` so that building the
command line (``options.add_arguments``, every ``epgen`` start, ``epgen --help`` included)
does not import the configuration, the token formats and their numeric libraries."""

from __future__ import annotations

ROUTINGS = ("uniform", "zipf")
WORLDS = ("emulated", "p2p", "shmem")
OPS = ("dispatch", "combine", "moe")
"""What ``epgen bench --op`` times: the dispatch round trip (the default), the combine alone
(after an untimed dispatch), or dispatch + combine back to back (``moe``)."""
