"""The variant matrix: every combination of ``EPConfig``'s boolean flags.

``MATRIX_FLAGS`` are the boolean parameters except ``use_shmem`` (always ``False`` here: the
base preset's destinations are all in one P2P group, where it changes nothing, and
``skip_a2a`` excludes it; the SHMEM variants are ``epgen.ep_goldens.SHMEM_VARIANTS``). Each of the ``2**8``
combinations is built on the ``small`` preset (``BASE_PRESET``) with a base derived per
combination, so that every combination ``EPConfig`` accepts is reachable:

- a flag whose single-flag golden variant (``epgen.ep_goldens.FLAG_VARIANTS``) changes
  non-flag parameters brings those changes along (``FLAG_BASE``): ``skip_a2a`` is built per
  device (``n_ranks = 1``, ``p2p_world_size = 1``, ``n_experts`` = the device's 8 experts),
  ``ep_copy_role_split`` on the geometry that enables the split (384 threads, H = 6144;
  otherwise the flag would build the stock kernels);
- the flags are then set as the combination says, and ``use_shmem = False``.

A combination is *legal* when ``EPConfig`` accepts it (``Combination.config``) and *illegal*
when it raises (``Combination.error``, an ``EPConfigError`` naming the conflicting flags).
``tests/ptx/test_variant_matrix.py`` builds, verifies, checks and assembles every legal one and
checks every illegal one's message; ``epgen variants --matrix`` lists them all.

Each combination also says whether the combine kernels build for it
(``Combination.combine_error``: ``runtime.combine.check_supported``'s reason, None when they
build); ``variant_config`` gives the configuration of a named variant, so ``epgen variants``
can say the same of each.

A new flag (a new ``BOOL_PARAMS`` entry) joins the matrix without a change here;
docs/extending.md says what else it touches.
"""

from __future__ import annotations

import functools
import itertools
from typing import Iterable

import attrs

from .config import BOOL_PARAMS, EPConfig, EPConfigError
from .formats import make_format
from .runtime.combine import check_supported

BASE_PRESET = "small"
"""The preset every combination starts from."""

MATRIX_FLAGS: tuple[str, ...] = tuple(name for name in BOOL_PARAMS if name != "use_shmem")
"""The flags the matrix combines (every boolean ``EPConfig`` parameter but ``use_shmem``)."""

FIXED = {"use_shmem": False}
"""Parameters every combination sets."""


def _flag_base() -> dict[str, dict]:
    """``flag -> non-flag parameter changes`` taken from the flag's single-flag golden variant
    (a ``FLAG_VARIANTS`` entry built on ``BASE_PRESET`` that sets exactly that one flag)."""
    from .ep_goldens import FLAG_VARIANTS

    out: dict[str, dict] = {}
    for name, (preset, changes) in FLAG_VARIANTS.items():
        flags = [k for k, v in changes.items() if k in BOOL_PARAMS and v is True]
        # a token format is not geometry: a variant in another format is not the flag's base
        geometry = {k: v for k, v in changes.items() if k not in BOOL_PARAMS and k != "format"}
        if preset != BASE_PRESET or len(flags) != 1 or not geometry:
            continue
        if flags[0] in out and out[flags[0]] != geometry:
            raise ValueError(f"FLAG_VARIANTS: two single-flag variants of {flags[0]} change "
                             f"the base differently ({out[flags[0]]} and {geometry}, {name})")
        out[flags[0]] = geometry
    return out


FLAG_BASE: dict[str, dict] = _flag_base()
"""``flag -> parameter changes`` a combination with that flag is built on."""


def base_changes(flags: Iterable[str]) -> dict:
    """The non-flag parameter changes (on ``BASE_PRESET``) of a combination that sets
    ``flags``; ``ValueError`` when two flags ask for different values of one parameter."""
    out: dict = {}
    for flag in flags:
        for key, value in FLAG_BASE.get(flag, {}).items():
            if key in out and out[key] != value:
                raise ValueError(f"the bases of the flags disagree on {key}: {out[key]!r} and "
                                 f"{value!r} ({flag})")
            out[key] = value
    return out


