"""The RL loop: one round (rollout -> compaction -> guidance store -> guided
QAT) end to end on the smoke preset for every method and both schedules,
through the same steps the pipeline runs; inputs of another run or policy
version refused; policy-gradient direction; resume; gradient accumulation."""

import dataclasses

import pytest
import torch
from chat_checkpoint import chat_checkpoint
from safetensors.torch import load_file

from tracefp4.components import steps
from tracefp4.components.capture import CaptureConfig, CaptureRecords
from tracefp4.components.checkpoint import CheckpointError, load_model, provenance
from tracefp4.components.choices import QUANTIZING_CAPTURED_SITES
from tracefp4.components.guidance import GuidanceError, GuidanceLoader, read_manifest, step_prefix, write_step
from tracefp4.components.model import build_model
from tracefp4.components.quant_config import rollout_config
from tracefp4.components.rl import (
    SequenceBatch,
    alignment_metrics,
    group_advantages,
    grpo_loss,
    stack_rows,
    token_logprobs,
)
from tracefp4.components.rollout import SamplingParams, TorchEngine
from tracefp4.components.store import open_store
from tracefp4.components.tokenizer import load_tokenizer
from tracefp4.components.trainer import MASTER_PREFIX, TrainConfig, Trainer
from tracefp4.components.trainer_state import StateMismatch, read_meta
from tracefp4.schemas import RunConfig, get_preset

RUN = "run-a"


def smoke(tmp_path, **changes) -> RunConfig:
    """The smoke preset with its store in ``tmp_path``; ``changes`` by section, e.g. ``rl={"rounds": 2}``."""
    data = get_preset("smoke").model_dump()
    for section, values in changes.items():
        data[section] = {**data[section], **values} if isinstance(values, dict) else values
    data["store"]["uri"] = (tmp_path / "store").as_uri()
    return RunConfig.model_validate(data)


def rounds(config: RunConfig, tmp_path, n: int, run_id: str = RUN) -> list[dict]:
    steps.prepare(config, tmp_path / "policy-0", run_id, tmp_path / "state-0")
    history = []
    for r in range(n):
        policy, state = tmp_path / f"policy-{r}", tmp_path / f"state-{r}"
        out, out_state = tmp_path / f"policy-{r + 1}", tmp_path / f"state-{r + 1}"
        history += steps.run_round(config, policy, state, r, out, out_state, tmp_path, run_id)
    return history


@pytest.mark.parametrize(
    "method, precision, codec",
    [
        ("trace", "bf16", "bits"),
        ("trace", "fp32_master", "bits"),
        ("trace", "bf16", "syndrome"),  # decode figures and the mismatch tally in one step
        ("qat", "bf16", "bits"),
        ("quads", "bf16", "bits"),
        ("tis_sc", "bf16", "bits"),
        ("bf16", "bf16", "bits"),
    ],
)
def test_rounds_end_to_end(method, precision, codec, tmp_path):
    config = smoke(
        tmp_path,
        method=method,
        model={"dtype": "bfloat16"},
        train={"precision": precision},
        guidance={"layers": [1], "compaction": "offline", "codec": codec},
        # the code mismatch where training quantizes the captured sites (other methods refuse it)
        rl={"measure_mismatch": method in QUANTIZING_CAPTURED_SITES, "learning_rate": 1e-3, "weight_decay": 0.1},
    )
    history = rounds(config, tmp_path, 2)
    assert [h["step"] for h in history] == [1, 2] and provenance(tmp_path / "policy-2")["policy_version"] == 2
    assert read_meta(tmp_path / "state-2")["policy_version"] == 2
    for h in history:
        for key in (
            "reward_mean",
            "accuracy",
            "entropy",
            "response_length",
            "loss",
            "logprob_abs_diff_mean",
            "k3_kl",
            "probs_diff_mean",
            "guidance_coverage",
            "rollout_seconds",
            "train_seconds",
            "reload_seconds",
            "reward_seconds",
        ):
            assert key in h, key
        assert h["optimizer_steps"] == 1  # on-policy: one per rollout batch
    # the untrained smoke policy earns no reward, so what moves the weights is the decay of the optimizer step
    before, after = (steps.load_model(tmp_path / f"policy-{i}").model.layers[0].mlp.experts.gate_up for i in (0, 2))
    assert not torch.equal(before, after)
    assert after.dtype == torch.bfloat16  # the rollout's (model.dtype), in either precision
    masters = {k for k in load_file(tmp_path / "state-2" / "state.safetensors") if k.startswith(MASTER_PREFIX)}
    assert masters  # the float32 bits below the bf16 policy: the trainer state's
    assert read_meta(tmp_path / "state-2")["precision"] == precision
    if method in ("qat", "trace"):  # FP4 activations in training: codes compared with the rollout's
        last = history[-1]
        assert set(last["code_mismatch_by_layer"]) == {0, 1}
        # how many codes differ depends on the CPU's kernels (none in bf16 emulated: conftest.native_bf16 says
        # why); the histogram counts exactly the ones that do (test_capture pins that some do)
        assert 0 <= last["code_mismatch"] < 0.5 and 0 not in last["codeword_diff_hist"]
        assert (sum(last["codeword_diff_hist"].values()) > 0) == (last["code_mismatch"] > 0)
    store = open_store(config.store.uri)
    guidance = steps.store_prefix(config, RUN, "guidance")
    if method == "trace":
        assert all(h["guidance_coverage"] > 0.9 for h in history)
        manifest = read_manifest(store, 1, guidance)
        assert (manifest["layers"], manifest["bits"], manifest["policy_version"], manifest["run_id"]) == (
            [1],
            [1],
            1,
            RUN,
        )
    else:
        assert not [k for k in store.list() if k.startswith(guidance)] and all(
            h["guidance_coverage"] is None
            for h in history  # no guidance: no share of it
        )


