"""``epgen.deepep``'s host side: every argument DeepEP's API would reject (and every one
epgen cannot serve yet) is refused with an ``EPInputError`` naming it before any world is
made or anything enqueued (the combine's wait statistics, checked after the handle:
tests/sim/test_deepep_wait_cost_sim.py); DeepEP's static helpers, ``Config``, the handle's tuple behaviour
and the module alias engines import."""

from __future__ import annotations

import importlib.util
import sys
import weakref

import pytest

torch = pytest.importorskip("torch")

import epgen.deepep as deep_ep  # noqa: E402
from epgen.deepep.handle import LowLatencyHandle  # noqa: E402
from epgen.deepep.shapes import LowLatencyShape  # noqa: E402
from epgen.errors import EPInputError  # noqa: E402

R, E, T, H, K = 2, 4, 4, 256, 2


@pytest.fixture
def group():
    return deep_ep.EmulatedGroup(R, backend="sim")


@pytest.fixture
def buf(group):
    return deep_ep.Buffer(group.rank(0), low_latency_mode=True)


def inputs(T=T, H=H, K=K, dtype=torch.bfloat16, ids_dtype=torch.int64):
    x = torch.zeros((T, H), dtype=dtype)
    idx = torch.arange(T * K, dtype=torch.int64).view(T, K) % E
    return x, idx.to(ids_dtype)


def refused(buf, group, match, *args, **kwargs):
    with pytest.raises(EPInputError, match=match):
        buf.low_latency_dispatch(*args, **kwargs)
    assert group.shapes_in_use() == [], "a refused call made a world"


def test_dispatch_arguments_deepep_rejects_are_refused_by_name_before_a_world_is_made(buf,
                                                                                      group):
    x, idx = inputs()
    refused(buf, group, r"^x: dtype torch.float32", *inputs(dtype=torch.float32), T, E)
    refused(buf, group, r"^x: 3 dimensions", x.view(2, 2, H), idx, T, E)
    refused(buf, group, r"^x: must be contiguous", torch.zeros((H, T), dtype=torch.bfloat16).t(),
            idx, T, E)
    refused(buf, group, r"^topk_idx: dtype torch.float32", x, idx.float(), T, E)
    refused(buf, group, r"^topk_idx: 3 rows", x, idx[:3], T, E)
    refused(buf, group, r"^x: 4 tokens, more than num_max_dispatch_tokens_per_rank \(3\)",
            x, idx, 3, E)
    refused(buf, group, r"^num_max_dispatch_tokens_per_rank: must be an int", x, idx, 4.0, E)
    refused(buf, group, r"^num_experts: 5 must be a positive multiple", x, idx, T, 5)
    refused(buf, group, r"^use_ue8m0: UE8M0 scales need round_scale", x, idx, T, E,
            use_fp8=True, use_ue8m0=True)
    refused(buf, group, r"^x: hidden 136 must be a multiple of 128 with use_fp8",
            *inputs(H=136), T, E, use_fp8=True)
    refused(buf, group, r"^x: hidden 256 must be a multiple of 512 with use_fp8 and use_ue8m0",
            x, idx, T, E, use_fp8=True, round_scale=True, use_ue8m0=True)
    refused(buf, group, r"^x: hidden 12 must be a multiple of 8", *inputs(H=12), T, E,
            use_fp8=False)
    refused(buf, group, r"^topk_idx: top-k 5 must be <= num_experts", *inputs(K=5), T, E)
    refused(buf, group, r"^cumulative_local_expert_recv_stats: dtype torch.int64", x, idx, T, E,
            cumulative_local_expert_recv_stats=torch.zeros(2, dtype=torch.int64))
    refused(buf, group, r"^cumulative_local_expert_recv_stats: shape \(3,\)", x, idx, T, E,
            cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32))
    refused(buf, group, r"^dispatch_wait_recv_cost_stats: shape \(2, 2\)", x, idx, T, E,
            dispatch_wait_recv_cost_stats=torch.zeros((R, R), dtype=torch.int64))
    refused(buf, group, r"^dispatch_wait_recv_cost_stats: dtype torch.int32", x, idx, T, E,
            dispatch_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int32))


def test_construction_refuses_what_it_cannot_serve(group):
    with pytest.raises(EPInputError, match=r"^comm: an MPI communicator"):
        deep_ep.Buffer(None, comm=object())
    with pytest.raises(EPInputError, match=r"^enable_shrink: rank masks"):   # simulator only
        deep_ep.Buffer(deep_ep.EmulatedGroup(R, backend="cuda").rank(0), low_latency_mode=True,
                       enable_shrink=True)
    with pytest.raises(EPInputError, match=r"^group: required"):
        deep_ep.Buffer(None)
    normal = deep_ep.Buffer(group.rank(0))
    with pytest.raises(EPInputError, match=r"needs low_latency_mode=True"):
        normal.low_latency_dispatch(*inputs(), T, E)
    with pytest.raises(EPInputError, match=r"^handle: must be the handle .* normal-mode"):
        normal.combine(torch.zeros((1, 8), dtype=torch.bfloat16), None)


