"""Named starting points for a run; a config file or overrides refine one.

`smoke` runs the whole DAG in tests in seconds, `tiny-qwen35` is the smoke
run on the paper's model family (hybrid Gated DeltaNet + gated attention,
Qwen3.5-MoE), `tiny` is `make run` on a 2-core CPU, and the two `paper-*`
presets describe the paper's Qwen3.5-35B-A3B cluster setups (REFERENCE.md
section 3). Their checkpoint is the Hugging Face folder as published, copied
into the user's store: its special tokens and chat template come from its own
tokenizer files at load time (docs/pipeline.md, "The policy's checkpoint
folder"), so a preset names only the URI. The bucket, image and cluster
resources are placeholders to adapt, and the RL hyperparameters the paper does
not state are ours.
"""

from tracefp4.components.architecture import QWEN35_35B_A3B
from tracefp4.components.quant_config import rollout_config

from .config import RunConfig


def _smoke() -> RunConfig:
    return RunConfig.model_validate(
        {
            "name": "smoke",
            "model": {"preset": "smoke", "max_seq_len": 64},
            "rollout": {"max_new_tokens": 8, "group_size": 2, "prompts_per_step": 2, "max_tokens_per_forward": 256},
            "guidance": {"bits": 1, "layers": 1, "trajectories_per_shard": 2},
            "rl": {"steps_per_round": 1, "rounds": 1, "microbatch_size": 4},
            "bootstrap": {"enabled": True, "steps": 2, "batch_size": 4, "warmup": 1, "eval_every": 0},
            "tasks": [{"name": "arithmetic", "difficulty": 1, "train_size": 8, "test_size": 4}],
            "evaluation": {"rollout_configs": ["bf16", "fp4_wa_kv"], "samples_per_prompt": 1, "test_prompts": 4},
            "resources": {"cpu": "1", "memory": "2Gi"},
        }
    )


def _tiny_qwen35() -> RunConfig:
    # the smoke run on tiny-qwen35 (3 Gated DeltaNet layers, then 1 full-attention layer); R-1bit on the deeper two
    # layers, so that guidance covers a linear-attention layer (expert sites only) and a full-attention one (+ KV)
    config = _smoke().model_dump()
    config |= {"name": "tiny-qwen35", "model": {"preset": "tiny-qwen35", "max_seq_len": 64}}
    config["guidance"]["layers"] = 2
    return RunConfig.model_validate(config)


def _tiny() -> RunConfig:
    # R-1bit of the deeper half (2 of 4 layers), as R-1bit-L20 is of 40.
    return RunConfig.model_validate(
        {
            "name": "tiny",
            "model": {"preset": "tiny", "dtype": "bfloat16", "max_seq_len": 256},
            "rollout": {"max_new_tokens": 64, "group_size": 4, "prompts_per_step": 8, "max_tokens_per_forward": 2048},
            "guidance": {"bits": 1, "layers": 2},
            # off-policy rounds of 5 steps: 3 rounds are 9 pipeline tasks instead of 45 on-policy
            "rl": {
                "schedule": "off_policy",
                "steps_per_round": 5,
                "rounds": 3,
                "learning_rate": 3e-5,
                "microbatch_size": 8,
            },
            # SFT to 20.3% greedy test accuracy in about 3-4 minutes on a 2-core AMD EPYC (docs/evaluation.md)
            # (`tracefp4 bootstrap --preset tiny`; arithmetic d1 has 300 distinct problems: 268 + 32)
            "bootstrap": {"enabled": True, "steps": 480, "learning_rate": 3e-3, "eval_every": 100},
            "tasks": [
                {"name": "arithmetic", "difficulty": 1, "train_size": 268, "test_size": 32},
                {"name": "countdown", "difficulty": 1, "train_size": 1000, "test_size": 32},
            ],
            "evaluation": {"rollout_configs": ["bf16", "fp4_wa_kv"], "samples_per_prompt": 2, "test_prompts": 32},
            "resources": {"cpu": "2", "memory": "4Gi"},
        }
    )