def test_off_policy_round_trains_every_batch_of_one_rollout(tmp_path):
    """Two optimizer steps per RL step, too: the guidance loader yields the second
    microbatch's guidance twice (the old policy's pass, then the loss), in the trainer's order."""
    rl = {"schedule": "off_policy", "steps_per_round": 2, "microbatch_size": 2, "grad_accumulation": 1}
    history = rounds(smoke(tmp_path, rl=rl), tmp_path, 1)
    assert [(h["step"], h["staleness"]) for h in history] == [(1, 0), (2, 1)]
    assert all(h["optimizer_steps"] == 2 for h in history)
    assert all(h["guidance_coverage"] > 0.9 for h in history)  # both batches guided by the one rollout's capture


def test_inputs_of_another_run_or_version_are_refused(tmp_path):
    config = smoke(tmp_path, rl={"rounds": 2})
    steps.prepare(config, tmp_path / "p0", RUN, tmp_path / "s0")
    trajectories = tmp_path / "t0.jsonl"
    steps.rollout(config, tmp_path / "p0", 0, trajectories, RUN)
    with pytest.raises(steps.RunMismatch, match="run 'run-a', this is run 'run-b'"):
        steps.rollout(config, tmp_path / "p0", 0, tmp_path / "t.jsonl", "run-b")
    with pytest.raises(steps.RunMismatch, match="round 0, expected run 'run-a' round 1"):
        steps.compaction(config, tmp_path / "p0", trajectories, 1, RUN)
    ref, _ = steps.compaction(config, tmp_path / "p0", trajectories, 0, RUN)
    with pytest.raises(GuidanceError, match="guidance of run 'run-a' handed to run 'run-b'"):
        ref.check("run-b", 0)
    stale = dataclasses.replace(ref, policy_version=3)
    with pytest.raises(GuidanceError, match="policy version 3, the policy to train is version 0"):
        steps.train(
            config, tmp_path / "p0", tmp_path / "s0", trajectories, stale, tmp_path / "p1", tmp_path / "s1", RUN
        )
    forged = dataclasses.replace(ref, run_id="run-b")  # a reference that lies: the store's manifest still says run-a
    with pytest.raises(GuidanceError, match="run_id is 'run-a', expected 'run-b'"):
        list(forged.loader(open_store(config.store.uri), [[0]]))
    # the step written over by a run of other guidance settings under the same run id, or copied from another step
    store, prefix = open_store(config.store.uri), steps.store_prefix(config, RUN, "guidance")
    for field, value in (("bits", 4), ("layers", (0,)), ("sites", ("kv",)), ("policy", "0" * 64)):
        with pytest.raises(GuidanceError, match=f"{field} is .*, expected"):
            list(dataclasses.replace(ref, **{field: value}).loader(store, [[0]]))
    store.put_bytes(
        f"{step_prefix(prefix, 1)}/manifest.json", store.get_bytes(f"{step_prefix(prefix, 0)}/manifest.json")
    )
    with pytest.raises(GuidanceError, match="rl_step is 0, expected 1"):
        list(dataclasses.replace(ref, rl_step=1).loader(store, [[0]]))
    # another policy at the same version under the same run id (a run id given twice): neither its guidance nor
    # its trajectories train this one
    steps.prepare(config.model_copy(update={"seed": 1}), tmp_path / "q0", RUN, tmp_path / "r0")
    with pytest.raises(GuidanceError, match="another policy folder .*used by two runs"):
        steps.train(config, tmp_path / "q0", tmp_path / "r0", trajectories, ref, tmp_path / "q1", tmp_path / "r1", RUN)
    unpinned = dataclasses.replace(ref, policy="")  # a reference of an earlier tracefp4: the trajectories still say
    with pytest.raises(steps.RunMismatch, match="another policy folder"):
        steps.train(
            config, tmp_path / "q0", tmp_path / "r0", trajectories, unpinned, tmp_path / "q1", tmp_path / "r1", RUN
        )
    assert [p.name for p in tmp_path.glob(".t0.jsonl*")] == []  # written through a renamed temporary file
    cut = tmp_path / "cut.jsonl"
    cut.write_text(trajectories.read_text()[:-20])  # a file cut in its last line names itself and the line
    lines = len(trajectories.read_text().splitlines())
    with pytest.raises(ValueError, match=rf"cut.jsonl, line {lines}: not a trajectory record"):
        steps.read_trajectories(cut, RUN, 0)
    # cut after a whole line, or a line repeated: train would have taken part of the batch, or a trajectory twice
    head, *records = trajectories.read_text().splitlines(keepends=True)
    cut.write_text(head + "".join(records[:-1]))
    with pytest.raises(
        ValueError, match=rf"cut.jsonl: {len(records) - 1} trajectories, its header counts {len(records)}"
    ):
        steps.read_trajectories(cut, RUN, 0)
    cut.write_text(head + "".join(records[:-1] + records[:1]))
    with pytest.raises(ValueError, match="cut.jsonl: trajectory 0 appears twice"):
        steps.read_trajectories(cut, RUN, 0)


