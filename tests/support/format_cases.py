"""The token formats the tests run, read from the registry (``epgen.formats.FORMATS``): a test
of "every format" parametrises over these, so a format is in it as soon as it is registered.

``SPEC`` is the one hand-written entry a new block-scaled format adds here: its element bits,
group size and scale bytes as its specification states them, the independent facts the layout
tests check the declaration against (tests/unit/test_formats_quant.py); a registered format
without an entry fails there, by name.
"""

from __future__ import annotations

from epgen.formats import FORMATS, BlockScaledFormat

#: every registered format, by name (registration order)
ALL = tuple(FORMATS)
#: the quantising (block-scaled) formats
QUANT = tuple(name for name, cls in FORMATS.items() if issubclass(cls, BlockScaledFormat))
#: the formats that do not quantise (BF16)
PLAIN = tuple(name for name in ALL if name not in QUANT)

#: ``name -> (element bits, group size, scale bytes)`` as each format's specification states
#: them (the reference's format table; OCP MX v1.0 for MXFP4)
SPEC = {
    "BlockwiseFP8": (8, 128, 4),
    "NVFP4": (4, 16, 1),
    "MXFP8": (8, 32, 1),
    "MXFP4": (4, 32, 1),
    "BlockwiseFP8Pow2": (8, 128, 4),
}

#: hid_dims of the simulator tests where a format's own layout asks for more than the
#: smallest: BlockwiseFP8 with 3 scale groups (the tile scale copy's padding guard) and with 4
#: (a whole vector of scales)
SIM_HID_DIMS = {"BlockwiseFP8": (384, 512)}


def smallest_hid_dim(name: str, at_least: int = 64) -> int:
    """The smallest ``hid_dim >= at_least`` the quantising format ``name`` allows."""
    m = FORMATS[name].hid_dim_multiple
    return -(-at_least // m) * m


def sim_cases(every_shape: bool = False) -> list[tuple[str, int]]:
    """``(format, hid_dim)`` of every quantising format at the simulator's sizes: its first
    ``SIM_HID_DIMS`` entry (``every_shape``: each of them), else ``smallest_hid_dim``."""
    cases = []
    for name in QUANT:
        dims = SIM_HID_DIMS.get(name, (smallest_hid_dim(name),))
        cases += [(name, h) for h in (dims if every_shape else dims[:1])]
    return cases


def scales_whole_vectors_hid_dim(name: str) -> int:
    """The smallest ``hid_dim`` at which the quantising format ``name``'s scales of one row
    are whole 16-byte vectors (what ``scales_ride_with_payload`` needs)."""
    cls = FORMATS[name]
    h = cls.hid_dim_multiple
    while (h // cls.group_size * cls.scale_bytes) % 16:
        h += cls.hid_dim_multiple
    return h


def case_ids(cases) -> list[str]:
    """Test ids ``NAME-H<hid_dim>`` of ``(format, hid_dim)`` cases."""
    return [f"{name}-H{h}" for name, h in cases]
