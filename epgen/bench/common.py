"""What both benchmark drivers share: ``driver`` (every rank on one GPU) and ``p2p`` (one GPU
per rank). ``driver`` hands a P2P plan to ``p2p``, and ``p2p`` uses these pieces, so they
live here rather than in either of them.
"""

from __future__ import annotations

from ..formats import BF16Format

__all__ = ["bf16_config", "failures", "import_torch"]


def import_torch():
    """``(torch, None)`` when torch imports and sees a GPU, else ``(None, why)``. torch is an
    optional dependency, imported only here and only when a benchmark runs."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False"
    return torch, None


def bf16_config(cfg):
    """``cfg`` with the BF16 format of the same shape (what the PyTorch baseline moves)."""
    fmt = cfg.token_fmt
    if isinstance(fmt, BF16Format):
        return cfg
    return cfg.replace(token_fmt=BF16Format(hid_dim=fmt.hid_dim, top_k=fmt.top_k,
                                            alignment=fmt.alignment))


def failures(results, baseline: str = "baseline") -> list[str]:
    """Errors and failed checks of a run, one line each (skipped phases are not failures);
    ``baseline`` names the baseline in the lines."""
    out = []
    for s in results.get("shapes", []):
        b = s["baseline"]
        if "error" in b or b.get("check", "ok") != "ok":
            out.append(f"T={s['tokens_per_rank']} {baseline}: {b.get('error') or b['check']}")
        out += [f"T={s['tokens_per_rank']} epgen {v['label']}: {v['error']}"
                for v in s["variants"] if "error" in v]
    return out
