"""The guidance codec: the low k bits of every code, densely packed."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracefp4.kernels import compact_codes, expand_codes


@settings(max_examples=100, deadline=None)
@given(
    codes=st.lists(st.integers(0, 15), min_size=1, max_size=67),
    bits=st.sampled_from([1, 2, 3, 4]),
    rows=st.integers(1, 3),
)
def test_round_trip_keeps_the_low_bits(codes, bits, rows):
    c = torch.tensor([codes] * rows, dtype=torch.uint8)
    packed = compact_codes(c, bits)
    assert packed.shape == (rows, -(-len(codes) * bits // 8))
    assert torch.equal(expand_codes(packed, bits, len(codes)), c & ((1 << bits) - 1))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_odd_lengths(bits):
    for n in (1, 7, 9, 31, 33, 1001):
        c = torch.randint(0, 16, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        assert torch.equal(expand_codes(compact_codes(c, bits), bits, n), c & ((1 << bits) - 1))


def test_bit_layout():
    # one bit: eight codes in a byte, code j at bit j
    c = torch.tensor([1, 0, 0, 1, 1, 0, 0, 0, 1], dtype=torch.uint8)
    assert compact_codes(c, 1).tolist() == [0b0001_1001, 0b1]
    # three bits: codes straddle bytes, little-endian bit stream
    c3 = torch.tensor([0b101, 0b011, 0b110], dtype=torch.uint8)
    assert compact_codes(c3, 3).tolist() == [0b10_011_101, 0b1]
    # four bits: the nibble layout of FP4 itself
    assert compact_codes(torch.tensor([0x3, 0xA], dtype=torch.uint8), 4).tolist() == [0xA3]


def test_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="guidance bits must be one of"):
        compact_codes(torch.zeros(8, dtype=torch.uint8), 0)
    with pytest.raises(TypeError, match="codes must be uint8, got torch.int64"):
        compact_codes(torch.zeros(8, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="has 2 bytes per row; 17 codes of 1 bits need 3"):
        expand_codes(torch.zeros(2, dtype=torch.uint8), 1, 17)
