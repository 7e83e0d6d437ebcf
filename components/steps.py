"""The pipeline's steps as plain functions over folders and a store: what each
Kubeflow component (and the CLI) calls. A round is rollout -> compaction ->
guided QAT; the policy travels as a Hugging Face checkpoint folder (with the
optimizer state and ``tokenizer.json`` beside it), trajectories as JSON lines,
captures and guidance through the artifact store.
"""

import copy
import json
import random
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from tracefp4.schemas import RunConfig

from . import bootstrap as sft
from .capture import CaptureConfig, CaptureRecords
from .checkpoint import load_model
from .guidance import GuidanceLoader, compact, compaction_report, read_manifest, read_step, select_layers, write_step
from .mismatch import teacher_force
from .model import build_model
from .ptq import apply_ptq
from .quant import rollout_config
from .rl import group_advantages
from .rollout import SamplingParams, TorchEngine, Trajectory
from .store import LocalStore, open_store
from .tasks import Problem, format_example, get_task, split
from .tokenizer import EOS, FILENAME, build_tokenizer, decode, encode, load_tokenizer
from .trainer import SCORE_CENTERING_TOPK, TrainConfig, Trainer


# A round's rollout and compaction figures, carried into each of its history rows.
ROUND_KEYS = ("rollout_seconds", "rollout_tokens", "rollout_tokens_per_second", "capture_overhead_ratio", "offload_seconds",
              "upload_seconds", "guidance_bytes", "capture_bytes", "guidance_bits_per_element", "compaction_ratio",
              "compaction_fidelity", "compaction_seconds")  # fmt: skip


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


def prepare(config: RunConfig, out: Path) -> dict:
    """The initial policy (a preset with seeded weights, or a checkpoint) with its
    tokenizer, as a trainer checkpoint; bootstrapped by SFT on the tasks when
    configured. Returns the bootstrap's figures (empty without one)."""
    out = Path(out)
    model = build_model(config.model.preset, seed=config.seed) if config.model.preset else load_model(config.model.checkpoint)
    tokenizer = load_tokenizer(config.model.checkpoint) if config.model.checkpoint else build_tokenizer()
    if tokenizer.get_vocab_size() > model.cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, the model only {model.cfg.vocab_size}")
    stats = run_bootstrap(config, model, tokenizer) if config.bootstrap.enabled else {}
    Trainer(model, _train_config(config), engine=None).save(out, extra={FILENAME: tokenizer.to_str().encode()})
    return stats


def run_bootstrap(config: RunConfig, model, tokenizer) -> dict:
    """Bootstrap SFT of ``model`` (in place) on the run's train split, scored greedily on its test split."""
    b = config.bootstrap
    train, test = problems(config)
    history = sft.bootstrap(model, tokenizer, train, test, sft.BootstrapConfig(
        steps=b.steps, batch_size=b.batch_size, learning_rate=b.learning_rate, warmup=b.warmup, seed=config.seed,
        max_len=config.model.max_seq_len, target_accuracy=b.target_accuracy, eval_every=b.eval_every,
        eval_prompts=b.eval_prompts, max_new_tokens=config.rollout.max_new_tokens,
    ))  # fmt: skip
    return {"bootstrap_accuracy": history["accuracy"], "bootstrap_steps": history["steps"],
            "bootstrap_loss": history["loss"][-1], "bootstrap_seconds": history["seconds"]}  # fmt: skip


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
    """The run's sampling; tis_sc's score centering also needs the sampler's top-k tokens."""
    r = config.rollout
    newline = encode(tokenizer, _NEWLINE)[0]
    topk = SCORE_CENTERING_TOPK if config.method == "tis_sc" else 0
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                          stop_tokens=(EOS, newline), seed=seed, record_topk=topk)  # fmt: skip


