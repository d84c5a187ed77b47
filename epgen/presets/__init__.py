"""Built-in configurations as data files: ``epgen/presets/<name>.toml``.

A preset is a flat table: every ``EPConfig`` parameter by name (omitted ones take their
default), the token format as ``format = "BF16"`` with ``hid_dim``, ``top_k`` and optionally
``alignment``, and a free-text ``description``::

    num_threads = 1024
    n_sms = 132
    ...
    use_shmem = false
    format = "BF16"
    hid_dim = 7168
    top_k = 8

``config_from_dict`` builds an ``EPConfig`` from such a table (or from ``cfg.describe()``,
whose ``token_fmt`` is a nested table); a nested ``[tuning]`` table sets ``EPConfig.tuning``
(``epgen.Tuning``'s fields); ``config_to_dict`` is its inverse; ``parse_value``
turns the text of ``epgen --set key=value`` into the value the table holds.
"""

from __future__ import annotations

import importlib.resources

import attrs

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (a dependency there)
    import tomli as tomllib

from ..config import BOOL_PARAMS, EPConfig, EPConfigError
from ..formats import TokenFormat, format_class

FORMAT_KEYS = ("format", "hid_dim", "top_k", "alignment")
"""Keys of a flat table that describe the token format."""
NESTED_PARAMS = ("token_fmt", "tuning")
"""``EPConfig`` fields that are objects (a nested table in ``describe()``), not flat keys."""
META_KEYS = ("description", "format_alignment")
"""Keys of a preset file that are not parameters (``format_alignment``: the alignment a
``--set format=`` takes for each named format, ``with_overrides``)."""
_FORMAT_INT_KEYS = ("hid_dim", "top_k", "alignment")
_NONE = object()
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class PresetError(ValueError):
    """An unknown preset, or a preset file that cannot be read."""


def config_params() -> tuple[str, ...]:
    """Every key a flat table may hold: the ``EPConfig`` parameters other than ``token_fmt``,
    then ``FORMAT_KEYS``."""
    fields = tuple(f.name for f in attrs.fields(EPConfig) if f.name not in NESTED_PARAMS)
    return fields + FORMAT_KEYS


def preset_names() -> list[str]:
    """Names of the built-in presets, sorted."""
    return sorted(p.name[:-len(".toml")] for p in importlib.resources.files(__name__).iterdir()
                  if p.name.endswith(".toml"))


def with_overrides(data: dict, overrides: dict) -> dict:
    """``data`` (a preset table) with ``overrides`` applied. A preset's ``alignment`` belongs to
    its format: when the overrides change ``format`` and say no ``alignment``, the new format
    takes the alignment the preset's ``format_alignment`` table names for it (a format name,
    any case, to an alignment), else the format's default (``decode`` and ``prefill`` set 128
    for BF16 and 32 for NVFP4, each measured fastest on the H200: docs/PERF.md)."""
    out = {**data, **overrides}
    if "format" in overrides and "alignment" not in overrides \
            and overrides["format"] != data.get("format"):
        out.pop("alignment", None)
        table = data.get("format_alignment", {})
        if not isinstance(table, dict):
            raise EPConfigError([(("format_alignment",), f"format_alignment must be a table "
                                  f"of format name = alignment, got {table!r}")])
        name = str(overrides["format"]).lower()
        chosen = [a for f, a in table.items() if f.lower() == name]
        if chosen:
            out["alignment"] = chosen[0]
    return out


def preset_data(name: str) -> dict:
    """The table of preset ``name`` as stored (``description`` included)."""
    if name not in preset_names():
        raise PresetError(f"unknown preset {name!r} (known: {', '.join(preset_names())})")
    text = importlib.resources.files(__name__).joinpath(f"{name}.toml").read_text("utf-8")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"preset {name!r}: {name}.toml is not valid TOML: {e}") from e


def load_preset(name: str) -> EPConfig:
    """The validated ``EPConfig`` of preset ``name``."""
    return config_from_dict(preset_data(name))


