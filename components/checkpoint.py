"""Hugging Face checkpoints of the policy: ``config.json`` plus
``model.safetensors``, or shards listed in ``model.safetensors.index.json``.
safetensors only; pickle files are refused.

On disk experts are per expert (``mlp.experts.{e}.gate_proj.weight``, the Hub
layout, ``[out, in]``) or fused per layer the way transformers 5 holds them
(``mlp.experts.gate_up_proj [E, 2I, H]``, gate rows first, and
``mlp.experts.down_proj [E, H, I]``: each expert's ``[out, in]`` stacked). The
published Qwen3.5-MoE checkpoints are fused, and transformers writes fused
tensors for any of our model types when nothing reverts them (a model it loaded
from fused files, or ``save_original_format=False``), so loading takes either
layout, but one per checkpoint; saving writes per expert, which every reader
takes. In memory experts are stacked in ``x @ w`` layout
(``mlp.experts.gate_up [E, in, out]``). Loading copies each tensor from the
mapped file straight into its slot of a model allocated once, in the
checkpoint's dtype (:func:`load_model`). Saving
writes into a temporary folder and renames it into place, so a reader never
sees a half-written checkpoint.

A checkpoint folder is untrusted input (a download, a copy, a bucket), so
loading checks before it allocates: the checksum manifest our saves write
(:data:`MANIFEST`, sha256 and size of every file) catches a corrupt or partial
copy; every size in config.json must be a sane integer and agree with the
tensor shapes in the safetensors headers (read without reading the data); and
every file read must lie inside the folder. A folder from elsewhere has no
manifest and loads with a warning that it is unverified; one whose upload to
the store was cut short (:func:`upload_folder`, :data:`UNFINISHED`) is
refused. The manifest guards against corruption, not against someone who
rewrites it along with the data.

A ``qwen3_5_moe`` checkpoint is multimodal on the Hub: its config.json nests
the language model's config under ``text_config`` and its weights live under
``model.language_model.``; the vision tower (``model.visual.*``) and the
multi-token-prediction head (``mtp.*``) are skipped with a logged note. Saving
writes the language model alone, as transformers' ``Qwen3_5MoeForCausalLM``
does (``model_type`` ``qwen3_5_moe_text``, keys under ``model.``).

A checkpoint in the artifact store (``s3://``, ``minio://``) is fetched into a
local cache first (:func:`fetch`), keyed by its checksums, checked against
them before it is renamed into place, and then loaded from there like any
folder.
"""

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from .architecture import LAYER_TYPES, MODEL_TYPES, ModelConfig
from .model import Transformer, empty_model
from .store import (
    ArtifactNotFound,
    ArtifactStore,
    LocalStore,
    check_key,
    ensure_room,
    file_path,
    fsync_folder,
    open_store,
    unexpanded_home,
    write_atomic,
)
from .tensor_files import DTYPES, TensorWriter, index_name, single_name, write_tensors
from .tokenizer import FILES as TOKENIZER_FILES
from .tokenizer import TOKENIZER, PolicyTokenizer, TokenizerError, load_tokenizer

log = logging.getLogger("tracefp4.checkpoint")
T = TypeVar("T")

