"""The pipeline's steps as plain functions over folders and a store: what each
Kubeflow component (and the CLI) calls. A round is rollout -> compaction ->
guided QAT; the policy travels as a Hugging Face checkpoint folder (with the
optimizer state and ``tokenizer.json`` beside it), trajectories as JSON lines,
captures and guidance through the artifact store.
"""

import json
import random
from dataclasses import asdict, replace
from pathlib import Path

import torch

from tracefp4.schemas import RunConfig

from .capture import CaptureConfig
from .checkpoint import load_model
from .guidance import GuidanceLoader, compact, read_manifest, read_step, select_layers, write_step
from .model import build_model
from .quant import rollout_config
from .rl import group_advantages
from .rollout import SamplingParams, TorchEngine, Trajectory
from .store import open_store
from .tasks import Problem, format_example, get_task, split
from .tokenizer import EOS, FILENAME, build_tokenizer, decode, encode, load_tokenizer
from .trainer import TrainConfig, Trainer


def store_prefix(config: RunConfig, kind: str) -> str:
    """Where a run keeps ``kind`` ("capture": full 4-bit captures; "guidance")
    in the store, per run and method, so that parallel branches never meet."""
    return f"{config.name}/{config.method}/{kind}"


_NEWLINE = "\n"


def _dtype(config: RunConfig) -> torch.dtype:
    return getattr(torch, config.model.dtype)


def problems(config: RunConfig) -> tuple[list[Problem], list[Problem]]:
    """The run's train and test problems, every task's split concatenated (seeded)."""
    train, test = [], []
    for t in config.tasks:
        a, b = split(t.name, t.train_size, t.test_size, config.seed, t.difficulty)
        train += a
        test += b
    return train, test


def prepare(config: RunConfig, out: Path) -> Path:
    """The initial policy (a preset with seeded weights, or a checkpoint) with its tokenizer, as a trainer checkpoint."""
    out = Path(out)
    model = build_model(config.model.preset, seed=config.seed) if config.model.preset else load_model(config.model.checkpoint)
    trainer = Trainer(model, _train_config(config), engine=None)
    tokenizer = load_tokenizer(config.model.checkpoint) if config.model.checkpoint else build_tokenizer()
    if tokenizer.get_vocab_size() > model.cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, the model only {model.cfg.vocab_size}")
    trainer.save(out, extra={FILENAME: tokenizer.to_str().encode()})
    return out


def _train_config(config: RunConfig) -> TrainConfig:
    rl = config.rl
    return TrainConfig(
        method=config.method, learning_rate=rl.learning_rate, weight_decay=rl.weight_decay, betas=tuple(rl.adam_betas),
        grad_clip=rl.grad_clip, microbatch_size=rl.microbatch_size, grad_accumulation=rl.grad_accumulation,
        ppo_clip=rl.ppo_clip, tis_cap=rl.tis_cap,
        kl_coef=rl.kl_coef, temperature=config.rollout.temperature or 1.0, compute_dtype=_dtype(config),
    )  # fmt: skip


def _inline(config: RunConfig) -> bool:
    return config.guidance.compaction == "inline"


def _layers(config: RunConfig, available: list[int]) -> tuple[int, ...]:
    spec = config.guidance.layers
    if isinstance(spec, str) and spec.startswith("adaptive"):
        raise ValueError("adaptive layer selection needs measured train-rollout mismatch, which the pipeline does not run yet")
    return select_layers(spec, available)


def _engine(config: RunConfig, policy: Path, capture: bool) -> TorchEngine:
    """The rollout engine; a capturing one keeps everything, or with inline
    compaction only the selected layers' low bits."""
    model = load_model(policy)
    cfg = None
    if capture:
        cfg = CaptureConfig(max_tokens=config.rollout.max_tokens_per_forward)
        if _inline(config):
            layers = _layers(config, list(range(model.cfg.num_layers)))
            cfg = CaptureConfig(bits=config.guidance.bits, layers=layers, max_tokens=config.rollout.max_tokens_per_forward)
    quant = rollout_config(config.rollout.config, config.rollout.fmt)
    return TorchEngine(model, quant, dtype=_dtype(config), capture=cfg, calibration_seed=config.seed)


def _sampling(config: RunConfig, seed: int, tokenizer) -> SamplingParams:
    r = config.rollout
    newline = encode(tokenizer, _NEWLINE)[0]
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                          stop_tokens=(EOS, newline), seed=seed)  # fmt: skip


def rollout(config: RunConfig, policy: Path, round_index: int, out: Path) -> Path:
    """``steps_per_round`` steps' worth of trajectories from the current policy,
    to ``out`` (JSON lines); for trace, the capture goes to the store (step
    ``round_index``): full for offline compaction, already compacted inline."""
    tokenizer = load_tokenizer(policy)
    train, _ = problems(config)
    rng = random.Random(f"{config.seed}/rollout/{round_index}")
    steps = config.rl.steps_per_round
    chosen = [rng.choice(train) for _ in range(steps * config.rollout.prompts_per_step)]
    batch = [p for p in chosen for _ in range(config.rollout.group_size)]
    engine = _engine(config, policy, capture=config.method == "trace")
    prompts = [encode(tokenizer, format_example(p), bos=True) for p in batch]
    per_step = len(prompts) // steps
    trajectories = []
    for s in range(steps):  # one RL step's batch per generate call
        sampling = _sampling(config, config.seed + round_index * steps + s, tokenizer)
        trajectories += engine.generate(prompts[s * per_step : (s + 1) * per_step], sampling)
    if engine.capture is not None:
        write_step(open_store(config.store.uri), engine.drain_capture(), rl_step=round_index, policy_version=round_index,
                   top_k=engine.model.cfg.top_k, prefix=store_prefix(config, "guidance" if _inline(config) else "capture"),
                   trajectories_per_shard=config.guidance.trajectories_per_shard)  # fmt: skip
    out = Path(out)
    with open(out, "w") as f:
        for t, p in zip(trajectories, batch):
            f.write(json.dumps({"trajectory": asdict(t), "problem": asdict(p)}) + "\n")
    return out


