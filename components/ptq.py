"""Post-training quantization (PTQ) baselines for the routed-expert weights.

Why: TRACE is a training-side fix. The question it has to answer is whether a
BF16-trained policy whose routed experts are simply quantized for FP4 rollout
after training, with the best available NVFP4 PTQ, does as well (issue 6,
point 3). This module holds those baselines, as plain-torch functions on one
weight ``w [out, in]`` (blocks of 16 along ``in``), and :func:`apply_ptq`,
which applies one to every routed expert of a policy in place, as
:func:`tracefp4.components.quant.quantize_expert_weights_` does for RTN.

- ``nvfp4``: ModelOpt's round-to-nearest, the kernels' ``fake_quantize``;
- ``four_over_six``: Four Over Six (arXiv 2512.02010), scale-to-4 or
  scale-to-6 per block, whichever has the lower block MSE;
- ``h_scale``: H-Scale (arXiv 2608.28113), each block's E4M3 scale searched
  near the RTN scale for the lowest Hessian-diagonal-weighted error.

Each returns a :class:`PTQResult`: the dequantized float32 weight, and the
same weight as an NVFP4 :class:`~tracefp4.kernels.FP4Tensor`, so that
``dequantize(result.q)`` reproduces ``result.values`` bit for bit. Rounding
onto E2M1 and the E4M3 scale casts are the kernels' reference ones; only the
choice of block scale differs between the methods. Inputs must be finite
(four_over_six, h_scale); ``nvfp4`` keeps the kernels' NaN/Inf rules.
"""

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor

from tracefp4.kernels import (
    E2M1_MAX,
    E4M3_NAN,
    NVFP4,
    FP4Tensor,
    code_values,
    divide,
    e2m1_encode,
    fake_quantize,
    nvfp4_global_scale,
    nvfp4_scales,
    pack_nibbles,
    quantize,
)

from .choices import PTQ_METHODS
from .model import CausalAttention, MoE, Transformer, right_pad

FOUR_OVER_SIX_E4M3_MAX = 256.0  # leaves room for the 1.5x scale-to-4 below E4M3's 448
E4M3_ONE = 0x38


class PTQResult(NamedTuple):
    """One quantized weight ``[out, in]``.

    values: float32 dequantized weight. q: the NVFP4 codes, E4M3 block scales
    ``[out, in // 16]`` and float32 global scale. choice, per block: for
    four_over_six True where scale-to-4 was kept; for h_scale the E4M3 code
    offset of the kept scale from the RTN scale (int16, 0 = RTN); None for nvfp4.
    """

    values: Tensor
    q: FP4Tensor
    choice: Tensor | None


