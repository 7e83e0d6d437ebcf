"""The pipeline's steps as plain functions over folders and a store: what each
Kubeflow component calls, and :func:`run_round`, the same round in one process.

A round is rollout -> compaction -> guided QAT (docs/training.md has the
schedule). The policy travels as a clean Hugging Face checkpoint folder (the
run id and policy version recorded in its checksum manifest), the optimizer
and step as a separate trainer-state folder pinned to it (only train reads
it: :mod:`.trainer_state`), trajectories
as JSON lines behind a header naming the run, round, policy version and the
rollout's numerics, captures and guidance through the artifact store, and the
guidance reference (:class:`~.guidance.GuidanceRef`) from compaction to train.
Every consumer refuses an input of another run or policy version. Every step
computes on ``resources.device``, resolved before it does anything else; what
it writes is device-independent (CPU tensors), so that a checkpoint rolled out
on a GPU trains on a CPU and the reverse.
"""

import contextlib
import functools
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from tracefp4.schemas import RunConfig, TaskConfig

from . import bootstrap as sft
from .architecture import ModelConfig, get_preset
from .capture import CaptureConfig, CaptureRecords
from .checkpoint import (
    delete_folder,
    fetch,
    folder_digest,
    load_model,
    provenance,
    read_config,
    read_policy_folder,
    recommit,
    remove_folder,
    save_model,
    upload_folder,
    write_location,
)
from .device import compute_on, measured_on, resolve
from .export import export
from .guidance import (
    STEP_MANIFEST,
    BackgroundStepWriter,
    FinishedShards,
    GuidanceError,
    GuidanceRef,
    StepSize,
    StepWriter,
    compact,
    compaction_report,
    encode_scales,
    iter_step,
    iter_step_tables,
    merge_steps,
    read_step,
    select_layers,
    step_prefix,
)
from .metrics import MEASURED_ON, machines
from .mismatch import teacher_force
from .model import build_model
from .quant_config import BF16, QuantConfig, rollout_config
from .rl import group_advantages
from .rollout import SamplingParams, TorchEngine, Trajectory, derive_seed
from .store import ArtifactNotFound, StoreError, file_path, open_store, unexpanded_home, write_atomic
from .syndrome import encode_table, merge_decode_json, site_rates
from .tasks import (
    FileTask,
    LineFormat,
    Problem,
    RewardFunction,
    Task,
    check_answer_readable,
    format_example,
    get_task,
    held_out,
    read_problems,
    reward_of,
    reward_parts,
    solved,
    split,
)
from .tokenizer import CHARS, build_tokenizer, load_tokenizer
from .trainer import DECODED, SCORE_CENTERING_TOPK, TrainConfig, Trainer
from .trainer_state import check_state, repin_state

# The compaction step's figures (none for methods without guidance).
COMPACTION_KEYS = (
    "guidance_bytes",
    "capture_bytes",
    "guidance_bits_per_element",
    "compaction_ratio",
    "compaction_fidelity",
    "compaction_seconds",
    *(f"compaction_{key}" for key in MEASURED_ON),  # where it was measured (device.measured_on)
)
DECODE_FILE = "decode.json"  # beside a syndrome-coded step's manifest: its decode statistics, from training
# A round's rollout and compaction figures, carried into each of its history rows.
ROUND_KEYS = (
    "rollout_seconds",
    "rollout_tokens",
    "rollout_tokens_per_second",
    *(f"rollout_{key}" for key in MEASURED_ON),  # where it was measured (device.measured_on)
    "capture_overhead_ratio",
    "offload_seconds",
    "upload_seconds",
) + COMPACTION_KEYS

log = logging.getLogger(__name__)


class RunMismatch(ValueError):
    """An input that belongs to another run, round or policy version than the step's."""


def store_prefix(config: RunConfig, run_id: str, kind: str) -> str:
    """Where a run keeps ``kind`` ("capture": full 4-bit captures; "guidance")
    in the store: per run name, run id and method, so that neither two runs
    with the same name nor the parallel branches of a comparison ever meet."""
    return f"{config.name}/{run_id}/{config.method}/{kind}"


# Settings of how long a step waits or of what the store keeps, not of what it computes: left out of config_digest,
# which they would otherwise change for every run when they were added (a retried step on a newer image would not
# find its round's work)
NOT_DIGESTED = {"train": {"queue_timeout_seconds"}, "guidance": {"keep_steps"}}


def config_digest(config: RunConfig) -> str:
    """Ten hex digits naming the run's settings, in what a retry of a step
    resumes (a round's sharded checkpoints, its TrainJob): a run id is a UI
    parameter, and another run given the same one with other settings must
    not resume the first's work as its own."""
    return hashlib.sha256(config.model_dump_json(exclude=NOT_DIGESTED).encode()).hexdigest()[:10]


def step_device(config: RunConfig) -> torch.device:
    """The device the step computes on (:func:`.device.compute_on`); a CUDA device this machine lacks
    fails here, before any work."""
    return compute_on(resolve(config.resources.device))


def _store(config: RunConfig):
    return open_store(config.store.uri, create_bucket=config.store.create_bucket)


def compute_dtype(config: RunConfig) -> torch.dtype:
    return getattr(torch, config.model.dtype)


def warn_of_checkpoint_dtype(weights: torch.dtype, config: RunConfig) -> None:
    """Warn where ``model.checkpoint``'s weights are of another dtype than the run's ``model.dtype``, which its
    rollout and training take them to: a bf16 checkpoint in a run of the schema's float32 (the library presets')
    takes twice the memory and bytes, and rolls out other values than it would serve."""
    run = compute_dtype(config)
    if weights != run:
        log.warning(
            "model.checkpoint %s holds %s weights; the run rolls them out and trains them in model.dtype %s (set "
            "model.dtype to keep the checkpoint's)",
            config.model.checkpoint, *(str(d).removeprefix("torch.") for d in (weights, run)),
        )  # fmt: skip


def problems(config: RunConfig) -> tuple[list[Problem], list[Problem]]:
    """The run's train and test problems, every task's split concatenated (seeded)."""
    splits = task_splits(config)
    return [p for train, _ in splits for p in train], [p for _, test in splits for p in test]


def task_splits(config: RunConfig) -> list[tuple[list[Problem], list[Problem]]]:
    """Each task's train and test problems (seeded). A task without as many
    distinct problems is an error naming its entry in ``tasks``."""
    splits = []
    for i, t in enumerate(config.tasks):
        task = task_of(config, i)
        with _naming(_task_entry(i, t)):
            splits.append(split(task, t.train_size, t.test_size, config.seed, t.difficulty))
    return splits


def task_of(config: RunConfig, i: int) -> Task:
    """The task of ``tasks.i``: its generated family, or its file's problems
    (:func:`.tasks.read_problems`); a file that is not there, holds no
    problems or is not the one ``sha256`` pins is an error naming the entry."""
    t = config.tasks[i]
    return get_task(t.name) if t.data is None else _file_task(config, i, _task_file(config, i, "data")[0])


def pin_problem_files(config: RunConfig) -> RunConfig:
    """``config`` with each file task's ``sha256`` (and ``reward_sha256``)
    set to its file's where empty (a pinned one checked), its problems read
    and its reward loaded: what a run's first task does, so that a file
    rewritten during the run stops its next step instead of changing its
    problems or their scores."""
    pinned = config.model_copy(deep=True)
    for i, t in enumerate(pinned.tasks):
        if t.data is None:
            continue
        data, t.sha256 = _task_file(config, i, "data")
        first = _file_task(config, i, data).problems[0]  # its problems read: a file of none is refused here
        if first.reward is not None:
            t.reward_sha256 = hashlib.sha256(first.reward.code).hexdigest()
            with _naming(f"tasks.{i}.reward"):  # refused here, not at the run's first reward
                first.reward.check(first)
    return pinned


