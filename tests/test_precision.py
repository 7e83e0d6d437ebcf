"""Training precision (components/precision.py): bf16 parameters and compute
over float32 master weights and moments, or float32 parameters under
autocast; both train, save and resume, and either resumes the other's
checkpoint; the bf16 forward is the rollout's bf16 forward; CPUs without bf16
units still take the emulated matmuls."""

import logging

import pytest
import torch
from pydantic import ValidationError

from tracefp4.components import device
from tracefp4.components.capture import CaptureConfig
from tracefp4.components.checkpoint import load_model
from tracefp4.components.model import build_model
from tracefp4.components.precision import MasterWeights
from tracefp4.components.quant_config import BF16, rollout_config
from tracefp4.components.rl import SequenceBatch, token_logprobs
from tracefp4.components.rollout import SamplingParams, TorchEngine
from tracefp4.components.trainer import TrainConfig, Trainer, master_weights
from tracefp4.components.trainer_state import load_state
from tracefp4.schemas import RunConfig

ADVANTAGES = torch.tensor([1.0, -1.0, 1.0, -1.0])


def trainer_and_batch(precision: str, method: str = "qat", lr: float = 1e-3, dtype: torch.dtype = torch.float32):
    engine = TorchEngine(build_model("smoke", seed=0), rollout_config("fp4_wa_kv"), capture=CaptureConfig())
    trajectories = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=4, seed=1))
    engine.drain_capture()
    config = TrainConfig(method=method, learning_rate=lr, microbatch_size=2, precision=precision, compute_dtype=dtype)
    model = build_model("smoke", seed=0, dtype=dtype)
    return Trainer(model, config, engine.quant, engine.global_scales), trajectories


def test_bf16_steps_a_float32_master_and_rounds_the_parameters_from_it():
    trainer, trajectories = trainer_and_batch("bf16")
    initial = build_model("smoke", seed=0)
    params, master = trainer.weights.params, trainer.weights.master
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    for name, p in initial.named_parameters():  # the master starts from the float32 model given, not its rounding
        assert master[name].dtype == torch.float32 and torch.equal(master[name], p)
    assert [id(t) for t in trainer.optimizer.param_groups[0]["params"]] == [id(m) for m in master.values()]
    stats = trainer.train_step(trajectories, ADVANTAGES, None)  # two microbatches: gradients accumulate in float32
    assert stats["optimizer_steps"] == 1 and all(p.grad is None for p in params.values())
    for name, p in params.items():
        assert torch.equal(p, master[name].to(torch.bfloat16)), name
    moved = [name for name, p in initial.named_parameters() if not torch.equal(master[name], p)]
    assert len(moved) == len(master)
    for state in trainer.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_fp32_master_is_the_float32_model_under_autocast():
    trainer, trajectories = trainer_and_batch("fp32_master")
    assert trainer.weights.master is trainer.weights.params and not trainer.weights.state()
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert [id(t) for t in trainer.optimizer.param_groups[0]["params"]] == [id(p) for p in trainer.model.parameters()]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_step(trajectories, ADVANTAGES, None)
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize("precision, equal", [("bf16", True), ("fp32_master", False)])
def test_the_bf16_forward_is_the_bf16_rollout_policys(precision, equal):
    """Under bf16 the training forward (no quantization) computes exactly what the
    rollout engine's bf16 policy computes; under fp32_master's autocast it does not."""
    trainer, trajectories = trainer_and_batch(precision, method="bf16")
    engine = TorchEngine(trainer.model, BF16, dtype=torch.bfloat16)
    batch = SequenceBatch.of(trajectories)
    with torch.no_grad():
        rollout = token_logprobs(engine.model, batch)
        with trainer._autocast(batch):
            training = token_logprobs(trainer.model, batch)
    assert torch.equal(rollout, training) == equal


@pytest.mark.parametrize(
    "saved, model_dtype, resumed",
    [
        ("bf16", torch.float32, "fp32_master"),
        ("fp32_master", torch.float32, "bf16"),
        ("fp32_master", torch.bfloat16, "fp32_master"),
        ("fp32_master", torch.bfloat16, "bf16"),
    ],
)
def test_either_precision_resumes_the_others_checkpoint_exactly(tmp_path, saved, model_dtype, resumed):
    """The policy is saved in bf16 under ``bf16``, in the model's own dtype under
    ``fp32_master`` (a bf16 model's float32 parameters going to the trainer
    state as master weights); either precision resumes either exactly."""
    trainer, trajectories = trainer_and_batch(saved, dtype=model_dtype)
    trainer.train_step(trajectories, ADVANTAGES, None)
    trainer.save(tmp_path / "policy", tmp_path / "state", run_id="r")
    policy_dtype = torch.float32 if (saved, model_dtype) == ("fp32_master", torch.float32) else torch.bfloat16
    assert {p.dtype for p in load_model(tmp_path / "policy").parameters()} == {policy_dtype}
    masters = master_weights(load_state(tmp_path / "state", tmp_path / "policy", "r")[0])
    assert bool(masters) == (policy_dtype == torch.bfloat16)
    config = TrainConfig(method="qat", microbatch_size=2, precision=resumed, kl_coef=0.1)
    other = Trainer.from_checkpoint(
        tmp_path / "policy", tmp_path / "state", config, trainer.quant, trainer.global_scales, run_id="r"
    )
    for a, b in zip(trainer.weights.tensors(), other.weights.tensors()):  # the float32 master, whichever holds it
        assert torch.equal(a, b)
    for (name, p), (_, ref) in zip(other.model.named_parameters(), other.reference.named_parameters()):
        assert torch.equal(p, ref), name  # the KL reference is where training resumes: KL 0 at its first step


