"""Which epgen configuration serves a DeepEP low-latency call, and the checks of DeepEP's
arguments that the host can make before anything is enqueued.

A call's shape (``LowLatencyShape``: ranks, experts, ``num_max_dispatch_tokens_per_rank``,
hidden, top-k and the token format its FP8 options pick) names one ``EPConfig`` with
``ep_final_layout``: without ``ep_prod_reserve`` that layout is *capacity-strided*, local
expert ``e``'s rows are ``[e * R * T_max, e * R * T_max + count_e)`` of the grouped output,
each source rank's rows one block in the order the sources reserved them, which is DeepEP's
receive layout ``[L, R * T_max, H]`` itself (docs/final-layout.md), so the received tensors
are views of epgen's output buffers.

Token formats: ``use_fp8=False`` BF16; ``use_fp8=True`` ``BlockwiseFP8`` (e4m3, one float32
scale ``max(amax, 1e-4) / 448`` per 128 elements); with ``round_scale`` ``BlockwiseFP8Pow2``
(the scale rounded up to a power of two, DeepEP's rule); ``use_ue8m0`` is the same format
with its scales' exponent bytes packed four to an int32.
"""

from __future__ import annotations

import attrs

from ..bench.traffic import out_row_bytes
from ..combine_layout import CombineLayout
from ..config import EPConfig
from ..errors import EPInputError
from ..formats import make_format

#: elements per FP8 scale (DeepEP's ``kNumPerChannels``)
FP8_GROUP = 128
#: UE8M0 exponent bytes packed per int32
UE8M0_PACK = 4


def format_name(use_fp8: bool, round_scale: bool) -> str:
    """The epgen token format of a dispatch's FP8 options (module docstring)."""
    if not use_fp8:
        return "BF16"
    return "BlockwiseFP8Pow2" if round_scale else "BlockwiseFP8"


