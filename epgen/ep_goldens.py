"""Golden variants of the EP dispatch kernels: ``ep/<preset>`` is the module of both entry
points (``ep_dispatch_async``, ``ep_dispatch_wait``) of that preset, pinned in
``golden/ep/<preset>.{ir,ptx}``; ``ep/default_<suffix>`` is the default preset with another
token format, one per registered format (``GOLDEN_FORMATS``, from the registry:
``ep/default_fp8`` is BlockwiseFP8, ``ep/default_nvfp4`` NVFP4, ...; the suffix is the format's
``golden_suffix``). ``FLAG_VARIANTS`` are the flag variants: ``ep/<name>`` is a preset with
some parameters changed (``docs/flags.md`` says what each flag changes in the PTX);
``SHMEM_VARIANTS`` the same for ``use_shmem`` with destinations outside the P2P group
(``ep/shmem_p2p1_<suffix>``: the same for every registered format).
``epgen ptx`` with no arguments prints ``ep/default``'s PTX.

Each variant is registered with a one-line description of what it sets (preset, then the
parameters or the format), which ``epgen variants`` prints; ``describe_changes`` writes the
parameters the way ``epgen --set`` reads them.
"""

from __future__ import annotations

from .formats import FORMATS, format_class
from .goldens import golden
from .presets import preset_data


def formats_besides(preset: str) -> list[tuple[str, str]]:
    """``(golden suffix, format name)`` of every registered format but ``preset``'s own."""
    own = format_class(preset_data(preset)["format"])
    return [(cls.golden_suffix, cls.name) for cls in FORMATS.values() if cls is not own]


GOLDEN_PRESETS = ("default", "small")
#: ``(preset, variant suffix, format name)`` of the golden format variants: the default
#: preset with every other registered format
GOLDEN_FORMATS = tuple(("default", suffix, name) for suffix, name in formats_besides("default"))

#: ``name -> (preset, parameter changes)`` of the flag variants ``ep/<name>``.
FLAG_VARIANTS = {
    "send_join_named": ("small", {"ep_send_join_named": True}),
    # the role split's geometry rule holds only for 384 threads and H = 6144 (H/8 = 3 * 256)
    "role_split": ("small", {"ep_copy_role_split": True, "num_threads": 384,
                             "hid_dim": 6144}),
    "ord_r": ("small", {"ep_ord_r": True, "has_rank_flag": True}),
    "ord_r_named": ("small", {"ep_ord_r": True, "has_rank_flag": True,
                              "ep_send_join_named": True}),
    # skip_a2a in the reference host's per-device form, the R = 1 case of its formulas:
    # n_ranks = 1, n_experts = the device's 8 experts (ep/skip_a2a_global: the global form)
    "skip_a2a": ("small", {"skip_a2a": True, "n_ranks": 1, "p2p_world_size": 1,
                           "n_experts": 8}),
    "final_layout": ("small", {"ep_final_layout": True}),
    "final_layout_prod_reserve": ("small", {"ep_final_layout": True, "ep_prod_reserve": True}),
    # a quantising format's final rows: the warp send writes the payload and the row-major
    # scales to the output (send_policy.writes_final_rows_by_warp)
    "final_layout_prod_reserve_nvfp4": ("small", {"ep_final_layout": True,
                                                  "ep_prod_reserve": True, "format": "NVFP4"}),
    # ours: the rank mask, on the staged layout and on the capacity-strided final layout (the
    # DeepEP API's)
    "rank_mask": ("small", {"ep_rank_mask": True}),
    "final_layout_rank_mask": ("small", {"ep_final_layout": True, "ep_rank_mask": True}),
    # ours: one message per (token, destination rank), on the staged layout (the warp send
    # path with two warps per token), in BF16 and in a quantising format
    "rank_dedup": ("small", {"ep_rank_dedup": True}),
    "rank_dedup_nvfp4": ("small", {"ep_rank_dedup": True, "format": "NVFP4"}),
}


_SHMEM = {"use_shmem": True, "p2p_world_size": 1}
_MIXED = {"use_shmem": True, "n_ranks": 4, "p2p_world_size": 2}
#: ``name -> (preset, parameter changes)`` of the SHMEM variants ``ep/<name>``: ``use_shmem``
#: with destinations outside the P2P group (NVSHMEM puts and signals, unlinked: the PTX
#: declares the NVSHMEM functions ``.extern .func``). Not points of the flag matrix
#: (``epgen.variants`` keeps ``use_shmem`` false).
SHMEM_VARIANTS = {
    "shmem_p2p1": ("small", dict(_SHMEM)),
    **{f"shmem_p2p1_{suffix}": ("small", {**_SHMEM, "format": name})
       for suffix, name in formats_besides("small")},
    "shmem_mixed": ("small", dict(_MIXED)),
    "shmem_mixed_ord_r": ("small", {**_MIXED, "ep_ord_r": True, "has_rank_flag": True}),
    # ours: one message per (token, destination rank), remote destinations included
    "shmem_mixed_rank_dedup": ("small", {**_MIXED, "ep_rank_dedup": True}),
}


