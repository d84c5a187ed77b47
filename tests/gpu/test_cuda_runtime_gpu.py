"""backends.cuda on a GPU (``@pytest.mark.gpu``): compile / load / launch / memory / events.
The CPU side (cache keys, argument packing, pointer extraction, errors):
tests/unit/test_cuda_runtime.py."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import backends.cuda as bc
from backends.cuda.errors import CudaError

PTX = ".version 8.6\n.target sm_90\n.address_size 64\n"

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
    """The PTX entry's count, then one driver query per parameter (tests/unit/test_host_path.py
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
