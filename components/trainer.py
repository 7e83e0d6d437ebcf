"""The RL loop of TRACE, after slime's ``train.py``: per step, rollout ->
capture and compaction -> guidance store -> guided QAT -> weight sync.

``Trainer`` holds the float32 master weights and AdamW, runs the training
path in the compute dtype (BF16 autocast) with the method's fake quantization,
accumulates gradients over microbatches (guidance reloaded per microbatch),
and saves checkpoints in the Hugging Face layout, atomically, with the
optimizer state beside them so that a run resumes. ``rl_round`` drives K steps.
"""

import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from .capture import Capture, CaptureConfig, CaptureRecords, TokenMap
from .checkpoint import load_model, save_model
from .guidance import GuidanceLoader, compact, write_step
from .mismatch import MismatchTally, compare
from .model import Transformer
from .qat import TrainingSites
from .rl import SequenceBatch, alignment_metrics, group_advantages, grpo_loss, score_centering, token_logprobs
from .rollout import SamplingParams, TorchEngine, Trajectory

OPTIMIZER_FILE = "optimizer.safetensors"
SCORE_CENTERING_TOPK = 8  # sampler tokens score centering looks at
STATE_FILE = "trainer_state.json"


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of the guided QAT step (GRPO with truncated IS)."""

    method: str = "trace"
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    microbatch_size: int = 8
    grad_accumulation: int = 0  # microbatches per optimizer step; 0: one optimizer step per RL step
    ppo_clip: float = 0.2
    tis_cap: float = 2.0
    kl_coef: float = 0.0  # > 0: penalize the k3 KL to the initial policy (the reference)
    temperature: float = 1.0
    compute_dtype: torch.dtype = torch.bfloat16


class Trainer:
    def __init__(self, model: Transformer, config: TrainConfig, engine: TorchEngine | None):
        self.model = model.float().train()  # float32 master weights
        self.config, self.engine = config, engine
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.learning_rate, betas=config.betas, weight_decay=config.weight_decay
        )
        self.step = 0
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False) if config.kl_coef > 0 else None

    def microbatches(self, trajectories: list[Trajectory]) -> list[list[Trajectory]]:
        n = self.config.microbatch_size
        return [trajectories[i : i + n] for i in range(0, len(trajectories), n)]

    def train_step(
        self, trajectories: list[Trajectory], advantages: torch.Tensor, loader: GuidanceLoader | None,
        rollout_records: CaptureRecords | None = None,
    ) -> dict:  # fmt: skip
        """One RL step over ``trajectories`` (an optimizer step every ``grad_accumulation``
        microbatches, or one for all); guidance comes microbatch by
        microbatch from ``loader``. With the rollout's full capture, the training
        path's codes are compared with it (per-layer mismatch, excess MSE)."""
        cfg = self.config
        parts = self.microbatches(trajectories)
        batches = [SequenceBatch.of(mb) for mb in parts]
        # optimizer steps over groups of grad_accumulation microbatches (0: the whole RL step)
        group = cfg.grad_accumulation or len(batches)
        group_tokens = [sum(int(b.response.sum()) for b in batches[i : i + group]) for i in range(0, len(batches), group)]
        total_tokens = sum(group_tokens)
        guidance = iter(loader) if loader is not None else iter([None] * len(batches))
        adv = dict(zip((t.id for t in trajectories), advantages.tolist()))
        self.optimizer.zero_grad(set_to_none=True)
        stats, alignment, guided, captured, reload_s = {}, [], 0, 0, 0.0
        tally = MismatchTally()
        grad_norms = []
        for index, batch in enumerate(batches):
            start = time.perf_counter()
            mb_guidance = next(guidance)
            reload_s += time.perf_counter() - start
            recorder = self._recorder(batch, rollout_records) if rollout_records is not None else None
            sites, (logprobs, every) = self._forward(batch, mb_guidance, recorder, full=True)
            mb_adv = torch.tensor([adv[t] for t in batch.trajectories])
            loss, loss_stats = grpo_loss(
                logprobs, logprobs.detach(), batch.rollout_logprobs, mb_adv, batch.response, clip=cfg.ppo_clip, tis_cap=cfg.tis_cap
            )
            if cfg.method == "tis_sc":
                loss = loss + (mb_adv[:, None] * score_centering(every, batch, cfg.tis_cap))[batch.response].mean()
            if self.reference is not None:
                with torch.no_grad(), torch.autocast(batch.tokens.device.type, dtype=cfg.compute_dtype, enabled=cfg.compute_dtype != torch.float32):
                    ref = token_logprobs(self.reference, batch, sites, cfg.temperature)
                log_ratio = (ref - logprobs)[batch.response].clamp(-10, 10)
                kl = (log_ratio.exp() - log_ratio - 1).mean()  # k3 estimate of KL(policy || reference)
                loss = loss + cfg.kl_coef * kl
                loss_stats["kl_to_reference"] = kl.item()
            tokens = int(batch.response.sum())
            (loss * tokens / group_tokens[index // group]).backward()
            weight = tokens / total_tokens
            if recorder is not None:
                recorder.end()
                tally.add(compare(rollout_records, recorder.drain()))
            for k, v in {"loss": loss.item(), **loss_stats}.items():
                stats[k] = stats.get(k, 0.0) + v * weight
            alignment.append((logprobs.detach(), batch))
            guided += sum(sites.coverage.guided.values())
            captured += sum(sites.coverage.total.values())
            if (index + 1) % group == 0 or index + 1 == len(batches):
                grad_norms.append(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip).item())
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        stats["grad_norm"] = max(grad_norms)
        stats["optimizer_steps"] = len(grad_norms)
        self.step += 1
        train_lp = torch.cat([lp[b.response] for lp, b in alignment])
        rollout_lp = torch.cat([b.rollout_logprobs[b.response] for _, b in alignment])
        stats.update(alignment_metrics(train_lp, rollout_lp, torch.ones_like(train_lp, dtype=torch.bool)))
        stats["guidance_coverage"] = guided / captured if captured else 0.0
        stats["reload_seconds"] = reload_s
        if rollout_records is not None:
            stats.update(tally.summary())
        return stats

    def _forward(self, batch: SequenceBatch, guidance, recorder: Capture | None, full: bool = False):
        """The training path's log-probs of one microbatch (the method's fake quantization, guided where guidance is)."""
        cfg = self.config
        sites = TrainingSites(self.engine.quant, cfg.method, self.engine.global_scales, trajectories=batch.trajectories,
                              seq_len=batch.tokens.shape[1], guidance=guidance, compute_dtype=cfg.compute_dtype,
                              recorder=recorder)  # fmt: skip
        with torch.autocast(batch.tokens.device.type, dtype=cfg.compute_dtype, enabled=cfg.compute_dtype != torch.float32):
            return sites, token_logprobs(self.model, batch, sites, cfg.temperature, full=full)

    @torch.no_grad()
    def measure(self, trajectories: list[Trajectory], loader: GuidanceLoader | None, rollout_records: CaptureRecords) -> dict:
        """The train-rollout discrepancy of the training path as it stands, without
        an update: log-prob alignment, and against the rollout's full capture the
        per-layer code mismatch, relative excess MSE and codeword-difference
        histogram (empty for methods whose training path does not quantize)."""
        parts = [SequenceBatch.of(mb) for mb in self.microbatches(trajectories)]
        guidance = iter(loader) if loader is not None else iter([None] * len(parts))
        tally, train_lp, rollout_lp = MismatchTally(), [], []
        for batch in parts:
            recorder = self._recorder(batch, rollout_records)
            _, logprobs = self._forward(batch, next(guidance), recorder)
            recorder.end()
            tally.add(compare(rollout_records, recorder.drain()))
            train_lp.append(logprobs[batch.response])
            rollout_lp.append(batch.rollout_logprobs[batch.response])
        train, rollout = torch.cat(train_lp), torch.cat(rollout_lp)
        return {**alignment_metrics(train, rollout, torch.ones_like(train, dtype=torch.bool)), **tally.summary()}

    def _recorder(self, batch: SequenceBatch, rollout: CaptureRecords) -> Capture:
        """A capture of the training path's codes over the positions the rollout fed."""
        keep_inputs = any(t.inputs is not None for t in rollout.tables.values())
        config = CaptureConfig(max_tokens=batch.tokens.numel(), inputs=keep_inputs)
        capture = Capture(self.model.cfg, self.engine.quant, config, self.engine.global_scales, kv_from_forward=True)
        traj = torch.tensor(batch.trajectories)[:, None].expand_as(batch.positions)
        fed = batch.positions < batch.lengths[:, None] - 1
        capture.begin(TokenMap(torch.where(fed, traj, -1).reshape(-1), batch.positions.reshape(-1)))
        return capture

    def save(self, path, extra: dict[str, bytes] | None = None) -> Path:
        """Checkpoint: the model in the Hub layout plus optimizer, step and ``extra`` files, all-or-nothing."""
        state = self.optimizer.state_dict()
        tensors = {f"{i}.{name}": t for i, s in state["state"].items() for name, t in s.items()}
        files = {
            OPTIMIZER_FILE: save_tensors({k: v.contiguous() for k, v in tensors.items()}),
            STATE_FILE: json.dumps({"step": self.step, "param_groups": state["param_groups"]}).encode(),
            **(extra or {}),
        }
        return save_model(self.model, path, extra=files)

    def resume(self, path) -> None:
        """Load a checkpoint written by :meth:`save`, and sync the rollout engine to it."""
        folder = Path(path)
        saved = load_model(folder)
        self.model.load_state_dict(saved.state_dict())
        meta = json.loads((folder / STATE_FILE).read_text())
        tensors = load_tensors((folder / OPTIMIZER_FILE).read_bytes())
        state: dict[int, dict] = {}
        for key, t in tensors.items():
            i, name = key.split(".", 1)
            state.setdefault(int(i), {})[name] = t
        self.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        self.step = meta["step"]
        self.engine.update_weights(self.model.state_dict())


@dataclass(frozen=True)
class RoundConfig:
    """One round: ``steps`` RL steps of ``prompts_per_step`` prompts x ``group_size`` responses."""

    steps: int = 1
    prompts_per_step: int = 4
    group_size: int = 4
    bits: int = 1
    layers: tuple[int, ...] | None = None  # None: every layer the capture holds
    prefix: str = "guidance"
    measure_mismatch: bool = False  # compare training codes with the rollout's full capture every step


def rl_round(
    engine: TorchEngine,
    trainer: Trainer,
    prompts: Callable[[int, int], list[list[int]]],
    reward: Callable[[Trajectory], float],
    sampling: SamplingParams,
    config: RoundConfig,
    store,
) -> list[dict]:
    """K steps of rollout -> compaction -> guided QAT -> weight sync; one metrics dict per step.

    ``prompts(step, n)`` gives a step's prompts, ``reward(trajectory)`` scores a response.
    """
    history = []
    for _ in range(config.steps):
        step, timings = trainer.step, {}
        start = time.perf_counter()
        batch = [p for p in prompts(step, config.prompts_per_step) for _ in range(config.group_size)]
        topk = SCORE_CENTERING_TOPK if trainer.config.method == "tis_sc" else sampling.record_topk
        trajectories = engine.generate(batch, replace(sampling, seed=sampling.seed + step, record_topk=topk))
        timings["rollout_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        records = engine.drain_capture() if engine.capture is not None else CaptureRecords()
        timings["capture_seconds"] = time.perf_counter() - start
        loader = None
        if trainer.config.method == "trace":
            start = time.perf_counter()
            layers = config.layers if config.layers is not None else sorted({layer for layer, _ in records.tables})
            write_step(store, compact(records, config.bits, layers), rl_step=step, policy_version=engine.policy_version,
                       top_k=engine.model.cfg.top_k, prefix=config.prefix)  # fmt: skip
            timings["offload_seconds"] = time.perf_counter() - start
            ids = [[t.id for t in mb] for mb in trainer.microbatches(trajectories)]
            loader = GuidanceLoader(store, step, ids, prefix=config.prefix, expect={"policy_version": engine.policy_version})
        rewards = torch.tensor([reward(t) for t in trajectories])
        start = time.perf_counter()
        full = records if config.measure_mismatch else None
        stats = trainer.train_step(trajectories, group_advantages(rewards, config.group_size), loader, full)
        timings["reload_seconds"] = stats.pop("reload_seconds")
        timings["train_seconds"] = time.perf_counter() - start - timings["reload_seconds"]
        engine.update_weights(trainer.model.state_dict())
        lengths = torch.tensor([len(t.response) for t in trajectories], dtype=torch.float32)
        rollout_lp = torch.tensor([lp for t in trajectories for lp in t.logprobs])
        history.append({
            "step": step,
            "reward_mean": rewards.mean().item(),
            "accuracy": (rewards >= 1.0).float().mean().item(),
            "entropy": -rollout_lp.mean().item(),  # per-token, estimated from the sampled tokens
            "response_length": lengths.mean().item(),
            **stats,
            **timings,
        })  # fmt: skip
    return history
