"""What a paper preset holds in GPU memory, rollout and training: the sizes
docs/deploy.md's "GPU memory" quotes.

The model is Qwen3.5-35B-A3B (``components.architecture.QWEN35_35B_A3B``, the
checkpoint the paper presets load). Rollout sizes come from the library's
own classes built on the meta device (nothing is allocated): the engine's
KV cache and linear-attention states (``rollout.KVCache``) for
``rollout.max_running_requests`` rows, and its two capture buffers
(``capture.Capture``, what the preset captures). Training sizes: the sharded
state (float32 master, gradient and two AdamW moments: 16 bytes a parameter,
over the ranks), and per token the layer inputs activation checkpointing
keeps (the float32 residual stream, every layer) plus the tensors one
recomputed layer of each kind saves for its backward, counted with
``torch.autograd.graph.saved_tensors_hooks`` over a forward of
``--tokens`` tokens of one such layer (at the model's widths, ``top_k``
experts) on the CPU under the preset's bf16 autocast.

    python benchmarks/memory.py                          # paper-nvfp4-wa-kv, GB200 (186 GB)
    python benchmarks/memory.py --preset paper-w4a8-mxfp4-kv --device-gb 141

Prints the figures, then one JSON line.
"""

import argparse
import dataclasses
import json
import os
from unittest import mock

import torch

from tracefp4.components import steps
from tracefp4.components.architecture import QWEN35_35B_A3B
from tracefp4.components.capture import Capture
from tracefp4.components.device import CPU_BF16_ENV
from tracefp4.components.model import build_model, empty_model
from tracefp4.components.quant import QuantSites
from tracefp4.components.rollout import KVCache
from tracefp4.schemas import get_preset

GB = 1e9
TRAIN_STATE_BYTES = 16  # float32 master, gradient, AdamW's two moments, a parameter (FSDP2 shards them)


def rollout_sizes(config, cfg) -> dict:
    """Bytes of the rollout engine's weights, its KV cache a position (every row), states and capture buffers."""
    quant = steps.rollout_quant(config)
    dtype = steps.compute_dtype(config)
    rows = config.rollout.max_running_requests
    cache = KVCache(cfg, rows, 4096, QuantSites(quant, {}, None), dtype, "meta")
    capture = Capture(cfg, quant, steps.capture_config(config, quant, cfg), {}, device="meta")
    weights = sum(p.numel() for p in empty_model(cfg, dtype, "meta").parameters()) * dtype.itemsize
    return {
        "rows": rows,
        "weights": weights,
        "kv_per_position": rows * cache.bytes_per_token(),
        "states": rows * cache.state_bytes_per_sequence(),
        "capture_buffers": capture.buffer_bytes,
    }


def saved_per_token(cfg, kind: str, tokens: int) -> float:
    """Bytes a layer of ``kind`` saves for its backward per token (one layer, recomputed), bf16 autocast over
    float32 weights as train.precision fp32_master runs it: with torch's bf16 kernels, as on a GPU, also where
    this CPU emulates bf16 (the emulation saves float32 copies of the operands, which a GPU never holds: 764
    and 1,176 KB a token against 467 and 834 on an AVX2 EPYC)."""
    one = dataclasses.replace(cfg, vocab_size=256, num_layers=1, layer_types=(kind,), num_experts=cfg.top_k, extra={})
    model = build_model(one, dtype=torch.float32).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def keep(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    native = mock.patch.dict(os.environ, {CPU_BF16_ENV: "native"})
    with (
        native,
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t),
    ):
        model.hidden_states(ids, torch.arange(tokens)[None])
    return sum(saved.values()) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="paper-nvfp4-wa-kv")
    parser.add_argument("--device-gb", type=float, default=186.0, help="GPU memory (GB200: 186)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the one-layer forwards measured")
    args = parser.parse_args()
    config, cfg = get_preset(args.preset), QWEN35_35B_A3B
    device = args.device_gb * GB

    r = rollout_sizes(config, cfg)
    fixed = r["weights"] + r["states"] + r["capture_buffers"]
    longest_cache = int((device - fixed) // r["kv_per_position"])
    print(f"{args.preset}: Qwen3.5-35B-A3B, {r['rows']} rows decoded at once, {args.device_gb:.0f} GB a GPU")
    print(
        f"rollout: weights {r['weights'] / GB:.1f} GB, linear-attention states {r['states'] / GB:.1f} GB, "
        f"capture buffers {r['capture_buffers'] / GB:.1f} GB"
    )
    print(
        f"rollout: KV cache {r['kv_per_position'] / 1e6:.2f} MB a position (all rows): "
        f"{longest_cache} positions fit beside the rest; rollout.max_new_tokens is {config.rollout.max_new_tokens}"
    )

    world = config.train.world_size
    params = sum(p.numel() for p in empty_model(cfg, torch.float32, "meta").parameters())
    state = TRAIN_STATE_BYTES * params / world
    checkpointed = cfg.num_layers * cfg.hidden_size * 4  # each layer's float32 input, every token
    layer = {kind: saved_per_token(cfg, kind, args.tokens) for kind in sorted(set(cfg.layer_types))}
    per_token = checkpointed + max(layer.values())
    longest_train = int((device - state) // per_token)
    print(f"training: {params / 1e9:.2f} B parameters, state {state / GB:.1f} GB a rank over {world} ranks")
    print(
        f"training: per token {checkpointed / 1e3:.1f} KB of checkpointed layer inputs, and one recomputed "
        + ", ".join(f"{kind} layer {b / 1e3:.0f} KB" for kind, b in layer.items())
        + f": a microbatch of at most {longest_train} tokens fits beside the state"
    )
    print(
        json.dumps(
            {
                "benchmark": "memory",
                "preset": args.preset,
                "device_gb": args.device_gb,
                "rollout_fixed_gb": round(fixed / GB, 1),
                "rollout_kv_mb_per_position": round(r["kv_per_position"] / 1e6, 3),
                "rollout_longest_cache_positions": longest_cache,
                "train_state_gb_per_rank": round(state / GB, 1),
                "train_kb_per_token": round(per_token / 1e3, 1),
                "train_longest_microbatch_tokens": longest_train,
                "max_new_tokens": config.rollout.max_new_tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