def test_inline_guidance_keeps_the_deepest_layers_with_fp4_sites(tmp_path, monkeypatch):
    """A hybrid model whose deepest layer is linear attention holds no KV cache
    there: under fp4_kv, guidance.layers 1 is the deepest full-attention layer,
    for the inline capture as for the schema and offline compaction."""
    from tracefp4.components import architecture

    hybrid = ("linear_attention", "linear_attention", "full_attention", "linear_attention")
    monkeypatch.setitem(
        architecture.PRESETS,
        "tiny-qwen35",
        dataclasses.replace(architecture.PRESETS["tiny-qwen35"], layer_types=hybrid),
    )
    data = get_preset("tiny-qwen35").model_dump()
    data["store"]["uri"] = (tmp_path / "store").as_uri()
    data["rollout"]["config"], data["evaluation"]["rollout_configs"] = "fp4_kv", ["fp4_kv"]
    data["guidance"].update(layers=1, compaction="inline", codec="bits")
    data["bootstrap"]["enabled"] = False
    config = RunConfig.model_validate(data)
    steps.prepare(config, tmp_path / "p0", RUN, tmp_path / "s0")
    (row,) = steps.run_round(
        config, tmp_path / "p0", tmp_path / "s0", 0, tmp_path / "p1", tmp_path / "s1", tmp_path, RUN
    )
    manifest = read_manifest(open_store(config.store.uri), 0, steps.store_prefix(config, RUN, "guidance"))
    assert manifest["layers"] == [2] and row["guidance_coverage"] > 0.9


def test_a_prompt_without_room_for_its_response_is_refused_before_any_work(tmp_path):
    config = smoke(tmp_path, model={"max_seq_len": 12}, rollout={"max_new_tokens": 8})  # 4 tokens of prompt
    too_long = r"a prompt of \d+ tokens .* and rollout.max_new_tokens 8 exceed model.max_seq_len 12"
    with pytest.raises(ValueError, match=too_long):  # every problem of the run, before the bootstrap
        steps.prepare(config, tmp_path / "p0", RUN)
    steps.prepare(smoke(tmp_path), tmp_path / "p0", RUN)  # a policy from a config that fits
    with pytest.raises(ValueError, match=too_long):  # the rollout checks its own batch too
        steps.rollout(config, tmp_path / "p0", 0, tmp_path / "t0.jsonl", RUN)
    assert not (tmp_path / "t0.jsonl").exists()


