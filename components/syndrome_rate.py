"""A syndrome rate (:class:`Rate`): the parity bits a block of guidance is
sent with, their bounds, the first step's rate, and the erasures a step's
decodes ask of the next (:func:`erasures_for`), without torch: the run
config (:mod:`tracefp4.schemas`) bounds ``guidance.bits_per_element`` by
them and the alerting rules read the target failure share.
:mod:`.syndrome` encodes and decodes at a rate and chooses the next step's."""

import math
from dataclasses import dataclass

BLOCK_ELEMENTS = 256  # elements per block at most: narrower rows are grouped up to it, wider ones cut
CODE_CHECK_BITS = 8  # code parity bits beyond the erasures: a wrong decode passes with probability 2^-8
SCALE_CHECK_BITS = 4  # scale parity bits beyond the erasures (a wrong scale fails the code check where codes differ)
MIN_CODE_BITS = 16  # 8 erasures + 8 check bits
MIN_SCALE_BITS = 8  # 4 erasures + 4 check bits, or (MXFP4: 8 scales a block) the scale bits themselves
MAX_CODE_BITS = 64  # 56 erasures + 8 check bits per block
MAX_SCALE_BITS = 16  # at most the scales' own bits (scale_bits_cap)
# Rate control (erasures_for): the share of a stage's blocks a rate aims to
# leave undecoded, the fewest blocks (and least share) the tail fit reads, the
# margin on the extrapolated distance, the growth when every tail block failed,
# and how far a rate may fall in one step (it rises at once).
TARGET_FAILED_SHARE = 0.001
TAIL_BLOCKS, TAIL_SHARE = 20, 0.05
TAIL_MARGIN = 1.25
BLIND_GROWTH = 1.5
MAX_FALL_BITS = 8


def whole_bytes(bits: float) -> int:
    """``bits`` rounded up to whole bytes, one at least: a decode reads a rate's bits by the byte."""
    return max(8, 8 * math.ceil(bits / 8))


@dataclass(frozen=True)
class Rate:
    """Parity bits per block of one ``(layer, site)``: codes and scales (multiples of 8)."""

    code_bits: int
    scale_bits: int


def scale_bits_cap(scales: int) -> int:
    """The most scale parity bits a block of ``scales`` scales is given: its
    scales' own bits, whole bytes, which decode exactly
    (:func:`~tracefp4.kernels.parity_matrix`); more would gain nothing."""
    return min(MAX_SCALE_BITS, whole_bytes(scales))


def rate_bounds(scales: int) -> dict[str, tuple[int, int]]:
    """Per stage (a :class:`Rate`'s field), the fewest and most parity bits a
    block of ``scales`` scales takes, whole bytes between: what rate control
    chooses among and what a shard's reader accepts (a decode reads a
    rate's bits from whole bytes, and at most 64 a block)."""
    return {"code_bits": (MIN_CODE_BITS, MAX_CODE_BITS), "scale_bits": (MIN_SCALE_BITS, scale_bits_cap(scales))}


def first_rate(bits_per_element: float, block_elements: int = BLOCK_ELEMENTS, scales: int = 16) -> Rate:
    """The rate of a step without previous decode statistics: ``bits_per_element``
    over a block of ``block_elements`` with ``scales`` scales (:attr:`.syndrome.BlockLayout.scales`;
    NVFP4's 16 by default), scales included, a quarter of it (8 or 16 bits) for the
    scales, at most their own bits (:func:`scale_bits_cap`; an MXFP4 block's 8
    scales take 8 bits and the codes the rest).

    Why a quarter: a 256-element block has only 16 scales, but on random
    weights their disagreements rank deep among them; rate control settled on
    16 scale bits for most sites (then hashed, 12 unknowns; since guidance
    format version 5 the 16 scales' own bits). With 8 (4 unknowns), the
    former split, the scale stage failed up to a tenth of the blocks of the
    deeper layers on the first step (worst layer fidelity 0.961 at 0.25 bit
    per element, against 0.992 with 48 + 16: benchmarks/guidance.py)."""
    total = whole_bytes(bits_per_element * block_elements)
    scale_bits = min(scale_bits_cap(scales), whole_bytes(total / 4))
    return Rate(min(MAX_CODE_BITS, max(MIN_CODE_BITS, total - scale_bits)), scale_bits)


def erasures_for(needed: list[int], failed: int, erasures: int) -> float | None:
    """The erasures at which one stage leaves about :data:`TARGET_FAILED_SHARE`
    of its blocks undecoded, from a step where ``needed[n]`` blocks decoded
    needing ``n`` erasures and ``failed`` blocks failed at ``erasures`` (None
    without blocks).

    A failed block needed more than the rate gave, by an unknown amount: it is
    a censored observation at the top of the distribution, not a missing one.
    (The former rule took a quantile of the decoded blocks alone, which lies
    below the truth, the more so the lower the rate.) And a target share of
    0.1% is beyond what a step's few hundred blocks a site can read as a
    quantile. So the upper tail is fitted: above ``n0``, the need below the
    largest ``max(TAIL_BLOCKS, TAIL_SHARE)`` of the blocks, the excess
    ``need - n0 - 1`` is taken as geometric, ``P(excess >= y) = rho^y``, with
    the censored maximum-likelihood ``rho = exposure / (exposure + events)``
    (exposure: the decoded tail blocks' excesses plus ``erasures - n0`` for
    each failed block; events: the decoded tail blocks). Then
    ``P(need > n) = S(n0) rho^(n - n0)``, solved for the target; the distance
    beyond ``n0`` gets a margin of :data:`TAIL_MARGIN` (the fit reads a few
    dozen blocks). A tail of failed blocks only bounds nothing: the erasures
    grow by :data:`BLIND_GROWTH`."""
    total = sum(needed) + failed
    if not total:
        return None
    tail = max(TAIL_BLOCKS, math.ceil(TAIL_SHARE * total))
    above = failed  # blocks needing more than n, for n from the largest down
    n0 = erasures
    while n0 >= 0 and above < tail:  # the largest n0 with at least `tail` blocks needing more
        above += needed[n0]
        n0 -= 1
    events = sum(needed[n0 + 1 :])
    if not events:
        return BLIND_GROWTH * max(erasures, 1)
    exposure = sum(count * (n - n0 - 1) for n, count in enumerate(needed) if n > n0) + failed * (erasures - n0)
    rho = exposure / (exposure + events)
    if rho == 0:  # every tail block needed exactly n0 + 1
        return n0 + 1
    return n0 + max(1.0, TAIL_MARGIN * math.log(TARGET_FAILED_SHARE / (above / total)) / math.log(rho))