def describe_changes(changes: dict) -> str:
    """``key=value, ...`` of parameter ``changes`` as ``epgen --set`` reads them (flags as
    ``true``/``false``)."""
    def text(v):
        return ("true" if v else "false") if isinstance(v, bool) else str(v)
    return ", ".join(f"{k}={text(v)}" for k, v in changes.items())


def _preset_description(preset: str) -> str:
    about = preset_data(preset).get("description")
    return f"preset {preset}" + (f" ({about})" if about else "")


def flag_variant_config(name: str):
    """The ``EPConfig`` of flag variant ``name`` (a key of ``FLAG_VARIANTS`` or
    ``SHMEM_VARIANTS``)."""
    from .presets import config_from_dict, with_overrides
    preset, changes = {**FLAG_VARIANTS, **SHMEM_VARIANTS}[name]
    table = with_overrides(preset_data(preset), changes)
    table.pop("description", None)
    return config_from_dict(table)


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
    about = (_preset_description(preset) + ", no flags" if fmt_name is None
             else f"preset {preset} + format={fmt_name}")
    golden(f"ep/{name}", description=about)(build)


def _register_config_variant(name: str, config_of, description: str) -> None:
    """Golden ``ep/<name>``: the dispatch module of ``config_of(name)``."""
    def build():
        from .kernels import build_module
        return build_module(config_of(name))

    build.__qualname__ = f"ep_{name}_module"
    golden(f"ep/{name}", description=description)(build)


def _register_flag_variant(name: str) -> None:
    preset, changes = {**FLAG_VARIANTS, **SHMEM_VARIANTS}[name]
    _register_config_variant(name, flag_variant_config,
                             f"preset {preset} + {describe_changes(changes)}")


for _preset in GOLDEN_PRESETS:
    _register(_preset)


# The combine kernels (``ep_combine_async``, ``ep_combine_wait``, the fused ``ep_combine``;
# docs/combine.md): their own module, so the dispatch goldens are unchanged.
@golden("combine/small", description="preset small (BF16, P2P): the combine kernels "
                                      "ep_combine_async, ep_combine_wait and ep_combine")
def combine_small_module():
    from .kernels import build_combine_module
    from .presets import load_preset
    return build_combine_module(load_preset("small"))


#: ``name -> (parameter changes of the small preset, fused kernel alone)`` of the combine
#: variants ``combine/<name>``. No ``ep_final_layout`` variant: the combine kernels are the
#: same in every layout (rows found from Region A and ``src_info``), so it would equal
#: ``combine/small``.
COMBINE_VARIANTS = {
    "fused": ({}, True),
    "skip_a2a": ({"skip_a2a": True, "n_ranks": 1, "p2p_world_size": 1, "n_experts": 8},
                 False),
    "fused_se": ({"fused_shared_expert": True}, True),
    "fused_se_skip_a2a": ({"fused_shared_expert": True, "skip_a2a": True, "n_ranks": 1,
                           "p2p_world_size": 1, "n_experts": 8}, True),
    # skip_a2a with the small preset's global n_ranks = 2, n_experts = 16 (same 8 experts
    # per device as combine/skip_a2a)
    "skip_a2a_global": ({"skip_a2a": True}, False),
    # every source reached by NVSHMEM
    "shmem": ({"use_shmem": True, "p2p_world_size": 1}, False),
    # ours: the rank mask (the standalone kernels only)
    "rank_mask": ({"ep_rank_mask": True}, False),
    # ours: combine_wait times each arrival word (Tuning.wait_times, kernels.wait_time)
    "wait_times": ({"tuning": {"wait_times": True}}, False),
}


def _register_combine_variant(name: str) -> None:
    changes, fused_only = COMBINE_VARIANTS[name]

    def build():
        import ir

        from .kernels import build_combine_fused, build_combine_module
        from .presets import config_from_dict
        cfg = config_from_dict({**preset_data("small"), **changes})
        if fused_only:
            return ir.Module("ep_combine", (build_combine_fused(cfg),))
        return build_combine_module(cfg)

    what = "the fused kernel ep_combine" if fused_only else "the combine kernels"
    build.__name__ = f"combine_{name}_module"
    sets = f" + {describe_changes(changes)}" if changes else ""
    golden(f"combine/{name}", description=f"preset small{sets}: {what}")(build)


