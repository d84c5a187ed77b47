"""The pointer tables a world builds after its creation (the combine's, the FP8 combine's)
are copied on each rank's stream and waited for before the builder returns. A kernel that
reads them may run on any stream: torch's streams are non-blocking and do not wait for the
default stream, so a table copied there could still be in flight when a rank thread's
first combine read it (an ``EmulatedGroup`` on a GPU: a rank's combine of zeros)."""

from __future__ import annotations

import epgen
from epgen.formats import make_format


def test_combine_tables_are_copied_on_rank_streams_and_waited_for(monkeypatch):
    R = 2
    cfg = epgen.EPConfig(num_threads=64, n_sms=5, n_experts=2 * R, n_ranks=R,
                         max_tokens_per_rank=4, p2p_world_size=R, use_shmem=False,
                         token_fmt=make_format("BF16", 256, 2))
    world = epgen.EmulatedWorld(cfg, backend="sim")
    rank_streams = {id(rk.stream) for rk in world.ranks}
    log = []
    to_device, synchronize = world.cuda.to_device, world.synchronize

    def logged_to_device(host, *args, **kw):
        log.append(("copy", kw.get("stream")))
        return to_device(host, *args, **kw)

    def logged_synchronize():
        log.append(("sync", None))
        return synchronize()
    monkeypatch.setattr(world.cuda, "to_device", logged_to_device)
    monkeypatch.setattr(world, "synchronize", logged_synchronize)
    world.prepare_combine(fp8=True)
    copies = [s for what, s in log if what == "copy"]
    assert copies, "the combine built no table"
    assert all(s is not None and id(s) in rank_streams for s in copies), \
        f"a table copied off its rank's stream: {copies}"
    assert log[-1][0] == "sync", f"no synchronise after the last table copy: {log}"