def test_a_trained_bf16_policy_without_saved_master_weights_starts_the_master_from_it_with_a_warning(caplog):
    policy = build_model("smoke", seed=0, dtype=torch.bfloat16)
    weights = MasterWeights(policy, "bf16", torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        weights.load({}, stepped=False)  # a fresh policy's state: the policy is the master
        assert not caplog.text
        weights.load({}, stepped=True)
    assert "master starts from the bf16 policy" in caplog.text
    for p, m in zip(policy.parameters(), weights.tensors()):
        assert m.dtype == torch.float32 and torch.equal(m, p.float())  # the bits below bf16 are gone


def test_bf16_training_on_a_cpu_without_bf16_takes_the_emulated_matmuls(monkeypatch):
    asked = []
    monkeypatch.setattr(device, "bf16_emulated", lambda: asked.append(1) or True)
    trainer, trajectories = trainer_and_batch("bf16")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    stats = trainer.train_step(trajectories, ADVANTAGES, None)
    assert asked and torch.isfinite(torch.tensor(stats["loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_unset_precision_is_the_rollouts_numerics():
    """A float32 rollout is matched by float32 training (fp32_master's autocast to float32 is off), a bf16
    one by bf16 parameters; several processes train fp32_master (FSDP2 shards the float32 parameters)."""
    assert RunConfig().train.precision is None and RunConfig().train_precision == "fp32_master"  # model.dtype float32
    assert RunConfig.model_validate({"model": {"preset": "tiny", "dtype": "bfloat16"}}).train_precision == "bf16"
    several = {"model": {"preset": "tiny", "dtype": "bfloat16"}, "train": {"processes_per_node": 2}}
    assert RunConfig.model_validate(several).train_precision == "fp32_master"
    chosen = {"model": {"preset": "tiny", "dtype": "float32"}, "train": {"precision": "bf16"}}
    assert RunConfig.model_validate(chosen).train_precision == "bf16"


def test_precision_names_are_checked():
    with pytest.raises(ValueError, match="unknown training precision 'fp16'"):
        MasterWeights(build_model("smoke"), "fp16", torch.float16)
    assert RunConfig.model_validate({"train": {"precision": "fp32_master"}}).train.precision == "fp32_master"
    for bad in ("fp16", "bfloat16"):
        with pytest.raises(ValidationError, match="train.precision"):
            RunConfig.model_validate({"train": {"precision": bad}})


@pytest.mark.parametrize("precision", ["bf16", "fp32_master"])
def test_a_fresh_bf16_policys_state_saves_no_master_weights_and_resumes_it_exactly(tmp_path, precision, caplog):
    """Until the optimizer steps them, master weights made from bf16 parameters
    are the policy: the trainer state of a fresh bf16 policy (prepare's)
    saves none (140 GB less at Qwen3.5-35B-A3B), resuming it warns of nothing
    and gives the same master; once stepped, they are saved."""
    trainer, trajectories = trainer_and_batch(precision, dtype=torch.bfloat16)
    trainer.save(tmp_path / "policy", tmp_path / "state", run_id="r")
    assert not master_weights(load_state(tmp_path / "state", tmp_path / "policy", "r")[0])
    config = TrainConfig(method="qat", microbatch_size=2, precision=precision)
    with caplog.at_level(logging.WARNING):
        other = Trainer.from_checkpoint(
            tmp_path / "policy", tmp_path / "state", config, trainer.quant, trainer.global_scales, run_id="r"
        )
    assert "master" not in caplog.text
    for a, b in zip(trainer.weights.tensors(), other.weights.tensors(), strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    other.train_step(trajectories, ADVANTAGES, None)
    other.save(tmp_path / "policy-1", tmp_path / "state-1", run_id="r")
    masters = master_weights(load_state(tmp_path / "state-1", tmp_path / "policy-1", "r")[0])
    assert sorted(masters) == sorted(name for name, _ in other.model.named_parameters())
