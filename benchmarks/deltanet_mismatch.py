"""The code mismatch that Gated DeltaNet's two forms cause by themselves.

Training runs the linear-attention layers in the chunked form, the rollout
decodes them token by token (recurrent form). Both compute the same function;
their float rounding differs, and FP4 rounding can turn that difference into
other codewords. This runs the rollout's trajectories through the same
cache-less forward twice, identical but for the delta rule's form, captures
every FP4 site in full and counts, per ``(layer, site)``, the elements whose
codeword differs (``components/mismatch.py``). For scale, the last column is
the whole rollout-vs-training mismatch (decode path with its KV cache and
recurrent states vs the teacher-forced chunked pass).

    python benchmarks/deltanet_mismatch.py [--preset tiny-qwen35] [--dtype bfloat16] [--prompts 16] [--new-tokens 48]

The last line is one JSON object with every figure.
"""

import argparse
import json

import torch

from tracefp4.components.capture import CaptureConfig
from tracefp4.components.device import cpu_kind
from tracefp4.components.mismatch import compare, teacher_force
from tracefp4.components.model import build_model
from tracefp4.components.quant_config import rollout_config
from tracefp4.components.rollout import SamplingParams, TorchEngine


def rates(report) -> dict[str, float]:
    return {f"{layer}.{site}": m.rate for (layer, site), m in report.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen35")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--config", default="fp4_wa_kv")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    model = build_model(args.preset, seed=0)
    if not model.cfg.linear_layers:
        raise SystemExit(f"preset {args.preset} has no linear-attention layers")
    dtype = getattr(torch, args.dtype)
    engine = TorchEngine(model, rollout_config(args.config), dtype=dtype, capture=CaptureConfig(bits=4))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.cfg.vocab_size, (args.prompts, args.prompt_len), generator=gen).tolist()
    trajectories = engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, seed=0))
    rollout = engine.drain_capture()
    chunked = teacher_force(engine, trajectories)
    recurrent = teacher_force(engine, trajectories, delta_form="recurrent")
    forms, whole = compare(chunked, recurrent), compare(rollout, chunked)
    figures = {
        **cpu_kind(),
        "preset": args.preset,
        "dtype": args.dtype,
        "config": args.config,
        "tokens": sum(len(t.tokens) for t in trajectories),
        "linear_layers": model.cfg.linear_layers,
        "forms_mismatch": rates(forms),
        "forms_mismatch_total": sum(m.mismatched for m in forms.values()) / sum(m.elements for m in forms.values()),
        "rollout_vs_training_mismatch": rates(whole),
    }
    print(f"{'layer':>5} {'site':<12} {'mixer':<7} {'chunked vs recurrent':>21} {'rollout vs training':>20}")
    for key, m in forms.items():
        kind = "linear" if model.cfg.is_linear(key[0]) else "full"
        print(f"{key[0]:>5} {key[1]:<12} {kind:<7} {m.rate:>21.3%} {whole[key].rate:>20.3%}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
