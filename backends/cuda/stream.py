"""Devices, streams, events and peer access.

:func:`gpu_available` never raises; everything that touches a device goes through
:func:`require_driver` and raises :class:`CudaUnavailableError` with the reason when there is
no driver or no GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import compat
from .errors import CudaError, CudaUnavailableError, check, cuda_errors

__all__ = ["gpu_available", "require_driver", "device_count", "current_ordinal", "get_device",
           "using_device",
           "sm_count", "arch", "driver_version", "default_stream", "as_stream", "create_stream",
           "create_event", "record", "record_event", "elapsed_ms", "Timer", "enable_peer_access",
           "can_access_peer"]

_probe_result: tuple[bool, str] | None = None


def _probe_driver() -> tuple[bool, str]:
    """Initialise the driver and count devices: (usable, reason when not)."""
    try:
        drv = compat.driver()
        err = drv.cuInit(0)[0]
        if int(err) != 0:
            return False, f"cuInit failed: {getattr(err, 'name', int(err))}"
        err, count = drv.cuDeviceGetCount()
        if int(err) != 0:
            return False, f"cuDeviceGetCount failed: {getattr(err, 'name', int(err))}"
        if count < 1:
            return False, "the CUDA driver reports no device"
        compat.core()
    except Exception as exc:  # noqa: BLE001 - any failure means "no usable GPU"
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def _probe() -> tuple[bool, str]:
    global _probe_result
    if _probe_result is None:
        _probe_result = _probe_driver()
    return _probe_result


def _reset_probe() -> None:
    """Forget the cached driver probe (for tests)."""
    global _probe_result
    _probe_result = None


def gpu_available() -> bool:
    """True when cuda-core imports, the driver initialises and there is at least one GPU.
    Never raises."""
    try:
        return _probe()[0]
    except Exception:  # noqa: BLE001
        return False


def require_driver() -> None:
    """Raise :class:`CudaUnavailableError` (with the reason) unless a GPU is usable."""
    ok, reason = _probe()
    if not ok:
        raise CudaUnavailableError(f"no usable CUDA GPU: {reason}")


def device_count() -> int:
    """Number of CUDA devices (0 when there is no usable driver)."""
    if not gpu_available():
        return 0
    return check(compat.driver().cuDeviceGetCount(), "cuDeviceGetCount")


def current_ordinal() -> int:
    """The device of the context current on this thread, or 0 when none is (cuda.core's
    and the runtime's choice). ``cuCtxGetCurrent`` first: ``cuCtxGetDevice`` without a
    current context fails with ``CUDA_ERROR_INVALID_CONTEXT``, which compute-sanitizer
    reports as an API error (cuda.core's ``Device()`` calls it unguarded)."""
    drv = compat.driver()
    ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is None or int(ctx) == 0:
        return 0
    return int(check(drv.cuCtxGetDevice(), "cuCtxGetDevice"))


def get_device(device=None):
    """The cuda.core ``Device`` for ``device`` (an ordinal, a ``Device``, or ``None`` for the
    current one, :func:`current_ordinal`), made current on this thread."""
    require_driver()
    ordinal = current_ordinal() if device is None else int(device)
    with cuda_errors("selecting the CUDA device"):
        dev = compat.core().Device(ordinal)
        dev.set_current()
    return dev


@contextlib.contextmanager
def using_device(device=None) -> Iterator:
    """Make ``device`` current for the block and restore the previous context afterwards."""
    require_driver()
    drv = compat.driver()
    previous = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    dev = get_device(device)
    try:
        yield dev
    finally:
        if previous is not None and int(previous) != 0:
            check(drv.cuCtxSetCurrent(previous), "cuCtxSetCurrent")


def sm_count(device=None) -> int:
    """Number of streaming multiprocessors of ``device``."""
    return int(get_device(device).properties.multiprocessor_count)


def arch(device=None) -> str:
    """The device's architecture as ``ProgramOptions`` spells it, e.g. ``"sm_90"``."""
    dev = get_device(device)
    major, minor = dev.compute_capability
    return f"sm_{major}{minor}"


def driver_version() -> int:
    """The driver's CUDA version as an int (13000 for CUDA 13.0)."""
    require_driver()
    return int(check(compat.driver().cuDriverGetVersion(), "cuDriverGetVersion"))


def default_stream(device=None):
    """The device's default stream (cuda.core ``Device.default_stream``)."""
    return get_device(device).default_stream


def as_stream(stream=None, device=None):
    """A cuda.core ``Stream`` for ``stream``: ``None`` gives the device's default stream, an
    object with ``__cuda_stream__`` (CuPy, a torch wrapper) is wrapped."""
    stream_type = compat.core().Stream
    if isinstance(stream, stream_type):
        return stream
    dev = get_device(device)
    if stream is None:
        return dev.default_stream
    if hasattr(stream, "__cuda_stream__"):
        with cuda_errors("wrapping a foreign stream"):
            return dev.create_stream(stream)
    raise TypeError(f"expected a cuda.core Stream or an object with __cuda_stream__, "
                    f"got {type(stream).__name__}")


def create_stream(device=None, *, nonblocking: bool = True, priority: int | None = None):
    """A new stream on ``device`` (non-blocking w.r.t. the legacy default stream by default)."""
    dev = get_device(device)
    options = compat.core().StreamOptions(nonblocking=nonblocking, priority=priority)
    with cuda_errors("creating a stream"):
        return dev.create_stream(options=options)


def create_event(device=None, *, timing: bool = True):
    """A new (unrecorded) event; with ``timing`` it can measure elapsed time."""
    dev = get_device(device)
    options = compat.core().EventOptions(timing_enabled=timing)
    with cuda_errors("creating an event"):
        return dev.create_event(options=options)


def record(stream, event=None, *, timing: bool = True):
    """Record ``event`` (a new event, timing-enabled unless ``timing`` is False, when
    ``None``) on ``stream``; returns the event. The stream's device is made current first:
    cuda.core creates the event in the current context, and recording it on another
    device's stream fails with ``CUDA_ERROR_INVALID_HANDLE`` (seen on two H200s)."""
    with cuda_errors("recording an event"):
        stream.device.set_current()
        if event is None:
            return stream.record(options=compat.core().EventOptions(timing_enabled=timing))
        return stream.record(event)


def record_event(stream):
    """A new non-timing event recorded on ``stream`` (its device made current): what a
    stream waits on to order work after another stream's, on any GPU."""
    return record(stream, timing=False)


def wait_for_stream_handle(stream, producer: int) -> None:
    """Make ``stream`` wait for the work enqueued so far on the raw stream handle
    ``producer`` (a ``__cuda_array_interface__`` stream: 1 is the legacy default stream, 2
    the per-thread one): an event recorded there (``cuEventRecord``) and waited on
    (``cuStreamWaitEvent``)."""
    drv = compat.driver()
    with cuda_errors("waiting for a producer stream"):
        stream.device.set_current()
        ev = check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                   "cuEventCreate")
        try:
            check(drv.cuEventRecord(ev, drv.CUstream(int(producer))), "cuEventRecord")
            check(drv.cuStreamWaitEvent(stream.handle, ev, 0), "cuStreamWaitEvent")
        finally:
            check(drv.cuEventDestroy(ev), "cuEventDestroy")


def elapsed_ms(start, end) -> float:
    """Milliseconds between two recorded timing events; waits for ``end`` to complete."""
    with cuda_errors("measuring elapsed time"):
        end.sync()
        return float(end - start)


class Timer:
    """Time the work enqueued on a stream inside a ``with`` block::

        with Timer(stream) as t:
            launch(...)
        print(t.ms)   # synchronises on the end event
    """

    def __init__(self, stream=None, device=None) -> None:
        self.stream = as_stream(stream, device)
        self.start = None
        self.end = None

    def __enter__(self) -> Timer:
        self.start = record(self.stream)
        return self

    def __exit__(self, *exc_info) -> None:
        self.end = record(self.stream)

    @property
    def ms(self) -> float:
        """Elapsed milliseconds between entering and leaving the block."""
        if self.start is None or self.end is None:
            raise RuntimeError("Timer.ms is available after the with block has ended")
        return elapsed_ms(self.start, self.end)


def _ordinal(device) -> int:
    return int(device.device_id) if hasattr(device, "device_id") else int(device)


def can_access_peer(dev_a, dev_b) -> bool:
    """Whether device ``dev_a`` can access memory on ``dev_b`` (``cuDeviceCanAccessPeer``)."""
    require_driver()
    drv = compat.driver()
    a, b = _ordinal(dev_a), _ordinal(dev_b)
    if a == b:
        return True
    return bool(check(drv.cuDeviceCanAccessPeer(drv.CUdevice(a), drv.CUdevice(b)),
                      "cuDeviceCanAccessPeer"))


def enable_peer_access(dev_a, dev_b) -> bool:
    """Let ``dev_a``'s context access memory allocated in ``dev_b``'s primary context
    (``cuCtxEnablePeerAccess``; one direction, call again swapped for both).

    Returns True when access was enabled now, False when it already was (or a == b). Raises
    :class:`CudaError` when the hardware cannot do peer access. Note: this covers ``cuMemAlloc``
    allocations; stream-ordered pool allocations need the pool's access set instead
    (cuda.core ``DeviceMemoryResource.peer_accessible_by``).
    """
    a, b = _ordinal(dev_a), _ordinal(dev_b)
    if a == b:
        return False
    if not can_access_peer(a, b):
        raise CudaError(f"device {a} cannot access device {b}'s memory (cuDeviceCanAccessPeer "
                        "is false: no NVLink/PCIe peer path)", name="PEER_ACCESS_UNSUPPORTED",
                        call="cuCtxEnablePeerAccess")
    if (a, b) in _peer_enabled:     # asking again would fail with ..._ALREADY_ENABLED
        return False
    drv = compat.driver()
    with using_device(b):
        peer_ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    with using_device(a):
        result = drv.cuCtxEnablePeerAccess(peer_ctx, 0)
        already = result[0] == drv.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
        if not already:
            check(result, "cuCtxEnablePeerAccess")
    _peer_enabled.add((a, b))
    return not already


#: (a, b) pairs of primary contexts whose peer access this process has enabled
_peer_enabled: set[tuple[int, int]] = set()
