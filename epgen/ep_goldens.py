"""Golden variants of the EP dispatch kernels: ``ep/<preset>`` is the module of both entry
points (``ep_dispatch_async``, ``ep_dispatch_wait``) of that preset, pinned in
``golden/ep/<preset>.{ir,ptx}``. ``epgen ptx`` with no arguments prints ``ep/default``'s PTX.

``FLAG_VARIANTS`` are the flag variants: ``ep/<name>`` is a preset with some parameters
changed (``docs/flags.md`` says what each flag changes in the PTX).
"""

from __future__ import annotations

from .goldens import golden

GOLDEN_PRESETS = ("default", "small")

#: ``name -> (preset, parameter changes)`` of the flag variants ``ep/<name>``.
FLAG_VARIANTS = {
    "send_join_named": ("small", {"ep_send_join_named": True}),
    # the role split's geometry rule holds only for 384 threads and H = 6144 (H/8 = 3 * 256)
    "role_split": ("small", {"ep_copy_role_split": True, "num_threads": 384,
                             "hid_dim": 6144}),
    "ord_r": ("small", {"ep_ord_r": True, "has_rank_flag": True}),
    "ord_r_named": ("small", {"ep_ord_r": True, "has_rank_flag": True,
                              "ep_send_join_named": True}),
    # skip_a2a kernels are built per device: n_ranks = 1, n_experts = the device's 8 experts
    "skip_a2a": ("small", {"skip_a2a": True, "n_ranks": 1, "p2p_world_size": 1,
                           "n_experts": 8}),
}


def flag_variant_config(name: str):
    """The ``EPConfig`` of flag variant ``name`` (a key of ``FLAG_VARIANTS``)."""
    from .presets import config_from_dict, preset_data
    preset, changes = FLAG_VARIANTS[name]
    table = {**preset_data(preset), **changes}
    table.pop("description", None)
    return config_from_dict(table)


def _register(preset: str) -> None:
    def build():
        from .kernels import build_module
        from .presets import load_preset
        return build_module(load_preset(preset))

    build.__qualname__ = f"ep_{preset}_module"
    golden(f"ep/{preset}")(build)


def _register_flag_variant(name: str) -> None:
    def build():
        from .kernels import build_module
        return build_module(flag_variant_config(name))

    build.__qualname__ = f"ep_{name}_module"
    golden(f"ep/{name}")(build)


for _preset in GOLDEN_PRESETS:
    _register(_preset)
for _name in FLAG_VARIANTS:
    _register_flag_variant(_name)
