"""One check per flag (docs/flags.md) proving the instructions that distinguish its
variant, mostly against the stock build of the same geometry: ``ep_send_join_named``,
``ep_copy_role_split``, ``ep_ord_r`` + ``has_rank_flag``, ``skip_a2a``; plus the IR-level
facts behind them and the illegal flag combinations. docs/flags.md describes each flag."""

from __future__ import annotations

import functools
import re

import attrs
import pytest

import ir
from backends import nvptx
from backends.nvptx.check import entry_bodies, scope_counts
from epgen.config import EPConfigError
from epgen.ep_goldens import FLAG_VARIANTS, flag_variant_config
from epgen.kernels import build_module
from epgen.kernels.dispatch_async import copy_and_send_tokens, declare_params
from epgen.presets import load_preset

ASYNC, WAIT = "ep_dispatch_async", "ep_dispatch_wait"
SYS_ORDERED = re.compile(r"\b(?:ld|st|atom|red)\.(?:acquire|release|acq_rel|sc)\.sys\b"
                         r"|\bfence\.\w+\.sys\b")


@functools.lru_cache(maxsize=None)
def _bodies(cfg) -> dict[str, str]:
    """PTX body of each entry point of ``cfg``'s module (comments stripped)."""
    return entry_bodies(nvptx.emit_ptx(build_module(cfg)))


def _cfg(name: str):
    if name == "skip_a2a_global":      # skip_a2a with the preset's global n_ranks, n_experts
        return load_preset("small").replace(skip_a2a=True)
    return load_preset(name) if name in ("small", "default") else flag_variant_config(name)


SKIP_FORMS = pytest.mark.parametrize("form", ["skip_a2a", "skip_a2a_global"],
                                     ids=["per_device", "global"])


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


@pytest.mark.parametrize("name", sorted(FLAG_VARIANTS))
def test_flag_variant_verifies(name):
    """Every flag variant passes the IR verifier and the PTX checker."""
    module = build_module(_cfg(name))
    assert ir.check(module) == []
    nvptx.check_ptx(module, nvptx.emit_ptx(module))


# ---- ep_send_join_named ------------------------------------------------------------------
def test_send_join_named_uses_nb_send():
    cfg = _cfg("send_join_named")
    named, stock = _bodies(cfg)[ASYNC], _bodies(_cfg("small"))[ASYNC]
    join = rf"\bbar\.sync\s+{cfg.layout.NB_SEND},\s*{cfg.num_threads};"
    # with the flag the send path is the block-staged broadcast, whose joins are all NB_SEND:
    # two with the two-buffer pipeline (after the first staging, after each broadcast); the
    # stock warp path has no block-wide join at all
    assert _count(join, named) == 2
    # the only id-0 joins are the monitor role's two around the block histogram of the counts
    # (the monitor blocks send too), as on the stock path
    assert _count(r"\bbar\.sync\s+0;", named) == 2
    assert _count(join, stock) == 0 and _count(r"\bbar\.sync\s+0;", stock) == 2
    assert _count(r"\bbar\.warp\.sync\s+-1;", stock) >= 1
    assert _bodies(cfg)[WAIT] == _bodies(_cfg("small"))[WAIT]


def test_send_join_named_barrier_is_declared_by_the_comm_role():
    comm = build_module(_cfg("send_join_named")).kernel(ASYNC).role("comm")
    assert [(b.id, b.count) for b in comm.barriers] == [(3, 256)]


def test_send_join_named_reuses_a_comm_barrier_with_the_same_id():
    """A comm role whose barrier id is NB_SEND declares barrier 3 once."""
    cfg = _cfg("send_join_named")
    kb = ir.KernelBuilder("k", cfg.num_threads)
    p = declare_params(kb, cfg)
    with kb.role("comm", blocks=(cfg.layout.n_signal_sms, None), barrier_id=3) as r:
        copy_and_send_tokens(r, cfg, p, cfg.layout.n_signal_sms)
    assert [b.id for b in kb.build().role("comm").barriers] == [3]


# ---- ep_copy_role_split -------------------------------------------------------------------
def test_role_split_geometry():
    split = _cfg("role_split").layout.role_split
    assert split.enabled and (split.n_copy_threads, split.n_copy_warps) == (256, 8)


