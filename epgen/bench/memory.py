"""Device memory: estimates of what each benchmark phase allocates (pure, from ``cfg.layout``)
so that a phase that cannot fit is skipped with a message instead of failing, and the two
device queries the driver needs (free memory, trimming the memory pool)."""

from __future__ import annotations

from .traffic import out_row_bytes

ALLOC_GRANULE = 2 << 20
"""Device allocations are rounded up to this in the estimates."""
GiB = 1 << 30


def granule(nbytes: int) -> int:
    return -(-max(int(nbytes), 1) // ALLOC_GRANULE) * ALLOC_GRANULE


def world_memory(cfg) -> dict:
    """Device bytes an ``EmulatedWorld`` of ``cfg`` allocates (``epgen/runtime/rank_world.py``'s
    per-rank buffers, from ``cfg.layout``), each allocation rounded up to 2 MiB."""
    lay, fmt = cfg.layout, cfg.token_fmt
    T, K, H = cfg.max_tokens_per_rank, fmt.top_k, fmt.hid_dim
    per_rank = {
        "tokens": T * H * 2,
        "topk_ids": T * K * 4,
        "send_buf": lay.send_buf_bytes,
        "recv_buf": lay.recv_buf_bytes,
        "recv_count": lay.recv_count_bytes,
        "counters": lay.counter_bytes,
        "out_tokens": lay.max_out_rows * out_row_bytes(fmt),
        "row_offsets": (lay.n_groups + 1) * 4,
        "expert_ids": lay.n_groups * 4,
        "src_info": lay.max_out_rows * 8,
        "hdr_buf": lay.hdr_buf_bytes,            # ep_final_layout
        "prod_buf": lay.prod_buf_bytes,          # ep_prod_reserve
    }
    rank_total = sum(granule(v) for v in per_rank.values())
    extra = 2 * cfg.n_ranks * granule(8 * cfg.p2p_world_size) + 8 * ALLOC_GRANULE  # ptrs, diag
    return {"per_rank": per_rank, "per_rank_total": rank_total,
            "total": cfg.n_ranks * rank_total + extra}


def staged_inputs_memory(cfg, tokens_per_rank: int, n_sets: int) -> int:
    """Device bytes of the staged epgen input sets."""
    fmt = cfg.token_fmt
    per = granule(tokens_per_rank * fmt.hid_dim * 2) + granule(tokens_per_rank * fmt.top_k * 4)
    return n_sets * cfg.n_ranks * per


def baseline_memory(cfg, tokens_per_rank: int, n_sets: int) -> int:
    """Device bytes of the baseline: staged sets, the grouped output and the sort's buffers
    (keys, indices, radix-sort scratch, ``order // K``: about 8 int64 arrays), plus 256 MiB
    for torch's allocator."""
    R, T, K, H = cfg.n_ranks, tokens_per_rank, cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
    n = R * T * K
    sets = n_sets * (granule(R * T * H * 2) + granule(n * 8))
    return sets + granule(n * H * 2) + 8 * granule(n * 8) + 256 * (1 << 20)


def fmt_gb(n) -> str:
    return f"{n / 1e9:.2f} GB"


# ---- device queries -------------------------------------------------------------------------
def mem_info(device) -> tuple[int, int]:
    """(free, total) device bytes."""
    from backends.cuda import check, compat, using_device
    with using_device(device):
        free, total = check(compat.driver().cuMemGetInfo(), "cuMemGetInfo")
    return int(free), int(total)


def trim_memory_pool(device, progress) -> None:
    """Give the device's current memory pool's free memory back (``cuMemPoolTrimTo``), so
    that torch can use what a torn-down world held; best effort (a failure is reported
    through ``progress``)."""
    try:
        from backends.cuda import check, compat, using_device
        drv = compat.driver()
        with using_device(device) as dev:
            pool = check(drv.cuDeviceGetMemPool(drv.CUdevice(int(dev.device_id))),
                         "cuDeviceGetMemPool")
            check(drv.cuMemPoolTrimTo(pool, 0), "cuMemPoolTrimTo")
    except Exception as exc:  # noqa: BLE001
        progress(f"  (memory pool not trimmed: {type(exc).__name__}: {exc})")