def test_combine_refuses_logfmt_and_foreign_handles(buf, group):
    x = torch.zeros((2, R * T, H), dtype=torch.bfloat16)
    _, idx = inputs()
    w = torch.ones((T, K))
    with pytest.raises(EPInputError, match=r"^use_logfmt"):
        buf.low_latency_combine(x, idx, w, None, use_logfmt=True)
    with pytest.raises(EPInputError, match=r"^handle: must be the handle low_latency_dispatch "
                                           r"returned, got tuple"):
        buf.low_latency_combine(x, idx, w, (None, None, T, H, E))
    assert group.shapes_in_use() == []


def test_deepeps_static_helpers(group):
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert hint == deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=128, hidden=7168, num_ranks=8, num_experts=256)
    # at least the two slots' BF16 output rows (32 experts x 1024 rows x 7168 x 2 bytes)
    assert hint >= 2 * 32 * 8 * 128 * 7168 * 2
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(256, 7168, 8, 256) > hint
    cfg = deep_ep.Buffer.get_dispatch_config(8)
    assert isinstance(cfg, deep_ep.Config)
    assert cfg.get_nvl_buffer_size_hint(7168 * 2, 8) == 0
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert deep_ep.Config(24, 6, 256, 6, 128).num_sms == 24
    with pytest.raises(EPInputError, match="must be even"):
        deep_ep.Buffer.set_num_sms(21)
    b = deep_ep.Buffer(group.rank(1), 2 << 30, hint, low_latency_mode=True,
                       num_qps_per_rank=E // R, allow_mnnvl=True)
    assert (b.rank, b.group_size, b.low_latency_mode, b.num_rdma_bytes) == (1, R, True, hint)
    assert b.ignored_arguments["num_nvl_bytes"] == 2 << 30
    assert weakref.ref(b)() is b           # engines cache buffers in a WeakValueDictionary
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        b.destroy()
    d = deep_ep.Buffer(group.rank(0), low_latency_mode=True, explicitly_destroy=True)
    d.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        d.low_latency_dispatch(*inputs(), T, E)
    assert deep_ep.topk_idx_t is torch.int64


def test_the_handle_unpacks_and_indexes_as_deepeps_tuple_and_computes_layout_range_once():
    calls = []
    shape = LowLatencyShape(R, E, T, H, K, "BF16")
    h = LowLatencyHandle("src", lambda: calls.append(1) or "range", shape, owner=None, slot=1,
                         generation=3)
    assert len(h) == 5 and calls == []
    src, lr, t_max, hidden, experts = h
    assert (src, lr, t_max, hidden, experts) == ("src", "range", T, H, E)
    assert h[1] == h[-4] == h.layout_range == "range" and calls == [1]
    assert h[0] == "src" and h[2:] == (T, H, E)


def test_install_as_deep_ep_makes_the_engines_import_find_this_module(monkeypatch):
    monkeypatch.delitem(sys.modules, "deep_ep_test_alias", raising=False)
    deep_ep.install_as_deep_ep("deep_ep_test_alias")
    try:
        import deep_ep_test_alias
        assert deep_ep_test_alias.Buffer is deep_ep.Buffer
        assert importlib.util.find_spec("deep_ep_test_alias") is not None
        monkeypatch.setitem(sys.modules, "deep_ep_other", sys)
        with pytest.raises(RuntimeError, match="already imported"):
            deep_ep.install_as_deep_ep("deep_ep_other")
    finally:
        sys.modules.pop("deep_ep_test_alias", None)


class FakeProcessGroup:
    """What a buffer reads of a process group before it bootstraps: ``rank()``, ``size()``."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_a_process_group_with_peers_outside_the_p2p_group_is_refused_until_puts_take_the_layout():
    with pytest.raises(EPInputError, match=r"^allow_nvlink_for_low_latency_mode=False: every "
                                           r"rank of the group must be in one P2P group"):
        deep_ep.Buffer(FakeProcessGroup(0, 2), low_latency_mode=True,
                       allow_nvlink_for_low_latency_mode=False)
    with pytest.raises(EPInputError, match=r"^p2p_world_size=2: every rank"):
        deep_ep.Buffer(FakeProcessGroup(1, 4), low_latency_mode=True, p2p_world_size=2)
    with pytest.raises(EPInputError, match=r"^p2p_world_size: 3 must divide the group size"):
        deep_ep.Buffer(FakeProcessGroup(1, 4), low_latency_mode=True, p2p_world_size=3)


def test_an_emulated_group_on_a_gpu_waits_long_by_default():
    """The rank threads call at their own pace: on a GPU the kernels' waits default to
    ``GPU_TIMEOUT_NS`` (not the configuration's 2 s, which a peer thread's host work between
    calls outlasts); the simulator keeps the configuration's; a given value is kept."""
    from epgen.deepep import emulated as em
    assert em.GPU_TIMEOUT_NS >= 30_000_000_000
    assert deep_ep.EmulatedGroup(2, backend="cuda").timeout_ns == em.GPU_TIMEOUT_NS
    assert deep_ep.EmulatedGroup(2, backend="sim").timeout_ns is None
    assert deep_ep.EmulatedGroup(2, backend="cuda", timeout_ns=5).timeout_ns == 5


def test_an_emulated_group_on_a_gpu_leaves_room_on_the_sms(monkeypatch):
    """Unless told, every rank's grid together is one block per SM (``default_gpu_grid``):
    a peer's send queued behind its thread's torch ops must find SMs that the other ranks'
    spinning receive kernels do not hold. Four ranks on a 132-SM GPU get 33 blocks each
    (66, two blocks per SM per rank's share, stalled); a rank count above the SM count gets
    one block; a given ``n_sms`` is kept."""
    import backends.cuda
    from epgen.deepep import emulated as em
    monkeypatch.setattr(backends.cuda, "sm_count", lambda device=None: 132)
    shape = LowLatencyShape(4, 64, 128, 7168, 8, "BF16")
    assert deep_ep.EmulatedGroup(4, backend="cuda").grid(shape)[0] == 33
    assert deep_ep.EmulatedGroup(8, backend="cuda").grid(shape)[0] == 16
    assert em.default_gpu_grid(132, 200) == 1
    assert deep_ep.EmulatedGroup(4, backend="cuda", n_sms=40).grid(shape)[0] == 40


def test_shrink_on_a_process_group_masks_every_low_latency_world(monkeypatch):
    """A process group's shrink mode (``ShmemSource``, worlds faked): a rank masked by the
    buffer is masked in the view of every low-latency world this rank has (not the normal
    mode's) and in every world made afterwards; the query adds what the worlds' kernels
    masked; clean unmasks everywhere. Each call first drains this rank's stream."""
    import types

    import numpy as np

    from epgen.deepep import shmem_source

    class FakeWorld:
        def __init__(self, cfg, **kw):
            self.cfg, self.kw, self.calls, self.view = cfg, kw, [], np.zeros(4, np.int32)

        def update_mask(self, q, masked=True):
            self.calls.append(("update", q, masked))

        def query_mask(self, rank):
            return self.view

        def clean_mask(self):
            self.calls.append(("clean",))

    drained = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a: types.SimpleNamespace(synchronize=lambda: drained.append(1)))
    monkeypatch.setattr(shmem_source, "ShmemWorld", FakeWorld)
    monkeypatch.setattr(shmem_source, "DevicePort",
                        lambda torch_, world, rank: types.SimpleNamespace(world=world))
    src = object.__new__(shmem_source.ShmemSource)
    src.rank, src.size, src.p2p_world_size = 1, 4, 4
    src.n_sms = src.num_threads = src.timeout_ns = None
    src.session, src.ports, src.shrink, src.masked = None, {}, True, set()
    class Shape:                     # hashable, as NormalShape and LowLatencyShape are
        @staticmethod
        def config(**kw):
            return kw
    shape = Shape()
    first = src.port(torch, shape, 0).world
    assert first.cfg["rank_mask"] is True and first.kw["shrink"] is True
    normal = FakeWorld({})
    src.ports[("normal", shape, 0)] = types.SimpleNamespace(world=normal)
    src.update_mask(2, True)
    assert first.calls == [("update", 2, True)] and normal.calls == []
    later = src.port(torch, shape, 1).world
    assert later.calls == [("update", 2, True)]          # made after: starts masked
    first.view[3] = 1                                      # its kernels masked rank 3
    assert src.masked_ranks() == {2, 3}
    src.clean_mask()
    assert first.calls[-1] == later.calls[-1] == ("clean",) and src.masked == set()
    assert len(drained) == 3


