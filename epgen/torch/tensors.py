"""Torch tensors over epgen's device buffers, and the checks of the torch API's inputs that
need no device data (shapes, dtypes, devices, layout)."""

from __future__ import annotations

import functools

import numpy as np

from .. import interop
from ..errors import EPInputError

#: numpy dtypes torch can view through ``__cuda_array_interface__``, by the torch view wanted
_VIEW_AS = {"bfloat16": np.int16, "uint16": np.int16, "uint32": np.int32}


class _Window:
    """``__cuda_array_interface__`` (version 2: no stream, so torch does not synchronise)
    of ``shape``/``dtype`` at ``ptr``; keeps ``owner`` alive as long as the tensor."""

    def __init__(self, ptr: int, shape, dtype, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": tuple(int(d) for d in shape),
                                         "typestr": np.dtype(dtype).str,
                                         "data": (int(ptr), False), "version": 2,
                                         "strides": None}


def view(torch, arr, *, dtype: str | None = None, shape=None, byte_offset: int = 0):
    """A torch tensor viewing ``arr`` (a ``backends.cuda`` DeviceArray), from
    ``byte_offset`` with ``shape`` (default: the array's) as ``dtype`` (a torch dtype name;
    default: the array's dtype; ``bfloat16``, ``uint16`` and ``uint32`` come through their
    same-size signed integers). No copy, no synchronisation."""
    want = dtype or np.dtype(arr.dtype).name
    np_dt = np.dtype(_VIEW_AS.get(want, want))
    shape = tuple(arr.shape) if shape is None else tuple(shape)
    dev = arr.device.device_id
    t = torch.as_tensor(_Window(arr.ptr + byte_offset, shape, np_dt, arr),
                        device=f"cuda:{dev}")
    if want == "bfloat16":
        return t.view(torch.bfloat16)
    return t


@functools.cache
def _torch_token_dtypes(torch) -> tuple:
    return (torch.bfloat16, torch.uint16) if hasattr(torch, "uint16") else (torch.bfloat16,)


def tokens_input(torch, x, name: str, cfg, device: int):
    """``x`` checked as one rank's tokens ``[T, hid_dim]`` BF16 on CUDA device ``device``:
    returns ``(x, info)``, a torch tensor made contiguous on the device when it was not
    (``x.contiguous()``, on the current stream) with ``info`` None, or another library's
    array and its ``interop.ArrayInfo`` (C-contiguous or with contiguous rows:
    ``interop.device_rows``)."""
    fmt = cfg.token_fmt
    if isinstance(x, torch.Tensor):
        if not x.is_cuda:
            raise EPInputError(f"{name}: a CPU tensor; the torch API takes CUDA tensors "
                               f"(x.cuda()), the numpy API (world.dispatch) host arrays")
        if not x.is_contiguous():
            x = x.contiguous()
        shape = x.shape
        if (x.dtype in _torch_token_dtypes(torch) and len(shape) == 2
                and shape[1] == fmt.hid_dim and shape[0] <= cfg.max_tokens_per_rank
                and x.device.index == device):
            return x, None          # the common case, checked without building an ArrayInfo
    info = interop.describe(x, name)
    if not info.on_device:
        raise EPInputError(f"{name}: a host array; the torch API takes device arrays")
    if info.device != device:
        raise EPInputError(f"{name}: on CUDA device {info.device}, the rank's buffers are on "
                           f"device {device}")
    if len(info.shape) != 2 or info.shape[1] != fmt.hid_dim:
        raise EPInputError(f"{name}: shape {info.shape} must be [T, hid_dim={fmt.hid_dim}]")
    if info.dtype not in fmt.accepted_input_dtypes:
        raise EPInputError(f"{name}: dtype {info.dtype} is not accepted by {fmt.name} (use one "
                           f"of {', '.join(fmt.accepted_input_dtypes)})")
    if info.shape[0] > cfg.max_tokens_per_rank:
        raise EPInputError(f"{name}: T={info.shape[0]} exceeds max_tokens_per_rank="
                           f"{cfg.max_tokens_per_rank}")
    interop.device_rows(info)
    return x, info


def ids_input(torch, ids, name: str, T: int, K: int, device: int):
    """``ids`` checked as one rank's top-k ids ``[T, top_k]``, int32 or int64 (what
    ``torch.topk`` gives), on device ``device``; a non-contiguous torch tensor is made
    contiguous on the current stream. Returns ``(ids, info)`` (``info`` None for a torch
    tensor). The values are not read: ``ep_check_ids`` checks them on the device."""
    if isinstance(ids, torch.Tensor):
        if not ids.is_cuda:
            raise EPInputError(f"{name}: a CPU tensor; the torch API takes CUDA tensors")
        if ids.dtype not in (torch.int32, torch.int64):
            raise EPInputError(f"{name}: dtype {ids.dtype} must be torch.int32 or torch.int64")
        if not ids.is_contiguous():
            ids = ids.contiguous()
        if ids.shape != (T, K):
            raise EPInputError(f"{name}: shape {tuple(ids.shape)} must be [T, top_k] = "
                               f"[{T}, {K}]")
        if ids.device.index != device:
            raise EPInputError(f"{name}: must be on CUDA device {device}")
        return ids, None
    info = interop.describe(ids, name)
    if not info.on_device or info.device != device:
        raise EPInputError(f"{name}: must be on CUDA device {device}")
    if tuple(info.shape) != (T, K):
        raise EPInputError(f"{name}: shape {tuple(info.shape)} must be [T, top_k] = [{T}, {K}]")
    if info.dtype not in ("int32", "int64"):
        raise EPInputError(f"{name}: dtype {info.dtype} must be int32 or int64")
    if not info.contiguous:
        raise EPInputError(f"{name}: must be C-contiguous (byte strides {info.strides})")
    return ids, info


