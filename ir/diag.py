"""Layout of the diagnostic (error) buffer that bounded waits write on expiry.

One buffer of u32 words per launch group: a header, then fixed-size records. The lowering of
``SpinWait`` writes it; the host (``backends.cuda`` / ``epgen.runtime``) decodes it. Both read
the layout from here, so it is defined once.
"""

from __future__ import annotations

import zlib

import attrs

ABORT_WORD = 0          # non-zero once any wait has expired: every other wait gives up too
COUNT_WORD = 1          # number of records claimed (may exceed MAX_RECORDS; extras are dropped)
HEADER_WORDS = 4
RECORD_WORDS = 16
MAX_RECORDS = 64
BUFFER_WORDS = HEADER_WORDS + RECORD_WORDS * MAX_RECORDS
BUFFER_BYTES = 4 * BUFFER_WORDS
RECORD_MAGIC = 0xE9D1A600
#: magic of a bounds record (combine_async: a row whose ``src_info`` is out of range): same
#: fields, ``index`` = the row, ``expected`` = its token, ``last_seen`` = its slot; ``decode``
#: skips it (``decode_bounds`` reads it)
BOUNDS_MAGIC = 0xE9D1A601
#: magic of an input record (``ep_check_ids``: a top-k id out of range or repeated within its
#: token): ``index`` = the token, ``expected`` = the top-k slot, ``last_seen`` = the id (its
#: low 32 bits); ``decode`` skips it (``decode_ids`` reads it)
IDS_MAGIC = 0xE9D1A602
#: magic of a mask record (rank masks under shrink: a bounded wait for another rank expired,
#: and the waiting rank masked it instead of aborting): the fields of a timeout record
#: (``elapsed_ns`` 0, ``smid`` 0) with ``expected`` = the rank masked; ``decode`` skips it
#: (``decode_masks`` reads it)
MASK_MAGIC = 0xE9D1A603

# word offsets inside one record; 64-bit fields take two words (low word first)
FIELDS = {
    "magic": 0, "kernel_tag": 1, "site_id": 2, "rank": 3, "block": 4, "thread": 5,
    "warp": 6, "smid": 7, "index": 8, "expected": 10, "last_seen": 12, "elapsed_ns": 14,
}
WIDE_FIELDS = ("index", "expected", "last_seen", "elapsed_ns")


def kernel_tag(kernel_name: str) -> int:
    """The 32-bit tag a kernel writes into its records (crc32 of its name)."""
    return zlib.crc32(kernel_name.encode())


@attrs.frozen
class TimeoutRecord:
    """One decoded record: which wait in which kernel gave up, and what it saw."""

    kernel: str
    role: str
    buffer: str
    rank: int
    block: int
    thread: int
    warp: int
    smid: int
    index: int
    expected: int
    last_seen: int
    elapsed_ns: int
    site_id: int

    def __str__(self) -> str:
        return (f"{self.kernel}/{self.role} rank {self.rank} block {self.block} warp {self.warp} "
                f"thread {self.thread}: waited on {self.buffer}[{self.index}] for "
                f"{self.elapsed_ns / 1e6:.1f} ms, expected {self.expected:#x}, last saw "
                f"{self.last_seen:#x}")


def decode(words, kernels) -> list[TimeoutRecord]:
    """Decode the records of ``words`` (a sequence of u32) written by ``kernels`` (IR
    ``Kernel`` objects whose ``sites`` name each wait)."""
    by_tag = {kernel_tag(k.name): k for k in kernels}
    n = min(int(words[COUNT_WORD]), MAX_RECORDS)
    out = []
    for i in range(n):
        base = HEADER_WORDS + i * RECORD_WORDS
        rec = {}
        for name, off in FIELDS.items():
            v = int(words[base + off])
            if name in WIDE_FIELDS:
                v |= int(words[base + off + 1]) << 32
            rec[name] = v
        if rec["magic"] != RECORD_MAGIC:
            continue
        k = by_tag.get(rec["kernel_tag"])
        site = next((s for s in (k.sites if k else ()) if s.site_id == rec["site_id"]), None)
        out.append(TimeoutRecord(
            kernel=k.name if k else f"<kernel {rec['kernel_tag']:#x}>",
            role=site.role if site else "?", buffer=site.buffer if site else "?",
            rank=rec["rank"], block=rec["block"], thread=rec["thread"], warp=rec["warp"],
            smid=rec["smid"], index=rec["index"], expected=rec["expected"],
            last_seen=rec["last_seen"], elapsed_ns=rec["elapsed_ns"], site_id=rec["site_id"]))
    return out


