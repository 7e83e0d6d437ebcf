"""Export of a trained policy for serving, as a compressed-tensors checkpoint:
the format llm-compressor writes and vLLM and SGLang load.

What the rollout served is what gets exported: :func:`export` takes the run's
rollout :class:`~.quant_config.QuantConfig` and writes its numerics, so that a serving
engine rounds weights and activations as training assumed.

- FP4 routed-expert weights are quantized exactly as :class:`~.rollout.TorchEngine`
  quantizes them (from the policy cast to the rollout dtype, one global scale per
  expert and matrix, blocks along the input dimension, :mod:`tracefp4.kernels`).
- Their input activations are described as the rollout quantizes them: NVFP4
  with the static global scales its calibration computes for this policy (same
  seeded batch, same device); MXFP4 dynamic (per-block E8M0 scales at run
  time); FP8 (W4A8) dynamic per token (one E4M3 scale ``amax / 448`` per row).
- A rollout that left the weights in the compute dtype (``fp4_kv``, ``bf16``) is
  exported unquantized: no ``quantization_config``, experts BF16.
- NVFP4 activations with per-token global scales are refused: a compressed-tensors
  module holds one input global scale (a static ``[1]`` tensor, or none at all
  when the activations are fully dynamic), so no checkpoint can say the rollout
  took one per row from the row itself.

Everything else (attention, router, shared experts, embeddings, norms, lm_head)
is BF16 and listed in the ignore list. The KV cache format is the serving
engine's choice and is not recorded; neither is QUADS' channel compensation,
which no serving format expresses.

Layout, per routed expert and projection (``model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj``)
when the weights are FP4:

- ``weight_packed``: uint8 ``[out, in/2]``, two E2M1 codes per byte, even element
  in the low nibble (our packing, and compressed-tensors');
- ``weight_scale``: NVFP4 float8_e4m3fn ``[out, in/16]``; MXFP4 uint8 biased
  E8M0 exponents ``[out, in/32]``;
- NVFP4 only: ``weight_global_scale``, float32 ``[1]``, in compressed-tensors'
  inverse convention (``448 * 6 / amax``, the reciprocal of our
  ``amax / (6 * 448)``); gate and up share their expert's global scale (our
  gate_up is one matrix; vLLM requires them equal);
- NVFP4 activations only: ``input_global_scale``, float32 ``[1]``, inverted
  likewise: gate and up take the ``moe_in`` site's, down ``moe_down_in``'s.
"""

import json
import logging
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from tracefp4.kernels import E2M1_VALUES, quantize

from .checkpoint import (
    CONFIG,
    MANIFEST,
    commit_folder,
    config_to_hf,
    dtype_fields,
    folder_digest,
    load_model,
    provenance,
    stacked_to_hub,
    staging_folder,
    write_weights,
)
from .quant import calibrate_global_scales, quantize_expert_weights_
from .quant_config import QuantConfig
from .tokenizer import FILES as TOKENIZER_FILES

# FP4 weight format -> compressed-tensors' format name
FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
# compressed-tensors' QuantizationArgs, as it serializes its NVFP4 / MXFP4 presets' weights
WEIGHT_ARGS = {
    "nvfp4": {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": 16,
        "strategy": "tensor_group",
        "dynamic": False,
        "scale_dtype": "torch.float8_e4m3fn",
    },
    "mxfp4": {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": 32,
        "strategy": "group",
        "dynamic": False,
        "scale_dtype": "torch.uint8",
    },
}
# ... and the input activations as the rollout quantizes them
INPUT_ARGS = {
    # static global scale from calibration, block scales per token at run time ("local"): the NVFP4 preset's
    "nvfp4": {**WEIGHT_ARGS["nvfp4"], "dynamic": "local", "observer": "static_minmax"},
    # every scale at run time: the MXFP4 preset's
    "mxfp4": {**WEIGHT_ARGS["mxfp4"], "dynamic": True},
    # kernels.fake_quantize(x, "fp8"): E4M3 with one amax/448 scale per row (token) at run time: FP8_DYNAMIC's
    "fp8": {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": "token",
        "dynamic": True,
    },
}
SERVING_DTYPE = torch.bfloat16
_ULP_SEARCH = (
    0,
    1,
    -1,
    2,
    -2,
    3,
    -3,
    4,
    -4,
)  # float32 steps around 1/g tried for the stored global scale, nearest first
log = logging.getLogger("tracefp4.export")
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)$")