def rows_input(torch, y, name: str, rows: int, H: int, device: int, rows_are: str = "T",
               why: str = ""):
    """``y`` checked as BF16 rows ``[rows, H]`` on CUDA device ``device`` (``rows_are``
    names ``rows`` in the message, ``why`` ends it): returns ``(y, info)``, a torch tensor
    (made contiguous on the current stream if needed) with ``info`` None, or another
    library's C-contiguous array (DLPack, ``__cuda_array_interface__``; BF16 or its uint16
    bits) and its ``ArrayInfo``."""
    if isinstance(y, torch.Tensor):
        if not y.is_cuda:
            raise EPInputError(f"{name}: a CPU tensor; the torch API takes CUDA tensors")
        if y.dtype not in _torch_token_dtypes(torch):
            raise EPInputError(f"{name}: dtype {y.dtype}, must be torch.bfloat16")
        shape, dev = tuple(y.shape), y.device.index
    else:
        info = interop.describe(y, name)
        if not info.on_device:
            raise EPInputError(f"{name}: a host array; the torch API takes device arrays")
        if info.dtype not in ("bfloat16", "uint16"):
            raise EPInputError(f"{name}: dtype {info.dtype}, must be bfloat16 (or its uint16 "
                               f"bits)")
        shape, dev = tuple(info.shape), info.device
    if len(shape) != 2 or shape[1] != H or shape[0] != rows:
        raise EPInputError(f"{name}: shape {shape}, must be [{rows_are}={rows}, "
                           f"hid_dim={H}]{why}")
    if dev != device:
        raise EPInputError(f"{name}: on CUDA device {dev}, the rank's buffers are on device "
                           f"{device}")
    if isinstance(y, torch.Tensor):
        return y.contiguous(), None
    if not info.contiguous:
        raise EPInputError(f"{name}: must be C-contiguous (byte strides {info.strides}); "
                           f"pass a contiguous copy")
    return y, info


def expert_rows_input(torch, y, name: str, cfg, device: int):
    """``y`` checked as one rank's expert outputs for combine (``rows_input``): exactly
    ``[max_out_rows, hid_dim]`` BF16, one row per row of the ``DispatchOutput``'s
    ``tokens``. Exactly: the rows the dispatch delivered (``row_offsets[-1]``) are counted
    on the device, which the torch API never reads, so only outputs of every row a
    dispatch can deliver are known to cover them; the rows past the delivered ones are
    not read."""
    return rows_input(torch, y, name, cfg.layout.max_out_rows, cfg.token_fmt.hid_dim, device,
                      rows_are="max_out_rows",
                      why=" (one row per row of out.tokens: the delivered rows are counted on "
                          "the device, which the torch API does not read; rows past them "
                          "are not read)")


def output_rows(torch, out, name: str, T: int, H: int, device: int) -> None:
    """``out`` checked as a tensor the kernel may write a result into: a contiguous
    ``[T, H]`` BF16 torch CUDA tensor on ``device`` (nothing is converted: a converted copy
    would not be the caller's tensor)."""
    if not isinstance(out, torch.Tensor) or not out.is_cuda:
        raise EPInputError(f"{name}: must be a torch CUDA tensor")
    if out.dtype is not torch.bfloat16:
        raise EPInputError(f"{name}: dtype {out.dtype}, must be torch.bfloat16")
    if tuple(out.shape) != (T, H):
        raise EPInputError(f"{name}: shape {tuple(out.shape)}, must be [T={T}, hid_dim={H}]")
    if not out.is_contiguous():
        raise EPInputError(f"{name}: must be contiguous (the kernel writes it row by row)")
    if out.device.index != device:
        raise EPInputError(f"{name}: on CUDA device {out.device.index}, the rank's buffers "
                           f"are on device {device}")


def weights_input(torch, w, name: str, T: int, K: int, device: int):
    """``w`` checked as one rank's router weights ``[T, top_k]`` float32 on ``device``
    (a torch tensor of another float dtype is converted there). Returns ``(w, info)``."""
    if isinstance(w, torch.Tensor):
        if not w.is_cuda:
            raise EPInputError(f"{name}: a CPU tensor; the torch API takes CUDA tensors")
        if w.dtype is not torch.float32:
            w = w.to(torch.float32)
        if not w.is_contiguous():
            w = w.contiguous()
        if w.shape == (T, K) and w.device.index == device:
            return w, None          # the common case, checked without building an ArrayInfo
    info = interop.describe(w, name)
    if not info.on_device or info.device != device:
        raise EPInputError(f"{name}: must be on CUDA device {device}")
    if tuple(info.shape) != (T, K) or info.dtype != "float32" or not info.contiguous:
        raise EPInputError(f"{name}: must be a C-contiguous float32 [T, top_k] = [{T}, {K}] "
                           f"array, got {info.dtype} {tuple(info.shape)}")
    return w, info


__all__ = ["view", "tokens_input", "ids_input", "rows_input", "expert_rows_input",
           "output_rows", "weights_input"]