def _s32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def decode_ids(words) -> list[dict]:
    """The input records (``IDS_MAGIC``) of ``words``: ``{"rank", "t", "k", "id"}`` each
    (``id`` as a signed 32-bit value)."""
    n = min(int(words[COUNT_WORD]), MAX_RECORDS)
    out = []
    for i in range(n):
        base = HEADER_WORDS + i * RECORD_WORDS
        if int(words[base + FIELDS["magic"]]) != IDS_MAGIC:
            continue
        out.append({"rank": int(words[base + FIELDS["rank"]]),
                    "t": int(words[base + FIELDS["index"]]),
                    "k": int(words[base + FIELDS["expected"]]),
                    "id": _s32(int(words[base + FIELDS["last_seen"]]))})
    return out


def decode_bounds(words) -> list[dict]:
    """The bounds records (``BOUNDS_MAGIC``) of ``words``: ``{"rank", "row", "t", "k",
    "kernel_tag"}`` each (``t`` and ``k`` as signed 32-bit values)."""
    n = min(int(words[COUNT_WORD]), MAX_RECORDS)
    out = []
    for i in range(n):
        base = HEADER_WORDS + i * RECORD_WORDS
        if int(words[base + FIELDS["magic"]]) != BOUNDS_MAGIC:
            continue
        s32 = lambda v: v - (1 << 32) if v >= 1 << 31 else v  # noqa: E731
        out.append({"rank": int(words[base + FIELDS["rank"]]),
                    "row": int(words[base + FIELDS["index"]]),
                    "t": s32(int(words[base + FIELDS["expected"]])),
                    "k": s32(int(words[base + FIELDS["last_seen"]])),
                    "kernel_tag": int(words[base + FIELDS["kernel_tag"]])})
    return out


@attrs.frozen
class MaskRecord:
    """One decoded mask record: rank ``rank``'s wait (``kernel``, ``role``, ``buffer[index]``,
    block, thread) for rank ``masked`` expired under shrink, and ``rank`` masked it."""

    kernel: str
    role: str
    buffer: str
    rank: int
    masked: int
    block: int
    thread: int
    index: int
    last_seen: int
    site_id: int

    def __str__(self) -> str:
        return (f"{self.kernel}/{self.role} rank {self.rank} block {self.block} thread "
                f"{self.thread}: masked rank {self.masked} (its {self.buffer}[{self.index}] "
                f"never came, last saw {self.last_seen:#x})")


def decode_masks(words, kernels) -> list[MaskRecord]:
    """The mask records (``MASK_MAGIC``) of ``words``, named by ``kernels`` as ``decode``
    names timeout records."""
    by_tag = {kernel_tag(k.name): k for k in kernels}
    n = min(int(words[COUNT_WORD]), MAX_RECORDS)
    out = []
    for i in range(n):
        base = HEADER_WORDS + i * RECORD_WORDS
        if int(words[base + FIELDS["magic"]]) != MASK_MAGIC:
            continue
        field = lambda name: int(words[base + FIELDS[name]])  # noqa: E731
        k = by_tag.get(field("kernel_tag"))
        site = next((s for s in (k.sites if k else ()) if s.site_id == field("site_id")), None)
        out.append(MaskRecord(
            kernel=k.name if k else f"<kernel {field('kernel_tag'):#x}>",
            role=site.role if site else "?", buffer=site.buffer if site else "?",
            rank=field("rank"), masked=field("expected"), block=field("block"),
            thread=field("thread"), index=field("index"), last_seen=field("last_seen"),
            site_id=field("site_id")))
    return out