def test_an_answer_longer_than_max_new_tokens_in_a_checkpoints_tokenizer_is_refused_by_prepare(tmp_path):
    """Configure knows no checkpoint's tokenizer, so prepare checks in it that
    rollout.max_new_tokens holds every reference answer through its end
    (``<|im_end|>`` here): a response cut before it scores nothing, and the
    run would train on nothing useful without a word."""
    folder = chat_checkpoint(tmp_path / "qwen")
    changes = {
        "model": {"preset": None, "checkpoint": str(folder), "max_seq_len": 128},
        "tasks": [
            {"name": "arithmetic", "train_size": 8, "test_size": 4},
            {"name": "countdown", "difficulty": 2, "train_size": 8, "test_size": 4},
        ],
        "bootstrap": {"enabled": False},
    }
    train, test = steps.problems(smoke(tmp_path, **changes))
    tok = load_tokenizer(folder)
    longest = max(train + test, key=lambda p: len(tok.encode_answer(p.answer)))
    need = len(tok.encode_answer(longest.answer))
    assert need != len(longest.answer) + 1  # the character tokenizer's count would not find the limit below
    config = smoke(tmp_path, rollout={"max_new_tokens": need - 1}, **changes)
    steps.check_tasks_drawable(config)  # what configure checks passes: it has no tokenizer for a checkpoint
    with pytest.raises(ValueError) as info:
        steps.prepare(config, tmp_path / "p0", RUN)
    assert str(info.value) == (
        f"rollout.max_new_tokens: {need - 1} tokens cut answers such as {longest.answer!r} (tasks.1: countdown at "
        f"difficulty 2) before their end ({need} tokens), which then score nothing: raise it or lower "
        "tasks.1.difficulty"
    )
    assert not (tmp_path / "p0").exists()
    steps.prepare(smoke(tmp_path, rollout={"max_new_tokens": need}, **changes), tmp_path / "p0", RUN)  # room: it runs


def test_guidance_reference_round_trips_and_names_a_bad_artifact(tmp_path):
    config = smoke(tmp_path)
    steps.prepare(config, tmp_path / "p0", RUN)
    steps.rollout(config, tmp_path / "p0", 0, tmp_path / "t0.jsonl", RUN)
    ref, _ = steps.compaction(config, tmp_path / "p0", tmp_path / "t0.jsonl", 0, RUN)
    assert type(ref).from_json(ref.to_json(), "x") == ref
    assert ref.layers and ref.prefix == steps.store_prefix(config, RUN, "guidance")
    assert set(ref.scales()) == {
        (layer, site) for layer in range(2) for site in ("moe_in", "moe_down_in", "k_cache", "v_cache")
    }
    for bad in ("", "{}", '{"run_id": 1}', "[1]"):
        with pytest.raises(GuidanceError, match="artifact-7: not a guidance artifact"):
            type(ref).from_json(bad, "artifact-7")


def setup(method, lr=1e-3, precision="bf16", grad_clip=1.0):
    engine = TorchEngine(build_model("smoke", seed=0), rollout_config("fp4_wa_kv"), capture=CaptureConfig(inputs=True))
    config = TrainConfig(method=method, learning_rate=lr, microbatch_size=4, precision=precision, grad_clip=grad_clip)
    return engine, Trainer(build_model("smoke", seed=0), config, engine.quant, engine.global_scales)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_trainer_refuses_a_static_global_scale_that_cannot_scale(bad):
    engine, _ = setup("qat")
    scales = dict(engine.global_scales)
    layer, site = next(iter(scales))
    scales[(layer, site)] = torch.tensor(bad)
    config = TrainConfig(method="qat", microbatch_size=4)
    with pytest.raises(
        ValueError, match=rf"global scales must be positive and finite, got {{'{layer}/{site}': {bad}}}"
    ):
        Trainer(build_model("smoke", seed=0), config, engine.quant, scales)


@pytest.mark.parametrize("precision, grad_clip", [("bf16", 1.0), ("fp32_master", 1.0), ("bf16", 0.0)])
def test_a_step_raises_the_likelihood_of_rewarded_responses(precision, grad_clip):
    """Also with ``grad_clip`` 0, which the config documents as no clipping
    (torch's clip_grad_norm_ with a limit of 0 zeroes every gradient)."""
    engine, trainer = setup("qat", lr=1e-2, precision=precision, grad_clip=grad_clip)
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


