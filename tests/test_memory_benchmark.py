"""`benchmarks/memory.py` runs in the tests, so that the command behind
docs/deploy.md's "GPU memory" cannot rot, and the figures it
prints follow from the library's own sizes."""

import json
import subprocess
import sys
from pathlib import Path

from tracefp4.components.architecture import QWEN35_35B_A3B

ROOT = Path(__file__).resolve().parent.parent


def test_the_memory_benchmark_sizes_the_paper_preset_from_the_librarys_classes():
    command = [sys.executable, "benchmarks/memory.py", "--tokens", "64"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["benchmark"] == "memory" and figures["preset"] == "paper-nvfp4-wa-kv"
    cfg = QWEN35_35B_A3B
    # FP4 KV: codes and a scale byte per 16 elements, K and V, the full-attention layers, 256 rows
    kv = 256 * len(cfg.attention_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * (1 / 2 + 1 / 16)
    assert figures["rollout_kv_mb_per_position"] == round(kv / 1e6, 3)
    # what docs/deploy.md says: neither the rollout's cache nor a training microbatch reaches max_new_tokens
    assert 0 < figures["rollout_longest_cache_positions"] < figures["max_new_tokens"]
    assert 0 < figures["train_longest_microbatch_tokens"] < figures["max_new_tokens"]
    assert figures["train_state_gb_per_rank"] == 69.3  # 16 bytes x 34.66 B parameters over 8 ranks