INDEX = index_name("model")
SINGLE = single_name("model")
CONFIG = "config.json"
CACHE_ENV = "TRACEFP4_CACHE_DIR"  # root of the local cache of checkpoints fetched from a store
MANIFEST = "checksums.json"  # {"files": {name: {"size": bytes, "sha256": hex}}, "provenance": {...}}, written last
HASH_THREADS = 8  # files hashed at once at most (sizes_and_sha256)
# files downloaded or uploaded at once at most (fetch, upload_folder): one S3 GET or PUT streams at a fraction of
# what the store and the node's network take, and S3Store's connection pool holds 8
TRANSFER_THREADS = 8
LOCATION = "location.json"  # {"uri": ...}: a folder standing for the folder there (write_location), beside its MANIFEST
# in a folder while upload_folder writes it or delete_folder deletes it, from before its first change until after
# its MANIFEST is there (or it is gone)
UNFINISHED = ".upload-unfinished"
_UNFINISHED_TEXT = f"tracefp4 is uploading or deleting this folder: it is whole once {MANIFEST} is here\n".encode()
_MAX_SIZE = 2**24  # any config.json size above this is a typo or an attack: real models stay far below
# safetensors' names of the weight dtypes we load
_TORCH_DTYPES = {name: dtype for name, dtype in DTYPES.items() if dtype.is_floating_point}
_FLOAT_DTYPES = set(_TORCH_DTYPES)
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up|down)_proj$")  # a layer's experts in one tensor
_FUSED_DIMS = {  # what a fused tensor's dims are, for the message when its shape is wrong
    "gate_up": "[num_experts, 2 * moe_intermediate_size, hidden_size], gate rows first",
    "down": "[num_experts, hidden_size, moe_intermediate_size]",
}
_QKV = re.compile(r"^(model\.layers\.\d+\.self_attn)\.([qkv])_proj\.(weight|bias)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_INDEX = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
QWEN35_TEXT = "qwen3_5_moe_text"  # model_type of Qwen3.5-MoE's language model alone (what save_model writes)
_LANGUAGE_MODEL = "model.language_model."  # where a multimodal qwen3_5_moe checkpoint keeps the language model
_SKIPPED = ("model.visual.", "mtp.")  # vision tower, multi-token prediction head: not part of the policy
# transformers' num_key_value_heads where config.json leaves it out: its config classes' fixed defaults, not the
# number of query heads; qwen3_5_moe's head_dim defaults likewise to 256, not hidden_size // num_attention_heads
_KV_HEADS = {"qwen3_moe": 4, "qwen2_moe": 16, "qwen3_5_moe": 2}
# config.json keys that config_from_hf reads or config_to_hf writes; the rest are kept in ModelConfig.extra
_HF_KEYS = {
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "qkv_bias",
    "architectures",
    "hidden_act",
    "layer_types",
    "full_attention_interval",
    "partial_rotary_factor",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
}


class CheckpointError(ValueError):
    """A checkpoint folder is corrupt or inconsistent; the message names the file,
    the config.json field or the tensor."""


def _experts_key(hf: dict) -> str:
    """The key of a config.json's routed-expert count: ``num_local_experts``
    where only that one is given (transformers 5.25's Qwen3MoeConfig writes
    it alone), else ``num_experts`` (named where neither is)."""
    only_local = hf.get("num_experts") is None and hf.get("num_local_experts") is not None
    return "num_local_experts" if only_local else "num_experts"


def config_from_hf(hf: dict) -> ModelConfig:
    """The policy's architecture from a transformers config.json (4.x and 5.x
    spellings). Each size must be an integer in 1..2**24 (JSON's ``1e9`` is a
    float and is refused), each flag a bool: a bad value fails here, naming the
    field, instead of deep inside the model or by sizing it. (RoPE is computed
    per forward, so max_position_embeddings sizes nothing and may be larger.)"""
    if not isinstance(hf, dict):
        raise CheckpointError(f"config.json must hold a JSON object, got {type(hf).__name__}")
    hf = _text_config(hf)
    model_type = "qwen3_5_moe" if hf.get("model_type") == QWEN35_TEXT else hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"config.json has model_type {model_type!r}; tracefp4 loads {', '.join(MODEL_TYPES)} "
            f"(and {QWEN35_TEXT}, Qwen3.5-MoE's language model alone)"
        )
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    if not isinstance(rope, dict) or not isinstance(scaling, dict):
        raise CheckpointError("config.json: rope_parameters and rope_scaling must be objects")
    rope_type = tuple(r.get("rope_type", r.get("type", "default")) for r in (scaling, rope))  # "type": older key
    if rope_type != ("default", "default"):
        raise CheckpointError(
            f"config.json asks for scaled RoPE ({', '.join(t for t in rope_type if t != 'default')}); tracefp4 "
            "implements the default RoPE only (docs/pipeline.md, on a scaling added to a checkpoint trained without it)"
        )
    qwen3, qwen35 = model_type == "qwen3_moe", model_type == "qwen3_5_moe"
    missing = object()

    def get(key: str, default: object, source: dict) -> object:
        if source.get(key) is not None:
            return source[key]
        if default is missing:
            raise CheckpointError(f"config.json lacks {key}")
        return default

    def size(key: str, default: object = missing, low: int = 1, high: int = _MAX_SIZE) -> int:
        value = get(key, default, hf)
        if type(value) is not int or not low <= value <= high:  # bool is an int subclass: refused too
            raise CheckpointError(f"config.json: {key} must be an integer in {low}..{high}, got {value!r}")
        return value

    def positive(key: str, default: float, source: dict = hf) -> float:
        value = get(key, default, source)
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"config.json: {key} must be a finite number > 0, got {value!r}")
        return float(value)

    def flag(key: str, default: bool) -> bool:
        value = get(key, default, hf)
        if type(value) is not bool:
            raise CheckpointError(f"config.json: {key} must be true or false, got {value!r}")
        return value

    # with it transformers masks attention to a window (in every layer of qwen3_moe, in the sliding_attention
    # layer_types of qwen2_moe); tracefp4 attends to the whole prefix, so it would load a different model
    if flag("use_sliding_window", False):
        raise CheckpointError(
            f"config.json: use_sliding_window is true (sliding_window {hf.get('sliding_window')!r}); "
            "tracefp4 implements full causal attention only"
        )
    if hf.get("hidden_act", "silu") != "silu":  # the experts', the shared expert's and the dense MLPs' SwiGLU
        raise CheckpointError(f"config.json: hidden_act is {hf['hidden_act']!r}; tracefp4 implements silu only")
    partial = rope if "partial_rotary_factor" in rope else hf
    if not qwen35 and partial.get("partial_rotary_factor", 1) != 1:
        raise CheckpointError(
            f"config.json: partial_rotary_factor is {partial['partial_rotary_factor']!r}; tracefp4 rotates part of "
            "each head for qwen3_5_moe only"
        )
    hidden, heads, layers = size("hidden_size"), size("num_attention_heads"), size("num_hidden_layers")
    types = hf.get("layer_types")  # transformers writes it for qwen2_moe too, all full_attention
    kinds = LAYER_TYPES if qwen35 else ("full_attention",)
    if types and (not isinstance(types, list) or len(types) != layers or not set(types) <= set(kinds)):
        raise CheckpointError(f"config.json: layer_types must list {layers} of {kinds}, got {types!r}")
    mlp_only = hf.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or any(type(i) is not int or not 0 <= i < layers for i in mlp_only):
        raise CheckpointError(f"config.json: mlp_only_layers must list layers in 0..{layers - 1}, got {mlp_only!r}")
    moe = size("moe_intermediate_size")
    known = {
        "model_type": model_type,
        "vocab_size": size("vocab_size"),
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": size("num_key_value_heads", _KV_HEADS[model_type]),
        "head_dim": size("head_dim", 256 if qwen35 else hidden // heads),  # transformers' defaults where absent
        "num_experts": size(_experts_key(hf)),
        "top_k": size("num_experts_per_tok"),
        "moe_intermediate_size": moe,
        "intermediate_size": size("intermediate_size", moe),
        "shared_expert_intermediate_size": 0 if qwen3 else size("shared_expert_intermediate_size", 0, low=0),
        "norm_topk_prob": flag("norm_topk_prob", False),  # transformers' default for both
        "decoder_sparse_step": size("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(mlp_only),
        "rms_norm_eps": positive("rms_norm_eps", 1e-6),
        "rope_theta": positive("rope_theta", 10000.0, rope if "rope_theta" in rope else hf),
        "max_position_embeddings": size("max_position_embeddings", 4096, high=2**31 - 1),
        "tie_word_embeddings": flag("tie_word_embeddings", False),
        "qkv_bias": flag("attention_bias", False) if qwen3 or qwen35 else flag("qkv_bias", True),
        "qk_norm": qwen3 or qwen35,
    }
    if qwen35:  # the hybrid layers (transformers' defaults where a key is absent)
        interval = size("full_attention_interval", 4)
        default_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
        types = types or default_types
        if known["decoder_sparse_step"] != 1 or known["mlp_only_layers"]:
            log.info(
                "config.json: qwen3_5_moe routes every layer's MLP; decoder_sparse_step and mlp_only_layers ignored"
            )
        known |= {
            "decoder_sparse_step": 1,  # transformers' Qwen3.5 has no dense layers, whatever these say
            "mlp_only_layers": (),
            "shared_expert_intermediate_size": size("shared_expert_intermediate_size"),
            "norm_topk_prob": True,  # the router always renormalizes its top-k
            "layer_types": tuple(types),
            "attn_output_gate": True,
            "partial_rotary_factor": positive("partial_rotary_factor", 0.25, partial),
            "norm_unit_offset": True,
            "linear_num_key_heads": size("linear_num_key_heads"),
            "linear_num_value_heads": size("linear_num_value_heads"),
            "linear_key_head_dim": size("linear_key_head_dim"),
            "linear_value_head_dim": size("linear_value_head_dim"),
            "linear_conv_kernel_dim": size("linear_conv_kernel_dim", 4, low=2),
        }
    try:
        return ModelConfig(**known, extra={k: v for k, v in hf.items() if k not in _HF_KEYS})
    except ValueError as e:  # the cross-field checks: heads vs kv heads, top_k vs experts
        raise CheckpointError(f"config.json: {e}") from None


def _text_config(hf: dict) -> dict:
    """The language model's config: a multimodal ``qwen3_5_moe`` config.json
    nests it under ``text_config`` (the vision tower's is skipped, with a note)."""
    if hf.get("model_type") != "qwen3_5_moe":
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError("config.json: a qwen3_5_moe config needs a text_config object")
    if hf.get("vision_config") is not None:
        log.info("config.json has a vision_config: loading the language model only, the vision tower is skipped")
    # transformers ties the whole model by the top level's (it writes both), False where it is absent
    return {**text, "tie_word_embeddings": hf.get("tie_word_embeddings", False)}


def config_to_hf(cfg: ModelConfig) -> dict:
    """A config.json that transformers and :func:`config_from_hf` both read."""
    qwen3, qwen35 = cfg.model_type == "qwen3_moe", cfg.model_type == "qwen3_5_moe"
    architecture = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
    hf = {
        **cfg.extra,
        "architectures": [architecture.get(cfg.model_type, "Qwen3_5MoeForCausalLM")],
        "model_type": QWEN35_TEXT if qwen35 else cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "intermediate_size": cfg.intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
    }
    if qwen35:
        del hf["intermediate_size"], hf["decoder_sparse_step"], hf["mlp_only_layers"], hf["norm_topk_prob"]
        del hf["rope_theta"]
        rope = {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        }
        if "mtp_num_hidden_layers" in hf:  # the folder holds no MTP head (skipped on load): a server must not look
            hf["mtp_num_hidden_layers"] = 0  # for one (vLLM's and SGLang's MTP speculative decoding read this)
        hf |= {
            "attention_bias": cfg.qkv_bias,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
            "rope_parameters": rope,
            "layer_types": list(cfg.layer_types),
            "linear_num_key_heads": cfg.linear_num_key_heads,
            "linear_num_value_heads": cfg.linear_num_value_heads,
            "linear_key_head_dim": cfg.linear_key_head_dim,
            "linear_value_head_dim": cfg.linear_value_head_dim,
            "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        }
    elif qwen3:
        hf["attention_bias"] = cfg.qkv_bias
    else:
        hf["qkv_bias"] = cfg.qkv_bias
        hf["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return hf


def hub_slot(key: str, cfg: ModelConfig) -> tuple[str, Callable[[Tensor], Tensor]]:
    """Where the Hub tensor ``key`` lives in the stacked state: the stacked key,
    and the view of the stacked tensor that holds it, in the Hub tensor's
    shape and orientation, so that copying the Hub tensor into the view places
    it (``q_proj`` is the first rows of ``qkv_proj``; expert e's ``gate_proj``
    the transposed first columns of ``gate_up[e]``; a fused ``gate_up_proj``
    all of ``gate_up`` with each expert's matrix transposed). Other keys are
    their own slot."""
    if f := _FUSED.match(key):
        return f"{f[1]}.{f[2]}", lambda t: t.transpose(1, 2)
    if m := _EXPERT.match(key):
        e, part, inter = int(m[2]), m[3], cfg.moe_intermediate_size
        if part == "down":
            return f"{m[1]}.down", lambda t: t[e].T
        start = 0 if part == "gate" else inter
        return f"{m[1]}.gate_up", lambda t: t[e, :, start : start + inter].T
    if a := _QKV.match(key):
        q_heads = cfg.num_heads * (2 if cfg.attn_output_gate else 1)  # each head's query, then its gate
        q, kv = q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[a[2]]
        return f"{a[1]}.qkv_proj.{a[3]}", lambda t: t.narrow(0, start, size)
    return key, lambda t: t


def hub_to_stacked(tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Fuse q/k/v into ``qkv_proj`` and stack per-expert (or transpose fused)
    Hub weights into ``experts.gate_up [E, H, 2I]`` / ``experts.down [E, I, H]``
    (each stacked tensor allocated once, in its first part's dtype); other keys
    pass through."""
    shapes = _stacked_shapes(cfg)
    parts: dict[str, set[str]] = {}  # stacked key -> the Hub keys that fill it
    for hub in hub_shapes(cfg, _experts_fused(tensors, "the state")):
        parts.setdefault(hub_slot(hub, cfg)[0], set()).add(hub)
    out, filled = {}, {}
    for key, t in tensors.items():
        name, view = hub_slot(key, cfg)
        if name == key:
            out[key] = t
            continue
        if name not in out:
            out[name] = t.new_empty(shapes[name])
        slot = view(out[name])
        if slot.shape != t.shape:
            raise ValueError(f"{key} has shape {list(t.shape)}, but the config implies {list(slot.shape)}")
        slot.copy_(t)
        filled.setdefault(name, set()).add(key)
    for name, keys in filled.items():
        missing = sorted(parts[name] - keys)
        if missing:
            raise KeyError(f"checkpoint lacks {missing[:4]}{' ...' if len(missing) > 4 else ''} of {name}")
    return out


def stacked_to_hub(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Inverse of :func:`hub_to_stacked`: views of ``state``'s tensors, no
    copy (:class:`~.tensor_files.TensorWriter` copies a file's worth at a time:
    a whole contiguous copy of a 35B model's experts would be another 70 GB in bf16)."""
    out = {}
    for key, t in state.items():
        prefix, _, name = key.rpartition(".")
        if prefix.endswith(".experts") and name == "gate_up":
            for e in range(cfg.num_experts):
                gate, up = t[e].T.chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
        elif prefix.endswith(".experts") and name == "down":
            for e in range(cfg.num_experts):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].T
        elif prefix.endswith(".qkv_proj"):
            q_heads = cfg.num_heads * (2 if cfg.attn_output_gate else 1)  # each head's query, then its gate
            sizes = [q_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
            attn = prefix.removesuffix(".qkv_proj")
            for part, piece in zip("qkv", t.split(sizes), strict=True):
                out[f"{attn}.{part}_proj.{name}"] = piece
        else:
            out[key] = t
    return out


def _inside(folder: Path, name: object, what: str) -> Path:
    """``folder / name`` if ``name`` is a relative file name that stays inside
    ``folder``: no absolute path, no '..', no symlink pointing out of it, but
    for Hugging Face's cache (:func:`_hub_cache_blob`)."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise CheckpointError(f"{folder}: {what} names {name!r}, which is not a file name")
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"{folder}: {what} names {name!r}, outside the folder")
    path = folder / name
    target = path.resolve()
    if not target.is_relative_to(folder.resolve()) and not _hub_cache_blob(folder, target):
        raise CheckpointError(
            f"{path} ({what}) is a link to {target}, outside the folder; copy the folder with its links followed "
            "(cp -rL) to load it"
        )
    return path


def _hub_cache_blob(folder: Path, target: Path) -> bool:
    """Whether ``folder`` is a snapshot in Hugging Face's cache (what
    ``snapshot_download`` and ``hf download`` without ``--local-dir`` give:
    ``models--{org}--{name}/snapshots/{revision}``) and ``target`` one of that
    repository's blobs, which its files link to (``../../blobs/{hash}``)."""
    snapshot = folder.resolve()
    repository = snapshot.parent.parent
    return snapshot.parent.name == "snapshots" and target.is_relative_to(repository / "blobs")


# Folders this process's fetch downloaded and checked, by resolved path: the (size, mtime_ns, ctime_ns) each file
# had once checked, the manifest's too (verify_folder)
_fetched: dict[Path, dict[str, tuple[int, int, int]]] = {}


def _stamp(path: Path) -> tuple[int, int, int]:
    info = path.stat()
    return info.st_size, info.st_mtime_ns, info.st_ctime_ns


def size_and_sha256(path: Path) -> tuple[int, str]:
    """A file's size and sha256, read a block at a time (checkpoint files can be hundreds of GB)."""
    with open(path, "rb") as f:
        return os.fstat(f.fileno()).st_size, hashlib.file_digest(f, "sha256").hexdigest()


def sizes_and_sha256(paths: list[Path]) -> list[tuple[int, str]]:
    """:func:`size_and_sha256` of each file, several at once: hashlib hashes
    outside the GIL, and a policy of Qwen3.5-35B-A3B (70 GB, saved and
    verified every round) hashed one file at a time took a core's 1.5 GB/s."""
    return each_at_once(size_and_sha256, paths, min(HASH_THREADS, len(os.sched_getaffinity(0))), "sha256")


def each_at_once(work: Callable[[T], object], items: list[T], threads: int, name: str) -> list:
    """``work(item)`` for each of ``items``, up to ``threads`` at once (threads
    named ``name``), its results in ``items``' order. A failure is raised once
    the items before it are done, and so is the first in that order wherever
    several fail; items not started by then never start, and those running
    end first (a transfer under way cannot be stopped), so that the caller
    cleans up after them (a partial download), also on an exit (SIGTERM,
    Ctrl-C): threads left running would write on after it."""
    with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(items))), thread_name_prefix=name) as pool:
        futures = [pool.submit(work, item) for item in items]
        try:
            return [future.result() for future in futures]
        finally:
            for future in futures:
                future.cancel()


def _write_manifest(folder: Path, provenance: dict | None = None) -> None:
    """Record the size and sha256 of every file in ``folder`` in :data:`MANIFEST`,
    with ``provenance`` (who wrote the folder: run id, policy version) beside them."""
    paths = sorted(folder.iterdir())
    files = {
        path.name: {"size": size, "sha256": digest} for path, (size, digest) in zip(paths, sizes_and_sha256(paths))
    }
    (folder / MANIFEST).write_text(json.dumps({"files": files, "provenance": provenance or {}}, indent=1))


def commit_folder(tmp: Path, folder: Path, provenance: dict | None = None) -> Path:
    """Finish a folder written at ``tmp``: the checksum manifest over its files
    (with ``provenance``), everything synced, then renamed to ``folder``, so
    that a reader never sees half of it. An existing ``folder`` is moved aside
    first and then deleted (POSIX renames no folder over a non-empty one): a
    crash between the two renames leaves no ``folder``, and the old one
    whole as ``.<name>.old-<random>`` beside it, which the next save puts
    back before it starts (:func:`staging_folder`)."""
    _write_manifest(tmp, provenance)  # last: it covers every file above
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_folder(tmp)  # the files' names
    old = None
    if folder.exists():  # onto a fresh empty folder, which a rename may replace
        old = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.old-"))
        folder.rename(old)
    tmp.rename(folder)
    fsync_folder(folder.parent)  # the renames
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def recommit(source: Path, folder: Path, provenance: dict, replace: Mapping[str, str] | None = None) -> Path:
    """A copy of the tracefp4 folder ``source`` (checked against its manifest
    first) at ``folder``, all-or-nothing, with ``provenance`` in its manifest
    and the text files ``replace`` names in place of the source's: how a
    continuation takes on the policy and trainer state of the run it
    continues, bit for bit. Files are hard-linked where the filesystem
    allows (at the paper's scale the two hold about 490 GB), else copied."""
    if not (source / MANIFEST).exists():
        raise CheckpointError(f"{source / MANIFEST}: missing, so {source} was not saved by tracefp4")
    verify_folder(source)
    replace = replace or {}
    with staging_folder(folder) as tmp:
        for name in _manifest_entries((source / MANIFEST).read_bytes(), source / MANIFEST):
            if name in replace:
                continue
            try:
                os.link(source / name, tmp / name)
            except OSError:  # another filesystem, or one without hard links
                shutil.copyfile(source / name, tmp / name)
        for name, text in replace.items():
            (tmp / name).write_text(text)
        return commit_folder(tmp, folder, provenance)


def check_replaceable(folder: Path) -> None:
    """Refuse to write a tracefp4 save at ``folder`` where that would delete
    what it holds: a file, or a folder of anything but a tracefp4 save (no
    :data:`MANIFEST`; an ``--output`` that names a folder of runs, say). A
    command checks its output with this before its work, the save again."""
    if folder.is_dir() and any(folder.iterdir()) and not (folder / MANIFEST).is_file():
        raise CheckpointError(
            f"{folder}: holds files tracefp4 did not save (it has no {MANIFEST}), which writing there would "
            "delete: write into a new or empty folder"
        )
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder}: a file, not a folder to write into")


@contextlib.contextmanager
def staging_folder(folder: Path) -> Iterator[Path]:
    """A fresh empty folder beside ``folder`` to write it in, for
    :func:`commit_folder`; deleted if the writing fails, so that a failed save
    leaves no copy behind. What a killed save left beside the folder is
    deleted first, but for a save killed between :func:`commit_folder`'s two
    renames, which left no ``folder`` and the old one whole beside it: that
    one is put back first, so that this save failing too loses nothing. A
    folder that replacing would delete what it holds is refused
    (:func:`check_replaceable`). Named uniquely: a container's process ids
    repeat."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    moved_aside = sorted(folder.parent.glob(f".{glob.escape(folder.name)}.old-*"), key=lambda p: p.stat().st_mtime)
    if moved_aside and not folder.exists():
        log.warning("%s: put back from %s, where a save killed while replacing it left it", folder, moved_aside[-1])
        moved_aside[-1].rename(folder)
    check_replaceable(folder)
    for kind in ("tmp", "old"):  # what a save killed mid-way (SIGKILL, out of memory) left: one writer per folder
        for stale in folder.parent.glob(f".{glob.escape(folder.name)}.{kind}-*"):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-"))
    os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would keep the saved folder from a serving engine of another user
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left there once committed: it is ``folder`` then


def provenance(folder: str | os.PathLike) -> dict:
    """The ``provenance`` a tracefp4 save recorded in the folder's :data:`MANIFEST`
    (for a policy: ``run_id`` and ``policy_version``); empty for a folder from elsewhere."""
    path = Path(folder) / MANIFEST
    return manifest_provenance(path.read_bytes(), str(path)) if path.exists() else {}


def manifest_provenance(manifest: bytes, where: str) -> dict:
    """The ``provenance`` recorded in a :data:`MANIFEST`'s bytes (read from ``where``: a path, or a store
    URI, as ``runs clean`` reads a deleted run's policies)."""
    try:
        found = json.loads(manifest).get("provenance", {})
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"{where}: not a checksum manifest ({type(e).__name__}: {e})") from None
    if not isinstance(found, dict):
        raise CheckpointError(f"{where}: provenance must be an object, got {found!r}")
    return found