@pytest.mark.parametrize("precision", ["bf16", "fp32_master"])
def test_resume_from_policy_and_state_equals_uninterrupted_training(tmp_path, precision):
    engine, straight = setup("qat", precision=precision)
    _, interrupted = setup("qat", precision=precision)
    trajectories = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=4, seed=1))
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    for t in (straight, interrupted):
        t.train_step(trajectories, advantages, None)
    interrupted.save(tmp_path / "policy", tmp_path / "state", run_id=RUN)
    assert sorted(p.name for p in (tmp_path / "policy").iterdir()) == [
        "checksums.json",
        "config.json",
        "model.safetensors",
    ]
    assert provenance(tmp_path / "policy") == {"run_id": RUN, "policy_version": 1}
    resumed = Trainer.from_checkpoint(
        tmp_path / "policy", tmp_path / "state", interrupted.config, engine.quant, engine.global_scales, run_id=RUN
    )
    assert resumed.step == 1
    for a, b in zip(interrupted.weights.tensors(), resumed.weights.tensors()):  # the float32 master, exactly
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    for step in (2, 3):  # two more steps each: the resumed run is the uninterrupted one, bit for bit
        for t in (straight, resumed):
            t.train_step(trajectories, advantages, None)
        assert resumed.step == straight.step == step
        for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
            assert torch.equal(a, b), name
    moments_a, moments_b = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(moments_a[i]["exp_avg_sq"], moments_b[i]["exp_avg_sq"]) for i in moments_a)


def test_an_optimizer_state_resumes_with_this_trainers_settings_and_devices_fused_flag(tmp_path):
    """A state saved on a GPU (fused AdamW) resumes on the CPU unfused; one
    resumed by a continuation given another learning rate, weight decay or
    betas goes on with those: the moments are the state's, the settings the
    config's."""
    engine, trainer = setup("qat", precision="fp32_master")
    trajectories = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=4, seed=1))
    trainer.train_step(trajectories, torch.tensor([1.0, -1.0, 1.0, -1.0]), None)
    state = trainer.optimizer.state_dict()
    on_gpu = {**state, "param_groups": [dict(group, fused=True) for group in state["param_groups"]]}
    _, resumed = setup("qat", precision="fp32_master")
    resumed.load_optimizer_state(on_gpu)
    assert [group["fused"] for group in resumed.optimizer.param_groups] == [False]
    moments = resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(moments[i]["exp_avg"], state["state"][i]["exp_avg"]) for i in state["state"])
    trainer.save(tmp_path / "policy", tmp_path / "state", run_id=RUN)
    changed = dataclasses.replace(trainer.config, learning_rate=1e-5, weight_decay=0.1, betas=(0.8, 0.95))
    args = (changed, engine.quant, engine.global_scales)
    (group,) = Trainer.from_checkpoint(
        tmp_path / "policy", tmp_path / "state", *args, run_id=RUN
    ).optimizer.param_groups
    assert (group["lr"], group["weight_decay"], tuple(group["betas"])) == (1e-5, 0.1, (0.8, 0.95))
    assert (trainer.config.learning_rate, trainer.config.weight_decay) != (1e-5, 0.1)


def test_a_trainer_state_is_refused_with_another_run_or_policy(tmp_path):
    engine, trainer = setup("qat")
    trainer.save(tmp_path / "p0", tmp_path / "s0", run_id=RUN)
    trainer.step = 1
    trainer.save(tmp_path / "p1", tmp_path / "s1", run_id=RUN)
    args = (trainer.config, engine.quant, engine.global_scales)
    with pytest.raises(StateMismatch, match="trainer state of run 'run-a', this is run 'run-b'"):
        Trainer.from_checkpoint(tmp_path / "p0", tmp_path / "s0", *args, run_id="run-b")
    with pytest.raises(StateMismatch, match="trainer state of policy version 1 saved with another policy folder"):
        Trainer.from_checkpoint(tmp_path / "p0", tmp_path / "s1", *args, run_id=RUN)
    (tmp_path / "s0" / "state.json").write_text('{"run_id": "run-a"}')  # edited after saving
    with pytest.raises(CheckpointError, match="state.json: .*checksums.json"):
        Trainer.from_checkpoint(tmp_path / "p0", tmp_path / "s0", *args, run_id=RUN)
    with pytest.raises(FileNotFoundError, match="is not a trainer state"):
        Trainer.from_checkpoint(tmp_path / "p0", tmp_path / "missing", *args, run_id=RUN)
    with pytest.raises(CheckpointError, match="state.json: unreadable"):  # a policy folder is no state
        Trainer.from_checkpoint(tmp_path / "p0", tmp_path / "p1", *args, run_id=RUN)


