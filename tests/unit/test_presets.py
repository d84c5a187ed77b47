"""Presets (``epgen/presets/*.toml``), ``config_from_dict``/``config_to_dict``, ``--set`` value
parsing and the token-format registry."""

from __future__ import annotations

import attrs
import pytest

import golden_util
from epgen import BF16Format, EPConfig, EPConfigError
from epgen.formats import FORMATS, format_class, format_names, make_format, register_format
from epgen.presets import tomllib  # tomllib, or tomli on Python 3.10
from epgen.presets import (META_KEYS, PresetError, config_from_dict, config_params,
                           config_to_dict, load_preset, parse_value, preset_data, preset_names)

H200_SMS = 132
MAX_THREADS_PER_SM = 2048

EXPECTED = {
    "default": dict(n_experts=256, n_ranks=8, hid_dim=7168, top_k=8, max_tokens_per_rank=128,
                    num_threads=1024, n_sms=132, p2p_world_size=8, use_shmem=False),
    "small": dict(n_experts=16, n_ranks=2, hid_dim=256, top_k=4, max_tokens_per_rank=32,
                  num_threads=256, n_sms=9, p2p_world_size=2, use_shmem=False),
    "decode": dict(n_experts=256, n_ranks=8, hid_dim=7168, top_k=8, max_tokens_per_rank=128,
                   num_threads=512, n_sms=33, p2p_world_size=8, use_shmem=False,
                   alignment=128),
    "prefill": dict(n_experts=256, n_ranks=8, hid_dim=7168, top_k=8, max_tokens_per_rank=4096,
                    num_threads=512, n_sms=33, p2p_world_size=8, use_shmem=False,
                    alignment=128),
}