def quantization_config(quant: QuantConfig, ignore: list[str]) -> dict:
    """config.json's ``quantization_config`` for a rollout with FP4 expert
    weights: one group over the Linear layers not in ``ignore`` (the routed
    experts), weights and input activations as ``quant`` quantizes them, as
    ``compressed_tensors.QuantizationConfig`` writes them."""
    name = FORMATS[quant.weights]
    group = {
        "targets": ["Linear"],
        "weights": dict(WEIGHT_ARGS[quant.weights]),
        "input_activations": dict(INPUT_ARGS[quant.activations]) if quant.activations else None,
        "output_activations": None,
        "format": name,
    }
    return {
        "config_groups": {"group_0": group},
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": name,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ignore,
    }


def check_exportable(quant: QuantConfig) -> None:
    """Refuse a rollout whose numerics a compressed-tensors checkpoint cannot
    state, rather than write one that serves other numerics than it trained against."""
    if quant.activation_global_scale == "per_token":
        raise ValueError(
            "rollout.activation_global_scale: per_token cannot be exported: compressed-tensors keeps one NVFP4 "
            "input global scale per module (static, or none when the activations are fully dynamic), not one "
            "per token computed from the token, so a serving engine would round the activations under another "
            "scale than the rollout did"
        )
    if quant.activations and not quant.weights:
        raise ValueError(
            f"rollout.config: a rollout with {quant.activations} activations on BF16 expert weights has no export "
            "(no rollout config quantizes the activations alone)"
        )


def served_by(quant: QuantConfig) -> str:
    """The serving engines whose compressed-tensors MoE loaders take the export
    of ``quant``, as read from their source, not run (docs/export.md, "Loading
    it for serving"); empty where none does (compressed-tensors itself loads it)."""
    if quant.weights == "nvfp4" and quant.activations == "fp8":
        return ""  # vLLM: NVFP4 weights need NVFP4 input quantization or none; SGLang: no such scheme
    if quant.weights == "mxfp4":
        return "vLLM, as W4A16"  # whatever the activations; SGLang has no MXFP4 scheme
    return "vLLM and SGLang"


def unservable(quant: QuantConfig) -> str | None:
    """The warning for a rollout whose export no serving engine loads (:func:`served_by`), else None."""
    if served_by(quant):
        return None
    return (
        f"{quant.weights.upper()} expert weights with {quant.activations.upper()} activations: compressed-tensors "
        "loads their export, but no serving engine does (docs/export.md, 'Loading it for serving')"
    )


def inverse_global_scale(g: Tensor, scales: Tensor) -> tuple[Tensor, bool]:
    """The float32 ``weight_global_scale`` to store for our global scale ``g``,
    and whether a loader dequantizes the matrix to exactly our BF16 values.

    Our values are ``e2m1 * (s * g)``; compressed-tensors (and so the
    checkpoint's readers) computes ``e2m1 * (s / gs)`` in float32. ``1 / g`` is
    rarely a float32, so with the nearest ``gs`` a product can land one float32
    ulp off ours and, next to a BF16 rounding boundary, one BF16 ulp off in the
    served weight. Any float32 within a few ulps of ``1 / g`` represents it
    equally well, so the nearest one for which every (code, block scale) pair
    the matrix uses dequantizes to exactly our BF16 value is taken. None exists
    when our products fall exactly on BF16 ties in both directions, which
    happens when ``g`` has few significant bits (e.g. ``7 * 2^-18``: a BF16
    amax that is a multiple of 21); then the nearest ``1 / g`` and False, and
    those pairs are served one BF16 ulp off."""
    nearest = (1.0 / g.float()).reshape(1)
    used = torch.unique(scales.reshape(-1).float())
    values = torch.tensor(E2M1_VALUES[1:], dtype=torch.float32)[:, None]
    ours = (values * (used * g.float())).to(SERVING_DTYPE)
    bits = nearest.view(torch.int32)
    for step in _ULP_SEARCH:
        candidate = (bits + step).view(torch.float32)
        if torch.equal((values * (used.to(SERVING_DTYPE).float() / candidate)).to(SERVING_DTYPE), ours):
            return candidate, True
    return nearest, False