def folder_digest(folder: str | os.PathLike) -> str:
    """sha256 of the folder's :data:`MANIFEST`: one value that names every file's
    content (and the provenance), so that another artifact can pin this exact folder."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{path}: missing, so {folder} was not saved by tracefp4")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def local_folder(uri: str) -> Path | None:
    """The folder a path or ``file://`` URI names; None for a store's (``s3://``, ``minio://``)."""
    if "://" not in uri:
        return Path(uri)
    return file_path(uri) if uri.startswith("file://") else None


def fingerprint(uri: str | os.PathLike, store_env: Mapping[str, str] | None = None) -> str:
    """A value that changes when the checkpoint at ``uri`` (a folder, ``file://``,
    ``s3://`` or ``minio://``) does, read without downloading its weights: the
    sha256 of its :data:`MANIFEST`, or, without one, of each file's name and
    size with its modification time (a folder) or its ETag (a store, reached
    with ``store_env``'s S3 settings: the steps', which read it). A folder that is
    not there is refused, and so is one standing for a folder that is not
    (:func:`location`): a local run fingerprints its checkpoints before it
    starts, which would otherwise fail in its first step."""
    text = os.fspath(uri)
    folder = local_folder(text)  # a location folder: its manifest is the one it stands for
    if folder is not None:
        if not folder.is_dir():
            raise CheckpointError(f"{text}: no such folder{unexpanded_home(text)}")
        _refuse_unfinished(folder, os.listdir(folder))
        location(folder, store_env)
        if (folder / MANIFEST).exists():
            return folder_digest(folder)
        files = sorted(f for f in folder.iterdir() if f.is_file())
        material = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    else:
        store = open_store(text, env=store_env)
        names = sorted(key for key in store.list() if "/" not in key)
        _refuse_unfinished(store.uri, names)
        if MANIFEST in names:
            return hashlib.sha256(store.get_bytes(MANIFEST)).hexdigest()
        material = [(name, *store.stat(name)) for name in names]
    return hashlib.sha256(json.dumps(material).encode()).hexdigest()