def _paper(name: str, fmt: str, config: str) -> RunConfig:
    # Qwen3.5-35B-A3B (components.architecture.QWEN35_35B_A3B, sources cited there), 40 layers: R-1bit-L20, the 20
    # deepest (the paper's default), of which guidance covers those with FP4 sites (all 20 where the experts'
    # activations are FP4; under W4A8 only KV is, in the full-attention layers: 5 of them); 256 prompts x 16 =
    # 4,096 trajectories a step.
    deep_half = range(QWEN35_35B_A3B.num_layers // 2, QWEN35_35B_A3B.num_layers)
    guided = [layer for layer in rollout_config(config, fmt).fp4_layers(QWEN35_35B_A3B) if layer in deep_half]
    return RunConfig.model_validate(
        {
            "name": name,
            "model": {"checkpoint": "s3://models/qwen3.5-35b-a3b", "dtype": "bfloat16", "max_seq_len": 262144},
            "rollout": {
                "fmt": fmt,
                "config": config,
                "temperature": 1.0,
                "max_new_tokens": 258048,
                "group_size": 16,
                "prompts_per_step": 256,
                "max_tokens_per_forward": 65536,
                # 256 sequences' Gated DeltaNet states are 16.5 GB (64 MB each), their FP4 KV 5.76 KB a token: on a
                # GB200 about 61,000 positions of all 256 fit beside the policy (docs/deploy.md, "GPU memory")
                "max_running_requests": 256,
            },
            "guidance": {
                "bits": 1,
                "layers": len(guided),
                "compaction": "inline",
                # one rank's run of an optimizer step's microbatches (1 x 16 / 8 ranks): each rank reads its own
                # shards alone (docs/training.md, "Data"); at 10,000 tokens a trajectory a shard is about 0.5 GB
                "trajectories_per_shard": 2,
            },
            "method": "trace",
            # training shards 35B parameters with their float32 master, gradients and AdamW moments (16 bytes a
            # parameter, about 560 GB) over 2 nodes x 4 GPUs, about 70 GB a GPU; a GB200 compute tray has 4 GPUs;
            # its 40 layers' activations are not kept at once, and beside that state a microbatch of about 100,000
            # tokens fits, not a 262,144-token trajectory (docs/deploy.md, "GPU memory": benchmarks/memory.py)
            "train": {
                "precision": "fp32_master",
                "activation_checkpointing": True,
                "nodes": 2,
                "processes_per_node": 4,
                "launcher": "trainjob",
            },
            "rl": {
                "schedule": "off_policy",
                "steps_per_round": 4,
                "rounds": 100,
                "rounds_per_run": 14,  # 48 tasks a run (docs/deploy.md, "Known limit"): a chain of 8 runs
                "learning_rate": 1e-6,
                "weight_decay": 0.01,
                "microbatch_size": 1,
                "grad_accumulation": 16,
                "tis_cap": 2.0,
            },
            "tasks": [
                {"name": "program", "difficulty": 5, "train_size": 20000, "test_size": 500},
                {"name": "countdown", "difficulty": 5, "train_size": 20000, "test_size": 500},
            ],
            "evaluation": {"rollout_configs": ["bf16", config], "samples_per_prompt": 8, "test_prompts": 1000},
            "store": {"uri": "s3://tracefp4/runs"},
            "resources": {
                "cpu": "64",
                "memory": "512Gi",
                "host_cpu": "8",  # gather and the TrainJob launcher, which must leave the ranks room on a tray
                "host_memory": "128Gi",  # gather holds a round of 16,384 trajectories: ~100 B per token
                "gpus": 4,  # a TrainJob node: one GB200 compute tray; every other step computes on one GPU
                "accelerator_type": "nvidia.com/gpu",
                "node_selector": {"nvidia.com/gpu.product": "NVIDIA-GB200"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
            "image": "ghcr.io/tracefp4/tracefp4:0.1.0-cuda",
        }
    )


PRESETS: dict[str, RunConfig] = {
    "smoke": _smoke(),
    "tiny-qwen35": _tiny_qwen35(),
    "tiny": _tiny(),
    "paper-nvfp4-wa-kv": _paper("paper-nvfp4-wa-kv", "nvfp4", "fp4_wa_kv"),
    "paper-w4a8-mxfp4-kv": _paper("paper-w4a8-mxfp4-kv", "mxfp4", "w4a8_mxfp4_kv"),
}


def get_preset(name: str) -> RunConfig:
    """A fresh copy of a named preset (callers may change it freely)."""
    try:
        return PRESETS[name].model_copy(deep=True)
    except KeyError:
        raise ValueError(f"unknown run preset {name!r}; expected one of {sorted(PRESETS)}") from None