def rollout(config: RunConfig, policy: Path, round_index: int, out: Path) -> dict:
    """``steps_per_round`` steps' worth of trajectories from the current policy,
    to ``out`` (JSON lines); for trace, the capture goes to the store (step
    ``round_index``): full for offline compaction, already compacted inline.
    Returns the round's rollout figures (time, tokens, capture overhead, upload)."""
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
    start = time.perf_counter()
    for s in range(steps):  # one RL step's batch per generate call
        sampling = _sampling(config, config.seed + round_index * steps + s, tokenizer)
        trajectories += engine.generate(prompts[s * per_step : (s + 1) * per_step], sampling)
    records = engine.drain_capture() if engine.capture is not None else None  # the drain is part of the rollout
    stats = {f"rollout_{key}": value for key, value in _throughput(trajectories, time.perf_counter() - start).items()}
    stats.update(capture_overhead_ratio=None, offload_seconds=None, upload_seconds=None)
    if records is not None:
        seconds = engine.capture.seconds
        stats.update(capture_overhead_ratio=seconds["capture"] / stats["rollout_seconds"], offload_seconds=seconds["offload"])
        start = time.perf_counter()
        write_step(open_store(config.store.uri), records, rl_step=round_index, policy_version=round_index,
                   top_k=engine.model.cfg.top_k, prefix=store_prefix(config, "guidance" if _inline(config) else "capture"),
                   trajectories_per_shard=config.guidance.trajectories_per_shard)  # fmt: skip
        stats["upload_seconds"] = time.perf_counter() - start
    write_trajectories(Path(out), trajectories, batch)
    return stats


def _throughput(trajectories: list[Trajectory], seconds: float) -> dict:
    tokens = sum(len(t.response) for t in trajectories)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}


def write_trajectories(path: Path, trajectories: list[Trajectory], batch: list[Problem]) -> Path:
    with open(path, "w") as f:
        for t, p in zip(trajectories, batch):
            f.write(json.dumps({"trajectory": asdict(t), "problem": asdict(p)}) + "\n")
    return path


def compaction(config: RunConfig, policy: Path, trajectories_file: Path, round_index: int) -> dict:
    """The guidance training reads for a round, and its size: offline, compacted
    from the round's full capture (with the fidelity of the compaction, measured
    on the first microbatch's trajectories); inline, the guidance the rollout
    wrote, read back and verified. Methods other than trace capture nothing."""
    stats = dict.fromkeys(("guidance_bytes", "capture_bytes", "guidance_bits_per_element", "compaction_ratio",
                           "compaction_fidelity", "compaction_seconds"))  # fmt: skip
    stats.update(layers=[], bits=config.guidance.bits)
    if config.method != "trace":
        return stats
    start = time.perf_counter()
    store = open_store(config.store.uri)
    if _inline(config):
        kept = read_step(store, round_index, store_prefix(config, "guidance"))
    else:
        full = read_step(store, round_index, store_prefix(config, "capture"))
        kept = compact(full, config.guidance.bits, _layers(config, sorted({layer for layer, _ in full.tables})))
        manifest = read_manifest(store, round_index, store_prefix(config, "capture"))
        write_step(store, kept, rl_step=round_index, policy_version=manifest["policy_version"], top_k=_top_k(full),
                   prefix=store_prefix(config, "guidance"), trajectories_per_shard=config.guidance.trajectories_per_shard)  # fmt: skip
        sample, _ = read_trajectories(trajectories_file)
        sample = sample[: config.rl.microbatch_size]
        training = teacher_force(_engine(config, policy, capture=False), sample, keep_inputs=True)
        ids = torch.tensor([t.id for t in sample])
        report = compaction_report(_restrict(full, ids), _restrict(kept, ids), training)
        stats.update(capture_bytes=full.nbytes, compaction_ratio=kept.nbytes / full.nbytes, compaction_fidelity=report.total["fidelity"])
    elements = sum(t.codes.shape[0] * t.width for t in kept.tables.values())
    stats.update(layers=sorted({layer for layer, _ in kept.tables}), guidance_bytes=kept.nbytes,
                 guidance_bits_per_element=8 * kept.nbytes / elements if elements else None,
                 compaction_seconds=time.perf_counter() - start)  # fmt: skip
    return stats


