"""``epgen.Tuning``: validation, ``--tune`` parsing, and its round trip with the config."""

import pytest

import epgen
from epgen.presets import config_from_dict, config_to_dict, load_preset
from epgen.tuning import Tuning, TuningError, field_names, parse_tune


def test_defaults_and_parse():
    t = parse_tune(["send_warps_per_token_max=2", "trace=on", "quant_stage_bytes=0x400"])
    assert (t.send_warps_per_token_max, t.trace, t.quant_stage_bytes) == (2, True, 1024)
    assert t.changed() == {"send_warps_per_token_max": 2, "trace": True,
                           "quant_stage_bytes": 1024}
    assert Tuning().changed() == {}
    assert set(Tuning().describe()) == set(field_names())


@pytest.mark.parametrize("item, words", [
    ("nope=1", "tuning.nope: unknown field"),
    ("trace=maybe", "tuning.trace: must be true or false"),
    ("send_warps_per_token_max=3", "tuning.send_warps_per_token_max: must be a power of two"),
    ("max_token_groups=0", "tuning.max_token_groups: must be a positive integer"),
    ("quant_stage_bytes=-1", "tuning.quant_stage_bytes: must be an integer >= 0"),
    ("scale_chunk_rows=x", "tuning.scale_chunk_rows: must be an integer"),
    ("trace", "--tune takes KEY=VALUE"),
])
def test_bad_values_name_the_field(item, words):
    with pytest.raises(TuningError, match=words.replace(".", r"\.").replace("-", r"\-")):
        parse_tune([item])


def test_travels_with_the_config():
    cfg = load_preset("small")
    tuned = cfg.replace(tuning=Tuning(max_token_groups=2))
    assert tuned != cfg and hash(tuned) != hash(cfg)
    assert tuned.describe()["tuning"]["max_token_groups"] == 2
    assert config_from_dict(tuned.describe()) == tuned
    assert config_from_dict(config_to_dict(tuned)) == tuned
    assert "tuning" not in config_to_dict(cfg)
    with pytest.raises(TuningError, match="unknown tuning field"):
        epgen.EPConfig(**_without_format(config_to_dict(cfg), cfg.token_fmt,
                                         tuning={"bogus": 1}))


def _without_format(d, fmt, **extra):
    for k in ("format", "hid_dim", "top_k", "alignment"):
        d.pop(k)
    return {**d, "token_fmt": fmt, **extra}