def kernel_grid(num_experts: int, n_local_experts: int, n_sms: int | None,
                num_threads: int | None, min_threads: int = 512) -> tuple[int, int]:
    """``(n_sms, num_threads)`` that every dispatch and combine kernel of a shape takes:
    ``num_threads`` default at least ``min_threads`` and at least ``num_experts``
    (dispatch_wait's aux block polls a count word per thread); ``n_sms`` at least a
    dispatch_wait comm block per local expert plus one, more blocks than dispatch_async's
    signal blocks (``num_experts / (num_threads / 32)``) and 2, raised to ``n_sms`` when
    given (``EPConfig``'s rules)."""
    threads = num_threads or max(min_threads, -(-num_experts // 32) * 32)
    need = max(n_local_experts + 1, -(-num_experts // (threads // 32)) + 1, 2)
    return max(need, n_sms or 0), threads


@attrs.frozen(cache_hash=True)
class LowLatencyShape:
    """One low-latency configuration: ``n_ranks``, ``num_experts``, ``max_tokens``
    (``num_max_dispatch_tokens_per_rank``), ``hidden``, ``top_k`` and ``fmt`` (the epgen
    format name, ``format_name``)."""

    n_ranks: int
    num_experts: int
    max_tokens: int
    hidden: int
    top_k: int
    fmt: str

    @property
    def n_local_experts(self) -> int:
        return self.num_experts // self.n_ranks

    @property
    def rows_per_expert(self) -> int:
        """``R * T_max``: the rows of one local expert in the receive layout."""
        return self.n_ranks * self.max_tokens

    def grid(self, n_sms: int | None = None, num_threads: int | None = None) -> tuple[int, int]:
        """``(n_sms, num_threads)`` for this shape's kernels: ``num_threads`` default at
        least 512 and at least ``num_experts`` (dispatch_wait's aux block polls a count word
        per thread); ``n_sms`` at least what the kernels need (a dispatch_wait comm block
        per local expert plus one, and more blocks than dispatch_async's signal blocks,
        ``num_experts / (num_threads / 32)``), raised to ``n_sms`` when given."""
        return kernel_grid(self.num_experts, self.n_local_experts, n_sms, num_threads)

    def config(self, *, n_sms: int | None = None, num_threads: int | None = None,
               p2p_world_size: int, use_shmem: bool, rank_mask: bool = False) -> EPConfig:
        """The ``EPConfig`` of this shape (capacity-strided final layout) with the grid
        ``grid(n_sms, num_threads)``; ``rank_mask``: with ``ep_rank_mask`` (shrink mode).
        Its kernels time their waits (``Tuning.wait_times``: the ``*_wait_recv_cost_stats``
        come from them; two timer reads and a store per waited word)."""
        n_sms, num_threads = self.grid(n_sms, num_threads)
        return EPConfig(num_threads=num_threads, n_sms=n_sms, n_experts=self.num_experts,
                        n_ranks=self.n_ranks, max_tokens_per_rank=self.max_tokens,
                        p2p_world_size=p2p_world_size, use_shmem=use_shmem,
                        ep_final_layout=True, ep_rank_mask=rank_mask,
                        token_fmt=make_format(self.fmt, self.hidden, self.top_k),
                        tuning={"wait_times": True})


def peer_bytes(shape: LowLatencyShape) -> int:
    """Bytes of one world of ``shape`` that peers write (one result slot, per rank): the
    grouped output and its scales, the header array, the receive-count words, and the
    combine's receive buffer and arrival words (``epgen.layout``, ``CombineLayout``)."""
    cfg = shape.config(p2p_world_size=shape.n_ranks, use_shmem=False)
    lay, clay = cfg.layout, CombineLayout(cfg)
    return (lay.max_out_rows * out_row_bytes(cfg.token_fmt) + lay.hdr_buf_bytes + lay.recv_count_bytes + clay.recv_bytes
            + clay.arrival_words * clay.arrival_word_bytes)


def _int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EPInputError(f"{name}: must be an int, got {value!r}")
    return value


def dispatch_shape(torch, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *,
                   n_ranks: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                   on_cuda: bool, known: dict | None = None) -> LowLatencyShape:
    """The shape of a ``low_latency_dispatch`` call, after checking its arguments as DeepEP
    does (and epgen's own limits): ``x`` a contiguous BF16 ``[T, hidden]`` tensor,
    ``topk_idx`` int64 (or int32) ``[T, top_k]``, ``T <= num_max_dispatch_tokens_per_rank``,
    ``num_experts`` a multiple of the ranks, ``hidden`` a multiple of 128 with FP8 (of 512
    with ``use_ue8m0``, which needs ``round_scale``) and of 8 without. ``EPInputError``
    naming the argument and the rule otherwise. ``known``: the caller's dict of the shapes
    checked before, by their scalar arguments; a repeated call checks only the tensors and
    gets the same shape object back (a call's host time is a goal of the API)."""
    T_max = _int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
    E = _int(num_experts, "num_experts")
    check_tensor(torch, x, "x", dtypes=(torch.bfloat16,), dim=2, on_cuda=on_cuda)
    check_tensor(torch, topk_idx, "topk_idx", dtypes=(torch.int64, torch.int32), dim=2,
                 on_cuda=on_cuda, device=x.device)
    T, H = x.shape
    if topk_idx.shape[0] != T:
        raise EPInputError(f"topk_idx: {topk_idx.shape[0]} rows, must be one per token of x "
                           f"({T})")
    K = topk_idx.shape[1]
    if T_max < 1:
        raise EPInputError(f"num_max_dispatch_tokens_per_rank: must be >= 1, got {T_max}")
    if T > T_max:
        raise EPInputError(f"x: {T} tokens, more than num_max_dispatch_tokens_per_rank "
                           f"({T_max})")
    key = (T_max, E, H, K, bool(use_fp8), bool(round_scale), bool(use_ue8m0))
    shape = None if known is None else known.get(key)
    if shape is None:
        shape = _checked_shape(T_max, E, H, K, n_ranks=n_ranks, use_fp8=use_fp8,
                               round_scale=round_scale, use_ue8m0=use_ue8m0)
        if known is not None:
            known[key] = shape
    return shape


def _checked_shape(T_max: int, E: int, H: int, K: int, *, n_ranks: int, use_fp8: bool,
                   round_scale: bool, use_ue8m0: bool) -> LowLatencyShape:
    """``dispatch_shape``'s checks of the scalar arguments and the shape they make."""
    if E < 1 or E % n_ranks:
        raise EPInputError(f"num_experts: {E} must be a positive multiple of the group size "
                           f"({n_ranks})")
    if use_ue8m0 and not round_scale:
        raise EPInputError("use_ue8m0: UE8M0 scales need round_scale=True")
    if use_fp8:
        group = FP8_GROUP * (UE8M0_PACK if use_ue8m0 else 1)
        if H % group:
            raise EPInputError(f"x: hidden {H} must be a multiple of {group} with use_fp8"
                               f"{' and use_ue8m0' if use_ue8m0 else ''}")
    elif H % 8:
        raise EPInputError(f"x: hidden {H} must be a multiple of 8 (combine reads 16-byte "
                           f"chunks)")
    if not 1 <= K <= 32:
        raise EPInputError(f"topk_idx: top-k {K} must be in [1, 32] (one lane per slot)")
    if K > E:
        raise EPInputError(f"topk_idx: top-k {K} must be <= num_experts ({E})")
    return LowLatencyShape(n_ranks, E, T_max, H, K, format_name(use_fp8, round_scale))


def check_tensor(torch, t, name: str, *, dtypes, dim: int | None = None, shape=None,
                 on_cuda: bool, device=None, contiguous: bool = True) -> None:
    """``EPInputError`` unless ``t`` is a torch tensor of one of ``dtypes``, of ``dim``
    dimensions or exactly ``shape``, on a CUDA device when ``on_cuda`` (else on the CPU:
    the simulator's buffers), on ``device`` when given, and contiguous when asked."""
    # the common case in one expression: the messages below are only for a refusal
    if isinstance(t, torch.Tensor) and t.dtype in dtypes \
            and (dim is None or t.dim() == dim) and (shape is None or t.shape == shape) \
            and t.is_cuda == on_cuda and (device is None or t.device == device) \
            and (not contiguous or t.is_contiguous()):
        return
    if not isinstance(t, torch.Tensor):
        raise EPInputError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise EPInputError(f"{name}: dtype {t.dtype}, must be {want}")
    if dim is not None and t.dim() != dim:
        raise EPInputError(f"{name}: {t.dim()} dimensions, must be {dim}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise EPInputError(f"{name}: shape {tuple(t.shape)}, must be {tuple(shape)}")
    if t.is_cuda != on_cuda:
        where = "a CUDA tensor" if on_cuda else "a CPU tensor (the buffer runs on the simulator)"
        raise EPInputError(f"{name}: must be {where}")
    if device is not None and t.device != device:
        raise EPInputError(f"{name}: on {t.device}, must be on {device}")
    if contiguous and not t.is_contiguous():
        raise EPInputError(f"{name}: must be contiguous")


__all__ = ["LowLatencyShape", "kernel_grid", "format_name", "dispatch_shape", "peer_bytes",
           "check_tensor", "FP8_GROUP", "UE8M0_PACK"]