def _restrict(records: CaptureRecords, trajectories: torch.Tensor) -> CaptureRecords:
    return CaptureRecords({k: t.select(torch.isin(t.traj, trajectories)) for k, t in records.tables.items()})


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


def train(config: RunConfig, policy: Path, trajectories_file: Path, round_index: int, out: Path,
          round_stats: dict | None = None) -> list[dict]:  # fmt: skip
    """``steps_per_round`` guided QAT steps over the round's trajectories; the new
    policy goes to ``out``. One history row per step; the round's rollout and
    compaction figures (``round_stats``) are repeated in each."""
    tokenizer = load_tokenizer(policy)
    trajectories, batch = read_trajectories(trajectories_file)
    engine = _engine(config, policy, capture=False)
    trainer = Trainer(load_model(policy), _train_config(config), engine)
    trainer.resume(policy)
    store = open_store(config.store.uri)
    per_step = config.rollout.prompts_per_step * config.rollout.group_size
    history = []
    for s in range(config.rl.steps_per_round):
        start = time.perf_counter()
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
        stats["train_seconds"] = time.perf_counter() - start - stats["reload_seconds"]
        history.append({"method": config.method, "round": round_index, "step": trainer.step, "reward_mean": rewards.mean().item(),
                        "accuracy": (rewards >= 1).float().mean().item(), **stats,
                        **{key: (round_stats or {}).get(key) for key in ROUND_KEYS}})  # fmt: skip
    trainer.save(out, extra={FILENAME: tokenizer.to_str().encode()})
    return history


