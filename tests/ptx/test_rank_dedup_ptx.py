"""``ep_rank_dedup`` (docs/flags.md) in the IR and the PTX, on each send path (the warp path
of ``ep/rank_dedup``, the block-staged broadcast with ``ep_send_join_named``, the send-buffer
path of the fused shared expert): every slot's index word and slot-table word are stored
before the releases that count the slots finished (IR statement order, and the PTX text of
the variant), the copy pass reads both, the ordered operations are exactly the stock
build's (the flag adds none and drops none) and the PTX checker finds each; the stock build
has neither word; the SHMEM variant's fence sits between the message and slot-word puts and
the index puts."""

from __future__ import annotations

import re

import attrs
import pytest

import ir
from backends import nvptx
from backends.nvptx.check import entry_bodies, ordered_ops
from epgen.ep_goldens import flag_variant_config
from epgen.formats import make_format
from epgen.kernels import build_module
from ir import nodes as N

ASYNC, WAIT, FUSED = "ep_dispatch_async", "ep_dispatch_wait", "ep_dispatch"
PATHS = {"warp": {}, "block": {"ep_send_join_named": True},
         "buffer": {"fused_shared_expert": True}}
FINISHED = r"\bred\.release\.gpu\.global\.add\.u32\b"


def _cfg(path, fmt=None):
    cfg = flag_variant_config("rank_dedup_nvfp4" if fmt else "rank_dedup")
    return cfg.replace(**PATHS[path])


def _consts(e) -> set:
    """The integer constants of expression ``e``."""
    out = set()

    def visit(x):
        if isinstance(x, N.Const):
            out.add(x.value)
        for f in attrs.fields(type(x)):
            y = getattr(x, f.name)
            if isinstance(y, N.ExprOps):
                visit(y)
    visit(e)
    return out


def _send_kernel(module):
    names = [k.name for k in module.kernels]
    return module.kernel(ASYNC if ASYNC in names else FUSED)


TABLES = {"index": "dedup_index_offset", "slot": "dedup_slot_offset"}


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("fmt", [None, "NVFP4"], ids=["BF16", "NVFP4"])
@pytest.mark.parametrize("path", PATHS)
def test_table_words_are_stored_before_the_finished_releases(path, fmt, table):
    cfg = _cfg(path, fmt)
    offset = getattr(cfg.layout, TABLES[table])
    comm = _send_kernel(build_module(cfg)).role("comm")
    stmts = list(ir.walk(comm.body))
    stores = [i for i, s in enumerate(stmts)
              if isinstance(s, N.Store) and offset in _consts(s.addr)]
    releases = [i for i, s in enumerate(stmts)
                if isinstance(s, N.AtomicRMW) and s.sem is ir.Sem.RELEASE]
    assert stores and releases
    assert max(stores) < min(releases), f"a {table} word after a finished release"


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("path", PATHS)
def test_ptx_has_the_table_stores_before_the_finished_releases(path, table):
    cfg = _cfg(path)
    bodies = entry_bodies(nvptx.emit_ptx(build_module(cfg)))
    offset = getattr(cfg.layout, TABLES[table])
    index_store = rf"\bst\.global\.b32\s+\[%rd\d+\+{offset}\]"
    index_load = rf"\bld\.global\.b32\s+%r\d+,\s+\[%rd\d+\+{offset}\]"
    send = bodies[ASYNC] if ASYNC in bodies else bodies[FUSED]
    releases = [m.start() for m in re.finditer(FINISHED, send)]
    stores = [m.start() for m in re.finditer(index_store, send)]
    assert stores and releases[-1] > max(stores)
    if ASYNC in bodies:     # the fused kernel's other roles release too, laid out anywhere
        assert max(stores) < releases[0]
    copy = bodies[WAIT] if WAIT in bodies else bodies[FUSED]
    assert re.search(index_load, copy)
    stock = entry_bodies(nvptx.emit_ptx(build_module(cfg.replace(ep_rank_dedup=False))))
    assert not any(re.search(index_store, b) or re.search(index_load, b)
                   for b in stock.values())


@pytest.mark.parametrize("path", PATHS)
def test_the_same_ordered_operations_as_the_stock_build_and_each_in_the_ptx(path):
    cfg = _cfg(path)
    module = build_module(cfg)
    stock = build_module(cfg.replace(ep_rank_dedup=False))

    def expected(m):
        return sorted((op.kernel, op.role, op.expected) for op in ordered_ops(m))
    assert expected(module) == expected(stock)
    assert ir.check(module) == []
    nvptx.check_ptx(module, nvptx.emit_ptx(module))


def test_role_split_builds_and_checks():
    """The send-buffer path with the copy/publisher split (the fan-out on publisher warps)."""
    cfg = flag_variant_config("rank_dedup").replace(
        ep_copy_role_split=True, num_threads=384, token_fmt=make_format("BF16", 6144, 4))
    assert cfg.layout.role_split.enabled
    module = build_module(cfg)
    assert ir.check(module) == []
    nvptx.check_ptx(module, nvptx.emit_ptx(module))


def test_shmem_variant_checks_with_its_fence_before_the_index_puts():
    """``ep/shmem_mixed_rank_dedup``: the PTX checker finds every ordered operation and
    NVSHMEM call in IR order (the fence after the message and slot-word puts, before each
    index word's put-with-signal)."""
    module = build_module(flag_variant_config("shmem_mixed_rank_dedup"))
    assert ir.check(module) == []
    nvptx.check_ptx(module, nvptx.emit_ptx(module))
    send = entry_bodies(nvptx.emit_ptx(module))[ASYNC]
    order = re.findall(r"call\.uni (?:\([^)]*\),\s*)?(nvshmem\w+),", send)
    fence, signal = order.index("nvshmem_fence"), order.index("nvshmemx_putmem_signal_nbi_warp")
    assert order[:fence] == ["nvshmemx_putmem_nbi_warp"] * 2 and fence < signal
