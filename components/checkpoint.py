"""Hugging Face checkpoints of the policy: ``config.json`` plus
``model.safetensors``, or shards listed in ``model.safetensors.index.json``.
safetensors only; pickle files are refused.

On disk experts are per expert (``mlp.experts.{e}.gate_proj.weight``, the Hub
layout, ``[out, in]``); in memory they are stacked in ``x @ w`` layout
(``mlp.experts.gate_up [E, in, out]``). Saving
writes into a temporary folder and renames it into place, so a reader never
sees a half-written checkpoint.
"""

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from .model import ModelConfig, Transformer

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_QKV = re.compile(r"^(model\.layers\.\d+\.self_attn)\.([qkv])_proj\.(weight|bias)$")


def _read_tensors(folder: Path) -> dict[str, Tensor]:
    if (folder / INDEX).exists():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE).exists():
        files = [SINGLE]
    else:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found pickle files {pickles}: convert them to safetensors)" if pickles else ""
        raise FileNotFoundError(f"no {SINGLE} or {INDEX} in {folder}{hint}")
    tensors = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def hub_to_stacked(tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Fuse q/k/v into ``qkv_proj`` and stack per-expert Hub weights into
    ``experts.gate_up [E, H, 2I]`` / ``experts.down [E, I, H]``."""
    out, experts, qkv = {}, {}, {}
    for key, t in tensors.items():
        m, a = _EXPERT.match(key), _QKV.match(key)
        if m:
            experts.setdefault(m[1], {})[(int(m[2]), m[3])] = t
        elif a:
            qkv.setdefault((a[1], a[3]), {})[a[2]] = t
        else:
            out[key] = t
    for (prefix, kind), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise KeyError(f"checkpoint has {sorted(parts)} but not all of q, k, v for {prefix}.*_proj.{kind}")
        out[f"{prefix}.qkv_proj.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    for prefix, parts in experts.items():
        missing = [f"{prefix}.{e}.{p}_proj.weight" for e in range(cfg.num_experts) for p in ("gate", "up", "down") if (e, p) not in parts]
        if missing:
            raise KeyError(f"checkpoint lacks expert weights: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        gate_up = [torch.cat([parts[(e, "gate")], parts[(e, "up")]]).T for e in range(cfg.num_experts)]
        out[f"{prefix}.gate_up"] = torch.stack(gate_up)
        out[f"{prefix}.down"] = torch.stack([parts[(e, "down")].T for e in range(cfg.num_experts)])
    return out


def stacked_to_hub(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Inverse of :func:`hub_to_stacked`."""
    out = {}
    for key, t in state.items():
        prefix, _, name = key.rpartition(".")
        if prefix.endswith(".experts") and name == "gate_up":
            for e in range(cfg.num_experts):
                gate, up = t[e].T.chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
        elif prefix.endswith(".experts") and name == "down":
            for e in range(cfg.num_experts):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].T.contiguous()
        elif prefix.endswith(".qkv_proj"):
            sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
            attn = prefix.removesuffix(".qkv_proj")
            for part, piece in zip("qkv", t.split(sizes)):
                out[f"{attn}.{part}_proj.{name}"] = piece.contiguous()
        else:
            out[key] = t
    return out


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Transformer:
    """The policy saved at ``path`` (a Hugging Face folder)."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} does not exist")
    cfg = ModelConfig.from_hf(json.loads(config_file.read_text()))
    state = hub_to_stacked(_read_tensors(folder), cfg)
    model = Transformer(cfg)
    load_state(model, state)
    return model.to(device=device, dtype=dtype)


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
        raise ValueError(f"checkpoint shapes do not match the config: {[(k, tuple(state[k].shape), tuple(expected[k].shape)) for k in bad[:3]]}")
    with torch.no_grad():
        for k, t in expected.items():
            t.copy_(state[k])


def save_model(
    model: Transformer, path: str | os.PathLike, max_shard_bytes: int = 2 << 30, extra: dict[str, bytes] | None = None
) -> Path:
    """Write ``model`` in the Hub layout at ``path``, sharded above
    ``max_shard_bytes``, with ``extra`` files beside it, all at once (atomically)."""
    folder = Path(path)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    hub = stacked_to_hub(state, model.cfg)
    shards, current, size = [], {}, 0
    for key in sorted(hub):
        nbytes = hub[key].numel() * hub[key].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = hub[key].contiguous()
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], tmp / SINGLE, metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, tmp / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in hub.values())
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2))
    for name, data in (extra or {}).items():
        (tmp / name).write_bytes(data)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder
