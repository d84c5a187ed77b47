"""Parity: the reference declares ``skip_a2a`` and ``use_shmem`` with ``use_shmem=True`` by
default, so ``skip_a2a=True`` alone must build. ``use_shmem`` is then inert: reported by
``EPConfig.inert_flags`` (an ``EPFlagNoEffect`` warning at build time), never an error, and the
kernels are those of ``use_shmem=False``."""

from __future__ import annotations

import pytest

import ir
from backends.nvptx import emit_ptx
from epgen.config import EPConfig, EPFlagNoEffect
from epgen.formats import BF16Format
from epgen.kernels import build_combine_module, build_module
from epgen.presets import load_preset

ARCH = "sm_90"


def test_skip_a2a_builds_with_the_reference_default_use_shmem():
    # every parameter of the reference page but the two flags left at their defaults
    cfg = EPConfig(num_threads=256, n_sms=9, n_experts=16, n_ranks=2, max_tokens_per_rank=8,
                   p2p_world_size=2, token_fmt=BF16Format(hid_dim=256, top_k=4),
                   skip_a2a=True)
    assert cfg.use_shmem is True
    assert not cfg.needs_shmem and not cfg.shmem_all_p2p
    assert set(cfg.inert_flags()) == {"use_shmem"}
    assert "skip_a2a sends nothing off the device" in cfg.inert_flags()["use_shmem"]
    assert cfg.effective_flags()["use_shmem"] == cfg.inert_flags()["use_shmem"]
    # without skip_a2a the flag is not inert (the P2P note or the SHMEM transport instead)
    assert "use_shmem" not in cfg.replace(skip_a2a=False).inert_flags()
    assert "use_shmem" not in cfg.replace(use_shmem=False).inert_flags()


@pytest.mark.parametrize("build", [build_module, build_combine_module],
                         ids=["dispatch", "combine"])
def test_inert_use_shmem_builds_the_use_shmem_false_ptx(build):
    """The small preset with ``skip_a2a`` (its global form, the ``ep/skip_a2a_global``
    golden's configuration): PTX byte-identical with and without ``use_shmem``; the dispatch
    build warns that the flag had no effect."""
    plain = load_preset("small").replace(skip_a2a=True, use_shmem=False)
    if build is build_module:
        with pytest.warns(EPFlagNoEffect, match="use_shmem: no effect"):
            flagged = build(plain.replace(use_shmem=True))
    else:
        flagged = build(plain.replace(use_shmem=True))
    want = build(plain)
    assert ir.print_module(flagged) == ir.print_module(want)
    assert emit_ptx(flagged, arch=ARCH) == emit_ptx(want, arch=ARCH)