def test_role_split_copy_is_three_items_per_copy_thread():
    """The staging copy: three ``ld.global.nc.v4`` per copy thread, n_copy_threads vectors
    apart (stock: one grid-strided load in a loop)."""
    cfg = _cfg("role_split")
    stride = 16 * cfg.layout.role_split.n_copy_threads
    split = _bodies(cfg)[ASYNC]
    stock = _bodies(cfg.replace(ep_copy_role_split=False))[ASYNC]
    loads = re.findall(r"\bld\.global\.nc\.v4\.b32\s+\{[^}]*\},\s*\[%rd\d+(?:\+(\d+))?\]", split)
    assert sorted(int(o or 0) for o in loads) == [0, stride, 2 * stride]
    # stock: the warp path, lane-strided loads 512 bytes apart, 2 in flight; no tail with one
    # warp per token (the role_split geometry's 768 vectors are 12 per lane), one more load
    # for the tail of a token's share when warps share tokens (send_warps_per_token)
    from epgen.kernels.send_policy import send_warps_per_token
    shared = send_warps_per_token(cfg) > 1
    assert _count(r"\bld\.global\.nc\.v4\.b32", stock) == 2 + shared
    stock_offs = [int(o or 0) for o in re.findall(
        r"\bld\.global\.nc\.v4\.b32\s+\{[^}]*\},\s*\[%rd\d+(?:\+(-?\d+))?\]", stock)]
    assert stock_offs == [0, 512] + [0] * shared, stock_offs
    assert _count(rf"\[%rd\d+\+{stride}\]", stock) == 0
    # only copy-role threads stage: tid > n_copy_threads - 1 skips the copy
    assert _count(rf"\bsetp\.gt\.u32\s+%p\d+,\s*%r\d+,\s*{stride // 16 - 1};", split) >= 1
    assert _bodies(cfg)[WAIT] == _bodies(cfg.replace(ep_copy_role_split=False))[WAIT]


def test_role_split_publishers_fan_out():
    """IR: the fan-out loop starts at ``selp(warp >= n_copy_warps, warp - n_copy_warps, K)``
    with step ``n_publisher_warps`` (stock: ``warp`` step ``n_warps``); PTX: the ``selp``."""
    cfg = _cfg("role_split")
    split = cfg.layout.role_split

    def fan_loop(c):
        comm = build_module(c).kernel(ASYNC).role("comm")
        return next(s for s in ir.walk(comm.body) if isinstance(s, ir.For) and s.var.name == "k")

    loop = fan_loop(cfg)
    assert loop.step == ir.Const(split.n_publisher_warps, ir.types.u32)
    assert isinstance(loop.start, ir.Select)
    assert loop.start.b == ir.Const(cfg.layout.top_k, ir.types.u32)
    stock = build_module(cfg.replace(ep_copy_role_split=False)).kernel(ASYNC).role("comm")
    assert not any(isinstance(s, ir.For) and s.var.name == "k" for s in ir.walk(stock.body)), \
        "the stock comm role broadcasts each staged token with every thread (no per-warp k loop)"
    assert _count(rf"\bselp\.b32\s+%r\d+,\s*%r\d+,\s*{cfg.layout.top_k},", _bodies(cfg)[ASYNC]) == 1


def test_role_split_flag_without_geometry_is_stock():
    """The flag on a geometry the rule rejects (256 threads, H = 256) changes nothing, and
    says so: a build warning and the effective flags name the flag and the rule."""
    from epgen.config import EPFlagNoEffect
    small = _cfg("small")
    flagged = small.replace(ep_copy_role_split=True)
    assert not flagged.layout.role_split.enabled
    with pytest.warns(EPFlagNoEffect, match="ep_copy_role_split: no effect .*hid_dim // 8 "
                                            "== 3 \\* n_copy_threads.*got hid_dim // 8 = 32 "
                                            "and n_copy_threads = 128"):
        flagged_module = build_module(flagged)
    assert ir.print_module(flagged_module) == ir.print_module(build_module(small))
    with pytest.warns(EPFlagNoEffect):
        assert _bodies(flagged) == _bodies(small)
    assert "ep_copy_role_split" in flagged.effective_flags()
    assert "ep_copy_role_split" not in small.effective_flags()
    assert "ep_copy_role_split" not in _cfg("role_split").effective_flags()


