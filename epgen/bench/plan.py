"""What one benchmark run measures: a base configuration, the shapes (tokens per rank), the
variants (flag sets compared in the same run) and the measurement settings (``Plan``), and
the parsers of the option values that describe them (``parse_tokens``, ``parse_sweep``,
``parse_variant``). No device work here.

A variant is ``[LABEL=]SPEC``: ``SPEC`` is ``default`` (the configuration as given) or items
separated by commas, each a bool parameter's name (set to true, e.g. ``ep_final_layout``) or
``KEY:VALUE`` (``VALUE`` as ``epgen --set`` reads it, e.g. ``num_threads:1024`` or
``ep_ord_r:false``) for a key of ``VARIANT_KEYS``; ``LABEL`` names it in the table, the JSON
and the plot (default: ``SPEC``). Parameters that change the inputs or the buffers' sizing
(ranks, experts, the token format, tokens per rank, the block capacity) are the same for all
variants of a run: set them with ``--preset``/``--set`` and ``--block-capacity``; the one
exception is the format's ``alignment`` (message and header field padding: the same inputs,
each variant's own buffers), e.g. ``prod=ep_final_layout,ep_prod_reserve,alignment:16``.
The ``WORLD_KEYS`` choose how the world runs: ``fused``, ``graph``, ``batched`` (e.g.
``g=fused,graph``). ``tune.FIELD:VALUE`` sets a field of the base configuration's tuning
(``epgen.tuning.Tuning``, as ``--tune FIELD=VALUE`` does), e.g.
``w1=tune.send_warps_per_token_max:1``.
"""

from __future__ import annotations

import dataclasses

import attrs

from .. import combine_fp8
from ..config import BOOL_PARAMS, EPConfig
from ..presets import parse_value
from ..runtime.combine import check_supported
from ..tuning import TuningError, parse_tune
from .choices import ROUTINGS, WORLDS
from .combine import check_arm, extra_arms

SHAPE_NAMES = {128: "decode", 4096: "prefill"}
SMALL_SHAPE_TOKENS = 512
"""At most this many tokens per rank: decode-like default iteration counts."""
DEFAULT_VARIANT = "default"
WORLD_KEYS = ("fused", "graph", "batched")
"""Variant keys that choose how the world runs, not the configuration (``fused``: the single
launch ``ep_dispatch`` per rank instead of dispatch_async + dispatch_wait; ``batched``: every
rank's grid in one launch, ``EmulatedWorld(batched=True)``; ``graph``: the
round trip replayed as a captured CUDA graph, ``RoundTripGraph``, and timed as the round
trip only)."""
FORMAT_VARIANT_KEYS = ("alignment",)
"""Variant keys of the token format (``alignment:16``: the final layout's header rows grow
with the field alignment, and the H200 ran it faster at the reference's 16 than at the
``decode``/``prefill`` presets' 128, docs/PERF.md, step 12)."""
VARIANT_KEYS = ("num_threads", "n_sms", "timeout_ns") + BOOL_PARAMS + WORLD_KEYS \
    + FORMAT_VARIANT_KEYS
"""Parameters a variant may change."""
TUNE_PREFIX = "tune."
"""Variant keys ``tune.FIELD`` set a field of the configuration's tuning."""


def shape_name(tokens_per_rank: int) -> str:
    """``decode`` (128), ``prefill`` (4096), else ``T=<n>``."""
    return SHAPE_NAMES.get(int(tokens_per_rank), f"T={tokens_per_rank}")


def default_iters(tokens_per_rank: int) -> int:
    return 100 if tokens_per_rank <= SMALL_SHAPE_TOKENS else 20


def default_warmup(tokens_per_rank: int) -> int:
    return 10 if tokens_per_rank <= SMALL_SHAPE_TOKENS else 3


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text.strip()!r}") from None
    if n <= 0:
        raise ValueError(f"tokens per rank must be > 0, got {n}")
    return n


