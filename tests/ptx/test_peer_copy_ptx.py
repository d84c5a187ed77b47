"""The copy-rate kernels (``epgen.kernels.peer_copy``) in PTX: each mode makes exactly the
copy its name says, found by the NVSHMEM call-site reader that counts the dispatch's calls
(``epgen.shmem_calls``): the put modes one put (with or without a signal) inside the
message loop and one ``nvshmem_quiet`` after it; the store mode no NVSHMEM call at all, and
16-byte vector loads and stores."""

from __future__ import annotations

import pytest

from backends import nvptx
from epgen import shmem_calls
from epgen.kernels import peer_copy

MSG_BYTES, THREADS = 14592, 512


@pytest.fixture(scope="module")
def ptx():
    return nvptx.emit_ptx(peer_copy.build_peer_copy_module(MSG_BYTES, THREADS))


def sites_of(ptx, mode):
    return [(s.function, s.in_loop) for s in shmem_calls.call_sites(ptx)
            if s.kernel == peer_copy.kernel_name(mode)]


@pytest.mark.parametrize("mode, put", [("puts", "nvshmemx_putmem_nbi_warp"),
                                       ("put_signals", "nvshmemx_putmem_signal_nbi_warp")])
def test_a_put_mode_puts_in_the_loop_and_quiets_once_after_it(ptx, mode, put):
    assert sites_of(ptx, mode) == [(put, True), ("nvshmem_quiet", False)]


def test_the_store_mode_copies_with_vector_stores_and_no_nvshmem_call(ptx):
    assert sites_of(ptx, "stores") == []
    body = shmem_calls.entry_bodies(ptx)[peer_copy.kernel_name("stores")]
    assert "ld.global.v4" in body and "st.global.v4" in body


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="msg_bytes=24 must be a positive multiple of 16"):
        peer_copy.build_peer_copy("puts", 24, THREADS)
    with pytest.raises(ValueError, match="block_threads=48 must be whole warps"):
        peer_copy.build_peer_copy("puts", 32, 48)
    with pytest.raises(ValueError, match="peer copy mode 'gets'"):
        peer_copy.kernel_name("gets")