def steps_environment(config: RunConfig) -> dict[str, str]:
    """The environment the steps reach a store with: a cluster's pods get the
    store's variables (:meth:`~tracefp4.schemas.config.StoreConfig.pod_environment`),
    a local run's steps too."""
    return {**os.environ, **config.store.pod_environment()}


_PINNED_BY = {"data": "sha256", "reward": "reward_sha256"}  # a task's file field: the field pinning its bytes


def _task_file(config: RunConfig, i: int, field: str) -> tuple[bytes, str]:
    """The bytes of ``tasks.i``'s ``data`` or ``reward`` file and their sha256, the pinned one where there is
    one."""
    t = config.tasks[i]
    uri, pinned = getattr(t, field), getattr(t, _PINNED_BY[field])
    uri = reward_parts(uri)[0] if field == "reward" else uri
    with _naming(f"tasks.{i}.{field}"):
        data, digest = read_task_file(uri, steps_environment(config))
        if pinned is not None and digest != pinned:
            raise ValueError(
                f"{uri} has changed since the run started: its sha256 is {digest}, the run's "
                f"tasks.{i}.{_PINNED_BY[field]} {pinned} (put the file back, or start another run)"
            )
    return data, digest


def with_rewards(config: RunConfig, problems: list[Problem]) -> list[Problem]:
    """``problems``, read from a trajectories file, with their tasks' reward functions (``tasks.i.reward``),
    which the file does not hold."""
    rewards = {t.name: _task_reward(config, i) for i, t in enumerate(config.tasks) if t.reward is not None}
    return [replace(p, reward=rewards[p.task]) if p.task in rewards else p for p in problems] if rewards else problems


def _task_reward(config: RunConfig, i: int) -> RewardFunction | None:
    """``tasks.i``'s reward of its own, its file read (None: math-verify's)."""
    t = config.tasks[i]
    return (
        None
        if t.reward is None
        else RewardFunction(*reward_parts(t.reward), _task_file(config, i, "reward")[0], t.data, t.reward_timeout_s)
    )


def _file_task(config: RunConfig, i: int, data: bytes) -> FileTask:
    """The problems of ``tasks.i``'s file, whose bytes are ``data``, each with its task's reward function."""
    t = config.tasks[i]
    fmt = LineFormat(t.prompt_key, t.answer_key, t.prompt_template)
    reward = _task_reward(config, i)
    with _naming(f"tasks.{i}.data"):
        return FileTask(t.name, _problems_in(t.name, data, t.data, fmt, reward), t.data)


_READ: dict[str, tuple[int, str, bytes, str]] = {}  # a file's uri: its size and tag when read, its bytes, their sha256


def read_task_file(uri: str, env: Mapping[str, str]) -> tuple[bytes, str]:
    """The bytes of a task's ``data`` or reward file (a path, ``file://`` or an S3 URI reached
    with ``env``'s settings) and their sha256; read again only once the file's
    size or modification tag changed, since a step draws its problems several
    times."""
    try:
        if uri.startswith(("s3://", "minio://")):
            folder, _, name = uri.rpartition("/")
            store = open_store(folder, env=env)
        else:
            path = file_path(uri) if uri.startswith("file://") else Path(uri)
            store, name = open_store(str(path.parent)), path.name
        size, tag = store.stat(name)
        if _READ.get(uri, ())[:2] != (size, tag):
            data = store.get_bytes(name)
            _READ[uri] = size, tag, data, hashlib.sha256(data).hexdigest()
    except ArtifactNotFound:
        relative = "://" not in uri and not Path(uri).is_absolute()
        where = f" (a relative path, read from {Path.cwd()})" * relative
        raise ValueError(f"{uri}: no such file{where}{unexpanded_home(uri)}") from None
    except (OSError, StoreError) as e:
        raise ValueError(f"{uri}: {e}") from None
    return _READ[uri][2:]


@functools.lru_cache(maxsize=8)
def _problems_in(name: str, data: bytes, source: str, fmt: LineFormat, reward: RewardFunction | None) -> list[Problem]:
    return read_problems(name, data, source, fmt, reward)


def check_tasks_drawable(config: RunConfig) -> None:
    """Every task holds its split's distinct problems, and an enabled
    bootstrap's extra problems theirs besides, drawn as the steps draw them
    (the errors :func:`task_splits` and :func:`extra_problems` raise) but
    keeping their prompts alone: what the run's first task checks, in a pod
    of 2Gi, where the steps hold every problem (about 1 KB each). For a
    library preset, whose character tokenizer is known without a checkpoint,
    the longest of each task's prompts and of each entry's extra problems are
    checked as prepare checks every one (:func:`encode_prompts`,
    :func:`check_answers_fit`, the bootstrap's examples): one without room
    for ``rollout.max_new_tokens``, or an answer longer than it, fails the
    first task, not prepare on a GPU node. A file's every problem is
    checked too: an answer math-verify reads nothing in, and for a library
    preset a character its tokenizer lacks. And no task's test prompt may
    be another's training prompt (:func:`_check_held_out`)."""
    # a checkpoint's tokenizer and chat template: prepare reads them; the character tokenizer takes a token a character,
    # so the longest text is the longest encoding
    tokenizer = build_tokenizer() if config.model.preset is not None else None
    prompts: set[str] = set()
    longest, answers = [], []  # of each task: the problem of the longest prompt, that of the longest reference answer
    parts = []  # of each task: the (prompt, line) of its train and test problems
    for i, t in enumerate(config.tasks):
        task = task_of(config, i)
        if isinstance(task, FileTask):  # every problem of the file, drawn or not: the next run may draw it
            if tokenizer is not None:  # the template's own characters first: named as its, not a line's
                with _naming(f"tasks.{i}.prompt_template"):
                    _check_characters(Problem(t.name, t.prompt_template, "", {}), t.data)
            with _naming(f"tasks.{i}.data"):
                for p in task.problems:
                    if t.reward is None:  # a reward of the user's own reads the answer as it will
                        check_answer_readable(p, t.data)
                    if tokenizer is not None:
                        _check_characters(p, t.data)
        with _naming(_task_entry(i, t)):
            top = answer = None
            drawn = []
            for p in task.draws(t.train_size + t.test_size, config.seed, t.difficulty):
                prompts.add(p.prompt)
                drawn.append((p.meta.get("prompt", p.prompt), p.meta.get("line")))  # without a file's template
                top = p if top is None or len(p.prompt) > len(top.prompt) else top
                answer = p if answer is None or len(p.answer) > len(answer.answer) else answer
            longest.append(top)
            answers.append(answer)
        parts.append(held_out(drawn, task.name, t.test_size, config.seed, t.difficulty))
    _check_held_out(config, parts)
    if tokenizer is not None:
        encode_prompts(config, tokenizer, longest)
        check_answers_fit(config, tokenizer, answers)
    if config.bootstrap.enabled:
        for i, drawn in enumerate(extra_problems(config, prompts)):
            if tokenizer is not None:
                example = max(drawn, key=lambda p: len(p.prompt) + len(p.answer))
                try:
                    sft.make_batch(tokenizer, [example], config.model.max_seq_len)
                except sft.ExampleTooLong as e:
                    raise ValueError(
                        f"bootstrap.extra_problems.{i}: {e} (model.max_seq_len): raise it or lower the difficulty"
                    ) from None