def evaluate(config: RunConfig, policy: Path, initial: Path | None = None) -> dict:
    """The final policy under BF16 and each configured FP4 rollout: accuracy
    (pass@1 greedy, mean@k sampled) per task, throughput, and for FP4 configs
    the train-rollout discrepancy of the method's training path; PTQ baselines
    of a bf16 run; the size and fidelity of guidance by R-k bits and layers.
    With the ``initial`` policy, its accuracy too (where RL started)."""
    tokenizer = load_tokenizer(policy)
    _, test = problems(config)
    per_task = -(-config.evaluation.test_prompts // len(config.tasks))  # the same share of every task
    test = [p for t in config.tasks for p in [q for q in test if q.task == t.name][:per_task]]
    prompts = [encode(tokenizer, format_example(p), bos=True) for p in test]
    model = load_model(policy)
    ptq = _ptq_models(config, model, prompts) if config.method == "bf16" else {}
    out = {"method": config.method, "accuracy": [], "throughput": [], "discrepancy": [], "guidance_sensitivity": []}
    start_model = load_model(initial) if initial is not None else None
    n = min(config.evaluation.discrepancy_prompts, len(test))

    def score(policy_label: str, weights, rollout: str, quant) -> dict:
        """Accuracy rows of one policy under one rollout config; returns the greedy pass's throughput."""
        rows, speed = _accuracy(config, TorchEngine(weights, quant, dtype=_dtype(config)), tokenizer, test, prompts)
        out["accuracy"] += [{"method": config.method, "policy": policy_label, "rollout": rollout, **r} for r in rows]
        return speed

    for name in config.evaluation.rollout_configs:
        quant = rollout_config(name, config.rollout.fmt)
        out["throughput"].append({"rollout": name, **score("trained", model, name, quant)})
        if start_model is not None:
            score("initial", start_model, name, quant)
        if name == "bf16":
            continue
        for label, ptq_model in ptq.items():  # PTQ weights as they are; activations and KV as the config quantizes them
            score(f"ptq:{label}", ptq_model, name, replace(quant, weights=None))
        if n:
            analysis = _discrepancy(config, model, name, tokenizer, prompts[:n], sensitivity=not out["guidance_sensitivity"])
            out["discrepancy"].append(analysis.pop("discrepancy"))
            out["guidance_sensitivity"] = out["guidance_sensitivity"] or analysis["guidance_sensitivity"]
    return out


def _accuracy(config: RunConfig, engine: TorchEngine, tokenizer, test: list[Problem], prompts) -> tuple[list[dict], dict]:
    """pass@1 and mean@k rows per task, and the greedy pass's throughput."""
    k = config.evaluation.samples_per_prompt
    start = time.perf_counter()
    greedy = engine.generate(prompts, replace(_sampling(config, config.seed, tokenizer), temperature=0.0))
    speed = _throughput(greedy, time.perf_counter() - start)
    sampled = engine.generate([q for q in prompts for _ in range(k)], _sampling(config, config.seed + 1, tokenizer))
    rows = []
    for task in sorted({p.task for p in test}):
        idx = [i for i, p in enumerate(test) if p.task == task]
        score = lambda t, p: get_task(p.task).reward(p, decode(tokenizer, t.response))  # noqa: E731
        pass1 = sum(score(greedy[i], test[i]) for i in idx) / len(idx)
        mean_k = sum(score(sampled[i * k + j], test[i]) for i in idx for j in range(k)) / (len(idx) * k)
        rows.append({"task": task, "pass@1": pass1, "mean@k": mean_k, "k": k, "prompts": len(idx)})
    return rows, speed


def _ptq_models(config: RunConfig, model, prompts: list[list[int]]) -> dict:
    """The policy with each configured PTQ baseline applied to its routed experts."""
    width = min(len(p) for p in prompts)
    calibration = torch.tensor([p[:width] for p in prompts])  # h_scale's Hessian diagonal, from the test prompts
    out = {}
    for method in config.evaluation.ptq_baselines:
        out[method] = copy.deepcopy(model)
        apply_ptq(out[method], method, calibration)
    return out


SENSITIVITY_BITS = (1, 2, 3, 4)


def _discrepancy(config: RunConfig, model, name: str, tokenizer, prompts, sensitivity: bool) -> dict:
    """Rollouts under ``name`` with a full capture, then the method's training path
    over the same tokens (guided for trace, by guidance compacted as configured):
    mismatch and alignment; with ``sensitivity``, the guidance's size and
    fidelity for R-1..R-4 over the deepest 1, half and all layers."""
    engine = TorchEngine(model, rollout_config(name, config.rollout.fmt), dtype=_dtype(config),
                         capture=CaptureConfig(max_tokens=config.rollout.max_tokens_per_forward, inputs=True), calibration_seed=config.seed)  # fmt: skip
    k = config.evaluation.samples_per_prompt
    trajectories = engine.generate([q for q in prompts for _ in range(k)], _sampling(config, config.seed + 2, tokenizer))
    records = engine.drain_capture()
    trainer = Trainer(model, _train_config(config), engine)
    available = sorted({layer for layer, _ in records.tables})
    loader = None
    with tempfile.TemporaryDirectory() as folder:
        if config.method == "trace":
            store = LocalStore(folder)
            write_step(store, compact(records, config.guidance.bits, _layers(config, available)), rl_step=0, policy_version=0,
                       top_k=engine.model.cfg.top_k)  # fmt: skip
            loader = GuidanceLoader(store, 0, [[t.id for t in mb] for mb in trainer.microbatches(trajectories)])
        stats = trainer.measure(trajectories, loader, records)
    discrepancy = {"rollout": name, "trajectories": len(trajectories), **stats}
    rows = []
    if sensitivity:
        training = teacher_force(engine, trajectories, keep_inputs=True)
        for bits in SENSITIVITY_BITS:
            for count in sorted({1, max(1, len(available) // 2), len(available)}):
                chosen = select_layers(count, available)
                total = compaction_report(records, compact(records, bits, chosen), training).total
                rows.append({"bits": bits, "layers": count, "layer_indices": list(chosen),
                             **{key: total[key] for key in ("bits_per_element", "ratio_to_full", "fidelity")}})  # fmt: skip
    return {"discrepancy": discrepancy, "guidance_sensitivity": rows}