def config_from_dict(d: dict) -> EPConfig:
    """An ``EPConfig`` from a flat table (see the module docstring) or from ``cfg.describe()``
    (``token_fmt`` a nested table whose derived entries must agree with the format built, or a
    ``TokenFormat``). Flat keys win over the nested table's; ``description`` is ignored.
    Unknown keys, a missing or unknown format and invalid values raise ``EPConfigError``
    naming the parameters."""
    d = {k: v for k, v in d.items() if k not in META_KEYS}
    fmt = d.pop("token_fmt", None)
    tuning = {"tuning": d.pop("tuning")} if "tuning" in d else {}
    derived = {}
    if isinstance(fmt, dict):
        derived = dict(fmt)
        for key in ("name", "hid_dim", "top_k", "alignment"):
            if key in derived:
                d.setdefault("format" if key == "name" else key, derived.pop(key))
    elif not (fmt is None or isinstance(fmt, TokenFormat)):
        raise EPConfigError([(("token_fmt",), "must be a TokenFormat or a table (name, hid_dim, "
                                              f"top_k[, alignment]), got {fmt!r}")])
    bad = [((k,), f"unknown parameter (known: {', '.join(config_params())})")
           for k in sorted(set(d) - set(config_params()))]
    if fmt is None or isinstance(fmt, dict):
        bad += [((k,), "required (the token format is format, hid_dim, top_k)")
                for k in ("format", "hid_dim", "top_k") if k not in d]
    if bad:
        raise EPConfigError(bad)
    if isinstance(fmt, TokenFormat):
        return EPConfig(token_fmt=fmt, **tuning, **d)
    try:
        fmt_cls = format_class(d.pop("format"))
    except ValueError as e:
        raise EPConfigError([(("format",), str(e))]) from None
    extra = {"alignment": d.pop("alignment")} if "alignment" in d else {}
    try:
        token_fmt = fmt_cls(d.pop("hid_dim"), d.pop("top_k"), **extra)
    except ValueError as e:
        raise EPConfigError([(("token_fmt",), str(e))]) from None
    have = token_fmt.describe()
    wrong = [((f"token_fmt.{k}",), f"the table says {v!r}, the format gives "
                                   f"{have.get(k, '(no such entry)')!r}")
             for k, v in derived.items() if have.get(k, _NONE) != v]
    if wrong:
        raise EPConfigError(wrong)
    return EPConfig(token_fmt=token_fmt, **tuning, **d)


def config_to_dict(cfg: EPConfig) -> dict:
    """The flat table of ``cfg``: every parameter, then ``format``, ``hid_dim``, ``top_k``,
    ``alignment``. ``config_from_dict(config_to_dict(cfg)) == cfg``."""
    out = {f.name: getattr(cfg, f.name) for f in attrs.fields(EPConfig)
           if f.name not in NESTED_PARAMS}
    fmt = cfg.token_fmt
    out.update(format=fmt.name, hid_dim=fmt.hid_dim, top_k=fmt.top_k, alignment=fmt.alignment)
    if cfg.tuning.changed():
        out["tuning"] = cfg.tuning.changed()
    return out


def parse_value(key: str, text: str):
    """The typed value of ``--set key=text``: an int (decimal, ``0x..``, ``1_000``), a bool
    (``true/false``, ``1/0``, ``yes/no``, ``on/off``) or the format name, by ``key``; ``none``
    for a parameter whose default is None."""
    if key not in config_params():
        raise EPConfigError([((key,), f"unknown parameter (known: {', '.join(config_params())})")])
    text = text.strip()
    if key == "format":
        return text
    field = getattr(attrs.fields(EPConfig), key, None)
    if field is not None and field.default is None and text.lower() in ("none", "null"):
        return None
    if key in BOOL_PARAMS:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise EPConfigError([((key,), f"must be true or false, got {text!r}")])
    try:
        return int(text, 0)
    except ValueError:
        try:
            return int(text)  # "08"
        except ValueError:
            raise EPConfigError([((key,), f"must be an integer, got {text!r}")]) from None


__all__ = ["PresetError", "config_params", "preset_names", "preset_data", "load_preset",
           "config_from_dict", "config_to_dict", "parse_value", "FORMAT_KEYS"]