def _check_held_out(config: RunConfig, parts: list[tuple[list, list]]) -> None:
    """Refuse a task's test prompt that another task trains on (the same
    prompt in two files, such as a benchmark's problem in a training set):
    evaluation would score what RL trained on. ``parts``: each task's train
    and test (prompt, line) pairs, a file's prompts as its lines hold them,
    before the task's template: the same problem put two ways is one."""
    trained = {prompt: (j, line) for j, (train, _) in enumerate(parts) for prompt, line in train}
    for i, (_, test) in enumerate(parts):
        seen = [(line, trained[prompt]) for prompt, line in test if prompt in trained and trained[prompt][0] != i]
        if not seen:
            continue
        line, (j, its) = seen[0]
        tested, training = config.tasks[i], config.tasks[j]
        are = "is another task's training prompt" if len(seen) == 1 else "are other tasks' training prompts"
        first = f"the first, {tested.data} line {line}," if tested.data else "the first"
        at = f"{training.name}'s, {training.data} line {its}" if training.data else f"a problem of {training.name}"
        files = list(dict.fromkeys(t.data for t in (tested, training) if t.data))
        lines = sorted(line for line, _ in seen) if tested.data and len(seen) > 1 else []
        listed = f" (lines {', '.join(map(str, lines[:8]))}{f' and {len(lines) - 8} more' * (len(lines) > 8)})"
        raise ValueError(
            f"tasks.{i}: {len(seen)} of {tested.name}'s {len(test)} test prompts {are}{listed * bool(lines)}, so "
            f"evaluation would score what RL trained on; {first} is one of tasks.{j} ({at}): drop them from "
            f"{' or '.join(files)}"
        )


def _check_characters(problem: Problem, source: str) -> None:
    """Refuse a file's problem with a character the library presets'
    character tokenizer lacks (:data:`.tokenizer.CHARS`: printable ASCII and
    newline): it would reach the policy as ``<unk>``, and its answer could
    never be written. A problem without a line (a task's template) is named
    by the caller alone."""
    outside = "".join(sorted(set(problem.prompt + problem.answer) - set(CHARS)))
    if outside:
        where = f"{source} line {problem.meta['line']}: " if "line" in problem.meta else ""
        raise ValueError(
            f"{where}{outside!r} is outside the library preset's character tokenizer (printable ASCII and "
            "newline): use a checkpoint whose tokenizer has it (model.checkpoint)"
        )


def _task_entry(i: int, t: TaskConfig) -> str:
    """A task's entry and sizes, for its draws' errors; sizes a file task left at the schema's defaults
    are said to be those (a user who set neither reads them as numbers from nowhere)."""
    sizes = (t.train_size, t.test_size)
    defaults = tuple(TaskConfig.model_fields[f].default for f in ("train_size", "test_size"))
    told = " (the schema's defaults)" if t.data is not None and sizes == defaults else ""
    return f"tasks.{i}: train_size {t.train_size} + test_size {t.test_size}{told}"


@contextlib.contextmanager
def _naming(entry: str):
    """A ValueError raised inside as ``entry: reason``: a draw that fails names the config entry behind it."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{entry}: {e}") from None


def training_problems(config: RunConfig, round_index: int, n: int) -> list[Problem]:
    """``n`` training problems for a round: a task with training problems drawn
    by the tasks' weights, then one of its training problems, uniformly (seeded
    per round)."""
    rng = random.Random(f"{config.seed}/rollout/{round_index}")
    trained = [(train, t.weight) for (train, _), t in zip(task_splits(config), config.tasks) if train]
    pools, weights = [train for train, _ in trained], [weight for _, weight in trained]
    return [rng.choice(pools[rng.choices(range(len(pools)), weights)[0]]) for _ in range(n)]


def prepare(config: RunConfig, out: Path, run_id: str = "", state: Path | None = None) -> dict:
    """The initial policy (a preset with seeded weights, or a checkpoint) with its
    tokenizer, as a checkpoint of ``run_id`` at policy version 0, and with
    ``state`` its initial trainer state (a fresh optimizer); bootstrapped by SFT
    on the tasks when configured. A continuation (``model.trainer_state``)
    takes on the policy and state the run it continues ended with instead
    (:func:`continue_from`). Returns the bootstrap's figures (empty without one)."""
    device = step_device(config)  # checked first: a CUDA device this machine lacks fails here
    # without a bootstrap the policy is only checked and written: it stays in host memory, where a paper-scale
    # checkpoint and the trainer's float32 copy of it fit, and the step's GPU is not touched
    device = device if config.bootstrap.enabled else torch.device("cpu")
    out = Path(out)
    checkpoint = fetch(config.model.checkpoint) if config.model.checkpoint else None  # a store URI: downloaded, cached
    cfg, tokenizer = (
        read_policy_folder(checkpoint, config.model.checkpoint)
        if checkpoint
        else (get_preset(config.model.preset), build_tokenizer())
    )
    check_policy_fits(config, cfg, tokenizer)  # before any work
    if config.model.trainer_state:
        if state is None:
            raise ValueError("model.trainer_state: a continuation's prepare writes a trainer state; none was asked for")
        continue_from(config, checkpoint, out, run_id, state)
        return {}
    if checkpoint is None:  # in the rollout's dtype unless a bootstrap trains it (in float32) first
        dtype = torch.float32 if config.bootstrap.enabled else compute_dtype(config)
        model = build_model(config.model.preset, seed=config.seed, dtype=dtype).to(device)
    else:
        model = load_model(checkpoint, device=device)
        warn_of_checkpoint_dtype(next(model.parameters()).dtype, config)  # a cluster run's, in prepare's log
    stats = run_bootstrap(config, model, tokenizer) if config.bootstrap.enabled else {}
    trainer = Trainer(model, train_config(config), BF16, {})
    if state is None:
        save_model(trainer.model, out, extra=tokenizer.files(), provenance={"run_id": run_id, "policy_version": 0})
    else:
        trainer.save(out, state, extra=tokenizer.files(), run_id=run_id)
    return stats


def continue_from(config: RunConfig, policy: Path, out: Path, run_id: str, state: Path) -> None:
    """A continuation's policy at ``out`` and trainer state at ``state``:
    ``policy`` (model.checkpoint) and model.trainer_state, saved together by
    the last round of the run it continues, copied bit for bit and taken on by
    run ``run_id`` (a run of its own: its store prefixes meet no other run's),
    at the policy version they reached, which must be what ``rl.first_round``
    rounds make. With the syndrome codec, the last round's decode statistics
    come along too: the next round chooses its rates from them."""
    source = fetch(config.model.trainer_state)
    meta = check_state(source, policy, None)  # saved with this very policy, by whichever run
    if meta["run_id"] == run_id:  # its first train would delete the last round's guidance of the run it continues
        raise ValueError(
            f"run id {run_id!r}: model.trainer_state {config.model.trainer_state} was saved by the run of that id, "
            "and a continuation is a run of its own: give it another run id (KFP's job id, where none is given)"
        )
    version, first, last = meta["policy_version"], config.rl.first_round, config.rl.first_round - 1
    if version != first * config.rl.steps_per_round:
        raise ValueError(
            f"rl.first_round: {first} rounds of {config.rl.steps_per_round} step(s) make policy version "
            f"{first * config.rl.steps_per_round}, but model.trainer_state {config.model.trainer_state} is at "
            f"version {version}"
        )
    decoded = None
    if config.guidance.codec == "syndrome":
        store = _store(config)
        # a trainer state saved before 2026-12-06 holds none: its run's store does
        decoded = meta.get(DECODED) or read_decode_stats(store, store_prefix(config, meta["run_id"], "guidance"), last)
        if decoded is None:
            raise GuidanceError(
                f"guidance.codec: syndrome chooses round {first}'s rates from round {last}'s decode statistics, "
                f"which neither model.trainer_state {config.model.trainer_state} holds nor {store.uri} under run "
                f"{meta['run_id']!r} of name {config.name} and method {config.method}: continue a run that used "
                "the syndrome codec, with its name and method"
            )
    recommit(policy, out, {"run_id": run_id, "policy_version": version})
    repin_state(source, meta, state, out, run_id)
    if decoded is not None:
        write_decode_stats(store, store_prefix(config, run_id, "guidance"), last, decoded)


