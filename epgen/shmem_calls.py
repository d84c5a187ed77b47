"""What the SHMEM transport asks of NVSHMEM per token, counted from the PTX (not measured).

Over InfiniBand (IBGDA) every NVSHMEM operation is a work request the NIC takes, and every
``nvshmem_quiet`` waits for the network round trip of what it completes, so the calls a
kernel makes per token are what a multi-node run pays. ``call_sites(ptx)`` finds each
``call.uni`` of an ``ir.nvshmem`` function in each entry of the PTX, and whether it sits in a
loop of the entry's control-flow graph (a natural loop: a back edge to a block that
dominates it); ``per_token(cfg, sites)`` turns the sites of one kernel into calls per token
per rank, for a call of ``max_tokens_per_rank`` tokens routed uniformly:

- a site inside a loop runs once per remote top-k slot (the send loops' iterations are
  slots: a lane's in a per-lane fan-out, a warp's in a per-warp one), ``K * (R - P) / R``
  remote slots per token (``P = p2p_world_size``, uniform routing over the experts);
  under ``ep_rank_dedup`` (``kernels/rank_dedup.py``, ``put_slot_to_remote``) only the
  calls in the slot loops do (each slot's slot-word put and its index word's
  put-with-signal: the loops as deep as the put-with-signal's); the message put and the
  fence (a put or a fence in a shallower loop) run once per (token, remote rank) that holds
  one of the token's experts, ``(R - P) * (1 - C(E - L, K) / C(E, K))`` per token (``L = E /
  R``; top-k without repeats);
- a site outside every loop runs once per thread (or warp) that issues it per call: a
  signal, and a quiet whose block's previous NVSHMEM call is a signal (the monitor's),
  once per (expert, remote destination), ``E * (R - P) / R`` per call; any other quiet once
  per sending warp per call: at most ``min(n_sms - n_signal_sms, tokens) * min(num_threads
  / 32, K)`` (the comm blocks that get a token, and in each the warps that take top-k slots:
  warp ``w`` takes slots ``w, w + warps, ...``).

Per-call numbers are divided by the call's tokens (``max_tokens_per_rank`` unless given).
The result is a count of what the code can issue, not a measurement: masked slots, routings
that favour some ranks and warps that send nothing issue fewer.
"""

from __future__ import annotations

import math
import re

import attrs

from backends.nvptx.check import entry_bodies
from ir import nvshmem

_LABEL = re.compile(r"^\s*(\$[\w$]+):\s*$")
_BRANCH = re.compile(r"^\s*(@!?%\w+\s+)?bra(?:\.uni)?\s+(\$[\w$]+)\s*;")
_END = re.compile(r"^\s*(?:@!?%\w+\s+)?(ret|exit|trap)\s*;")
_CALL = re.compile(r"^\s*call(?:\.uni)?\s+(?:\([^)]*\),\s*)?(\w+)\s*,")


@attrs.frozen
class CallSite:
    """One NVSHMEM call of an entry: its kernel, function, whether it is in a loop, the
    NVSHMEM function called before it in its basic block (None: none) and how many loops
    (natural loops, by header) hold it."""

    kernel: str
    function: str
    in_loop: bool
    after: str | None = None
    depth: int = 0


def _ends_block(line: str) -> bool:
    return bool(_BRANCH.match(line) or _END.match(line))


def _unconditional(line: str) -> bool:
    return not line.strip().startswith("@")


def _blocks(body: str):
    """The entry body's basic blocks: ``(label, instruction lines)``, in text order; a block
    ends at a label or after a branch or exit, conditional or not."""
    blocks, label, lines = [], None, []
    for line in body.splitlines():
        m = _LABEL.match(line)
        if m:
            if lines or label is not None:
                blocks.append((label, lines))
            label, lines = m.group(1), []
            continue
        lines.append(line)
        if _ends_block(line):
            blocks.append((label, lines))
            label, lines = None, []
    if lines or label is not None:
        blocks.append((label, lines))
    return blocks


def _graph(blocks):
    """Successors of each block (index): its branch target and the fall-through (unless it
    ends in an unconditional branch or exit)."""
    at = {label: i for i, (label, _) in enumerate(blocks) if label is not None}
    succ = []
    for i, (_, lines) in enumerate(blocks):
        out, last = [], lines[-1] if lines else ""
        b = _BRANCH.match(last)
        if b:
            out.append(at[b.group(2)])
        if not (_ends_block(last) and _unconditional(last)) and i + 1 < len(blocks):
            out.append(i + 1)
        succ.append(out)
    return succ