for _name in COMBINE_VARIANTS:
    _register_combine_variant(_name)


# The FP8 combine's twins (``ep_combine_async_fp8``, ``ep_combine_wait_fp8``, ``ep_combine_fp8``;
# docs/combine.md, "FP8 combine"): one ``combine/<name>_fp8`` per BF16 combine golden above,
# the same configuration, the FP8 module (or its fused kernel alone where the BF16 golden is).
def _register_combine_fp8_variant(name: str) -> None:
    changes, fused_only = ({}, False) if name == "small" else COMBINE_VARIANTS[name]

    def build():
        import ir

        from .kernels import build_combine_fp8_module, build_combine_fused
        from .kernels.combine_fp8 import Fp8Wire
        from .presets import config_from_dict
        cfg = config_from_dict({**preset_data("small"), **changes})
        if fused_only:
            return ir.Module("ep_combine_fp8", (build_combine_fused(cfg, Fp8Wire(cfg)),))
        return build_combine_fp8_module(cfg)

    what = "the FP8 fused kernel ep_combine_fp8" if fused_only else "the FP8 combine kernels"
    build.__name__ = f"combine_{name}_fp8_module"
    sets = f" + {describe_changes(changes)}" if changes else ""
    golden(f"combine/{name}_fp8", description=f"preset small{sets}: {what}")(build)


for _name in ("small", *COMBINE_VARIANTS):
    _register_combine_fp8_variant(_name)


# Ours: the partial-reduce combine's twins (``ep_combine_async_partial``,
# ``ep_combine_wait_partial``, ``ep_combine_partial``; ``ep_rank_dedup`` only, docs/combine.md
# "Partial reduce"): the small preset with the flag, and with every source reached by NVSHMEM.
COMBINE_PARTIAL_VARIANTS = {
    "rank_dedup_partial": {"ep_rank_dedup": True},
    "shmem_rank_dedup_partial": {"ep_rank_dedup": True, "use_shmem": True,
                                 "p2p_world_size": 1},
}


def _register_combine_partial_variant(name: str) -> None:
    changes = COMBINE_PARTIAL_VARIANTS[name]

    def build():
        from .kernels import build_combine_partial_module
        from .presets import config_from_dict
        return build_combine_partial_module(config_from_dict({**preset_data("small"),
                                                              **changes}))

    build.__name__ = f"combine_{name}_module"
    golden(f"combine/{name}", description=f"preset small + {describe_changes(changes)}: "
                                          f"the partial-reduce combine kernels")(build)


for _name in COMBINE_PARTIAL_VARIANTS:
    _register_combine_partial_variant(_name)


# The fused single-launch kernel alone (``ep/fused``: the small preset; ``ep/fused_se``: with
# fused_shared_expert) and the fused-roles test kernel (``ep/fused_roles``: the small preset).
@golden("ep/fused", description="preset small: the fused single-launch kernel ep_dispatch "
                                 "alone (async and wait in one grid)")
def ep_fused_module():
    import ir
    from .kernels import build_dispatch_fused
    from .presets import load_preset
    return ir.Module("ep_dispatch", (build_dispatch_fused(load_preset("small")),))


@golden("ep/fused_se", description="preset small + fused_shared_expert=true: ep_dispatch with "
                                    "the shared expert as group 0")
def ep_fused_se_module():
    import ir
    from .kernels import build_dispatch_fused
    from .presets import load_preset
    cfg = load_preset("small").replace(fused_shared_expert=True)
    return ir.Module("ep_dispatch", (build_dispatch_fused(cfg),))


@golden("ep/fused_roles", description="preset small: the ep_fused_roles test kernel (an ffn "
                                       "role consuming the L1 arrival counters, then the comm "
                                       "role's copy with the role parameters)")
def ep_fused_roles_module():
    import ir
    from .kernels.fused_roles import KERNEL_NAME, build_fused_roles
    from .presets import load_preset
    return ir.Module(KERNEL_NAME, (build_fused_roles(load_preset("small")),))


# The SM-remapping test kernel (``ep/sm_remap``: the small preset, the warp send path;
# ``ep/sm_remap_se``: with fused_shared_expert, the packers' SM arguments too).
@golden("ep/sm_remap", description="preset small: the ep_dispatch_sm_remap test kernel (the "
                                     "fused kernel with every role on remapped SMs)")