def state_key(config: RunConfig, run_id: str, round_index: int) -> str:
    """Where :func:`hand_on_state` keeps round ``round_index``'s trainer state in the store: per run
    and settings (another config under the same run id keeps its own)."""
    return f"{store_prefix(config, run_id, 'trainer-state')}/round-{round_index:06d}-{config_digest(config)}"


def hand_on_state(config: RunConfig, run_id: str, round_index: int, folder: Path) -> None:
    """Move the trainer state a train step wrote at ``folder`` into the store, and leave at ``folder``
    a folder that stands for it (:func:`.checkpoint.write_location`), as a TrainJob round does: KFP
    then keeps that small folder each round, not the state (at Qwen3.5-35B-A3B 420 GB a round, which
    the pipeline root would keep for good), and the next round fetches the state from the store. The
    state of two rounds before leaves the store: the round after it trained from it and finished,
    and a retry of this round takes the round before's."""
    root = config.store.uri.rstrip("/")
    target = open_store(f"{root}/{state_key(config, run_id, round_index)}", create_bucket=config.store.create_bucket)
    manifest = upload_folder(folder, target)
    remove_folder(folder)
    write_location(folder, target.uri, manifest)
    if round_index >= 2:
        delete_folder(_store(config), state_key(config, run_id, round_index - 2))


def round_steps(config: RunConfig, run_id: str, round_index: int) -> list[str]:
    """The store folders of round ``round_index``'s steps: its guidance (with
    the syndrome codec, its decode statistics beside the manifest), its full
    capture, and each rollout worker's step of what the rollout wrote, which
    the merged step's manifest lists (:func:`.guidance.merge_steps`); the
    merged or only step of each kind first."""
    folders = [step_prefix(store_prefix(config, run_id, kind), round_index) for kind in ("guidance", "capture")]
    rolled_out = store_prefix(config, run_id, _capture_kind(config))
    folders += [step_prefix(worker_prefix(rolled_out, config, w), round_index) for w in range(config.rollout.workers)]
    return list(dict.fromkeys(folders))  # one worker writes the step itself


def delete_round_steps(config: RunConfig, run_id: str, round_index: int) -> None:
    """Delete round ``round_index``'s guidance and capture (:func:`round_steps`)
    from the store: what :func:`train` of the round after does once it has
    saved its outputs, unless ``guidance.keep_steps``. Nothing reads them again
    by then: the round after's compaction read the decode statistics, its
    train reads its own round's steps (a retry of it too, and a distributed
    round resumed within it), and a rerun of a local run takes the round's
    finished tasks from its cache. Without it the store kept every round's (at
    the paper presets 4 TB of guidance a round) until ``runs clean``. Every
    step's manifest goes first, so that a deletion cut short leaves steps that
    read as missing (:func:`.guidance.read_manifest`), never one whose shards
    fail their checksums; then each folder, which a deletion repeated (a
    retried train) finishes, or finds gone."""
    store, folders = _store(config), round_steps(config, run_id, round_index)
    for folder in folders:
        store.delete(f"{folder}/{STEP_MANIFEST}")
    for folder in folders:
        store.delete_folder(folder, STEP_MANIFEST)


def sft_problems(config: RunConfig) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """The bootstrap's problems: to train on, to check every ``bootstrap.eval_every``
    steps (the early stop), and to score at its end (the run's test split). The
    checks, ``bootstrap.eval_prompts`` with ``eval_every``, are the last of each
    task's training problems in turn (the split is a seeded shuffle: a sample of
    the same distribution), and SFT does not train on them; RL later does. To
    train on besides, ``bootstrap.extra_problems``, seeded, none with a prompt
    of the splits or of each other."""
    train, checks, test = [], [], []
    for (task_train, task_test), share in zip(task_splits(config), config.bootstrap_checks):
        train += task_train[: len(task_train) - share]
        checks += task_train[len(task_train) - share :]
        test += task_test
    for drawn in extra_problems(config, {p.prompt for p in train + checks + test}):
        train += drawn
    return train, checks, test


def extra_problems(config: RunConfig, exclude: set[str]) -> Iterator[list[Problem]]:
    """Each of ``bootstrap.extra_problems`` in turn, seeded, none with a prompt
    in ``exclude`` (the splits'), which takes theirs as they are drawn. An entry
    whose task holds too few other problems is an error naming it."""
    for i, extra in enumerate(config.bootstrap.extra_problems):
        with _naming(f"bootstrap.extra_problems.{i}: size {extra.size}"):
            drawn = get_task(extra.name).generate(extra.size, config.seed, extra.difficulty, frozenset(exclude))
        exclude.update(p.prompt for p in drawn)
        yield drawn


def run_bootstrap(config: RunConfig, model, tokenizer) -> dict:
    """Bootstrap SFT of ``model`` (in place) on the run's train split but its checks (and any extra problems),
    scored greedily on its test split (:func:`sft_problems`)."""
    b = config.bootstrap
    train, checks, test = sft_problems(config)
    try:
        history = sft.bootstrap(
            model,
            tokenizer,
            train,
            checks,
            test,
            sft.BootstrapConfig(
                steps=b.steps,
                batch_size=b.batch_size,
                learning_rate=b.learning_rate,
                warmup=b.warmup,
                weight_decay=b.weight_decay,
                seed=config.seed,
                max_len=config.model.max_seq_len,
                target_accuracy=b.target_accuracy,
                eval_every=b.eval_every,
                max_new_tokens=config.rollout.max_new_tokens,
            ),
        )
    except sft.ExampleTooLong as e:  # max_len is the run's longest sequence
        raise ValueError(f"model.max_seq_len: {e}") from None
    return {
        "bootstrap_accuracy": history["accuracy"],
        "bootstrap_steps": history["steps"],
        "bootstrap_loss": history["loss"][-1],
        "bootstrap_seconds": history["seconds"],
    }


def train_config(config: RunConfig) -> TrainConfig:
    rl = config.rl
    return TrainConfig(
        method=config.method,
        learning_rate=rl.learning_rate,
        weight_decay=rl.weight_decay,
        betas=tuple(rl.adam_betas),
        grad_clip=rl.grad_clip,
        microbatch_size=rl.microbatch_size,
        grad_accumulation=rl.grad_accumulation,
        ppo_clip=rl.ppo_clip,
        tis_cap=rl.tis_cap,
        kl_coef=rl.kl_coef,
        temperature=config.rollout.temperature or 1.0,
        compute_dtype=compute_dtype(config),
        precision=config.train_precision,
        activation_checkpointing=config.train.activation_checkpointing,
    )


def _inline(config: RunConfig) -> bool:
    """Whether the rollout writes compacted guidance itself (else a full capture, compacted offline)."""
    return config.method == "trace" and config.guidance.compaction == "inline"


def rollout_writes_guidance(config: RunConfig) -> bool:
    """Whether the rollout's shards are the guidance itself; else compaction
    encodes them (offline compaction, or the syndrome codec)."""
    return _inline(config) and config.guidance.codec == "bits"


def rollout_captures(config: RunConfig) -> bool:
    """Whether the rollout records its FP4 outcomes: for guidance (trace), or
    to measure the train-rollout mismatch (``rl.measure_mismatch``)."""
    return config.method == "trace" or config.rl.measure_mismatch


