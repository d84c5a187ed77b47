"""The dispatch benchmark behind ``epgen bench`` (docs/PERF.md has the figures):
epgen's dispatch_async + dispatch_wait on an ``EmulatedWorld`` (every rank on one GPU),
against a device-to-device copy and against the PyTorch baseline, measured in one process.

Method
------
* **Shapes and variants** (``plan``): each shape is a number of tokens per rank
  (``max_tokens_per_rank`` of that shape's configuration); each variant a set of flag (or
  ``num_threads``/``n_sms``) overrides of the base configuration. Every variant of a shape
  runs on the same inputs, against the same baseline and copy.
* **Inputs** (``inputs``, ``runner``): ``sets`` (default 3) input sets per shape (random
  tokens; uniform or Zipf-like routing) staged on the GPU once and rotated through the
  iterations, so caches do not flatter and nothing is copied between timed calls.
* **Timing** (``timing``): CUDA events around a fork/join over the rank streams, behind a
  spin-kernel gate so host enqueue time is excluded; the median of ``iters`` samples after
  ``warmup``. dispatch_async alone, dispatch_wait alone, and the round trip.
* **Bytes** (``traffic``): what the variant's round trip must move. Staged layout: input
  read once, each routed message written and read once, each output row written once;
  ``ep_final_layout``: input read once, each output row written once. GB/s = bytes / time
  (1 GB = 1e9 B); fraction = GB/s over the copy's.
* **Link bytes** (``link_bytes``): apart from those, the bytes crossing between ranks (a
  message per remote (token, k) slot as the send path writes it; the combine's BF16 rows
  back), from each variant's input sets, the mean per call, and their rate over the timed
  figure. ``python -m epgen.bench.link_bytes`` prints the deduplicated-dispatch and FP8
  ratios.
* **Copy** (``runner``): ``copy_`` of a 1 GiB buffer in torch (and CuPy), read + written.
* **Baseline** (``baseline``): one stable argsort of all ranks' (token, k) pairs by expert
  and one ``index_select`` into the grouped output; speed-up = its time / epgen's.
* **Checks**: each world's output against ``epgen.reference`` before and after timing; the
  baseline's grouping of one rank against the reference.
* **Memory** (``memory``): each phase's device memory is estimated first; a phase that does
  not fit is skipped with a message. ``--block-capacity fit`` (default) sizes the receive
  blocks for the inputs' largest (expert, source) block: the reference sizing needs ~152 GB
  at prefill. The capacity bounds memory only: the same bytes move.
* **Output** (``report``): progress on stderr, a table on stdout (time, GB/s, fraction of
  copy, speed-up over the baseline), JSON with every number, the device, date and commit,
  and a PNG plot of bandwidth against tokens per rank.

Other worlds and ops
--------------------
* ``--op combine|moe`` (``combine``): the combine alone (after an untimed dispatch) or
  dispatch + combine, transform-free, on every world, each timed as its dispatch is;
  ``--combine-fp8`` / ``--combine-partial`` (emulated and SHMEM worlds) time the FP8 /
  partial-reduce combine after the plain one of the same dispatches (``combine.CombineArm``).
* ``--world p2p`` (``p2p``): one GPU per rank, against the peer copy and NCCL; every sample
  from an idle device, host enqueue included (as NCCL must be timed). No NCCL baseline for
  combine and moe.
* ``--world shmem`` (``shmem``): one process per PE under ``epgen launch``; each PE times its
  own rank on its stream, rank 0 combines the PEs (the slowest PE per call);
  ``--compare-p2p P,Q`` times several ``p2p_world_size`` in one run and reports each against
  the largest ("x of direct stores").

``driver.run(plan)`` runs a ``plan.Plan``; ``options`` holds the command-line options both
front ends share (``epgen bench`` in ``epgen.commands.bench``, ``benchmarks/dispatch_bench.py``)
and builds the SHMEM world's ``plan.ShmemPlan``.
Importing any module here needs numpy only: torch, CuPy, matplotlib and ``backends.cuda``
are imported inside the functions that use the device or draw.
"""
