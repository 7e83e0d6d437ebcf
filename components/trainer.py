"""The training side of TRACE's RL loop: guided QAT steps over rolled-out trajectories.

``Trainer`` holds the policy in its training precision (:mod:`.precision`:
bf16 parameters and compute over float32 master weights, or float32
parameters under BF16 autocast) and AdamW, runs the training path with the
method's fake quantization, accumulates gradients over microbatches (guidance
reloaded per microbatch), and saves two artifacts, each atomically: the policy
as a clean Hugging Face checkpoint (in its parameters' dtype), and the trainer
state (optimizer moments, the float32 master weights, step) that resumes it
exactly (:mod:`.trainer_state`). It quantizes from the
rollout's numerics (quantization config and static global scales, carried by
the guidance artifact), never from a rollout engine. It computes on the
device of the model it is given; what it saves are CPU tensors. The loop
itself is :func:`tracefp4.components.steps.run_round`.
"""

import copy
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tracefp4.kernels import valid_global_scale

from .capture import Capture, CaptureConfig, CaptureRecords, TokenMap
from .checkpoint import load_model, save_stacked, saved_state
from .guidance import GuidanceError, GuidanceLoader
from .mismatch import MismatchTally, compare
from .model import Transformer
from .precision import MasterWeights
from .qat import TrainingSites
from .quant_config import QuantConfig
from .rl import SequenceBatch, alignment_metrics, grpo_loss, k3_terms, score_centering, stack_rows, token_logprobs
from .rollout import Trajectory
from .syndrome import DecodeStats, add_tally, decode_summary, merge_decodes
from .tensor_files import layout_of
from .trainer_state import load_state, save_state

MASTER_PREFIX = "master."  # trainer-state tensors holding the float32 master weights, by parameter name
SCORE_CENTERING_TOPK = 8  # sampler tokens score centering looks at
OPTIMIZER_PREFIX = "optimizer."  # trainer-state tensors of the optimizer: optimizer.{param index}.{name}
# What a trainer's AdamW groups take from its config, not from the state it resumes
OWN_SETTINGS = ("lr", "betas", "weight_decay", "fused")
DECODED = "guidance_decode"  # trainer-state metadata: the last round's syndrome decode statistics, by "layer/site"


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
    kl_coef: float = 0.0  # > 0: penalize the k3 KL to the policy this trainer started from (the reference)
    temperature: float = 1.0
    compute_dtype: torch.dtype = torch.bfloat16  # the rollout's: fp32_master's autocast dtype, the W4 rounding
    precision: str = "bf16"  # .choices.PRECISIONS
    activation_checkpointing: bool = False  # each layer's activations recomputed in the backward


@dataclass
class TrainingPass:
    """The training path's forward over rolled-out trajectories (:meth:`Trainer.teacher_force`):
    its full capture, and ``[B, T]`` log-probs beside the rollout's over the response ``mask``."""

    records: CaptureRecords
    logprobs: Tensor
    rollout_logprobs: Tensor
    mask: Tensor
    guidance_coverage: float  # share of captured elements rounded with guidance (0.0: none, or none captured)

    def alignment(self, tis_cap: float) -> dict[str, float]:
        return alignment_metrics(self.logprobs, self.rollout_logprobs, self.mask, tis_cap=tis_cap)


