"""backends.cuda on the CPU: cache keys, argument packing, pointer extraction and errors.
Compile / load / launch / memory / events on a GPU: tests/gpu/test_cuda_runtime_gpu.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import backends.cuda as bc
from backends.cuda import compat, stream
from backends.cuda.compile import cache_key, cache_path, default_cache_dir, normalize_arch
from backends.cuda.errors import CudaError, CudaUnavailableError, check, translate_exception
from backends.cuda.launch import check_untyped_args, pack_args

PTX = ".version 8.6\n.target sm_90\n.address_size 64\n"


# ---------------------------------------------------------------------------------------------
# Fakes


class FakeCudaArray:
    """Device memory seen only through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, shape=(4,), typestr="<u4"):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (ptr, False), "version": 3, "strides": None}


class FakeDLPackCuda:
    """Claims to live on CUDA device 0 and exports a real (host) DLPack capsule, so the
    capsule parsing can be checked on the CPU."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()


class IRType:
    """Stands in for an IR type object: only ``.name`` matters."""

    def __init__(self, name: str):
        self.name = name


# ---------------------------------------------------------------------------------------------
# Cache keys


def test_cache_key_is_stable():
    a = cache_key(PTX + "// k\n", "sm_90", 13000, ["nvjitlink-13.0"])
    b = cache_key(PTX + "// k\n", "sm_90", 13000, ["nvjitlink-13.0"])
    assert a == b
    assert len(a) == 64 and int(a, 16) >= 0


def test_cache_key_is_sensitive_to_every_input():
    base = cache_key(PTX, "sm_90", 13000)
    assert cache_key(PTX + " ", "sm_90", 13000) != base
    assert cache_key(PTX, "sm_100", 13000) != base
    assert cache_key(PTX, "sm_90a", 13000) != base
    assert cache_key(PTX, "sm_90", 12080) != base
    assert cache_key(PTX, "sm_90", 13000, ["ptxas:-O0"]) != base
    # fields are length-prefixed: moving text between fields changes the key
    assert cache_key(PTX, "sm_90", 13000, ["ab", "c"]) != cache_key(PTX, "sm_90", 13000,
                                                                    ["a", "bc"])


def test_cache_key_normalizes_arch_and_ptx_type():
    assert cache_key(PTX, "90", 13000) == cache_key(PTX, "sm_90", 13000)
    assert cache_key(PTX.encode(), "SM_90", 13000) == cache_key(PTX, "sm_90", 13000)


def test_normalize_arch():
    assert normalize_arch("sm_90") == "sm_90"
    assert normalize_arch(90) == "sm_90"
    assert normalize_arch("sm_90a") == "sm_90a"
    with pytest.raises(ValueError, match="architecture"):
        normalize_arch("compute")


def test_cache_path_and_default_dir(tmp_path, monkeypatch):
    key = cache_key(PTX, "sm_90", 13000)
    assert cache_path(tmp_path, key) == tmp_path / key[:2] / f"{key}.cubin"
    monkeypatch.setenv("EPGEN_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("EPGEN_CACHE_DIR")
    assert default_cache_dir().parts[-3:] == (".cache", "epgen", "cubin")


# ---------------------------------------------------------------------------------------------
# Typed argument packing


def test_pack_args_converts_to_exact_types():
    packed = pack_args(["u32", "s64", "f32", "u8", "pred", "ptr.global"],
                       [np.int64(7), np.int32(-3), 1.5, np.uint16(255), True,
                        FakeCudaArray(0x7F0000001000)])
    assert [type(v) for v in packed[:5]] == [np.uint32, np.int64, np.float32, np.uint8, np.bool_]
    assert packed[:5] == (7, -3, 1.5, 255, True)
    assert packed[5] == 0x7F0000001000 and type(packed[5]) is int


def test_pack_args_accepts_ir_type_objects():
    packed = pack_args([IRType("u16"), IRType("ptr.global")], [np.uint8(3), 0x1000])
    assert type(packed[0]) is np.uint16 and packed[1] == 0x1000


def test_pack_args_rejects_plain_python_int_for_scalar():
    with pytest.raises(TypeError, match=r"argument 1 'n' \(u32\).*Python int"):
        pack_args(["ptr.global", "u32"], [0x1000, 5], names=["x", "n"])


def test_pack_args_int_scalars_opt_in():
    packed = pack_args(["u32", "s8"], [5, -1], int_scalars=True)
    assert type(packed[0]) is np.uint32 and packed[0] == 5
    assert type(packed[1]) is np.int8 and packed[1] == -1


@pytest.mark.parametrize("ptype, value", [
    ("u32", np.int64(-1)), ("u32", np.uint64(2**32)), ("s8", np.int16(128)),
    ("s8", np.int16(-129)), ("u64", np.int64(-5)), ("b16", np.int32(70000)),
])
def test_pack_args_range_errors(ptype, value):
    with pytest.raises(ValueError, match=r"argument 0 \(" + ptype + r"\).*outside"):
        pack_args([ptype], [value])


def test_pack_args_bits_types_take_signed_or_unsigned():
    (packed,) = pack_args(["b32"], [np.int32(-1)])
    assert type(packed) is np.uint32 and packed == 0xFFFFFFFF


def test_pack_args_float_checks():
    with pytest.raises(TypeError, match="integer for a float"):
        pack_args(["f32"], [np.int32(1)])
    with pytest.raises(ValueError, match="overflows f32"):
        pack_args(["f32"], [1e300])
    with pytest.raises(ValueError, match="overflows f16"):
        pack_args(["f16"], [np.float32(1e6)])
    (inf,) = pack_args(["f32"], [float("inf")])
    assert np.isinf(inf)


def test_pack_args_bf16_bits():
    packed = pack_args(["bf16", "bf16", "bf16"], [1.0, -2.0, 1.00390625])
    assert [int(v) for v in packed] == [0x3F80, 0xC000, 0x3F80]  # last: tie rounds to even
    assert all(type(v) is np.uint16 for v in packed)


def test_pack_args_type_errors():
    with pytest.raises(TypeError, match="bool for an integer"):
        pack_args(["u32"], [np.bool_(True)])
    with pytest.raises(TypeError, match="expected an integer"):
        pack_args(["u32"], [np.float32(1.0)])
    with pytest.raises(TypeError, match="takes 2 arguments, got 1"):
        pack_args(["u32", "u32"], [np.uint32(1)])
    with pytest.raises(TypeError, match="cannot be passed"):
        pack_args(["v4.u32"], [np.uint32(1)])
    with pytest.raises(TypeError, match="host numpy array"):
        pack_args(["ptr.global"], [np.zeros(4)])


def test_pack_args_null_pointer():
    assert pack_args(["ptr.global"], [None]) == (0,)


# ---------------------------------------------------------------------------------------------
# Untyped arguments


def test_untyped_args_reject_python_scalars():
    with pytest.raises(TypeError, match=r"argument 1.*Python int.*pointer"):
        check_untyped_args([np.uint32(1), 5])
    with pytest.raises(TypeError, match=r"argument 0 'scale'.*double"):
        check_untyped_args([1.5], names=["scale"])
    with pytest.raises(TypeError, match="bool"):
        check_untyped_args([True])


def test_untyped_args_pass_scalars_and_extract_pointers():
    scalar = np.float32(2.0)
    c_int = ctypes.c_int32(3)
    packed = check_untyped_args([scalar, c_int, FakeCudaArray(0xABC000)])
    assert packed[0] is scalar and packed[1] is c_int and packed[2] == 0xABC000


# ---------------------------------------------------------------------------------------------
# Pointer extraction


def test_as_device_pointer_sources():
    assert bc.as_device_pointer(FakeCudaArray(0x1234000)) == 0x1234000
    assert bc.as_device_pointer(0x5000) == 0x5000
    assert bc.as_device_pointer(np.uint64(0x6000)) == 0x6000
    host = np.arange(8, dtype=np.int32)
    assert bc.as_device_pointer(FakeDLPackCuda(host)) == host.ctypes.data


def test_as_device_pointer_rejections():
    with pytest.raises(ValueError, match="outside"):
        bc.as_device_pointer(-1)
    with pytest.raises(TypeError, match="bool"):
        bc.as_device_pointer(True)
    with pytest.raises(TypeError, match="host numpy array"):
        bc.as_device_pointer(np.zeros(3))
    with pytest.raises(TypeError, match="cannot get a device pointer"):
        bc.as_device_pointer("0x1000")
    with pytest.raises(TypeError, match="not in CUDA device memory"):
        bc.as_device_pointer(_CpuDLPack())


class _CpuDLPack:
    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, stream=None):  # pragma: no cover - never reached
        raise AssertionError


# ---------------------------------------------------------------------------------------------
# Errors


def test_check_returns_outputs_and_raises_with_driver_name():
    driver = pytest.importorskip("cuda.bindings.driver")
    ok = driver.CUresult.CUDA_SUCCESS
    assert check((ok,)) is None
    assert check((ok, 5)) == 5
    assert check((ok, 1, 2)) == (1, 2)
    with pytest.raises(CudaError, match=r"cuMemAlloc: CUDA_ERROR_INVALID_VALUE") as info:
        check((driver.CUresult.CUDA_ERROR_INVALID_VALUE, None), "cuMemAlloc")
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert info.value.code == 1 and info.value.call == "cuMemAlloc"
    assert isinstance(info.value, RuntimeError)


def test_translate_cuda_core_exceptions():
    class CUDAError(Exception):
        pass

    CUDAError.__module__ = "cuda.core._utils.cuda_utils"
    err = translate_exception(CUDAError("CUDA_ERROR_OUT_OF_MEMORY: out of memory"), "allocating")
    assert isinstance(err, CudaError) and err.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert str(err).startswith("allocating: CUDA_ERROR_OUT_OF_MEMORY")
    assert translate_exception(ValueError("misuse")) is None

    with pytest.raises(CudaError, match="launching: CUDA_ERROR_INVALID_VALUE"):
        with bc.cuda_errors("launching"):
            raise CUDAError("CUDA_ERROR_INVALID_VALUE: bad")
    with pytest.raises(ValueError):
        with bc.cuda_errors("launching"):
            raise ValueError("not a CUDA error")


def test_translate_nvjitlink_error():
    nvjitlink = pytest.importorskip("cuda.bindings.nvjitlink")
    exc = nvjitlink.nvJitLinkError(nvjitlink.Result.ERROR_PTX_COMPILE)
    err = translate_exception(exc, "compiling")
    assert err.name == "NVJITLINK_ERROR_PTX_COMPILE"


# ---------------------------------------------------------------------------------------------
# Availability


@pytest.fixture
def fresh_probe():
    stream._reset_probe()
    yield
    stream._reset_probe()


def test_gpu_available_never_raises(fresh_probe):
    assert isinstance(bc.gpu_available(), bool)


def test_no_driver_gives_clear_errors(fresh_probe, monkeypatch):
    monkeypatch.setattr(stream, "_probe_driver", lambda: (False, "libcuda.so not found"))
    assert bc.gpu_available() is False
    with pytest.raises(CudaUnavailableError, match="libcuda.so not found"):
        bc.get_device()
    with pytest.raises(CudaUnavailableError):
        bc.compile_ptx(PTX, "sm_90")
    with pytest.raises(CudaUnavailableError):
        bc.zeros(4, np.uint32)
    assert bc.device_count() == 0


def test_probe_failure_is_reported_not_raised(fresh_probe, monkeypatch):
    def boom():
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(compat, "driver", boom)
    assert bc.gpu_available() is False


# ---------------------------------------------------------------------------------------------
# compat


def test_parse_version():
    assert compat.parse_version("1.2.0") == (1, 2, 0)
    assert compat.parse_version("0.5") == (0, 5, 0)
    assert compat.parse_version("1.3.0.dev4+gabc") == (1, 3, 0)


def test_launch_config_accepts_numpy_dims():
    try:
        compat.core()
    except CudaUnavailableError as exc:
        pytest.skip(str(exc))
    config = compat.launch_config(np.int64(4), (np.int32(128),), 256)
    assert tuple(config.grid) == (4, 1, 1) and tuple(config.block) == (128, 1, 1)
    assert config.shmem_size == 256
    with pytest.raises(ValueError, match="1 to 3"):
        compat.launch_config((1, 1, 1, 1), 32)


def test_launch_config_programmatic(monkeypatch):
    try:
        compat.core()
    except CudaUnavailableError as exc:
        pytest.skip(str(exc))
    if compat.CUDA_CORE_GE_1_0:
        assert compat.launch_config(1, 32, programmatic=True).programmatic_stream_serialization
        assert not compat.launch_config(1, 32).programmatic_stream_serialization
    monkeypatch.setattr(compat, "CUDA_CORE_GE_1_0", False)
    with pytest.raises(CudaUnavailableError, match="cuda-core 1.0"):
        compat.launch_config(1, 32, programmatic=True)