def _manifest_entries(data: bytes, where: object) -> dict[str, tuple[int, str]]:
    """Each file's size and sha256 from the bytes of a :data:`MANIFEST` read from ``where``."""
    try:
        files = json.loads(data)["files"]
        return {name: (int(e["size"]), str(e["sha256"])) for name, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{where}: not a checksum manifest ({type(e).__name__}: {e})") from None


def verify_folder(folder: Path) -> None:
    """Check every file against :data:`MANIFEST`, so that a corrupt, truncated
    or partly copied checkpoint fails here, naming the file, instead of loading
    wrong weights. A folder without a manifest (saved by transformers, say)
    loads with a warning; one an upload left unfinished (a ``file://``
    store's, or a copy of a store's) is refused (:func:`_refuse_unfinished`).
    A folder that :func:`fetch` downloaded and checked in
    this process is not read for its checksums again, as long as it and its
    manifest keep the sizes and times they had then: rank 0 of a distributed
    round fetches the policy and trainer state and loads them at once (490 GB
    at Qwen3.5-35B-A3B, minutes of sha256)."""
    path = folder / MANIFEST
    if not path.exists():
        _refuse_unfinished(folder, os.listdir(folder))
        log.warning("%s has no %s: loading it unverified (not saved by tracefp4)", folder, MANIFEST)
        return
    files = _manifest_entries(_inside(folder, MANIFEST, "the manifest").read_bytes(), path)
    fetched = _fetched.get(folder.resolve(), {})
    if fetched.get(MANIFEST) != _stamp(path):
        fetched = {}
    unchecked = {}
    for name, (size, digest) in files.items():
        file = _inside(folder, name, MANIFEST)
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in {MANIFEST} but missing")
        if name not in fetched or fetched[name] != _stamp(file):  # else checked as fetch downloaded it, unchanged
            unchecked[file] = (size, digest)
    for (file, (size, digest)), (got_size, got_digest) in zip(unchecked.items(), sizes_and_sha256(list(unchecked))):
        if got_size != size:
            raise CheckpointError(f"{file}: {got_size} bytes, but {MANIFEST} says {size}: truncated or changed since")
        if got_digest != digest:
            raise CheckpointError(f"{file}: sha256 does not match {MANIFEST}: corrupt or changed since")
    # the steps read the tokenizer's files too: a chat_template.jinja added beside a save would change every prompt
    read = [
        p.name
        for p in folder.iterdir()
        if p.name in (CONFIG, INDEX, *TOKENIZER_FILES) or p.name.endswith(".safetensors")
    ]
    unlisted = sorted(set(read) - set(files))
    if unlisted:
        raise CheckpointError(f"{folder}: {unlisted} not covered by {MANIFEST}: added after saving")


def _headers(folder: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Each tensor's file, dtype and shape, from the safetensors headers only
    (no tensor data is read), as the index or the single file lists them."""
    _one_set_of_weights(str(folder), {name for name in (INDEX, SINGLE) if (folder / name).exists()})
    if (folder / INDEX).exists():
        index = _inside(folder, INDEX, "the index")
        try:
            entries = json.loads(index.read_text())["weight_map"].items()
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, not {"weight_map": {...}}
            raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        shards: dict[Path, list[str]] = {}
        for tensor, shard in entries:
            shards.setdefault(_inside(folder, shard, f"{INDEX} for tensor {tensor}"), []).append(tensor)
    elif (folder / SINGLE).exists():
        shards = {_inside(folder, SINGLE, "the weights file"): []}  # empty: every tensor in it
    else:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found pickle files {pickles}: convert them to safetensors)" if pickles else ""
        raise FileNotFoundError(f"no {SINGLE} or {INDEX} in {folder}{hint}")
    headers = {}
    for path, tensors in shards.items():
        if not path.is_file():  # a shard the index names, or the single file gone a folder
            raise CheckpointError(
                f"{path}: missing, but {INDEX} puts {tensors[0]} there" if tensors else f"{path}: not a file"
            )
        try:
            with safe_open(path, framework="pt") as f:
                held = set(f.keys())
                for tensor in tensors or sorted(held):
                    if tensor not in held:
                        raise CheckpointError(f"{INDEX} puts {tensor} in {path}, which does not hold it")
                    piece = f.get_slice(tensor)
                    headers[tensor] = (path, piece.get_dtype(), tuple(piece.get_shape()))
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    return headers


def _one_set_of_weights(where: str, names: set[str]) -> None:
    """Refuse a checkpoint holding both a single weights file and an index
    (``names``: its files): two sets of weights, one of them stale (a re-sharded
    save beside the old file), and which is meant cannot be told;
    transformers would load the single file."""
    if {SINGLE, INDEX} <= names:
        raise CheckpointError(
            f"{where}: holds both {SINGLE} and {INDEX}, two sets of weights (transformers would load {SINGLE}); "
            "delete the stale one"
        )


def _language_model(folder: Path, headers: dict, cfg: ModelConfig) -> tuple[dict, dict[str, str]]:
    """The language model's tensors of a (multimodal) qwen3_5_moe checkpoint
    under the policy's names (``model.language_model.X`` as ``model.X``),
    without the vision tower and the MTP head, which are skipped with a note;
    also each renamed tensor's name in the file. Other models' tensors pass as
    they are."""
    if cfg.model_type != "qwen3_5_moe":
        return headers, {}
    skipped = sorted({prefix for t in headers for prefix in _SKIPPED if t.startswith(prefix)})
    if skipped:
        log.info("%s: skipping %s (not part of the language model)", folder, ", ".join(p + "*" for p in skipped))
    kept, names = {}, {}
    for tensor, header in headers.items():
        if tensor.startswith(_SKIPPED):
            continue
        name = "model." + tensor.removeprefix(_LANGUAGE_MODEL) if tensor.startswith(_LANGUAGE_MODEL) else tensor
        if name in kept:
            raise CheckpointError(f"{folder}: holds {name} both with and without the {_LANGUAGE_MODEL} prefix")
        kept[name] = header
        if name != tensor:
            names[name] = tensor
    return kept, names


def _meta_state(cfg: ModelConfig) -> dict[str, Tensor]:
    """The stacked state of a model of ``cfg`` on the meta device (nothing is
    allocated), without the tied ``lm_head.weight``."""
    with torch.device("meta"):
        state = Transformer(cfg).state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def _stacked_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {k: tuple(t.shape) for k, t in _meta_state(cfg).items()}


def hub_shapes(cfg: ModelConfig, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """The Hub tensor names and shapes of a model of ``cfg``; with ``fused``,
    each layer's experts as its two fused tensors (:data:`_FUSED`), shaped as
    their slots (:func:`hub_slot`), instead of three per expert."""
    state = _meta_state(cfg)
    experts = [k for k in state if fused and k.endswith((".experts.gate_up", ".experts.down"))]
    hub = stacked_to_hub({k: t for k, t in state.items() if k not in experts}, cfg)
    hub |= {f"{k}_proj": hub_slot(f"{k}_proj", cfg)[1](state[k]) for k in experts}
    return {k: tuple(t.shape) for k, t in hub.items()}


def _experts_fused(tensors: Iterable[str], where: object) -> bool:
    """Whether the tensor names hold the routed experts fused per layer
    (:data:`_FUSED`) rather than one by one. transformers writes a checkpoint in
    one layout or the other, so a mix (fused tensors beside an expert's own) is
    a broken conversion and refused, naming one tensor of each."""
    fused = next((t for t in tensors if _FUSED.match(t)), None)
    single = next((t for t in tensors if _EXPERT.match(t)), None)
    if fused and single:
        raise CheckpointError(
            f"{where}: holds {fused} (a layer's experts fused) and {single} (one expert's): "
            "the experts must be all fused or all per expert"
        )
    return fused is not None


_ROPE_BUFFER = re.compile(r"\.rotary_emb\.inv_freq$")


def _check_tensors(folder: Path, cfg: ModelConfig, headers: dict) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """The tensors to load, once config.json agrees with their names, dtypes and
    shapes. Layer and expert counts are compared first, so that an absurd count
    fails before a model of that size is even described (fused experts hold
    their count in their shape, which describing does not walk)."""

    def check_count(key: Callable[[], str], said: int, pattern: re.Pattern, name: str) -> None:
        held = 1 + max((int(m[1]) for t in headers if (m := pattern.match(t))), default=-1)
        if held != said:
            gap = f"missing {name.format(held)}.*" if said > held else f"unexpected {name.format(said)}.*"
            raise CheckpointError(f"{folder / CONFIG}: {key()} is {said}, but the weights hold {held} ({gap})")

    check_count(lambda: "num_hidden_layers", cfg.num_layers, _LAYER, "model.layers.{}")
    fused = _experts_fused(headers, folder)
    if cfg.sparse_layers and not fused:  # only now: it walks the layers
        check_count(
            lambda: _experts_key(json.loads((folder / CONFIG).read_text())),  # the file's own name, read to say it
            cfg.num_experts,
            _EXPERT_INDEX,
            "experts.{}",
        )
    expected = hub_shapes(cfg, fused)
    if cfg.tie_word_embeddings:
        headers = {k: v for k, v in headers.items() if k != "lm_head.weight"}  # transformers may save the tied copy
    # RoPE's inverse frequencies, a buffer older transformers saved and its loaders skip: computed from config.json
    headers = {k: v for k, v in headers.items() if not _ROPE_BUFFER.search(k)}
    missing, unexpected = sorted(set(expected) - set(headers)), sorted(set(headers) - set(expected))
    if missing or unexpected:
        gaps = [f"{what} {names[:5]}" + f" and {len(names) - 5} more" * (len(names) > 5)
                for what, names in (("missing", missing), ("unexpected", unexpected)) if names]  # fmt: skip
        raise CheckpointError(f"{folder}: the weights do not match {CONFIG}: {', '.join(gaps)}")
    for tensor, shape in expected.items():
        path, dtype, got = headers[tensor]
        if dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{path}: {tensor} is {dtype}; weights must be one of {sorted(_FLOAT_DTYPES)}")
        if got != shape:
            dims = f" ({_FUSED_DIMS[f[2]]})" if (f := _FUSED.match(tensor)) else ""
            raise CheckpointError(f"{path}: {tensor} has shape {list(got)}, but {CONFIG} implies {list(shape)}{dims}")
    return headers


def load_model(
    path: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> Transformer:
    """The policy saved at ``path`` (a Hugging Face folder), checked as the
    module docstring says before any weight is read, in ``dtype`` (default: the
    checkpoint's, see :func:`checkpoint_dtype`) on ``device``.

    Lean: the model is built on the meta device and each parameter allocated
    once, in ``dtype``; every Hub tensor is copied from the memory-mapped file
    straight into its slot of the stacked layout (:class:`PolicyReader`):
    peak memory is the model plus about one stacked tensor's weights
    (``benchmarks/load.py``)."""
    reader = PolicyReader(path)
    model = empty_model(reader.cfg, dtype or reader.dtype, device)
    state = model.state_dict()
    with torch.no_grad():
        for name in reader.stacked:
            reader.read_into(name, state[name])
    return model


def check_weights(path: str | os.PathLike, cfg: ModelConfig) -> torch.dtype:
    """The weights of the policy folder ``path`` checked against ``cfg``, its
    config.json's (:func:`read_config`), by their safetensors headers alone
    (files, names, dtypes, shapes), as :class:`PolicyReader` checks them before
    it reads any: a command checks a checkpoint so before its run starts, in a
    moment at any size (the checksums, which read every byte, are prepare's).
    Returns the dtype they load in (:func:`checkpoint_dtype`)."""
    folder = Path(path)
    headers, _ = _language_model(folder, _headers(folder), cfg)
    return checkpoint_dtype(_check_tensors(folder, cfg, headers))


class PolicyReader:
    """A policy folder checked as the module docstring says, before any weight
    is read, whose stacked tensors are then read one at a time: by
    :func:`load_model`, and by a distributed trainer's rank 0, which hands each
    to the ranks before it reads the next (at Qwen3.5-35B-A3B the policy is
    70 GB in bf16, 140 GB as the trainer's float32 parameters)."""

    def __init__(self, path: str | os.PathLike):
        folder = Path(path)
        _config_file(folder)  # before the checksums: a folder that is no policy says so
        verify_folder(folder)
        cfg = read_config(folder)
        headers, self.names = _language_model(folder, _headers(folder), cfg)
        self.cfg = _untied_where_the_head_differs(folder, cfg, headers, self.names)
        headers = _check_tensors(folder, self.cfg, headers)
        self.dtype = checkpoint_dtype(headers)
        # stacked name -> shard -> its Hub tensors there, in the files' order
        self.parts: dict[str, dict[Path, list[str]]] = {}
        for tensor, (shard, _, _) in headers.items():
            self.parts.setdefault(hub_slot(tensor, self.cfg)[0], {}).setdefault(shard, []).append(tensor)
        self.stacked = list(self.parts)  # the stacked tensors the folder holds

    def read_into(self, name: str, target: Tensor) -> None:
        """Copy the stacked tensor ``name`` into ``target`` (in its dtype),
        each shard mapped only while its parts are read: pages read through a
        mapping count in the process's resident memory until it is closed."""
        for shard, tensors in self.parts[name].items():
            with safe_open(shard, framework="pt") as f:
                for tensor in tensors:
                    hub_slot(tensor, self.cfg)[1](target).copy_(f.get_tensor(self.names.get(tensor, tensor)))


def _untied_where_the_head_differs(folder: Path, cfg: ModelConfig, headers: dict, names: dict) -> ModelConfig:
    """``cfg``, untied where config.json ties the embedding and ``lm_head``
    but the weights hold an ``lm_head.weight`` of other values: a fine-tune
    that untied the head and kept the config. transformers loads both, and so
    does this (a log line says so); tying would drop the trained head and
    give other logits."""
    if not (cfg.tie_word_embeddings and "lm_head.weight" in headers):
        return cfg
    tensors = []
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name not in headers:
            return cfg  # _check_tensors names what is missing
        with safe_open(headers[name][0], framework="pt") as f:
            tensors.append(f.get_tensor(names.get(name, name)))
    if tensors[0].shape == tensors[1].shape and torch.equal(*tensors):
        return cfg  # the tied copy transformers may save
    log.warning("%s: tie_word_embeddings is true, but lm_head.weight differs from the embedding: loaded untied, as "
                "transformers loads it", folder / CONFIG)  # fmt: skip
    return dataclasses.replace(cfg, tie_word_embeddings=False)


def _config_file(folder: Path) -> Path:
    """``folder``'s config.json, which a policy folder has: a missing one fails naming it."""
    path = _inside(folder, CONFIG, "the config")
    if not path.exists():
        what = "no policy folder" if folder.is_dir() else f"no folder{unexpanded_home(str(folder))}"
        raise FileNotFoundError(
            f"{path} does not exist: {folder} is {what} (a Hugging Face checkpoint's config.json, safetensors and "
            "tokenizer files)"
        )
    return path


def read_config(folder: str | os.PathLike) -> ModelConfig:
    """The architecture a policy folder's config.json describes, checked (:func:`config_from_hf`)."""
    folder = Path(folder)
    path = _config_file(folder)
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    quantized = hf.get("quantization_config") if isinstance(hf, dict) else None
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise CheckpointError(
            f"{path}: a quantized checkpoint (quantization_config, {method}), such as tracefp4 export writes for "
            "serving: the policy is trained and rolled out from unquantized weights; give the folder it was "
            "exported from"
        )
    try:
        return config_from_hf(hf)
    except CheckpointError as e:
        raise CheckpointError(f"{folder}: {e}") from None


def read_policy_folder(folder: str | os.PathLike, source: str | None = None) -> tuple[ModelConfig, PolicyTokenizer]:
    """A policy folder's architecture and tokenizer, checked (:func:`read_config`,
    :func:`~.tokenizer.load_tokenizer`) and against each other: every token
    has a row of the embedding. A tokenizer without a chat template is warned
    of (but the library's character tokenizer): prompts are then plain text,
    answers end at a newline (docs/pipeline.md), which a chat model's folder
    without its ``chat_template.jinja`` would get unawares. Errors and the
    warning name ``source`` in place of ``folder`` where given (the store URI
    the folder was fetched from: its cache entry means nothing to whoever
    gave the URI)."""
    named = str(folder) if source is None else source.rstrip("/")
    try:
        cfg, tokenizer = read_config(folder), load_tokenizer(folder)
    except (CheckpointError, TokenizerError, FileNotFoundError) as e:
        raise type(e)(str(e).replace(str(folder), named)) from None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(
            f"{named}: {TOKENIZER} holds {tokenizer.vocab_size} tokens, more than config.json's vocab_size "
            f"{cfg.vocab_size} (the rows of the model's embedding)"
        )
    if not (tokenizer.chat or tokenizer.characters):
        log.warning(
            "%s has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json): prompts are "
            "plain text and answers end at a newline (docs/pipeline.md)",
            named,
        )
    elif tokenizer.chat and not tokenizer.opens_a_response():
        log.warning(
            "%s: its chat template renders no generation prompt (add_generation_prompt changes nothing): a "
            "response would follow the user's turn with no assistant header; check the template",
            named,
        )
    return cfg, tokenizer


def checkpoint_dtype(headers: dict[str, tuple[Path, str, tuple[int, ...]]]) -> torch.dtype:
    """The dtype of the checkpoint's weights; where they mix dtypes, the one
    holding most of their bytes. The published Qwen3.5 checkpoints keep a few
    vectors in F32 (each linear-attention layer's ``A_log`` and norm) among
    BF16 matrices: loading every weight in float32 would double the model's
    memory. The others are rounded to it, as transformers rounds them loading
    with that dtype; a log line names them."""
    sizes = [(dtype, math.prod(shape) * _TORCH_DTYPES[dtype].itemsize) for _, dtype, shape in headers.values()]
    chosen = _most_bytes(sizes)
    others = sorted(name for name, (_, dtype, _) in headers.items() if dtype != chosen)
    if others:
        log.info("loading in %s, the dtype of most of the weights; rounded to it from another dtype: %s (%d in all)",
                 _TORCH_DTYPES[chosen], ", ".join(others[:4]), len(others))  # fmt: skip
    return _TORCH_DTYPES[chosen]


def _most_bytes(sizes: Iterable[tuple[T, int]]) -> T:
    """Of ``(dtype, bytes)`` pairs, the dtype holding most bytes in all: a checkpoint's, where weights mix dtypes."""
    total: dict = {}
    for dtype, nbytes in sizes:
        total[dtype] = total.get(dtype, 0) + nbytes
    return max(total, key=total.get)


def load_state(model: Transformer, state: dict[str, Tensor]) -> None:
    """Copy ``state`` into ``model``; every weight must be there, and nothing else."""
    expected = dict(model.state_dict())
    if model.cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise KeyError(f"checkpoint does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    bad = [k for k in expected if tuple(state[k].shape) != tuple(expected[k].shape)]
    if bad:
        shapes = [(k, tuple(state[k].shape), tuple(expected[k].shape)) for k in bad[:3]]
        raise ValueError(f"checkpoint shapes do not match the config: {shapes}")
    with torch.no_grad():
        for k, t in expected.items():
            t.copy_(state[k])


def save_model(
    model: Transformer,
    path: str | os.PathLike,
    max_shard_bytes: int = 2 << 30,
    extra: dict[str, bytes] | None = None,
    provenance: dict | None = None,
) -> Path:
    """Write ``model`` in the Hub layout at ``path``, sharded above
    ``max_shard_bytes``, with ``extra`` files beside it and the checksum
    manifest over all of them (recording ``provenance``), all at once (atomically)."""
    state = saved_state(model)
    return save_stacked(model.cfg, state, state.items(), path, max_shard_bytes, extra, provenance)


def saved_state(model: Transformer) -> dict[str, Tensor]:
    """The stacked tensors a save writes: the model's state, a tied ``lm_head`` left out (the Hub has it once)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def save_stacked(
    cfg: ModelConfig,
    layout: Mapping[str, Tensor],
    values: Iterable[tuple[str, Tensor]],
    path: str | os.PathLike,
    max_shard_bytes: int = 2 << 30,
    extra: dict[str, bytes] | None = None,
    provenance: dict | None = None,
) -> Path:
    """:func:`save_model` of a stacked state given as the tensors ``layout``
    names (shapes and dtypes: meta tensors will do) and their ``values``, in
    the same order, as they come: each stacked tensor is split into its Hub
    tensors (views) and let go once the file holding them is written
    (:class:`~.tensor_files.TensorWriter`). A distributed trainer's rank 0
    passes the parameters as it gathers them, holding about one file's worth
    of the model rather than all of it."""
    folder = Path(path)
    with staging_folder(folder) as tmp:
        writer = TensorWriter(tmp, stacked_to_hub(dict(layout), cfg), "model", max_shard_bytes)
        for name, t in values:
            for key, view in stacked_to_hub({name: t}, cfg).items():
                writer.add(key, view)
        writer.close()
        held = _most_bytes((t.dtype, t.numel() * t.element_size()) for t in layout.values())
        hf = {**config_to_hf(cfg), **dtype_fields(held)}
        (tmp / CONFIG).write_text(json.dumps(hf, indent=2))
        for name, data in (extra or {}).items():
            (tmp / name).write_bytes(data)
        return commit_folder(tmp, folder, provenance)


def dtype_fields(dtype: torch.dtype) -> dict[str, str]:
    """config.json's dtype of the weights (most of their bytes), under
    transformers 5's key and 4's: what ``from_pretrained`` computes in by
    default. The source checkpoint's, which ``cfg.extra`` keeps, is stale where
    the weights were saved in another dtype (an fp32 policy trained and saved
    in bf16; fp32 weights under "bfloat16" would be rounded on loading)."""
    name = str(dtype).removeprefix("torch.")
    return {"dtype": name, "torch_dtype": name}


def write_weights(hub: dict[str, Tensor], folder: Path, max_shard_bytes: int = 2 << 30) -> None:
    """``hub`` tensors as :data:`SINGLE`, or above ``max_shard_bytes`` as numbered
    shards with their :data:`INDEX`, the way transformers names them (sorted by name)."""
    write_tensors(folder, {key: hub[key] for key in sorted(hub)}, "model", max_shard_bytes)


def cache_dir() -> Path:
    """Where :func:`fetch` keeps downloaded checkpoints: ``$TRACEFP4_CACHE_DIR/checkpoints``,
    by default ``~/.cache/tracefp4/checkpoints`` (``$XDG_CACHE_HOME`` honoured)."""
    root = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "tracefp4")
    return Path(root, "checkpoints")


def fetch(
    uri: str | os.PathLike,
    store_env: Mapping[str, str] | None = None,
    weights: bool = True,
    into: str | os.PathLike | None = None,
) -> Path:
    """The local folder of the checkpoint at ``uri``. A path or ``file://`` URI is
    that folder. An ``s3://`` or ``minio://`` one (settings from ``store_env``,
    default the environment) is downloaded once into :func:`cache_dir`, under a
    name derived from the checksum manifest (or, for a checkpoint without one,
    from the ETags of its objects), so that a later fetch of the same objects
    downloads nothing. Downloaded files are checked against the manifest before
    the folder is renamed into place: a corrupt or partial download is never
    used. One process of a machine downloads a checkpoint at a time; another
    fetching it meanwhile waits and finds it cached. Without a manifest every shard the index names must be there, and
    :func:`load_model` loads it with its unverified warning; a folder whose upload did not finish, in a store or a
    folder, is refused (:func:`_refuse_unfinished`). Only the files loading reads are fetched: the weights,
    config.json, the index, the manifest's files and the tokenizer's (:data:`.tokenizer.FILES`); without
    ``weights``, all but the safetensors files, into a cache entry of its own:
    a folder to read the config, tokenizer and manifest from, which
    :func:`load_model` refuses (a distributed round's ranks but rank 0 need
    no more: :meth:`.distributed.DistributedTrainer.from_checkpoint`). A
    folder standing for another (:func:`write_location`: a TrainJob round's
    trainer state), in a folder or a store, is followed there.

    With ``into`` (a folder that does not exist or is empty) the checkpoint
    is placed there instead: downloaded and checked as above without the
    cache, or copied from a local folder. A step that hands the folder on as
    its own output (the TrainJob launcher's new policy and trainer state:
    hundreds of GB at the paper's scale) would otherwise hold it twice."""
    text = os.fspath(uri)
    if into is not None:
        into = Path(into)
        if into.exists() and any(into.iterdir()):
            raise CheckpointError(f"{into}: not empty; fetching {text} into it would mix two checkpoints")
    local = local_folder(text)
    if local is not None:
        if local.is_dir():
            _refuse_unfinished(local, os.listdir(local))
        if (local / LOCATION).is_file():
            return fetch(location(local, store_env), store_env, weights, into)
        return local if into is None else Path(shutil.copytree(local, into, dirs_exist_ok=True))
    store = open_store(text, env=store_env)
    where = store.uri
    listed = {key for key in store.list() if "/" not in key}  # the folder's own objects, not its subfolders'
    _refuse_unfinished(where, listed)
    if LOCATION in listed:  # a small folder standing for a large one: read whole, followed from there
        with tempfile.TemporaryDirectory() as tmp:
            for name in {LOCATION, MANIFEST} & listed:
                store.download(name, Path(tmp, name))
            return fetch(location(Path(tmp), store_env, where), store_env, weights, into)
    have: dict[str, bytes] = {}  # small objects already read, written to the cache as read
    entries: dict[str, tuple[int, str]] = {}
    if MANIFEST in listed:
        have[MANIFEST] = store.get_bytes(MANIFEST)
        entries = _manifest_entries(have[MANIFEST], f"{where}/{MANIFEST}")
        wanted = {MANIFEST, *entries}
        for name in sorted(entries):
            _flat(where, name, MANIFEST)
            if name not in listed:
                raise CheckpointError(f"{where}/{name}: listed in {MANIFEST} but missing from the store")
    else:
        wanted = _weights(store, listed, have)
    wanted |= set(TOKENIZER_FILES) & listed
    if not weights:
        wanted = {name for name in wanted if not name.endswith(".safetensors")}
    # the files without a checksum: their sizes, and their ETags, which key the cache entry instead
    unverified = {name: store.stat(name) for name in sorted(wanted - set(entries) - {MANIFEST})}
    if into is not None:
        into.parent.mkdir(parents=True, exist_ok=True)
        if into.exists():
            into.rmdir()  # empty: the checked download is renamed into its place
        return _download(store, where, wanted, have, entries, unverified, into)
    material = {
        "manifest": hashlib.sha256(have.get(MANIFEST, b"")).hexdigest(),
        "files": {name: list(stat) for name, stat in unverified.items()},
    }
    if not weights:
        material["without"] = "weights"
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    folder = cache_dir() / key
    if folder.is_dir():
        log.info("%s: cached at %s", where, folder)
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder.parent.with_name("checkpoint-locks") / key) as alone:
        if folder.is_dir():  # a process that held the lock before fetched it
            log.info("%s: cached at %s", where, folder)
            return folder
        if alone:  # so every partial download of this entry is a dead process's (killed, out of memory)
            for partial in folder.parent.glob(f".{key}.*.partial"):
                shutil.rmtree(partial, ignore_errors=True)
        return _download(store, where, wanted, have, entries, unverified, folder)


def write_location(folder: Path, uri: str, manifest: bytes) -> Path:
    """Make ``folder`` (missing or empty) stand for the tracefp4 folder at
    ``uri``: that folder's :data:`MANIFEST`, byte for byte, and :data:`LOCATION`
    naming ``uri``, written last. It pins the same content (its
    :func:`folder_digest` is that folder's), and :func:`fetch` and the
    TrainJob launcher follow it there: how a TrainJob round hands its ranks'
    trainer state to the next round (at Qwen3.5-35B-A3B 420 GB a round) without
    its step's pod downloading it and KFP keeping a copy of it every round."""
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise CheckpointError(f"{folder}: not empty; it cannot stand for {uri}")
    write_atomic(folder / MANIFEST, lambda f: f.write(manifest))
    write_atomic(folder / LOCATION, lambda f: f.write(json.dumps({"uri": uri}).encode()))
    return folder


def upload_folder(folder: Path, target: ArtifactStore) -> bytes:
    """Upload the files of the tracefp4 folder ``folder`` to the store folder
    ``target``, up to :data:`TRANSFER_THREADS` at once, its :data:`MANIFEST`
    once all others are there, so that a reader takes it whole once that is
    there; returns the manifest. :data:`UNFINISHED` goes there before
    anything else and leaves once the manifest is there: an upload cut short
    (the step killed) leaves a folder without a manifest, which would
    otherwise load as a checkpoint from elsewhere, unverified, once its
    config.json and weights were there; with it every reader refuses the
    folder (:func:`_refuse_unfinished`). A folder uploaded there before (a
    retried step's) is deleted next, its manifest before its other files:
    files it had that the new one lacks would be taken for the new one's
    (:func:`fetch` takes the tokenizer's files and :data:`LOCATION` by
    listing the folder), and while the new files are uploaded the folder
    holds none of the old one's, which a fetch would otherwise mix with
    them unchecked."""
    files = [file for file in sorted(folder.iterdir()) if file.name != MANIFEST]
    marker = _unmake(target, "", [key for key in target.list() if "/" not in key])  # the folder's own objects
    each_at_once(lambda file: target.upload(file.name, file), files, TRANSFER_THREADS, "upload")
    target.upload(MANIFEST, folder / MANIFEST)
    target.delete(marker)
    return (folder / MANIFEST).read_bytes()


def delete_folder(store: ArtifactStore, prefix: str) -> None:
    """Delete the tracefp4 folder ``prefix`` of ``store`` (everything under
    it) as :func:`upload_folder` deletes the one it replaces
    (:func:`_unmake`), so that a deletion cut short (the step killed) is
    refused like an upload cut short, not loaded as a checkpoint from
    elsewhere from the config.json and weights it left. Its :data:`UNFINISHED`
    goes last, by the store's own folder deletion (a ``file://`` store's also
    deletes the temp files killed writers left there)."""
    _unmake(store, prefix, store.list(f"{prefix}/"))
    store.delete_folder(prefix, UNFINISHED)


def remove_folder(folder: Path) -> None:
    """Delete the local tracefp4 folder ``folder`` as :func:`delete_folder`
    deletes a store's, so that one cut short is refused too."""
    delete_folder(LocalStore(folder.parent), folder.name)


def _unmake(store: ArtifactStore, folder: str, keys: Iterable[str]) -> str:
    """Put :data:`UNFINISHED` in the folder ``folder`` of ``store`` ("" its
    root), then delete its objects ``keys``, its :data:`MANIFEST` first: how
    a tracefp4 folder loses what it holds, replaced (:func:`upload_folder`) or
    deleted (:func:`delete_folder`). Cut short anywhere after, the folder
    has the marker and no manifest, which every reader refuses
    (:func:`_refuse_unfinished`); without the marker its config.json and
    weights would load as a checkpoint from elsewhere, unverified. Returns the
    marker's key, which the caller deletes once the folder is whole or gone."""
    marker = mark_unfinished(store, folder)
    store.delete_keys([key for key in keys if key != marker], (MANIFEST,))
    return marker


def mark_unfinished(store: ArtifactStore, folder: str) -> str:
    """Put :data:`UNFINISHED` in the folder ``folder`` of ``store`` ("" its
    root) before its :data:`MANIFEST` goes (:func:`_unmake`; a run's folders
    deleted all at once, ``runs clean``); returns its key."""
    marker = f"{folder}/{UNFINISHED}" if folder else UNFINISHED
    store.put_bytes(marker, _UNFINISHED_TEXT)
    return marker


def _refuse_unfinished(where: object, names: Iterable[str]) -> None:
    """Refuse the folder ``where`` (its file or object names ``names``) if
    an upload or a deletion of it did not finish: :data:`UNFINISHED` without a
    :data:`MANIFEST` (:func:`_unmake`). Loaded, it would pass for a
    checkpoint from elsewhere: half of it written or deleted, the rest missing
    or an earlier folder's, with no more than a warning that it is unverified. With
    a manifest the upload committed (it was cut short before the marker
    left), and the manifest vouches for every file."""
    names = set(names)
    if UNFINISHED in names and MANIFEST not in names:
        raise CheckpointError(
            f"{where}: its upload or deletion did not finish (it holds {UNFINISHED} and no {MANIFEST}), so it is "
            "not whole: re-run the step that uploads it"
        )


def location(
    folder: Path, store_env: Mapping[str, str] | None = None, where: object = None, check: bool = True
) -> str | None:
    """The URI of the folder ``folder`` stands for (:func:`write_location`;
    None where it stands for itself), checked unless ``check`` is false: the
    manifest there the same, byte for byte, so that a folder rewritten or
    deleted since is not taken for the one pinned. ``where`` names ``folder``
    in messages (a store URI it was read from)."""
    where = where or folder
    if not (folder / LOCATION).is_file():
        return None
    try:
        uri = json.loads((folder / LOCATION).read_bytes())["uri"]
        if not isinstance(uri, str):
            raise TypeError(f"uri is {uri!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}/{LOCATION}: not a location ({type(e).__name__}: {e})") from None
    if not check:
        return uri
    if not (folder / MANIFEST).is_file():
        raise CheckpointError(f"{where}: {LOCATION} without the {MANIFEST} of the folder it stands for")
    try:
        if (there := local_folder(uri)) is not None:
            manifest, standing_in = (there / MANIFEST).read_bytes(), (there / LOCATION).exists()
        else:
            store = open_store(uri, env=store_env)
            manifest, standing_in = store.get_bytes(MANIFEST), LOCATION in store.list(LOCATION)
    except (FileNotFoundError, NotADirectoryError, ArtifactNotFound):
        moved = (
            "; or the run folder was moved or copied since: a local run's store is a folder of it, named by its "
            "path, so go on from the run folder where it ran"
        ) * (local_folder(uri) is not None)
        raise CheckpointError(
            f"{where} stands for {uri}, which is gone (a round's trainer state leaves the store once a later round "
            f"has trained from it: go on from a run's last round{moved})"
        ) from None
    if standing_in:
        raise CheckpointError(f"{where} stands for {uri}, which stands for another folder in turn")
    if manifest != (folder / MANIFEST).read_bytes():
        raise CheckpointError(f"{where} stands for {uri}, whose {MANIFEST} differs: rewritten since")
    return uri


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[bool]:
    """Hold ``lock`` (a file) alone among this machine's processes: the ranks of
    a distributed train step fetch the same checkpoint at once, and each would
    download the whole of it (at the paper's scale 70 GB of bf16 policy and
    420 GB of trainer state, times the ranks on a node) into a folder of its own.
    The kernel releases the lock of a process that dies. The lock files live
    beside the cache, not in it, and open for reading: another user of the
    cache can lock them too. Where this user may not create one, the fetch
    goes on unlocked (a duplicate download, never a wrong folder: each goes
    to a partial folder of its own and the first rename wins). Yields whether
    it holds the lock."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o666)
    except PermissionError as e:
        log.info("fetching without the cache's lock (%s): another process may download the same files", e)
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)


def _download(store, where: str, wanted: set[str], have: dict, entries: dict, unverified: dict, folder: Path) -> Path:
    """:func:`fetch`'s download of ``wanted`` into a partial folder, up to
    :data:`TRANSFER_THREADS` files at once, each checked as it arrives (while
    others download), renamed to ``folder``."""
    sizes = [entries[name][0] if name in entries else unverified[name][0] for name in wanted - set(have)]
    ensure_room(folder.parent, sum(sizes), f"downloading {where} ({len(wanted)} files)")
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".partial"))

    def download(name: str) -> None:
        if name in have:
            (tmp / name).write_bytes(have[name])
        else:
            store.download(name, tmp / name)
        if name in entries:
            size, digest = size_and_sha256(tmp / name)
            if size != entries[name][0]:
                raise CheckpointError(f"{where}/{name}: {size} bytes, but {MANIFEST} says {entries[name][0]}")
            if digest != entries[name][1]:
                raise CheckpointError(f"{where}/{name}: sha256 does not match {MANIFEST}: corrupt or changed")

    try:
        log.info("%s: downloading %d files into %s", where, len(wanted), folder)
        each_at_once(download, sorted(wanted), TRANSFER_THREADS, "download")
        os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would hide the entry from the cache's other users
        checked = {name: _stamp(tmp / name) for name in [*entries, MANIFEST] if name in wanted}
        try:
            tmp.rename(folder)  # the files keep their inodes and times
            _fetched[folder.resolve()] = checked
        except OSError:
            if not folder.is_dir():
                raise
            shutil.rmtree(tmp)  # another process fetched the same checkpoint first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _flat(where: str, name: str, what: str) -> str:
    """``name`` if it names an object of the checkpoint's own folder (no '/', '..')."""
    if isinstance(name, str) and "/" in name:
        raise CheckpointError(f"{where}: {what} names {name!r}, outside the folder")
    try:
        return check_key(name)
    except ValueError:
        raise CheckpointError(f"{where}: {what} names {name!r}, which is not a file name") from None


def _weights(store, listed: set[str], have: dict[str, bytes]) -> set[str]:
    """config.json and the weights of a checkpoint without a manifest: the index
    and every shard it names (each must be in the store), or the single file."""
    where = store.uri
    if CONFIG not in listed:
        raise FileNotFoundError(f"{where}/{CONFIG} does not exist")
    _one_set_of_weights(where, listed)
    if INDEX not in listed:
        if SINGLE not in listed:
            pickles = sorted(n for n in listed if n.endswith((".bin", ".pt")))
            hint = f" (found pickle files {pickles}: convert them to safetensors)" if pickles else ""
            raise FileNotFoundError(f"no {SINGLE} or {INDEX} at {where}{hint}")
        return {CONFIG, SINGLE}
    have[INDEX] = store.get_bytes(INDEX)
    try:
        weight_map = json.loads(have[INDEX])["weight_map"]
        entries = list(weight_map.items())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{where}/{INDEX}: not a safetensors index ({type(e).__name__}: {e})") from None
    shards = set()
    for tensor, shard in entries:
        shards.add(_flat(where, shard, f"{INDEX} for tensor {tensor}"))
        if shard not in listed:
            raise CheckpointError(f"{where}/{shard}: missing from the store, but {INDEX} puts {tensor} there")
    return {CONFIG, INDEX, *shards}
