"""Evaluation of a run's final policy (and of where RL started): accuracy per
task under BF16 and each configured FP4 rollout, throughput, the train-rollout
discrepancy of the method's own training path, the PTQ baselines of a bf16
run, and the size and fidelity of guidance by R-k bits and layers
(docs/evaluation.md). One JSON object, which the report reads. Everything
(policies, PTQ copies, engines, the trainer) computes on ``resources.device``.
"""

import contextlib
import copy
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from tracefp4.schemas import RunConfig

from . import steps
from .capture import CaptureConfig
from .checkpoint import load_model
from .choices import scored_under
from .device import hardware
from .guidance import GuidanceLoader, compact, compaction_figures, select_layers, write_step
from .mismatch import teacher_force
from .ptq import apply_ptq
from .quant_config import QuantConfig
from .rollout import TorchEngine
from .stats import accuracy_row
from .store import LocalStore
from .tasks import Problem, reward_of, solved
from .tokenizer import load_tokenizer
from .trainer import Trainer


def evaluate(config: RunConfig, policy: Path, initial: Path | None = None) -> dict:
    """The final policy under BF16 and each configured FP4 rollout: accuracy
    (pass@1 greedy, mean@k sampled) per task, throughput, and for FP4 configs
    the train-rollout discrepancy of the method's training path; PTQ baselines
    of a bf16 run; the size and fidelity of guidance by R-k bits and layers.
    With the ``initial`` policy, its accuracy too (where RL started)."""
    device = steps.step_device(config)
    tokenizer = load_tokenizer(policy)
    train, test = steps.problems(config)
    test = [p for t, n in zip(config.tasks, config.test_shares) for p in [q for q in test if q.task == t.name][:n]]
    prompts = steps.encode_prompts(config, tokenizer, test)
    model = load_model(policy, device=device)
    out = {
        "method": config.method,
        "hardware": hardware(device),  # what the throughput and discrepancy figures were computed on
        "accuracy": [],
        "throughput": [],
        "discrepancy": [],
        "guidance_sensitivity": [],
    }
    analysed = [prompts[i] for i in across_tasks(test, config.evaluation.discrepancy_prompts)]

    def score(policy_label: str, weights, rollout: str, quant, take: bool = False) -> dict:
        """Accuracy rows of one policy under one rollout config; returns the sampled pass's throughput.
        With ``take`` the engine takes ``weights`` over (no copy): the caller does not use them again."""
        engine = TorchEngine(weights, quant, device=device, take=take, **steps.engine_options(config))
        rows, speed = _accuracy(config, engine, tokenizer, test, prompts)
        out["accuracy"] += [{"method": config.method, "policy": policy_label, "rollout": rollout, **r} for r in rows]
        return speed

    quants = {name: steps.rollout_quant(config, name) for name in config.evaluation.rollout_configs}
    for name, quant in quants.items():
        out["throughput"].append({"rollout": name, **score("trained", model, name, quant)})
        if initial is not None:  # loaded for each config and handed over: not held beside the policy throughout
            score("initial", load_model(initial, device=device), name, quant, take=True)
        if name == "bf16":
            continue
        if analysed:
            analysis = _discrepancy(
                config, model, name, quant, tokenizer, analysed, sensitivity=not out["guidance_sensitivity"]
            )
            out["discrepancy"].append(analysis.pop("discrepancy"))
            out["guidance_sensitivity"] = out["guidance_sensitivity"] or analysis["guidance_sensitivity"]
    if config.method == "bf16":
        # calibrated on as many training prompts, of each task in turn, so that the test prompts stay unseen
        calibrating = [train[i] for i in sorted(across_tasks(train, len(test)))]
        calibration = steps.encode_prompts(config, tokenizer, calibrating)
        # PTQ weights as they are, activations and KV as each config quantizes them
        scored = {name: replace(quant, weights=None) for name, quant in quants.items() if scored_under(quant)}
        for label in config.evaluation.ptq_baselines:
            # one baseline at a time, each a copy of the policy: at the paper's scale (a policy of ~60 GB) the
            # three beside it would not fit on one GPU; the last config's engine takes it over
            ptq_model = _ptq_model(model, label, calibration)
            for i, (name, quant) in enumerate(scored.items()):
                score(f"ptq:{label}", ptq_model, name, quant, take=i == len(scored) - 1)
            del ptq_model
    return out


def across_tasks(problems: list[Problem], n: int) -> list[int]:
    """The indices of ``n`` of ``problems`` (listed task by task) taking each task in
    turn, so that an analysis of the first few covers every task, not only the first."""
    seen: Counter[str] = Counter()
    turn = []
    for p in problems:
        turn.append(seen[p.task])
        seen[p.task] += 1
    return sorted(range(len(problems)), key=lambda i: (turn[i], i))[:n]


