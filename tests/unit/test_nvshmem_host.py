"""The NVSHMEM host binding (backends/cuda/nvshmem_host.py) on the CPU: the library found in
the wheel (skipped when the wheel is not installed) with every symbol looked up, the
version, a unique id (needs no GPU), the init-attribute bytes against the header layout, and
the clear error when the library is missing."""

from __future__ import annotations

import ctypes
import struct

import pytest

from backends.cuda import nvshmem_host as nh


def _host():
    try:
        return nh.NvshmemHost()
    except nh.NvshmemUnavailableError as e:
        pytest.skip(f"no NVSHMEM host library: {e}")


def test_loads_and_looks_up_every_symbol():
    host = _host()
    assert host.path.name == "libnvshmem_host.so.3"
    for name in nh._SIGNATURES:
        assert getattr(host.lib, name) is not None
    major, minor, patch = host.version()
    assert major >= 3
    uid = host.get_uniqueid()
    assert len(uid) == nh.UNIQUEID_BYTES == 128
    # the id's version word: (1 << 16) + sizeof(nvshmemx_uniqueid_t)
    assert struct.unpack_from("<i", uid, 0)[0] == (1 << 16) + 128
    assert host.get_uniqueid() != uid                      # a fresh id each time


def test_set_attr_writes_only_the_uid_args():
    """What the library's nvshmemx_set_attr_uniqueid_args writes (id, myrank, nranks at
    32, 40, 44) is where init_attr_bytes puts them; the version words are ours to set."""
    host = _host()
    uid = ctypes.create_string_buffer(128)
    raw = bytearray(b"\xab" * nh.INIT_ATTR_BYTES)
    attr = (ctypes.c_char * nh.INIT_ATTR_BYTES).from_buffer(raw)
    assert host.lib.nvshmemx_set_attr_uniqueid_args(3, 8, uid, attr) == 0
    ours = nh.init_attr_bytes(3, 8, ctypes.addressof(uid), host.version())
    changed = [i for i in range(nh.INIT_ATTR_BYTES) if raw[i] != 0xAB]
    assert changed and set(changed) <= set(range(32, 48))
    assert raw[32:48] == ours[32:48]


def test_init_attr_layouts():
    v2 = nh.init_attr_bytes(1, 4, 0x1122334455667788, (3, 8, 0), device=2)
    assert len(v2) == 144

    assert struct.unpack_from("<i", v2, 0)[0] == (2 << 16) + 144
    assert struct.unpack_from("<Q", v2, 8)[0] == 0
    assert struct.unpack_from("<i", v2, 16)[0] == (2 << 16) + 128
    assert struct.unpack_from("<i", v2, 24)[0] == (1 << 16) + 24
    assert struct.unpack_from("<Q", v2, 32)[0] == 0x1122334455667788
    assert struct.unpack_from("<ii", v2, 40) == (1, 4)
    assert struct.unpack_from("<i", v2, 48)[0] == 2
    assert not any(v2[52:])
    assert struct.unpack_from("<i", nh.init_attr_bytes(0, 1, 8, (3, 9, 1)), 48)[0] == -1
    v1 = nh.init_attr_bytes(1, 4, 8, (3, 4, 5), device=2)
    assert struct.unpack_from("<i", v1, 0)[0] == (1 << 16) + 144
    assert struct.unpack_from("<i", v1, 16)[0] == (1 << 16) + 128
    assert not any(v1[48:])                        # no cuda_device_id in the v1 layout
    assert nh.INIT_WITH_UNIQUEID == 8


def test_missing_library_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setenv(nh.LIB_ENV, str(tmp_path / "libnvshmem_host.so.3"))
    with pytest.raises(nh.NvshmemUnavailableError, match=r"pip install 'epgen\[shmem\]'"):
        nh.NvshmemHost()
    monkeypatch.delenv(nh.LIB_ENV)
    monkeypatch.setattr(nh.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(nh.NvshmemUnavailableError, match=r"pip install 'epgen\[shmem\]'"):
        nh.find_host_library()
    bogus = tmp_path / "libfake.so"
    bogus.write_bytes(b"not an ELF")
    with pytest.raises(nh.NvshmemUnavailableError, match="cannot load"):
        nh.NvshmemHost(bogus)


def test_env_override(monkeypatch):
    path = _host().path
    monkeypatch.setenv(nh.LIB_ENV, str(path))
    assert nh.find_host_library() == path


def test_status_codes_are_checked():
    with pytest.raises(nh.NvshmemError, match="nvshmemx_cumodule_init failed with status 7"):
        nh.NvshmemHost._check("nvshmemx_cumodule_init", 7)
    nh.NvshmemHost._check("x", 0)


def test_symmetric_resource_frees_in_reverse_order():
    class FakeHost:
        def __init__(self):
            self.next, self.freed = 0x1000, []

        def malloc(self, n):
            self.next += 0x1000
            return self.next

        def free(self, p):
            self.freed.append(p)

    host = FakeHost()
    mr = nh.SymmetricMemoryResource(host)
    bufs = [mr.allocate(n, stream=None) for n in (10, 20, 30)]
    for b in bufs:
        b.close(None)                      # closing a buffer frees nothing
    assert host.freed == []
    mr.free_all()
    assert host.freed == [b.handle for b in reversed(bufs)]
    mr.free_all()
    assert len(host.freed) == 3
