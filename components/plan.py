"""Capacity planning (``tracefp4 plan``): what a run writes and needs, from its
config and its model's architecture, before it is submitted.

Each size is the writer's own: the policy is the Hub tensors a save writes
(:func:`.checkpoint.hub_shapes`) in the dtype the trainer saves it in
(:func:`.precision.policy_dtype`); the trainer state is AdamW's two float32
moments and step of each parameter and, where the policy does not hold them
(:func:`.precision.saves_masters`), the float32 master weights
(:meth:`.trainer.Trainer.save`); guidance is the ``nbytes`` of the tables the
rollout and compaction encode (:class:`.capture.SiteTable`, compacted, or
syndrome-coded at a first step's rate), sized on a sample of rows of every
guided layer and site; a round's trajectories are the lines the rollout writes
(:func:`.steps.trajectory_line`), sized on a sample of tokens and on the
tasks' training problems (read as a run's first task reads them). What is not
known before a run is an input: the tokens of a trajectory are at most
``model.max_seq_len`` (prompt and response) unless a mean is given, and the
syndrome codec's later steps choose their own rates.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tracefp4.kernels import get_format
from tracefp4.schemas import RunConfig

from .architecture import ModelConfig, get_preset
from .capture import SiteTable, site_shape
from .checkpoint import CONFIG, config_from_hf, hub_shapes, read_config
from .guidance import select_layers
from .model import Transformer
from .precision import policy_dtype, saves_masters
from .rollout import Trajectory
from .steps import (
    capture_config,
    compute_dtype,
    recorded_topk,
    rollout_captures,
    rollout_quant,
    rollout_writes_guidance,
    task_of,
    trajectory_line,
)
from .store import StoreError, file_path, open_store
from .syndrome import block_layout, encode_table, site_rates
from .tasks import Problem

OPTIMIZER_MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq, float32 like the master they step
STEP_BYTES = 4  # AdamW's step count: a float32 scalar tensor per parameter
SAMPLE_TOKENS = 4096  # the response a trajectory line is sized on
SAMPLE_PROBLEMS = 64  # of each task, the problems a trajectory line's problem is sized on


class PlanError(ValueError):
    """A plan that cannot be made: the model's architecture is not known."""


def model_config(config: RunConfig, model_config_file: str | Path | None = None) -> ModelConfig:
    """The architecture of ``config``'s model: from ``model_config_file`` (a
    config.json on disk) where given, else its preset, else the config.json of
    ``model.checkpoint`` (a folder, or read from its store alone). A preset's
    architecture is its own: a file beside it would plan a model the run
    does not train."""
    if model_config_file is not None and config.model.preset is not None:
        raise PlanError(
            f"--model-config {model_config_file}: the config's model is the preset {config.model.preset}, whose "
            "architecture the plan knows; the file is for a model.checkpoint (--set model.checkpoint=...)"
        )
    if model_config_file is not None:
        path = Path(model_config_file)
        try:
            return config_from_hf(json.loads(path.read_text()))
        except (OSError, ValueError) as e:  # unreadable, not JSON, or not a qwen MoE config (CheckpointError)
            raise PlanError(f"--model-config {path}: {e}") from None
    if config.model.preset is not None:
        return get_preset(config.model.preset)
    uri = config.model.checkpoint
    try:
        if "://" not in uri or uri.startswith("file://"):
            return read_config(file_path(uri) if "://" in uri else uri)
        return config_from_hf(json.loads(open_store(uri).get_bytes(CONFIG)))
    except (OSError, ValueError, StoreError) as e:
        raise PlanError(
            f"model.checkpoint {uri}: its {CONFIG} could not be read ({type(e).__name__}: {e}); give a copy of it "
            "with --model-config PATH"
        ) from None


@dataclass
class Model:
    """What a model of ``cfg`` holds: its parameters (a tied weight once) and parameter tensors."""

    parameters: int
    tensors: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Model":
        with torch.device("meta"):  # nothing allocated
            params = list(Transformer(cfg).parameters())
        return cls(sum(p.numel() for p in params), len(params))