def parse_tokens(text: str) -> list[int]:
    """``"128,4096"`` -> ``[128, 4096]`` (``ValueError`` for a bad or non-positive count)."""
    out = [_count(p) for p in text.split(",") if p.strip()]
    if not out:
        raise ValueError("give at least one token count")
    return out


def parse_sweep(text: str) -> list[int]:
    """A geometric sweep ``LO,...,HI`` (doubling) or ``LO,NEXT,...,HI`` (ratio NEXT/LO, an
    integer >= 2): ``"32,64,...,4096"`` -> ``[32, 64, 128, ..., 4096]``; HI must lie on it."""
    parts = [p.strip() for p in text.split(",")]
    if parts.count("...") != 1 or parts[-2] != "..." or len(parts) not in (3, 4):
        raise ValueError(f"expected LO,...,HI or LO,NEXT,...,HI (e.g. 32,64,...,4096), "
                         f"got {text!r}")
    lo, hi = _count(parts[0]), _count(parts[-1])
    ratio = 2
    if len(parts) == 4:
        nxt = _count(parts[1])
        if nxt % lo or nxt // lo < 2:
            raise ValueError(f"NEXT must be an integer multiple >= 2 of LO, got {lo},{nxt}")
        ratio = nxt // lo
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * ratio)
    if out[-1] != hi:
        raise ValueError(f"{hi} is not on the sweep {lo} x {ratio}^n (... {out[-2]}, {out[-1]})")
    return out


