"""The ordering checker on the SHMEM transport (``epgen check-ordering`` of the ``ep/shmem_*``
and ``combine/shmem*`` variants): the checked configurations keep remote destinations; the
NVSHMEM calls that order or complete are ordered operations with their own mutations (a
put-with-signal split into a put and an unordered signal, a quiet or a fence removed), each
rebuilt into exactly one change; and every NVSHMEM ordering step the protocol needs is
detected in each of three seeds under the weak model: the put-with-signal of a message and
of a returned row, the senders' and the monitor's quiets, the waits for the arrival words.

Seeds: 0, 1, 2 (the checker's), named in every failure."""

from __future__ import annotations

import pytest

from epgen.ordering import mutations as M
from epgen.ordering import runs, sweep
from ir import nodes as N

from nvshmem_kernel import shmem_kernel

SEEDS = (0, 1, 2)


@pytest.mark.parametrize("variant", [v for v in runs.checked() if "shmem" in v])
def test_shmem_checks_keep_remote_destinations(variant):
    cfg = runs.config(runs.checked()[variant])
    assert cfg.needs_shmem, variant


def test_nvshmem_ordering_calls_are_ordered_operations_with_their_mutations():
    k = shmem_kernel("k")
    ops = [(oid, s) for oid, s in M.ordered_ops(k) if isinstance(s, N.Call)]
    assert [oid for oid, _ in ops] == ["k:send:0:nvshmemx_putmem_signal_nbi_warp",
                                       "k:send:1:nvshmem_fence", "k:send:3:nvshmem_quiet"]
    kinds = [m.kind for oid, s in ops for m in M.mutations_of(s, oid)]
    assert kinds == ["unordered", "removed", "removed"]


def _calls(kernel) -> list[str]:
    return [s.name for role in kernel.roles for s in N.walk(role.body) if isinstance(s, N.Call)]


def test_each_nvshmem_mutation_changes_exactly_its_call():
    k = shmem_kernel("k")
    before = _calls(k)
    split = M.mutate_kernel(k, "k:send:0:nvshmemx_putmem_signal_nbi_warp", "unordered")
    assert _calls(split) == [n for name in before for n in (
        ["nvshmemx_putmem_nbi_warp", "nvshmemx_signal_op"]
        if name == "nvshmemx_putmem_signal_nbi_warp" else [name])]
    at = before.index("nvshmemx_putmem_signal_nbi_warp")
    calls = [s for s in N.walk(split.roles[0].body) if isinstance(s, N.Call)]
    put, signal = calls[at], calls[at + 1]       # where the put-with-signal was
    old = next(s for s in N.walk(k.roles[0].body)
               if isinstance(s, N.Call) and s.name == "nvshmemx_putmem_signal_nbi_warp")
    assert put.args == old.args[:3] + old.args[6:] and signal.args == old.args[3:]
    for oid, name in (("k:send:1:nvshmem_fence", "nvshmem_fence"),
                      ("k:send:3:nvshmem_quiet", "nvshmem_quiet")):
        assert _calls(M.mutate_kernel(k, oid, "removed")) == [n for n in before if n != name]
    with pytest.raises(ValueError, match="applies to a put-with-signal"):
        M.mutate_kernel(k, "k:send:1:nvshmem_fence", "unordered")


#: per variant, the NVSHMEM ordering steps the protocol needs (operation id substrings)
NEEDED = {
    "ep/shmem_mixed": ["nvshmemx_putmem_signal_nbi_warp -> unordered",
                       "nvshmem_quiet -> removed", "shmem_arrival -> relaxed"],
    "combine/shmem_fused": ["nvshmemx_putmem_signal_nbi_warp -> unordered",
                            "nvshmem_quiet -> removed", "combine_rows_landed -> relaxed"],
}
#: the mutations those select: ep: the comm warps' and the monitor's quiets; combine: one
#: put-with-signal per source (4 ranks)
SELECTED = {"ep/shmem_mixed": 4, "combine/shmem_fused": 6}


@pytest.mark.parametrize("variant", list(NEEDED))
def test_each_nvshmem_ordering_step_is_detected_in_every_seed(variant):
    report = sweep.check(variant, SEEDS, NEEDED[variant])
    assert report.baseline_ok, (variant, report.baseline)
    names = sorted(r.mutation.name for r in report.results)
    assert len(names) == SELECTED[variant], names
    weak = {r.mutation.name: [o for _, o, _ in r.outcomes] for r in report.results
            if r.detected < len(SEEDS)}
    assert not weak, f"{variant}: detected in fewer than {len(SEEDS)} seeds: {weak}"