def test_preset_names():
    assert set(EXPECTED) <= set(preset_names())
    assert preset_names() == sorted(preset_names())


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_validates_and_builds(name):
    data = preset_data(name)
    assert isinstance(data.get("description"), str) and data["description"]
    assert set(data) - set(META_KEYS) <= set(config_params())
    for fmt, alignment in data.get("format_alignment", {}).items():   # each names a format
        assert format_class(fmt).name == fmt and isinstance(alignment, int)
    cfg = load_preset(name)
    assert isinstance(cfg, EPConfig)
    assert not cfg.needs_shmem and not cfg.use_shmem
    cfg.layout.check()
    from epgen.kernels import build_module
    module = build_module(cfg)
    assert [k.name for k in module.kernels] == ["ep_dispatch_async", "ep_dispatch_wait",
                                              "ep_dispatch"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_values(name):
    cfg = load_preset(name)
    flat = config_to_dict(cfg)
    assert {k: flat[k] for k in EXPECTED[name]} == EXPECTED[name]
    assert type(cfg.token_fmt) is BF16Format


@pytest.mark.parametrize("name", ["decode", "prefill"])
def test_emulation_presets_fit_one_h200(name):
    """8 emulated ranks' grids are all resident on one H200 (threads per SM bound only)."""
    cfg = load_preset(name)
    assert cfg.n_ranks == 8
    assert cfg.n_ranks * cfg.n_sms <= H200_SMS * (MAX_THREADS_PER_SM // cfg.num_threads)


@pytest.mark.parametrize("overrides,want", [
    ({}, 128),                                        # the preset's own (BF16) alignment
    ({"format": "BF16"}, 128),                        # the same format: kept
    ({"format": "BlockwiseFP8"}, 16),                 # another format: that format's default
    ({"format": "NVFP4"}, 32),                        # ... unless format_alignment names it
    ({"format": "nvfp4"}, 32),                        # (format names in any case)
    ({"format": "NVFP4", "alignment": 16}, 16),       # said explicitly: kept
    ({"format": "BlockwiseFP8", "alignment": 64}, 64),   # said explicitly: kept
    ({"alignment": 32}, 32)])
def test_a_preset_alignment_belongs_to_its_format(overrides, want):
    from epgen.presets import with_overrides
    cfg = config_from_dict(with_overrides(preset_data("prefill"), overrides))
    assert cfg.token_fmt.alignment == want
    assert cfg.token_fmt.name.lower() == overrides.get("format", "BF16").lower()


@pytest.mark.parametrize("table", [32, "NVFP4=32", [32]])
def test_format_alignment_must_be_a_table(table):
    from epgen.presets import with_overrides
    data = {**preset_data("prefill"), "format_alignment": table}
    with pytest.raises(EPConfigError, match="format_alignment must be a table"):
        with_overrides(data, {"format": "NVFP4"})


def test_format_alignment_value_is_checked_as_an_alignment():
    from epgen.presets import with_overrides
    data = {**preset_data("prefill"), "format_alignment": {"NVFP4": 24}}
    with pytest.raises(ValueError, match="alignment must be a power of two"):
        config_from_dict(with_overrides(data, {"format": "NVFP4"}))


@pytest.mark.parametrize("fmt,want", [("BlockwiseFP8", 16), ("NVFP4", 32)])
def test_cli_set_format_takes_the_format_alignment(fmt, want, capsys):
    """``epgen inspect --preset decode --set format=...``: the quantising format gets the
    preset's ``format_alignment`` for it or its default alignment (16), not the BF16 preset's
    128."""
    from epgen import cli
    assert cli.main(["inspect", "--preset", "decode", "--set", f"format={fmt}", "--json"]) == 0
    import json
    report = json.loads(capsys.readouterr().out)
    text = json.dumps(report)
    assert f'"alignment": {want}' in text and '"alignment": 128' not in text


def test_unknown_preset():
    with pytest.raises(PresetError, match="unknown preset 'nope'.*default"):
        load_preset("nope")


def test_presets_are_package_data():
    pyproject = tomllib.loads((golden_util.REPO_ROOT / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]
    assert "presets/*.toml" in data["epgen"] or "*.toml" in data.get("epgen.presets", [])


# ---------------------------------------------------------------------------------------------
# config_from_dict / config_to_dict

VARIANTS = [
    {},
    {"use_shmem": True},
    {"ep_final_layout": True, "ep_prod_reserve": True},
    {"has_rank_flag": True, "ep_ord_r": True, "timeout_ns": 0},
    {"ep_copy_role_split": True, "ep_send_join_named": True, "fused_shared_expert": True},
]


@pytest.mark.parametrize("name", preset_names())
@pytest.mark.parametrize("changes", VARIANTS, ids=lambda c: ",".join(c) or "preset")
def test_round_trip(name, changes):
    cfg = load_preset(name).replace(**changes)
    again = config_from_dict(cfg.describe())
    assert again == cfg
    assert again.describe() == cfg.describe()
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_round_trip_optional_parameter():
    cfg = load_preset("small").replace(recv_block_capacity=8)
    assert config_from_dict(cfg.describe()) == cfg
    assert config_from_dict(config_to_dict(cfg)).recv_block_capacity == 8


def test_flat_table_and_token_format_instance():
    flat = {k: v for k, v in config_to_dict(load_preset("small")).items()
            if k not in ("format", "hid_dim", "top_k", "alignment")}
    cfg = config_from_dict({**flat, "token_fmt": BF16Format(256, 4)})
    assert cfg == load_preset("small")
    assert config_from_dict({**flat, "format": "bf16", "hid_dim": 256, "top_k": 4,
                             "description": "ignored"}) == cfg


def _violations(d) -> dict:
    with pytest.raises(EPConfigError) as info:
        config_from_dict(d)
    return {params: rule for params, rule in info.value.violations}


def test_config_from_dict_errors_name_the_parameter():
    base = config_to_dict(load_preset("default"))
    assert ("bogus",) in _violations({**base, "bogus": 1})
    missing = {k: v for k, v in base.items() if k not in ("format", "top_k")}
    assert {("format",), ("top_k",)} <= set(_violations(missing))
    assert "BF16" in _violations({**base, "format": "FP5"})[("format",)]
    assert "hid_dim" in _violations({**base, "hid_dim": 100})[("token_fmt",)]
    assert ("n_experts", "n_ranks") in _violations({**base, "n_ranks": 3})
    assert ("use_shmem",) in _violations({**base, "use_shmem": "yes"})
    described = load_preset("default").describe()
    described["token_fmt"] = {**described["token_fmt"], "msg_size": 1}
    assert ("token_fmt.msg_size",) in _violations(described)
    with pytest.raises(EPConfigError, match="token_fmt"):
        config_from_dict({**base, "token_fmt": 7})


def test_config_to_dict_keys():
    flat = config_to_dict(load_preset("default"))
    assert tuple(flat) == config_params()
    assert flat["format"] == "BF16" and flat["alignment"] == 16


# ---------------------------------------------------------------------------------------------
# parse_value (epgen --set key=value)


@pytest.mark.parametrize("key, text, value", [
    ("n_sms", "20", 20), ("n_sms", " 0x10 ", 16), ("timeout_ns", "2_000", 2000),
    ("max_tokens_per_rank", "08", 8), ("use_shmem", "true", True), ("use_shmem", "False", False),
    ("skip_a2a", "1", True), ("ep_ord_r", "off", False), ("format", "BF16", "BF16"),
    ("hid_dim", "512", 512), ("recv_block_capacity", "none", None),
    ("recv_block_capacity", "4", 4),
])
def test_parse_value(key, text, value):
    got = parse_value(key, text)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("key, text", [("n_sms", "many"), ("n_sms", "1.5"), ("use_shmem", "2"),
                                       ("bogus", "1"), ("n_sms", "none")])
def test_parse_value_errors(key, text):
    with pytest.raises(EPConfigError) as info:
        parse_value(key, text)
    assert info.value.violations[0][0] == (key,)


# ---------------------------------------------------------------------------------------------
# token format registry


def test_format_registry():
    assert FORMATS["BF16"] is BF16Format
    assert "BF16" in format_names()
    assert format_class("bf16") is BF16Format
    assert make_format("BF16", 128, 4) == BF16Format(128, 4)
    with pytest.raises(ValueError, match="unknown token format 'FP5'.*BF16"):
        format_class("FP5")


def test_register_format_rejects_a_second_class_under_one_name(monkeypatch):
    monkeypatch.setattr("epgen.formats.registry.FORMATS", dict(FORMATS))

    @attrs.frozen
    class Other(BF16Format):
        name = "BF16"

    with pytest.raises(ValueError, match="registered twice"):
        register_format(Other)

    @attrs.frozen
    class Nameless(BF16Format):
        name = "abstract"

    with pytest.raises(ValueError, match="needs a 'name'"):
        register_format(Nameless)