def test_role_split_needs_the_whole_block_as_comm_role():
    cfg = _cfg("role_split")
    kb = ir.KernelBuilder("k", cfg.num_threads)
    p = declare_params(kb, cfg)
    with pytest.raises(ValueError, match="ep_copy_role_split.*n_comm_threads"):
        with kb.role("comm", blocks=(2, None), threads=(0, 256)) as r:
            copy_and_send_tokens(r, cfg, p, 2)


# ---- ep_ord_r + has_rank_flag ---------------------------------------------------------------
def test_ord_r_async_publishes_one_rank_flag():
    cfg = _cfg("ord_r")
    L = cfg.layout.n_local_experts
    ordr, stock = _bodies(cfg)[ASYNC], _bodies(_cfg("small"))[ASYNC]
    # the rank flag (value L, an immediate) is the only sys release
    assert scope_counts(ordr)["releases"].get("sys") == 1
    assert _count(rf"\bst\.release\.sys\.global\.b64\s+\[[^\]]+\],\s*{L};", ordr) == 1
    # count words are plain stores; the election is an acq_rel RMW at gpu scope
    assert _count(r"\bst\.global\.b64\s", ordr) >= 1
    assert _count(r"\batom\.acq_rel\.gpu\.global\.add\.u32\b", ordr) == 1
    # stock: every count word is a sys release of the count (a register), no election
    assert _count(r"\bst\.global\.b64\s", stock) == 0
    assert _count(r"\batom\.acq_rel\.", stock) == 0
    assert _count(r"\bst\.release\.sys\.global\.b64\s+\[[^\]]+\],\s*%rd\d+;", stock) == 1


def test_ord_r_wait_polls_only_the_rank_flags():
    """Every ``ld.acquire.sys`` of the ORD-R wait is compared with L (a rank flag), the count
    words are read with plain loads, and both the count words and the flags are re-armed
    (two sentinel stores); the stock wait compares its sys polls with the sentinel."""
    cfg = _cfg("ord_r")
    L = cfg.layout.n_local_experts
    ordr, stock = _bodies(cfg)[WAIT], _bodies(_cfg("small"))[WAIT]
    polls = re.findall(r"\bld\.acquire\.sys\.global\.b64\s+(%rd\d+),[^\n]*\n\s*setp\.(\w+)\.b64"
                       r"\s+%p\d+,\s*(%rd\d+),\s*(-?\d+);", ordr)
    assert polls and all(reg == seen and value == str(L) for reg, _op, seen, value in polls)
    assert len(polls) == _count(r"\bld\.acquire\.sys\.", ordr)
    assert _count(r"\bst\.global\.b64\s+\[[^\]]+\],\s*-1;", ordr) == 2
    assert _count(r"\bst\.global\.b64\s+\[[^\]]+\],\s*-1;", stock) == 1
    assert re.search(r"\bld\.acquire\.sys\.global\.b64\s+(%rd\d+),[^\n]*\n\s*setp\.ne\.b64"
                     r"\s+%p\d+,\s*\1,\s*-1;", stock)


def test_ord_r_wait_ir():
    """IR: the only sys-scope spin-wait of the wait kernel polls ``rank_flag`` words, and the
    count words are weak loads."""
    wait = build_module(_cfg("ord_r")).kernel(WAIT)
    spins = [s for r in wait.roles for s in ir.walk(r.body) if isinstance(s, ir.SpinWait)
             and s.scope is ir.Scope.SYS]
    assert [s.site.buffer for s in spins] == ["rank_flag"]
    aux = wait.role("aux")
    count_loads = [s for s in ir.walk(aux.body) if isinstance(s, ir.Load)
                   and s.dst.name.startswith("count_word")]
    assert count_loads and all(s.sem is ir.Sem.WEAK for s in count_loads)


