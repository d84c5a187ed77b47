"""The combine figures of ``epgen bench --op combine|moe`` on an ``EmulatedWorld`` or (the P2P
benchmark, ``world_factory``) a ``P2PWorld``, measured like the dispatch round trip of that
world (``runner``): staged input sets rotated through the iterations, device events around a
fork/join over the rank streams behind the gate (or, ``host_sync``, from an idle device with
host enqueue included, as the P2P dispatch), the median of ``iters`` samples after
``warmup``. (The SHMEM world's combine is timed per PE by ``epgen.bench.shmem``.)

Transform-free: each rank's expert-output buffer is pointed at its own grouped dispatch output
(``Combiner.bufs[i].expert_out = rank.out_tokens``), so every received row goes back as it
came and nothing is copied between timed calls; a quantising format's rows are not BF16, so
there the expert-output buffers are filled once with random BF16 rows instead (the same
bytes move). The router weights are loaded once (one random ``[T, K]`` set per rank,
``weights``). ``combine``: each sample's dispatch round trip
is enqueued before the fork (untimed; the fork waits for it), the combine's launches
(``Combiner.enqueue``) are timed; then, on the split kernels, each half alone in complete
combines (``<key>_send``: ``Combiner.enqueue_send`` timed, the reduce after the end event;
``<key>_reduce``: the send before the fork, ``Combiner.enqueue_reduce`` timed), for the
plain combine and each arm. ``moe``: the round trip and the combine, one sample; with
the ``graph`` variant, the replay of a ``world.capture_moe`` graph (one per input set).

Checks: on set 0, ``world.dispatch`` + ``world.combine`` against ``reference.combine`` bit for
bit before the timing, and the last timed call's dispatch and combine after it; above
``PREFILL_CHECK_TOKENS`` tokens per rank, on the first and the last source and
``PREFILL_CHECK_TOKENS`` of their tokens spread evenly (``check_tokens``; the whole
reference takes minutes there).

Extra combine arms (``CombineArm``, ``op == "combine"``): after the plain combine's figure,
each arm's combine is timed on the same world, input sets, weights and expert outputs, the
same way, under its own result key, checked like the plain one against ``reference.combine``
with its flags on set 0 and after its last call (``post_check_<name>``):

* ``combine_fp8`` (``--combine-fp8``): the FP8 combine, ``combine(fp8=True)``; its bytes are
  ``fp8_combine_bytes``;
* ``combine_partial`` (``--combine-partial``, ``ep_rank_dedup``): the partial-reduce combine,
  ``combine(partial_reduce=True)``, which weighs with the weights the dispatch carried: every
  dispatch of the run (the set-0 check's and the timed ones, whose weights buffer it loaded)
  carries the run's weights ``weights``; its bytes are ``partial_combine_bytes``.
"""

from __future__ import annotations

import dataclasses
import gc
import time

import numpy as np

from .. import combine_fp8 as fp8_wire
from .. import reference
from ..kernels.combine_partial import check_config as check_partial_config
from ..runtime.combine import check_supported
from .link_bytes import rank_counts
from .memory import trim_memory_pool
from .report import HALVES
from .runner import StagedInputs, emulated_world
from .timing import fork_join, from_idle, sample, summarize

PRIMARY = {"dispatch": "round_trip", "combine": "combine", "moe": "moe"}
"""The result key of the figure each ``--op`` is compared by (speed-up, plot)."""


def weights(cfg, tokens_per_rank: int, seed: int = 0) -> list[np.ndarray]:
    """The run's router weights: per rank ``[T, K]`` float32, uniform in [0, 1)."""
    rng = np.random.default_rng(seed + 2)
    return [rng.random((tokens_per_rank, cfg.token_fmt.top_k), dtype=np.float32)
            for _ in range(cfg.n_ranks)]


def _fixed_rows(cfg, seed: int = 0) -> list[np.ndarray] | None:
    """None for BF16 (transform-free); else per rank ``max_out_rows`` random BF16 rows
    (finite), the expert outputs of every call."""
    if cfg.token_fmt.name == "BF16":
        return None
    rng = np.random.default_rng(seed + 3)
    shape = (cfg.layout.max_out_rows, cfg.token_fmt.hid_dim)
    return [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & np.uint16(0xBFFF)
            for _ in range(cfg.n_ranks)]


#: above this many tokens per rank the check covers two sources and this many of their
#: tokens, spread evenly from the first to the last (``_check``)
PREFILL_CHECK_TOKENS = 512


