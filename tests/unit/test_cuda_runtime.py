"""backends.cuda: cache keys, argument packing, pointer extraction and errors on the CPU;
compile / load / launch / memory / events on a GPU (``@pytest.mark.gpu``)."""

from __future__ import annotations

import ctypes
import warnings

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


# ---------------------------------------------------------------------------------------------
# GPU tests

ADD_ONE_PTX = PTX + r"""
.visible .entry add_one(
	.param .u64 add_one_param_0,
	.param .u32 add_one_param_1,
	.param .u32 add_one_param_2
)
{
	.reg .pred 	%p<2>;
	.reg .b32 	%r<9>;
	.reg .b64 	%rd<5>;

	ld.param.u64 	%rd1, [add_one_param_0];
	ld.param.u32 	%r1, [add_one_param_1];
	ld.param.u32 	%r2, [add_one_param_2];
	mov.u32 	%r3, %ctaid.x;
	mov.u32 	%r4, %ntid.x;
	mov.u32 	%r5, %tid.x;
	mad.lo.s32 	%r6, %r3, %r4, %r5;
	setp.ge.u32 	%p1, %r6, %r1;
	@%p1 bra 	$L__done;
	cvta.to.global.u64 	%rd2, %rd1;
	mul.wide.u32 	%rd3, %r6, 4;
	add.s64 	%rd4, %rd2, %rd3;
	ld.global.u32 	%r7, [%rd4];
	add.s32 	%r8, %r7, %r2;
	st.global.u32 	[%rd4], %r8;
$L__done:
	ret;
}
"""

ADD_ONE_TYPES = ("ptr.global", "u32", "u32")

SMEM_PTX = PTX + r"""
.extern .shared .align 16 .b8 dyn_smem[];

.visible .entry smem_rw(
	.param .u64 smem_rw_param_0,
	.param .u32 smem_rw_param_1
)
{
	.reg .b32 	%r<5>;
	.reg .b64 	%rd<8>;

	ld.param.u64 	%rd1, [smem_rw_param_0];
	ld.param.u32 	%r1, [smem_rw_param_1];
	mov.u32 	%r2, %tid.x;
	add.s32 	%r3, %r2, %r1;
	mul.wide.u32 	%rd2, %r3, 4;
	mov.u64 	%rd3, dyn_smem;
	add.s64 	%rd4, %rd3, %rd2;
	st.shared.u32 	[%rd4], %r2;
	bar.sync 	0;
	ld.shared.u32 	%r4, [%rd4];
	cvta.to.global.u64 	%rd5, %rd1;
	mul.wide.u32 	%rd6, %r2, 4;
	add.s64 	%rd7, %rd5, %rd6;
	st.global.u32 	[%rd7], %r4;
	ret;
}
"""


@pytest.fixture
def module(tmp_path):
    return bc.LoadedModule(ADD_ONE_PTX, cache_dir=tmp_path)


@pytest.mark.gpu
def test_compile_ptx_uses_the_disk_cache(tmp_path):
    before = bc.cache_info()
    first = bc.compile_ptx(ADD_ONE_PTX, cache_dir=tmp_path)
    assert bc.cache_info().misses == before.misses + 1
    assert list(tmp_path.glob("*/*.cubin")), "the cubin was not written to the cache"
    second = bc.compile_ptx(ADD_ONE_PTX, cache_dir=tmp_path)
    assert bc.cache_info().hits == before.hits + 1
    assert bytes(second.code) == bytes(first.code)
    assert second.get_kernel("add_one") is not None


