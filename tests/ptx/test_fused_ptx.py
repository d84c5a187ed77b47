"""PTX checks of the fused variants: the instructions that distinguish them, counted in the
``.entry`` bodies of their goldens' PTX (the generic checker, ``check_ptx``, already proves that
every ordered IR operation survives; these pin what each flag adds)."""

from __future__ import annotations

import functools
import re

import pytest

from epgen import goldens
from epgen.presets import load_preset

check = pytest.importorskip("backends.nvptx.check")


@functools.lru_cache(maxsize=None)
def ptx(variant: str) -> str:
    return goldens.golden_outputs(variant)["ptx"]


def body(variant: str, kernel: str) -> str:
    return check.entry_bodies(ptx(variant))[kernel]


def count(text: str, pattern: str) -> int:
    return len(re.findall(pattern, text))


RED_REL_GPU = r"red\.release\.gpu\.global\.add\.u32\s"
ATOM_RELAXED_GPU = r"atom\.relaxed\.gpu\.global\.add\.u32\s"


def f_byte() -> int:
    """Byte offset of send_buf_ready (Region F) in the dispatch_wait counters (small preset)."""
    return 4 * load_preset("small").layout.send_buf_ready_offset


def test_fused_kernel_is_both_halves():
    fused = body("ep/fused", "ep_dispatch")
    async_, wait = body("ep/small", "ep_dispatch_async"), body("ep/small", "ep_dispatch_wait")
    for pattern in (r"st\.release\.sys\.global\.b64", r"ld\.acquire\.sys\.global\.b64",
                    r"st\.release\.gpu\.global\.b32", RED_REL_GPU,
                    r"atom\.acquire\.gpu\.global\.add\.u32"):
        assert count(fused, pattern) == count(async_, pattern) + count(wait, pattern), pattern


def test_shared_expert_adds_the_send_buf_ready_protocol():
    se, plain = body("ep/fused_se", "ep_dispatch"), body("ep/fused", "ep_dispatch")
    # every send block: one red.release.gpu on send_buf_ready after staging its tokens, on top
    # of the finished count
    assert count(se, RED_REL_GPU) == count(plain, RED_REL_GPU) + 1
    # the packers' bounded poll of send_buf_ready: ld.acquire.gpu at Region F's offset
    poll = rf"ld\.acquire\.gpu\.global\.b32\s+%r\d+,\s*\[%rd\d+\+{f_byte()}\]"
    assert count(se, poll) >= 1 and count(plain, poll) == 0
    # the started count (Region G), relaxed, plus the record slot of the packers' bounded
    # wait's timeout path
    assert count(se, ATOM_RELAXED_GPU) >= count(plain, ATOM_RELAXED_GPU) + 2
    # the monitors signal as without the shared expert: no extra sys-scope traffic
    for pattern in (r"st\.release\.sys", r"ld\.acquire\.sys"):
        assert count(se, pattern) == count(plain, pattern)


def test_fused_roles_publish_l1_arrivals_and_keep_their_barriers_apart():
    from epgen.kernels.fused_roles import FFN_SMEM_BYTES, FusedRolesSpec
    spec, cfg = FusedRolesSpec(), load_preset("small")
    roles = body("ep/fused_roles", "ep_fused_roles")
    # the L1 release is the only release RMW of this kernel (dispatch_wait has none)
    assert count(roles, RED_REL_GPU) >= 1
    assert count(body("ep/small", "ep_dispatch_wait"), RED_REL_GPU) == 0
    n_comm = cfg.num_threads - spec.ffn_threads
    assert count(roles, rf"bar\.sync\s+{spec.comm_barrier_id},\s*{n_comm};") >= 2
    assert count(roles, rf"bar\.sync\s+{spec.ffn_barrier_id},\s*{spec.ffn_threads};") >= 2
    # the aux block alone uses barrier 0
    assert count(roles, r"bar\.sync\s+0;") >= 1
    # both roles' scratch in dynamic shared memory: ffn at 0, comm from comm_smem_base
    assert ".extern .shared .align 16 .b8 dyn_smem[];" in ptx("ep/fused_roles")
    assert count(roles, rf"\[dyn_smem\+{FFN_SMEM_BYTES + 16}\]") >= 1
    # the ffn's bounded polls: ready flag and L1 arrival counter, acquire at gpu scope
    assert count(roles, r"ld\.acquire\.gpu\.global\.b32") >= 3