def compaction(config: RunConfig, round_index: int) -> dict:
    """Offline compaction of a round's full capture into the guidance training reads; returns its size.
    Methods other than trace capture nothing; inline compaction already wrote the guidance."""
    if config.method != "trace":
        return {"layers": [], "bits": config.guidance.bits, "bytes": 0, "full_bytes": 0}
    store = open_store(config.store.uri)
    if _inline(config):
        manifest = read_manifest(store, round_index, store_prefix(config, "guidance"))
        size = sum(e["bytes"] for e in manifest["shards"])
        return {"layers": manifest["layers"], "bits": config.guidance.bits, "bytes": size, "full_bytes": 0}
    full = read_step(store, round_index, store_prefix(config, "capture"))
    chosen = _layers(config, sorted({layer for layer, _ in full.tables}))
    kept = compact(full, config.guidance.bits, chosen)
    manifest = read_manifest(store, round_index, store_prefix(config, "capture"))
    write_step(store, kept, rl_step=round_index, policy_version=manifest["policy_version"], top_k=_top_k(full),
               prefix=store_prefix(config, "guidance"), trajectories_per_shard=config.guidance.trajectories_per_shard)  # fmt: skip
    return {"layers": list(chosen), "bits": config.guidance.bits, "bytes": kept.nbytes, "full_bytes": full.nbytes}


def _top_k(records) -> int:
    slots = [int(t.slot.max()) + 1 for (_, site), t in records.tables.items() if site == "moe_down_in" and len(t.slot)]
    return max(slots, default=1)


def read_trajectories(path: Path) -> tuple[list[Trajectory], list[Problem]]:
    trajectories, batch = [], []
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        trajectories.append(Trajectory(**record["trajectory"]))
        batch.append(Problem(**record["problem"]))
    return trajectories, batch


def train(config: RunConfig, policy: Path, trajectories_file: Path, round_index: int, out: Path) -> list[dict]:
    """``steps_per_round`` guided QAT steps over the round's trajectories; the new policy goes to ``out``."""
    tokenizer = load_tokenizer(policy)
    trajectories, batch = read_trajectories(trajectories_file)
    engine = _engine(config, policy, capture=False)
    trainer = Trainer(load_model(policy), _train_config(config), engine)
    trainer.resume(policy)
    store = open_store(config.store.uri)
    per_step = config.rollout.prompts_per_step * config.rollout.group_size
    history = []
    for s in range(config.rl.steps_per_round):
        part = slice(s * per_step, (s + 1) * per_step)
        step_trajectories, step_problems = trajectories[part], batch[part]
        rewards = torch.tensor([get_task(p.task).reward(p, decode(tokenizer, t.response))
                                for t, p in zip(step_trajectories, step_problems)])  # fmt: skip
        loader = None
        if config.method == "trace":
            ids = [[t.id for t in mb] for mb in trainer.microbatches(step_trajectories)]
            loader = GuidanceLoader(store, round_index, ids, prefix=store_prefix(config, "guidance"), prefetch=config.guidance.prefetch_microbatches,
                                    allow_rtn_fallback=config.guidance.allow_rtn_fallback)  # fmt: skip
        stats = trainer.train_step(step_trajectories, group_advantages(rewards, config.rollout.group_size), loader)
        stats.pop("reload_seconds")
        history.append({"round": round_index, "step": trainer.step, "reward_mean": rewards.mean().item(),
                        "accuracy": (rewards >= 1).float().mean().item(), **stats})  # fmt: skip
    trainer.save(out, extra={FILENAME: tokenizer.to_str().encode()})
    return history


def evaluate(config: RunConfig, policy: Path) -> list[dict]:
    """pass@1 (greedy) and mean@k accuracy per task under BF16 and each configured FP4 rollout."""
    tokenizer = load_tokenizer(policy)
    _, test = problems(config)
    per_task = -(-config.evaluation.test_prompts // len(config.tasks))  # the same share of every task
    test = [p for t in config.tasks for p in [q for q in test if q.task == t.name][:per_task]]
    k = config.evaluation.samples_per_prompt
    rows = []
    for name in config.evaluation.rollout_configs:
        engine = TorchEngine(load_model(policy), rollout_config(name, config.rollout.fmt), dtype=_dtype(config))
        prompts = [encode(tokenizer, format_example(p), bos=True) for p in test]
        greedy = engine.generate(prompts, replace(_sampling(config, config.seed, tokenizer), temperature=0.0))
        sampled = engine.generate([q for q in prompts for _ in range(k)], _sampling(config, config.seed + 1, tokenizer))
        for task in sorted({p.task for p in test}):
            idx = [i for i, p in enumerate(test) if p.task == task]
            score = lambda t, p: get_task(p.task).reward(p, decode(tokenizer, t.response))  # noqa: E731
            pass1 = sum(score(greedy[i], test[i]) for i in idx) / len(idx)
            mean_k = sum(score(sampled[i * k + j], test[i]) for i in idx for j in range(k)) / (len(idx) * k)
            rows.append({"method": config.method, "rollout": name, "task": task, "pass@1": pass1, f"mean@{k}": mean_k,
                         "prompts": len(idx)})  # fmt: skip
    return rows