def _text(value) -> str:
    """``value`` as ``epgen --set`` reads it."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


@attrs.frozen(eq=False)
class Combination:
    """One combination of ``MATRIX_FLAGS``: ``flags`` (those set, in ``MATRIX_FLAGS`` order),
    ``changes`` (every parameter changed on ``BASE_PRESET``: the base, then every matrix flag
    and ``FIXED``), and either ``config`` (legal) or ``error`` (illegal)."""

    flags: tuple[str, ...]
    changes: dict
    config: EPConfig | None
    error: EPConfigError | None

    @property
    def legal(self) -> bool:
        return self.config is not None

    @property
    def name(self) -> str:
        """``flag+flag+...`` of the flags set, ``stock`` for none."""
        return "+".join(self.flags) or "stock"

    @property
    def combine_error(self) -> str | None:
        """Why the combine kernels do not build for this combination (None: they build; an
        illegal combination: its configuration error)."""
        return combine_error(self.config) if self.legal else str(self.error)

    def set_changes(self) -> dict:
        """The changes that differ from ``BASE_PRESET`` (what ``--set`` must say)."""
        from .presets import preset_data
        base = preset_data(BASE_PRESET)
        return {k: v for k, v in self.changes.items()
                if base.get(k, _default(k)) != v}

    def cli_args(self) -> list[str]:
        """``epgen ptx`` / ``inspect`` / ``run`` arguments that select this combination."""
        args = ["--preset", BASE_PRESET]
        for key, value in self.set_changes().items():
            args += ["--set", f"{key}={_text(value)}"]
        return args


def combine_error(cfg) -> str | None:
    """None when the combine kernels build for ``cfg``, else why not
    (``runtime.combine.check_supported``'s message, without its prefix)."""
    try:
        check_supported(cfg)
    except ValueError as e:
        return str(e).split(": ", 2)[-1]
    return None


def variant_config(name: str) -> EPConfig | None:
    """The ``EPConfig`` a registered golden variant is built from (``ep/<preset>``, the
    format, flag and tuning variants, ``ep/fused``, ``ep/fused_se``, ``ep/skip_a2a_global``,
    ``ep/rank_dedup_tokens``, ``ep/rank_dedup_combine_tokens``, every ``combine/`` variant,
    its FP8 twin ``combine/<name>_fp8`` and the partial-reduce ones); None for the others
    (the demos, the id checks, the test kernels
    ``ep/fused_roles`` and ``ep/sm_remap*``)."""
    from . import ep_goldens as eg
    from .presets import config_from_dict, load_preset, preset_data

    group, _, rest = name.partition("/")
    if group == "combine" and rest.endswith("_fp8"):   # the FP8 twin of a combine golden
        base = rest[:-len("_fp8")]
        if base in eg.GOLDEN_PRESETS or base in eg.COMBINE_VARIANTS:
            return variant_config(f"combine/{base}")
    if group == "combine" and rest in eg.COMBINE_PARTIAL_VARIANTS:
        return config_from_dict({**preset_data("small"), **eg.COMBINE_PARTIAL_VARIANTS[rest]})
    if group == "combine" and rest in eg.GOLDEN_PRESETS:
        return load_preset(rest)
    if group == "combine" and rest in eg.COMBINE_VARIANTS:
        return config_from_dict({**preset_data("small"), **eg.COMBINE_VARIANTS[rest][0]})
    if group != "ep":
        return None
    if rest in eg.GOLDEN_PRESETS:
        return load_preset(rest)
    for preset, suffix, fmt in eg.GOLDEN_FORMATS:
        if rest == f"{preset}_{suffix}":
            cfg = load_preset(preset)
            f = cfg.token_fmt
            return cfg.replace(token_fmt=make_format(fmt, f.hid_dim, f.top_k,
                                                     alignment=f.alignment))
    if rest in eg.FLAG_VARIANTS or rest in eg.SHMEM_VARIANTS:
        return eg.flag_variant_config(rest)
    if rest in eg.TUNING_VARIANTS:
        return eg.tuning_variant_config(rest)
    if rest == "fused":
        return load_preset("small")
    if rest == "fused_se":
        return load_preset("small").replace(fused_shared_expert=True)
    if rest == "skip_a2a_global":
        return load_preset("small").replace(skip_a2a=True)
    if rest in ("rank_dedup_tokens", "rank_dedup_combine_tokens"):
        return eg.flag_variant_config("rank_dedup")
    return None


def _default(name: str):
    for f in attrs.fields(EPConfig):
        if f.name == name:
            return f.default
    return None


def combination(flags: Iterable[str]) -> Combination:
    """The combination that sets exactly ``flags`` (names from ``MATRIX_FLAGS``)."""
    from .presets import config_from_dict, preset_data, with_overrides

    flags = set(flags)
    unknown = flags - set(MATRIX_FLAGS)
    if unknown:
        raise ValueError(f"not matrix flags: {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(MATRIX_FLAGS)})")
    ordered = tuple(f for f in MATRIX_FLAGS if f in flags)
    changes = {**base_changes(ordered), **{f: f in flags for f in MATRIX_FLAGS}, **FIXED}
    table = with_overrides(preset_data(BASE_PRESET), changes)
    try:
        return Combination(ordered, changes, config_from_dict(table), None)
    except EPConfigError as e:
        return Combination(ordered, changes, None, e)


@functools.lru_cache(maxsize=None)
def combinations() -> tuple[Combination, ...]:
    """All ``2 ** len(MATRIX_FLAGS)`` combinations: none set first, then by the binary count
    over ``MATRIX_FLAGS`` (the first flag the lowest bit)."""
    out = []
    for bits in itertools.product((False, True), repeat=len(MATRIX_FLAGS)):
        flags = [f for f, on in zip(MATRIX_FLAGS, reversed(bits)) if on]
        out.append(combination(flags))
    return tuple(out)


def legal() -> tuple[Combination, ...]:
    """The combinations ``EPConfig`` accepts."""
    return tuple(c for c in combinations() if c.legal)


def illegal() -> tuple[Combination, ...]:
    """The combinations ``EPConfig`` rejects."""
    return tuple(c for c in combinations() if not c.legal)


def violated_flags(c: Combination) -> list[tuple[str, ...]]:
    """The parameters each violated rule of an illegal combination names."""
    return [] if c.error is None else [tuple(p) for p, _ in c.error.violations]
