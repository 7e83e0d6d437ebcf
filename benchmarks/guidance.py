"""Guidance compaction and storage: bits per element and fidelity for R-1..R-4
x {all, deeper half, deeper quarter, shallow half} layers on captures of the tiny
preset; then the guidance store's write and read of one step's shards as a
ratio to plain minio-SDK put/get of the same bytes on the same S3 server (a
SeaweedFS started on loopback).

    python benchmarks/guidance.py [--prompts 32] [--new-tokens 32] [--repeat 3]

The last line is one JSON object with every figure.
"""

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from minio import Minio

from tracefp4.components.capture import CaptureConfig
from tracefp4.components.guidance import (
    GuidanceLoader,
    compact,
    compaction_report,
    select_layers,
    write_step,
)
from tracefp4.components.mismatch import MismatchTally, compare, teacher_force
from tracefp4.components.model import build_model
from tracefp4.components.quant import rollout_config
from tracefp4.components.rollout import SamplingParams, TorchEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from s3_server import S3Server  # noqa: E402  (the test suite's SeaweedFS launcher)


def compaction_table(engine, trajectories, full) -> tuple[list[dict], dict]:
    training = teacher_force(engine, trajectories, keep_inputs=True)
    tally = MismatchTally()
    tally.add(compare(full, training))
    mismatch = tally.summary()["code_mismatch_by_layer"]  # end to end: a layer's rate includes the cascade below it
    layers = sorted({layer for layer, _ in full.tables})
    selections = {
        "all": "all",
        "deeper half": len(layers) // 2,
        "deeper quarter": max(1, len(layers) // 4),
        "shallow half": layers[: len(layers) // 2],
    }
    rows = []
    for bits in (1, 2, 3, 4):
        for label, spec in selections.items():
            chosen = select_layers(spec, layers)
            total = compaction_report(full, compact(full, bits, chosen), training).total
            rows.append(
                {
                    "bits": bits,
                    "layers": label,
                    "chosen": list(chosen),
                    "bits_per_element": total["bits_per_element"],
                    "ratio_to_full": total["ratio_to_full"],
                    "fidelity": total["fidelity"],
                }
            )
    return rows, mismatch


def store_throughput(records, top_k: int, repeat: int) -> dict:
    """Seconds to write and read one step through the guidance store vs minio's put/get of the same bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        server = S3Server(tmp)
        server.start()
        try:
            return _time_step(server, records, top_k, repeat)
        finally:
            server.stop()


def _time_step(server: S3Server, records, top_k: int, repeat: int) -> dict:
    store = server.store("bench")
    client = Minio(server.endpoint, server.access_key, server.secret_key, secure=False)
    manifest = write_step(store, records, rl_step=0, policy_version=0, top_k=top_k)
    blobs = {e["key"]: store.get_bytes(e["key"]) for e in manifest["shards"]}
    blobs["manifest"] = json.dumps(manifest).encode()
    ids = [t for e in manifest["shards"] for t in e["trajectories"]]

    def sdk_write(step):
        for key, data in blobs.items():
            client.put_object(server.bucket, f"plain/{step}/{key}", io.BytesIO(data), len(data))

    def sdk_read(step):
        for key in blobs:
            response = client.get_object(server.bucket, f"plain/{step}/{key}")
            response.read()
            response.close()
            response.release_conn()

    def store_write(step):
        for key, data in blobs.items():
            store.put_bytes(f"copy/{step}/{key}", data)

    def store_read(step):
        for key in blobs:
            store.get_bytes(f"copy/{step}/{key}")

    runs = {
        "store_write": store_write,
        "store_read": store_read,
        "sdk_write": sdk_write,
        "sdk_read": sdk_read,
        # the whole path: encode + checksums + shards + manifest; read, verify, align to a microbatch
        "write_step": lambda step: write_step(store, records, rl_step=step, policy_version=0, top_k=top_k),
        "load_step": lambda step: list(GuidanceLoader(store, step, [ids])),
    }
    best = dict.fromkeys(runs, float("inf"))
    for step in range(1, repeat + 1):  # interleaved rounds, best of each
        for name, run in runs.items():
            start = time.perf_counter()
            run(step)
            best[name] = min(best[name], time.perf_counter() - start)
    return {
        "step_bytes": sum(len(b) for b in blobs.values()),
        **{f"{k}_seconds": v for k, v in best.items()},
        "write_throughput_vs_sdk": best["sdk_write"] / best["store_write"],
        "read_throughput_vs_sdk": best["sdk_read"] / best["store_read"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    model = build_model("tiny", seed=0)
    engine = TorchEngine(model, rollout_config("fp4_wa_kv"), capture=CaptureConfig(max_tokens=4096))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab_size, (24,), generator=gen).tolist() for _ in range(args.prompts)]
    trajectories = engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, seed=0))
    full = engine.drain_capture()

    rows, mismatch = compaction_table(engine, trajectories, full)
    print(f"{'R-bits':>6} {'layers':>15} {'bits/elem':>9} {'x full':>7} {'fidelity':>8}")
    for r in rows:
        print(
            f"{r['bits']:>6} {r['layers']:>15} {r['bits_per_element']:9.3f} {r['ratio_to_full']:7.3f} "
            f"{r['fidelity']:8.4f}"
        )
    store = store_throughput(full, model.cfg.top_k, args.repeat)
    print(
        f"store vs plain minio SDK on one step ({store['step_bytes']} bytes): write "
        f"{store['write_throughput_vs_sdk']:.2f}x, read {store['read_throughput_vs_sdk']:.2f}x (target >= 0.8); "
        f"write_step {store['write_step_seconds']:.3f} s, load {store['load_step_seconds']:.3f} s"
    )
    print(json.dumps({"compaction": rows, "layer_mismatch": mismatch, "store": store}))


if __name__ == "__main__":
    main()