def rollout_quant(config: RunConfig, name: str | None = None) -> QuantConfig:
    """What the run's rollout quantizes under rollout config ``name`` (default:
    the run's); QUADS' rollout also compensates its worst activation channels.
    ``rollout.activation_global_scale`` applies where activations are NVFP4
    (the schema refuses it for a run whose own config has none; another
    config evaluated beside it may have FP8 or BF16 activations)."""
    quant = rollout_config(name or config.rollout.config, config.rollout.fmt)
    channels = config.rollout.quads_compensated_channels if config.method == "quads" else 0
    mode = config.rollout.activation_global_scale if quant.activations == "nvfp4" else "static"
    return replace(quant, compensated_channels=channels, activation_global_scale=mode)


def _engine(config: RunConfig, policy: Path, capture: bool, device: torch.device) -> TorchEngine:
    """The rollout engine on ``device``, on the policy loaded there and handed
    over (no copy); a capturing one keeps everything, or with inline
    compaction only the selected layers' low bits."""
    model, quant = load_model(policy, device=device), rollout_quant(config)
    cfg = capture_config(config, quant, model.cfg) if capture else None
    return TorchEngine(model, quant, device=device, capture=cfg, take=True, **engine_options(config))


def capture_config(config: RunConfig, quant: QuantConfig, model_cfg) -> CaptureConfig:
    """What a rollout engine captures: everything, or with inline compaction
    only the selected layers' low bits."""
    if not _inline(config):
        return CaptureConfig(max_tokens=config.rollout.max_tokens_per_forward)
    layers = select_layers(config.guidance.layers, quant.fp4_layers(model_cfg))  # as offline compaction chooses
    return CaptureConfig(bits=config.guidance.bits, layers=layers, max_tokens=config.rollout.max_tokens_per_forward)


def engine_options(config: RunConfig) -> dict:
    """What every engine of the run (rollout, evaluation) takes from its config."""
    return {
        "dtype": compute_dtype(config),
        "calibration_seed": config.seed,
        "max_running_requests": config.rollout.max_running_requests,
    }


def sampling(config: RunConfig, tokenizer, *stream: int | str) -> SamplingParams:
    """The run's sampling for the random stream ``stream`` (seeded from the
    run's seed by :func:`derive_seed`), stopping on the tokenizer's stop ids
    (every eos; a plain tokenizer's newline too) and padding with its pad id;
    tis_sc's score centering also needs the sampler's top-k tokens."""
    r = config.rollout
    return SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop_tokens=tokenizer.stop_ids,
        pad_token=tokenizer.pad_id,
        seed=derive_seed(config.seed, *stream),
        record_topk=recorded_topk(config),
    )


def recorded_topk(config: RunConfig) -> int:
    """How many of the sampler's likeliest tokens a trajectory records per
    step: tis_sc's score centering reads them; other methods record none."""
    return SCORE_CENTERING_TOPK if config.method == "tis_sc" else 0


def policy_version(policy: Path, run_id: str) -> int:
    """The policy checkpoint's version (RL steps taken), refusing a checkpoint of another run."""
    saved = provenance(policy)
    if saved.get("run_id") != run_id or "policy_version" not in saved:
        raise RunMismatch(f"{policy}: policy of run {saved.get('run_id')!r}, this is run {run_id!r}")
    return saved["policy_version"]


def worker_prefix(prefix: str, config: RunConfig, worker: int) -> str:
    """Where rollout worker ``worker`` writes its capture (the run's own prefix with one worker)."""
    return f"{prefix}/worker-{worker:03d}" if config.rollout.workers > 1 else prefix


def rollout(config: RunConfig, policy: Path, round_index: int, out: Path, run_id: str = "", worker: int = 0) -> dict:
    """``steps_per_round`` steps' worth of trajectories from the current policy,
    to ``out`` (JSON lines behind a header); for trace (and when measuring
    mismatch), the capture goes to the store (step ``round_index``): full for
    offline compaction, already compacted inline. Returns the round's rollout
    figures (time, tokens, capture overhead, upload). With ``rollout.workers``
    N > 1 this is worker ``worker``'s share: a contiguous slice of every RL
    step's responses, numbered and seeded by their place in the round, so the
    N shares (:func:`gather`) are what one worker rolls out."""
    workers = config.rollout.workers
    if not 0 <= worker < workers:
        raise ValueError(f"rollout worker {worker} of {workers}")
    device = step_device(config)
    version, digest = policy_version(policy, run_id), folder_digest(policy)
    tokenizer = load_tokenizer(policy)
    steps = config.rl.steps_per_round
    chosen = training_problems(config, round_index, steps * config.rollout.prompts_per_step)
    batch = [p for p in chosen for _ in range(config.rollout.group_size)]
    engine = _engine(config, policy, capture=rollout_captures(config), device=device)
    writer = None
    if engine.capture is not None:  # written on a thread of its own while the engine decodes
        kind = store_prefix(config, run_id, _capture_kind(config))
        writer = BackgroundStepWriter(
            _store(config),
            rl_step=round_index,
            policy_version=version,
            top_k=engine.model.cfg.top_k,
            prefix=worker_prefix(kind, config, worker),
            trajectories_per_shard=config.guidance.trajectories_per_shard,
            run_id=run_id,
            policy=digest,
            merged=kind if workers > 1 else None,  # compaction's merge of the workers' steps (a retry's)
        )
    per_step = len(batch) // steps
    trajectories, mine = [], []
    start, upload_s = time.perf_counter(), 0.0
    for s in range(steps):  # one RL step's batch (this worker's share of it) per generate call
        lo, hi = s * per_step + per_step * worker // workers, s * per_step + per_step * (worker + 1) // workers
        params = sampling(config, tokenizer, "rollout", round_index * steps + s)  # policy version
        prompts = encode_prompts(config, tokenizer, batch[lo:hi])
        # the capture goes to the store in shards as their requests finish (the drains count as capture)
        shards = None
        if writer is not None:
            shards = FinishedShards(writer, engine.drain_capture, range(lo, hi), engine.rows_at_once(prompts))
        trajectories += engine.generate(prompts, params, first=lo, place=lo - s * per_step, finished=shards)
        mine += batch[lo:hi]
        if shards is not None:
            shards.check_all_written()
            upload_s += shards.seconds
    elapsed = time.perf_counter() - start - upload_s
    figures = {**throughput(trajectories, elapsed), **measured_on(device)}
    stats = {f"rollout_{key}": value for key, value in figures.items()}
    stats.update(capture_overhead_ratio=None, offload_seconds=None, upload_seconds=None)
    if writer is not None:
        seconds = engine.capture.seconds
        stats.update(
            capture_overhead_ratio=seconds["capture"] / stats["rollout_seconds"], offload_seconds=seconds["offload"]
        )
        uploading = time.perf_counter()
        writer.close()
        stats["upload_seconds"] = upload_s + time.perf_counter() - uploading
    header = {
        "run_id": run_id,
        "round": round_index,
        "policy_version": version,
        "policy": digest,
        "quant": asdict(engine.quant),
        "global_scales": encode_scales(engine.global_scales),
        "top_k": engine.model.cfg.top_k,
    }
    write_trajectories(Path(out), header, trajectories, mine)
    return stats


def _capture_kind(config: RunConfig) -> str:
    """What the rollout writes to the store: guidance (compacted inline) or the full capture."""
    return "guidance" if rollout_writes_guidance(config) else "capture"