def _compressed(weight: Tensor, fmt: str) -> tuple[dict[str, Tensor], bool]:
    """One matrix's compressed weight tensors from its weight ``[out, in]``
    (float32), and whether a loader dequantizes them to exactly our values."""
    q = quantize(weight, fmt)  # on the weight's device (Triton on CUDA: the same bits)
    out = {"weight_packed": q.codes.cpu(), "weight_scale": q.scales.cpu()}
    if q.global_scale is None:  # MXFP4: powers of two, exact in any float format
        return out, True
    out["weight_global_scale"], exact = inverse_global_scale(q.global_scale.cpu(), out["weight_scale"])
    return out, exact


def _expert_tensors(key: str, stacked: Tensor, fmt: str) -> tuple[dict[str, Tensor], int]:
    """Hub names -> compressed weight tensors of every expert of one stacked
    matrix (``gate_up [E, H, 2I]`` or ``down [E, I, H]``, ``x @ w`` layout), and
    how many of its experts a loader would not dequantize exactly (see
    :func:`inverse_global_scale`)."""
    kind = _EXPERTS.match(key)[2]
    prefix = key.rpartition(".")[0]
    half = stacked.shape[-1] // 2
    out, inexact = {}, 0
    for e in range(stacked.shape[0]):
        # the rollout's quantization: the whole matrix [out, in] at once, one global scale, blocks along in
        q, exact = _compressed(stacked[e].T.float(), fmt)
        inexact += not exact
        if kind == "down":
            parts = {"down_proj": q}
        else:  # gate rows first, then up: the Hub split of gate_up (checkpoint.stacked_to_hub)
            parts = {
                name: {k: (v if k == "weight_global_scale" else v[rows]) for k, v in q.items()}
                for name, rows in (("gate_proj", slice(None, half)), ("up_proj", slice(half, None)))
            }
        for proj, tensors in parts.items():
            out.update({f"{prefix}.{e}.{proj}.{k}": v.contiguous().clone() for k, v in tensors.items()})
    return out, inexact


def _input_scales(key: str, experts: int, scales: dict) -> dict[str, Tensor]:
    """``input_global_scale`` of every expert projection of one stacked matrix:
    the layer's static ``moe_in`` (gate, up) or ``moe_down_in`` (down) scale, inverted."""
    m = _EXPERTS.match(key)
    layer, site = int(m[1]), "moe_in" if m[2] == "gate_up" else "moe_down_in"
    if (layer, site) not in scales:
        raise ValueError(f"no calibrated {site} global scale for layer {layer}")
    value = (1.0 / scales[(layer, site)].float().cpu()).reshape(1)
    prefix = key.rpartition(".")[0]
    projections = ("down_proj",) if m[2] == "down" else ("gate_proj", "up_proj")
    return {f"{prefix}.{e}.{p}.input_global_scale": value.clone() for e in range(experts) for p in projections}