def _rows(results, fixed) -> list:
    """Each destination's expert outputs for ``results``: its rows, or the fixed ones."""
    if fixed is None:
        return [r.out_tokens for r in results]
    return [f[:len(r.src_info)] for r, f in zip(results, fixed)]


def fp8_combine_bytes(cfg, tokens_per_rank: int) -> dict:
    """Bytes of one FP8 combine of every rank at ``tokens_per_rank`` (every slot filled):
    ``rows_read`` (the BF16 expert outputs), ``slots`` (the FP8 slots written over the
    link: ``R * T * K * slot_bytes``, ``link_ratio`` of the BF16 rows' bytes), the same
    slots read by the reduce, the ``[T, H]`` BF16 output; ``total``."""
    R, K, H = cfg.n_ranks, cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
    n = R * tokens_per_rank * K
    rows, slots = n * H * 2, n * fp8_wire.slot_bytes(cfg)
    out = R * tokens_per_rank * H * 2
    return {"rows_read": rows, "slots": slots, "link_ratio": slots / rows, "output": out,
            "total": rows + 2 * slots + out}


def partial_combine_bytes(cfg, sets) -> dict:
    """Bytes of one partial-reduce combine of every rank, the mean over the input sets
    ``sets``: ``rows_read`` (the BF16 expert outputs, one per routed slot), ``partial_rows``
    (one BF16 row per (token, destination rank) pair, written by the destination and read
    by the source's reduce, local pairs included), ``link_ratio`` (the remote pairs over the
    remote slots: the combine's link bytes against the plain combine's), the ``[T, H]`` BF16
    output; ``total``."""
    H, row = cfg.token_fmt.hid_dim, 2 * cfg.token_fmt.hid_dim
    slots, pairs, remote_slots, remote_pairs, tokens = [], [], [], [], []
    for _toks, ids in sets:
        s, p = rank_counts(cfg, ids)
        off = ~np.eye(cfg.n_ranks, dtype=bool)
        slots.append(s.sum())
        pairs.append(p.sum())
        remote_slots.append(s[off].sum())
        remote_pairs.append(p[off].sum())
        tokens.append(sum(len(a) for a in ids))
    rows, partial = float(np.mean(slots)) * row, float(np.mean(pairs)) * row
    out = float(np.mean(tokens)) * H * 2
    far = float(np.sum(remote_slots))
    return {"rows_read": rows, "partial_rows": partial,
            "link_ratio": float(np.sum(remote_pairs)) / far if far else 1.0,
            "output": out, "total": rows + 2 * partial + out}


@dataclasses.dataclass(frozen=True)
class CombineArm:
    """A combine timed after the plain one of the same dispatches (module docstring):
    ``key`` names its figure (``combine_<name>``), ``option`` the command-line flag that
    asks for it, ``fp8`` / ``partial_reduce`` the flags of its ``combine`` and
    ``reference.combine`` calls, ``versus`` what its speed-up is over (the figure
    ``speedup_key``)."""

    name: str
    option: str
    versus: str
    speedup_key: str
    fp8: bool = False
    partial_reduce: bool = False

    @property
    def key(self) -> str:
        return f"combine_{self.name}"

    @property
    def flags(self) -> dict:
        """The keyword arguments of its ``combine`` / ``Combiner.load`` /
        ``reference.combine`` calls."""
        return {"fp8": self.fp8, "partial_reduce": self.partial_reduce}

    def call_weights(self, w):
        """The ``topk_weights`` its ``combine`` call takes: none under ``partial_reduce``
        (the dispatched ones are used)."""
        return None if self.partial_reduce else w

    def bytes(self, cfg, tokens_per_rank: int, sets) -> dict:
        """Its bytes (``fp8_combine_bytes`` or ``partial_combine_bytes``)."""
        if self.partial_reduce:
            return partial_combine_bytes(cfg, sets)
        return fp8_combine_bytes(cfg, tokens_per_rank)


FP8_ARM = CombineArm("fp8", "--combine-fp8", "BF16 combine", "fp8_speedup_vs_bf16", fp8=True)
PARTIAL_ARM = CombineArm("partial", "--combine-partial", "plain combine",
                         "partial_speedup_vs_plain", partial_reduce=True)


def extra_arms(combine_fp8: bool = False, combine_partial: bool = False) -> tuple:
    """The ``CombineArm`` of each flag given, in the order they are timed."""
    return tuple(a for a, on in ((FP8_ARM, combine_fp8), (PARTIAL_ARM, combine_partial)) if on)


