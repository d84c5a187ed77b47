"""The CUDA host path makes no driver call that fails (what ``compute-sanitizer`` reports as
an API error): pinned on the CPU with a fake driver and a fake cuda.core that record every
call and fail exactly where the real ones do.

- ``cuCtxGetDevice`` only while a context is current (``CUDA_ERROR_INVALID_CONTEXT``
  otherwise), and never cuda.core's ``Device(None)``, which calls it unguarded;
- ``cuKernelGetParamInfo`` only for indices below the kernel's parameter count
  (``CUDA_ERROR_INVALID_VALUE`` past the last, which cuda.core's ``arguments_info`` probes
  for);
- ``cuCtxEnablePeerAccess`` once per pair (``CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`` again).
"""

from __future__ import annotations

import pathlib
import re
import types

import pytest

from backends.cuda import compat, stream
from backends.cuda.kernel import KernelHandle, entry_param_count, kernel_param_sizes
from backends.cuda.module import LoadedModule

REPO = pathlib.Path(__file__).resolve().parents[2]
SUCCESS, INVALID_VALUE, INVALID_CONTEXT, ALREADY_ENABLED = 0, 1, 201, 704


class Result(int):
    """A ``CUresult`` stand-in: an int with a ``name``."""

    NAMES = {SUCCESS: "CUDA_SUCCESS", INVALID_VALUE: "CUDA_ERROR_INVALID_VALUE",
             INVALID_CONTEXT: "CUDA_ERROR_INVALID_CONTEXT",
             ALREADY_ENABLED: "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"}

    @property
    def name(self):
        return self.NAMES[int(self)]


class FakeDriver:
    """The ``cuda.bindings.driver`` calls of the host path, failing where the driver does;
    ``calls`` records each, ``errors`` each call that would have failed."""

    class CUkernel:
        def __init__(self, n_params):
            self.n_params = n_params

    class CUresult:
        CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = Result(ALREADY_ENABLED)

    CUdevice = int

    def __init__(self):
        self.calls, self.errors = [], []
        self.current = 0          # the current context: 0 none, else 100 + ordinal
        self.peer = set()

    def _result(self, name, code, *outputs):
        self.calls.append(name)
        if code:
            self.errors.append((name, Result(code).name))
        return (Result(code), *outputs)

    def cuCtxGetCurrent(self):
        return self._result("cuCtxGetCurrent", SUCCESS, self.current)

    def cuCtxSetCurrent(self, ctx):
        self.current = int(ctx)
        return self._result("cuCtxSetCurrent", SUCCESS)

    def cuCtxGetDevice(self):
        if not self.current:
            return self._result("cuCtxGetDevice", INVALID_CONTEXT, 0)
        return self._result("cuCtxGetDevice", SUCCESS, self.current - 100)

    def cuDriverGetVersion(self):
        return self._result("cuDriverGetVersion", SUCCESS, 13000)

    def cuKernelGetParamCount(self, handle):
        return self._result("cuKernelGetParamCount", SUCCESS, handle.n_params)

    def cuKernelGetParamInfo(self, handle, index):
        self.calls.append(("cuKernelGetParamInfo", index))
        if index >= handle.n_params:
            return self._result("cuKernelGetParamInfo", INVALID_VALUE, 0, 0)
        return self._result("cuKernelGetParamInfo", SUCCESS, 8 * index, 4 + 4 * (index % 2))

    def cuDeviceGetMemPool(self, dev):
        return self._result("cuDeviceGetMemPool", SUCCESS, f"pool{int(dev)}")

    def cuMemPoolTrimTo(self, pool, size):
        return self._result("cuMemPoolTrimTo", SUCCESS)

    def cuDeviceCanAccessPeer(self, a, b):
        return self._result("cuDeviceCanAccessPeer", SUCCESS, 1)

    def cuCtxEnablePeerAccess(self, ctx, flags):
        pair = (self.current, int(ctx))
        if pair in self.peer:
            return self._result("cuCtxEnablePeerAccess", ALREADY_ENABLED)
        self.peer.add(pair)
        return self._result("cuCtxEnablePeerAccess", SUCCESS)


