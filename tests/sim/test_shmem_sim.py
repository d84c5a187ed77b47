"""``use_shmem`` with destinations outside the sender's P2P group, on the CPU: the kernels'
NVSHMEM calls (``ir.nvshmem``) run in the simulator's model (``backends.sim.shmem``: every
rank a PE, every put and signal landing rounds late in any order NVSHMEM allows, a
put-with-signal's signal after its data) against the numpy reference, every format, all
ranks remote (``p2p_world_size = 1``) and mixed (4 ranks in groups of 2), ORD-R, the fused
kernel, back-to-back calls; which destinations get NVSHMEM calls and where (a warp's
put-with-signal per remote slot, one quiet per warp per call); that each ordering step the
protocol needs is caught when removed; the send policy; the sim's extern-call rules.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import epgen
import ir
from ir import nvshmem
from backends import sim as sim_backend
from backends.sim import shmem as sim_shmem
from epgen import reference, routing
from epgen.formats import make_format
from epgen.kernels import send_policy, shmem_send
from epgen.ordering import mutations

import format_cases
from cli_runs import run_cli
from sim_world import sim_world
from world_checks import checked_calls

FORMATS = [(f, 256) for f in format_cases.PLAIN] + format_cases.sim_cases()
#: (n_ranks, p2p_world_size): every peer remote, and mixed
GROUPS = {"p2p1": (2, 1), "mixed": (4, 2)}
ORD_R = {"ep_ord_r": True, "has_rank_flag": True}
NVSHMEM_CALLS = ("nvshmemx_putmem_signal_nbi_warp", "nvshmem_quiet", "nvshmemx_signal_op")


def make_cfg(fmt="BF16", H=256, R=2, P=1, **flags):
    L = 2
    return epgen.EPConfig(num_threads=64, n_sms=R + 2, n_experts=L * R, n_ranks=R,
                          max_tokens_per_rank=4, p2p_world_size=P,
                          use_shmem=flags.pop("use_shmem", True),
                          token_fmt=make_format(fmt, H, 2), **flags)


def run_calls(cfg, seed, n_calls=3, **world_kwargs):
    """``n_calls`` round trips on the simulator against the reference, the first with every
    rank full; the failure names the seed and the call."""
    rng = np.random.default_rng(seed)

    def counts(call):
        drawn = [int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
        return [cfg.max_tokens_per_rank] * cfg.n_ranks if call == 0 else drawn

    with sim_world(cfg, seed, **world_kwargs) as world:
        for _ in checked_calls(world, rng, f"{seed} ({cfg.token_fmt.name})", counts, n_calls,
                               graph=False):
            pass
        return world


def calls_in(kernel: ir.Kernel) -> list[str]:
    """The extern function names a kernel calls, in statement order."""
    return [name for name, _, _ in call_sites(kernel)]


def call_sites(kernel: ir.Kernel) -> list[tuple[str, str, int]]:
    """``(function, role, loops around it)`` of every extern call of ``kernel``, in statement
    order (``loops``: the ``For`` / ``While`` bodies it is nested in)."""
    out = []

    def walk(stmts, role, depth):
        for s in stmts:
            if isinstance(s, ir.nodes.Call):
                out.append((s.name, role, depth))
            inner = depth + isinstance(s, (ir.nodes.For, ir.nodes.While))
            for attr in ("then", "orelse", "body"):
                walk(getattr(s, attr, None) or (), role, inner)
    for role in kernel.roles:
        walk(role.body, role.name, 0)
    return out


# ---- round trips ---------------------------------------------------------------------------

@pytest.mark.parametrize("group", GROUPS, ids=list(GROUPS))
@pytest.mark.parametrize("fmt,H", FORMATS, ids=[f for f, _ in FORMATS])
def test_round_trips_match_reference(fmt, H, group, seed):
    R, P = GROUPS[group]
    run_calls(make_cfg(fmt, H, R, P), seed)


@pytest.mark.parametrize("fmt,H", [("BF16", 256), ("NVFP4", 64)], ids=["BF16", "NVFP4"])
def test_ord_r_mixed_matches_reference(fmt, H, seed):
    run_calls(make_cfg(fmt, H, 4, 2, **ORD_R), seed)


def test_ord_r_all_remote_and_send_join_named(seed):
    run_calls(make_cfg(R=2, P=1, ep_send_join_named=True, **ORD_R), seed)


def test_fused_kernel_mixed(seed):
    run_calls(make_cfg(R=4, P=2), seed, fused=True)


def test_several_seeds_back_to_back(seed):
    for s in range(3):
        run_calls(make_cfg(R=4, P=2), seed + s, n_calls=2)


# ---- which destinations get NVSHMEM calls ----------------------------------------------------

def test_calls_only_with_remote_destinations():
    remote = epgen.build_module(make_cfg(R=4, P=2))
    for k in remote.kernels:
        names = calls_in(k)
        # receiving: only the consistency step after the arrival polls
        receives = ["nvshmem_signal_wait_until"] if k.name != "ep_dispatch_async" else []
        if k.name == "ep_dispatch_wait":
            assert names == receives, names
        else:
            assert set(names) == set(NVSHMEM_CALLS) | set(receives), (k.name, names)
            sites = call_sites(k)
            # the put-with-signal in the send loops; no quiet in any loop: one per warp (after
            # its last token) and one per monitor lane (after its count signal)
            assert [d for n, _, d in sites if n == "nvshmemx_putmem_signal_nbi_warp"] == [2]
            assert [d for n, _, d in sites if n == "nvshmem_quiet"] == [0, 0], sites
            assert names.count("nvshmemx_signal_op") == 1
    # use_shmem with every destination in the group: the P2P kernels, no call at all
    for cfg in (make_cfg(R=2, P=2), make_cfg(R=4, P=4, **ORD_R)):
        same = epgen.build_module(cfg)
        assert all(calls_in(k) == [] for k in same.kernels)
        text = ir.print_module(same)
        assert text == ir.print_module(epgen.build_module(cfg.replace(use_shmem=False)))


def test_puts_and_signals_go_to_remote_pes_only(seed, monkeypatch):
    """Every put and signal the kernels issue targets a PE outside the issuer's group; one
    put per remote (token, k) pair, each with its signal on the arrival word of its block,
    and one count signal per (remote destination, expert)."""
    seen = []
    translate = sim_shmem.SymmetricHeap.translate

    def record(heap, addr, pe, nbytes=1):
        src, name, off = heap.locate(addr, nbytes)
        if name == "recv_count":
            name = "arrival" if off // 8 >= cfg.layout.shmem_arrival_base else "count"
        seen.append((name, src, int(pe)))
        return translate(heap, addr, pe, nbytes)
    monkeypatch.setattr(sim_shmem.SymmetricHeap, "translate", record)
    cfg = make_cfg(R=4, P=2)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, [cfg.max_tokens_per_rank] * cfg.n_ranks)
    with sim_world(cfg, seed) as world:
        reference.assert_match(cfg, reference.dispatch(cfg, toks, ids),
                               world.dispatch(toks, ids))
    P, L = cfg.p2p_world_size, cfg.layout.n_local_experts
    assert seen and all(src // P != dst // P for _, src, dst in seen), seen
    puts = sorted((s, d) for n, s, d in seen if n == "recv_buf")
    want = sorted((src, int(g) // L) for src, x in enumerate(ids) for g in np.ravel(x)
                  if src // P != int(g) // L // P)
    assert puts == want
    assert sorted((s, d) for n, s, d in seen if n == "arrival") == want
    signals = sorted((s, d) for n, s, d in seen if n == "count")
    assert signals == sorted((s, d) for s in range(4) for d in range(4) if s // P != d // P
                             for _ in range(L))


def test_missing_quiet_is_caught(seed, monkeypatch):
    """Without the quiets the puts and signals are never completed: NVSHMEM promises nothing
    at a kernel's end, so the simulator fails a thread that exits with operations issued
    after its last quiet, landed or not, instead of passing by luck."""
    monkeypatch.setattr(nvshmem, "quiet", lambda r: None)
    cfg = make_cfg(R=2, P=1)
    with pytest.raises(sim_backend.SimError, match="never completed"):
        run_calls(cfg, seed, n_calls=1)


# ---- send policy -----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,H", FORMATS, ids=[f for f, _ in FORMATS])
def test_send_policy_takes_the_send_buffer_path(fmt, H):
    # a prefill-sized call, where the formats that prefer it take the block-staged broadcast
    big = dict(max_tokens_per_rank=16 * 6)
    cfg = make_cfg(fmt, H, R=4, P=2).replace(**big)
    assert cfg.needs_shmem
    assert not send_policy.uses_warp_send(cfg) and not send_policy.uses_block_broadcast(cfg)
    assert not send_policy.sends_from_every_block(cfg)
    p2p = make_cfg(fmt, H, R=4, P=4).replace(**big)
    assert not p2p.needs_shmem
    assert send_policy.uses_warp_send(p2p) or send_policy.uses_block_broadcast(p2p)


# ---- the simulator's rules -----------------------------------------------------------------

def test_unknown_extern_call_is_a_clear_error():
    kb = ir.KernelBuilder("k", 32)
    with kb.role("main") as r:
        r.call("mystery_fn", [ir.Const(1, ir.types.u32)])
    machine = sim_backend.Machine(0)
    kernel = machine.load_module(ir.Module("m", (kb.build(),))).kernel("k")
    kernel.launch(1, 32, ())
    with pytest.raises(sim_backend.SimError, match="'mystery_fn'"):
        machine.drain()


def test_symmetric_heap_translation():
    heap = sim_shmem.SymmetricHeap()
    heap.register(0, "buf", 1000, 64)
    heap.register(1, "buf", 5000, 64)
    heap.register(1, "other", 9000, 8)
    assert heap.translate(1010, 1, 8) == 5010 and heap.translate(5010, 0, 8) == 1010
    with pytest.raises(sim_backend.SimError, match="no registered symmetric buffer"):
        heap.translate(1060, 1, 8)          # runs past the buffer
    with pytest.raises(sim_backend.SimError, match="PE 0 has no symmetric buffer 'other'"):
        heap.translate(9000, 0, 8)


# ---- the command line ----------------------------------------------------------------------

SHMEM_RUNS = {
    "p2p1-BF16": ["--set", "p2p_world_size=1", "--calls", "2"],
    **{f"mixed-{f}": ["--set", "n_ranks=4", "--set", "p2p_world_size=2", "--set", f"format={f}"]
       + (["--set", "hid_dim=384"] if f == "BlockwiseFP8" else []) + ["--tokens", "12"]
       for f, _ in FORMATS},
    "mixed-ord_r": ["--set", "n_ranks=4", "--set", "p2p_world_size=2", "--set",
                    "ep_ord_r=true", "--set", "has_rank_flag=true", "--tokens", "12"],
}


@pytest.mark.parametrize("name", SHMEM_RUNS, ids=list(SHMEM_RUNS))
def test_cli_run_sim_shmem(name, capsys, seed):
    status, out, err = run_cli(capsys, "run", "--backend", "sim", "--preset", "small",
                               "--set", "use_shmem=true", *SHMEM_RUNS[name], "--seed",
                               str(seed))
    assert status == 0, out + err
    calls = [line for line in out.splitlines() if line.startswith("call ")]
    assert calls and all(line.endswith("matches the reference") for line in calls), out
    assert "no NVSHMEM call" not in err


@pytest.mark.parametrize("command", ["ptx", "inspect"])
def test_cli_notes_use_shmem_without_remote_destinations(command, capsys):
    status, out, err = run_cli(capsys, command, "--preset", "small", "--set", "use_shmem=true",
                               "--set", "n_experts=8")
    assert err.count("note: use_shmem=true but every destination is in the P2P group: no "
                     "NVSHMEM call") == 1, err
    assert "nvshmem" not in out
    if command == "inspect":
        assert "effective flags" in out and "no NVSHMEM call" in out


def test_cli_use_shmem_false_with_remote_destinations_is_a_usage_error(capsys):
    status, _, err = run_cli(capsys, "ptx", "--preset", "small", "--set", "p2p_world_size=1")
    assert status == 2 and "use_shmem=False with p2p_world_size=1 < n_ranks=2" in err


def failing_seeds(cfg, monkeypatch, transform, seeds=range(4), **world_kwargs) -> int:
    """How many of ``seeds`` fail a one-call run whose modules are built through
    ``transform`` (a wrong result or a hang: a wait that polls too long)."""
    from epgen.runtime import world as world_mod
    build = world_mod.build_module
    monkeypatch.setattr(world_mod, "build_module", lambda c: transform(build(c)))
    failures = 0
    for s in seeds:
        try:
            run_calls(cfg, s, n_calls=1, max_spins=3000, **world_kwargs)
        except (AssertionError, sim_backend.SimHang):
            failures += 1
    return failures


def test_unordered_signal_is_caught(monkeypatch):
    """The put-with-signal is the one ordering between a message and its arrival count:
    split into the same put and a plain signal by lane 0 (which NVSHMEM does not order after
    the put), some seed's destination copies a row that has not landed. The fused kernel,
    where a rank's copy runs while its peers still send (standalone, a rank's dispatch_wait
    starts after its own sends are quieted, which narrows the window)."""
    def split(module):
        found = [oid for k in module.kernels for oid, _ in mutations.ordered_ops(k)
                 if oid.endswith("nvshmemx_putmem_signal_nbi_warp")]
        assert found
        for oid in reversed(found):     # the last first: the others' indices stay
            module = mutations.mutate(module, oid, "unordered")
        return module
    assert failing_seeds(make_cfg(R=4, P=1), monkeypatch, split, fused=True) >= 2


def test_missing_arrival_wait_is_caught(monkeypatch):
    """Without the wait for the arrival words the destination takes a remote count word as
    the rows' arrival: some seed copies a row that has not landed (the fused kernel, as
    above)."""
    monkeypatch.setattr(shmem_send, "wait_remote_arrivals", lambda *a, **k: None)
    from epgen.kernels import dispatch_wait, ord_r
    monkeypatch.setattr(dispatch_wait, "wait_remote_arrivals", lambda *a, **k: None)
    monkeypatch.setattr(ord_r, "wait_remote_arrivals", lambda *a, **k: None)
    assert failing_seeds(make_cfg(R=4, P=1), monkeypatch, lambda m: m, fused=True) >= 2


#: the function a ``call.uni`` calls (after its return parameter, when it has one)
CALLED = r"call\.uni (?:\([^)]*\),\s*)?(\w+),"


def test_ptx_calls_nvshmem_in_the_send_kernels_only():
    """The PTX of the mixed variant: the three NVSHMEM functions declared ``.extern .func``
    and called (``call.uni``) in ``ep_dispatch_async`` and ``ep_dispatch``: one put-with-signal
    and one signal, two quiets (the comm warps', the monitor's); ``ep_dispatch_wait`` (and
    the fused ``ep_dispatch``'s receiving part) only the consistency step
    ``nvshmem_signal_wait_until``; the P2P build of the same ranks calls nothing."""
    from backends import nvptx
    ptx = nvptx.emit_ptx(epgen.build_module(make_cfg(R=4, P=2)))
    for name in NVSHMEM_CALLS:
        assert f".extern .func {name}" in ptx
    bodies = dict(re.findall(r"\.entry (\w+)\((.*?)\n}\n", ptx, re.S))
    assert set(bodies) == {"ep_dispatch_async", "ep_dispatch_wait", "ep_dispatch"}
    wait = ("nvshmem_signal_wait_until",)
    for kernel, extra in (("ep_dispatch_async", ()), ("ep_dispatch", wait)):
        found = re.findall(CALLED, bodies[kernel])
        assert sorted(found) == sorted(NVSHMEM_CALLS + ("nvshmem_quiet",) + extra), \
            (kernel, found)
    assert re.findall(CALLED, bodies["ep_dispatch_wait"]) == list(wait)
    p2p = nvptx.emit_ptx(epgen.build_module(make_cfg(R=4, P=4)))
    assert "nvshmem" not in p2p and "call.uni" not in p2p


def test_inspect_shmem_config(capsys):
    status, out, err = run_cli(capsys, "inspect", "--preset", "small", "--set",
                               "use_shmem=true", "--set", "p2p_world_size=1")
    assert status == 0, out + err
    assert "effective flags" in out and "NVSHMEM puts and signals" in out
    assert "NVSHMEM: device bitcode linked into the PTX" in out and "failed" not in out
    assert "note:" not in err
