"""TRACE against vanilla QAT and QUADS on the same FP4 rollouts (tiny preset,
fixed seeds): the train-rollout log-prob |diff| and code mismatch rate of each
method's training path, and the share of R-4bit's mismatch reduction that
R-1bit on the deeper half keeps.

    python benchmarks/repro.py [--prompts 16] [--new-tokens 24]

Measured at the rollout's own weights (before any RL update: the RL loop is
not built yet). Prints a markdown table, then one JSON line.
"""

import argparse
import json
import tempfile

import torch

from tracefp4.components.capture import Capture, CaptureConfig, TokenMap
from tracefp4.components.guidance import GuidanceLoader, compact, select_layers, write_step
from tracefp4.components.mismatch import compare
from tracefp4.components.model import build_model
from tracefp4.components.qat import TrainingSites
from tracefp4.components.quant import rollout_config
from tracefp4.components.rl import SequenceBatch, alignment_metrics, token_logprobs
from tracefp4.components.rollout import SamplingParams, TorchEngine
from tracefp4.components.store import open_store


def measure(engine, trajectories, rollout_codes, method: str, guidance) -> dict:
    """One training pass over the rollouts: alignment metrics and code mismatch against the rollout's codes."""
    batch = SequenceBatch.of(trajectories)
    s = batch.tokens.shape[1]
    capture = Capture(engine.model.cfg, engine.quant, CaptureConfig(max_tokens=batch.tokens.numel()), engine.global_scales,
                      kv_from_forward=True)  # fmt: skip
    traj = torch.tensor(batch.trajectories)[:, None].expand(-1, s)
    capture.begin(TokenMap(torch.where(batch.positions < batch.lengths[:, None] - 1, traj, -1).reshape(-1), batch.positions.reshape(-1)))
    sites = TrainingSites(engine.quant, method, engine.global_scales, trajectories=batch.trajectories, seq_len=s,
                          guidance=guidance, recorder=capture)  # fmt: skip
    with torch.no_grad():
        logprobs = token_logprobs(engine.model, batch, sites)
    capture.end()
    report = compare(rollout_codes, capture.drain())
    elements = sum(m.elements for m in report.values())
    figures = alignment_metrics(logprobs, batch.rollout_logprobs, batch.response)
    figures["code_mismatch"] = sum(m.mismatched for m in report.values()) / elements if elements else None
    figures["guidance_coverage"] = sites.coverage.rate
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    engine = TorchEngine(build_model("tiny", seed=0), rollout_config("fp4_wa_kv"), capture=CaptureConfig(max_tokens=4096))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, engine.model.cfg.vocab_size, (16,), generator=gen).tolist() for _ in range(args.prompts)]
    trajectories = engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, seed=0))
    full = engine.drain_capture()
    ids = [t.id for t in trajectories]
    layers = sorted({layer for layer, _ in full.tables})

    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(tmp)
        guidance = {}
        for label, bits, spec in [("R-4bit all layers", 4, "all"), ("R-1bit deeper half", 1, len(layers) // 2)]:
            step = len(guidance)
            write_step(store, compact(full, bits, select_layers(spec, layers)), rl_step=step, policy_version=0, top_k=engine.model.cfg.top_k)
            (guidance[label],) = GuidanceLoader(store, step, [ids])
        rows = {
            "qat": measure(engine, trajectories, full, "qat", None),
            "quads": measure(engine, trajectories, full, "quads", None),
            **{f"trace, {label}": measure(engine, trajectories, full, "trace", g) for label, g in guidance.items()},
        }
    qat, r4, r1 = rows["qat"], rows["trace, R-4bit all layers"], rows["trace, R-1bit deeper half"]
    kept = (qat["code_mismatch"] - r1["code_mismatch"]) / (qat["code_mismatch"] - r4["code_mismatch"])

    print("| method | logprob abs diff mean | max | k3 KL | code mismatch | guidance coverage |")
    print("|---|---|---|---|---|---|")
    for name, f in rows.items():
        mismatch = "n/a (BF16 activations)" if name == "quads" else f"{f['code_mismatch']:.4f}"
        print(f"| {name} | {f['logprob_abs_diff_mean']:.5f} | {f['logprob_abs_diff_max']:.4f} | {f['k3_kl']:.2e} | {mismatch} | {f['guidance_coverage']:.3f} |")
    print(f"\nR-1bit on the deeper half keeps {kept:.1%} of R-4bit's code-mismatch reduction")
    print(json.dumps({"methods": rows, "r1_share_of_r4_reduction": kept}))


if __name__ == "__main__":
    main()
