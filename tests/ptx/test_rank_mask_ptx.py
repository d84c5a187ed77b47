"""``ep_rank_mask`` (docs/flags.md; docs/design.md "Rank masks") in the IR and the PTX:
which waits may give up (only those for another rank's words), what an expiry under shrink
does (``atom.relaxed.sys.exch`` of the mask word, the push, a MASK record), the mask reads
of the send side, the ready flag's longer deadline, the fused kernels left out; against the
stock build of the same geometry. The ``SpinWait`` fields' text form and lowering too."""

from __future__ import annotations

import functools
import re

import pytest

import ir
from backends import nvptx
from backends.nvptx import spin_wait
from backends.nvptx.check import entry_bodies
from epgen.ep_goldens import flag_variant_config
from epgen.kernels import build_combine_module, build_module
from epgen.kernels.common import READY_FLAG_DEADLINES
from epgen.presets import load_preset
from ir import diag
from ir import nodes as N

ASYNC, WAIT = "ep_dispatch_async", "ep_dispatch_wait"
C_ASYNC, C_WAIT = "ep_combine_async", "ep_combine_wait"
EXCH = r"\batom\.relaxed\.sys\.global\.exch\.b32\b"
LD_SYS = r"\bld\.relaxed\.sys\.global\.b32\b"


def _cfg(name: str):
    return load_preset("small") if name == "small" else flag_variant_config(name)


@functools.lru_cache(maxsize=None)
def _bodies(name: str, combine: bool = False) -> dict[str, str]:
    build = build_combine_module if combine else build_module
    return entry_bodies(nvptx.emit_ptx(build(_cfg(name))))


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def _waits(module, kernel: str):
    return [s for r in module.kernel(kernel).roles for s in ir.walk(r.body)
            if isinstance(s, N.SpinWait)]


@pytest.mark.parametrize("name", ["rank_mask", "final_layout_rank_mask"])
def test_only_waits_for_another_rank_may_give_up(name):
    cfg = _cfg(name)
    m = build_module(cfg)
    giving_up = {(w.site.buffer, w.give_up is not None, w.shrink is not None)
                 for k in (ASYNC, WAIT) for w in _waits(m, k)}
    assert ("recv_count", True, True) in giving_up
    local = {b for b, g, _ in giving_up if not g}
    assert local and "recv_count" not in local      # finished counter, ready flag, hand-off
    assert all(not g for b, g, _ in giving_up if b != "recv_count")
    c = build_combine_module(cfg)
    (arrival,) = _waits(c, C_WAIT)
    assert arrival.site.buffer == "combine_arrival" and arrival.give_up is not None
    assert all(w.give_up is None for w in _waits(build_module(_cfg("small")), WAIT))


def test_the_fused_kernels_are_left_out():
    assert [k.name for k in build_module(_cfg("rank_mask")).kernels] == [ASYNC, WAIT]
    assert [k.name for k in build_combine_module(_cfg("rank_mask")).kernels] == [C_ASYNC,
                                                                                 C_WAIT]


@pytest.mark.parametrize("kernel,combine", [(WAIT, False), (C_WAIT, True)])
def test_an_expiry_under_shrink_masks_pushes_and_records(kernel, combine):
    """The waiting kernels gain one ``atom.relaxed.sys.exch`` (mask the rank), the push
    (``st.relaxed.sys`` into the rank's own mask) and the MASK record's magic."""
    masked, stock = _bodies("rank_mask", combine)[kernel], _bodies("small", combine)[kernel]
    assert _count(EXCH, masked) == 1 and _count(EXCH, stock) == 0
    magic = rf"(?<![\w-])(?:{diag.MASK_MAGIC}|{diag.MASK_MAGIC - 2**32}|0x{diag.MASK_MAGIC:x})\b"
    assert _count(magic, masked) >= 1 and _count(magic, stock) == 0
    pushes = r"\bst\.relaxed\.sys\.global\.b32\b"
    assert _count(pushes, masked) > _count(pushes, stock)


