"""The call-argument checks without a world or a simulator (``epgen.runtime.call_args``, the
host conversions ``interop.host_bf16`` / ``host_float32``, the torch API's expert-row rule
``epgen.torch.tensors.expert_rows_input`` on a stand-in device array): each bad argument
is named with its rule, each good one passes through unchanged in value."""

from __future__ import annotations

import re
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from epgen import interop, reference
from epgen.errors import EPInputError
from epgen.presets import load_preset
from epgen.runtime import call_args
from epgen.torch import DispatchOutput, tensors

CFG = load_preset("small")
K, H, M = CFG.token_fmt.top_k, CFG.token_fmt.hid_dim, CFG.layout.max_out_rows


# ---- input_scale ---------------------------------------------------------------------------
@pytest.mark.parametrize("value, want", [(1, 1.0), (0.37, float(np.float32(0.37))),
                                         (np.float32(2.5), 2.5), (np.array(3.0), 3.0),
                                         (np.int64(7), 7.0), (3e38, float(np.float32(3e38)))])
def test_a_good_input_scale_is_its_float32_value(value, want):
    assert call_args.input_scale(value) == want


def repr_id(value) -> str:
    """A parameter id that is the same in every process (an ``object()``'s repr is not, and
    pytest-xdist refuses workers that collect different ids)."""
    return type(value).__name__ if type(value) is object else repr(value)


@pytest.mark.parametrize("value", [float("nan"), -1.0, 0.0, -0.0, float("-inf"), 1e39, "2.0",
                                   b"1", True, np.bool_(True), None, [1.0], object()],
                         ids=repr_id)
def test_a_bad_input_scale_is_named_with_its_rule(value):
    with pytest.raises(EPInputError, match=re.escape(
            f"input_scale: must be a finite float32 > 0, got {value!r}")):
        call_args.input_scale(value)


# ---- one array per rank --------------------------------------------------------------------
def test_per_rank_takes_lists_tuples_and_3d_arrays():
    a = np.zeros((2, 3, 4), np.uint16)
    assert [x.shape for x in call_args.per_rank(a, "y", 2)] == [(3, 4), (3, 4)]
    assert call_args.per_rank((1, 2), "y", 2) == [1, 2]


@pytest.mark.parametrize("value, message", [
    (None, r"y: must be a list of one array per rank \(2\), got None"),
    (np.zeros((5, 4)), r"y: must be a list of one array per rank \(2\), got ndarray"),
    ({"a": 1}, r"y: must be a list of one array per rank \(2\), got dict"),
    ([np.zeros(1)] * 3, r"y: one array per rank \(2\), got 3"),
])
def test_per_rank_names_the_argument(value, message):
    with pytest.raises(EPInputError, match=message):
        call_args.per_rank(value, "y", 2)


# ---- host conversions ----------------------------------------------------------------------
def test_host_bf16_takes_bits_and_bfloat16_values():
    bits = np.array([[0x3F80, 0xC000]], np.uint16)
    assert interop.host_bf16(bits, "y") is bits
    as_bf16 = bits.view(ml_dtypes.bfloat16)
    assert np.array_equal(interop.host_bf16(as_bf16, "y"), bits)


@pytest.mark.parametrize("value, message", [
    (np.zeros((2, 2), np.float32), r"y\[1\]: dtype float32, must be BF16 bits as uint16"),
    (np.zeros((2, 2), np.int16), r"y\[1\]: dtype int16, must be BF16 bits as uint16"),
    ([["a"]], r"y\[1\]: dtype <U1, must be BF16 bits"),
    (None, r"y\[1\]: missing \(None\), must be BF16 bits as uint16"),
])
def test_host_bf16_names_the_argument(value, message):
    with pytest.raises(EPInputError, match=message):
        interop.host_bf16(value, "y[1]")


def test_host_float32_converts_real_numbers_by_value():
    assert interop.host_float32(np.array([[1, 2]], np.int64), "w").dtype == np.float32
    halves = np.array([[0.5, -2.0]], ml_dtypes.bfloat16)
    assert np.array_equal(interop.host_float32(halves, "w"), [[0.5, -2.0]])
    w = np.ones((2, 2), np.float32)
    assert interop.host_float32(w, "w") is w


