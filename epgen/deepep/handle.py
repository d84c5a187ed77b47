"""``LowLatencyHandle``: the handle ``low_latency_dispatch`` returns, DeepEP's tuple
``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``.

It is a tuple (it unpacks and indexes as DeepEP's does) that also knows which buffer and
which of its two result slots made it, and that slot's dispatch generation, so a combine can
refuse a handle of another buffer or one whose slot a later dispatch reused. ``layout_range``
is computed on first read (``views.layout_range``: a few small device operations on the
current stream), since epgen's combine does not need it.
"""

from __future__ import annotations


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle (module docstring). ``owner``: the ``Buffer``;
    ``slot``: its result slot; ``generation``: that slot's dispatch count when made;
    ``shape``: the ``LowLatencyShape``."""

    def __new__(cls, src_info, layout_range_of, shape, *, owner, slot, generation):
        self = super().__new__(cls, (src_info, None, shape.max_tokens, shape.hidden,
                                     shape.num_experts))
        self._layout_range_of = layout_range_of
        self._layout_range = None
        self.owner, self.slot, self.generation, self.shape = owner, slot, generation, shape
        return self

    @property
    def layout_range(self):
        """``[L, R]`` int64 ``begin << 32 | count`` (computed on first read)."""
        if self._layout_range is None:
            self._layout_range = self._layout_range_of()
        return self._layout_range

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self)[index]
        if index in (1, -4):
            return self.layout_range
        return super().__getitem__(index)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        s = self.shape
        return (f"LowLatencyHandle(slot={self.slot}, generation={self.generation}, "
                f"num_max_dispatch_tokens_per_rank={s.max_tokens}, hidden={s.hidden}, "
                f"num_experts={s.num_experts})")


__all__ = ["LowLatencyHandle"]