def gather(
    config: RunConfig, parts: list[Path], part_stats: list[dict], round_index: int, out: Path, run_id: str = ""
) -> dict:
    """The round's trajectories from its rollout workers' ``parts`` (any
    order), in the order one worker writes them, to ``out``; their figures
    (``part_stats``) combined: tokens summed, times the slowest worker's, the
    workers' hardware each kind once (``; `` between kinds)."""
    headers, rows = [], []
    for part in parts:
        header, trajectories, batch = read_trajectories(part, run_id, round_index)
        headers.append(header)
        rows += zip(trajectories, batch)
    differ = [k for k in headers[0] if any(h[k] != headers[0][k] for h in headers[1:])]
    if differ:
        raise RunMismatch(f"rollout workers of round {round_index} disagree on {differ}")
    rows.sort(key=lambda row: row[0].id)
    expected = config.rl.steps_per_round * config.rollout.prompts_per_step * config.rollout.group_size
    if [t.id for t, _ in rows] != list(range(expected)):
        raise RunMismatch(
            f"rollout workers of round {round_index}: trajectories {[t.id for t, _ in rows]}, "
            f"expected 0..{expected - 1} once each"
        )
    write_trajectories(Path(out), headers[0], [t for t, _ in rows], [p for _, p in rows])
    slowest = max(s["rollout_seconds"] for s in part_stats)
    stats = {
        "rollout_seconds": slowest,
        "rollout_tokens": sum(s["rollout_tokens"] for s in part_stats),
        "capture_overhead_ratio": None,
        "offload_seconds": None,
        "upload_seconds": None,
    }
    stats["rollout_tokens_per_second"] = stats["rollout_tokens"] / slowest
    stats |= machines(part_stats, "rollout_")
    for key in ("capture_overhead_ratio", "offload_seconds", "upload_seconds"):
        values = [s[key] for s in part_stats if s.get(key) is not None]
        if values:
            stats[key] = max(values)
    return stats


def throughput(trajectories: list[Trajectory], seconds: float) -> dict:
    tokens = sum(len(t.response) for t in trajectories)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}


def check_policy_fits(config: RunConfig, cfg: ModelConfig, tokenizer) -> None:
    """The policy's architecture ``cfg`` and ``tokenizer`` against the run:
    the guided layers have FP4 sites, and every prompt a round or evaluation
    may draw, and every answer, fits (:func:`encode_prompts`,
    :func:`check_answers_fit`); a ValueError of ``field: reason`` lines. What
    prepare checks before any work, and a local run with a checkpoint's own
    before it starts (the configure task, without the checkpoint, checks a
    preset's alone)."""
    unguidable = config.guided_layer_problems(cfg, f"checkpoint {config.model.checkpoint}")
    if unguidable:
        raise ValueError("\n".join(unguidable))
    train, test = problems(config)
    encode_prompts(config, tokenizer, train + test)
    check_answers_fit(config, tokenizer, train + test)


def encode_prompts(config: RunConfig, tokenizer, problems: list[Problem]) -> list[list[int]]:
    """The problems' prompts as the policy reads them (through the chat template
    where there is one), each refused unless it leaves ``rollout.max_new_tokens``
    within ``model.max_seq_len``, the longest sequence the run allows: an
    error naming the fields that make room, and the task the prompt is of."""
    texts = [format_example(p) for p in problems]
    encoded = {text: tokenizer.encode_prompt(text) for text in dict.fromkeys(texts)}  # a group's prompt once
    prompts = [list(encoded[text]) for text in texts]
    room = config.model.max_seq_len - config.rollout.max_new_tokens
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]), default=None)
    if longest is not None and len(prompts[longest]) > room:
        problem = problems[longest]
        i = _task_index(config, problem)
        raise ValueError(
            f"model.max_seq_len: a prompt of {len(prompts[longest])} tokens ({problem.prompt!r}, tasks.{i}: "
            f"{_told(config, i)}) and rollout.max_new_tokens "
            f"{config.rollout.max_new_tokens} exceed model.max_seq_len {config.model.max_seq_len}: raise it or "
            f"lower rollout.max_new_tokens{_or_lower_difficulty(config, i)}"
        )
    return prompts


def check_answers_fit(config: RunConfig, tokenizer, problems: list[Problem]) -> None:
    """Refuse problems whose reference answer, through its end
    (:meth:`.tokenizer.PolicyTokenizer.encode_answer`), is longer than
    ``rollout.max_new_tokens``: a response the limit cuts before its end
    scores nothing (:func:`.tasks.reward_of`), so the run would train on
    nothing useful without a word. An error naming the field, the task entry
    and the longest answer; configure checks a library preset's answers with
    it, prepare every run's, in the checkpoint's tokenizer where there is one."""
    lengths = {answer: len(tokenizer.encode_answer(answer)) for answer in dict.fromkeys(p.answer for p in problems)}
    longest = max(problems, key=lambda p: lengths[p.answer], default=None)
    if longest is not None and lengths[longest.answer] > config.rollout.max_new_tokens:
        i = _task_index(config, longest)
        raise ValueError(
            f"rollout.max_new_tokens: {config.rollout.max_new_tokens} tokens cut answers such as {longest.answer!r} "
            f"(tasks.{i}: {_told(config, i)}) before their end "
            f"({lengths[longest.answer]} tokens), which then score nothing: raise it{_or_lower_difficulty(config, i)}"
        )


def _task_index(config: RunConfig, problem: Problem) -> int:
    """The entry of ``tasks`` that ``problem`` was drawn for: the one of its task's name (validation refuses a
    name listed twice)."""
    return next(i for i, t in enumerate(config.tasks) if t.name == problem.task)


def _told(config: RunConfig, i: int) -> str:
    """``tasks.i`` as an error names it: its family at its difficulty, or its name and file."""
    t = config.tasks[i]
    return f"{t.name} at difficulty {t.difficulty}" if t.data is None else f"{t.name} from {t.data}"


def _or_lower_difficulty(config: RunConfig, i: int) -> str:
    """The remedy that ``tasks.i`` offers a prompt or answer too long besides the field the error names: a
    lower difficulty, where it has one (1 has none)."""
    return f" or lower tasks.{i}.difficulty" * (config.tasks[i].difficulty > 1)


def write_trajectories(path: Path, header: dict, trajectories: list[Trajectory], batch: list[Problem]) -> Path:
    """JSON lines: the header (with the count of lines that follow), then one
    trajectory with its problem per line; whole or not at all."""

    def fill(f) -> None:
        f.write((json.dumps({"header": header | {"trajectories": len(trajectories)}}) + "\n").encode())
        for t, p in zip(trajectories, batch):
            f.write(trajectory_line(t, p))

    write_atomic(Path(path), fill)
    return path


def trajectory_line(trajectory: Trajectory, problem: Problem) -> bytes:
    """A trajectories file's line of one trajectory with its problem (without its task's reward function, a
    program: :func:`with_rewards` gives it back)."""
    problem_fields = {key: value for key, value in _fields(problem).items() if key != "reward"}
    return (json.dumps({"trajectory": _fields(trajectory), "problem": problem_fields}) + "\n").encode()


