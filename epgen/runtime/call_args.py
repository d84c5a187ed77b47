"""The checks of a world's call arguments, shared by every world (``EmulatedWorld``,
``P2PWorld``, ``ShmemWorld``) and by ``epgen.torch.EPBuffer``: the global ``input_scale`` of
``dispatch``; the expert outputs, router weights and residual of ``combine``, and that they
cover every row the last dispatch delivered; the dispatch outputs the torch API's combine
takes. A bad argument is an error naming it and the rule, raised before anything is copied
or launched, so the world stays usable. (``world_args.py`` checks the constructors'.)"""

from __future__ import annotations

import numpy as np

from .. import combine_fp8, interop
from ..errors import EPInputError

__all__ = ["input_scale", "per_rank", "combine_fp8_flag", "combine_partial_flag", "combine_inputs", "last_dispatch_rows", "check_combine",
           "check_dispatch_outputs"]


def input_scale(value) -> float:
    """``value`` as the world's global input scale (float32; NVFP4's ``input_scale`` launch
    argument, the reference's ``input_scales_wrapper``): a finite number > 0 on every format,
    those that do not read it included, so a bad value never waits for a format change to
    surface. ``EPInputError`` otherwise (a string, a bool, NaN, an infinity, 0, a negative)."""
    scale = None
    if not isinstance(value, (str, bytes, bool, np.bool_)):
        try:
            with np.errstate(over="ignore"):
                scale = np.float32(float(value))
        except (TypeError, ValueError):
            pass
    if scale is None or not (np.isfinite(scale) and scale > 0):
        raise EPInputError(f"input_scale: must be a finite float32 > 0, got {value!r}")
    return float(scale)


def per_rank(value, name: str, n: int) -> list:
    """``value`` as a list of one entry per rank (``n``): a list or tuple of ``n`` entries,
    or a numpy array whose first axis has ``n`` entries of two dimensions each.
    ``EPInputError`` naming ``name`` otherwise (None included)."""
    if isinstance(value, np.ndarray) and value.ndim == 3:
        value = list(value)
    if not isinstance(value, (list, tuple)):
        got = "None" if value is None else type(value).__name__
        raise EPInputError(f"{name}: must be a list of one array per rank ({n}), got {got}")
    if len(value) != n:
        raise EPInputError(f"{name}: one array per rank ({n}), got {len(value)}")
    return list(value)


def _calling(rk) -> bool:
    """Whether rank buffers ``rk`` take part in the current call (``RankBuffers.calling``;
    an object without it, always)."""
    return getattr(rk, "calling", True)


def combine_fp8_flag(cfg, fp8) -> bool:
    """``fp8`` of a combine call (the FP8 combine, docs/combine.md) checked: a bool
    (``EPInputError`` naming ``fp8`` otherwise), and ``hid_dim`` a multiple of 128 when it
    is True (``ValueError`` naming ``hid_dim``)."""
    if not isinstance(fp8, (bool, np.bool_)):
        raise EPInputError(f"fp8: must be True or False, got {fp8!r}")
    if fp8:
        combine_fp8.check_hid_dim(cfg.token_fmt.hid_dim)
    return bool(fp8)


def combine_partial_flag(cfg, partial_reduce, topk_weights=None, fp8: bool = False,
                         dispatched: bool = False) -> bool:
    """``partial_reduce`` of a combine call (the partial-reduce combine, docs/combine.md)
    checked, before anything runs: a bool (``EPInputError`` naming ``partial_reduce``); when
    True, ``ValueError`` without ``ep_rank_dedup`` or with ``fp8=True`` (not built), and
    ``EPInputError`` when ``topk_weights`` is given (the weights are the dispatched ones) or
    the last dispatch was given none (``dispatched`` false)."""
    if not isinstance(partial_reduce, (bool, np.bool_)):
        raise EPInputError(f"partial_reduce: must be True or False, got {partial_reduce!r}")
    if not partial_reduce:
        return False
    if not cfg.ep_rank_dedup:
        raise ValueError("partial_reduce: needs ep_rank_dedup=True (the destination sums the "
                         "rows of a token it received once)")
    if fp8:
        raise ValueError("partial_reduce: not with fp8=True (not built: the FP8 wire "
                         "quantises rows read from memory, the partial sums live in "
                         "registers; use one or the other)")
    if topk_weights is not None:
        raise EPInputError("topk_weights: must be None with partial_reduce=True (the "
                           "destinations weigh with the weights the dispatch carried)")
    if not dispatched:
        raise EPInputError("partial_reduce: the last dispatch was given no topk_weights "
                           "(pass dispatch(..., topk_weights=) first)")
    return True