def test_tiny_preset_round_with_kl_to_the_reference(tmp_path):
    """A round on the tiny model, with the KL penalty on."""
    config = smoke(
        tmp_path,
        model={"preset": "tiny"},
        guidance={"layers": [2, 3]},
        rl={"schedule": "off_policy", "steps_per_round": 2, "kl_coef": 0.1, "learning_rate": 1e-2, "weight_decay": 0.5},
    )
    history = rounds(config, tmp_path, 1)  # no reward yet: the weight decay moves the policy off the reference
    assert history[0]["kl_to_reference"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert history[1]["kl_to_reference"] > 0
    assert history[1]["guidance_coverage"] > 0.7  # the rest: slots the two paths routed to different experts


def test_the_kl_reference_forward_leaves_the_comparison_with_the_rollout_alone():
    """The reference model's forward (kl_coef > 0) has sites of its own: the step's
    comparison with the rollout's full capture is the policy's, as without the
    penalty (sharing the policy's recorder overflowed its one-forward buffer)."""
    engine = TorchEngine(build_model("smoke", seed=0), rollout_config("fp4_wa_kv"), capture=CaptureConfig(inputs=True))
    trajectories = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=3, seed=3))
    records = engine.drain_capture()
    stats = []
    for kl_coef in (0.0, 0.1):
        config = TrainConfig(method="qat", microbatch_size=4, kl_coef=kl_coef)
        trainer = Trainer(build_model("smoke", seed=0), config, engine.quant, engine.global_scales)
        stats.append(trainer.train_step(trajectories, torch.tensor([1.0, -1.0, 1.0, -1.0]), None, records))
    compared = [key for key in stats[0] if "mismatch" in key]
    assert compared and {k: stats[1][k] for k in compared} == {k: stats[0][k] for k in compared}
    assert stats[1]["kl_to_reference"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference


def test_gradient_accumulation_groups_microbatches():
    engine, _ = setup("qat")
    trajectories = engine.generate([[5, 6, 7]] * 8, SamplingParams(max_new_tokens=3, seed=1))
    grouped = Trainer(
        build_model("smoke", seed=0),
        TrainConfig(method="qat", microbatch_size=2, grad_accumulation=2),
        engine.quant,
        engine.global_scales,
    )
    stats = grouped.train_step(trajectories, torch.tensor([1.0, -1.0] * 4), None)
    assert stats["optimizer_steps"] == 2 and grouped.step == 1  # 4 microbatches, 2 per optimizer step
    whole = Trainer(
        build_model("smoke", seed=0), TrainConfig(method="qat", microbatch_size=2), engine.quant, engine.global_scales
    )
    assert whole.train_step(trajectories, torch.tensor([1.0, -1.0] * 4), None)["optimizer_steps"] == 1


def test_a_steps_gradient_does_not_depend_on_the_microbatch_size():
    """The loss is a token mean over the step's response tokens (score centering's
    term too): responses of other lengths split into microbatches of 1, 3 or all 8
    give the same gradient, each microbatch weighted by its share of the tokens.
    The sampler's top-k is made less likely than it was, so that truncated IS
    leaves score centering a gradient of its own."""
    engine = TorchEngine(build_model("smoke", seed=0), rollout_config("fp4_wa_kv"))
    sampled = engine.generate([[5, 6, 7], [9, 4]] * 4, SamplingParams(max_new_tokens=6, seed=3, record_topk=8))
    trajectories = [
        dataclasses.replace(
            t,
            response=t.response[:n],
            logprobs=t.logprobs[:n],
            topk_ids=t.topk_ids[:n],
            topk_logprobs=[[lp - 1.5 for lp in top] for top in t.topk_logprobs[:n]],
        )
        for t, n in zip(sampled, [1, 6, 2, 5, 3, 6, 1, 4])
    ]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.3, 0.2, 1.2, -0.7, 0.1])
    grads, losses = [], []
    for size in (1, 3, 8):
        config = TrainConfig(
            method="tis_sc", microbatch_size=size, precision="fp32_master", compute_dtype=torch.float32
        )
        trainer = Trainer(build_model("smoke", seed=0), config, engine.quant, engine.global_scales)
        step = trainer._optimizer_step

        def keep_gradients(trainer=trainer, step=step):
            grads.append([p.grad.clone() for p in trainer.weights.tensors()])
            return step()

        trainer._optimizer_step = keep_gradients
        losses.append(trainer.train_step(trajectories, advantages, None)["loss"])
    assert losses == pytest.approx([losses[0]] * 3, rel=1e-5)
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("indices", [False, True])
def test_positions_outside_the_response_send_no_gradient(indices):
    """A prompt or padding position whose ratio to the old policy overflows
    (here a log-ratio of 99) is left out of the loss, and out of its backward:
    it had sent NaN (0 * inf through exp) into the gradient, and from there into
    every weight at the optimizer step."""
    logprobs = torch.tensor([[-1.0, -1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -100.0, -2.5]])
    mask = torch.tensor([[True, False, True]])
    loss, stats = grpo_loss(
        logprobs, old, old - 0.5, torch.tensor([1.0]), mask.nonzero(as_tuple=True) if indices else mask
    )
    loss.backward()
    # the first token's ratio 1; the last's e^0.5 clipped to 1.2 (no gradient); both TIS-weighted by e^0.5
    assert loss.item() == pytest.approx(-(torch.e**0.5) * (1 + 1.2) / 2)
    assert logprobs.grad[0].tolist() == pytest.approx([-(torch.e**0.5) / 2, 0.0, 0.0])
    assert stats["clip_fraction"].item() == 0.5 and stats["tis_weight_mean"].item() == pytest.approx(torch.e**0.5)