def policy_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of a policy's weights as a save writes them (its Hub tensors in
    ``dtype``), without their files' headers, config.json and tokenizer."""
    return sum(math.prod(shape) for shape in hub_shapes(cfg).values()) * dtype.itemsize


def trainer_state_bytes(model: Model, policy: torch.dtype) -> int:
    """Bytes of the tensors of a trainer state saved after an optimizer step
    (:meth:`.trainer.Trainer.save`), without the file's header and state.json:
    AdamW's float32 moments and step of each parameter, and the float32 master
    weights beside a policy saved in another dtype."""
    per_parameter = 4 * (OPTIMIZER_MOMENTS + saves_masters(policy))
    return model.parameters * per_parameter + model.tensors * STEP_BYTES


def _sample(cfg: ModelConfig, layer: int, site: str, fmt: str, per_token_scale: bool) -> tuple[SiteTable, int]:
    """A full 4-bit capture of ``(layer, site)`` for the fewest tokens of one
    trajectory whose rows make whole syndrome blocks, and that many tokens."""
    width, slots = site_shape(cfg, site)
    block = get_format(fmt).block_size
    tokens = block_layout(width, block).group
    rows = tokens * slots
    index = torch.arange(rows)
    table = SiteTable(
        layer,
        site,
        fmt,
        4,
        width,
        None,
        traj=torch.zeros(rows, dtype=torch.int64),
        pos=index // slots,
        slot=index % slots,
        expert=torch.zeros(rows, dtype=torch.int64),
        codes=torch.zeros(rows, width // 2, dtype=torch.uint8),
        scales=torch.zeros(rows, width // block, dtype=torch.uint8),
        row_global_scales=torch.zeros(rows, 1) if per_token_scale else None,
    )
    return table, tokens


def guidance_bytes_per_token(
    config: RunConfig, cfg: ModelConfig, layers: list[int], bits: int, codec: str = "bits"
) -> float:
    """Bytes a token ships at ``layers`` (each with its FP4 sites under the
    run's rollout): its rows' low ``bits`` and block scales (``codec`` bits),
    or their parity at the syndrome codec's first-step rate
    (``guidance.syndrome_rate``: later steps choose theirs from the decode
    statistics), where rows narrower than a block share one
    (:func:`.syndrome.block_layout`) without the part-empty last block of each
    trajectory. Shard headers and manifests, a few kilobytes a shard, are not
    counted."""
    quant, total = rollout_quant(config), 0.0
    for layer in layers:
        for site in quant.fp4_sites(cfg, layer):
            table, tokens = _sample(cfg, layer, site, quant.site_format(site), quant.per_token(site))
            if codec == "syndrome":
                rate = site_rates({(layer, site): table}, None, config.guidance.syndrome_rate)[(layer, site)]
                total += encode_table(table, rate).nbytes / tokens
            else:
                total += table.compacted(bits).nbytes / tokens
    return total


def trajectory_bytes_per_token(config: RunConfig, cfg: ModelConfig) -> float:
    """Bytes a token adds to a trajectories file's line
    (:func:`.steps.trajectory_line`): its id and, as a response token, its
    float32 log-probability in JSON and the sampler's likeliest tokens where
    the method records them (:func:`.steps.recorded_topk`), on a seeded sample
    of ids uniform over the vocabulary (more digits than text's common tokens
    have) and log-probabilities of uniform draws (a float32 value's JSON takes
    19 to 22 characters whatever its size, those of likely tokens, near 0, the
    most: a few bytes a token more than here). A prompt token, its id alone,
    counts as much; a line's problem is :func:`problem_bytes_per_trajectory`'s."""
    k, generator = recorded_topk(config), torch.Generator().manual_seed(0)

    def line_bytes(tokens: int) -> int:
        ids = torch.randint(cfg.vocab_size, (tokens, 1 + k), generator=generator)
        logprobs = torch.rand(tokens, 1 + k, generator=generator).log()
        top = (ids[:, 1:].tolist(), logprobs[:, 1:].tolist()) if k else (None, None)
        trajectory = Trajectory(0, [], ids[:, 0].tolist(), logprobs[:, 0].tolist(), "length", *top)
        return len(trajectory_line(trajectory, Problem("", "", "", {})))

    return (line_bytes(SAMPLE_TOKENS) - line_bytes(0)) / SAMPLE_TOKENS


def problem_bytes_per_trajectory(config: RunConfig) -> float:
    """Bytes a trajectory's problem adds to its trajectories file's line
    (:func:`.steps.trajectory_line`): its prompt, answer and meta (a file's
    line whole where a reward of the task's own scores it, which may be
    most of the file: test cases), a mean over a sample of each trained
    task's problems (:data:`SAMPLE_PROBLEMS`: drawing them all takes half a
    minute on a paper preset), weighted as rollout draws the tasks. A task's
    file that cannot be read is an error naming it, as the run's first task
    would give."""
    empty = Trajectory(0, [], [], [], "length")
    bare = len(trajectory_line(empty, Problem("", "", "", {})))
    weighted = []
    for i, t in enumerate(config.tasks):
        if t.train_size:
            drawn = task_of(config, i).generate(min(SAMPLE_PROBLEMS, t.train_size), config.seed, t.difficulty)
            weighted.append((t.weight, sum(len(trajectory_line(empty, p)) - bare for p in drawn) / len(drawn)))
    total = sum(weight for weight, _ in weighted)
    return sum(weight * size for weight, size in weighted) / total if total else 0.0


def rounds_at_once(config: RunConfig, rounds: int) -> int:
    """The most rounds of guidance and capture the store holds at once in a
    run of ``rounds`` rounds: round r's rollout writes its own while round
    r-1's are there, which round r's train deletes
    (:func:`.steps.delete_round_steps`), so two; every round's with
    ``guidance.keep_steps``."""
    return rounds if config.guidance.keep_steps else min(2, rounds)


def rounds_left(config: RunConfig, rounds: int) -> int:
    """The rounds of guidance and capture a finished run of ``rounds`` rounds
    leaves in the store until ``runs clean``: its last (a run that continues
    it, with a run id of its own, deletes none of them); every round's with
    ``guidance.keep_steps``."""
    return rounds if config.guidance.keep_steps else min(1, rounds)


def chain_rounds_at_once(config: RunConfig, rounds_per_run: int) -> int:
    """The most rounds of guidance and capture the store holds at once over a
    chain of runs of ``rounds_per_run`` rounds making ``rl.rounds``, where no
    run of it is cleaned: what each run before the running one left, and the
    running one's (:func:`rounds_left`, :func:`rounds_at_once`)."""
    left = most = 0
    for first in range(0, config.rl.rounds, rounds_per_run):
        rounds = min(rounds_per_run, config.rl.rounds - first)
        most = max(most, left + rounds_at_once(config, rounds))
        left += rounds_left(config, rounds)
    return most


def plan(config: RunConfig, cfg: ModelConfig, tokens_per_trajectory: int | None = None) -> dict:
    """The sizes of a run of ``config`` on a model of ``cfg``, in bytes, by
    what causes them; ``tokens_per_trajectory`` (prompt and response, a mean)
    where known, else the bound ``model.max_seq_len``. Per round, per run (a
    cluster run's ``rl.rounds_per_run``) and per chain (``rl.rounds``)."""
    if tokens_per_trajectory is not None and not 0 < tokens_per_trajectory <= config.model.max_seq_len:
        raise PlanError(
            f"tokens per trajectory {tokens_per_trajectory}: must be 1 to model.max_seq_len "
            f"({config.model.max_seq_len}), prompt and response together"
        )
    unguidable = config.guided_layer_problems(cfg, f"the model ({cfg.model_type}, {cfg.num_layers} layers)")
    if unguidable:  # as prepare refuses it
        raise PlanError("\n".join(unguidable))
    model, quant = Model.of(cfg), rollout_quant(config)
    dtype = policy_dtype(config.train_precision, compute_dtype(config))
    fp4_layers = quant.fp4_layers(cfg)
    trace = config.method == "trace"
    guided = select_layers(config.guidance.layers, fp4_layers) if trace and fp4_layers else ()
    guidance = guidance_bytes_per_token(config, cfg, guided, config.guidance.bits, config.guidance.codec)
    capture = 0.0  # what the rollout ships that is not the guidance itself (compaction reads it): what it captures
    if rollout_captures(config) and not rollout_writes_guidance(config):
        kept = capture_config(config, quant, cfg)
        capture = guidance_bytes_per_token(config, cfg, [layer for layer in fp4_layers if kept.keeps(layer)], kept.bits)
    r, rl = config.rollout, config.rl
    trajectories = rl.steps_per_round * r.prompts_per_step * r.group_size
    tokens = trajectories * (tokens_per_trajectory or config.model.max_seq_len)
    rounds_per_run = rl.rounds_per_run or rl.rounds
    runs = -(-rl.rounds // rounds_per_run)
    policy = policy_bytes(cfg, dtype)
    state = trainer_state_bytes(model, dtype)
    per_round = round((guidance + capture) * tokens)
    trajectory, problem = trajectory_bytes_per_token(config, cfg), problem_bytes_per_trajectory(config)
    trajectories_per_round = round(trajectory * tokens + problem * trajectories)
    # in the pipeline root each rollout worker's trajectories besides the round's gathered file
    rolled_out = trajectories_per_round * (1 + (r.workers > 1))
    # in the store a TrainJob's inputs, the running round's trajectories among them, until its outputs are out
    stored = trajectories_per_round if config.train.in_trainjob else 0
    return {
        "model_type": cfg.model_type,
        "parameters": model.parameters,
        "policy_dtype": str(dtype).removeprefix("torch."),
        "policy_bytes": policy,
        "trainer_state_bytes": state,
        "trainer_state_masters": saves_masters(dtype),
        "guided_layers": list(guided),
        "guidance_bytes_per_token": guidance,
        "capture_bytes_per_token": capture,
        "full_capture_bytes_per_token": guidance_bytes_per_token(config, cfg, fp4_layers, 4),
        "trajectories_per_round": trajectories,
        "tokens_per_trajectory": tokens_per_trajectory or config.model.max_seq_len,
        "tokens_per_trajectory_is_bound": tokens_per_trajectory is None,
        "tokens_per_round": tokens,
        "guidance_bytes_per_round": round(guidance * tokens),
        "capture_bytes_per_round": round(capture * tokens),
        "trajectory_bytes_per_token": trajectory,
        "problem_bytes_per_trajectory": problem,
        "trajectories_bytes_per_round": trajectories_per_round,
        "rounds_per_run": rounds_per_run,
        "runs": runs,
        # the store (store.uri): rounds' guidance and capture, at most two rounds' at once in a run and its last
        # round's after it (every round's with guidance.keep_steps), and the trainer states a round hands on: under a
        # TrainJob one at a time, from the train step's own pod the last two
        "store_bytes_per_run": per_round * rounds_at_once(config, rounds_per_run),
        "store_bytes_after_run": per_round * rounds_left(config, rounds_per_run),
        "store_bytes_per_chain": per_round * chain_rounds_at_once(config, rounds_per_run),
        "store_trainer_state_bytes": state * (1 if config.train.in_trainjob else 2),
        "store_trajectories_bytes": stored,
        # KFP's pipeline root: prepare's policy, each round's new policy and trajectories; a chain's later runs'
        # prepare copies the run before's last policy and trainer state
        "pipeline_root_bytes_per_run": (policy + rolled_out) * rounds_per_run + policy,
        "pipeline_root_bytes_per_chain": (policy + rolled_out) * rl.rounds + policy * runs + state * (runs - 1),
    }
