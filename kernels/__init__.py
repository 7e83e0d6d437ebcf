"""FP4 numerics for TRACE: NVFP4 and MXFP4 quantization, FP8 E4M3 fake-quant,
guided rounding and the guidance codec.

Layout follows torchao's mx_formats: :mod:`.formats` holds spec constants,
:mod:`.reference` the plain-torch reference (the CPU path), and
:mod:`.triton_kernels` the CUDA path, tested bit for bit against the
reference. :mod:`.fp4` is the API re-exported here.
"""

from .formats import E2M1_VALUES, FORMATS, GUIDANCE_BITS, MXFP4, NVFP4, FP4Format, get_format
from .fp4 import (
    HAS_TRITON,
    FP4Tensor,
    Guidance,
    code_values,
    compact_codes,
    dequantize,
    expand_codes,
    fake_quantize,
    quantize,
    unpack_codes,
)

__all__ = [
    "E2M1_VALUES",
    "FORMATS",
    "GUIDANCE_BITS",
    "HAS_TRITON",
    "MXFP4",
    "NVFP4",
    "FP4Format",
    "FP4Tensor",
    "Guidance",
    "code_values",
    "compact_codes",
    "dequantize",
    "expand_codes",
    "fake_quantize",
    "get_format",
    "quantize",
    "unpack_codes",
]