@pytest.mark.parametrize("kernel,combine", [(ASYNC, False), (C_ASYNC, True),
                                            (WAIT, False), (C_WAIT, True)])
def test_every_kernel_reads_the_mask(kernel, combine):
    masked, stock = _bodies("rank_mask", combine)[kernel], _bodies("small", combine)[kernel]
    assert _count(LD_SYS, masked) > _count(LD_SYS, stock)


def test_the_ready_flag_waits_three_deadlines():
    m = build_module(_cfg("rank_mask"))
    (flag,) = [w for w in _waits(m, WAIT) if w.site.buffer == "ready_flag"]
    assert ir.print_expr(flag.timeout_ns) == f"mul($timeout_ns, {READY_FLAG_DEADLINES}:u64)"
    (stock,) = [w for w in _waits(build_module(_cfg("small")), WAIT)
                if w.site.buffer == "ready_flag"]
    assert ir.print_expr(stock.timeout_ns) == "$timeout_ns"


def test_the_masked_base_is_past_every_output_row():
    """A masked destination's comm warps get ``MASKED_BASE``: every ``base + slot`` is past
    the output, so the device guard drops the row."""
    from epgen.kernels.final_layout import MASKED_BASE
    cfg = _cfg("final_layout_rank_mask")
    assert MASKED_BASE >= cfg.layout.max_out_rows
    assert MASKED_BASE + cfg.max_tokens_per_rank < 2 ** 32


PTR, U32, U64 = ir.types.ptr_global, ir.types.u32, ir.types.u64
PARAMS = (N.Param("flag", PTR), N.Param("mask_word", PTR), N.Param("shrink", U32),
          N.Param("err_buf", PTR), N.Param("timeout_ns", U64))


def _give_up_wait(status=True):
    flag, give, shrink, err_buf, timeout = PARAMS
    site = N.DiagSite(0, "flags", N.Const(0, U64))
    return N.SpinWait(N.Var("seen", U32), flag, U32, ir.CmpOp.GE, N.Const(1, U32), site,
                      timeout, err_buf, N.Const(0, U32), give_up=give, shrink=shrink,
                      status=N.Var("st", U32) if status else None)


def test_give_up_fields_print_and_parse_back():
    m = build_module(_cfg("rank_mask"))
    text = ir.print_module(m)
    assert "give_up=" in text and "shrink=" in text and "status=" in text
    assert ir.print_module(ir.parse_module(text)) == text
    stock = ir.print_module(build_module(_cfg("small")))
    assert "give_up=" not in stock


def test_a_give_up_wait_lowers_to_its_checks():
    """The expansion: ``status = 0`` first; after an unmet poll the ``give_up`` word
    (``ld.relaxed.sys``, status 1 and break), and on expiry ``shrink`` first (status 2 and
    break) before the record and the abort."""
    stmts = spin_wait.expand("k", _give_up_wait())
    first, loop = stmts[0], stmts[-1]
    assert isinstance(first, N.Assign) and first.value == N.Const(N.SPIN_MET, ir.types.u32)
    body = loop.body
    give = [s for s in body if isinstance(s, N.Load) and s.sem is ir.Sem.RELAXED
            and s.scope is ir.Scope.SYS and s.addr == N.Param("mask_word", ir.types.ptr_global)]
    assert len(give) == 1
    text = "\n".join(ir.print_stmt(s) for s in body)
    assert text.index("mask_word") < text.index("globaltimer")
    expiry = text[text.index("globaltimer"):]
    assert expiry.index(f"{N.SPIN_EXPIRED}:u32") < expiry.index(str(diag.RECORD_MAGIC))


def test_a_give_up_wait_needs_its_status():
    def issues(status):
        role = N.Role("r", (_give_up_wait(status),))
        k = N.Kernel("k", PARAMS, 32, (role,), sites=(N.SiteInfo(0, "r", "flags"),))
        return [i.message for i in ir.check(N.Module("m", (k,)))]
    assert issues(True) == []
    assert any("needs a status variable" in msg for msg in issues(False)), issues(False)