class FakeCore:
    """cuda.core's ``Device``: ``Device(None)`` asks ``cuCtxGetDevice`` unguarded, as the
    real one does."""

    def __init__(self, drv):
        outer = self
        self.drv = drv
        self.device_args = []

        class Device:
            def __init__(self, device_id=None):
                outer.device_args.append(device_id)
                if device_id is None:
                    err, dev = drv.cuCtxGetDevice()
                    device_id = int(dev) if not int(err) else 0
                self.device_id = int(device_id)

            def __int__(self):
                return self.device_id

            def set_current(self):
                drv.cuCtxSetCurrent(100 + self.device_id)

        self.Device = Device


@pytest.fixture
def fake(monkeypatch):
    drv = FakeDriver()
    core = FakeCore(drv)
    monkeypatch.setattr(compat, "driver", lambda: drv)
    monkeypatch.setattr(compat, "core", lambda: core)
    monkeypatch.setattr(stream, "_probe", lambda: (True, ""))
    monkeypatch.setattr(stream, "_peer_enabled", set())
    return types.SimpleNamespace(drv=drv, core=core)


# ---- no context query without a current context -----------------------------------------------
def test_get_device_without_a_current_context_asks_no_context(fake):
    dev = stream.get_device()
    assert dev.device_id == 0
    assert fake.drv.errors == []
    assert "cuCtxGetDevice" not in fake.drv.calls
    assert None not in fake.core.device_args       # never cuda.core's unguarded Device()


def test_get_device_with_a_current_context_keeps_its_device(fake):
    stream.get_device(1)
    assert stream.get_device().device_id == 1
    assert fake.drv.errors == [] and None not in fake.core.device_args


def test_using_device_none_first_in_a_thread(fake):
    with stream.using_device() as dev:
        assert dev.device_id == 0
    with stream.using_device(None):
        pass
    assert fake.drv.errors == [] and None not in fake.core.device_args


def test_trim_memory_pool_asks_no_context(fake):
    from epgen.bench.memory import trim_memory_pool

    notes = []
    trim_memory_pool(1, notes.append)
    assert notes == [] and fake.drv.errors == []
    assert "cuCtxGetDevice" not in fake.drv.calls and "cuMemPoolTrimTo" in fake.drv.calls


# ---- parameter sizes: exactly the known count -------------------------------------------------
def _handle(n_params, **kwargs):
    core_kernel = types.SimpleNamespace(handle=FakeDriver.CUkernel(n_params))
    return KernelHandle(None, "k", core_kernel, types.SimpleNamespace(device_id=0), **kwargs)


def _param_queries(drv):
    return [c[1] for c in drv.calls if isinstance(c, tuple) and c[0] == "cuKernelGetParamInfo"]


@pytest.mark.parametrize("n", [0, 1, 3, 17])
def test_param_sizes_ask_only_below_the_entry_count(fake, n):
    k = _handle(n, param_count=n)
    sizes = k.param_sizes()
    assert sizes == (tuple(4 + 4 * (i % 2) for i in range(n)) or None)
    assert _param_queries(fake.drv) == list(range(n))
    assert fake.drv.errors == []
    k.param_sizes()                                        # cached: asked once
    assert _param_queries(fake.drv) == list(range(n))


def test_param_sizes_count_from_the_driver_without_an_entry_count(fake):
    k = _handle(3, param_types=("ptr.global", "u32"))      # the driver's count wins
    assert k.param_sizes() == (4, 8, 4)
    assert fake.drv.calls.count("cuKernelGetParamCount") == 1
    assert _param_queries(fake.drv) == [0, 1, 2] and fake.drv.errors == []


def test_bare_kernel_sizes_from_the_driver_count(fake):
    core_kernel = types.SimpleNamespace(handle=FakeDriver.CUkernel(2))
    assert kernel_param_sizes(core_kernel) == (4, 8)
    assert kernel_param_sizes(core_kernel, 1) == (4,)
    assert _param_queries(fake.drv) == [0, 1, 0] and fake.drv.errors == []


