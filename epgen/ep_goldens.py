"""Golden variants of the EP dispatch kernels: ``ep/<preset>`` is the module of both entry
points (``ep_dispatch_async``, ``ep_dispatch_wait``) of that preset, pinned in
``golden/ep/<preset>.{ir,ptx}``; ``ep/<preset>_<fmt>`` is the same preset with another token
format (``ep/default_fp8``: BlockwiseFP8, ``ep/default_nvfp4``, ``ep/default_mxfp8``).
``ep/<flag variant>`` (``FLAG_VARIANTS``) is the small preset with some flags set.
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


# The fused single-launch kernel alone (``ep/fused``: the small preset; ``ep/fused_se``: with
# fused_shared_expert) and the fused-roles test kernel (``ep/fused_roles``: the small preset).
@golden("ep/fused")
def ep_fused_module():
    import ir
    from .kernels import build_dispatch_fused
    from .presets import load_preset
    return ir.Module("ep_dispatch", (build_dispatch_fused(load_preset("small")),))


@golden("ep/fused_se")
def ep_fused_se_module():
    import ir
    from .kernels import build_dispatch_fused
    from .presets import load_preset
    cfg = load_preset("small").replace(fused_shared_expert=True)
    return ir.Module("ep_dispatch", (build_dispatch_fused(cfg),))


@golden("ep/fused_roles")
def ep_fused_roles_module():
    import ir
    from .kernels.fused_roles import KERNEL_NAME, build_fused_roles
    from .presets import load_preset
    return ir.Module(KERNEL_NAME, (build_fused_roles(load_preset("small")),))


# Flag variants on the small preset: name -> the EPConfig flags it sets.
FLAG_VARIANTS = {
    "final_layout": {"ep_final_layout": True},
    "final_layout_prod_reserve": {"ep_final_layout": True, "ep_prod_reserve": True},
}


def flag_variant_config(name: str):
    """The ``EPConfig`` of flag variant ``ep/<name>``: the small preset plus its flags."""
    from .presets import load_preset
    return load_preset("small").replace(**FLAG_VARIANTS[name])


def _register_flags(name: str) -> None:
    def build():
        from .kernels import build_module
        return build_module(flag_variant_config(name))

    build.__qualname__ = f"ep_{name}_module"
    golden(f"ep/{name}")(build)


for _name in FLAG_VARIANTS:
    _register_flags(_name)


for _preset, _suffix, _fmt in GOLDEN_FORMATS:
    _register(_preset, _suffix, _fmt)
