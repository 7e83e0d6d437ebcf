"""Guidance compaction and storage: bits per element and fidelity for R-1..R-4
x {all, deeper half, deeper quarter, shallow half} layers on captures of the tiny
preset; the syndrome codec side by side with R-1..R-4 on every layer, decoded
inline in guided training forwards, on the tiny preset's random weights and
after its bootstrap SFT; then the guidance store's write and read of one
step's shards as a ratio to plain minio-SDK put/get of the same bytes on the
same S3 server (a SeaweedFS started on loopback).

    python benchmarks/guidance.py [--prompts 32] [--new-tokens 32] [--repeat 3] [--bootstrap-steps 480]
        [--parts compaction,syndrome,bootstrapped,speed,store] [--speed-rows 16384] [--threads N]

The last line is one JSON object with every figure.
"""

import argparse
import copy
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from minio import Minio

from tracefp4.components import steps
from tracefp4.components.capture import Capture, CaptureConfig, CaptureRecords, SiteTable, TokenMap
from tracefp4.components.checkpoint import load_model
from tracefp4.components.device import resolve
from tracefp4.components.guidance import (
    GuidanceLoader,
    compact,
    compaction_figures,
    select_layers,
    write_step,
)
from tracefp4.components.mismatch import MismatchTally, compare, join_rows, teacher_force
from tracefp4.components.model import build_model
from tracefp4.components.quant_config import rollout_config
from tracefp4.components.rl import SequenceBatch
from tracefp4.components.rollout import SamplingParams, TorchEngine
from tracefp4.components.store import open_store
from tracefp4.components.syndrome import DecodeStats, decode_rows, encode_table, site_rates
from tracefp4.components.syndrome_rate import first_rate
from tracefp4.components.tasks import format_example
from tracefp4.components.tokenizer import load_tokenizer
from tracefp4.components.trainer import TrainConfig, Trainer
from tracefp4.kernels import quantize, unpack_nibbles
from tracefp4.schemas import get_preset

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
            figures = compaction_figures(full, bits, chosen, training)
            rows.append({"bits": bits, "layers": label, "chosen": list(chosen), **figures})
    return rows, mismatch


def guided_forward(model, engine, trajectories, store, step: int) -> tuple[CaptureRecords, dict]:
    """The training path's codes at every captured site in one guided forward
    over the trajectories (the step's guidance in ``store``; syndrome-coded
    tables decode inline, layer by layer), and the decode statistics."""
    trainer = Trainer(
        copy.deepcopy(model), TrainConfig(microbatch_size=len(trajectories)), engine.quant, engine.global_scales
    )
    batch = SequenceBatch.of(trajectories, trainer.device)
    config = CaptureConfig(max_tokens=batch.tokens.numel())
    recorder = Capture(model.cfg, engine.quant, config, engine.global_scales, trainer.device, kv_from_forward=True)
    recorder.begin(TokenMap.of(batch.trajectories, batch.positions, batch.lengths - 1))  # the positions the rollout fed
    guidance = next(iter(GuidanceLoader(store, step, [batch.trajectories])))
    with torch.no_grad():
        sites, _ = trainer._forward(batch, guidance, recorder)
    recorder.end()
    decode = {key: DecodeStats.from_tally(rate, tally.tolist()) for key, (rate, tally) in sites.coverage.decode.items()}
    return recorder.drain(), decode


def fidelity_by_layer(reference: CaptureRecords, guided: CaptureRecords) -> dict[int, float]:
    """Per layer, the share of captured elements whose guided FP4 value (code
    and block scale) equals the one full R-4 guidance gives (rows the two
    forwards routed to different experts count as different)."""
    same, total = {}, {}
    for (layer, site), ref in reference.tables.items():
        run = guided.tables[(layer, site)]
        ref_rows, run_rows = join_rows(ref, run)
        equal = int((ref.values()[ref_rows] == run.values()[run_rows]).sum())
        same[layer] = same.get(layer, 0) + equal
        total[layer] = total.get(layer, 0) + len(ref.traj) * ref.width
    return {layer: same[layer] / total[layer] for layer in sorted(total)}