def ep_sm_remap_module():
    import ir
    from .kernels.sm_remap import KERNEL_NAME, build_dispatch_sm_remap
    from .presets import load_preset
    return ir.Module(KERNEL_NAME, (build_dispatch_sm_remap(load_preset("small")),))


@golden("ep/sm_remap_se", description="preset small + fused_shared_expert=true: the "
                                        "ep_dispatch_sm_remap test kernel with the packers")
def ep_sm_remap_se_module():
    import ir
    from .kernels.sm_remap import KERNEL_NAME, build_dispatch_sm_remap
    from .presets import load_preset
    cfg = load_preset("small").replace(fused_shared_expert=True)
    return ir.Module(KERNEL_NAME, (build_dispatch_sm_remap(cfg),))


# skip_a2a with the reference's global parameters (not a FLAG_VARIANTS entry: the variant
# matrix builds skip_a2a on ep/skip_a2a's per-device base)
@golden("ep/skip_a2a_global", description="preset small + skip_a2a=true (n_ranks=2, "
                                           "n_experts=16 global: 8 experts per device, "
                                           "my_rank picks them)")
def ep_skip_a2a_global_module():
    from .kernels import build_module
    from .presets import load_preset
    return build_module(load_preset("small").replace(skip_a2a=True))


for _preset, _suffix, _fmt in GOLDEN_FORMATS:
    _register(_preset, _suffix, _fmt)
for _name in (*FLAG_VARIANTS, *SHMEM_VARIANTS):
    _register_flag_variant(_name)


#: ours: ``name -> (parameter changes, tuning changes)`` of the variants ``ep/<name>`` that set
#: a ``Tuning`` knob on the small preset: the wait times (``Tuning.wait_times``,
#: epgen.kernels.wait_time) on the capacity-strided final layout, as the DeepEP API builds
#: its worlds (dispatch_wait times each count word)
TUNING_VARIANTS = {
    "final_layout_wait_times": ({"ep_final_layout": True}, {"wait_times": True}),
}


def tuning_variant_config(name: str):
    """The ``EPConfig`` of tuning variant ``name`` (a key of ``TUNING_VARIANTS``)."""
    from .presets import load_preset
    changes, knobs = TUNING_VARIANTS[name]
    cfg = load_preset("small")
    return cfg.replace(**changes, tuning=cfg.tuning.replace(**knobs))


for _name, (_changes, _knobs) in TUNING_VARIANTS.items():
    _register_config_variant(_name, tuning_variant_config,
                             f"preset small + {describe_changes(_changes)}, tuning "
                             f"{describe_changes(_knobs)}")


# The device-side check of top-k ids (``ep_check_ids``; epgen.kernels.check_ids), run by the
# torch API before dispatch: its own module.
@golden("check_ids/small", description="preset small: ep_check_ids, the device-side check "
                                        "of one rank's top-k ids")
def check_ids_small_module():
    from .kernels.check_ids import build_check_ids_module
    from .presets import load_preset
    return build_check_ids_module(load_preset("small"))


@golden("check_ids/small_ranks4", description="preset small: ep_check_ids_ranks4, the check "
                                              "of four ranks' top-k ids in one launch")
def check_ids_small_ranks4_module():
    from .kernels.check_ids import build_check_ids_module
    from .presets import load_preset
    return build_check_ids_module(load_preset("small"), n_ranks=4)


# The token-major receive of the deduplicated dispatch (``ep_dispatch_wait_tokens``;
# epgen.kernels.dispatch_tokens, DeepEP's normal mode): its own module, after the unchanged
# ``ep_dispatch_async`` of ``ep/rank_dedup``.
@golden("ep/rank_dedup_tokens", description="preset small + ep_rank_dedup=true: "
                                            "ep_dispatch_wait_tokens, the token-major receive "
                                            "(DeepEP's normal mode)")
def ep_rank_dedup_tokens_module():
    from .kernels.dispatch_tokens import build_dispatch_tokens_module
    return build_dispatch_tokens_module(flag_variant_config("rank_dedup"))


# DeepEP's normal-mode combine (epgen.kernels.combine_tokens): ``ep_combine_async_tokens`` and
# the partial-reduce combine's unchanged ``ep_combine_wait_partial``, in a module of their own.
@golden("ep/rank_dedup_combine_tokens", description="preset small + ep_rank_dedup=true: "
                                                    "ep_combine_async_tokens and "
                                                    "ep_combine_wait_partial, the normal-mode "
                                                    "combine (DeepEP's)")
def ep_rank_dedup_combine_tokens_module():
    from .kernels.combine_tokens import build_combine_tokens_module
    return build_combine_tokens_module(flag_variant_config("rank_dedup"))