@pytest.mark.parametrize("reward", [0.9, 0.1, 0.7, 1 / 3])
def test_a_group_of_equal_rewards_has_no_advantage(reward):
    """Partial-credit rewards whose float32 group mean is an ulp off the rewards
    themselves (eight of 0.9) gave every response of the group the same
    advantage, -0.06 for 0.9, once divided by a std of about an ulp plus eps."""
    rewards = torch.tensor([reward] * 8 + [0.0, 1.0] * 4)
    advantages = group_advantages(rewards, 8)
    assert advantages[:8].tolist() == [0.0] * 8
    assert advantages[8:].tolist() == pytest.approx([-((7 / 8) ** 0.5), (7 / 8) ** 0.5] * 4, rel=1e-5)


def test_ppo_old_policy_is_the_one_the_step_starts_from():
    """After a step's first optimizer step, PPO's ratio, the TIS weight and the
    alignment figures read the log-probs of the policy the step started from
    (a no-grad pass before it), not the updated policy's own (a ratio of 1)."""
    engine, _ = setup("qat")
    trajectories = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=3, seed=1))
    config = TrainConfig(method="qat", microbatch_size=2, grad_accumulation=1, learning_rate=0.05)
    trainer = Trainer(build_model("smoke", seed=0), config, engine.quant, engine.global_scales)
    before = Trainer(build_model("smoke", seed=0), config, engine.quant, engine.global_scales)
    with torch.no_grad():
        parts = [SequenceBatch.of(mb) for mb in before.microbatches(trajectories)]
        start = [before._forward(batch, None, None)[1] for batch in parts]
    stats = trainer.train_step(trajectories, torch.tensor([1.0, -1.0, -1.0, 1.0]), None)
    assert stats["optimizer_steps"] == 2
    expected = alignment_metrics(
        stack_rows(start),
        stack_rows([b.rollout_logprobs for b in parts]),
        stack_rows([b.response for b in parts]),
        tis_cap=config.tis_cap,
    )
    assert stats["logprob_abs_diff_mean"] == expected["logprob_abs_diff_mean"]
    assert stats["k3_kl"] == expected["k3_kl"]
    assert stats["clip_fraction"] > 0  # the second microbatch's ratio moved past the clip
    assert trainer.guidance_order(4) == [1, 2, 3, 0, 1, 2, 3]


def test_trajectories_trained_without_guidance_are_counted_once(tmp_path):
    """With guidance.allow_rtn_fallback, a trajectory whose guidance is missing
    is rounded RTN: the step's stats count it (once, though pi_old's forward
    loads its microbatch's guidance again), and the coverage is that of the
    guided ones; before, nothing a user sees said so."""
    engine = TorchEngine(build_model("smoke", seed=0), rollout_config("fp4_wa_kv"), capture=CaptureConfig())
    trajectories = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=3, seed=1))
    store = open_store(str(tmp_path))
    kept = torch.tensor([1, 2, 3])  # trajectory 0's guidance missing
    records = CaptureRecords({key: t.for_trajectories(kept) for key, t in engine.drain_capture().tables.items()})
    write_step(store, records, rl_step=0, policy_version=0, top_k=engine.model.cfg.top_k)
    config = TrainConfig(method="trace", microbatch_size=2, grad_accumulation=1)
    trainer = Trainer(build_model("smoke", seed=0), config, engine.quant, engine.global_scales)
    microbatches = trainer.microbatches(trajectories)
    order = [[t.id for t in microbatches[i]] for i in trainer.guidance_order(len(microbatches))]
    assert order == [[2, 3], [0, 1], [2, 3]]  # microbatch [2, 3] loads twice: pi_old, then its loss
    loader = GuidanceLoader(store, 0, order, allow_rtn_fallback=True)
    stats = trainer.train_step(trajectories, torch.tensor([1.0, -1.0, 1.0, -1.0]), loader)
    assert stats["guidance_fallback_trajectories"] == 1 and stats["guidance_coverage"] > 0.9
    plain_config = dataclasses.replace(config, method="qat")
    plain = Trainer(build_model("smoke", seed=0), plain_config, engine.quant, engine.global_scales)
    assert (
        plain.train_step(trajectories, torch.tensor([1.0, -1.0, 1.0, -1.0]), None)["guidance_fallback_trajectories"]
        is None
    )