def _accuracy(
    config: RunConfig, engine: TorchEngine, tokenizer, test: list[Problem], prompts
) -> tuple[list[dict], dict]:
    """pass@1 and mean@k rows per task, and the sampled pass's throughput.
    That pass is timed, not the greedy one, because it runs second: one-time
    costs of a new engine (Triton compilation, lazy initialization) fall on
    the greedy pass, and the figure is the rollout's steady speed."""
    k = config.evaluation.samples_per_prompt
    greedy = engine.generate(prompts, replace(steps.sampling(config, tokenizer, "evaluate", "greedy"), temperature=0.0))
    start = time.perf_counter()
    sampled = engine.generate(
        [q for q in prompts for _ in range(k)], steps.sampling(config, tokenizer, "evaluate", "sampled")
    )
    speed = steps.throughput(sampled, time.perf_counter() - start)
    rows = []
    for task in sorted({p.task for p in test}):
        idx = [i for i, p in enumerate(test) if p.task == task]
        reward = lambda t, p: float(solved(reward_of(p, tokenizer.response_text(t.response), t.finished)))  # noqa: E731
        greedy_scores = [reward(greedy[i], test[i]) for i in idx]
        sampled_scores = [sum(reward(sampled[i * k + j], test[i]) for j in range(k)) / k for i in idx]
        rows.append(accuracy_row(task, [test[i].prompt for i in idx], greedy_scores, sampled_scores, k))
    return rows, speed


def _ptq_model(model, method: str, prompts: list[list[int]]):
    """A copy of the policy with the PTQ baseline ``method`` applied to its routed experts (h_scale's Hessian
    diagonal from the training ``prompts``, whole)."""
    out = copy.deepcopy(model)
    apply_ptq(out, method, prompts)
    return out


SENSITIVITY_BITS = (1, 2, 3, 4)


def _discrepancy(
    config: RunConfig, model, name: str, quant: QuantConfig, tokenizer, prompts, sensitivity: bool
) -> dict:
    """Rollouts under ``name`` (``quant``) with a full capture, then the method's training path
    over the same tokens (guided for trace, by guidance compacted and coded as
    configured: syndrome-coded guidance at a first step's rates, decoded in the
    training forward): mismatch and alignment; with ``sensitivity``, the
    guidance's size and fidelity for R-1..R-4 over the deepest 1, half and all layers."""
    k, limit = config.evaluation.samples_per_prompt, config.rollout.max_tokens_per_forward
    requests = [q for q in prompts for _ in range(k)]
    # the capture buffers hold the largest forward of these few requests, a prefill of them all (fewer at once
    # only where max_tokens_per_forward was already less), not max_tokens_per_forward token rows: they keep the
    # inputs, which the relative excess MSE compares (at Qwen3.5-35B-A3B ~1 MB per token, in two buffers)
    capture = CaptureConfig(max_tokens=min(limit, len(requests) * max(map(len, requests))), inputs=True)
    engine = TorchEngine(
        model,
        quant,
        device=next(model.parameters()).device,
        capture=capture,
        **steps.engine_options(config),
    )
    trajectories = engine.generate(requests, steps.sampling(config, tokenizer, "evaluate", "discrepancy"))
    records = engine.drain_capture()
    quant, global_scales, top_k = engine.quant, engine.global_scales, engine.model.cfg.top_k
    # teacher forcing (in forwards of max_tokens_per_forward rows, as ever) before the trainer is built: the engine
    # and its FP4 copy of the policy go first, so the policy has one copy beside it at a time, not two
    training = teacher_force(engine, trajectories, keep_inputs=True, max_tokens=limit) if sensitivity else None
    del engine
    # on a copy: a trainer converts its model in place to the training precision (float32 weights rounded to
    # bf16 under train.precision bf16), and the later rollout configs score this policy
    trainer = Trainer(copy.deepcopy(model), steps.train_config(config), quant, global_scales)
    available = sorted({layer for layer, _ in records.tables})
    loader = None
    with tempfile.TemporaryDirectory() as folder:
        if config.method == "trace":
            store = LocalStore(folder)
            if config.guidance.codec == "syndrome":
                guidance, _ = steps.syndrome_coded(config, records, None)
            else:
                guidance = compact(records, config.guidance.bits, select_layers(config.guidance.layers, available))
            write_step(
                store,
                guidance,
                rl_step=0,
                policy_version=0,
                top_k=top_k,
            )
            loader = GuidanceLoader(store, 0, [[t.id for t in mb] for mb in trainer.microbatches(trajectories)])
        with contextlib.nullcontext() if loader is None else loader:
            stats = trainer.measure(trajectories, loader, records)
    # the response tokens the log-prob figures are over: the report says how many a figure of 0 covers
    tokens = sum(len(t.response) for t in trajectories)
    discrepancy = {"rollout": name, "trajectories": len(trajectories), "response_tokens": tokens, **stats}
    rows = []
    if sensitivity:
        for bits in SENSITIVITY_BITS:
            for count in sorted({1, max(1, len(available) // 2), len(available)}):
                chosen = select_layers(count, available)
                figures = compaction_figures(records, bits, chosen, training)
                rows.append({"bits": bits, "layers": count, "layer_indices": list(chosen), **figures})
    return {"discrepancy": discrepancy, "guidance_sensitivity": rows}