def parse_p2p_sizes(text: str) -> tuple[int, ...]:
    """``"1,4"`` -> ``(1, 4)``: at least two distinct positive ``p2p_world_size`` values,
    sorted (``ValueError`` otherwise); the largest is the one the others are compared with."""
    try:
        sizes = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"expected p2p_world_size values like 1,4, got {text!r}") from None
    if len(sizes) < 2 or len(set(sizes)) != len(sizes) or min(sizes) <= 0:
        raise ValueError(f"expected at least two distinct positive p2p_world_size values "
                         f"(e.g. 1,4), got {text!r}")
    return tuple(sorted(sizes))


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named set of parameter overrides applied to the base configuration."""

    label: str
    spec: str
    overrides: tuple[tuple[str, object], ...] = ()

    @property
    def world_options(self) -> dict:
        """Keyword arguments for ``runner.measure_world`` (``WORLD_KEYS``)."""
        return {k: v for k, v in self.overrides if k in WORLD_KEYS}

    def describe(self) -> dict:
        return {"label": self.label, "spec": self.spec, "overrides": dict(self.overrides)}


def parse_variant(text: str) -> Variant:
    """``[LABEL=]SPEC`` (module docstring) -> ``Variant``; ``ValueError`` naming the bad item."""
    label, sep, spec = text.partition("=")
    if not sep:
        label, spec = text, text
    label, spec = label.strip(), spec.strip()
    if not label or not spec:
        raise ValueError(f"expected [LABEL=]SPEC, got {text!r}")
    if spec == DEFAULT_VARIANT:
        return Variant(label, spec)
    overrides = {}
    for item in (i.strip() for i in spec.split(",")):
        key, colon, value = item.partition(":")
        key = key.strip()
        if key.startswith(TUNE_PREFIX):
            if not colon:
                raise ValueError(f"{item!r}: {key} needs a value ({key}:VALUE)")
            if key in overrides:
                raise ValueError(f"{key} appears twice in {spec!r}")
            field = key[len(TUNE_PREFIX):]
            try:
                overrides[key] = getattr(parse_tune([f"{field}={value.strip()}"]), field)
            except TuningError as e:
                raise ValueError(f"{item!r}: {e}") from None
            continue
        if key not in VARIANT_KEYS:
            raise ValueError(f"{item!r}: a variant sets {', '.join(VARIANT_KEYS)} (a bool by "
                             f"its name, any of them as KEY:VALUE); set the others with --set")
        if not colon and key not in BOOL_PARAMS + WORLD_KEYS:
            raise ValueError(f"{item!r}: {key} needs a value ({key}:VALUE)")
        if key in overrides:
            raise ValueError(f"{key} appears twice in {spec!r}")
        if colon and key in WORLD_KEYS:
            overrides[key] = value.strip().lower() in ("1", "true", "yes", "on")
        else:
            overrides[key] = parse_value(key, value) if colon else True
    return Variant(label, spec, tuple(overrides.items()))


@dataclasses.dataclass(frozen=True)
class Plan:
    """One benchmark run: every shape of ``tokens`` with every variant, against the copy and
    the PyTorch baseline. ``iters``/``warmup`` None: by shape (``default_iters``,
    ``default_warmup``). ``block_capacity``: ``"fit"``, ``"full"`` or a number. ``world``:
    ``"emulated"`` (every rank on GPU ``device``) or ``"p2p"`` (one GPU per rank,
    ``devices`` or rank r on GPU r; against the peer copy and NCCL, ``epgen.bench.p2p``).
    ``op``: what is timed (``choices.OPS``: the dispatch round trip, the combine, or both,
    ``epgen.bench.combine``)."""

    base: EPConfig
    tokens: tuple[int, ...]
    variants: tuple[Variant, ...] = (Variant(DEFAULT_VARIANT, DEFAULT_VARIANT),)
    routing: str = "uniform"
    zipf_s: float = 0.8
    seed: int = 0
    sets: int = 3
    iters: int | None = None
    warmup: int | None = None
    block_capacity: str | int = "fit"
    copy_mib: int = 1024
    copy_iters: int = 20
    mem_fraction: float = 0.9
    device: int = 0
    check_rank: int = 0
    gate: bool = True
    baseline: bool = True
    post_check: bool = True
    arch: str | None = None
    world: str = "emulated"
    devices: tuple[int, ...] | None = None
    op: str = "dispatch"
    #: ``--combine-fp8`` (``op == "combine"``, emulated world): the FP8 combine timed after the
    #: BF16 one in the same run (``epgen.bench.combine``)
    combine_fp8: bool = False
    #: ``--combine-partial`` (``op == "combine"``, emulated world): the partial-reduce combine
    #: timed after the plain one in the same run, on each variant with ``ep_rank_dedup``
    #: (``epgen.bench.combine``; the others report why not)
    combine_partial: bool = False

    def iters_for(self, tokens_per_rank: int) -> int:
        return self.iters or default_iters(tokens_per_rank)

    def warmup_for(self, tokens_per_rank: int) -> int:
        return default_warmup(tokens_per_rank) if self.warmup is None else self.warmup

    def config(self, tokens_per_rank: int, variant: Variant | None = None,
               block_capacity: int | None = None) -> EPConfig:
        """The ``EPConfig`` of one shape and variant: ``max_tokens_per_rank`` is the shape's
        tokens per rank; ``block_capacity`` None (or >= T) is the reference sizing."""
        cap = None if block_capacity is None or block_capacity >= tokens_per_rank \
            else int(block_capacity)
        overrides = {k: v for k, v in (variant.overrides if variant is not None else ())
                     if k not in WORLD_KEYS}
        fmt_changes = {k: overrides.pop(k) for k in FORMAT_VARIANT_KEYS if k in overrides}
        if fmt_changes:
            overrides["token_fmt"] = attrs.evolve(self.base.token_fmt, **fmt_changes)
        tune = {k[len(TUNE_PREFIX):]: overrides.pop(k) for k in list(overrides)
                if k.startswith(TUNE_PREFIX)}
        if tune:
            overrides["tuning"] = self.base.tuning.replace(**tune)
        return self.base.replace(max_tokens_per_rank=tokens_per_rank, recv_block_capacity=cap,
                                 **overrides)

    def check_op(self, tokens_per_rank: int, variant: Variant) -> None:
        """``ValueError`` when ``op`` is a combine one and the combine kernels do not take
        this shape's and variant's configuration (``runtime.combine.check_supported``)."""
        if self.op != "dispatch":
            check_supported(self.config(tokens_per_rank, variant))

    def check_combine_fp8(self, tokens_per_rank: int, variant: Variant) -> None:
        """``ValueError`` naming ``hid_dim`` when the FP8 combine cannot run this variant."""
        combine_fp8.check_hid_dim(self.config(tokens_per_rank, variant).token_fmt.hid_dim,
                                  "--combine-fp8")

    def describe(self) -> dict:
        """Plain data (for the JSON)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["base"] = self.base.describe()
        out["tokens"] = list(self.tokens)
        out["variants"] = [v.describe() for v in self.variants]
        out["devices"] = list(self.devices) if self.devices is not None else None
        return out


