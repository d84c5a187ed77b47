"""Where a kernel runs each dispatch role, and the SM arguments of the reference methods it
passes (reference page: ``sm_id`` of ``monitor_and_signal_completion`` and
``copy_and_send_tokens``, ``n_active_send_sms``, ``n_active_offset_sms``, ``scatter_sm_id``,
and ``pack_shared_expert_inputs``' ``pack_sm_id``, ``n_active_comm_sms``, ``n_send_sms``).

``SMMap`` is the standalone kernels' mapping: every role on its usual blocks, every SM
argument left to the builder's default (derived from ``%ctaid.x`` and ``%nctaid.x``), so the
generated code is the one without a map. A persistent fused kernel remaps SMs by passing
another map (``ReversedSubsetSMs`` is the test kernel's, ``sm_remap``); the composers
(``dispatch_async.add_send_phase``, ``dispatch_fused.build_dispatch_fused``) ask it for each
role's block range and keyword arguments. Emits nothing itself but the u32 expressions the
roles evaluate.
"""

from __future__ import annotations

import ir

from .send_policy import sends_from_every_block

#: The SM arguments each role's builder takes, by role name.
ROLE_ARGS = {
    "monitor": ("sm_id",), "signal": ("sm_id",), "comm": ("sm_id", "n_active_send_sms"),
    "aux": ("n_active_offset_sms",), "copy": ("scatter_sm_id",),
    "pack": ("pack_sm_id", "n_active_comm_sms", "n_send_sms"),
}


class SMMap:
    """The default mapping: ``blocks`` returns the role's usual range, ``args`` no SM
    argument (each builder derives its default from the block index)."""

    def blocks(self, cfg, role: str, start, stop):
        """The role's block range ``(start, stop)`` (``stop`` None: the grid's end)."""
        return start, stop

    def args(self, cfg, role: str, r: ir.RoleBuilder) -> dict:
        """Keyword SM arguments for the role's builder (names from ``ROLE_ARGS``)."""
        return {}


DEFAULT_SMS = SMMap()


def _last_block():
    return ir.SRegRead(ir.SReg.NCTAID_X) - 1


class ReversedSubsetSMs(SMMap):
    """The SM-remapping test kernel's map: every role's ids in reversed block order, the
    sends on every block but the last one, the copy role on blocks ``[1, grid - 1)``:

    ==========  =====================  ==============================================
    role        blocks                 SM arguments
    ==========  =====================  ==============================================
    monitor,    ``[0, n_signal_sms)``  ``sm_id = n_signal_sms - 1 - block``
    signal
    comm        ``[s, grid - 1)``      ``sm_id = grid - 2 - block``,
                                       ``n_active_send_sms = grid - 1 - s``
    aux         ``grid - 1``           ``n_active_offset_sms = grid - 2``
    copy        ``[1, grid - 1)``      ``scatter_sm_id = grid - 2 - block``
    pack        ``[0, grid - 1)``      ``pack_sm_id = block`` (the default reverses),
                                       ``n_active_comm_sms = grid - 1``,
                                       ``n_send_sms = grid - 1 - s``
    ==========  =====================  ==============================================

    ``s`` is the first sending block (0 when the monitor blocks send too, else
    ``n_signal_sms``). Needs ``n_sms >= n_signal_sms + 3`` (``check``)."""

    def check(self, cfg) -> None:
        n_sig = cfg.layout.n_signal_sms
        if cfg.n_sms < n_sig + 3:
            raise ValueError(f"ReversedSubsetSMs needs n_sms >= n_signal_sms + 3 = {n_sig + 3} "
                             f"(a send block besides the last one and two copy blocks), got "
                             f"n_sms={cfg.n_sms}")

    @staticmethod
    def _first_send(cfg) -> int:
        return 0 if sends_from_every_block(cfg) else cfg.layout.n_signal_sms

    def blocks(self, cfg, role, start, stop):
        if role == "comm":
            return start, _last_block()
        if role == "copy":
            return 1, stop
        return start, stop

    def args(self, cfg, role, r):
        last, n_sig, s = _last_block(), cfg.layout.n_signal_sms, self._first_send(cfg)
        if role in ("monitor", "signal"):
            return {"sm_id": r.let("remap_sm_id", (n_sig - 1) - r.block)}
        if role == "comm":
            return {"sm_id": r.let("remap_sm_id", (last - 1) - r.block),
                    "n_active_send_sms": r.let("remap_n_send", last - s)}
        if role == "aux":
            return {"n_active_offset_sms": r.let("remap_n_copy", last - 1)}
        if role == "copy":
            return {"scatter_sm_id": r.let("remap_scatter_id", (last - 1) - r.block)}
        if role == "pack":
            return {"pack_sm_id": r.let("remap_pack_id", r.block),
                    "n_active_comm_sms": r.let("remap_n_comm", last),
                    "n_send_sms": r.let("remap_n_send", last - s)}
        raise ValueError(f"ReversedSubsetSMs: no role {role!r}")


__all__ = ["SMMap", "DEFAULT_SMS", "ReversedSubsetSMs", "ROLE_ARGS"]