def export(
    policy: str | os.PathLike,
    out: str | os.PathLike,
    quant: QuantConfig,
    *,
    rollout_dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    calibration_seed: int = 0,
    max_shard_bytes: int = 2 << 30,
) -> dict:
    """Write the policy folder ``policy`` at ``out`` (atomically) as the rollout
    ``quant`` served it: quantized as a rollout in ``rollout_dtype`` on
    ``device`` with ``calibration_seed`` quantizes it, as a compressed-tensors
    checkpoint, or unquantized in BF16 where the rollout left the weights
    alone. Returns what was written."""
    check_exportable(quant)
    name = FORMATS[quant.weights] if quant.weights else "bf16"
    source = Path(policy)
    if Path(out).resolve() == source.resolve():
        raise ValueError(f"{out}: the policy to export; write the export to another folder")
    model = load_model(source, device=device)
    saved = next(model.parameters()).dtype
    if saved != rollout_dtype:  # a run that took the weights to its model.dtype, or an export not given the run's
        log.warning(
            "%s: %s weights, exported as a rollout of model.dtype %s quantizes them, where a run of model.dtype %s "
            "served other values (the export follows the run's model.dtype: its --preset or --config, else "
            "--rollout-dtype)",
            source, *(str(d).removeprefix("torch.") for d in (saved, rollout_dtype, saved)),
        )  # fmt: skip
    model = model.to(rollout_dtype)
    cfg = model.cfg
    state = model.state_dict()
    experts = [key for key in state if _EXPERTS.match(key)]
    if quant.weights and not experts:
        raise ValueError(f"{source}: no routed experts to quantize (model_type {cfg.model_type})")
    packed = experts if quant.weights else []  # the matrices written FP4; everything else goes out BF16
    tensors, inexact = {}, 0
    for key in packed:  # before the in-place fake quantization below
        compressed, missed = _expert_tensors(key, state[key].detach(), quant.weights)
        tensors.update(compressed)
        inexact += missed
    if inexact:  # said here once: the pipeline's export task logs it, the export command shows the log
        log.warning(
            "%s: %d of %d expert matrices %s some weights one BF16 ulp off the rollout's values, at exact BF16 ties "
            "(docs/export.md, 'How exact it is')",
            source,
            inexact,
            sum(state[key].shape[0] for key in packed),
            "dequantizes" if inexact == 1 else "dequantize",
        )
    if problem := unservable(quant):
        log.warning("%s: %s", source, problem)
    if quant.activations == "mxfp4":
        log.warning(
            "%s: MXFP4 activations are exported as dynamic; compressed-tensors chooses their block scales by "
            "another rule than the rollout's OCP floor (docs/export.md)",
            source,
        )
    scales = {}
    if quant.activations == "nvfp4":
        # the rollout's calibration: on the FP4 expert weights, the seeded batch, its device and dtype
        quantize_expert_weights_(model, quant.weights)
        scales = calibrate_global_scales(model, replace(quant, kv=None), seed=calibration_seed)
        for key in packed:
            tensors.update(_input_scales(key, state[key].shape[0], scales))
    dense = {k: v.detach().cpu().to(SERVING_DTYPE) for k, v in state.items() if k not in packed}
    if cfg.tie_word_embeddings:
        dense.pop("lm_head.weight")
    dense = stacked_to_hub(dense, cfg)
    tensors.update(dense)

    folder = Path(out)
    hf = {**config_to_hf(cfg), **dtype_fields(SERVING_DTYPE)}
    if quant.weights:
        # every layer left in the serving dtype, Qwen3.5's causal convs ([C, 1, K]) too: vLLM builds them as
        # linear layers, which a quantization config's "Linear" target would otherwise take in
        ignore = sorted(k.removesuffix(".weight") for k, v in dense.items() if k.endswith(".weight") and v.dim() >= 2)
        ignore = [k for k in ignore if k != "model.embed_tokens"] + ([] if "lm_head" in ignore else ["lm_head"])
        hf["quantization_config"] = quantization_config(quant, ignore)
    record = {**provenance(source), "format": name, "served_by": served_by(quant)}
    if (source / MANIFEST).exists():
        record["exported_from"] = folder_digest(source)  # the policy folder's manifest, which names its weights
    with staging_folder(folder) as tmp:
        write_weights(tensors, tmp, max_shard_bytes)
        (tmp / CONFIG).write_text(json.dumps(hf, indent=2))
        # the tokenizer's files and the generation config, and nothing else of a source folder: a Hub folder's
        # other weight files (Qwen3.5's mtp.safetensors) would be read by an engine that globs *.safetensors
        for file in TOKENIZER_FILES:
            if (source / file).is_file():
                shutil.copyfile(source / file, tmp / file)
        commit_folder(tmp, folder, record)
    return {
        "format": name,
        "served_by": record["served_by"],
        "expert_matrices": sum(state[key].shape[0] for key in experts),
        "inexact_matrices": inexact,
        "expert_bytes": sum(t.numel() * t.element_size() for k, t in tensors.items() if ".mlp.experts." in k),
        "expert_bytes_bf16": sum(state[key].numel() * 2 for key in experts),
        "input_global_scales": {f"{layer}.{site}": g.item() for (layer, site), g in sorted(scales.items())},
    }
