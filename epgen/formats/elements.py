"""Fixed numeric facts of the quantising formats' elements, shared by their host codecs and
device emitters (and unchanged by any tuning)."""

#: bf16 elements per 16-byte input item (one ``ld.global.nc.v4.b32``); the quantising send
#: takes a token item by item
ITEM_ELEMS = 8
#: largest finite e4m3 magnitude: the e4m3 payloads' saturation
FP8_MAX = 448.0
#: BlockwiseFP8's smallest group maximum: ``scale = max(amax, MIN_AMAX) / FP8_MAX``
MIN_AMAX = 1e-4
#: largest e2m1 magnitude: NVFP4's saturation and the divisor of its group scale
FP4_MAX = 6.0
#: e8m0's NaN code (MXFP8's scale of a group with an infinite maximum: a "dead" block)
E8M0_NAN = 0xFF
