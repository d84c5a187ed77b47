"""Golden variants of the EP dispatch kernels: ``ep/<preset>`` is the module of both entry
points (``ep_dispatch_async``, ``ep_dispatch_wait``) of that preset, pinned in
``golden/ep/<preset>.{ir,ptx}``; ``ep/<preset>_<fmt>`` is the same preset with another token
format (``ep/default_fp8``: BlockwiseFP8, ``ep/default_nvfp4``, ``ep/default_mxfp8``).
``epgen ptx`` with no arguments prints ``ep/default``'s PTX.
"""

from __future__ import annotations

from .goldens import golden

GOLDEN_PRESETS = ("default", "small")
#: ``(preset, variant suffix, format name)`` of the golden format variants
GOLDEN_FORMATS = (("default", "fp8", "BlockwiseFP8"), ("default", "nvfp4", "NVFP4"),
                  ("default", "mxfp8", "MXFP8"))


def _register(preset: str, suffix: str | None = None, fmt_name: str | None = None) -> None:
    def build():
        from .formats import make_format
        from .kernels import build_module
        from .presets import load_preset
        cfg = load_preset(preset)
        if fmt_name is not None:
            f = cfg.token_fmt
            cfg = cfg.replace(token_fmt=make_format(fmt_name, f.hid_dim, f.top_k,
                                                    alignment=f.alignment))
        return build_module(cfg)

    name = preset if suffix is None else f"{preset}_{suffix}"
    build.__qualname__ = f"ep_{name}_module"
    golden(f"ep/{name}")(build)


for _preset in GOLDEN_PRESETS:
    _register(_preset)
for _preset, _suffix, _fmt in GOLDEN_FORMATS:
    _register(_preset, _suffix, _fmt)