class Trainer:
    """The policy being trained (in ``config.precision``; the model is converted
    in place), its optimizer over the float32 master weights, and the
    rollout's numerics it fake-quantizes with (``quant``, ``global_scales``),
    all on the model's device."""

    def __init__(
        self, model: Transformer, config: TrainConfig, quant: QuantConfig, global_scales: dict[tuple[int, str], Tensor]
    ):
        self.config, self.quant = config, quant
        # host copies: the training path checks guidance against them and quantizes unchecked, without device reads
        self.scale_values = {key: float(g) for key, g in global_scales.items()}
        bad = {f"{layer}/{site}": g for (layer, site), g in self.scale_values.items() if not valid_global_scale(g)}
        if bad:
            raise ValueError(f"global scales must be positive and finite, got {bad}")
        self.weights = MasterWeights(model, config.precision, config.compute_dtype)  # in the precision's dtype
        model = model.train()
        model.recompute_layers = config.activation_checkpointing
        reference = copy.deepcopy(model).eval().requires_grad_(False) if config.kl_coef > 0 else None
        self.reference = self.wrap(reference) if reference is not None else None
        self.model = self.wrap(model)
        self.device = next(self.model.parameters()).device  # after wrap, which may place the model (distributed)
        self.global_scales = {key: g.to(self.device) for key, g in global_scales.items()}
        self.optimizer = torch.optim.AdamW(
            self.weights.tensors(),
            lr=config.learning_rate,
            betas=config.betas,
            weight_decay=config.weight_decay,
            fused=self.device.type == "cuda",  # one kernel per step on a GPU; the CPU keeps the reference loop
        )
        self.step = 0  # RL steps taken: the policy version of the weights
        self.history: list[dict] = []  # rows of this round's steps a resumed trainer already took
        self.decoded: dict[str, dict] = {}  # and their syndrome decode statistics, merged per "layer/site"

    # -- data parallelism: one process here; components/distributed.py overrides these for its ranks

    def wrap(self, model: Transformer) -> Transformer:
        """The module this process trains (here ``model`` itself)."""
        return model

    def owned(self, microbatches: int, group: int) -> list[int]:
        """The indices of a step's ``microbatches`` this process trains (here all),
        optimizer steps every ``group`` of them."""
        return list(range(microbatches))

    def all_sum(self, values: list[float]) -> list[float]:
        """``values`` summed over the processes training together (here one)."""
        return values

    def all_gather(self, item: object) -> list:
        """``item`` of every process training together, by rank (here one)."""
        return [item]

    def step_done(self, history: list[dict], decoded: dict[str, dict]) -> None:
        """Called after each RL step with the round's rows and merged decode
        statistics so far (a distributed trainer writes its resumable sharded
        checkpoint here)."""

    def once(self, write, what: str) -> None:
        """``write()`` of an artifact the processes training together share
        (the round's decode statistics), done by one of them: here this
        process; a distributed trainer's rank 0 alone, the others going on
        once it has succeeded (:func:`.distributed.rank0_does`), where each
        rank wrote the same object ``world`` times over. ``what``: the
        others' error when rank 0 fails."""
        write()

    def microbatches(self, trajectories: list[Trajectory]) -> list[list[Trajectory]]:
        n = self.config.microbatch_size
        return [trajectories[i : i + n] for i in range(0, len(trajectories), n)]

    def guidance_order(self, microbatches: int) -> list[int]:
        """The microbatches (of a step of ``microbatches``) whose guidance :meth:`train_step`
        reads, in its order: first those this process trains after one of the step's
        optimizer steps (their old policy's pass), then every one it trains (the loss)."""
        group = self.config.grad_accumulation or microbatches
        owned = self.owned(microbatches, group)
        return [i for i in owned if i >= group] + owned

    def train_step(
        self,
        trajectories: list[Trajectory],
        advantages: Tensor,
        loader: GuidanceLoader | None,
        rollout_records: CaptureRecords | None = None,
    ) -> dict:
        """One RL step over ``trajectories``: an optimizer step every
        ``grad_accumulation`` microbatches (0: one for the whole step), each
        microbatch's loss weighted by its share of its group's response tokens;
        guidance comes microbatch by microbatch from ``loader``. With the
        rollout's full capture, the training path's codes are compared with it
        (per-layer mismatch, codeword-difference histogram)."""
        cfg = self.config
        everything = self.microbatches(trajectories)
        group = cfg.grad_accumulation or len(everything)
        owned = self.owned(len(everything), group)
        order = self.guidance_order(len(everything))  # ``loader`` yields these microbatches' guidance, in order
        batches = {i: SequenceBatch.of(everything[i], self.device) for i in owned}
        adv = dict(zip((t.id for t in trajectories), advantages.tolist()))
        mb_advantages = {
            i: torch.tensor([adv[t] for t in b.trajectories], device=self.device) for i, b in batches.items()
        }
        tokens = [sum(len(t.response) for t in mb) for mb in everything]  # every process holds every trajectory
        group_tokens = [sum(tokens[i : i + group]) for i in range(0, len(tokens), group)]
        total_tokens = sum(group_tokens)
        last_owned = {i // group: i for i in owned}  # the optimizer steps after a group's last microbatch
        loaded = iter(loader) if loader is not None else itertools.repeat(None)
        reload_s = 0.0

        def next_guidance(batch: SequenceBatch):
            nonlocal reload_s
            start = time.perf_counter()
            mb_guidance = next(loaded)
            reload_s += time.perf_counter() - start
            if mb_guidance is not None and mb_guidance.trajectories != batch.trajectories:
                raise GuidanceError(
                    f"the loader's next guidance is of trajectories {mb_guidance.trajectories}, the microbatch "
                    f"holds {batch.trajectories}: load the microbatches in Trainer.guidance_order"
                )
            return mb_guidance

        # read from the device once, after the last microbatch: each microbatch's loss figures, the gradient norms
        loss_stats: list[tuple[int, dict[str, Tensor]]] = []
        alignment, grad_norms, tally = [], [], MismatchTally()
        guided, captured = 0, 0
        decode: dict = {}  # syndrome-coded guidance: (layer, site) -> (rate, tally on the device)
        old: dict[int, Tensor] = {}  # pi_old of the microbatches that come after an optimizer step
        for index in order[: len(order) - len(owned)]:
            recorder = self._recording(batches[index], rollout_records)
            with torch.no_grad():
                _, old[index] = self._forward(batches[index], next_guidance(batches[index]), recorder)
            self._compare(recorder, rollout_records, tally)
        self.optimizer.zero_grad(set_to_none=True)
        for index, batch in batches.items():
            mb_guidance = next_guidance(batch)
            recorder = None if index in old else self._recording(batch, rollout_records)
            loss, logprobs, sites, figures = self._loss(
                batch, mb_guidance, recorder, mb_advantages[index], old.get(index)
            )
            (loss * tokens[index] / group_tokens[index // group]).backward()
            self.weights.accumulate()
            self._compare(recorder, rollout_records, tally)
            loss_stats.append((tokens[index], figures))
            alignment.append((index, old.get(index, logprobs.detach()), batch.rollout_logprobs, batch.response))
            guided += sum(sites.coverage.guided.values())
            captured += sum(sites.coverage.total.values())
            for key, (rate, found) in sites.coverage.decode.items():
                add_tally(decode, key, rate, found)
            if last_owned[index // group] == index:
                grad_norms.append(self._optimizer_step())
        self.step += 1
        figures = [v for _, figures in loss_stats for v in figures.values()]
        read = iter(to_host(figures + grad_norms + [guided] + [found for _, found in decode.values()]))
        stats = {}
        for n, figures in loss_stats:
            for k in figures:
                stats[k] = stats.get(k, 0.0) + next(read) * n / total_tokens
        grad_norms, guided = [next(read) for _ in grad_norms], next(read)
        decode = merge_decodes(
            self.all_gather({key: DecodeStats.from_tally(rate, next(read)) for key, (rate, _) in decode.items()})
        )
        names = sorted(stats)
        fallen_back = loader.fallback_trajectories if loader is not None else 0
        summed = self.all_sum([stats[k] for k in names] + [guided, captured, fallen_back])
        stats = dict(zip(names, summed))
        guided, captured, fallen_back = summed[-3:]
        stats.update(self._alignment([part for rank in self.all_gather(alignment) for part in rank]))
        stats.update(
            grad_norm=max(grad_norms),
            optimizer_steps=len(grad_norms),
            reload_seconds=max(self.all_gather(reload_s)),
            guidance_coverage=guided / captured if captured else None,  # no guidance: not "none of it used"
            # trajectories rounded RTN for want of guidance (guidance.allow_rtn_fallback): outside the coverage,
            # whose elements are those of the guided trajectories
            guidance_fallback_trajectories=round(fallen_back) if loader is not None else None,
            **decode_summary(decode),
        )
        if rollout_records is not None:
            stats.update(MismatchTally.merged(self.all_gather(tally)).summary())
        return stats

    def _loss(self, batch: SequenceBatch, guidance, recorder: Capture | None, advantages: Tensor, old: Tensor | None):
        """A microbatch's loss (GRPO with truncated IS against the ``old`` policy's
        log-probs, or its own when the policy has not moved since the step began;
        plus score centering for tis_sc and the k3 KL to the reference when
        configured), its training-path log-probs, sites and loss figures
        (detached 0-dim tensors: reading them here would sync the host with the
        device every microbatch)."""
        cfg = self.config
        centering = cfg.method == "tis_sc"
        sites, out = self._forward(batch, guidance, recorder, topk=centering)
        logprobs, sampler_topk = out if centering else (out, None)
        response = batch.response_index  # picks what the mask picks, without a device read
        loss, stats = grpo_loss(
            logprobs,
            logprobs.detach() if old is None else old,
            batch.rollout_logprobs,
            advantages,
            response,
            clip=cfg.ppo_clip,
            tis_cap=cfg.tis_cap,
        )
        if centering:
            loss = loss + (advantages[:, None] * score_centering(sampler_topk, batch, cfg.tis_cap))[response].mean()
        if self.reference is not None:  # its own sites: the step's capture and coverage are the policy's alone
            with torch.no_grad(), self._autocast(batch):
                ref = token_logprobs(self.reference, batch, self._sites(batch, guidance, None), cfg.temperature)
            log_ratio = (ref - logprobs)[response].clamp(-10, 10)
            kl = k3_terms(log_ratio).mean()  # k3 estimate of KL(policy || reference)
            loss = loss + cfg.kl_coef * kl
            stats["kl_to_reference"] = kl.detach()
        return loss, logprobs, sites, {"loss": loss.detach(), **stats}

    def _alignment(self, parts: list[tuple[int, Tensor, Tensor, Tensor]]) -> dict:
        """Alignment metrics over the microbatches' ``(index, training log-probs,
        rollout log-probs, response mask)``, in microbatch order."""
        parts = sorted(parts, key=lambda part: part[0])
        stacked = (stack_rows([part[i] for part in parts]) for i in (1, 2, 3))
        return alignment_metrics(*stacked, tis_cap=self.config.tis_cap)

    def _optimizer_step(self) -> Tensor:
        """Clip, step and clear the gradients; returns the norm before clipping
        (a 0-dim tensor, read with the step's other figures)."""
        norm = clip_gradients(self.weights.tensors(), self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weights.sync()
        return norm

    def _autocast(self, batch: SequenceBatch):
        """fp32_master's autocast to the compute dtype; bf16 parameters compute in bf16 as they are."""
        dtype = self.config.compute_dtype
        enabled = self.config.precision == "fp32_master" and dtype != torch.float32
        return torch.autocast(batch.tokens.device.type, dtype=dtype, enabled=enabled)

    def _forward(self, batch: SequenceBatch, guidance, recorder: Capture | None, topk: bool = False):
        """The training path's log-probs of one microbatch (:func:`.rl.token_logprobs`), and its sites."""
        sites = self._sites(batch, guidance, recorder)
        with self._autocast(batch):
            return sites, token_logprobs(self.model, batch, sites, self.config.temperature, topk=topk)

    def _sites(self, batch: SequenceBatch, guidance, recorder: Capture | None) -> TrainingSites:
        """One forward's quantization sites: the method's fake quantization, guided
        where guidance is, its codes recorded by ``recorder`` and its guidance
        coverage counted (so a forward of another model needs sites of its own)."""
        return TrainingSites(
            self.quant,
            self.config.method,
            self.global_scales,
            trajectories=batch.trajectories,
            seq_len=batch.tokens.shape[1],
            guidance=guidance,
            compute_dtype=self.config.compute_dtype,
            recorder=recorder,
            scale_values=self.scale_values,
        )

    @torch.no_grad()
    def measure(
        self, trajectories: list[Trajectory], loader: GuidanceLoader | None, rollout_records: CaptureRecords
    ) -> dict:
        """The train-rollout discrepancy of the training path as it stands, without
        an update: log-prob alignment, and against the rollout's full capture the
        per-layer code mismatch, relative excess MSE and codeword-difference
        histogram (empty for methods whose training path does not quantize)."""
        forward = self.teacher_force(trajectories, loader, rollout_records)
        tally = MismatchTally()
        tally.add(compare(rollout_records, forward.records))
        return {**forward.alignment(self.config.tis_cap), **tally.summary()}

    @torch.no_grad()
    def teacher_force(
        self, trajectories: list[Trajectory], loader: GuidanceLoader | None, rollout_records: CaptureRecords
    ) -> TrainingPass:
        """The training path over the trajectories' tokens without an update, as
        the train step runs it (microbatches, guidance from ``loader``): its full
        capture at the positions the rollout fed (with the values before
        quantization when the rollout kept its own) and its log-probs."""
        parts = [SequenceBatch.of(mb, self.device) for mb in self.microbatches(trajectories)]
        guidance = iter(loader) if loader is not None else iter([None] * len(parts))
        recorder = self._recorder(max(b.tokens.numel() for b in parts), rollout_records)
        alignment, guided, captured = [], 0, 0
        for index, batch in enumerate(parts):
            recorder.begin(TokenMap.of(batch.trajectories, batch.positions, batch.lengths - 1))
            sites, logprobs = self._forward(batch, next(guidance), recorder)
            recorder.end()
            alignment.append((index, logprobs, batch.rollout_logprobs, batch.response))
            guided += sum(sites.coverage.guided.values())
            captured += sum(sites.coverage.total.values())
        train, rollout, mask = (stack_rows([part[i] for part in alignment]) for i in (1, 2, 3))
        return TrainingPass(recorder.drain(), train, rollout, mask, float(guided) / captured if captured else 0.0)

    def _recording(self, batch: SequenceBatch, rollout: CaptureRecords | None) -> Capture | None:
        """A capture of ``batch``'s training-path codes, begun, when there is the rollout's to compare with."""
        if rollout is None:
            return None
        recorder = self._recorder(batch.tokens.numel(), rollout)
        recorder.begin(TokenMap.of(batch.trajectories, batch.positions, batch.lengths - 1))
        return recorder

    def _compare(self, recorder: Capture | None, rollout: CaptureRecords | None, tally: MismatchTally) -> None:
        """End ``recorder``'s capture and tally its codes against the rollout's."""
        if recorder is not None:
            recorder.end()
            tally.add(compare(rollout, recorder.drain()))

    def _recorder(self, max_tokens: int, rollout: CaptureRecords) -> Capture:
        """A capture of the training path's codes (each forward: ``begin`` with
        the positions the rollout fed, ``end``), keeping the values before
        quantization when the rollout kept its own."""
        keep_inputs = any(t.inputs is not None for t in rollout.tables.values())
        config = CaptureConfig(max_tokens=max_tokens, inputs=keep_inputs)
        return Capture(self.model.cfg, self.quant, config, self.global_scales, self.device, kv_from_forward=True)

    def save(
        self, policy, state, extra: dict[str, bytes] | None = None, run_id: str = "", decoded: dict | None = None
    ) -> tuple[Path, Path]:
        """The policy at ``policy`` (Hub layout in the precision's policy dtype,
        ``extra`` files beside it, the run and policy version in its manifest) and the
        trainer state that resumes it at ``state`` (optimizer moments, float32
        master weights, precision, and the last round's syndrome ``decoded``
        statistics, from which the next round, in this run or one that
        continues it, chooses its rates), pinned to that policy; each
        all-or-nothing. Each is written as its tensors come (:meth:`stream`),
        not from a whole copy."""
        cfg, provenance = self.model.cfg, {"run_id": run_id, "policy_version": self.step}
        dtype = self.weights.policy_dtype

        def write_policy(layout, values):
            layout = layout_of(layout, dtype)
            values = ((name, t.to(dtype)) for name, t in values)
            save_stacked(cfg, layout, values, policy, extra=extra, provenance=provenance)

        self.stream(saved_state(self.model), write_policy)
        optimizer = self.optimizer.state_dict()  # parameters by index
        tensors = {f"{OPTIMIZER_PREFIX}{i}.{name}": t for i, s in optimizer["state"].items() for name, t in s.items()}
        tensors.update({MASTER_PREFIX + name: t for name, t in self.weights.state().items()})
        meta = {"run_id": run_id, "policy_version": self.step, "precision": self.config.precision}
        meta["param_groups"] = optimizer["param_groups"]
        if decoded:
            meta[DECODED] = decoded
        self.stream(tensors, lambda layout, values: save_state(state, layout, values, meta, policy))
        return Path(policy), Path(state)

    def stream(self, tensors: dict[str, Tensor], write) -> None:
        """``write(layout, values)`` of ``tensors``: their names, shapes and
        dtypes, then the tensors themselves by name as they come. Here they are
        this process's own, in memory."""
        write(tensors, tensors.items())

    @classmethod
    def from_checkpoint(
        cls,
        policy,
        state,
        config: TrainConfig,
        quant: QuantConfig,
        global_scales: dict,
        device: str | torch.device = "cpu",
        run_id: str = "",
    ) -> "Trainer":
        """A trainer on ``device`` resumed from the policy and trainer state
        :meth:`save` wrote (the state refused unless it is run ``run_id``'s and
        was saved with that policy; the optimizer state and the master weights
        follow the weights to the device). Either precision resumes the other's
        state: saved master weights are used where there are some, by the
        trained model and by its KL reference alike (KL 0 at the first step)."""
        tensors, meta = load_state(state, policy, run_id)
        trainer = cls(load_model(policy, device=device), config, quant, global_scales)
        masters, optimizer = master_weights(tensors), optimizer_state(tensors, meta)
        trainer.weights.load(masters, stepped=bool(optimizer["state"]))
        if masters and trainer.reference is not None:  # the KL reference is where training starts: the masters
            with torch.no_grad():
                for name, p in trainer.reference.named_parameters():
                    p.copy_(masters[name])  # a bf16 reference takes them rounded: the policy itself
        trainer.load_optimizer_state(optimizer)
        trainer.step = meta["policy_version"]
        return trainer

    def load_optimizer_state(self, state: dict) -> None:
        """Load an optimizer ``state_dict()`` (parameters by index) as :func:`optimizer_state` reads it."""
        self.optimizer.load_state_dict(self.with_own_settings(state))

    def with_own_settings(self, state: dict) -> dict:
        """An optimizer state with this trainer's :data:`OWN_SETTINGS` in its
        groups. Loading takes the saved ones: a continuation given another
        learning rate, weight decay or betas would go on with the old ones,
        silently; and a state saved on the CPU would resume on a GPU unfused,
        its step counts left on the host (torch moves them to the parameters'
        device for a fused group only), and a GPU's would run fused on the CPU."""
        own = {key: self.optimizer.param_groups[0][key] for key in OWN_SETTINGS}
        return {**state, "param_groups": [dict(group, **own) for group in state["param_groups"]]}


def master_weights(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The float32 master weights in a trainer state's tensors, by parameter name (none saved: empty)."""
    return {k.removeprefix(MASTER_PREFIX): t for k, t in tensors.items() if k.startswith(MASTER_PREFIX)}


def optimizer_state(tensors: dict[str, Tensor], meta: dict) -> dict:
    """The optimizer ``state_dict()`` (parameters by index) in a trainer state's tensors and metadata."""
    moments: dict[int, dict] = {}
    for key, t in tensors.items():
        if key.startswith(OPTIMIZER_PREFIX):
            i, name = key.removeprefix(OPTIMIZER_PREFIX).split(".", 1)
            moments.setdefault(int(i), {})[name] = t
    return {"state": moments, "param_groups": meta["param_groups"]}


def clip_gradients(parameters, max_norm: float) -> Tensor:
    """The gradients' global norm, clipped to ``max_norm``; 0 leaves them as they
    are, as the config says (``clip_grad_norm_`` with 0 would zero them all)."""
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm > 0 else math.inf)


def to_host(values: list) -> list:
    """``values`` with their tensors (on one device) as Python floats (0-dim)
    or lists of them, read from the device at once: a training step's one
    read, after its last microbatch (``.item()`` per figure would sync the host
    with the device each time). Through float64, so each reads as its own
    ``.item()`` would."""
    tensors = [v for v in values if isinstance(v, Tensor)]
    flat = torch.cat([t.double().reshape(-1) for t in tensors]).tolist() if tensors else []
    out, at = [], 0
    for v in values:
        if isinstance(v, Tensor):
            out.append(flat[at] if v.dim() == 0 else flat[at : at + v.numel()])
            at += v.numel()
        else:
            out.append(v)
    return out