def test_ord_r_named_has_both():
    cfg = _cfg("ord_r_named")
    body = _bodies(cfg)[ASYNC]
    assert _count(rf"\bbar\.sync\s+3,\s*{cfg.num_threads};", body) == 2
    assert _count(r"\batom\.acq_rel\.gpu\.global\.add\.u32\b", body) == 1
    assert _bodies(cfg)[WAIT] == _bodies(_cfg("ord_r"))[WAIT]


@pytest.mark.parametrize("flags", [dict(has_rank_flag=True), dict(ep_ord_r=True)],
                         ids=["has_rank_flag-alone", "ep_ord_r-alone"])
def test_ord_r_flags_come_together(flags):
    with pytest.raises(EPConfigError) as info:
        load_preset("small").replace(**flags)
    message = str(info.value)
    assert "has_rank_flag" in message and "ep_ord_r" in message
    assert any({"has_rank_flag", "ep_ord_r"} <= set(p) for p, _ in info.value.violations)


# ---- skip_a2a -------------------------------------------------------------------------------
@SKIP_FORMS
@pytest.mark.parametrize("ord_r", [False, True], ids=["legacy", "ord_r"])
def test_skip_a2a_signals_at_gpu_scope(ord_r, form):
    cfg = _cfg(form)
    if ord_r:
        cfg = cfg.replace(ep_ord_r=True, has_rank_flag=True)
    bodies = _bodies(cfg)
    for name, body in bodies.items():
        assert not SYS_ORDERED.findall(body), f"{name}: {SYS_ORDERED.findall(body)}"
        counts = scope_counts(body)
        assert "sys" not in counts["releases"] and "sys" not in counts["acquires"]
    L = cfg.layout.n_local_experts
    signal = (rf"\bst\.release\.gpu\.global\.b64\s+\[[^\]]+\],\s*{L};" if ord_r
              else r"\bst\.release\.gpu\.global\.b64\s")
    assert _count(signal, bodies[ASYNC]) == 1
    assert _count(r"\bld\.acquire\.gpu\.global\.b64\s", bodies[WAIT]) == 1


def _vars(kernel):
    for p in kernel.params:
        yield p
    for role in kernel.roles:
        for s in ir.walk(role.body):
            for f in attrs.fields(type(s)):
                v = getattr(s, f.name)
                for x in (v if isinstance(v, tuple) else (v,)):
                    if isinstance(x, ir.nodes.ExprOps):
                        yield from (e for e in ir.walk_expr(x)
                                    if isinstance(e, (ir.Param, ir.Var)))
                    elif isinstance(x, ir.Var):
                        yield x


@SKIP_FORMS
def test_skip_a2a_has_no_peer_memory(form):
    """Under skip_a2a no parameter or local is marked peer and nothing derives from one; the
    stock build marks its peer pointers."""
    from ir.verify import peer_vars
    for kernel in build_module(_cfg(form)).kernels:
        assert not [v.name for v in _vars(kernel) if v.peer], kernel.name
        assert peer_vars(kernel) == frozenset()
    stock = build_module(_cfg("small"))
    assert any(v.peer for k in stock.kernels for v in _vars(k))


@SKIP_FORMS
def test_skip_a2a_uses_only_pointer_table_entry_zero(form):
    """The async kernel reads only entry 0 of its pointer tables (the device's own buffers):
    every ``ld.global.nc.b64`` of a table has no offset."""
    body = _bodies(_cfg(form))[ASYNC]
    stock = _bodies(_cfg("small"))[ASYNC]
    def direct(text):
        """Per table parameter: is its base loaded from directly (entry 0, no index)?"""
        regs = re.findall(r"\bld\.param\.b64\s+(%rd\d+),\s*\[ep_dispatch_async_param_[45]\];",
                          text)
        return [bool(re.search(rf"\bld\.global\.nc\.b64\s+%rd\d+,\s*\[{re.escape(reg)}\];",
                               text)) for reg in regs]

    assert direct(body) == [True, True]
    assert False in direct(stock)  # stock: entries indexed by the destination's P2P rank


def test_variant_parameters_are_the_documented_ones():
    assert _cfg("skip_a2a").skip_a2a and _cfg("skip_a2a").n_ranks == 1
    assert _cfg("role_split").num_threads == 384
    assert _cfg("role_split").token_fmt.hid_dim == 6144
