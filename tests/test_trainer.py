"""The RL loop: rollout -> compaction -> guidance store -> guided QAT -> weight
sync, end to end on the smoke preset; policy-gradient direction; resume."""

import pytest
import torch

from tracefp4.components.capture import CaptureConfig
from tracefp4.components.guidance import read_manifest
from tracefp4.components.model import build_model
from tracefp4.components.quant import rollout_config
from tracefp4.components.rl import SequenceBatch, token_logprobs
from tracefp4.components.rollout import SamplingParams, TorchEngine
from tracefp4.components.store import open_store
from tracefp4.components.trainer import RoundConfig, TrainConfig, Trainer, rl_round


def prompts(step, n):
    return [[1 + step + i, 2, 3, 4] for i in range(n)]


def even_tokens(trajectory):
    return sum(t % 2 == 0 for t in trajectory.response) / len(trajectory.response)


def setup(method, lr=1e-3):
    engine = TorchEngine(build_model("smoke", seed=0), rollout_config("fp4_wa_kv"), capture=CaptureConfig(inputs=True))
    trainer = Trainer(build_model("smoke", seed=0), TrainConfig(method=method, learning_rate=lr, microbatch_size=4), engine)
    return engine, trainer


@pytest.mark.parametrize("method", ["trace", "qat", "quads", "tis_sc", "bf16"])
def test_rl_round_end_to_end(method, tmp_path):
    engine, trainer = setup(method)
    store = open_store(str(tmp_path))
    before = trainer.model.model.layers[0].mlp.experts.gate_up.detach().clone()
    history = rl_round(engine, trainer, prompts, even_tokens, SamplingParams(max_new_tokens=6),
                       RoundConfig(steps=2, prompts_per_step=2, group_size=4, bits=1, layers=(1,), measure_mismatch=True),
                       store)  # fmt: skip
    assert [h["step"] for h in history] == [0, 1] and trainer.step == 2 and engine.policy_version == 2
    for h in history:
        for key in ("reward_mean", "accuracy", "entropy", "response_length", "loss", "logprob_abs_diff_mean", "k3_kl",
                    "probs_diff_mean", "guidance_coverage", "rollout_seconds", "train_seconds", "reload_seconds"):  # fmt: skip
            assert key in h, key
        assert h["response_length"] == 6
    assert not torch.equal(before, trainer.model.model.layers[0].mlp.experts.gate_up)
    if method in ("qat", "trace"):  # FP4 activations in training: codes compared with the rollout's
        last = history[-1]
        assert set(last["code_mismatch_by_layer"]) == {0, 1} and set(last["relative_excess_mse_by_layer"]) == {0, 1}
        assert 0 <= last["code_mismatch"] < 0.5 and sum(last["codeword_diff_hist"].values()) > 0
    if method == "trace":
        assert all(h["guidance_coverage"] > 0.9 for h in history)
        assert history[-1]["code_mismatch_by_layer"][1] < history[-1]["code_mismatch_by_layer"][0]  # layer 1 guided
        manifest = read_manifest(store, 1)
        assert manifest["layers"] == [1] and manifest["bits"] == [1] and manifest["policy_version"] == 1
    else:
        assert store.list() == [] and all(h["guidance_coverage"] == 0 for h in history)


def test_a_step_raises_the_likelihood_of_rewarded_responses():
    engine, trainer = setup("qat", lr=1e-2)
    trajectories = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=5, seed=3))
    engine.drain_capture()
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    batch = SequenceBatch.of(trajectories)

    def response_logprobs():
        with torch.no_grad():
            lp = token_logprobs(trainer.model, batch)
        return (lp * batch.response).sum(1)

    start = response_logprobs()
    trainer.train_step(trajectories, advantages, None)
    moved = response_logprobs() - start
    assert moved[advantages > 0].mean() > moved[advantages < 0].mean()


def test_checkpoint_resume(tmp_path):
    engine, trainer = setup("qat")
    store = open_store(str(tmp_path / "store"))
    rl_round(engine, trainer, prompts, even_tokens, SamplingParams(max_new_tokens=4), RoundConfig(steps=1, prompts_per_step=2, group_size=2), store)
    trainer.save(tmp_path / "ckpt")
    other_engine, resumed = setup("qat")
    resumed.resume(tmp_path / "ckpt")
    assert resumed.step == trainer.step == 1 and other_engine.policy_version == 1
    for a, b in zip(trainer.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    state_a, state_b = trainer.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(state_a[i]["exp_avg"], state_b[i]["exp_avg"]) for i in state_a)
    # both continue identically from here
    for t in (trainer, resumed):
        rl_round(t.engine, t, prompts, even_tokens, SamplingParams(max_new_tokens=4), RoundConfig(steps=1, prompts_per_step=2, group_size=2), store)
    for a, b in zip(trainer.model.parameters(), resumed.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_tiny_preset_round_with_kl_to_the_reference(tmp_path):
    """The RL loop on the tiny preset, with the KL penalty on."""
    engine = TorchEngine(build_model("tiny", seed=0), rollout_config("fp4_wa_kv"), capture=CaptureConfig())
    trainer = Trainer(build_model("tiny", seed=0), TrainConfig(method="trace", kl_coef=0.1, microbatch_size=8), engine)
    history = rl_round(engine, trainer, prompts, even_tokens, SamplingParams(max_new_tokens=6),
                       RoundConfig(steps=2, prompts_per_step=2, group_size=4, bits=1, layers=(2, 3)), open_store(str(tmp_path)))  # fmt: skip
    assert history[0]["kl_to_reference"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert history[1]["kl_to_reference"] > 0
    assert history[1]["guidance_coverage"] > 0.7  # the rest: slots the two paths routed to different experts


def test_gradient_accumulation_groups_microbatches(tmp_path):
    engine, _ = setup("qat")
    trainer = Trainer(build_model("smoke", seed=0), TrainConfig(method="qat", microbatch_size=2, grad_accumulation=2), engine)
    trajectories = engine.generate([[5, 6, 7]] * 8, SamplingParams(max_new_tokens=3, seed=1))
    stats = trainer.train_step(trajectories, torch.tensor([1.0, -1.0] * 4), None)
    assert stats["optimizer_steps"] == 2 and trainer.step == 1  # 4 microbatches, 2 per optimizer step
    whole = Trainer(build_model("smoke", seed=0), TrainConfig(method="qat", microbatch_size=2), engine)
    assert whole.train_step(trajectories, torch.tensor([1.0, -1.0] * 4), None)["optimizer_steps"] == 1