def _fields(record) -> dict:
    """A dataclass's fields by name, as they are: ``asdict`` copies every element
    of a trajectory's token lists, most of the time a rollout took to write a
    round's trajectories (at the paper's scale, minutes of an idle GPU)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


def read_trajectories(path: Path, run_id: str, round_index: int) -> tuple[dict, list[Trajectory], list[Problem]]:
    """A round's trajectories file, refused if another run or round wrote it,
    or if it holds other trajectories than its header counts (cut short, or
    lines repeated: the write is atomic, but a file is also copied and
    edited) or one twice. The header is returned without its count."""
    lines = Path(path).read_text().splitlines()
    try:
        header = json.loads(lines[0])["header"] if lines else {}
        count = header.pop("trajectories", None)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}, line 1: not a trajectories header ({e})") from None
    if (header.get("run_id"), header.get("round")) != (run_id, round_index):
        raise RunMismatch(
            f"{path}: trajectories of run {header.get('run_id')!r} round {header.get('round')}, "
            f"expected run {run_id!r} round {round_index}"
        )
    trajectories, batch = [], []
    for number, line in enumerate(lines[1:], 2):
        try:
            record = json.loads(line)
            trajectories.append(Trajectory(**record["trajectory"]))
            batch.append(Problem(**record["problem"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}, line {number}: not a trajectory record ({e})") from None
    if len(trajectories) != count:
        raise ValueError(f"{path}: {len(trajectories)} trajectories, its header counts {count}")
    ids = [t.id for t in trajectories]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: trajectory {next(i for i in ids if ids.count(i) > 1)} appears twice")
    return header, trajectories, batch


def rolled_out_by(header: dict) -> dict:
    """What the store's steps of a round must say of the rollout that wrote them (:func:`.guidance.read_step`'s
    ``expect``), from its trajectories' ``header``: its run, and the policy's version and folder."""
    return {key: header[key] for key in ("run_id", "policy_version", "policy")}


def compaction(
    config: RunConfig, policy: Path, trajectories_file: Path, round_index: int, run_id: str = ""
) -> tuple[GuidanceRef, dict]:
    """The guidance training reads for a round, as a :class:`GuidanceRef`, and
    its size: offline, compacted from the round's full capture (with the
    compaction's fidelity, measured on the first microbatch's trajectories);
    inline, the guidance the rollout wrote, measured by its shards' headers
    and sizes (at the paper's scale the shards are terabytes a round; the
    train step reads each, verified). Methods
    other than trace get a reference without shards: the rollout's numerics."""
    device = step_device(config)
    header, trajectories, _ = read_trajectories(trajectories_file, run_id, round_index)
    stats = dict.fromkeys(COMPACTION_KEYS)
    stats.update(layers=[], bits=config.guidance.bits)
    ref = GuidanceRef(
        run_id,
        round_index,
        header["policy_version"],
        QuantConfig(**header["quant"]),
        header["global_scales"],
        top_k=header["top_k"],
        policy=header["policy"],
    )
    expect = rolled_out_by(header)
    if config.rollout.workers > 1 and rollout_captures(config):  # one step of every worker's shards, where they lie
        kind = store_prefix(config, run_id, _capture_kind(config))
        sources = [worker_prefix(kind, config, w) for w in range(config.rollout.workers)]
        merge_steps(_store(config), round_index, sources, kind, expect)
    if config.method != "trace":
        return ref, stats
    start = time.perf_counter()
    store = _store(config)
    prefix = store_prefix(config, run_id, "guidance")
    cfg = read_config(policy)
    fp4_sites = [site for layer in ref.quant.fp4_layers(cfg) for site in ref.quant.fp4_sites(cfg, layer)]
    size = StepSize(fp4_sites)  # against a full capture of every FP4 layer, whichever codec and compaction
    if config.guidance.codec == "syndrome":
        _syndrome_step(config, store, round_index, header, run_id, size)
    elif _inline(config):  # the shards the rollout wrote, by their headers: training reads them, each verified
        for kept in iter_step_tables(store, round_index, prefix, expect):
            size.add(kept, kept)
    else:  # shard by shard: a round's full capture is never held at once
        writer = StepWriter(
            store,
            rl_step=round_index,
            policy_version=header["policy_version"],
            top_k=header["top_k"],
            prefix=prefix,
            trajectories_per_shard=config.guidance.trajectories_per_shard,
            run_id=run_id,
            policy=header["policy"],
        )
        sample = trajectories[: config.rl.microbatch_size]  # the compaction's fidelity is measured on these
        ids = torch.tensor([t.id for t in sample])
        layers, sampled, captured = None, [], 0
        for full in iter_step(store, round_index, store_prefix(config, run_id, "capture"), expect):
            layers = layers or select_layers(config.guidance.layers, sorted({layer for layer, _ in full.tables}))
            kept = compact(full, config.guidance.bits, layers)
            writer.add(kept)
            size.add(kept, full)
            captured += full.nbytes
            sampled.append((_restrict(full, ids), _restrict(kept, ids)))
        writer.close()
        training = teacher_force(_engine(config, policy, capture=False, device=device), sample, keep_inputs=True)
        full_sample, kept_sample = (CaptureRecords.concat(list(parts)) for parts in zip(*sampled))
        report = compaction_report(full_sample, kept_sample, training)
        stats.update(capture_bytes=captured, compaction_fidelity=report.total["fidelity"])
    layers = sorted({layer for layer, _ in size.tables})
    stats.update(
        layers=layers,
        guidance_bytes=size.guidance_bytes,
        guidance_bits_per_element=8 * size.guidance_bytes / size.elements if size.elements else None,
        compaction_ratio=size.guidance_bytes / size.full_bytes if size.full_bytes else None,
        compaction_seconds=time.perf_counter() - start,
        **{f"compaction_{key}": value for key, value in measured_on(device).items()},
    )
    sites = tuple(sorted({site for _, site in size.tables}))
    guided = replace(
        ref,
        store_uri=config.store.uri,
        prefix=prefix,
        codec=config.guidance.codec,
        bits=config.guidance.bits,
        layers=tuple(layers),
        sites=sites,
    )
    return guided, stats


def export_policy(config: RunConfig, policy: Path, out: Path) -> dict:
    """The policy for serving as this run's rollout served it (:func:`rollout_quant`:
    compressed-tensors where it quantized the expert weights, BF16 where it did
    not), quantized as the rollout quantizes it: its dtype, device and calibration seed."""
    device = step_device(config)
    return export(
        policy,
        out,
        rollout_quant(config),
        rollout_dtype=compute_dtype(config),
        device=device,
        calibration_seed=config.seed,
    )


def syndrome_coded(config: RunConfig, captured: CaptureRecords, previous: dict | None) -> tuple[CaptureRecords, dict]:
    """The guidance layers' tables of ``captured`` coded as parity bits
    (codec syndrome), at rates chosen from ``previous`` decode statistics
    (None: a first step's ``guidance.syndrome_rate``); and the rates."""
    chosen = select_layers(config.guidance.layers, sorted({layer for layer, _ in captured.tables}))
    kept = {key: t for key, t in captured.tables.items() if key[0] in chosen}
    rates = site_rates(kept, previous, config.guidance.syndrome_rate)
    return CaptureRecords({key: encode_table(t, rates[key]) for key, t in kept.items()}), rates


def _syndrome_step(config: RunConfig, store, round_index: int, header: dict, run_id: str, size: StepSize) -> None:
    """Encode the round's capture (inline: R-1 of the selected layers; offline:
    full) with the syndrome codec at rates chosen from the previous round's
    decode statistics, shard by shard, and write it as the round's guidance;
    the rates and the statistics they came from go into the manifest. Each
    coded shard is added to ``size``."""
    previous = read_decode_stats(store, store_prefix(config, run_id, "guidance"), round_index - 1)
    writer = StepWriter(
        store,
        rl_step=round_index,
        policy_version=header["policy_version"],
        top_k=header["top_k"],
        prefix=store_prefix(config, run_id, "guidance"),
        trajectories_per_shard=config.guidance.trajectories_per_shard,
        run_id=run_id,
        policy=header["policy"],
    )
    for captured in iter_step(store, round_index, store_prefix(config, run_id, "capture"), rolled_out_by(header)):
        coded, rates = syndrome_coded(config, captured, previous)  # a site's rate: its layout's and the previous step's
        writer.add(coded)
        size.add(coded, coded)
    writer.close(
        {
            "rates": {f"{layer}/{site}": [r.code_bits, r.scale_bits] for (layer, site), r in sorted(rates.items())},
            "first_rate": config.guidance.syndrome_rate,
            "previous_decode": previous,
        }
    )


