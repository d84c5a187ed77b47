"""``Tuning``: the code-generation choices that change the generated code but not its meaning.

One frozen object travels with the configuration (``EPConfig.tuning``) to every builder, so
two builds with different choices can live side by side in one process (a test, an A/B
benchmark) and nothing flips module globals. Each field is typed, validated and documented
here; the CLI sets them with ``--tune KEY=VALUE`` (``ptx``, ``inspect``, ``run``, ``bench``)
and the benchmark JSON records them with the configuration.

Choices that were settled by measurement keep only their winning arm in the code; what the
other arm measured is a line of the tuning table in ``docs/PERF.md``. A field stays here only
while switching it is still worth something (a geometry, a format or a launch form where the
best value differs, or instrumentation).
"""

from __future__ import annotations

import attrs


class TuningError(ValueError):
    """An invalid ``Tuning`` value or ``--tune`` argument (names the field and the rule)."""


def _positive(inst, attribute, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TuningError(f"tuning.{attribute.name}: must be a positive integer, got {value!r}")


def _non_negative(inst, attribute, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TuningError(f"tuning.{attribute.name}: must be an integer >= 0, got {value!r}")


def _power_of_two(inst, attribute, value):
    _positive(inst, attribute, value)
    if value & (value - 1):
        raise TuningError(f"tuning.{attribute.name}: must be a power of two, got {value}")


def _bool(inst, attribute, value):
    if not isinstance(value, bool):
        raise TuningError(f"tuning.{attribute.name}: must be a bool, got {value!r}")


@attrs.frozen(kw_only=True)
class Tuning:
    """Code-generation choices of the dispatch kernels (defaults: the measured best on the
    H200). Equal tunings build byte-identical code; the PTX goldens pin the defaults."""

    #: warp send path: the most warps that share one token when the sending warps outnumber
    #: a call's tokens (decode); 1 is one warp per token
    send_warps_per_token_max: int = attrs.field(default=4, validator=_power_of_two)
    #: warp send path: the most token groups (each with its own named barrier) per block
    max_token_groups: int = attrs.field(default=4, validator=_positive)
    #: staged variants take the block-staged broadcast instead of the warp send path when a
    #: full call gives every block at least this many tokens (prefill-sized calls)
    block_broadcast_min_tokens_per_block: int = attrs.field(default=16, validator=_positive)
    #: quantising formats, warp send path: 16-byte input items each lane loads before
    #: quantising them
    quant_items_in_flight: int = attrs.field(default=2, validator=_positive)
    #: quantising formats, warp send path: preferred payload bytes each warp stages in shared
    #: memory before its wide stores to the destinations (0: no staging)
    quant_stage_bytes: int = attrs.field(default=2048, validator=_non_negative)
    #: combine reduce (every form: BF16, FP8, partial, unreduced): the most warps that share
    #: one token's row when the grid's warps outnumber a call's tokens (decode), each taking
    #: every ``n``-th of the row's 16-byte chunks; 1 is one warp per token. 8 measured at
    #: decode on an H100: BF16 combine 221.9 -> 196.0 us, FP8 325.0 -> 270.9 us against 1
    #: (docs/PERF.md, "Adoption figures"); at prefill the tokens outnumber the warps and
    #: every token keeps one warp
    reduce_warps_per_token_max: int = attrs.field(default=8, validator=_power_of_two)
    #: combine send over P2P, the BF16 copy: the most warps that share one returned row,
    #: each taking every ``n``-th 32-lane slice of it, on a block with fewer rows than the
    #: warps on it (the others keep one warp a row); 1 is one warp per row, and under the
    #: SHMEM transport it is always 1 (a remote row is one put-with-signal). 4 measured at
    #: decode on an H100 against 1: the BF16 combine 221.9 -> 242.2 us (docs/PERF.md,
    #: "Adoption figures"), so 1 stays the default
    combine_send_warps_per_row: int = attrs.field(default=1, validator=_power_of_two)
    #: the same for the sends that compute per byte: the FP8 combine's quantise and the
    #: partial-reduce combine's destination sum. 4 measured on an H100 against 1, one run:
    #: at decode FP8 274.5 -> 239.7 us, partial 415.7 -> 282.3 us; at prefill the pairs have
    #: more rows than warps and keep one warp a row (FP8 3187.3 -> 3183.6 us; docs/PERF.md,
    #: "The send split per wire")
    combine_fp8_partial_send_warps_per_row: int = attrs.field(default=4,
                                                             validator=_power_of_two)
    #: final layout with transposed scales: rows per tile of dispatch_wait's header-pass
    #: scale copy
    scale_chunk_rows: int = attrs.field(default=128, validator=_power_of_two)
    #: record ``%globaltimer`` events in per-block trace rings at every role's begin, end and
    #: hand-offs (an extra kernel parameter ``trace_buf``: ``epgen.kernels.trace``); off, the
    #: PTX is that of a build without tracing and the other ``trace_*`` fields change nothing
    trace: bool = attrs.field(default=False, validator=_bool)
    #: with ``trace``: trace rings per block (the roles of a block spread their claims over
    #: them)
    trace_rings_per_cta: int = attrs.field(default=1, validator=_positive)
    #: with ``trace``: events one ring keeps per call (later ones are counted as dropped)
    trace_ring_capacity: int = attrs.field(default=512, validator=_positive)
    #: with ``trace``: also stamp each L1 release of a copy role that emits them
    trace_scatter_release: bool = attrs.field(default=True, validator=_bool)
    #: time every wait for another rank's data (``%globaltimer`` ns, an extra kernel
    #: parameter ``wait_time``: ``epgen.kernels.wait_time``): dispatch_wait's wait for each
    #: count word, combine_wait's for each arrival word, per source rank (what DeepEP's
    #: ``*_wait_recv_cost_stats`` report); off, the PTX is that of a build without it
    wait_times: bool = attrs.field(default=False, validator=_bool)

    def replace(self, **changes) -> Tuning:
        """A copy with ``changes`` applied (validated again)."""
        unknown = sorted(set(changes) - set(field_names()))
        if unknown:
            raise TuningError(f"unknown tuning field(s) {', '.join(unknown)} (known: "
                              f"{', '.join(field_names())})")
        return attrs.evolve(self, **changes)

    def describe(self) -> dict:
        """Every field as plain data (bench JSON, ``inspect``)."""
        return attrs.asdict(self)

    def changed(self) -> dict:
        """The fields that differ from the defaults."""
        default = Tuning()
        return {k: v for k, v in self.describe().items() if getattr(default, k) != v}


def field_names() -> tuple[str, ...]:
    """The names of ``Tuning``'s fields, in declaration order."""
    return tuple(f.name for f in attrs.fields(Tuning))


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_tune(items, base: Tuning | None = None) -> Tuning:
    """``base`` (default ``Tuning()``) with ``KEY=VALUE`` strings applied, typed by the field
    (``--tune send_warps_per_token_max=2 --tune trace=true``)."""
    changes = {}
    fields = attrs.fields_dict(Tuning)
    for item in items:
        key, sep, text = str(item).partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key:
            raise TuningError(f"--tune takes KEY=VALUE, got {item!r}")
        if key not in fields:
            raise TuningError(f"tuning.{key}: unknown field (known: {', '.join(field_names())})")
        if fields[key].type in (bool, "bool"):
            if text.lower() not in _TRUE + _FALSE:
                raise TuningError(f"tuning.{key}: must be true or false, got {text!r}")
            changes[key] = text.lower() in _TRUE
        else:
            try:
                changes[key] = int(text, 0)
            except ValueError:
                raise TuningError(f"tuning.{key}: must be an integer, got {text!r}") from None
    return (base or Tuning()).replace(**changes)


def tuning_from_dict(d: dict) -> Tuning:
    """A ``Tuning`` from ``Tuning.describe()``'s table (unknown keys refused)."""
    if isinstance(d, Tuning):
        return d
    if not isinstance(d, dict):
        raise TuningError(f"tuning: must be a table of field = value, got {d!r}")
    return Tuning().replace(**d)


__all__ = ["Tuning", "TuningError", "field_names", "parse_tune", "tuning_from_dict"]
