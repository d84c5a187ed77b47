"""Where a routed token goes, and how the destination finds it: the destination strategy,
chosen once from the configuration when a kernel declares its parameters.

``strategy_class(cfg)`` is one of

- ``staged.StagedDestination`` (the default): the message goes to row ``slot`` of block
  ``(e, src)`` of the destination's receive buffer; dispatch_wait copies it to the grouped
  output;
- ``rank_dedup.RankDedupDestination`` (``ep_rank_dedup``): the staged layout with one message
  per (token, destination rank), in the receive buffer's message area, and an index table
  that names each slot's token; dispatch_wait's copy reads the slot's token there
  (``message_address``);
- ``final_layout.CapacityStridedRows`` (``ep_final_layout``) and
  ``final_layout.ProdReservedRows`` (with ``ep_prod_reserve``): the payload goes straight to
  its final output row and the header to the same row of the header array; dispatch_wait's
  copy blocks run the header pass.

``declare_send`` (``dispatch_async.declare_params``) and ``declare_wait``
(``dispatch_wait.declare_params``) build it, declaring its own kernel parameters, into the
parameters' ``dest``. Every builder then asks ``p.dest``, so none tests the layout itself:

- the monitor (``monitor.py``): ``offset_var`` / ``reserve`` / ``reserve_counted`` /
  ``carried_offset`` (the block reservation and the offset the count word carries),
  ``count_word`` (the published count), ``rearm`` (its words after a call);
- the send paths (``send_warp.py``, ``send_staged.py``): ``slot_counter`` / ``take_slot`` /
  ``reserve_slot`` (a top-k slot's counter and row on its ``(expert, destination)`` block),
  ``copy_message`` / ``send_slot`` / ``warp_rows`` (where the staged message or the warp's
  token goes, header included), ``stage_source`` (what the header carries besides the source index),
  ``shares_tokens``;
- dispatch_wait's aux block: ``start_arrivals`` (at entry), ``count_offset_var`` /
  ``read_count_offset`` (the offset a count word carries), ``group_end`` / ``pad_groups`` /
  ``pair_end_word`` (the rows of each group and pair), ``rearm_arrivals`` (its words of the
  receive-count buffer);
- dispatch_wait's copy blocks: ``copy_pass`` (the staged copy, or the header pass) and its
  scratch, ``copy_scratch_bytes``; the staged copy's ``message_address`` (where slot ``j`` of
  block ``(e, src)``'s message lies).
"""

from __future__ import annotations

import ir

from .final_layout import CapacityStridedRows, ProdReservedRows
from .rank_dedup import RankDedupDestination
from .staged import StagedDestination


def strategy_class(cfg) -> type[StagedDestination]:
    """The destination strategy of ``cfg`` (module docstring)."""
    if not cfg.ep_final_layout:
        return RankDedupDestination if cfg.ep_rank_dedup else StagedDestination
    return ProdReservedRows if cfg.ep_prod_reserve else CapacityStridedRows


def declare_send(kb: ir.KernelBuilder, cfg, p) -> StagedDestination:
    """dispatch_async's strategy: ``strategy_class(cfg)`` with its send-side parameters
    declared on ``kb`` after dispatch_async's own ``p``."""
    return strategy_class(cfg).declare_send(kb, cfg, p)


def declare_wait(kb: ir.KernelBuilder, cfg, p) -> StagedDestination:
    """dispatch_wait's strategy: ``strategy_class(cfg)`` with its wait-side parameters
    declared on ``kb`` after dispatch_wait's own ``p``."""
    return strategy_class(cfg).declare_wait(kb, cfg, p)


__all__ = ["strategy_class", "declare_send", "declare_wait"]
