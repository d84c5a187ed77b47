"""Token formats by name (``"BF16"``), so presets and the CLI can say ``format = "BF16"``.

A format class registers itself with ``@register_format``, under its ``name`` attribute, in its
own module, which ``epgen.formats`` imports. Everything that lists formats reads this registry:
the top-level exports (``epgen.<Class>Format``), the golden variants (``epgen.ep_goldens``)
and the tests' format cases (tests/support/format_cases.py).
"""

from __future__ import annotations

FORMATS: dict[str, type] = {}
"""Registered token format classes, by ``cls.name``."""


def register_format(cls: type) -> type:
    """Class decorator: register ``cls`` (a ``TokenFormat`` subclass) under ``cls.name``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or name == "abstract":
        raise ValueError(f"{cls.__name__}: a registered token format needs a 'name'")
    old = FORMATS.get(name)
    if old is not None and old.__qualname__ != cls.__qualname__:
        raise ValueError(f"token format {name!r} is registered twice: by {old.__qualname__} "
                         f"and by {cls.__qualname__}")
    if not cls.__name__.endswith("Format"):
        raise ValueError(f"{cls.__name__}: a registered token format's class name must end "
                         f"in 'Format' (epgen exports it under that name)")
    FORMATS[name] = cls
    return cls


def format_names() -> list[str]:
    """Names of the registered token formats, sorted."""
    return sorted(FORMATS)


def format_class(name: str) -> type:
    """The format class registered as ``name`` (case-insensitive); ``ValueError`` naming the
    known formats otherwise."""
    if isinstance(name, str):
        for key, cls in FORMATS.items():
            if key.lower() == name.lower():
                return cls
    raise ValueError(f"unknown token format {name!r} (known: {', '.join(format_names())})")


def make_format(name: str, hid_dim: int, top_k: int, **kwargs):
    """An instance of the format registered as ``name``: ``cls(hid_dim, top_k, **kwargs)``."""
    return format_class(name)(hid_dim, top_k, **kwargs)
