"""Errors of the CUDA runtime layer, and the one place raw driver results are checked.

Raw ``cuda.bindings.driver`` calls return a tuple ``(CUresult, *outputs)``; pass it to
:func:`check`, which returns the outputs or raises :class:`CudaError` with the driver's own
error name and description. Exceptions raised inside ``cuda.core`` (its ``CUDAError``,
nvJitLink's ``nvJitLinkError`` ...) are translated by :func:`cuda_errors` so the driver's
message surfaces with a note of what epgen was doing.

This module imports no CUDA package at import time.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

__all__ = ["CudaError", "CudaUnavailableError", "CompileError", "check", "cuda_errors",
           "translate_exception"]


class CudaError(RuntimeError):
    """A CUDA driver, compiler or loader failure.

    ``name`` is the driver's error name (``CUDA_ERROR_INVALID_VALUE``) when known, ``code`` its
    numeric value, ``call`` the API or action that failed.
    """

    def __init__(self, message: str, *, name: str | None = None, code: int | None = None,
                 call: str | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.code = code
        self.call = call


class CudaUnavailableError(CudaError):
    """No usable CUDA: cuda-core is not installed, the driver is missing, or there is no GPU."""


class CompileError(CudaError):
    """PTX could not be compiled to a cubin; ``log`` holds the compiler's error log."""

    def __init__(self, message: str, *, log: str = "", **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.log = log


def _error_text(err) -> tuple[str, str]:
    """(name, description) of a driver ``CUresult``; falls back to the enum name when the
    driver library cannot be asked (no libcuda)."""
    name = getattr(err, "name", None) or f"CUresult {int(err)}"
    desc = ""
    try:
        from cuda.bindings import driver

        res, raw = driver.cuGetErrorName(err)
        if int(res) == 0 and raw:
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
        res, raw = driver.cuGetErrorString(err)
        if int(res) == 0 and raw:
            desc = raw.decode() if isinstance(raw, bytes) else str(raw)
    except Exception:  # noqa: BLE001 - error reporting must not raise a second error
        pass
    return name, desc


def check(result, call: str | None = None):
    """Check the result of a raw ``cuda.bindings`` call and return its outputs.

    ``result`` is the returned tuple ``(CUresult, *outputs)`` (a bare ``CUresult`` is accepted
    too). Returns ``None`` when there are no outputs, the single output, or a tuple of them.
    Raises :class:`CudaError` carrying ``cuGetErrorName``/``cuGetErrorString`` text.
    """
    if isinstance(result, tuple):
        if not result:
            raise TypeError("check() needs a (CUresult, ...) tuple, got an empty tuple")
        err, outputs = result[0], result[1:]
    else:
        err, outputs = result, ()
    if int(err) != 0:
        name, desc = _error_text(err)
        where = f"{call}: " if call else ""
        message = f"{where}{name}" + (f" ({desc})" if desc else "")
        raise CudaError(message, name=name, code=int(err), call=call)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else outputs


_DRIVER_NAME = re.compile(r"\b(CUDA_ERROR_[A-Z0-9_]+)\b")


def translate_exception(exc: BaseException, what: str = "") -> CudaError | None:
    """The :class:`CudaError` for an exception raised by cuda.core/cuda.bindings, or ``None``
    when ``exc`` is not a CUDA error (a plain ``TypeError`` from an API misuse stays as is)."""
    if isinstance(exc, CudaError):
        return exc
    cls = type(exc)
    module = cls.__module__ or ""
    prefix = f"{what}: " if what else ""
    text = str(exc)
    if cls.__name__ == "DynamicLibNotFoundError" or (
            module.startswith("cuda.pathfinder") and isinstance(exc, RuntimeError)):
        return CudaUnavailableError(f"{prefix}CUDA driver library not found ({text})", call=what)
    if cls.__name__ == "nvJitLinkError":
        status = getattr(exc, "status", None)
        name = "NVJITLINK_" + (getattr(status, "name", None) or "ERROR")
        return CudaError(f"{prefix}{text}", name=name, code=_int_or_none(status), call=what)
    if cls.__name__ in ("CUDAError", "NVRTCError", "nvvmError") and module.startswith("cuda."):
        match = _DRIVER_NAME.search(text)
        return CudaError(f"{prefix}{text}", name=match.group(1) if match else cls.__name__,
                         call=what)
    return None


def _int_or_none(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def cuda_errors(what: str) -> Iterator[None]:
    """Re-raise CUDA exceptions from the enclosed ``cuda.core`` calls as :class:`CudaError`,
    prefixed with ``what`` (for example ``"launching kernel 'dispatch'"``)."""
    try:
        yield
    except CudaError:
        raise
    except Exception as exc:
        translated = translate_exception(exc, what)
        if translated is None:
            raise
        raise translated from exc
