"""Fixed numeric facts of the quantising formats' elements and scales, shared by the host
encoders (``quant_host``), the device encoders (``quant_ir``) and the declarations that pair
them (``scaling``); unchanged by any tuning."""

#: bf16 elements per 16-byte input item (one ``ld.global.nc.v4.b32``); the quantising send
#: takes a token item by item
ITEM_ELEMS = 8
#: largest finite e4m3 magnitude: the e4m3 payloads' saturation
FP8_MAX = 448.0
#: exponent of e4m3's largest binade (448 = 1.75 * 2^8)
FP8_EMAX = 8
#: BlockwiseFP8's smallest group maximum: ``scale = max(amax, MIN_AMAX) / FP8_MAX``
MIN_AMAX = 1e-4
#: largest e2m1 magnitude: the e2m1 payloads' saturation and the divisor of NVFP4's scale
FP4_MAX = 6.0
#: exponent of e2m1's largest binade (6 = 1.5 * 2^2): the OCP shared-exponent rule's
#: ``emax_elem``
FP4_EMAX = 2
#: e8m0's NaN code (the scale of a group with an infinite maximum: a "dead" block)
E8M0_NAN = 0xFF
#: e8m0's exponent bias: code ``c`` is ``2^(c - 127)``
E8M0_BIAS = 127
#: the global-scale rule clamps ``g * amax`` here before the division by the element maximum:
#: every quotient from 448 up saturates to e4m3's 448 (4096 / 6 = 682.7 does too), and the
#: clamp turns an overflowed ``+inf`` into a finite value for ``quant_ir.quotient_by_fma``
SCALE_INPUT_CLAMP = 4096.0