def syndrome_table(model, engine, trajectories, full: CaptureRecords) -> list[dict]:
    """R-1..R-4 on every layer and the syndrome codec (the first step's rate,
    then rates chosen from that step's decode statistics) on the same capture:
    bits per captured element (scales included), per-layer fidelity to R-4,
    decode failures."""
    layers = sorted({layer for layer, _ in full.tables})
    elements = sum(len(t.traj) * t.width for t in full.tables.values())
    codings = {f"R-{bits}": compact(full, bits, layers) for bits in (4, 3, 2, 1)}
    rows, reference, decode = [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(Path(tmp).as_uri())
        step = 0
        for label in [*codings, "syndrome, first step", "syndrome, rate control"]:
            if label.startswith("syndrome"):
                previous = {f"{layer}/{site}": d.to_json() for (layer, site), d in decode.items()} if decode else None
                rates = site_rates(full.tables, previous, 0.25)
                codings[label] = CaptureRecords({key: encode_table(t, rates[key]) for key, t in full.tables.items()})
            coded = codings[label]
            write_step(store, coded, rl_step=step, policy_version=0, top_k=model.cfg.top_k)
            guided, found = guided_forward(model, engine, trajectories, store, step)
            step += 1
            reference = reference or guided
            if label.startswith("syndrome"):
                decode = found
            fidelity = fidelity_by_layer(reference, guided)
            rows.append(
                {
                    "coding": label,
                    "bits_per_element": 8 * coded.nbytes / elements,
                    "fidelity_by_layer": fidelity,
                    "min_layer_fidelity": min(fidelity.values()),
                    "decode_blocks": sum(d.blocks for d in found.values()) if found else None,
                    "decode_failed": sum(d.failed for d in found.values()) if found else None,
                }
            )
    return rows


def print_syndrome(title: str, rows: list[dict]) -> None:
    print(f"\n{title}: every layer guided, fidelity to R-4 per layer (targets: syndrome <= 0.35 bit, >= 0.99)")
    print(f"{'coding':>24} {'bits/elem':>9} {'min layer':>9}  per layer             failed blocks")
    for r in rows:
        per_layer = " ".join(f"{v:.4f}" for v in r["fidelity_by_layer"].values())
        failed = "" if r["decode_blocks"] is None else f"{r['decode_failed']}/{r['decode_blocks']}"
        print(f"{r['coding']:>24} {r['bits_per_element']:9.3f} {r['min_layer_fidelity']:9.4f}  {per_layer}  {failed}")


def bootstrapped_tiny(folder: Path, steps_override: int | None):
    """The tiny preset's model after its bootstrap SFT, its tokenizer and training prompts."""
    config = get_preset("tiny")
    if steps_override is not None:
        config = config.model_copy(update={"bootstrap": config.bootstrap.model_copy(update={"steps": steps_override})})
    figures = steps.prepare(config, folder, "bench")
    tokenizer = load_tokenizer(folder)
    problems = steps.training_problems(config, 0, 32)
    prompts = [tokenizer.encode_prompt(format_example(p)) for p in problems]
    return load_model(folder), prompts, figures


def syndrome_on(model, prompts, new_tokens: int) -> list[dict]:
    engine = TorchEngine(model, rollout_config("fp4_wa_kv"), capture=CaptureConfig(max_tokens=4096))
    trajectories = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, seed=0))
    return syndrome_table(model, engine, trajectories, engine.drain_capture())


