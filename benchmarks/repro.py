"""TRACE against vanilla QAT and QUADS in the same FP4 RL loop (tiny preset,
fixed seeds, the same prompts and the same number of steps for every method):
the train-rollout log-prob |diff| and code mismatch rate of each method's
training path at every step, and the share of R-4bit's mismatch reduction
that R-1bit on the deeper half keeps.

    python benchmarks/repro.py [--steps 4] [--prompts 8] [--group 4] [--new-tokens 24]

The reward is synthetic (the share of even token ids in a response): this
measures alignment, not task accuracy. Prints a markdown table, then one JSON line.
"""

import argparse
import json
import tempfile
from dataclasses import replace

import torch

from tracefp4.components.capture import CaptureConfig
from tracefp4.components.model import build_model
from tracefp4.components.quant import rollout_config
from tracefp4.components.rollout import SamplingParams, TorchEngine
from tracefp4.components.store import open_store
from tracefp4.components.trainer import RoundConfig, TrainConfig, Trainer, rl_round

COMPENSATED_CHANNELS = 8  # QUADS' rollout: the 8 worst of each activation's channels kept exact

RUNS = {  # label: (method, guidance bits, guided layers: "all" or "deeper half")
    "qat": ("qat", 4, "all"),
    "quads": ("quads", 4, "all"),
    "trace, R-4bit all layers": ("trace", 4, "all"),
    "trace, R-1bit deeper half": ("trace", 1, "deeper half"),
}


def run(label: str, args) -> list[dict]:
    method, bits, which = RUNS[label]
    model = build_model("tiny", seed=0)
    layers = model.cfg.sparse_layers
    chosen = tuple(layers) if which == "all" else tuple(layers[len(layers) // 2 :])
    quant = rollout_config("fp4_wa_kv")
    if method == "quads":
        quant = replace(quant, compensated_channels=COMPENSATED_CHANNELS)
    engine = TorchEngine(model, quant, capture=CaptureConfig(max_tokens=4096, inputs=True))
    trainer = Trainer(build_model("tiny", seed=0), TrainConfig(method=method, learning_rate=1e-4, microbatch_size=16), engine)

    def prompts(step: int, n: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(1000 + step)
        return [torch.randint(0, model.cfg.vocab_size, (16,), generator=gen).tolist() for _ in range(n)]

    def reward(trajectory) -> float:
        return sum(t % 2 == 0 for t in trajectory.response) / len(trajectory.response)

    config = RoundConfig(steps=args.steps, prompts_per_step=args.prompts, group_size=args.group, bits=bits,
                         layers=chosen, measure_mismatch=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        return rl_round(engine, trainer, prompts, reward, SamplingParams(max_new_tokens=args.new_tokens), config, open_store(tmp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    histories = {label: run(label, args) for label in RUNS}

    def mean(label, key):
        values = [h[key] for h in histories[label] if h.get(key) is not None]
        return sum(values) / len(values) if values else None

    print(f"Means over {args.steps} RL steps, each step's training path against that step's rollout:\n")
    print("| method | logprob abs diff mean | logprob abs diff max | k3 KL | code mismatch | guidance coverage |")
    print("|---|---|---|---|---|---|")
    for label in RUNS:
        mismatch = mean(label, "code_mismatch")
        shown = "n/a (BF16 activations)" if mismatch is None else f"{mismatch:.4f}"
        print(f"| {label} | {mean(label, 'logprob_abs_diff_mean'):.5f} | {mean(label, 'logprob_abs_diff_max'):.4f} | "
              f"{mean(label, 'k3_kl'):.2e} | {shown} | {mean(label, 'guidance_coverage'):.3f} |")  # fmt: skip
    qat, r4, r1 = (mean(label, "code_mismatch") for label in ("qat", "trace, R-4bit all layers", "trace, R-1bit deeper half"))
    kept = (qat - r1) / (qat - r4)
    print(f"\nR-1bit on the deeper half keeps {kept:.1%} of R-4bit's code-mismatch reduction")
    print(json.dumps({"histories": histories, "r1_share_of_r4_reduction": kept}))


if __name__ == "__main__":
    main()
