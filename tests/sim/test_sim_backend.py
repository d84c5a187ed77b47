"""``backends.sim`` as a product backend: its stream ordering and by-value tables on tiny IR
kernels, ``EmulatedWorld(cfg, backend="sim")`` on the ``small`` preset against the
reference, the size limit, the ``backend`` argument's validation, the layering (the
package imports neither ``epgen`` nor cuda), and ``epgen run --backend sim`` on a machine
where cuda.core cannot even be imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ir
from backends import sim
from epgen import reference, routing
from epgen.presets import load_preset
from epgen.runtime import backend as backend_mod
from epgen.runtime import world as world_mod
from ir import types as T

ROOT = Path(__file__).resolve().parents[2]


# ---- the machine on tiny kernels ---------------------------------------------------------------
def _affine_module() -> ir.Module:
    """``x[0] = x[0] * mul + add`` by thread 0 of block 0 (a load then a store: two accesses
    the interpreter may preempt between)."""
    kb = ir.KernelBuilder("affine", 32)
    x = kb.param("x", T.ptr_global)
    mul = kb.param("mul", T.u32)
    add = kb.param("add", T.u32)
    with kb.role("r") as r:
        with r.if_(r.tid.eq(0) & r.block.eq(0)):
            v = r.load(x, T.u32)
            r.store(x, v * mul + add)
    return ir.Module("affine", (kb.build(),))


def _affine(machine, stream, x, mul, add):
    k = machine.load_module(_affine_module()).kernel("affine")
    k.launch(2, 32, [x, mul, add], stream)


def test_a_stream_runs_its_launches_in_order_and_host_copies_wait(seed):
    for s in range(seed, seed + 4):
        m = sim.Machine(s)
        x = m.to_device(np.array([5], np.uint32))
        st = m.create_stream()
        _affine(m, st, x, 2, 0)
        _affine(m, st, x, 1, 3)
        assert int(x.to_host()[0]) == 13, f"sim seed {s}"      # (5 * 2) + 3, not (5 + 3) * 2


def test_an_event_orders_two_streams(seed):
    """Without the event both orders (and lost updates) occur over seeds; with it, one."""
    seen = set()
    for s in range(seed, seed + 12):
        for ordered in (False, True):
            m = sim.Machine(s, preempt=0.9)
            x = m.to_device(np.array([5], np.uint32))
            a, b = m.create_stream(), m.create_stream()
            _affine(m, a, x, 2, 0)
            if ordered:
                b.wait(m.record_event(a))
            _affine(m, b, x, 1, 3)
            got = int(x.to_host()[0])
            if ordered:
                assert got == 13, f"sim seed {s}"
            else:
                seen.add(got)
    assert len(seen) > 1, f"unordered launches always gave {seen}"


def test_memory_ops_are_refused_while_capturing():
    m = sim.Machine(0)
    st = m.create_stream()
    with pytest.raises(sim.SimError, match="capturing"):
        with m.graph.capture(st):
            m.zeros(4, np.uint32)
    assert m.capture is None


def test_the_rank_table_round_trips_epgen_pack():
    """The interpreter's own reading of a by-value table is the layout
    ``epgen.runtime.rank_table.pack`` writes (a float parameter too)."""
    from epgen.runtime import rank_table
    kb = ir.KernelBuilder("k", 32)
    kb.param("p", T.ptr_global)
    kb.param("n", T.u32)
    kb.param("s", T.f32)
    with kb.role("r"):
        pass
    k = ir.batch_ranks(ir.Module("m", (kb.build(),)), 3, 2).kernel("k")
    rows = [{"p": 0x10000 + 64 * q, "n": 2**32 - 1 - q, "s": 0.5 + q} for q in range(3)]
    table = rank_table.pack(k, rows, lambda p, v: v)
    assert sim.unpack_rank_table(k, table) == rows
    with pytest.raises(TypeError, match="rank table of 8 words, needs 3 x 3"):
        sim.unpack_rank_table(k, table[:8])


def test_the_package_imports_neither_epgen_nor_cuda():
    code = ("import sys, backends.sim; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('epgen', 'cuda')); "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# ---- EmulatedWorld(cfg, backend="sim") -------------------------------------------------------
@pytest.mark.parametrize("offset", [0, 1])
def test_small_preset_on_the_simulator_matches_the_reference(offset, seed):
    seed = seed + offset
    cfg = load_preset("small")
    rng = np.random.default_rng(seed)
    world = world_mod.EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    assert isinstance(world.cuda, sim.Machine) and world.cuda.seed == seed
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    got = world.dispatch(toks, ids)
    try:
        reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: {exc}") from None
    assert sum(int(r.row_offsets[-1]) for r in got) > 0
    assert [n for n, _ in world.program.loaded.launched] == \
        ["ep_dispatch_async"] * 2 + ["ep_dispatch_wait"] * 2


def test_the_size_limit_admits_small_and_refuses_default(monkeypatch):
    small, default = load_preset("small"), load_preset("default")
    assert backend_mod.sim_work(small) == backend_mod.SMALL_PRESET_WORK == 8_704
    assert backend_mod.sim_work(small) * 10 < backend_mod.SIM_WORK_LIMIT
    assert backend_mod.sim_work(default) > 5 * backend_mod.SIM_WORK_LIMIT

    def never(*a, **k):
        raise AssertionError("the kernels were built before the size check")
    monkeypatch.setattr(world_mod, "build_module", never)
    limit = f"{backend_mod.SIM_WORK_LIMIT:,}"
    with pytest.raises(ValueError, match=rf"EmulatedWorld: backend='sim': this configuration "
                                         rf"is too large to simulate: 8 ranks x n_sms=132 x "
                                         rf"num_threads=1024 .* hid_dim=7168 .* over the "
                                         rf"simulator's limit of {limit}"):
        world_mod.EmulatedWorld(default, backend="sim")
    from epgen.runtime import p2p_world
    monkeypatch.setattr(p2p_world, "build_module", never)
    with pytest.raises(ValueError, match="P2PWorld: backend='sim': this configuration is too "
                                         "large to simulate"):
        p2p_world.P2PWorld(default, backend=sim.Machine(0, n_gpus=8))


@pytest.mark.parametrize("kwargs,message", [
    ({"backend": "gpu"}, "EmulatedWorld: backend must be one of 'cuda', 'sim' or a "
                         "backends.sim.Machine, got 'gpu'"),
    ({"backend": None}, "backend must be one of 'cuda', 'sim'"),
    ({"backend": "cuda", "sim_seed": 3}, "sim_seed=3 applies only with backend='sim'"),
    ({"backend": "sim", "sim_seed": "x"}, "sim_seed must be an integer, got 'x'"),
    ({"backend": sim.Machine(0), "sim_seed": 1}, "sim_seed applies only with backend='sim'"),
])
def test_bad_backend_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        world_mod.EmulatedWorld(load_preset("small"), **kwargs)


def test_p2p_world_refuses_a_bad_backend():
    from epgen.runtime.p2p_world import P2PWorld
    with pytest.raises(ValueError, match="P2PWorld: backend must be one of 'cuda', 'sim'"):
        P2PWorld(load_preset("small"), backend="nccl")


# ---- epgen run --backend sim -------------------------------------------------------------------
#: cuda.core and cuda.bindings made unimportable, as on a machine without them (or a driver)
NO_CUDA = "import sys; sys.modules['cuda'] = None; from epgen import cli; "


def _epgen(*argv):
    code = NO_CUDA + f"sys.exit(cli.main({list(argv)!r}))"
    env = {**os.environ, "EPGEN_TRACEBACK": ""}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=300)


def test_cli_run_sim_small_preset_without_cuda(seed):
    out = _epgen("run", "--backend", "sim", "--preset", "small", "--calls", "1",
                 "--seed", str(seed))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (f"2 emulated ranks, 32 tokens/rank, seed {seed}, simulated on the "
                        f"CPU (backends.sim)"), out.stdout
    assert len(lines) == 2 and lines[1].startswith("call 0: ")
    assert lines[1].endswith("ms (host round trip), matches the reference"), out.stdout


def test_cli_run_sim_refuses_the_default_preset():
    out = _epgen("run", "--backend", "sim", "--calls", "1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.startswith("epgen: error: EmulatedWorld: backend='sim': this "
                                 "configuration is too large to simulate"), out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize("argv,message", [
    (["--backend", "gpu"], "argument --backend: invalid choice: 'gpu'"),
])
def test_cli_run_backend_usage_errors(argv, message, capsys):
    from epgen import cli
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--preset", "small", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


TINY_SETS = ["--set", "n_experts=4", "--set", "hid_dim=16", "--set", "top_k=2",
             "--set", "max_tokens_per_rank=4", "--set", "num_threads=64", "--set", "n_sms=4"]


@pytest.mark.parametrize("argv,phrase", [
    (["--graph"], "2 emulated ranks, 4 tokens/rank, seed {seed}, each call a CUDA-graph "
                  "replay, simulated on the CPU"),
    (["--batched"], "2 emulated ranks, 4 tokens/rank, seed {seed}, every rank in one launch, "
                    "simulated on the CPU"),
    (["--fused"], "2 emulated ranks, 4 tokens/rank, seed {seed}, the fused single launch, "
                  "simulated on the CPU"),
    (["--world", "p2p", "--graph"], "2 ranks on GPUs 0,1 (P2P), 4 tokens/rank, seed {seed}, "
                                    "each call a CUDA-graph replay, simulated on the CPU"),
])
def test_cli_run_sim_options_run_as_on_a_gpu(argv, phrase, capsys, seed):
    from epgen import cli
    status = cli.main(["run", "--backend", "sim", "--preset", "small", *TINY_SETS,
                       "--calls", "2", "--seed", str(seed), *argv])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.startswith(phrase.format(seed=seed)), out
    assert out.count("matches the reference") == 2, out