def codec_speed(rows: int, threads: int, repeat: int, device: str = "cpu") -> dict:
    """Encode and decode rates of the syndrome codec on ``device`` (the CPU:
    vectorized torch; CUDA: the Triton kernels of kernels/triton_syndrome.py),
    in captured elements per second, best of ``repeat``, on ``rows``
    rows of 256 elements (one row a block) at the first step's rate; the
    training side's values drift from the rollout's so that about 1% of the low
    code bits disagree, as measured with the layers below guided. Rates per
    second of wall time and per second of this process's CPU time (on a shared
    machine the two differ by the time other processes held the cores)."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 256, generator=gen) * torch.rand(rows, 1, generator=gen).add(0.5)
    g = torch.tensor(x.abs().max().item() / (6 * 448))
    x, g = x.to(device), g.to(device)
    q = quantize(x, "nvfp4", global_scale=g)
    n, pos = torch.zeros(rows, dtype=torch.long, device=device), torch.arange(rows, device=device)
    table = SiteTable(0, "moe_in", "nvfp4", 4, 256, float(g), n, pos, n, n - 1, q.codes, q.scales.view(torch.uint8))
    train = x * (1 + 4e-3 * torch.randn(x.shape, generator=gen)).to(device)
    own = unpack_nibbles(quantize(train, "nvfp4", global_scale=g).codes) & 1
    disagreement = float((own != unpack_nibbles(q.codes) & 1).float().mean())
    available = torch.ones(rows, dtype=torch.bool, device=device)
    rate = first_rate(0.25)
    best = {}  # per stage: (wall seconds, CPU seconds of this process), best of repeat

    def timed(stage, run, *args):
        start, cpu = time.perf_counter(), time.process_time()
        result = run(*args)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start, time.process_time() - cpu)
        best[stage] = min(best.get(stage, seconds), seconds)
        return result

    for _ in range(repeat):
        coded = timed("encode", encode_table, table, rate)
        ok = timed("decode", decode_rows, coded, train, available)[2]
    return {
        "device": device,
        "elements": rows * 256,
        "threads": threads,
        "load_average": os.getloadavg()[0],
        "low_bit_disagreement": disagreement,
        "decoded_share": float(ok.float().mean()),
        "encode_melem_per_s": rows * 256 / best["encode"][0] / 1e6,
        "decode_melem_per_s": rows * 256 / best["decode"][0] / 1e6,
        "encode_melem_per_cpu_s": rows * 256 / best["encode"][1] / 1e6,
        "decode_melem_per_cpu_s": rows * 256 / best["decode"][1] / 1e6,
    }


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


PARTS = ("compaction", "syndrome", "bootstrapped", "speed", "store")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bootstrap-steps", type=int, default=None, help="default: the tiny preset's")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument("--speed-rows", type=int, default=16384, help="rows of 256 elements the codec is timed on")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for the timing")
    parser.add_argument("--device", default="cpu", help="where the speed part runs the codec (cuda: Triton kernels)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    model = build_model("tiny", seed=0)
    engine = TorchEngine(model, rollout_config("fp4_wa_kv"), capture=CaptureConfig(max_tokens=4096))
    if {"compaction", "syndrome", "store"} & set(parts):  # the parts that read the random-weights capture
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.cfg.vocab_size, (24,), generator=gen).tolist() for _ in range(args.prompts)]
        trajectories = engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, seed=0))
        full = engine.drain_capture()
    out = {}
    if "compaction" in parts:
        rows, out["layer_mismatch"] = compaction_table(engine, trajectories, full)
        out["compaction"] = rows
        print(f"{'R-bits':>6} {'layers':>15} {'bits/elem':>9} {'x full':>7} {'fidelity':>8}")
        for r in rows:
            print(
                f"{r['bits']:>6} {r['layers']:>15} {r['bits_per_element']:9.3f} {r['ratio_to_full']:7.3f} "
                f"{r['fidelity']:8.4f}"
            )
    syndrome = out["syndrome"] = {}
    if "syndrome" in parts:
        syndrome["random_weights"] = syndrome_table(model, engine, trajectories, full)
        print_syndrome("Syndrome codec, tiny preset, random weights", syndrome["random_weights"])
    if "bootstrapped" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            tuned, task_prompts, syndrome["bootstrap"] = bootstrapped_tiny(Path(tmp) / "policy", args.bootstrap_steps)
        syndrome["bootstrapped"] = syndrome_on(tuned, task_prompts[: args.prompts], args.new_tokens)
        print_syndrome(
            f"Syndrome codec, tiny preset after bootstrap SFT ({syndrome['bootstrap']})", syndrome["bootstrapped"]
        )
    if "speed" in parts:
        speed = syndrome["speed"] = codec_speed(args.speed_rows, args.threads, args.repeat, str(resolve(args.device)))
        print(
            f"syndrome codec, {args.device} ({speed['threads']} threads, load average {speed['load_average']:.1f}), "
            f"{speed['elements']} elements at {speed['low_bit_disagreement']:.2%} low-bit disagreement: "
            f"encode {speed['encode_melem_per_s']:.1f} M elements/s ({speed['encode_melem_per_cpu_s']:.1f} per CPU s; "
            f"target >= 50), decode {speed['decode_melem_per_s']:.1f} M elements/s "
            f"({speed['decode_melem_per_cpu_s']:.1f} per CPU s; target >= 20), "
            f"{speed['decoded_share']:.2%} of blocks decoded"
        )
    if "store" in parts:
        store = out["store"] = store_throughput(full, model.cfg.top_k, args.repeat)
        print(
            f"store vs plain minio SDK on one step ({store['step_bytes']} bytes): write "
            f"{store['write_throughput_vs_sdk']:.2f}x, read {store['read_throughput_vs_sdk']:.2f}x (target >= 0.8); "
            f"write_step {store['write_step_seconds']:.3f} s, load {store['load_step_seconds']:.3f} s"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
