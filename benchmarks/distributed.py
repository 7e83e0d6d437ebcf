"""FSDP2 sharding of guided QAT: what one training process holds at world size 2
against one process training alone, and what the ranks exchange per RL step.

One process trains an RL step of a preset model (method qat: FP4 fake
quantization, no store needed) with :class:`Trainer`; then two processes
(torch.multiprocessing, gloo on CPU) train the same step with
:class:`DistributedTrainer`. Each counts the bytes of the parameters, the
gradients (at the optimizer step, before they are freed) and the AdamW state
it holds: the target is rank 0's total <= 0.55x the single process's. Each
rank also counts the payload of every collective it takes part in during the
step (FSDP2's all-gathers of parameters for forward and backward, its
reduce-scatters of gradients, the trainer's all-reduces of metrics).

    python benchmarks/distributed.py [--preset tiny] [--prompts 8] [--new-tokens 16]

The last line is one JSON object with every figure.
"""

import argparse
import json
import os
import socket
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.distributed.tensor import DTensor

from tracefp4.components.distributed import DistributedTrainer
from tracefp4.components.model import build_model
from tracefp4.components.quant_config import rollout_config
from tracefp4.components.rollout import SamplingParams, TorchEngine
from tracefp4.components.trainer import TrainConfig, Trainer

TARGET = 0.55


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def measured(cls):
    """``cls`` whose optimizer step records the bytes of the gradients it steps with."""

    class Measured(cls):
        grad_bytes = 0

        def _optimizer_step(self) -> Tensor:
            self.grad_bytes = max(
                self.grad_bytes, _bytes(p.grad for p in self.model.parameters() if p.grad is not None)
            )
            return super()._optimizer_step()

    return Measured


def state_bytes(trainer) -> dict:
    params = _bytes(trainer.model.parameters())
    optimizer = _bytes(t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    return {
        "parameters": params,
        "gradients": trainer.grad_bytes,
        "optimizer": optimizer,
        "total": params + trainer.grad_bytes + optimizer,
    }


def count_collectives(counts: Counter) -> None:
    """Wrap the torch.distributed collectives FSDP2 and the trainer call, adding each one's payload bytes."""

    def wrap(name, payload):
        original = getattr(dist, name)

        def counted(*args, **kwargs):
            counts[name] += payload(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    wrap("all_gather_single", lambda output, *a, **k: output.numel() * output.element_size())
    wrap("reduce_scatter_single", lambda output=None, input=None, *a, **k: input.numel() * input.element_size())
    wrap("all_reduce", lambda tensor, *a, **k: tensor.numel() * tensor.element_size())


def rank(index: int, world: int, port: int, setup: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index), WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    counts: Counter = Counter()
    count_collectives(counts)
    model = build_model(setup["preset"], seed=0)
    trainer = measured(DistributedTrainer)(model, setup["config"], setup["quant"], setup["scales"])
    stats = trainer.train_step(setup["trajectories"], setup["advantages"], None)
    result = {"state_bytes": state_bytes(trainer), "collective_bytes": dict(counts), "loss": stats["loss"]}
    if index == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    quant = rollout_config("fp4_wa_kv", "nvfp4")
    engine = TorchEngine(build_model(args.preset, seed=0), quant)
    prompts = torch.randint(1, 64, (args.prompts, 6)).tolist()
    trajectories = engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, seed=0))
    config = TrainConfig(method="qat", microbatch_size=max(1, args.prompts // 4), precision="fp32_master")
    setup = {
        "preset": args.preset,
        "config": config,
        "quant": quant,
        "scales": engine.global_scales,
        "trajectories": trajectories,
        "advantages": torch.randn(len(trajectories), generator=torch.Generator().manual_seed(0)),
    }
    alone = measured(Trainer)(build_model(args.preset, seed=0), config, quant, engine.global_scales)
    alone_stats = alone.train_step(trajectories, setup["advantages"], None)
    one = state_bytes(alone)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rank0.json"
        mp.spawn(rank, args=(2, port, setup, out), nprocs=2, join=True)
        two = json.loads(Path(out).read_text())
    ratio = two["state_bytes"]["total"] / one["total"]
    print(f"one process: {one['total'] / 2**20:.2f} MiB of parameters + gradients + AdamW state")
    print(f"world size 2, rank 0: {two['state_bytes']['total'] / 2**20:.2f} MiB ({ratio:.3f}x, target <= {TARGET})")
    for name, n in sorted(two["collective_bytes"].items()):
        print(f"  {name}: {n / 2**20:.2f} MiB per rank per RL step")
    print(
        json.dumps(
            {
                "preset": args.preset,
                "microbatches": len(alone.microbatches(trajectories)),
                "one_process_state_bytes": one,
                "rank0_state_bytes_world2": two["state_bytes"],
                "state_ratio_world2": ratio,
                "target": TARGET,
                "meets_target": ratio <= TARGET,
                "collective_bytes_per_rank_per_step": two["collective_bytes"],
                "loss_one_process": alone_stats["loss"],
                "loss_world2": two["loss"],
            }
        )
    )


if __name__ == "__main__":
    main()
