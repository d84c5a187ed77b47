"""``epgen.interop``: what an input's metadata says (shape, dtype, byte strides, device) for
numpy, ``__cuda_array_interface__`` and torch objects, the copy plan of a device input
(contiguous, rows apart, refused), and the host paths: strided numpy views and torch CPU
tensors dispatch on the CPU simulator exactly as their contiguous copies."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import interop, reference, routing
from epgen.errors import EPInputError
from epgen.presets import load_preset
from epgen.runtime.world import EmulatedWorld


class FakeCuda:
    """A ``__cuda_array_interface__`` producer at a made-up address (never dereferenced)."""

    def __init__(self, shape, typestr, strides=None, ptr=0x10000, stream=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": strides, "version": 3, "stream": stream}


def test_numpy_info_and_contiguity():
    a = np.zeros((4, 6), np.uint16)
    info = interop.describe(a, "x")
    assert (info.shape, info.dtype, info.strides, info.on_device) == ((4, 6), "uint16", (12, 2),
                                                                       False)
    assert info.contiguous and info.row_pitch == 12
    view = interop.describe(a[:, :3], "x")
    assert not view.contiguous and view.row_pitch == 12
    assert interop.describe(a.T, "x").row_pitch is None


def test_device_rows_plans_and_refusals():
    c = interop.describe(FakeCuda((4, 8), "<u2"), "tokens[0]")
    assert c.on_device and c.contiguous
    assert interop.device_rows(c) == (0x10000, 64, 64, 1)
    wide = interop.describe(FakeCuda((4, 8), "<u2", strides=(40, 2)), "tokens[0]")
    assert interop.device_rows(wide) == (0x10000, 40, 16, 4)
    for strides in [(2, 8), (16, 4), (8, 2)]:      # transposed, element-strided, overlapping
        bad = interop.describe(FakeCuda((4, 8), "<u2", strides=strides), "tokens[1]")
        with pytest.raises(EPInputError, match=r"tokens\[1\].*contiguous"):
            interop.device_rows(bad)
    assert interop.describe(FakeCuda((3,), "<i4", stream=7), "ids").stream == 7


def test_host_array_refuses_device_and_copies_views():
    with pytest.raises(EPInputError, match="ids: a device array"):
        interop.host_array(FakeCuda((2, 2), "<i4"), "ids")
    a = np.arange(24, dtype=np.uint16).reshape(4, 6)
    got = interop.host_array(a[:, 1:4], "x")
    assert got.flags.c_contiguous and np.array_equal(got, a[:, 1:4])


def _dispatch_both(cfg, seed, make_input):
    """The sim world's results for ``make_input(tokens)`` inputs against the reference."""
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    got = world.dispatch([make_input(t) for t in toks], ids)
    reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)


def test_strided_numpy_view_dispatches_as_its_values(seed):
    cfg = load_preset("small")
    H = cfg.token_fmt.hid_dim

    def wider_view(t):
        w = np.zeros((t.shape[0], H + 24), np.uint16)
        w[:, 8:8 + H] = t
        return w[:, 8:8 + H]
    _dispatch_both(cfg, seed, wider_view)


def test_torch_cpu_bf16_tensors_dispatch(seed):
    torch = pytest.importorskip("torch")
    cfg = load_preset("small")

    def as_torch(t):      # BF16 bits -> a torch bf16 CPU tensor, as a strided view
        base = torch.from_numpy(np.ascontiguousarray(t).view(np.int16)).view(torch.bfloat16)
        return torch.cat([base, base], dim=1)[:, :t.shape[1]]
    _dispatch_both(cfg, seed, as_torch)
    info = interop.describe(as_torch(np.zeros((2, 4), np.uint16)), "x")
    assert info.dtype == "bfloat16" and info.strides == (16, 2) and not info.on_device


class _DLPackOnly:
    """An object that offers its array only through the DLPack protocol."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, stream=None, **kw):
        return self._a.__dlpack__()

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_transposed_torch_cpu_tensor_dispatches_as_its_values(seed):
    """A column-major (transposed) BF16 CPU tensor: its values, not its memory order."""
    torch = pytest.importorskip("torch")
    cfg = load_preset("small")

    def transposed(t):
        base = torch.from_numpy(np.ascontiguousarray(t).view(np.int16)).view(torch.bfloat16)
        x = torch.empty(t.shape[1], t.shape[0], dtype=torch.bfloat16).t()
        x.copy_(base)
        assert not x.is_contiguous()
        return x
    _dispatch_both(cfg, seed, transposed)


def test_dlpack_only_inputs_dispatch(seed):
    """Tokens and ids offered only through ``__dlpack__`` (host memory) dispatch as their
    arrays; the ids as int64 too."""
    cfg = load_preset("small")
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    got = world.dispatch([_DLPackOnly(np.ascontiguousarray(t)) for t in toks],
                         [_DLPackOnly(i.astype(np.int64)) for i in ids])
    reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)
