"""DeepEP's ``get_dispatch_layout``: where each token of a rank goes, from its top-k ids alone.

For ``topk_idx`` ``[T, K]`` (``-1``: no expert) and ``num_experts`` experts on ``R`` ranks
(expert ``g`` lives on rank ``g // (num_experts / R)``):

- ``num_tokens_per_rank[r]``: the tokens with at least one expert on rank ``r`` (a token
  counts once per rank, however many of its experts live there);
- ``num_tokens_per_expert[g]``: the ``(token, slot)`` pairs routed to expert ``g``;
- ``is_token_in_rank[t, r]``: whether token ``t`` has an expert on rank ``r``;
- ``num_tokens_per_rdma_rank``: ``None`` (DeepEP's value for ranks that all reach each
  other directly; epgen has no RDMA-rank level).

All three tensors are computed on the ids' device with scatters, no host round trip. An id
outside ``[-1, num_experts)`` selects nothing and is counted in ``bad``, a one-element
device tensor the caller turns into an error (``LayoutResult.raise_if_bad``): at once
outside a CUDA-graph capture, at ``Buffer.check()`` inside one (a capture cannot read the
device).
"""

from __future__ import annotations

import attrs

from ..errors import EPInputError
from .shapes import check_tensor


@attrs.frozen
class LayoutResult:
    """The results of ``dispatch_layout`` (module docstring) and the bad-id count."""

    num_tokens_per_rank: object
    num_tokens_per_expert: object
    is_token_in_rank: object
    bad: object

    def raise_if_bad(self, bad_count: int | None = None) -> None:
        """``EPInputError`` naming ``topk_idx`` when ``bad_count`` (default: read ``bad``,
        a host synchronisation) is non-zero."""
        n = int(self.bad.item()) if bad_count is None else bad_count
        if n:
            raise EPInputError(f"topk_idx: {n} id(s) outside [-1, num_experts) "
                               f"(-1 selects no expert)")


def check_arguments(torch, topk_idx, num_experts, n_ranks: int, *, on_cuda: bool) -> int:
    """``EPInputError`` naming the argument unless ``topk_idx`` is a 2-D int64 or int32 tensor
    on the buffer's kind of device and ``num_experts`` a positive multiple of ``n_ranks``;
    returns the experts per rank."""
    check_tensor(torch, topk_idx, "topk_idx", dtypes=(torch.int64, torch.int32), dim=2,
                 on_cuda=on_cuda, contiguous=False)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise EPInputError(f"num_experts: must be an int, got {num_experts!r}")
    if num_experts < 1 or num_experts % n_ranks:
        raise EPInputError(f"num_experts: {num_experts} must be a positive multiple of the "
                           f"group size ({n_ranks})")
    return num_experts // n_ranks


def dispatch_layout(torch, topk_idx, num_experts: int, n_ranks: int) -> LayoutResult:
    """The layout of ``topk_idx`` (module docstring); the arguments already checked
    (``check_arguments``). Invalid ids and ``-1`` go to a discard column that is dropped."""
    L = num_experts // n_ranks
    T, _ = topk_idx.shape
    dev = topk_idx.device
    idx = topk_idx.to(torch.int64)
    valid = (idx >= 0) & (idx < num_experts)
    bad = ((idx < -1) | (idx >= num_experts)).sum(dtype=torch.int64).reshape(1)
    expert = torch.where(valid, idx, torch.full_like(idx, num_experts))
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    per_expert.scatter_add_(0, expert.reshape(-1),
                            torch.ones(expert.numel(), dtype=torch.int32, device=dev))
    rank = torch.where(valid, idx // L, torch.full_like(idx, n_ranks))
    in_rank = torch.zeros((T, n_ranks + 1), dtype=torch.bool, device=dev)
    in_rank.scatter_(1, rank, torch.ones_like(rank, dtype=torch.bool))
    in_rank = in_rank[:, :n_ranks].contiguous()
    per_rank = in_rank.sum(dim=0, dtype=torch.int32)
    return LayoutResult(per_rank, per_expert[:num_experts].contiguous(), in_rank, bad)


__all__ = ["LayoutResult", "check_arguments", "dispatch_layout"]