@pytest.mark.gpu
def test_launch_typed_args(module):
    n = 1000
    data = bc.to_device(np.arange(n, dtype=np.uint32))
    kernel = module.kernel("add_one", param_types=ADD_ONE_TYPES, param_names=("x", "n", "d"))
    bc.launch(kernel, (n + 255) // 256, 256, (data, np.uint32(n), np.uint32(7)), sync=True)
    np.testing.assert_array_equal(data.to_host(), np.arange(n, dtype=np.uint32) + 7)
    kernel.launch((n + 255) // 256, 256, (data, n, 1), int_scalars=True)
    np.testing.assert_array_equal(data.to_host(), np.arange(n, dtype=np.uint32) + 8)


@pytest.mark.gpu
def test_launch_untyped_numpy_scalars_on_a_stream(module):
    n = 300
    s = bc.create_stream()
    data = bc.zeros(n, np.uint32, stream=s)
    raw_kernel = module.kernel("add_one").kernel  # a bare cuda.core Kernel
    bc.launch(raw_kernel, 2, 256, (data, np.uint32(n), np.uint32(3)), stream=s)
    np.testing.assert_array_equal(data.to_host(), np.full(n, 3, np.uint32))


@pytest.mark.gpu
def test_python_int_scalar_is_rejected(module):
    data = bc.zeros(16, np.uint32)
    untyped = module.kernel("add_one")
    with pytest.raises(TypeError, match="argument 1.*Python int"):
        bc.launch(untyped, 1, 32, (data, 16, np.uint32(1)))
    with pytest.raises(TypeError, match="argument 2.*Python int"):
        bc.launch(untyped, 1, 32, (data, np.uint32(16), 1), param_types=ADD_ONE_TYPES)
    with pytest.raises(TypeError, match="4 bytes"):  # widths checked against the driver
        bc.launch(untyped, 1, 32, (data, np.uint64(16), np.uint32(1)))
    with pytest.raises(TypeError, match="takes 3 arguments"):
        bc.launch(untyped.kernel, 1, 32, (data, np.uint32(16)))
    np.testing.assert_array_equal(data.to_host(), np.zeros(16, np.uint32))


@pytest.mark.gpu
def test_param_sizes_from_the_entry_count(module):
    """The PTX entry's count, then one driver query per parameter (tests/test_host_path.py
    pins that no index past the last is asked)."""
    from backends.cuda.kernel import driver_param_count, kernel_param_sizes

    k = module.kernel("add_one")
    assert k.param_count == 3
    assert k.param_sizes() == (8, 4, 4)
    assert driver_param_count(k.kernel) in (3, None)       # None below driver 13.0
    assert kernel_param_sizes(k.kernel) in ((8, 4, 4), None)


@pytest.mark.gpu
def test_device_array_round_trip_and_memsets():
    host = np.arange(64, dtype=np.uint32).reshape(8, 8)
    arr = bc.to_device(host)
    np.testing.assert_array_equal(arr.to_host(), host)
    assert arr.shape == (8, 8) and arr.nbytes == 256

    cai = arr.__cuda_array_interface__
    assert cai["version"] == 3 and cai["data"] == (arr.ptr, False) and cai["typestr"] == "<u4"
    assert bc.as_device_pointer(arr) == arr.ptr == bc.as_device_pointer(arr.buffer)

    rows = arr[2:4]
    assert rows.ptr == arr.ptr + 2 * 32 and rows.shape == (2, 8)
    np.testing.assert_array_equal(rows.to_host(), host[2:4])
    rows.fill_bytes(0xAB)
    expect = host.copy()
    expect[2:4] = 0xABABABAB
    np.testing.assert_array_equal(arr.to_host(), expect)

    tail = arr.subarray(7 * 32, (4,), np.uint64)
    tail.fill_u32(5)
    np.testing.assert_array_equal(tail.to_host(), np.full(4, (5 << 32) | 5, np.uint64))

    copy = bc.empty((8, 8), np.uint32).copy_from(arr)
    np.testing.assert_array_equal(copy.to_host(), arr.to_host())
    np.testing.assert_array_equal(bc.zeros(5, np.float32).to_host(), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="outside"):
        arr.subarray(250, (4,), np.uint32)


@pytest.mark.gpu
def test_events_time_the_work(module):
    n = 1 << 20
    data = bc.zeros(n, np.uint32)
    kernel = module.kernel("add_one", param_types=ADD_ONE_TYPES)
    with bc.Timer() as timer:
        for _ in range(3):
            kernel.launch(n // 256, 256, (data, np.uint32(n), np.uint32(1)))
    assert timer.ms >= 0.0
    s = bc.default_stream()
    start = bc.record(s)
    kernel.launch(n // 256, 256, (data, np.uint32(n), np.uint32(1)))
    end = bc.record(s)
    assert bc.elapsed_ms(start, end) >= 0.0
    assert int(data.to_host()[-1]) == 4


@pytest.mark.gpu
def test_invalid_ptx_raises_compile_error(tmp_path):
    bad = ADD_ONE_PTX.replace("add.s32 	%r8, %r7, %r2;", "add.s32 	%r8, %r7, %r99;")
    assert bad != ADD_ONE_PTX
    with pytest.raises(bc.CompileError) as info:
        bc.compile_ptx(bad, cache_dir=tmp_path)
    assert isinstance(info.value, CudaError)
    assert "compiling PTX for sm_" in str(info.value)
    assert "r99" in str(info.value) or "error" in info.value.log.lower()


@pytest.mark.gpu
def test_kernel_attributes_and_occupancy(module):
    kernel = module.kernel("add_one")
    attrs = kernel.attributes()
    assert attrs.num_regs > 0 and attrs.max_threads_per_block >= 256
    assert attrs.shared_size_bytes == 0
    assert kernel.max_active_blocks_per_sm(256) >= 1
    assert bc.sm_count() > 0 and bc.arch().startswith("sm_")
    assert bc.driver_version() >= 12000


@pytest.mark.gpu
def test_dynamic_shared_memory_above_48k(tmp_path):
    kernel = bc.LoadedModule(SMEM_PTX, cache_dir=tmp_path).kernel(
        "smem_rw", param_types=("ptr.global", "u32"))
    out = bc.zeros(256, np.uint32)
    smem = 64 * 1024
    kernel.launch(1, 256, (out, np.uint32(60 * 1024 // 4)), shmem=smem, sync=True)
    np.testing.assert_array_equal(out.to_host(), np.arange(256, dtype=np.uint32))
    assert kernel.attributes().max_dynamic_shared_size_bytes >= smem
    assert kernel.max_active_blocks_per_sm(256, smem) >= 1


def _import_or_skip(name: str):
    with warnings.catch_warnings():  # import-time warnings are not ours to fail on
        warnings.simplefilter("ignore")
        return pytest.importorskip(name)


@pytest.mark.gpu
def test_cupy_interop(module):
    cp = _import_or_skip("cupy")
    kernel = module.kernel("add_one", param_types=ADD_ONE_TYPES)
    x = cp.arange(100, dtype=cp.uint32)
    kernel.launch(1, 128, (x, np.uint32(100), np.uint32(2)), sync=True)
    assert int(x[99]) == 101
    mine = bc.to_device(np.arange(10, dtype=np.uint32))
    np.testing.assert_array_equal(cp.asnumpy(cp.asarray(mine)), np.arange(10))


@pytest.mark.gpu
def test_torch_interop(module):
    torch = _import_or_skip("torch")
    kernel = module.kernel("add_one", param_types=ADD_ONE_TYPES)
    t = torch.zeros(10, dtype=torch.int32, device="cuda")
    kernel.launch(1, 32, (t, np.uint32(10), np.uint32(9)), sync=True)
    assert t.cpu().tolist() == [9] * 10


@pytest.mark.gpu
def test_peer_access():
    if bc.device_count() < 2:
        pytest.skip("needs two GPUs")
    if not bc.can_access_peer(0, 1):
        with pytest.raises(CudaError, match="cannot access"):
            bc.enable_peer_access(0, 1)
        return
    first = bc.enable_peer_access(0, 1)
    assert bc.enable_peer_access(0, 1) is False  # already enabled is tolerated
    assert isinstance(first, bool)
    assert bc.enable_peer_access(0, 0) is False
