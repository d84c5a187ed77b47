"""GPU tests of the three demo kernels (``epgen.demos``) against numpy, on fresh random data."""

from __future__ import annotations

import time

import numpy as np
import pytest

from epgen.errors import EPTimeoutError

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def runner():
    from epgen.runtime.demo_runs import DemoRunner
    return DemoRunner()


@pytest.mark.parametrize("n_bytes", [16, 4096, 16 * 12345, 64 << 20])
def test_copy16_copies_every_byte(runner, seed, n_bytes):
    from backends import cuda
    rng = np.random.default_rng(seed)
    host = rng.integers(0, 2**32, n_bytes // 4, dtype=np.uint32)
    src = cuda.to_device(host)
    dst = cuda.empty(n_bytes // 4 + 4, np.uint32)
    dst.fill_bytes(0xA5)                           # poison, including a guard past the end
    runner.copy16(dst, src, n_bytes)
    got = dst.to_host()
    np.testing.assert_array_equal(got[:-4], host, err_msg=f"seed {seed}")
    assert (got[-4:] == 0xA5A5A5A5).all(), "copy16 wrote past n_bytes"


@pytest.mark.parametrize("n_producers,n_consumers,chunk", [(1, 1, 256), (4, 8, 1000), (16, 16, 4096)])
def test_producer_consumer(runner, seed, n_producers, n_consumers, chunk):
    s = seed & 0xFFFFFFFF
    got, want = runner.producer_consumer(n_producers, n_consumers, chunk, s, epoch=1 + seed % 7)
    np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")


@pytest.mark.parametrize("n_blocks", [1, 4])
def test_handshake_two_streams(runner, seed, n_blocks):
    rng = np.random.default_rng(seed)
    n = 4 * n_blocks * 300
    payloads = [rng.integers(0, 2**32, n, dtype=np.uint32) for _ in range(2)]
    out = runner.handshake(payloads, n_blocks, epochs=3)
    np.testing.assert_array_equal(out[0], payloads[1], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(out[1], payloads[0], err_msg=f"seed {seed}")


def test_handshake_missing_peer_times_out(runner, seed):
    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 2**32, 4 * 2 * 64, dtype=np.uint32) for _ in range(2)]
    deadline_ns = 200_000_000
    t0 = time.monotonic()
    with pytest.raises(EPTimeoutError) as info:
        runner.handshake(payloads, n_blocks=2, launch_ranks=(0,), timeout_ns=deadline_ns)
    elapsed = time.monotonic() - t0
    assert elapsed < 5.0, f"timeout took {elapsed:.1f}s"
    recs = info.value.records
    assert recs, "no diagnostic record"
    for rec in recs:
        assert (rec.kernel, rec.role, rec.buffer, rec.rank) == ("handshake", "receive", "arrivals", 0)
        assert rec.expected == 2 and rec.last_seen == 0 and rec.thread == 0
        assert rec.elapsed_ns >= deadline_ns
    assert {r.block for r in recs} <= {0, 1}
    assert "handshake/receive rank 0" in str(info.value) and "arrivals[0]" in str(info.value)