def test_a_known_dispatch_shape_still_checks_every_call():
    """``dispatch_shape`` with the buffer's ``known`` shapes: a repeated call gets the same
    shape object, yet the tensors and the token count are checked on every call and other
    scalar arguments are checked as on a first call."""
    from epgen.deepep import shapes
    known = {}
    x, idx = torch.zeros((T, H), dtype=torch.bfloat16), torch.zeros((T, K), dtype=torch.int64)
    kw = dict(n_ranks=R, use_fp8=False, round_scale=False, use_ue8m0=False, on_cuda=False,
              known=known)
    first = shapes.dispatch_shape(torch, x, idx, T, E, **kw)
    assert shapes.dispatch_shape(torch, x, idx, T, E, **kw) is first and len(known) == 1
    with pytest.raises(EPInputError, match=r"^x: 5 tokens, more than"):
        shapes.dispatch_shape(torch, torch.zeros((T + 1, H), dtype=torch.bfloat16),
                              torch.zeros((T + 1, K), dtype=torch.int64), T, E, **kw)
    with pytest.raises(EPInputError, match=r"^topk_idx: dtype torch.float32"):
        shapes.dispatch_shape(torch, x, idx.float(), T, E, **kw)
    with pytest.raises(EPInputError, match=r"^num_experts: 5 must be a positive multiple"):
        shapes.dispatch_shape(torch, x, idx, T, 5, **kw)
    with pytest.raises(EPInputError, match=r"^use_ue8m0: UE8M0 scales need round_scale"):
        shapes.dispatch_shape(torch, x, idx, T, E, **{**kw, "use_ue8m0": True,
                                                       "use_fp8": True})
    assert len(known) == 1
