"""FP4 numerics for TRACE: NVFP4 and MXFP4 quantization, FP8 E4M3 fake-quant,
guided rounding and the guidance codec.

Layout follows torchao's mx_formats: :mod:`.formats` holds spec constants,
:mod:`.reference` the plain-torch reference (the CPU path), and
:mod:`.triton_kernels` the CUDA path, tested bit for bit against the
reference; :mod:`.syndrome` codes guidance bits as parity bits decoded with
side information. :mod:`.fp4` is the API re-exported here, with the spec constants
and the few reference building blocks code outside this package needs (so that
it never imports :mod:`.reference` or :mod:`.formats` itself): the NVFP4
global and block scales, E2M1 encoding and nibble packing.
"""

from .formats import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_NAN,
    FORMATS,
    GUIDANCE_BITS,
    MXFP4,
    NVFP4,
    FP4Format,
    get_format,
)
from .fp4 import (
    HAS_TRITON,
    FP4Tensor,
    Guidance,
    code_values,
    compact_codes,
    dequantize,
    expand_codes,
    fake_quantize,
    graph_capturing,
    per_token_global_scale,
    quantize,
    straight_through,
    unpack_codes,
    valid_global_scale,
)
from .reference import (
    divide,
    e2m1_encode,
    nvfp4_global_scale,
    nvfp4_scales,
    pack_nibbles,
    to_device,
    unpack_nibbles,
)
from .syndrome import (
    MAX_ERASURES,
    code_side_info,
    parity_matrix,
    scale_side_info,
    solve_erasures,
    syndrome,
    unknowns,
)

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_NAN",
    "FORMATS",
    "GUIDANCE_BITS",
    "HAS_TRITON",
    "MAX_ERASURES",
    "MXFP4",
    "NVFP4",
    "FP4Format",
    "FP4Tensor",
    "Guidance",
    "code_side_info",
    "code_values",
    "compact_codes",
    "dequantize",
    "divide",
    "e2m1_encode",
    "expand_codes",
    "fake_quantize",
    "get_format",
    "graph_capturing",
    "nvfp4_global_scale",
    "nvfp4_scales",
    "pack_nibbles",
    "parity_matrix",
    "per_token_global_scale",
    "quantize",
    "scale_side_info",
    "solve_erasures",
    "straight_through",
    "syndrome",
    "to_device",
    "unknowns",
    "unpack_codes",
    "unpack_nibbles",
    "valid_global_scale",
]
