"""A training step reads the device once, after its last microbatch.

On CUDA every read of a value from the device (``.item()``, ``float(t)``,
``.tolist()``, a shape that depends on values: ``nonzero``, boolean-mask
indexing) makes the host wait for the GPU, so the host can no longer queue the
next microbatch's kernels while the GPU works. These tests run on the CPU,
where nothing syncs, so they watch the ops themselves: between a step's first
microbatch and its one read of the figures (``trainer.to_host``) none of those
ops may run, but for two that read the host alone."""

import pytest
import torch
from device_reads import DeviceReads

from tracefp4.components import trainer as trainer_module
from tracefp4.components.capture import CaptureConfig, CaptureRecords
from tracefp4.components.guidance import GuidanceLoader, write_step
from tracefp4.components.model import build_model
from tracefp4.components.quant_config import rollout_config
from tracefp4.components.rollout import SamplingParams, TorchEngine
from tracefp4.components.store import open_store
from tracefp4.components.syndrome import encode_table
from tracefp4.components.syndrome_rate import first_rate
from tracefp4.components.trainer import TrainConfig, Trainer


@pytest.fixture
def reads(monkeypatch):
    """A :class:`DeviceReads` (to enter around a step) that starts watching at
    the step's first forward (``Trainer._forward``: the old policy's pass, or
    the first microbatch's loss) and stops at its read of
    the figures (``to_host``, counted in ``host_reads``)."""
    mode = DeviceReads()
    forward, to_host, tolist = Trainer._forward, trainer_module.to_host, torch.Tensor.tolist

    def watched_forward(self, *args, **kwargs):
        mode.watching = True
        return forward(self, *args, **kwargs)

    def watched_to_host(values):
        mode.watching = False
        mode.host_reads += 1
        return to_host(values)

    def watched_tolist(t):
        if mode.watching and mode.was_made(t):
            mode.record("tolist")
        return tolist(t)

    def watched_to(t, *args, **kwargs):  # a host tensor to the device: on CUDA it waits unless non_blocking
        copies = mode.watching and not mode.was_made(t) and _names_a_device(args, kwargs)
        if copies and "non_blocking" not in kwargs:  # tracefp4.kernels.to_device says, for the device it copies to
            mode.record("blocking copy to the device")
        return to(t, *args, **kwargs)

    def watched_tensor(data, *args, **kwargs):  # the same, from Python values
        if mode.watching and kwargs.get("device") is not None:
            mode.record("blocking copy to the device")
        return tensor(data, *args, **kwargs)

    to, tensor = torch.Tensor.to, torch.tensor
    monkeypatch.setattr(Trainer, "_forward", watched_forward)
    monkeypatch.setattr(trainer_module, "to_host", watched_to_host)
    monkeypatch.setattr(torch.Tensor, "tolist", watched_tolist)
    monkeypatch.setattr(torch.Tensor, "to", watched_to)
    monkeypatch.setattr(torch, "tensor", watched_tensor)
    return mode


def _names_a_device(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names a device (not only a dtype)."""
    return kwargs.get("device") is not None or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)


@pytest.mark.parametrize(
    "method, changes, codec",
    [
        (
            "trace",
            {"kl_coef": 0.1, "grad_accumulation": 1},
            "bits",
        ),  # guided, the KL, two optimizer steps (the old policy's pass)
        ("trace", {}, "syndrome"),  # guidance decoded from side information, tokens routed as the rollout
        ("tis_sc", {}, "bits"),  # score centering
    ],
)
def test_a_step_reads_the_device_only_after_its_last_microbatch(reads, method, changes, codec, tmp_path):
    engine = TorchEngine(build_model("tiny", seed=0), rollout_config("fp4_wa_kv"), capture=CaptureConfig())
    trajectories = engine.generate([[5, 6, 7, 8]] * 4, SamplingParams(max_new_tokens=5, seed=0, record_topk=2))
    store = open_store(str(tmp_path))
    records = engine.drain_capture()
    if codec == "syndrome":
        records = CaptureRecords({key: encode_table(t, first_rate(0.25)) for key, t in records.tables.items()})
    write_step(store, records, rl_step=0, policy_version=0, top_k=engine.model.cfg.top_k)
    config = TrainConfig(method=method, microbatch_size=2, **changes)
    trainer = Trainer(build_model("tiny", seed=0), config, engine.quant, engine.global_scales)
    microbatches = trainer.microbatches(trajectories)
    order = trainer.guidance_order(len(microbatches))
    loader = GuidanceLoader(store, 0, [[t.id for t in microbatches[i]] for i in order])
    with reads:
        stats = trainer.train_step(trajectories, torch.tensor([1.0, -1.0, 1.0, -1.0]), loader)
    assert reads.reads == [], "read from the device during the step (op, innermost calls)"
    assert reads.host_reads == 1 and stats["optimizer_steps"] == (2 if changes else 1)
    assert method != "trace" or stats["guidance_coverage"] > 0.5  # the guided path ran
    assert codec != "syndrome" or stats["guidance_decode_blocks"] > 0  # and decoded, its figures read with the rest