def check_arm(cfg, arm: CombineArm) -> None:
    """``ValueError`` naming what ``cfg`` lacks when ``arm``'s combine cannot run on it:
    the FP8 combine's ``hid_dim`` rule, the partial-reduce combine's ``ep_rank_dedup`` and
    limits (``kernels.combine_partial.check_config``)."""
    if arm.fp8:
        fp8_wire.check_hid_dim(cfg.token_fmt.hid_dim)
    if arm.partial_reduce:
        check_partial_config(cfg)


def check_tokens(n: int) -> np.ndarray:
    """The tokens a large-shape check computes of a source of ``n``: ``PREFILL_CHECK_TOKENS``
    spread evenly over ``[0, n)``, the first and the last included (all of them when ``n``
    is not larger)."""
    if n <= PREFILL_CHECK_TOKENS:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, PREFILL_CHECK_TOKENS).round().astype(np.int64))


def _check(cfg, got, results, w, what: str, fixed=None, **flags) -> None:
    """``AssertionError`` unless ``got`` (the world's combine) is the reference combine of
    the world's dispatch ``results`` (expert outputs ``_rows``; ``flags``: a
    ``CombineArm``'s, the FP8 or partial-reduce combine's), bit for bit."""
    # every token of every source at small shapes; at large ones (the reference's float32
    # sums of R * T * K rows take minutes) PREFILL_CHECK_TOKENS tokens of the first and the
    # last source
    big = max(len(r) for r in w) > PREFILL_CHECK_TOKENS if w is not None else False
    only = [0, len(got) - 1] if big else None
    picked = {s: check_tokens(len(w[s])) for s in only} if big else None
    want = reference.combine(cfg, results, _rows(results, fixed), w, sources=only,
                             tokens=picked, **flags)
    for s, (g, x) in enumerate(zip(got, want)):
        if x is None:
            continue
        g = g if picked is None else np.asarray(g)[picked[s]]
        if g.shape != x.shape or not np.array_equal(g, x):
            raise AssertionError(f"{what}: rank {s} combine differs from the reference "
                                 f"({np.count_nonzero(g != x) if g.shape == x.shape else 'shape'})")


