"""``EmulatedWorld(cfg, devices=D)``: the skip_a2a participants (no GPU needed)."""

from __future__ import annotations

import pytest

import epgen
from epgen.runtime.world import participants


def make(**kw):
    base = dict(num_threads=256, n_sms=9, n_experts=16, n_ranks=2, max_tokens_per_rank=32,
                p2p_world_size=2, use_shmem=False, token_fmt=epgen.BF16Format(256, 4))
    return epgen.EPConfig(**{**base, **kw})


SKIP = dict(skip_a2a=True, n_ranks=1, p2p_world_size=1, n_experts=8)


def test_ranks_without_skip_a2a():
    assert participants(make(), None) == [0, 1]


def test_devices_need_skip_a2a():
    with pytest.raises(ValueError, match="devices=2 applies only with skip_a2a"):
        participants(make(), 2)


def test_world_refuses_devices_before_touching_a_gpu():
    with pytest.raises(ValueError, match="devices.*skip_a2a"):
        epgen.EmulatedWorld(make(), devices=2)


@pytest.mark.parametrize("devices, ids", [(None, [0]), (1, [0]), (4, [0, 1, 2, 3])])
def test_skip_a2a_devices(devices, ids):
    assert participants(make(**SKIP), devices) == ids


@pytest.mark.parametrize("devices", [0, -1, True, 2.0, "2"])
def test_bad_device_counts(devices):
    with pytest.raises(ValueError, match="devices must be a positive integer"):
        participants(make(**SKIP), devices)


def test_global_ids_must_fit_uint16():
    cfg = make(**SKIP)
    assert participants(cfg, 65536 // 8) == list(range(8192))
    with pytest.raises(ValueError, match="65536"):
        participants(cfg, 65536 // 8 + 1)


def test_global_skip_a2a_defaults_to_one_device_per_rank():
    """skip_a2a with the global n_ranks: by default one device per rank's expert slice (the
    per-device form, n_ranks = 1, keeps its one device)."""
    cfg = make(skip_a2a=True)
    assert cfg.n_ranks == 2 and participants(cfg, None) == [0, 1]
    assert participants(cfg, 3) == [0, 1, 2]
