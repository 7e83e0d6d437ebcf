"""`benchmarks/load.py --quick` runs in the tests, so that the command that
measures load's peak memory cannot rot (the figure itself is the full run's,
docs/rollout.md)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_load_benchmark_ends_with_its_figures():
    command = [sys.executable, "benchmarks/load.py", "--quick"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["benchmark"] == "load" and figures["size"] == "quick" and figures["shards"] == 4
    assert figures["param_bytes"] == figures["checkpoint_bytes"] > 64 << 20  # loaded in bf16, every tensor
    assert figures["load_peak_rss_bytes"] > figures["baseline_peak_rss_bytes"] > 0
    assert figures["target"] == 1.3 and figures["cpu"] and figures["cpu_bf16"] in ("native", "emulated")
    # 1.7x here: a fixed ~50 MB (one layer's mapped pages, small allocations) over 69 MB; the loader before
    # the lean one (all tensors, a stacked copy, a float32 model) took over 4x
    assert 1.0 <= figures["ratio"] < 2.5
    # saving it again adds about one shard, made contiguous as it is written (2.8 shards when the Hub layout
    # was one contiguous copy of every expert before the first shard was written)
    assert 0.5 <= figures["save_added_over_shard"] < 1.5