def _blocks(w: Tensor) -> Tensor:
    """``w [out, in]`` as float32 blocks ``[out, in // 16, 16]``."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"expected a floating-point 2-D weight [out, in], got {w.dtype} of shape {tuple(w.shape)}")
    if w.shape[1] % NVFP4.block_size:
        raise ValueError(f"the input dimension {w.shape[1]} is not a multiple of {NVFP4.block_size}")
    wb = w.detach().float().reshape(w.shape[0], -1, NVFP4.block_size)
    if not bool(torch.isfinite(wb).all()):
        raise ValueError("the weight holds NaN or Inf; PTQ needs a finite weight")
    return wb


def _round(wb: Tensor, units: Tensor) -> tuple[Tensor, Tensor]:
    """RTN E2M1 codes of ``wb / unit`` and their values ``e2m1 * unit`` (the kernels' reference arithmetic)."""
    codes = e2m1_encode(wb / units[..., None])
    return codes, code_values(codes) * units[..., None]


def block_error(w: Tensor, values: Tensor, h: Tensor | None = None) -> Tensor:
    """Per block of 16 along ``in``: ``sum_i h_i (w_i - values_i)^2`` in float64,
    ``[out, in // 16]``; ``h [in]`` defaults to ones (the block's squared error)."""
    d = (values.double() - w.double()).reshape(w.shape[0], -1, NVFP4.block_size) ** 2
    if h is not None:
        d = d * h.double().reshape(1, -1, NVFP4.block_size)
    return d.sum(-1)


def _best_scales(wb: Tensor, candidates: Iterable[Tensor], g: Tensor, h: Tensor | None) -> tuple[Tensor, ...]:
    """Per block, the candidate E4M3 scale (uint8 bits ``[out, nb]``) with the lowest
    (weighted) error; an earlier candidate wins ties. Returns codes, values, bits, index."""
    best = None
    for i, bits in enumerate(candidates):
        codes, values = _round(wb, bits.view(torch.float8_e4m3fn).float() * g)
        err = block_error(wb.flatten(1), values.flatten(1), h)
        if best is None:
            best = [codes, values, bits, torch.zeros_like(bits, dtype=torch.int64), err]
            continue
        better = err < best[4]  # strict: ties keep the earlier candidate
        for j, new in enumerate((codes, values, bits, torch.full_like(best[3], i), err)):
            best[j] = torch.where(better[..., None] if j < 2 else better, new, best[j])
    return tuple(best[:4])


def _result(shape: torch.Size, codes: Tensor, values: Tensor, bits: Tensor, g: Tensor, choice) -> PTQResult:
    q = FP4Tensor(pack_nibbles(codes.reshape(shape)), bits.view(torch.float8_e4m3fn), g, "nvfp4", shape)
    return PTQResult(values.reshape(shape), q, choice)


def vanilla_nvfp4(w: Tensor) -> PTQResult:
    """RTN with ModelOpt's scales (global ``amax / (6 * 448)``, block ``e4m3(block_amax / (6 g))``):
    ``tracefp4.kernels.fake_quantize(w, "nvfp4")``, see docs/fp4-formats.md."""
    wf = w.detach().float()
    return PTQResult(fake_quantize(wf, "nvfp4"), quantize(wf, "nvfp4"), None)


def four_over_six(w: Tensor) -> PTQResult:
    """Four Over Six (Cook et al., arXiv 2512.02010; github.com/mit-han-lab/fouroversix,
    ``quantize/reference.py``, rule ``mse``).

    Global scale ``g = amax / (6 * 256)`` (float32; 1.0 for an all-zero weight).
    Per block two candidates: scale-to-6 ``s6 = e4m3(block_amax * 256 / amax)``
    and scale-to-4 ``s4 = e4m3(1.5 * (block_amax * 256 / amax))`` (the 1.5x is
    applied before the cast, as upstream, so the block max maps to 4). Codes are
    RTN of ``w / (s * g)``, values ``code * s * g``. Kept: the candidate with the
    lower block squared error (float64 sum); a tie keeps scale-to-6 (upstream
    picks 4 only when strictly better). A zero block scale (an all-zero block, or
    one below E4M3's range) becomes 1.0, as in the kernels; its codes are 0 and
    it keeps scale-to-6.
    """
    wb = _blocks(w)
    amax = wb.abs().amax()
    ratio = wb.abs().amax(-1) * FOUR_OVER_SIX_E4M3_MAX / torch.where(amax > 0, amax, 1.0)
    g = torch.where(amax > 0, divide(amax, E2M1_MAX * FOUR_OVER_SIX_E4M3_MAX), 1.0)

    def e4m3_bits(v: Tensor) -> Tensor:  # v <= 384: never saturates
        bits = v.to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.where(bits == 0, E4M3_ONE, bits)

    codes, values, bits, index = _best_scales(wb, [e4m3_bits(ratio), e4m3_bits(ratio * 1.5)], g, None)
    return _result(w.shape, codes, values, bits, g, index == 1)


def hessian_diag(x_calib: Tensor) -> Tensor:
    """``h_i = mean_n x_{n,i}^2`` (float64 ``[in]``) of calibration inputs ``[n, in]``:
    the diagonal of the layer-output Hessian ``X^T X / n``; zeros when ``n = 0``."""
    if x_calib.dim() != 2:
        raise ValueError(f"calibration activations must be [n, in], got shape {tuple(x_calib.shape)}")
    return (x_calib.detach().double() ** 2).sum(0) / max(x_calib.shape[0], 1)


def h_scale(w: Tensor, x_calib: Tensor | None = None, *, h: Tensor | None = None, k: int = 4) -> PTQResult:
    """H-Scale (arXiv 2608.28113): Hessian-guided NVFP4 block-scale refinement.

    The global scale stays ModelOpt's ``amax / (6 * 448)``. Each block's scale is
    searched over the E4M3 codes ``c_rtn + d``, ``d`` in ``-k..k``, clipped to
    the positive finite codes ``0x01..0x7E`` (``c_rtn`` is the RTN scale of
    :func:`vanilla_nvfp4`); codes are RTN under each candidate, and the kept
    scale minimises ``sum_i h_i (w_i - q_i)^2`` with ``h = hessian_diag(x_calib)``
    (or ``h [in]`` given directly). Candidates are tried in the order
    ``0, -1, +1, -2, +2, ...`` and a later one must be strictly better, so ties
    keep the RTN scale, then the nearer code, then the smaller one. Hence an
    all-zero block, a block whose inputs never fire (``h = 0``), ``k = 0`` or an
    empty ``x_calib`` all give :func:`vanilla_nvfp4` exactly.
    """
    if (x_calib is None) == (h is None):
        raise ValueError("h_scale needs exactly one of x_calib [n, in] and h [in]")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k (the scale-code search radius) must be an int >= 0, got {k!r}")
    wb = _blocks(w)
    h = hessian_diag(x_calib) if h is None else h.detach().double()
    if h.shape != (w.shape[1],):
        raise ValueError(f"h must have one entry per input ({w.shape[1]}), got shape {tuple(h.shape)}")
    if not bool(torch.isfinite(h).all() & (h >= 0).all()):
        raise ValueError("h must be finite and non-negative")
    g = nvfp4_global_scale(wb.abs().amax())
    rtn = nvfp4_scales(wb.abs().amax(-1), g).view(torch.uint8).short()
    offsets = [0] + [d for step in range(1, k + 1) for d in (-step, step)]
    candidates = [(rtn + d).clamp(1, E4M3_NAN - 1).to(torch.uint8) for d in offsets]
    codes, values, bits, _ = _best_scales(wb, candidates, g, h)
    return _result(w.shape, codes, values, bits, g, bits.short() - rtn)


class _ExpertInputs:
    """Sites that leave every value alone and accumulate, per ``(layer, matrix)``,
    each expert's input rows: ``sq [E, in]`` (float64 sum of squares) and ``n [E]``.
    gate_up sees the (moe_in) rows of the tokens routed to the expert; down sees
    that expert's intermediate rows."""

    def __init__(self, num_experts: int, valid: Tensor):
        self.num_experts, self.valid = num_experts, valid  # valid [T]: the tokens that are no padding
        self.sq: dict[tuple[int, str], Tensor] = {}
        self.n: dict[tuple[int, str], Tensor] = {}
        self._x: dict[int, Tensor] = {}

    def _add(self, layer: int, matrix: str, rows: Tensor, expert: Tensor, num_experts: int) -> None:
        key = (layer, matrix)
        if key not in self.sq:
            self.sq[key] = rows.new_zeros(num_experts, rows.shape[1], dtype=torch.float64)
            self.n[key] = rows.new_zeros(num_experts, dtype=torch.int64)
        self.sq[key].index_add_(0, expert, rows.double() ** 2)
        self.n[key].index_add_(0, expert, torch.ones_like(expert))

    def moe_in(self, layer, x):
        self._x[layer] = x
        return x

    def moe_down_in(self, layer, h, rows):
        real = self.valid[rows.token]
        self._add(layer, "gate_up", self._x.pop(layer)[rows.token[real]], rows.expert[real], self.num_experts)
        self._add(layer, "down", rows.rows(h)[real], rows.expert[real], self.num_experts)
        return h

    def kv(self, layer, k, v):
        return k, v

    def expert_weights(self, layer, gate_up, down):
        return gate_up, down

    def routing(self, layer, experts):
        return experts


def calibration_hessians(model: Transformer, tokens) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
    """Per ``(layer, "gate_up" | "down")``: ``(h [E, in], n [E])``, each expert's
    :func:`hessian_diag` of its input rows and their count, from one BF16 (no
    quantization) forward of calibration token ids ``[B, S]`` (or ``[S]``), or
    of sequences of several lengths (a list of token lists: right-padded, the
    padding's rows left out; prompts cut to the shortest lost the ends of the
    others, where a chat template's assistant header and a task's question lie)."""
    device = next(model.parameters()).device
    if isinstance(tokens, list) and tokens and all(isinstance(t, list) for t in tokens):
        if not all(tokens):
            raise ValueError("calibration sequences must each hold a token")
        tokens, positions, lengths = right_pad(tokens, device=device)
    else:
        tokens = torch.as_tensor(tokens, device=device)
        tokens = tokens[None] if tokens.dim() == 1 else tokens
        if tokens.dim() != 2 or tokens.numel() == 0 or tokens.is_floating_point():
            raise ValueError(
                f"calibration must be integer token ids [B, S] or [S], or a list of token lists, got "
                f"{tokens.dtype} {tuple(tokens.shape)}"
            )
        positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        lengths = torch.full((tokens.shape[0],), tokens.shape[1], device=device)
    if bool((tokens < 0).any() | (tokens >= model.cfg.vocab_size).any()):
        raise ValueError(f"calibration token ids must lie in 0..{model.cfg.vocab_size - 1}")
    rec = _ExpertInputs(model.cfg.num_experts, (positions < lengths[:, None]).reshape(-1))
    with torch.no_grad():
        model.hidden_states(tokens, positions, CausalAttention(), rec)
    return {key: (rec.sq[key] / rec.n[key].clamp(min=1)[:, None], rec.n[key]) for key in rec.sq}


def apply_ptq(model: Transformer, method: str, calibration=None, *, k: int = 4) -> None:
    """Replace every routed expert's weights by their PTQ values (in place), per
    expert and matrix with blocks along the input dimension, like
    ``quantize_expert_weights_``. ``method`` is one of :data:`~.choices.PTQ_METHODS`;
    ``h_scale`` needs ``calibration`` token ids, read by one forward
    of the unquantized model (:func:`calibration_hessians`) before any weight
    changes; the other methods ignore it. Other parameters are left untouched."""
    if method not in PTQ_METHODS:
        raise ValueError(f"unknown PTQ method {method!r}; expected one of {PTQ_METHODS}")
    if method == "h_scale" and calibration is None:
        raise ValueError("h_scale needs calibration token ids [B, S] for its Hessian diagonal")
    hessians = calibration_hessians(model, calibration) if method == "h_scale" else {}
    with torch.no_grad():
        for block in model.model.layers:
            if not isinstance(block.mlp, MoE):
                continue
            for matrix in ("gate_up", "down"):
                w = getattr(block.mlp.experts, matrix)  # [E, in, out]
                for e in range(w.shape[0]):
                    wt = w[e].T  # [out, in]
                    if method == "nvfp4":
                        r = vanilla_nvfp4(wt)
                    elif method == "four_over_six":
                        r = four_over_six(wt)
                    else:
                        r = h_scale(wt, h=hessians[(block.layer, matrix)][0][e], k=k)
                    w[e] = r.values.T.to(w.dtype)