def write_decode_stats(store, prefix: str, rl_step: int, stats: dict) -> None:
    """A step's decode statistics beside its guidance, where :func:`read_decode_stats` finds them."""
    store.put_bytes(f"{step_prefix(prefix, rl_step)}/{DECODE_FILE}", json.dumps(stats).encode())


def read_decode_stats(store, prefix: str, rl_step: int) -> dict | None:
    """A step's decode statistics (written by its training), or None where
    there are none (the first step of a run)."""
    key = f"{step_prefix(prefix, rl_step)}/{DECODE_FILE}"
    try:
        data = store.get_bytes(key)
    except ArtifactNotFound:
        return None
    try:
        stats = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GuidanceError(f"{store.uri}/{key}: not decode statistics (unreadable JSON: {e})") from None
    if not isinstance(stats, dict):
        raise GuidanceError(f"{store.uri}/{key}: not decode statistics (a JSON {type(stats).__name__})")
    return stats


def _restrict(records: CaptureRecords, trajectories: torch.Tensor) -> CaptureRecords:
    return CaptureRecords({k: t.select(torch.isin(t.traj, trajectories)) for k, t in records.tables.items()})


def train(
    config: RunConfig,
    policy: Path,
    state: Path,
    trajectories_file: Path,
    guidance: GuidanceRef,
    out: Path,
    out_state: Path,
    run_id: str = "",
    round_stats: dict | None = None,
    open_trainer=Trainer.from_checkpoint,
    device: torch.device | None = None,
) -> list[dict]:
    """``steps_per_round`` guided QAT steps over the round's trajectories, each
    an RL step (the schedule: docs/training.md), resuming from ``policy`` and its
    trainer ``state``; the new policy goes to ``out``, its state to ``out_state``.
    The training path quantizes with the rollout's numerics from ``guidance``,
    which must come from this run and the policy version being trained. One
    history row per step, with where it trained (``train_device``,
    ``train_cpu_bf16``: :func:`.device.measured_on`); the round's rollout and
    compaction figures (``round_stats``) are repeated in each. ``open_trainer`` makes the trainer
    from the policy (:meth:`Trainer.from_checkpoint`; a distributed one, see
    :mod:`.distributed`, may resume within the round: steps it already took,
    listed in its ``history``, are not taken again). ``device``: where it
    computes, ``resources.device`` unless given (a rank's own GPU)."""
    device = step_device(config) if device is None else device
    round_index = guidance.rl_step
    header, trajectories, batch = read_trajectories(trajectories_file, run_id, round_index)
    batch = with_rewards(config, batch)
    tokenizer = load_tokenizer(policy)
    # the state is refused unless it is this run's and was saved with this very policy folder
    trainer = open_trainer(policy, state, train_config(config), guidance.quant, guidance.scales(), device, run_id)
    version = trainer.step - len(trainer.history)  # the policy version the round trains
    digest = folder_digest(policy)
    guidance.check(run_id, version, digest)
    if header["policy_version"] != version:
        raise RunMismatch(
            f"{trajectories_file}: rolled out by policy version {header['policy_version']}, "
            f"the policy to train is version {version}"
        )
    if header["policy"] != digest:
        raise RunMismatch(
            f"{trajectories_file}: rolled out by another policy folder (digest {header['policy']}) than the one to "
            f"train ({digest}): is run id {run_id!r} used by two runs?"
        )
    store = _store(config)
    full = None
    if config.rl.measure_mismatch:
        full = read_step(
            store,
            round_index,
            store_prefix(config, run_id, "capture"),
            rolled_out_by(header),
        )
    per_step = config.rollout.prompts_per_step * config.rollout.group_size
    trained_on = {f"train_{key}": value for key, value in measured_on(device).items()}
    history, decoded = list(trainer.history), dict(trainer.decoded)
    for s in range(len(history), config.rl.steps_per_round):
        start = time.perf_counter()
        part = slice(s * per_step, (s + 1) * per_step)
        step_trajectories, step_problems = trajectories[part], batch[part]
        rewards = torch.tensor(
            [
                reward_of(p, tokenizer.response_text(t.response), t.finished)
                for t, p in zip(step_trajectories, step_problems)
            ]
        )
        scored = time.perf_counter()  # a reward of the user's own (a program under test) may take long
        loader = None
        if config.method == "trace":
            microbatches = trainer.microbatches(step_trajectories)
            ids = [[t.id for t in microbatches[i]] for i in trainer.guidance_order(len(microbatches))]
            loader = guidance.loader(
                store,
                ids,
                prefetch=config.guidance.prefetch_microbatches,
                allow_rtn_fallback=config.guidance.allow_rtn_fallback,
            )
        measured = _restrict(full, torch.tensor([t.id for t in step_trajectories])) if full is not None else None
        with contextlib.nullcontext() if loader is None else loader:  # closed: its prefetch thread ends with the step
            stats = trainer.train_step(
                step_trajectories, group_advantages(rewards, config.rollout.group_size), loader, measured
            )
        stats["train_seconds"] = time.perf_counter() - scored - stats["reload_seconds"]
        stats["reward_seconds"] = scored - start
        for key, found in stats.pop("guidance_decode").items():
            decoded[key] = merge_decode_json(decoded.get(key), found)
        lengths = torch.tensor([len(t.response) for t in step_trajectories], dtype=torch.float32)
        rollout_lp = torch.tensor([lp for t in step_trajectories for lp in t.logprobs])
        history.append(
            {
                "method": config.method,
                "round": round_index,
                "step": trainer.step,
                "staleness": s,
                "reward_mean": rewards.mean().item(),
                "accuracy": solved(rewards).float().mean().item(),
                "task_solved": solved_by_task(step_problems, rewards),
                "entropy": -rollout_lp.mean().item(),  # per token, estimated from the sampled tokens
                "response_length": lengths.mean().item(),
                **stats,
                **trained_on,
                **{key: (round_stats or {}).get(key) for key in ROUND_KEYS},
            }
        )
        trainer.step_done(history, decoded)
    if decoded:  # the next round's compaction chooses its syndrome rates from these
        trainer.once(
            lambda: write_decode_stats(store, guidance.prefix, round_index, decoded),
            f"write round {round_index}'s decode statistics",
        )
    trainer.save(out, out_state, extra=tokenizer.files(), run_id=run_id, decoded=decoded)
    if round_index > 0 and rollout_captures(config) and not config.guidance.keep_steps:
        trainer.once(
            lambda: delete_round_steps(config, run_id, round_index - 1),
            f"delete round {round_index - 1}'s guidance and capture",
        )
    return history


def solved_by_task(problems: list[Problem], rewards: torch.Tensor) -> dict[str, list[int]]:
    """Each task's responses solved (reward 1) and drawn, of a step's ``problems``: a mix's tasks learn at
    their own pace, which the step's accuracy over all of them hides."""
    out: dict[str, list[int]] = {}
    for problem, reward in zip(problems, rewards.tolist()):
        counts = out.setdefault(problem.task, [0, 0])
        counts[0] += solved(reward)
        counts[1] += 1
    return out


def run_round(
    config: RunConfig,
    policy: Path,
    state: Path,
    round_index: int,
    out: Path,
    out_state: Path,
    workdir: Path,
    run_id: str = "",
) -> list[dict]:
    """One round in one process, through the same three steps the pipeline runs
    as components: rollout -> compaction -> guided QAT from ``policy`` and its
    trainer ``state``; the new policy to ``out``, its state to ``out_state``."""
    trajectories = Path(workdir) / f"trajectories-{round_index}.jsonl"
    rollout_stats = rollout(config, policy, round_index, trajectories, run_id)
    guidance, compaction_stats = compaction(config, policy, trajectories, round_index, run_id)
    stats = {**rollout_stats, **compaction_stats}
    return train(config, policy, state, trajectories, guidance, out, out_state, run_id, stats)
