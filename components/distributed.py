"""Guided QAT over several processes with torch.distributed: FSDP2 sharding,
each rank's share of the microbatches, metrics reduced over ranks, and
checkpoints that survive a rank's death.

One process (``train.nodes`` x ``train.processes_per_node`` = 1) trains in
the train step itself (:class:`~.trainer.Trainer`). More run this module
under torchrun semantics (``env://``: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...), started by ``torchrun`` locally or by a Kubeflow Trainer
TrainJob on a cluster (:mod:`tracefp4.pipelines.launch`); the round's inputs
come as paths or store URIs. How it works:

- every :class:`~.model.Block` and then the whole model is ``fully_shard``-ed
  (FSDP2): each rank holds 1/world of the float32 master weights, gradients
  and AdamW state; the layers are gathered for their forward and backward.
  The compute dtype is the trainer's autocast (bf16), gradients are
  reduce-scattered in float32; FSDP averages them and the optimizer step
  multiplies by W (each rank's loss is already its share of the step's
  token-weighted loss), so W ranks compute the gradient one process does, up
  to float32 summation order;
- rank 0 alone reads the round's policy and trainer state, one tensor at a
  time; every rank builds the model on the meta device and takes its shards
  of the weights and AdamW moments from each tensor rank 0 broadcasts
  (:meth:`DistributedTrainer.from_checkpoint`);
- rank r trains the r-th of W contiguous runs of each optimizer step's
  group of microbatches and loads only their guidance: where a guidance
  shard holds no more than one rank's run, each rank reads about 1/W of a
  step's shards; every group must split evenly, so every rank takes part in
  every collective;
- after each RL step the sharded state (weights, optimizer, the round's
  history so far) goes to the store through torch.distributed.checkpoint,
  the ``.metadata`` object last: a step whose ``.metadata`` is missing is
  incomplete and never read, and the step before is deleted once the new
  one is complete. A rerun of the round resumes from its last complete step;
  at the end the ranks gather the parameters and then the moments one tensor
  at a time and rank 0 writes the consolidated policy (the Hugging Face
  folder) and trainer state, what one process writes, each atomically,
  holding about one file of them at a time; the round's sharded checkpoints
  are then deleted;
- the other ranks wait for each piece of rank 0's serial work (a tensor read
  or written, a checkpoint completed, the outputs published) in
  :func:`rank0_does`, which stops them with rank 0's reason when it fails.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from .checkpoint import PolicyReader, fetch, folder_digest, size_and_sha256, sizes_and_sha256, upload_folder
from .choices import uneven_split
from .device import compute_on, resolve
from .model import Transformer, empty_model
from .precision import MasterWeights
from .quant_config import QuantConfig
from .steps import config_digest, store_prefix
from .store import ArtifactNotFound, ArtifactStore, StoreError, open_store, write_atomic
from .tensor_files import layout_of, read_tensor, tensor_files, tensor_layout
from .trainer import (
    MASTER_PREFIX,
    OPTIMIZER_PREFIX,
    OWN_SETTINGS,
    TrainConfig,
    Trainer,
    clip_gradients,
)
from .trainer_state import STEM, check_state

METADATA = ".metadata"  # written last by torch.distributed.checkpoint's coordinator: a complete checkpoint
HISTORY = "history.json"
# HISTORY's fields
RECORD_FIELDS = ("run_id", "start_version", "policy", "round_inputs", "step", "files", "history", "decoded")
# How long the ranks wait for rank 0's serial work (downloading and checksumming the round's policy and
# trainer state, reading or writing one of its tensors; checksumming and uploading the new ones: hundreds of GB at
# the paper's scale), and for each other's transfers of a sharded checkpoint (tens of GB a rank), in collectives of
# a gloo group of their own: train.timeout_seconds bounds the collectives of ranks that all compute, where a longer
# wait means a rank died or hangs
RANK0_IO_TIMEOUT = timedelta(hours=6)
_rank0_io: list = []  # that group, made with the process group (every rank must make it, in the same order)


class DistributedError(RuntimeError):
    """A distributed run that cannot go on as configured."""


def init_process_group(config) -> torch.device:
    """Join the process group torchrun (or a TrainJob) describes in the
    environment: gloo on CPU; on CUDA, NCCL with this rank on GPU
    ``LOCAL_RANK`` of its node. A collective that waits longer than
    ``train.timeout_seconds`` (a rank died or hangs) raises instead of waiting
    forever. Returns this rank's device; the config stays the launching
    step's, whose digest names the round's checkpoints on every rank
    (:func:`checkpoints_prefix`)."""
    device = resolve(config.resources.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    compute_on(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=config.train.timeout_seconds))
    _rank0_io[:] = [dist.new_group(backend="gloo", timeout=RANK0_IO_TIMEOUT)]
    return device


def rank0_does(work, what: str):
    """``work()`` run by rank 0 alone and what it returns there (None on the
    others), every rank past this point only once it has succeeded: its
    exception raised on rank 0 and, with its reason, as a
    :class:`DistributedError` ("rank 0 could not ``what``") on the others,
    which would otherwise wait for rank 0 in their next collective until it
    timed out. They wait in the group of rank 0's serial work
    (:data:`RANK0_IO_TIMEOUT`), longer than ``train.timeout_seconds`` bounds a
    collective: rank 0 may be reading or writing hundreds of GB."""
    if dist.get_rank():
        listen_to_rank0(what)
        return None
    try:
        value = work()
    except Exception as e:
        tell_the_ranks(e)
        raise
    tell_the_ranks(None)
    return value


def tell_the_ranks(failure: Exception | None) -> None:
    """Rank 0's half of :func:`rank0_does`: the others go on, or stop with ``failure``'s reason."""
    reason = None if failure is None else f"{type(failure).__name__}: {failure}"
    dist.broadcast_object_list([reason], src=0, group=_rank0_io[0])


def listen_to_rank0(what: str) -> None:
    """The other ranks' half of :func:`rank0_does`: wait for rank 0's word, raise its failure."""
    reason = [None]
    dist.broadcast_object_list(reason, src=0, group=_rank0_io[0])
    if reason[0] is not None:
        raise DistributedError(f"rank 0 could not {what}: {reason[0]}")


def from_rank0(read, what: str):
    """``read()`` run by rank 0 alone (:func:`rank0_does`), what it returns
    (small, picklable) given to every rank."""
    shared = [rank0_does(read, what)]
    dist.broadcast_object_list(shared, src=0, group=_rank0_io[0])
    return shared[0]


def mixed_precision() -> MixedPrecisionPolicy:
    """FSDP2's precision: parameters gathered as the trainer holds them (float32
    masters; its bf16 autocast sets the compute dtype, as in one process),
    gradients reduced in float32."""
    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)


def on_host(item: object) -> object:
    """``item`` with every tensor in it (in lists and tuples, nested) copied to the host."""
    if isinstance(item, Tensor):
        return item.cpu()
    if isinstance(item, (list, tuple)):
        return type(item)(on_host(part) for part in item)
    return item


@torch.no_grad()
def _take_shard(target: Tensor, whole: Tensor) -> None:
    """Copy this rank's shard of ``whole`` into ``target``: a sharded parameter
    or moment (a DTensor) takes its own part, a plain tensor all of it."""
    if isinstance(target, DTensor):
        mine = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(mine.to_local())
    else:
        target.copy_(whole)


def rank_microbatches(microbatches: int, group: int, rank: int, world: int) -> list[int]:
    """The microbatches rank ``rank`` of ``world`` trains: the rank-th of ``world``
    contiguous runs of each optimizer step's group of ``group`` microbatches
    (the last group may hold fewer; every group's size is a multiple of
    ``world``, so every rank takes part in each). Contiguous, not round-robin:
    where a guidance shard holds no more than one rank's run
    (``guidance.trajectories_per_shard``), each rank reads its own shards
    alone, about 1/``world`` of a step's (round-robin: two ranks or more each)."""
    mine = []
    for start in range(0, microbatches, group):
        share = min(group, microbatches - start) // world
        mine += range(start + rank * share, start + (rank + 1) * share)
    return mine


