"""An independent, element-by-element model of the FP4 specs, written from the
format definitions alone (value tables, nearest-value search, float32 steps via
numpy) and sharing no code with tracefp4.kernels. Slow; for small inputs."""

import math

import numpy as np

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_value(bits: int) -> float:
    e, m = (bits >> 3) & 0xF, bits & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    return m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


E4M3 = sorted((e4m3_value(b), b) for b in range(0x7F))  # all non-negative finite codes


def nearest(value: float, table: list[tuple[float, int]]) -> int:
    """Code of the table entry nearest to value; ties to the even code."""
    best = min(table, key=lambda entry: (abs(entry[0] - value), entry[1] % 2))
    return best[1]


def e4m3_encode(v: float) -> int:
    if math.isnan(v):
        return 0x7F
    return nearest(min(v, 448.0), E4M3)


def e2m1_encode(y: float) -> int:
    if math.isnan(y):
        return 0
    magnitude = nearest(min(abs(y), 6.0), [(v, i) for i, v in enumerate(E2M1)])
    return magnitude | (8 if y < 0 else 0)


def floor_log2(v: float) -> int:
    mantissa, exponent = math.frexp(v)  # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    return exponent - 1


def ceil_log2(v: float) -> int:
    mantissa, exponent = math.frexp(v)
    return exponent - 1 if mantissa == 0.5 else exponent


def f32(v) -> np.float32:
    return np.float32(v)


def nvfp4(block_rows, global_scale=None):
    """Codes (one per element) and E4M3 scale bits of rows of 16-element blocks."""
    xs = [[f32(v) for v in row] for row in block_rows]
    amaxes = [max(abs(float(v)) for v in row) if not any(math.isnan(v) for v in row) else math.nan for row in xs]
    if global_scale is None:
        amax = max(amaxes)
        global_scale = f32(1.0) if amax == 0 else f32(f32(amax) / f32(6.0 * 448.0))
    g = f32(global_scale)
    codes, scales = [], []
    for row, amax in zip(xs, amaxes):
        s_bits = e4m3_encode(float(f32(f32(amax) / f32(f32(6.0) * g))))
        s_bits = 0x38 if s_bits == 0 else s_bits
        unit = f32(f32(e4m3_value(s_bits)) * g)
        scales.append(s_bits)
        codes.append([e2m1_encode(float(f32(v / unit))) for v in row])
    return codes, scales, float(g)


def mxfp4(block_rows, scale_mode="floor"):
    """Codes and biased E8M0 exponents of rows of 32-element blocks."""
    codes, scales = [], []
    for row in block_rows:
        row = [f32(v) for v in row]
        amax = max(abs(float(v)) for v in row)
        if any(math.isnan(v) or math.isinf(v) for v in row):
            e = 255
        elif amax == 0:
            e = 0
        elif scale_mode == "floor":
            e = max(floor_log2(amax) - 2 + 127, 0)
        else:
            v = float(f32(f32(amax) / f32(6.0)))
            e = 0 if v == 0 else max(ceil_log2(v) + 127, 0)
        scales.append(e)
        unit = math.nan if e == 255 else 2.0 ** (e - 127)
        codes.append([e2m1_encode(float(f32(v / f32(unit)))) if e != 255 else 0 for v in row])
    return codes, scales


def e2m1_value(code: int) -> float:
    """The signed value of a 4-bit code (8 is -0.0)."""
    return -E2M1[code & 7] if code & 8 else E2M1[code & 7]


def e2m1_guided(y: float, guidance: int, bits: int) -> int:
    """TRACE's guided rounding of one ``y`` (docs/fp4-formats.md) from the value
    table: the two codewords ``y`` lies between (its sign, the magnitudes below
    and above it); for ``bits`` < 4 the one whose low bits are the guidance's
    when exactly one is, else round-to-nearest; for 4 the one nearer the
    rollout code's value. On a codeword, beyond +-6 or NaN: round-to-nearest."""
    if math.isnan(y) or min(abs(y), 6.0) in E2M1:
        return e2m1_encode(y)
    sign = 8 if y < 0 else 0
    below = max(i for i, v in enumerate(E2M1) if v < abs(y))
    candidates = [below | sign, (below + 1) | sign]
    if bits == 4:
        return min(candidates, key=lambda code: abs(e2m1_value(code) - e2m1_value(guidance)))
    mask = (1 << bits) - 1
    matching = [code for code in candidates if code & mask == guidance & mask]
    return matching[0] if len(matching) == 1 else e2m1_encode(y)