@pytest.mark.parametrize("precision", ["bf16", "fp32_master"])
def test_a_fresh_bf16_model_starts_as_a_bf16_policy_without_master_weights(tmp_path, precision):
    """prepare of a preset without a bootstrap, model.dtype bfloat16: the policy
    in the rollout's dtype and a trainer state without master weights (docs/
    training.md); a preset built in float32 had saved float32 masters, and under
    fp32_master a float32 policy for the whole run."""
    config = smoke(tmp_path, bootstrap={"enabled": False}, train={"precision": precision}, model={"dtype": "bfloat16"})
    steps.prepare(config, tmp_path / "policy", RUN, tmp_path / "state")
    assert {p.dtype for p in steps.load_model(tmp_path / "policy").parameters()} == {torch.bfloat16}
    assert not [k for k in load_file(tmp_path / "state" / "state.safetensors") if k.startswith(MASTER_PREFIX)]


def test_guidance_loaded_in_another_order_than_the_trainers_is_refused(tmp_path):
    engine = TorchEngine(build_model("smoke", seed=0), rollout_config("fp4_wa_kv"), capture=CaptureConfig())
    trajectories = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=3, seed=1))
    store = open_store(str(tmp_path))
    write_step(store, engine.drain_capture(), rl_step=0, policy_version=0, top_k=engine.model.cfg.top_k)
    config = TrainConfig(method="trace", microbatch_size=2, grad_accumulation=1)
    trainer = Trainer(build_model("smoke", seed=0), config, engine.quant, engine.global_scales)
    one_pass = GuidanceLoader(store, 0, [[t.id for t in mb] for mb in trainer.microbatches(trajectories)])
    with pytest.raises(GuidanceError, match=r"trajectories \[0, 1\], the microbatch holds \[2, 3\]"):
        trainer.train_step(trajectories, torch.tensor([1.0, -1.0, 1.0, -1.0]), one_pass)


def test_prepare_checks_guided_layers_against_a_checkpoint_before_any_work(tmp_path):
    steps.prepare(smoke(tmp_path, bootstrap={"enabled": False}), tmp_path / "base", RUN)
    config = smoke(tmp_path, model={"preset": None, "checkpoint": str(tmp_path / "base")}, guidance={"layers": [0, 5]})
    with pytest.raises(
        ValueError, match=f"guidance.layers: layer 5 does not exist; checkpoint {tmp_path / 'base'} has 2"
    ):
        steps.prepare(config, tmp_path / "p0", RUN)  # the bootstrap (enabled in smoke) never starts
    assert not (tmp_path / "p0").exists()


def test_the_policy_folder_is_a_clean_hugging_face_checkpoint(native_bf16, tmp_path):
    import transformers

    config = smoke(tmp_path, bootstrap={"enabled": False})
    steps.prepare(config, tmp_path / "p0", RUN, tmp_path / "s0")
    files = sorted(p.name for p in (tmp_path / "p0").iterdir())
    assert files == [
        "checksums.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(p.name for p in (tmp_path / "s0").iterdir()) == ["checksums.json", "state.json", "state.safetensors"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "p0").eval()
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "p0")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, [2], 0)  # eos: a list
    ours = load_model(tmp_path / "p0").eval()
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reference(tokens).logits - ours(tokens, torch.arange(9).expand(2, 9))).abs().max() < 1e-4


def test_activation_checkpointing_reaches_the_trained_model():
    """train.activation_checkpointing, off by default and on in the paper presets, sets the trained model's
    recompute_layers (tests/test_qat.py -k recomputed and tests/test_distributed.py -k recomputing: what it does)."""
    assert not steps.train_config(get_preset("tiny")).activation_checkpointing
    config = get_preset("paper-nvfp4-wa-kv")
    assert config.train.activation_checkpointing and steps.train_config(config).activation_checkpointing
    for on in (False, True):
        trainer = Trainer(
            build_model("smoke", seed=0), TrainConfig(activation_checkpointing=on), rollout_config("bf16"), {}
        )
        assert trainer.model.recompute_layers is on