def _loop_depths(succ) -> dict[int, int]:
    """How many natural loops (by header; reachable from the entry, block 0) hold each
    block that belongs to one."""
    n = len(succ)
    pred = [[] for _ in range(n)]
    for i, out in enumerate(succ):
        for j in out:
            pred[j].append(i)
    reach, todo = {0}, [0]
    while todo:
        for j in succ[todo.pop()]:
            if j not in reach:
                reach.add(j)
                todo.append(j)
    dom = {i: set(reach) for i in reach}
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for i in sorted(reach - {0}):
            ps = [dom[p] for p in pred[i] if p in reach]
            new = set.intersection(*ps) | {i} if ps else {i}
            if new != dom[i]:
                dom[i], changed = new, True
    bodies: dict[int, set[int]] = {}
    for u in reach:
        for h in succ[u]:
            if h in dom[u]:                     # a back edge u -> h: the loop of header h
                body, todo = {h, u}, ([u] if u != h else [])
                while todo:
                    for p in pred[todo.pop()]:
                        if p in reach and p not in body:
                            body.add(p)
                            todo.append(p)
                bodies.setdefault(h, set()).update(body)
    depth: dict[int, int] = {}
    for body in bodies.values():
        for b in body:
            depth[b] = depth.get(b, 0) + 1
    return depth


def call_sites(ptx: str) -> list[CallSite]:
    """Every NVSHMEM call site of every entry of ``ptx`` (module docstring)."""
    out = []
    for kernel, body in entry_bodies(ptx).items():
        start = body.find("{")
        blocks = _blocks(body[start + 1:])
        depths = _loop_depths(_graph(blocks))
        for i, (_, lines) in enumerate(blocks):
            before = None
            for line in lines:
                m = _CALL.match(line)
                if m and nvshmem.is_nvshmem(m.group(1)):
                    out.append(CallSite(kernel, m.group(1), i in depths, before,
                                        depths.get(i, 0)))
                    before = m.group(1)
    return out


def per_token(cfg, sites, kernel: str = "ep_dispatch_async",
              tokens: int | None = None) -> dict[str, float]:
    """``function -> calls per token per rank`` of ``kernel``'s ``sites`` for ``cfg`` and a
    call of ``tokens`` tokens (default ``max_tokens_per_rank``; module docstring), plus
    ``"operations"`` (every call but the quiets and fences: the work requests) and
    ``"quiets"``."""
    E, R, P, K = cfg.n_experts, cfg.n_ranks, cfg.p2p_world_size, cfg.layout.top_k
    T = cfg.max_tokens_per_rank if tokens is None else tokens
    remote = (R - P) / R
    per_pair = ("put", "fence") if cfg.ep_rank_dedup else ()
    slot_depth = max((s.depth for s in sites if s.kernel == kernel
                      and s.function == "nvshmemx_putmem_signal_nbi_warp"), default=0)
    warps = min(cfg.n_sms - cfg.layout.n_signal_sms, T) * min(cfg.num_threads // 32, K)
    out: dict[str, float] = {}
    for s in sites:
        if s.kernel != kernel or nvshmem.FUNCTIONS[s.function].role == "query":
            continue
        role = nvshmem.FUNCTIONS[s.function].role
        if s.in_loop and role in per_pair and s.depth < slot_depth:
            n = remote_rank_pairs(cfg)
        elif s.in_loop:
            n = K * remote
        elif role == "signal" or (role == "quiet" and s.after is not None
                                  and nvshmem.FUNCTIONS[s.after].role == "signal"):
            n = E * remote / T
        else:
            n = warps / T
        out[s.function] = out.get(s.function, 0.0) + n
    out["quiets"] = sum(v for f, v in out.items() if f in nvshmem.FUNCTIONS
                        and nvshmem.FUNCTIONS[f].role == "quiet")
    out["operations"] = sum(v for f, v in out.items() if f in nvshmem.FUNCTIONS
                            and nvshmem.FUNCTIONS[f].role not in ("quiet", "fence"))
    return out


def remote_rank_pairs(cfg) -> float:
    """Expected (token, remote rank) pairs per token whose rank holds at least one of the
    token's experts, for uniform top-k routing without repeats: each of the ``R - P`` ranks
    outside the token's P2P group holds ``L = E / R`` experts and is missed with probability
    ``C(E - L, K) / C(E, K)``."""
    E, R, P, K = cfg.n_experts, cfg.n_ranks, cfg.p2p_world_size, cfg.layout.top_k
    L = cfg.layout.n_local_experts
    return (R - P) * (1 - math.comb(E - L, K) / math.comb(E, K))


__all__ = ["CallSite", "call_sites", "per_token", "remote_rank_pairs"]