def measure_world(cfg, sets, w, iters: int, warmup: int, gate, *, op: str, device=None,
                  arch=None, post_check: bool = True, progress, fused: bool | None = None,
                  graph: bool = False, batched: bool = False, world_factory=None,
                  host_sync: bool = False, timer=fork_join, combine_fp8: bool = False,
                  combine_partial: bool = False) -> dict:
    """Build the world (``world_factory()``, default an ``EmulatedWorld``), check dispatch +
    combine on set 0, time ``op`` (module docstring; ``timer``: the fork/join timing,
    ``timing.fork_join``), check the last call. Raises when a check fails; ``ValueError``
    for a configuration combine does not take.

    ``host_sync`` (with ``gate`` None): every sample starts after the host waited for every
    rank stream and the timing stream, as ``runner.measure_world(host_sync=True)`` times the
    dispatch (the P2P benchmark): ``combine``'s untimed dispatch is enqueued after that
    wait, as ``dispatch_wait``'s untimed dispatch_async is there. ``combine_fp8``,
    ``combine_partial`` (``op`` combine only): the FP8 / partial-reduce combine's figure
    too, ``res["combine_fp8"]`` / ``res["combine_partial"]`` (module docstring,
    ``CombineArm``)."""
    arms = extra_arms(combine_fp8, combine_partial)
    if arms and op != "combine":
        raise ValueError(f"measure_world: {arms[0].key} times the combine alone, not op={op}")
    for arm in arms:
        check_arm(cfg, arm)
    if host_sync and gate is not None:
        raise ValueError("measure_world: host_sync times host enqueue; it takes no gate")
    check_supported(cfg)
    key = PRIMARY[op]
    res = {}
    t0 = time.perf_counter()
    world = (world_factory or (lambda: emulated_world(cfg, arch=arch, device=device,
                                                      fused=fused, batched=batched)))()
    res["build_s"] = time.perf_counter() - t0
    staged, comb, saved, graphs = None, None, None, []
    try:
        progress("  epgen: correctness check on set 0 (dispatch + combine vs reference)")
        fixed = _fixed_rows(cfg)
        # the partial-reduce combine weighs with the dispatched weights: every dispatch
        # carries them (the timed ones read the weights buffer this one loads)
        carried = w if any(a.partial_reduce for a in arms) else None
        results = world.dispatch(*sets[0], topk_weights=carried)
        reference.assert_match(cfg, reference.dispatch(cfg, *sets[0]), results)
        _check(cfg, world.combine(_rows(results, fixed), w), results, w, "set 0", fixed)
        for arm in arms:
            _check(cfg, world.combine(_rows(results, fixed), arm.call_weights(w), **arm.flags),
                   results, w, f"set 0 {arm.name}", fixed, **arm.flags)
        res["check"] = "ok"

        comb = world.combiner()
        staged = StagedInputs(world, sets)
        staged.use(0)
        H = cfg.token_fmt.hid_dim
        given = fixed or [np.zeros((0, H), np.uint16)] * len(world.ranks)
        comb.load(given, w)
        if fixed is None:
            saved = [b.expert_out for b in comb.bufs]
            for b, rk in zip(comb.bufs, world.ranks):
                b.expert_out = rk.out_tokens
        ts = world.cuda.create_stream(world.device)
        streams = [rk.stream for rk in world.ranks]

        def combine_once(i):
            staged.use(i)
            world.enqueue_round_trip()            # untimed: the fork waits for it
            return timer(ts, streams, gate, comb.enqueue)

        def moe_once(i):
            staged.use(i)
            return timer(ts, streams, gate,
                         lambda: (world.enqueue_round_trip(), comb.enqueue()))

        if graph:
            for j in range(len(staged.sets)):
                staged.use(j)
                graphs.append(world.capture_moe(stream=ts))

        def graph_once(i):
            g = graphs[staged.use(i)]
            g.refresh()
            g.follow_world(ts)
            ms, over = timer(ts, [], gate, lambda: g.replay(ts))
            g.lead_world(ts)
            return ms, over

        def send_once(i):                         # the reduce after it: untimed
            staged.use(i)
            world.enqueue_round_trip()
            sends = []
            out = timer(ts, streams, gate, lambda: sends.append(comb.enqueue_send()))
            for events in sends:                  # none when a test's timer skips the body
                comb.enqueue_reduce(events)
            return out

        def reduce_once(i):                       # the round trip and the send: untimed
            staged.use(i)
            world.enqueue_round_trip()
            sends = comb.enqueue_send()
            return timer(ts, streams, gate, lambda: comb.enqueue_reduce(sends))

        def timed(fn):
            return from_idle(fn, (*streams, ts)) if host_sync else fn

        def halves(res_key):
            """The split combine's two kernels, each timed alone in complete combines
            (``Combiner.enqueue_send`` / ``enqueue_reduce``): ``<res_key>_send`` and
            ``<res_key>_reduce``; the fused kernel has no halves."""
            if op != "combine" or comb.fused:
                return
            for (suffix, _), fn in zip(HALVES, (send_once, reduce_once)):
                progress(f"  epgen: timing {res_key}_{suffix} ({warmup} warm-up + {iters} "
                         f"iterations)")
                res[f"{res_key}_{suffix}"] = summarize(sample(timed(fn), iters, warmup, gate))

        once = timed(combine_once if op == "combine" else graph_once if graph else moe_once)
        progress(f"  epgen: timing {key} ({warmup} warm-up + {iters} iterations)")
        res[key] = summarize(sample(once, iters, warmup, gate))
        halves(key)
        world.check(f"benchmark {key}")
        got = comb.finish()
        if post_check:
            last = staged.current
            progress(f"  epgen: checking the last call's dispatch and combine (set {last})")
            results = world.results()
            reference.assert_match(cfg, reference.dispatch(cfg, *sets[last]), results)
            _check(cfg, got, results, w, f"set {last} after timing", fixed)
            res["post_check"] = "ok"
        for arm in arms:                # the same samples, the arm's kernels
            comb.load(given, arm.call_weights(w), **arm.flags)
            progress(f"  epgen: timing {arm.key} ({warmup} warm-up + {iters} iterations)")
            res[arm.key] = summarize(sample(once, iters, warmup, gate))
            halves(arm.key)
            world.check(f"benchmark {arm.key}")
            got = comb.finish()
            if post_check:
                last = staged.current
                _check(cfg, got, world.results(), w, f"set {last} after timing, {arm.name}",
                       fixed, **arm.flags)
                res[f"post_check_{arm.name}"] = "ok"
    finally:
        if saved is not None:
            for b, buf in zip(comb.bufs, saved):
                b.expert_out = buf
        if staged is not None:
            staged.restore()
        world.synchronize()
        for g in graphs:
            g.close()
        device = world.device
        on_gpu = not getattr(world.cuda, "RUNS_IR", False)
        staged = world = comb = None
        gc.collect()
        if on_gpu:
            device.sync()
            trim_memory_pool(device, progress)
    return res
