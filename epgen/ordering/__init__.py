"""The ordering checker (``epgen check-ordering``): the protocol run under the simulator's
weak-memory mode (``backends.sim.weak``) against ``epgen.reference``, with each ordered
operation of its kernels weakened in turn.

- ``mutations`` -- the ordered operations of a kernel (stable ids) and their weakened forms
- ``runs``      -- the checked variants, their small configurations, one weak-memory run
- ``sweep``     -- the sweep over seeds and mutations, the excuses (``undetected.toml``),
  the table and the JSON

docs/ordering.md has the per-operation tables.
"""

from .sweep import Report, check, table, write_json

__all__ = ["Report", "check", "table", "write_json"]