def combine_inputs(world, expert_outputs, topk_weights=None, residual=None, *,
                   reduced: bool = False) -> tuple:
    """Every rank's combine inputs checked against ``world``'s configuration and its ranks'
    token counts, as ``(ys, ws, rs)``: per rank the expert outputs ``[rows <= max_out_rows,
    H]`` as BF16 bits, the router weights ``[T, K]`` as float32 (``ws`` None without
    weights), the residual ``[T, H]`` as BF16 bits (``rs`` None without one). A residual
    needs weights (the unreduced rows take none), unless the call reduces without them
    (``reduced``: the partial-reduce combine). Host arrays only (``interop.host_bf16``,
    ``interop.host_float32``). What the rows must cover is ``check_combine``'s: a CUDA
    graph's combine inputs are loaded before the dispatch that delivers the rows."""
    cfg, ranks = world.cfg, world.ranks
    K, H, M = cfg.token_fmt.top_k, cfg.token_fmt.hid_dim, cfg.layout.max_out_rows
    n = len(ranks)
    if residual is not None and topk_weights is None and not reduced:
        raise EPInputError("residual: needs topk_weights (the unreduced rows take none)")
    ys = per_rank(expert_outputs, "expert_outputs", n)
    ws = None if topk_weights is None else per_rank(topk_weights, "topk_weights", n)
    rs = None if residual is None else per_rank(residual, "residual", n)
    for i, rk in enumerate(ranks):
        if not _calling(rk):        # ep_rank_mask: it sat the dispatch out, nothing is read
            continue
        ys[i] = y = interop.host_bf16(ys[i], f"expert_outputs[{i}]")
        if y.ndim != 2 or y.shape[1] != H or y.shape[0] > M:
            raise EPInputError(f"expert_outputs[{i}]: shape {y.shape}, must be [rows <= "
                               f"max_out_rows={M}, hid_dim={H}]")
        if ws is not None:
            ws[i] = w = interop.host_float32(ws[i], f"topk_weights[{i}]")
            if w.shape != (rk.n_tokens, K):
                raise EPInputError(f"topk_weights[{i}]: shape {w.shape}, must be [T, top_k] = "
                                   f"[{rk.n_tokens}, {K}] (T: rank {rk.rank}'s tokens)")
        if rs is not None:
            rs[i] = r = interop.host_bf16(rs[i], f"residual[{i}]")
            if r.shape != (rk.n_tokens, H):
                raise EPInputError(f"residual[{i}]: shape {r.shape}, must be [T, hid_dim] = "
                                   f"[{rk.n_tokens}, {H}] (T: rank {rk.rank}'s tokens)")
    return ys, ws, rs


def last_dispatch_rows(world) -> list[int]:
    """Per rank of ``world``, the rows its last dispatch delivered (``row_offsets[-1]``, what
    ``world.results()`` returns as the grouped output); synchronises the world first.
    ``RuntimeError`` when no dispatch was enqueued since the world was made or since a
    failed call re-armed it (no rank has a last call to follow)."""
    if all(rk.wait_done is None for rk in world.ranks):
        raise RuntimeError("combine: no dispatch to combine: call dispatch first (combine "
                           "sends the expert outputs of the rows the last dispatch delivered "
                           "back to their sources; a failed call leaves none)")
    world.synchronize()
    return [int(rk.row_offsets.to_host()[-1]) for rk in world.ranks]


def check_combine(world, expert_outputs, topk_weights=None, residual=None, *,
                  reduced: bool = False) -> None:
    """The arguments of ``world.combine``: a dispatch came first (``last_dispatch_rows``),
    the inputs are well formed (``combine_inputs``), and each rank's expert outputs cover
    every row its last dispatch delivered (missing rows would be read from whatever the
    device buffer held). ``reduced``: as ``combine_inputs``. Raises before anything is
    copied."""
    delivered = last_dispatch_rows(world)
    ys, _, _ = combine_inputs(world, expert_outputs, topk_weights, residual, reduced=reduced)
    for i, (rk, y, n) in enumerate(zip(world.ranks, ys, delivered)):
        if _calling(rk) and y.shape[0] < n:
            raise EPInputError(
                f"expert_outputs[{i}]: {y.shape[0]} rows given, but the last dispatch "
                f"delivered {n} rows to rank {rk.rank}: one expert output row per delivered "
                f"row (rows past them are ignored, at most max_out_rows="
                f"{world.cfg.layout.max_out_rows})")


def check_dispatch_outputs(outs, ranks) -> None:
    """The torch API's combine: ``outs[j]`` must be the ``DispatchOutput`` the buffer's last
    dispatch returned for ``ranks[j]`` (its rank, filled by a dispatch, of that dispatch's
    token count), else ``EPInputError`` naming ``out[rank]``; before any dispatch a
    ``RuntimeError``. The delivered row count stays on the device (the torch API reads no
    device data), so the expert outputs' rows are checked against the output's fixed
    ``max_out_rows`` instead (``tensors.rows_input``)."""
    for rk, o in zip(ranks, outs):
        name = f"out[{rk.rank}]"
        if getattr(o, "rank", None) != rk.rank or not hasattr(o, "n_tokens"):
            raise EPInputError(f"{name}: must be the DispatchOutput dispatch returned for rank "
                               f"{rk.rank}, got {type(o).__name__}")
        if getattr(o, "topk_ids", None) is None:
            raise RuntimeError(f"{name}: no dispatch has filled it: call dispatch first")
        if o.n_tokens != rk.n_tokens:
            raise EPInputError(f"{name}: from an earlier dispatch ({o.n_tokens} tokens; rank "
                               f"{rk.rank}'s last dispatch had {rk.n_tokens}): pass the "
                               f"DispatchOutput of the last dispatch")
