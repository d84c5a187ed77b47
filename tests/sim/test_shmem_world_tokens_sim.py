"""DeepEP's normal mode on ``ShmemWorld`` (one process per PE; what ``Buffer`` runs on a
process group through ``ShmemSource.normal_port``), on the CPU with two PEs' worlds in one
process (tests/sim/test_shmem_world.py's fake NVSHMEM host and bootstrap): the deduplicated
send, the token-major receive and the normal-mode combine of each PE against
``epgen.reference_tokens`` bit for bit over consecutive calls; the weight slots the
destinations store into are symmetric allocations reached through ``nvshmem_ptr``, and the
PEs meet once after building the combine sides."""

from __future__ import annotations

import numpy as np

from epgen.reference_tokens import normal_combine

from test_dispatch_tokens_sim import check_rank, draw_inputs, make_cfg
from test_shmem_world import SymmetricMachine, collectively, make_worlds


def receive(world, toks, ids, weights):
    """This PE's dispatch of its own inputs, received token-major (``NormalDevicePort.send``
    on the GPU: dispatch_async, then ep_dispatch_wait_tokens)."""
    r = world.rank
    rcv = world.token_receiver()
    world.load_inputs(toks[r], ids[r])
    world.load_weights(world.check_weights(weights[r], ids[r]))
    world.dispatch_async()
    rcv.enqueue()
    return rcv.finish()[0]


def test_two_pes_dispatch_and_combine_token_major(seed):
    cfg = make_cfg(R=2, L=2, K=2)
    machine = SymmetricMachine(seed % 1000)
    log = []
    worlds = make_worlds(cfg, machine, log)
    try:
        _dispatch_and_combine(cfg, machine, log, worlds, seed)
    finally:
        for w in worlds:
            w.close()


def _dispatch_and_combine(cfg, machine, log, worlds, seed):
    built, errors = collectively(machine, worlds, [w.token_combiner for w in worlds])
    assert errors == [None, None], errors
    # each PE meets the other once per side, after arming it
    assert sorted(e for e in log if e[0] == "barrier" and e[2].startswith("combine")) == \
        [("barrier", pe, name) for pe in (0, 1)
         for name in ("combine-ready", "combine-tokens-ready")]
    for w, tc in zip(worlds, built):
        assert any(a.ptr == tc.weight_slots[0].ptr for a in w.pool.allocs), \
            f"PE {w.rank}: the weight slots are not a symmetric allocation"
        table = list(np.asarray(tc.weight_ptrs[0].to_host()))
        assert table == [b.weight_slots[0].ptr for b in built], f"PE {w.rank}"
    rng = np.random.default_rng(seed)
    H, K = cfg.token_fmt.hid_dim, cfg.token_fmt.top_k
    for call in range(3):
        toks, ids = draw_inputs(rng, cfg)
        ws = [rng.standard_normal(i.shape).astype(np.float32) for i in ids]
        got, errors = collectively(machine, worlds, [
            (lambda w=w: receive(w, toks, ids, ws)) for w in worlds])
        assert errors == [None, None], errors
        for d in range(2):
            check_rank(cfg, got[d], toks, ids, d, 0, ws)
        xs = [(rng.integers(0, 1 << 14, (g.n_rows, H)) ^ 0x3000).astype(np.uint16) for g in got]
        rw = [rng.standard_normal((g.n_rows, K)).astype(np.float32) for g in got]
        out, errors = collectively(machine, worlds, [
            (lambda w=w: w.token_combiner().run([xs[w.rank]], [rw[w.rank]])[0])
            for w in worlds])
        assert errors == [None, None], errors
        want = normal_combine(cfg.n_experts, ids, [g.src for g in got], xs, rw)
        for s in range(2):
            np.testing.assert_array_equal(out[s][0], want[s][0],
                                          err_msg=f"seed {seed} call {call} PE {s}")
            np.testing.assert_array_equal(out[s][1], want[s][1],
                                          err_msg=f"seed {seed} call {call} PE {s} weights")