def test_param_sizes_without_the_driver_count(fake, monkeypatch):
    """A 12.4 - 12.9 driver has the sizes but not the count: the types' count, else
    nothing asked."""
    monkeypatch.setattr(fake.drv, "cuDriverGetVersion", lambda: (Result(0), 12080))
    assert _handle(3, param_types=("u64", "u32", "u32")).param_sizes() == (4, 8, 4)
    assert _handle(3).param_sizes() is None
    assert kernel_param_sizes(types.SimpleNamespace(handle=FakeDriver.CUkernel(3))) is None
    assert _param_queries(fake.drv) == [0, 1, 2] and fake.drv.errors == []
    assert "cuKernelGetParamCount" not in fake.drv.calls


def test_param_sizes_on_an_old_driver(fake, monkeypatch):
    monkeypatch.setattr(fake.drv, "cuDriverGetVersion", lambda: (Result(0), 12030))
    assert _handle(2, param_count=2).param_sizes() is None
    assert _param_queries(fake.drv) == []


def test_loaded_module_kernels_know_their_entry_count(fake):
    mod = object.__new__(LoadedModule)
    mod.ptx, mod.name, mod._kernels = TWO_ENTRIES, "m", {}
    mod.device = stream.get_device(0)
    mod.object_code = types.SimpleNamespace(
        get_kernel=lambda name: types.SimpleNamespace(handle=FakeDriver.CUkernel(
            {"scale": 3, "table": 1}[name])))
    assert mod.kernel("scale").param_count == 3
    assert mod.kernel("table").param_sizes() == (4,)
    assert fake.drv.errors == []


TWO_ENTRIES = """.version 8.6
.target sm_90
.address_size 64
.visible .entry scale_twice(
\t.param .u64 scale_twice_param_0
)
{ ret; }
.visible .entry scale(
\t.param .u64 scale_param_0,
\t.param .u32 scale_param_1,
\t.param .f32 scale_param_2
)
{ ret; }
.visible .entry table(
\t.param .align 8 .b8 table_param_0[40]
)
{ ret; }
.visible .entry none()
{ ret; }
.visible .entry bare
{ ret; }
"""


def test_entry_param_count():
    assert entry_param_count(TWO_ENTRIES, "scale") == 3
    assert entry_param_count(TWO_ENTRIES, "scale_twice") == 1
    assert entry_param_count(TWO_ENTRIES, "table") == 1          # one by-value array
    assert entry_param_count(TWO_ENTRIES, "none") == 0
    assert entry_param_count(TWO_ENTRIES, "bare") == 0
    assert entry_param_count(TWO_ENTRIES, "missing") is None
    assert entry_param_count(TWO_ENTRIES, "scal") is None


def test_entry_param_count_of_generated_ptx():
    """Every kernel of the small preset's module: the PTX entry's count is the IR's."""
    from backends import nvptx
    from epgen import presets
    from epgen.kernels import build_module

    module = build_module(presets.load_preset("small"))
    ptx = nvptx.emit_linked_ptx(module, arch="sm_90")
    for k in module.kernels:
        assert entry_param_count(ptx, k.name) == len(k.params), k.name


# ---- peer access: enabled once per pair ---------------------------------------------------------
def test_enable_peer_access_once_per_pair(fake):
    assert stream.enable_peer_access(0, 1) is True
    assert stream.enable_peer_access(0, 1) is False
    assert stream.enable_peer_access(1, 0) is True
    assert fake.drv.calls.count("cuCtxEnablePeerAccess") == 2
    assert fake.drv.errors == []


# ---- the sources use neither probe --------------------------------------------------------------
PROBES = re.compile(r"\.arguments_info\b|\.num_arguments\b|\bDevice\(\s*\)|Device\(None\)")


def test_no_probing_calls_in_the_host_path():
    """cuda.core's ``Kernel.arguments_info`` / ``num_arguments`` probe past the last
    parameter, its ``Device()`` asks ``cuCtxGetDevice`` without a context: none of the host
    path's modules calls them."""
    found = []
    for sub in ("backends/cuda", "epgen/runtime", "epgen/bench", "epgen/torch"):
        for path in sorted((REPO / sub).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if PROBES.search(code) and "``" not in code:
                    found.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