class DistributedTrainer(Trainer):
    """A :class:`Trainer` whose model, gradients and optimizer state are sharded
    over the ranks of the default process group, which must be initialized.

    ``model`` may be on the meta device (:meth:`from_checkpoint`): each rank
    then allocates its own shards on ``device``, to be filled (:meth:`receive`)."""

    def __init__(
        self,
        model: Transformer,
        config: TrainConfig,
        quant: QuantConfig,
        global_scales: dict,
        device: str | torch.device | None = None,
    ):
        if not dist.is_initialized():
            raise DistributedError("a DistributedTrainer needs torch.distributed initialized (run under torchrun)")
        if config.precision != "fp32_master":
            raise DistributedError(
                f"train.precision {config.precision}: distributed training needs fp32_master (FSDP2 shards the "
                "float32 parameters themselves; bf16 parameters with float32 masters beside them train in one process)"
            )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.place = torch.device(device) if device is not None else next(model.parameters()).device
        self.mesh = init_device_mesh(self.place.type, (self.world,))
        self.checkpoints: ShardCheckpoints | None = None
        super().__init__(model, config, quant, global_scales)

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
    ) -> "DistributedTrainer":
        """Every rank's trainer, resumed as :meth:`Trainer.from_checkpoint`
        resumes one. Rank 0 alone reads the policy and the trainer state, one
        tensor at a time; every rank builds the model on the meta device,
        allocates its own shards and takes their values, then its shards of
        the AdamW moments, from the tensors rank 0 hands out (:meth:`receive`).
        Each rank reading both whole would hold W copies, and rank 0 reading
        them whole would hold them once: at Qwen3.5-35B-A3B the float32
        parameters are 140 GB, more than an H200's memory, and their moments
        280 GB more."""
        readers: dict = {}  # rank 0's

        def open_policy():
            meta = check_state(state, policy, run_id)  # checked and pinned; its tensors are read later
            reader = readers["policy"] = PolicyReader(policy)
            return reader.cfg, reader.dtype, reader.stacked, meta

        cfg, dtype, stacked, meta = from_rank0(open_policy, f"read the policy {policy} or its trainer state")
        trainer = cls(empty_model(cfg, dtype, "meta"), config, quant, global_scales, device)
        trainer.receive_weights(stacked, readers.pop("policy", None))
        trainer.receive_state(Path(state), meta)
        trainer.step = meta["policy_version"]
        return trainer

    def receive_weights(self, stacked: list[str], reader: PolicyReader | None) -> None:
        """The ``stacked`` weights of rank 0's ``reader`` (None elsewhere), in
        this rank's shards of the trained model and of its KL reference."""
        states = [m.state_dict() for m in (self.model, self.reference) if m is not None]
        layout = {name: (states[0][name].shape, states[0][name].dtype) for name in stacked}

        def read(name: str) -> Tensor:
            whole = torch.empty(layout[name][0], dtype=layout[name][1])
            reader.read_into(name, whole)
            return whole

        for name, whole in self.receive(layout, read):
            for weights in states:  # the trained model and its KL reference start alike
                _take_shard(weights[name], whole)

    def receive_state(self, state: Path, meta: dict) -> None:
        """The trainer state at ``state`` (read by rank 0; ``meta``, its checked
        metadata): saved float32 master weights into this rank's shards of the
        trained model and of its KL reference (as one process loads them),
        AdamW's moments into this rank's shards of them."""
        files: dict = {}  # rank 0's

        def open_state():
            files.update(tensor_files(state, STEM))
            return tensor_layout(files)

        layout = from_rank0(open_state, f"read the trainer state {state}")
        params = dict(self.model.named_parameters())
        names = list(params)  # the optimizer's parameter order
        reference = dict(self.reference.named_parameters()) if self.reference is not None else {}
        masters = {key.removeprefix(MASTER_PREFIX) for key in layout if key.startswith(MASTER_PREFIX)}
        if masters:  # refused before any is taken, on every rank alike (each holds the layout)
            self.weights.check(masters)
        moments: dict[int, dict] = {}
        for key, whole in self.receive(layout, lambda key: read_tensor(files, key)):
            if key.startswith(MASTER_PREFIX):
                name = key.removeprefix(MASTER_PREFIX)
                for target in (params[name], reference.get(name)):
                    if target is not None:
                        _take_shard(target, whole)
            elif key.startswith(OPTIMIZER_PREFIX):
                index, item = key.removeprefix(OPTIMIZER_PREFIX).split(".", 1)
                if whole.dim() == 0:  # AdamW's step: a host scalar
                    value = whole.cpu()
                else:
                    value = torch.empty_like(params[names[int(index)]])
                    _take_shard(value, whole)
                moments.setdefault(int(index), {})[item] = value
        if moments:
            self.load_optimizer_state({"state": moments, "param_groups": meta["param_groups"]})
        else:  # a fresh policy: the optimizer makes its state at its first step
            for group, saved in zip(self.optimizer.param_groups, meta["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params" and k not in OWN_SETTINGS})

    def receive(self, layout: dict[str, tuple], read) -> Iterator[tuple[str, Tensor]]:
        """Each tensor ``layout`` names (name: shape, dtype) whole on every
        rank's device, one at a time: rank 0 reads it (``read(name)``), a
        broadcast hands it to the others. The converse of :meth:`stream`.

        The others wait for each read in :func:`rank0_does` (on the host:
        NCCL's collectives do not block it, and it times an operation from
        when it is queued, so they would otherwise queue a whole policy's
        broadcasts at once and wait out rank 0's reading of all of it under
        ``train.timeout_seconds``), and a read that fails stops them with its
        reason."""
        for name, (shape, dtype) in layout.items():
            whole = rank0_does(lambda name=name: read(name).to(self.place), f"read {name}")
            if self.rank:
                whole = torch.empty(shape, dtype=dtype, device=self.place)
            dist.broadcast(whole, src=0)
            yield name, whole

    def wrap(self, model: Transformer) -> Transformer:
        policy = mixed_precision()
        for block in model.model.layers:
            fully_shard(block, mesh=self.mesh, mp_policy=policy)
        fully_shard(model, mesh=self.mesh, mp_policy=policy)
        if next(model.parameters()).is_meta:  # this rank's shards alone allocated, filled by from_checkpoint
            model.to_empty(device=self.place)
        if model.training:  # the optimizer steps the sharded parameters (float32: they are their own master)
            self.weights = MasterWeights(model, self.config.precision, self.config.compute_dtype)
        return model

    def owned(self, microbatches: int, group: int) -> list[int]:
        problem = uneven_split(microbatches, group, self.world)
        if problem is not None:
            raise DistributedError(
                f"{problem} (set rl.microbatch_size, rl.grad_accumulation, rollout.prompts_per_step or "
                "rollout.group_size to fit)"
            )
        return rank_microbatches(microbatches, group, self.rank, self.world)

    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)  # NCCL reduces GPU tensors only
        dist.all_reduce(t)
        return t.tolist()

    def all_gather(self, item: object) -> list:
        # tensors travel as host tensors: a pickled CUDA tensor loads on the GPU of the rank that sent it
        out = [None] * self.world
        dist.all_gather_object(out, on_host(item))
        return out

    def _optimizer_step(self) -> Tensor:
        # FSDP averages the ranks' gradients; each rank's loss is already its share of the whole, so the
        # sum is wanted (gloo has no pre-scaled sum to ask FSDP for it): exact for a power-of-two world
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.world)
        norm = clip_gradients(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # read with the step's other figures

    def step_done(self, history: list[dict], decoded: dict[str, dict]) -> None:
        if self.checkpoints is not None:
            self.checkpoints.save(self, history, decoded)

    def once(self, write, what: str) -> None:
        rank0_does(write, what)

    @torch.no_grad()
    def stream(self, tensors: dict[str, Tensor], write) -> None:
        """Rank 0's ``write(layout, values)`` of the sharded ``tensors``,
        gathered one at a time on every rank in the same order: rank 0 holds
        about one file's worth of them (:class:`~.tensor_files.TensorWriter`),
        not all the parameters (140 GB in float32 at Qwen3.5-35B-A3B) or
        their moments (280 GB). Every rank returns once rank 0 has written them.

        Before each gather, and at the end, the others wait for rank 0's word
        (:func:`rank0_does`, for the reasons :meth:`receive` gives): a write
        that fails (a full disk) stops them with its reason."""
        what = f"write {', '.join(list(tensors)[:2])}... ({len(tensors)} tensors)"
        if self.rank:
            for t in tensors.values():
                listen_to_rank0(what)
                _whole(t)
            listen_to_rank0(what)
            return

        taken = [0]

        def gathered() -> Iterator[tuple[str, Tensor]]:
            for name, t in tensors.items():
                tell_the_ranks(None)
                taken[0] += 1
                yield name, _whole(t).cpu()

        def write_all() -> None:
            write(layout_of(tensors), gathered())
            if taken[0] < len(tensors):  # the others wait for the next gather: told this failure instead
                raise RuntimeError(f"the writer returned after {taken[0]} of the {len(tensors)} tensors")

        rank0_does(write_all, what)


def _whole(t: Tensor) -> Tensor:
    """``t`` whole on every rank: a sharded tensor (a DTensor) gathered, a plain one as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class ShardCheckpoints:
    """A round's sharded checkpoints in the store, one per RL step taken:
    ``<prefix>/step-<policy version>/`` holds each rank's torch.distributed.checkpoint
    files, the round's history and syndrome decode statistics so far with
    every file's size and sha256, and last the ``.metadata`` that makes it
    complete. A resume reads the files the history names and refuses one that
    differs. Each is pinned to the round's run, starting version, policy
    folder (``policy``: its :func:`~.checkpoint.folder_digest`) and
    trajectories and guidance (``inputs``: :func:`round_inputs`): a run id
    given twice must not resume one run's round onto another's policy, nor
    steps taken on one rollout of the round into training on another."""

    def __init__(
        self, store: ArtifactStore, prefix: str, run_id: str, start_version: int, policy: str, inputs: dict[str, str]
    ):
        self.store, self.prefix = store, prefix.rstrip("/")
        self.run_id, self.start_version, self.policy, self.inputs = run_id, start_version, policy, inputs

    def _key(self, version: int) -> str:
        return f"{self.prefix}/step-{version:06d}"

    def latest(self) -> int | None:
        """The policy version of the newest complete checkpoint of the round, if any."""
        done = [key.split("/")[-2] for key in self.store.list(self.prefix + "/") if key.endswith("/" + METADATA)]
        versions = [int(name.removeprefix("step-")) for name in done if name.startswith("step-")]
        return max(versions, default=None)

    def save(self, trainer: DistributedTrainer, history: list[dict], decoded: dict[str, dict]) -> None:
        key = self._key(trainer.step)
        model_state, optimizer = get_state_dict(trainer.model, trainer.optimizer)
        with tempfile.TemporaryDirectory(prefix="tracefp4-dcp-") as local:
            # items every rank holds alike (optimizer step counts, param groups) go in rank 0's file, not spread
            # over all of them: a resumed rank then reads its own file and rank 0's (files_read)
            planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
            dcp.save({"model": model_state, "optimizer": optimizer}, checkpoint_id=local, planner=planner)
            written = sorted(Path(local).iterdir())  # the coordinator's include .metadata
            for f in written:
                if f.name != METADATA:
                    self.store.upload(f"{key}/{f.name}", f)
            sums = {f.name: s for f, s in zip(written, sizes_and_sha256(written))}
            # gathered from each rank after its uploads: every rank's files are in the store
            files = {name: s for rank in after_transfers(sums) for name, s in rank.items()}

            def complete() -> None:
                meta = {
                    "run_id": self.run_id,
                    "start_version": self.start_version,
                    "policy": self.policy,
                    "round_inputs": self.inputs,
                    "step": trainer.step,
                    "files": files,
                }
                record = {**meta, "history": history, "decoded": decoded}
                self.store.put_bytes(f"{key}/{HISTORY}", json.dumps(record).encode())
                self.store.upload(f"{key}/{METADATA}", Path(local) / METADATA)  # complete
                self.clear(keep=trainer.step)

            rank0_does(complete, f"complete the checkpoint {self.store.uri}/{key}")

    def _record(self, key: str) -> dict:
        """The record :meth:`save` wrote beside the checkpoint at ``key`` (its
        run, policy, step, history, decode statistics and files' checksums),
        refused, naming it, where it cannot be read or lacks a field."""
        name = f"{self.store.uri}/{key}/{HISTORY}"
        try:
            meta = json.loads(self.store.get_bytes(f"{key}/{HISTORY}"))
        except ArtifactNotFound:
            raise DistributedError(f"{name}: missing beside the checkpoint's {METADATA}; {self._again(key)}") from None
        except ValueError as e:
            raise DistributedError(f"{name}: unreadable ({e}); {self._again(key)}") from None
        missing = [field for field in RECORD_FIELDS if not isinstance(meta, dict) or field not in meta]
        if missing:
            raise DistributedError(
                f"{name}: without {', '.join(missing)} (damaged, or by an older tracefp4); {self._again(key)}"
            )
        return meta

    def _again(self, key: str) -> str:
        """What to do about a damaged checkpoint at ``key``."""
        return f"delete {self.store.uri}/{key}/ to train the round from its start"

    def _fetch(self, key: str, name: str, files: dict, folder: Path) -> None:
        """Download one file of the checkpoint at ``key``, checked against the size and sha256 it was written with."""
        if name not in files:
            raise DistributedError(f"{self.store.uri}/{key}: {name} is not among the files the checkpoint wrote")
        path = folder / name
        try:
            self.store.download(f"{key}/{name}", path)
        except ArtifactNotFound:
            raise DistributedError(
                f"{self.store.uri}/{key}/{name}: missing, though the checkpoint wrote it; {self._again(key)}"
            ) from None
        if size_and_sha256(path) != tuple(files[name]):
            raise DistributedError(
                f"{self.store.uri}/{key}/{name}: not the file this checkpoint wrote (size or sha256 "
                f"differs); {self._again(key)}"
            )

    def clear(self, keep: int | None = None) -> None:
        """Delete the round's checkpoints but the one at version ``keep``."""
        clear_checkpoints(self.store, self.prefix, None if keep is None else self._key(keep))

    def load(self, trainer: DistributedTrainer, version: int) -> tuple[int, int]:
        """Resume ``trainer`` (on every rank) from the complete checkpoint at
        ``version``; returns how many of its shard files this rank read, of how many."""
        key = self._key(version)
        meta = self._record(key)
        if (meta["run_id"], meta["start_version"]) != (self.run_id, self.start_version):
            raise DistributedError(
                f"{self.store.uri}/{key}: checkpoint of run {meta['run_id']!r} from policy version "
                f"{meta['start_version']}, this round is run {self.run_id!r} from version {self.start_version}"
            )
        if meta.get("policy") != self.policy:
            raise DistributedError(
                f"{self.store.uri}/{key}: checkpoint of a round from another policy folder (digest "
                f"{meta.get('policy')}, this round's {self.policy}): is run id {self.run_id!r} used by two runs?"
            )
        if meta["round_inputs"] != self.inputs:
            raise DistributedError(
                f"{self.store.uri}/{key}: checkpoint of a round trained on other trajectories or guidance (sha256 "
                f"{meta['round_inputs']}, this round's {self.inputs}): another rollout of the round, or run id "
                f"{self.run_id!r} used by two runs? {self._again(key)}"
            )
        model_state, optimizer = get_state_dict(trainer.model, trainer.optimizer)
        state = {"model": model_state, "optimizer": optimizer}
        with tempfile.TemporaryDirectory(prefix="tracefp4-dcp-") as local:
            self._fetch(key, METADATA, meta["files"], Path(local))
            read = files_read(state, local)
            for name in sorted(read):
                self._fetch(key, name, meta["files"], Path(local))
            after_transfers(None)  # every rank's files here: load's collectives wait for no download
            dcp.load(state, checkpoint_id=local)
        set_state_dict(
            trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        trainer.step, trainer.history, trainer.decoded = meta["step"], meta["history"], meta["decoded"]
        return len(read), len(meta["files"]) - 1


def after_transfers(item: object) -> list:
    """``item`` of every rank, by rank, once each has ended its own transfers of
    a sharded checkpoint to or from the store: in the group that waits for I/O
    (:data:`RANK0_IO_TIMEOUT`), not under ``train.timeout_seconds``. Each rank
    uploads and checksums its own file, tens of GB at the paper's scale, and a
    resuming rank but 0 downloads rank 0's besides (:func:`files_read`): a
    slower link, or twice rank 0's download, timed out the ranks that were done
    first as if the other had hung."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, item, group=_rank0_io[0])
    return gathered


def files_read(state: dict, folder: str) -> set[str]:
    """The files of the checkpoint in ``folder`` (only its ``.metadata`` need be
    there) that loading ``state`` reads on this rank, as torch.distributed.checkpoint
    plans it: the rank's own shards' file and rank 0's (:meth:`ShardCheckpoints.save`),
    not every rank's, which at scale is the whole trainer state on every rank."""
    metadata = FileSystemReader(folder).read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return {metadata.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items}


def checkpoints_prefix(config, run_id: str, rl_step: int) -> str:
    """Where a round's sharded checkpoints live: keyed by its first RL step and
    the run's settings (:func:`.steps.config_digest`), so that only a retry of
    the round resumes them."""
    return f"{store_prefix(config, run_id, 'checkpoints')}/round-{rl_step:06d}-{config_digest(config)}"


def clear_checkpoints(store: ArtifactStore, prefix: str, keep: str | None = None) -> None:
    """Delete the sharded checkpoints under ``prefix`` but the one under ``keep``; each
    loses its ``.metadata`` first, so that a half-deleted one is never read."""
    store.delete_folder(prefix, METADATA, keep)


def round_inputs(trajectories: Path, guidance: Path) -> dict[str, str]:
    """The sha256 of a round's trajectories and of its guidance reference: what,
    beside the policy, its sharded checkpoints were trained on."""
    return {"trajectories": size_and_sha256(trajectories)[1], "guidance": size_and_sha256(guidance)[1]}


def open_trainer(prefix: str | None, store: ArtifactStore | None, run_id: str, inputs: dict[str, str]):
    """``steps.train``'s ``open_trainer`` for a distributed round: the policy
    folder sharded over the ranks, resumed from the round's newest complete
    sharded checkpoint under ``prefix`` (:func:`checkpoints_prefix`) in ``store`` when there is one
    (refused where it was trained on other ``inputs``: :func:`round_inputs`)."""

    def make(
        policy, state, config: TrainConfig, quant: QuantConfig, global_scales: dict, device, run_id: str
    ) -> DistributedTrainer:
        trainer = DistributedTrainer.from_checkpoint(policy, state, config, quant, global_scales, device, run_id)
        if prefix is not None:
            trainer.checkpoints = ShardCheckpoints(store, prefix, run_id, trainer.step, folder_digest(policy), inputs)
            latest = trainer.checkpoints.latest()
            if latest is not None:
                read, written = trainer.checkpoints.load(trainer, latest)
                if trainer.rank == 0:
                    print(
                        f"resumed from {store.uri}/{prefix}: step {latest} "
                        f"(rank 0 read {read} of the checkpoint's {written} shard files)",
                        flush=True,
                    )
        return trainer

    return make


# -- the program torchrun (or a TrainJob) starts on every rank --------------------------------------------------


# Beside the round's record of its inputs: the train step's heartbeat while it uploads them (trainjob.heartbeat)
UPLOADING = ".uploading"


def wait_for_inputs(uri: str, sha256: str, timeout_s: float, poll_s: float = 2.0) -> None:
    """Until the store object ``uri`` has the sha256 ``sha256``: the record
    that the round's inputs are all in the store (``inputs-ready.json``),
    which the train step writes after its upload
    (:meth:`tracefp4.pipelines.trainjob.TrainJobRun.train`). The ranks of a
    TrainJob that Kueue queued when it was created (a namespace with a
    LocalQueue named ``default``) start whenever Kueue admits it, maybe
    before the upload has ended. Raises :class:`DistributedError` after
    ``timeout_s`` (``train.timeout_seconds``) without the record nor a new
    beat of the step's heartbeat (``uri`` + :data:`UPLOADING`); a store that
    does not answer for a while is no news."""
    base, _, name = uri.rpartition("/")
    store, since, said, beat, error = open_store(base), time.monotonic(), False, None, None

    def read(key: str) -> bytes | None:
        nonlocal error
        try:
            return store.get_bytes(key)
        except ArtifactNotFound:
            return None
        except StoreError as e:  # no answer for a while (a restart), or no access: the timeout tells
            error = e
            return None

    while True:
        record = read(name)
        if record is not None and hashlib.sha256(record).hexdigest() == sha256:
            return
        now = read(name + UPLOADING)
        if now is not None and now != beat:  # the step is uploading
            since, beat = time.monotonic(), now
        if time.monotonic() - since > timeout_s:
            raise DistributedError(
                f"{uri}: the round's inputs were not recorded there, nor uploaded, for {timeout_s} s "
                "(train.timeout_seconds): the train step that created this TrainJob died uploading them? A retry "
                "of the step uploads them" + (f" (the store's last error: {error})" if error else "")
            )
        if not said:
            print(f"waiting for the train step to upload the round's inputs ({uri})", flush=True)
            said = True
        time.sleep(poll_s)


def _local(uri: str, workdir: Path) -> Path:
    """A path for an input given as a path, a ``file://`` URI or a store object URI (downloaded)."""
    if "://" not in uri or uri.startswith("file://"):
        return fetch(uri)
    base, _, name = uri.rpartition("/")
    path = workdir / name
    open_store(base).download(name, path)
    return path


@record  # a rank's exception goes into torchrun's failure summary, naming the rank
def main(argv: list[str] | None = None) -> None:
    from tracefp4.schemas import RunConfig

    from . import steps
    from .guidance import GuidanceRef

    parser = argparse.ArgumentParser(description="One rank of a distributed train step (run under torchrun).")
    parser.add_argument("--config", required=True, help="run config JSON: a path or a store URI")
    parser.add_argument("--policy", required=True, help="the policy folder: a path or a store folder URI")
    parser.add_argument(
        "--state", required=True, help="the policy's trainer state folder: a path or a store folder URI"
    )
    parser.add_argument("--trajectories", required=True, help="the round's trajectories: a path or a store URI")
    parser.add_argument("--guidance", required=True, help="the round's GuidanceRef JSON: a path or a store URI")
    parser.add_argument("--round-stats", required=True, help="the round's rollout/compaction figures (JSON)")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--out", required=True, help="the new policy: a folder, or a store URI uploaded to")
    parser.add_argument("--out-state", required=True, help="the new trainer state: a folder, or a store URI")
    parser.add_argument("--history", required=True, help="the steps' history rows (JSON): a path or a store URI")
    parser.add_argument(
        "--inputs", nargs=3, metavar=("URI", "SHA256", "TIMEOUT_S"), help="wait for this record first (wait_for_inputs)"
    )
    args = parser.parse_args(argv)
    if args.inputs:
        uri, sha256, timeout_s = args.inputs
        wait_for_inputs(uri, sha256, float(timeout_s))
    with tempfile.TemporaryDirectory(prefix="tracefp4-rank-") as tmp:
        work = Path(tmp)
        config = RunConfig.model_validate_json(_local(args.config, work).read_text())
        device = init_process_group(config)
        try:
            guidance_file, trajectories = _local(args.guidance, work), _local(args.trajectories, work)
            ref = GuidanceRef.from_json(guidance_file.read_text(), args.guidance)
            store = open_store(config.store.uri, create_bucket=config.store.create_bucket)
            prefix = checkpoints_prefix(config, args.run_id, ref.rl_step)
            out, out_state = _output(args.out, work / "policy"), _output(args.out_state, work / "state")
            # rank 0 alone reads the weights and the trainer state (DistributedTrainer.from_checkpoint), and the
            # others wait while it downloads and checks them (stopped with its reason if that fails); they download
            # the policy's config, tokenizer and manifest, and no state
            fetched = rank0_does(lambda: (fetch(args.policy), fetch(args.state)), "download the policy and state")
            policy, state = fetched or (fetch(args.policy, weights=False), Path(args.state))
            rows = steps.train(
                config,
                policy,
                state,
                trajectories,
                ref,
                out,
                out_state,
                args.run_id,
                json.loads(_local(args.round_stats, work).read_text()),
                open_trainer=open_trainer(prefix, store, args.run_id, round_inputs(trajectories, guidance_file)),
                device=device,
            )

            def publish() -> None:
                _publish(rows, args.history, {out: args.out, out_state: args.out_state})
                clear_checkpoints(store, prefix)  # the round's policy is out: no resume needed

            rank0_does(publish, "publish the round's outputs")
        finally:
            dist.destroy_process_group()


def _remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def _output(uri: str, staging: Path) -> Path:
    """Where an output folder given as ``uri`` is written: the folder itself, or ``staging`` for a store URI."""
    return staging if _remote(uri) else fetch(uri)


def _publish(rows: list[dict], history: str, folders: dict[Path, str]) -> None:
    """Rank 0's outputs: the history rows, and each output folder given as a store
    URI uploaded there (its manifest last)."""
    data = json.dumps(rows).encode()
    if _remote(history):
        base, _, name = history.rpartition("/")
        open_store(base).put_bytes(name, data)
    else:
        write_atomic(fetch(history), lambda f: f.write(data))
    for folder, uri in folders.items():
        if _remote(uri):
            upload_folder(folder, open_store(uri))
            shutil.rmtree(folder)


if __name__ == "__main__":
    main(sys.argv[1:])
