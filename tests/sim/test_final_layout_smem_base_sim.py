"""The final layout's dispatch_wait with its copy role at a non-zero shared-memory base (the
reference's ``comm_smem_base``, honoured on every path): the header pass's scratch moves into
dynamic shared memory from that byte (checked in the PTX), and the kernel, launched with that
much dynamic shared memory in place of the world's dispatch_wait, still matches the numpy
reference on the simulator over back-to-back calls.

The copy role also takes a thread range and a barrier id of its own (the fused megakernel's
other role parameters), as ``ep_fused_roles`` gives the staged path."""

from __future__ import annotations

import re

import numpy as np
import pytest

import epgen
import ir
from backends.nvptx import emit_ptx
from epgen import reference, routing
from epgen.formats import make_format
from epgen.kernels import dispatch_wait
from epgen.runtime.program import Program

from sim_world import sim_world

BASE = 96                   # the copy role's scratch starts here (a multiple of 16)
BARRIER = 1
FIRST_THREAD = 32           # the copy role is threads [32, num_threads)
FLAGS = {"final_layout": {"ep_final_layout": True},
         "prod_reserve": {"ep_final_layout": True, "ep_prod_reserve": True}}
# (format, hid_dim, flags): BlockwiseFP8's transposed scales go through the header rows,
# whose addresses the header pass keeps in its scratch (the larger buffer)
CASES = [("BF16", 16, "final_layout"), ("BF16", 16, "prod_reserve"),
         ("BlockwiseFP8", 512, "prod_reserve")]
IDS = [f"{f}-{flags}" for f, _, flags in CASES]


def make_cfg(fmt: str, H: int, flags: str) -> epgen.EPConfig:
    return epgen.EPConfig(num_threads=64, n_sms=4, n_experts=4, n_ranks=2,
                          max_tokens_per_rank=4, p2p_world_size=2, use_shmem=False,
                          token_fmt=make_format(fmt, H, 2), **FLAGS[flags])


def wait_kernel(cfg, smem_base):
    """dispatch_wait as ``build_dispatch_wait`` makes it, but its copy role on threads
    ``[FIRST_THREAD, num_threads)`` with barrier ``BARRIER`` and its scratch from
    ``smem_base`` (None: static buffers). Returns the kernel and the dynamic shared memory
    bytes it needs."""
    kb = ir.KernelBuilder(dispatch_wait.KERNEL_NAME, cfg.num_threads)
    p = dispatch_wait.declare_params(kb, cfg)
    last = ir.SRegRead(ir.SReg.NCTAID_X) - 1
    with kb.role("copy", blocks=(0, last), threads=(FIRST_THREAD, cfg.num_threads - FIRST_THREAD),
                 barrier_id=BARRIER, smem_base=smem_base) as r:
        dispatch_wait.copy_received_tokens_to_output(r, cfg, p)
        smem = r.scratch_end
    with kb.role("aux", blocks=(last, None)) as r:
        dispatch_wait.wait_for_arrivals_and_compute_offsets(r, cfg, p)
    return kb.build(), smem


def dyn_offsets(ptx: str) -> list[int]:
    """Every constant offset the PTX addresses ``dyn_smem`` at (``[dyn_smem]`` is 0)."""
    return sorted(int(m or 0) for m in re.findall(r"\[dyn_smem(?:\+(\d+))?\]", ptx))


@pytest.mark.parametrize("fmt,H,flags", CASES, ids=IDS)
def test_the_header_pass_scratch_moves_by_the_smem_base(fmt, H, flags):
    cfg = make_cfg(fmt, H, flags)
    n_copy = cfg.num_threads - FIRST_THREAD
    scratch = dispatch_wait.copy_scratch_bytes(cfg, n_copy)
    kernels = {base: wait_kernel(cfg, base) for base in (None, 0, BASE)}
    for base in (0, BASE):
        assert kernels[base][1] == base + scratch
    ptx = {base: emit_ptx(ir.Module("m", (k,)), arch="sm_90")
           for base, (k, _) in kernels.items()}
    # static: the copy role's scratch is .shared buffers, no dynamic shared memory
    assert "dyn_smem" not in ptx[None] and "tile_vals" in ptx[None]
    for base in (0, BASE):
        assert ".extern .shared .align 16 .b8 dyn_smem[];" in ptx[base]
        assert "tile_vals" not in ptx[base] and "tile_hdr_rows" not in ptx[base]
        # the role's own barrier over its threads, never bar.sync 0 in the copy role
        assert f"bar.sync \t{BARRIER}, {n_copy};" in ptx[base]
    # every dynamic shared-memory access moves by the base, and there are some
    at0, at_base = dyn_offsets(ptx[0]), dyn_offsets(ptx[BASE])
    assert at0 and at_base == [o + BASE for o in at0]
    assert max(at_base) < BASE + scratch


@pytest.mark.parametrize("fmt,H,flags", CASES, ids=IDS)
def test_the_smem_base_wait_matches_the_reference(fmt, H, flags, seed):
    """Every rank runs the world's dispatch_async, then the kernel above (its copy role's
    scratch at byte ``BASE``, launched with exactly the dynamic shared memory it needs) in
    place of dispatch_wait; each call's results match the reference."""
    cfg = make_cfg(fmt, H, flags)
    kernel, smem = wait_kernel(cfg, BASE)
    rng = np.random.default_rng(seed)
    inputs = [routing.edge_case(rng, cfg, "full")] + [
        routing.routing(rng, cfg, [int(rng.integers(0, cfg.max_tokens_per_rank + 1))
                                   for _ in range(cfg.n_ranks)]) for _ in range(2)]
    with sim_world(cfg, seed) as world:
        program = Program(ir.Module(kernel.name, (kernel,)), arch=world.program.arch,
                          device=world.device, backend=world.cuda)
        for call, (toks, ids) in enumerate(inputs):
            world.load_inputs(toks, ids)
            world.dispatch_async()
            for rk, args in zip(world.ranks, world.wait_rows()):
                program.launch(kernel.name, cfg.n_sms, args, rk.stream, shmem=smem)
                rk.wait_done = rk.stream.record()
            world.check_with(program, "dispatch")
            try:
                reference.assert_match(cfg, reference.dispatch(cfg, toks, ids),
                                       world.results())
            except AssertionError as exc:
                raise AssertionError(f"seed {seed}, call {call}: {exc}") from None