@pytest.mark.parametrize("value, dtype", [(np.full((1, 2), "a"), "<U1"),
                                          (np.ones((1, 2), bool), "bool"),
                                          (np.ones((1, 2), complex), "complex128"),
                                          ([[None, 1]], "object")])
def test_host_float32_names_the_argument(value, dtype):
    with pytest.raises(EPInputError, match=rf"w\[0\]: dtype {dtype}, must be float32 "
                                           rf"\(an array of real numbers\)"):
        interop.host_float32(value, "w[0]")


class _DeviceArray:
    """A device array as ``__cuda_array_interface__`` describes it (never dereferenced)."""

    def __init__(self, shape, typestr="<u2"):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (0x7F0000000000, False), "version": 2,
                                         "strides": None}


def test_host_conversions_refuse_device_arrays_by_name():
    with pytest.raises(EPInputError, match=r"y\[0\]: a device array where a host array"):
        interop.host_bf16(_DeviceArray((4, H)), "y[0]")
    with pytest.raises(EPInputError, match=r"w\[0\]: a device array where a host array"):
        interop.host_float32(_DeviceArray((4, K), "<f4"), "w[0]")


# ---- combine arguments (a stand-in world) --------------------------------------------------
class _Rows:
    def __init__(self, n):
        self.n = n

    def to_host(self):
        return np.array([0, self.n // 2, self.n], np.uint32)


def _world(tokens=(5, 3), delivered=(9, 4), dispatched=True):
    ranks = [SimpleNamespace(rank=r, n_tokens=t, row_offsets=_Rows(n),
                             wait_done=object() if dispatched else None)
             for r, (t, n) in enumerate(zip(tokens, delivered))]
    world = SimpleNamespace(cfg=CFG, ranks=ranks, synced=0)
    world.synchronize = lambda: setattr(world, "synced", world.synced + 1)
    return world


def _inputs(world, rows=(9, 4)):
    ys = [np.zeros((n, H), np.uint16) for n in rows]
    ws = [np.ones((rk.n_tokens, K), np.float64) for rk in world.ranks]
    rs = [np.zeros((rk.n_tokens, H), np.uint16).view(ml_dtypes.bfloat16)
          for rk in world.ranks]
    return ys, ws, rs


def test_combine_inputs_convert_good_arguments():
    world = _world()
    ys, ws, rs = call_args.combine_inputs(world, *_inputs(world))
    assert [y.dtype for y in ys] == [np.uint16] * 2
    assert [w.dtype for w in ws] == [np.float32] * 2 and [r.dtype for r in rs] == [np.uint16] * 2
    assert call_args.combine_inputs(world, _inputs(world)[0])[1:] == (None, None)


@pytest.mark.parametrize("change, message", [
    (lambda ys, ws, rs: (ys, None, rs), r"residual: needs topk_weights"),
    (lambda ys, ws, rs: ([np.zeros((M + 1, H), np.uint16), ys[1]], ws, rs),
     rf"expert_outputs\[0\]: shape \({M + 1}, {H}\), must be \[rows <= max_out_rows={M}, "
     rf"hid_dim={H}\]"),
    (lambda ys, ws, rs: ([ys[0], ys[1][:, :8]], ws, rs),
     r"expert_outputs\[1\]: shape \(4, 8\), must be"),
    (lambda ys, ws, rs: (ys, [ws[0], ws[1][:2]], rs),
     rf"topk_weights\[1\]: shape \(2, {K}\), must be \[T, top_k\] = \[3, {K}\] \(T: rank 1's"),
    (lambda ys, ws, rs: (ys, ws, [rs[0][:1], rs[1]]),
     rf"residual\[0\]: shape \(1, {H}\), must be \[T, hid_dim\] = \[5, {H}\]"),
    (lambda ys, ws, rs: (ys, ws, [rs[0], rs[1].astype(np.float32)]),
     r"residual\[1\]: dtype float32, must be BF16 bits as uint16"),
    (lambda ys, ws, rs: (ys[:1], ws, rs), r"expert_outputs: one array per rank \(2\), got 1"),
    (lambda ys, ws, rs: (ys, "w", rs),
     r"topk_weights: must be a list of one array per rank \(2\), got str"),
])
def test_combine_inputs_name_the_bad_argument(change, message):
    world = _world()
    with pytest.raises(EPInputError, match=message):
        call_args.combine_inputs(world, *change(*_inputs(world)))


def test_last_dispatch_rows_are_read_after_a_synchronise():
    world = _world(delivered=(9, 0))
    assert call_args.last_dispatch_rows(world) == [9, 0] and world.synced == 1


def test_no_dispatch_no_rows():
    world = _world(dispatched=False)
    with pytest.raises(RuntimeError, match="no dispatch to combine: call dispatch first"):
        call_args.last_dispatch_rows(world)
    assert world.synced == 0


@pytest.mark.parametrize("rows", [(9, 4), (9, 7), (M, M)])
def test_expert_outputs_covering_the_delivered_rows_pass(rows):
    world = _world()
    call_args.check_combine(world, *_inputs(world, rows))


@pytest.mark.parametrize("rows, rank, given, delivered", [((8, 4), 0, 8, 9),
                                                          ((9, 0), 1, 0, 4)])
def test_expert_outputs_short_of_the_delivered_rows_are_named(rows, rank, given, delivered):
    world = _world()
    with pytest.raises(EPInputError, match=(
            rf"expert_outputs\[{rank}\]: {given} rows given, but the last dispatch delivered "
            rf"{delivered} rows to rank {rank}: one expert output row per delivered row")):
        call_args.check_combine(world, *_inputs(world, rows))


# ---- the torch API's combine ---------------------------------------------------------------
def _output(rank, n_tokens, filled=True):
    return DispatchOutput(rank, None, None, None, None, None, None, n_tokens,
                          topk_ids=object() if filled else None)


def test_dispatch_outputs_of_the_last_dispatch_pass():
    ranks = [SimpleNamespace(rank=r, n_tokens=4) for r in (2, 3)]
    call_args.check_dispatch_outputs([_output(2, 4), _output(3, 4)], ranks)


@pytest.mark.parametrize("out, error, message", [
    (_output(3, 4), EPInputError, r"out\[2\]: must be the DispatchOutput dispatch returned "
                                  r"for rank 2, got DispatchOutput"),
    (np.zeros(3), EPInputError, r"out\[2\]: must be the DispatchOutput .* got ndarray"),
    (_output(2, 4, filled=False), RuntimeError, r"out\[2\]: no dispatch has filled it"),
    (_output(2, 6), EPInputError, r"out\[2\]: from an earlier dispatch \(6 tokens; rank 2's "
                                  r"last dispatch had 4\)"),
])
def test_a_wrong_dispatch_output_is_named(out, error, message):
    with pytest.raises(error, match=message):
        call_args.check_dispatch_outputs([out], [SimpleNamespace(rank=2, n_tokens=4)])


_NO_TORCH = SimpleNamespace(Tensor=type("Tensor", (), {}))    # no array is a torch tensor


@pytest.mark.parametrize("rows", [0, 1, M - 1, M + 1])
def test_torch_expert_outputs_must_have_max_out_rows_rows(rows):
    """The delivered count is on the device, so only ``max_out_rows`` rows are known to
    cover it: fewer (the delivered rows of a synchronised host read included) are refused."""
    with pytest.raises(EPInputError, match=(
            rf"expert_out\[1\]: shape \({rows}, {H}\), must be \[max_out_rows={M}, "
            rf"hid_dim={H}\] \(one row per row of out.tokens")):
        tensors.expert_rows_input(_NO_TORCH, _DeviceArray((rows, H)), "expert_out[1]", CFG, 0)


def test_torch_expert_outputs_of_max_out_rows_rows_pass():
    y = _DeviceArray((M, H))
    got, info = tensors.expert_rows_input(_NO_TORCH, y, "expert_out[0]", CFG, 0)
    assert got is y and info.shape == (M, H)


# ---- the reference names the same arguments ------------------------------------------------
def test_reference_combine_names_a_float32_expert_output():
    res = SimpleNamespace(src_info=np.zeros((3, 2), np.int32))
    with pytest.raises(EPInputError, match=r"expert_outputs\[0\]: dtype float32, must be BF16"):
        reference.combine(CFG, [res, res], [np.zeros((3, H), np.float32)] * 2, None,
                          n_tokens=[1, 1])