SHMEM_ITERS, SHMEM_WARMUP = 50, 5
"""The SHMEM benchmark's default timed and untimed calls per figure."""


@dataclasses.dataclass(frozen=True)
class ShmemPlan:
    """One ``epgen bench --world shmem`` run (``epgen.bench.shmem``), the same on every PE:
    ``op`` (``choices.OPS``) at every shape of ``tokens`` (tokens per rank) on one world
    per ``p2p_world_size`` of ``p2p_sizes`` (None: the base configuration's alone), each
    figure the median of ``iters`` calls after ``warmup``; ``check``: each world's first
    call of each shape against the reference (and the combine's last timed call)."""

    base: EPConfig
    tokens: tuple[int, ...]
    op: str = "dispatch"
    p2p_sizes: tuple[int, ...] | None = None
    iters: int = SHMEM_ITERS
    warmup: int = SHMEM_WARMUP
    seed: int = 0
    check: bool = True
    arch: str | None = None
    #: ``--combine-fp8`` / ``--combine-partial`` (``op == "combine"``): the FP8 /
    #: partial-reduce combine timed after the plain one on each world
    combine_fp8: bool = False
    combine_partial: bool = False
    #: ``--copy-rate``: after each shape on the world of the smallest ``p2p_world_size``,
    #: the bare copy of that shape's dispatch bytes by stores and by puts
    #: (``bench.copy_rate``)
    copy_rate: bool = False

    @property
    def arms(self) -> tuple:
        """The extra combines timed after the plain one (``combine.CombineArm``)."""
        return extra_arms(self.combine_fp8, self.combine_partial)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The ``p2p_world_size`` of each world, in the order they run."""
        return self.p2p_sizes or (self.base.p2p_world_size,)

    @property
    def reference_size(self) -> int:
        """The ``p2p_world_size`` the others are compared with: the largest."""
        return max(self.sizes)

    def config(self, p2p_world_size: int) -> EPConfig:
        """The world of ``p2p_world_size``: sized for the largest shape (one world serves
        every shape: NVSHMEM initialises once per process)."""
        return self.base.replace(p2p_world_size=p2p_world_size, max_tokens_per_rank=max(
            [*self.tokens, self.base.max_tokens_per_rank]))

    def check_op(self, p2p_world_size: int) -> None:
        """``ValueError`` when ``op`` is a combine one and the combine kernels do not take
        the world of ``p2p_world_size`` (``runtime.combine.check_supported``), or an extra
        combine does not (``combine.check_arm``, naming its option)."""
        if self.op != "dispatch":
            check_supported(self.config(p2p_world_size))
        for arm in self.arms:
            try:
                check_arm(self.config(p2p_world_size), arm)
            except ValueError as exc:
                raise ValueError(f"{arm.option}: {exc}") from None

    def describe(self) -> dict:
        """Plain data (for the JSON)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["base"] = self.base.describe()
        out["tokens"] = list(self.tokens)
        out["p2p_sizes"] = list(self.sizes)
        return out
