"""Spec data for the FP4 formats TRACE quantizes to, and nothing else.

E2M1 (OCP MX v1.0, section 5.3.3): 1 sign, 2 exponent (bias 1), 1 mantissa bit.
A 4-bit code is ``sign << 3 | magnitude index``; the eight magnitudes are
listed in :data:`E2M1_VALUES`. Two codes share a byte, the even element in the
low nibble (ModelOpt, vLLM, NeMo).

NVFP4: blocks of 16 along the last dimension, an unsigned E4M3 block scale and
an FP32 per-tensor global scale ``amax / (6 * 448)``.
MXFP4: blocks of 32, an E8M0 block scale (a biased power of two, 0xFF = NaN).
"""

from dataclasses import dataclass

import torch

E2M1_MAX = 6.0
# value of magnitude index 0..7: 0b0000 .. 0b0111
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_SIGN = 0b1000

E4M3_MAX = 448.0  # 0b0_1111_110; 0b0_1111_111 is NaN (the "fn" variant)
E4M3_NAN = 0x7F
E8M0_BIAS = 127
E8M0_NAN = 0xFF

# Key values with their encodings, imported by the tests (torchao's habit).
E2M1_ENCODINGS = (  # (value, code)
    (0.0, 0b0000),  # zero
    (0.5, 0b0001),  # subnormal: 0.5 * 2^0
    (1.0, 0b0010),  # 1.0 * 2^0
    (1.5, 0b0011),  # 1.5 * 2^0
    (2.0, 0b0100),  # 1.0 * 2^1
    (3.0, 0b0101),  # 1.5 * 2^1
    (4.0, 0b0110),  # 1.0 * 2^2
    (6.0, 0b0111),  # 1.5 * 2^2, the largest magnitude
    (-1.0, 0b1010),  # sign bit 3
    (-6.0, 0b1111),
)
E4M3_ENCODINGS = {
    448.0: 0x7E,  # 1.75 * 2^8, the largest finite value
    1.0: 0x38,  # exponent field 7 = bias
    24.0: 0x5C,  # 1.5 * 2^4, the unit scale of the paper's example
    2.0**-6: 0x08,  # smallest normal
    2.0**-9: 0x01,  # smallest subnormal
}


@dataclass(frozen=True)
class FP4Format:
    """One block-scaled FP4 format: how many elements share a scale, and the scale's type."""

    name: str
    block_size: int
    scale_dtype: torch.dtype
    has_global_scale: bool


NVFP4 = FP4Format("nvfp4", 16, torch.float8_e4m3fn, True)
MXFP4 = FP4Format("mxfp4", 32, torch.uint8, False)
FORMATS = {f.name: f for f in (NVFP4, MXFP4)}

SCALE_MODES = ("floor", "rceil")  # MXFP4 only; OCP MX v1.0 uses floor
GUIDANCE_BITS = (1, 2, 3, 4)


def get_format(fmt: "str | FP4Format") -> FP4Format:
    """The format named `fmt`, with an error that lists the known ones."""
    if isinstance(fmt, FP4Format):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown FP4 format {fmt!r}; expected one of {sorted(FORMATS)}") from None
