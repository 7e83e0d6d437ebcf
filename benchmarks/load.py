"""Peak memory of loading a checkpoint (``components/checkpoint.py``
``load_model``) against the checkpoint's size: issue #14's target is at most
1.3x. And what saving it again (``save_model``, sharded as it came) adds
over the loaded model: about one shard, as tensors are made contiguous in
the Hub layout a shard at a time.

It writes a random bf16 ``qwen3_moe`` checkpoint in the Hub layout (sharded
safetensors and their index, per-expert tensors, no checksum manifest: as a
user brings one from the Hub) into a temporary folder, then loads it in a
child process that reports its own peak resident memory (``VmHWM``). A second
child only imports torch and tracefp4 and reports its peak too: that baseline
(the interpreter, torch's libraries) is subtracted, so the ratio is what
loading adds, over the checkpoint's bytes. Each child is a fresh process, so
nothing the parent holds (the checkpoint it wrote) is counted.

    python benchmarks/load.py            # >= 1 GB checkpoint (about 1.2 GB)
    python benchmarks/load.py --quick    # about 70 MB, what tests/test_load_benchmark.py runs

Prints the figures, then one JSON line.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from tracefp4.components.architecture import ModelConfig
from tracefp4.components.checkpoint import CONFIG, INDEX, config_to_hf, hub_shapes
from tracefp4.components.device import cpu_kind

TARGET = 1.3  # issue #14: peak RSS at most 1.3x the checkpoint's bytes
SIZES = {
    # 8 layers x 40 experts of 3 x 1024 x 512, a 32k vocabulary: 1.19 GB in bf16
    "full": ModelConfig(
        vocab_size=32000,
        hidden_size=1024,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=128,
        num_experts=40,
        top_k=4,
        moe_intermediate_size=512,
    ),
    # 4 layers x 8 experts of 3 x 512 x 512, an 8k vocabulary: 69 MB
    "quick": ModelConfig(
        vocab_size=8192,
        hidden_size=512,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=512,
    ),
}
# A child: import, optionally load (and save again), report the peak resident memory (kB in /proc/self/status).
CHILD = """
import json, sys
import torch
from tracefp4.components.checkpoint import load_model, save_model
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
params, save_added = 0, None
if sys.argv[1] != "-":
    model = load_model(sys.argv[1])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
peak = status("VmHWM")
if len(sys.argv) > 2:
    open("/proc/self/clear_refs", "w").write("5")  # the peak reset to the current resident memory
    before = status("VmRSS")
    save_model(model, sys.argv[2], max_shard_bytes=int(sys.argv[3]))
    save_added = status("VmHWM") - before
print(json.dumps({"peak_rss_bytes": peak, "param_bytes": params, "save_added_bytes": save_added}))
"""


def module_order(name: str) -> tuple:
    """Hub tensors in the order transformers writes them: embeddings, layer by layer, final norm, head."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return (1, int(layer[1]), name) if layer else (0 if "embed" in name else 2, 0, name)


def write_checkpoint(cfg: ModelConfig, folder: Path, shard_bytes: int, seed: int = 0) -> int:
    """A random bf16 checkpoint of ``cfg`` at ``folder``, one shard in memory at a time; returns its tensor bytes."""
    gen = torch.Generator().manual_seed(seed)
    names = sorted(hub_shapes(cfg).items(), key=lambda item: module_order(item[0]))
    shards, current, size = [], {}, 0
    for name, shape in names:
        current[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        size += current[name].numel() * 2
        if size >= shard_bytes or name == names[-1][0]:
            shards.append(sorted(current))
            save_file(current, folder / f"part-{len(shards)}.safetensors", metadata={"format": "pt"})
            current, size = {}, 0
    weight_map, total = {}, 0
    for i, keys in enumerate(shards, 1):
        final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        (folder / f"part-{i}.safetensors").rename(folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    total = sum(2 * torch.Size(shape).numel() for _, shape in names)
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / CONFIG).write_text(json.dumps(config_to_hf(cfg)))
    return total


def child(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the loading child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 69 MB checkpoint instead of 1.19 GB")
    parser.add_argument("--shard-mb", type=int, default=0, help="shard size in MB (default: a quarter of the total)")
    args = parser.parse_args()
    size = "quick" if args.quick else "full"
    cfg = SIZES[size]
    with tempfile.TemporaryDirectory(prefix="tracefp4-load-") as tmp:
        folder = Path(tmp)
        total = sum(2 * torch.Size(s).numel() for s in hub_shapes(cfg).values())
        shard_bytes = args.shard_mb << 20 if args.shard_mb else total // 4
        written = write_checkpoint(cfg, folder, shard_bytes)
        shards = len(list(folder.glob("*.safetensors")))
        baseline = child("-")
        loaded = child(str(folder), str(folder / "saved"), str(shard_bytes))
    added = loaded["peak_rss_bytes"] - baseline["peak_rss_bytes"]
    figures = {
        "benchmark": "load",
        "size": size,
        "checkpoint_bytes": written,
        "shards": shards,
        "param_bytes": loaded["param_bytes"],
        "baseline_peak_rss_bytes": baseline["peak_rss_bytes"],
        "load_peak_rss_bytes": loaded["peak_rss_bytes"],
        "ratio": added / written,
        "target": TARGET,
        "shard_bytes": shard_bytes,
        "save_added_bytes": loaded["save_added_bytes"],
        "save_added_over_shard": loaded["save_added_bytes"] / shard_bytes,
        **cpu_kind(),
    }
    print(f"checkpoint: {written / 1e9:.3f} GB bf16 in {shards} shards ({size})")
    print(f"peak RSS of a child that only imports torch + tracefp4: {baseline['peak_rss_bytes'] / 1e9:.3f} GB")
    print(f"peak RSS of a child that loads the checkpoint: {loaded['peak_rss_bytes'] / 1e9:.3f} GB")
    print(f"(peak RSS - baseline) / checkpoint bytes = {figures['ratio']:.3f} (target <= {TARGET})")
    print(
        f"saving it again in shards of {shard_bytes / 1e9:.3f} GB adds {loaded['save_added_bytes'] / 1e9:.3f} GB "
        f"to the loaded model's resident memory: {figures['save_added_over_shard']:.2f} shards"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
