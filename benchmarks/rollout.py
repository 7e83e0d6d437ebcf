"""Rollout throughput: this engine vs transformers' ``generate`` on the same
checkpoint, batch and lengths (BF16, both with a KV cache), and the torch
calls each makes per decode step; the cost of capture; bytes captured per
token; KV cache bytes per token; how decode speed of Gated DeltaNet
layers (qwen3_5_moe) holds up as the context grows; and what continuous
batching gains over static waves when responses end at scattered lengths.

    python benchmarks/rollout.py [--preset tiny] [--batches 32 128] [--prompt-len 32] [--new-tokens 64] [--repeat 3]
    python benchmarks/rollout.py --linear-decode-only   # the Gated DeltaNet row alone
    python benchmarks/rollout.py --speed-only           # the engine against generate alone
    python benchmarks/rollout.py --batching-only        # continuous batching against static waves alone
    python benchmarks/rollout.py --anatomy-only         # where a decode step's time goes

The last line is one JSON object with every figure, the CPU it was
measured on (model, bf16 native or emulated: ``TRACEFP4_CPU_BF16``) and, for
the engine against ``generate``, how many cores other processes kept busy
meanwhile.
"""

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from tracefp4.components import model as model_module
from tracefp4.components.architecture import PRESETS
from tracefp4.components.capture import CaptureConfig
from tracefp4.components.checkpoint import save_model
from tracefp4.components.device import cpu_kind, keep_freed_memory
from tracefp4.components.model import build_model, right_pad
from tracefp4.components.quant_config import rollout_config
from tracefp4.components.rollout import KVCache, SamplingParams, TorchEngine


def tokens_per_second(fn, n_tokens: int) -> float:
    start = time.perf_counter()
    fn()
    return n_tokens / (time.perf_counter() - start)


def best_of(repeat: int, *runs):
    """Each run's best figure over ``repeat`` interleaved rounds: noise on a shared machine hits all alike."""
    figures = [[run() for run in runs] for _ in range(repeat)]
    return [max(column) for column in zip(*figures)]


def busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have spent since boot (Linux's /proc/stat; None elsewhere)."""
    try:
        ticks = [int(n) for n in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


@contextlib.contextmanager
def others_on_the_cores(figures: dict):
    """Records in ``figures`` how many cores other processes kept busy
    meanwhile (the machine's CPU time less this process's, over the wall
    time), and warns above a quarter of one: such a run's figures are the
    other work's as much as the machine's (docs/performance.md, "Figures on
    a shared machine")."""
    machine, own, start = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    yield
    if machine is None:
        return
    others = (busy_cpu_seconds() - machine - (time.process_time() - own)) / (time.perf_counter() - start)
    figures["other_processes_busy_cores"] = round(max(others, 0.0), 2)
    if others > 0.25:
        print(
            f"other processes kept {others:.1f} cores busy during the timing: compare ratios from quiet runs",
            file=sys.stderr,
        )


class CountCalls(TorchFunctionMode):
    """Counts the torch functions and tensor methods Python calls (property
    reads such as ``.shape`` left out): each is a trip through torch's
    dispatcher, whose fixed cost sets the pace of a small model's decode step
    on a CPU (docs/rollout.md)."""

    calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += getattr(func, "__name__", "") != "__get__"
        return func(*args, **(kwargs or {}))


def calls_per_decode_step(generate) -> float:
    """Torch calls per decode step of ``generate(new_tokens)``: the difference
    between 24 and 16 new tokens, so that the prefill and setup cancel (both
    span one of the engine's stop checks)."""
    counts = []
    for new_tokens in (16, 24):
        with CountCalls() as counter:
            generate(new_tokens)
        counts.append(counter.calls)
    return (counts[1] - counts[0]) / 8


def hf_generate(checkpoint: str, device: str):
    """transformers' generate on the checkpoint, sampling every step to the full length."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device).eval()

    def run(prompts: torch.Tensor, new_tokens: int):
        with torch.no_grad():
            model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=True,
                top_k=0,
                temperature=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )

    return run


def _sync(device: torch.device) -> None:
    """Wait for a GPU's queued work (a CPU's is done when its call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefilled(engine: TorchEngine, batch: int, context: int, steps: int):
    """A batch of ``context`` random tokens a row, prefilled into a KV cache with
    room for ``steps`` more: the first decode step's inputs (new tokens, lengths,
    ids) and the cache."""
    gen = torch.Generator().manual_seed(context)
    prompts = torch.randint(0, engine.model.cfg.vocab_size, (batch, context), generator=gen).tolist()
    tokens, positions, lengths = right_pad(prompts, device=engine.device)
    cache = KVCache(engine.model.cfg, batch, context + steps, engine.sites, engine.dtype, engine.device)
    ids = torch.arange(batch, device=engine.device)
    with torch.no_grad():
        new = engine._prefill(tokens, positions, lengths, ids, cache).argmax(-1)
    return new, lengths, ids, cache


def decode_tokens_per_s(engine: TorchEngine, batch: int, context: int, steps: int) -> float:
    """Greedy decode steps per second x batch after a prefill of ``context``
    tokens: the decode loop alone, through the engine's own prefill and decode
    steps (``generate`` would time the prefill too)."""
    new, lengths, ids, cache = _prefilled(engine, batch, context, steps)
    _sync(engine.device)
    start = time.perf_counter()
    with torch.no_grad():
        for step in range(steps):
            lengths = lengths + 1
            new = engine._decode(new, lengths, ids, cache, context + step + 1).argmax(-1)
    _sync(engine.device)
    return batch * steps / (time.perf_counter() - start)


def step_anatomy(engine: TorchEngine, batch: int, context: int, steps: int, repeat: int) -> dict:
    """Where a decode step's time goes, in milliseconds a step (the best of
    ``repeat`` interleaved rounds): the step as it runs; the step with every
    matmul and attention call (those of model.py, which all go through
    ``batch_invariant``) answered from a table of outputs computed once per
    call shape, which leaves the small ops and Python; and the step's matmul
    and attention calls alone, replayed back to back on the inputs one step
    gave them, so that their weights and code stay warm in the caches. The
    calls take (step - rest) inside the step, against the replay alone."""
    real, outputs, calls = model_module.batch_invariant, {}, []

    def answered(op, *args, **kwargs):
        key = (op, *(None if a is None else (a.shape, a.dtype) for a in args))
        if key not in outputs:
            outputs[key] = real(op, *args, **kwargs)
        return outputs[key]

    def recorded(op, *args, **kwargs):
        calls.append((op, args, kwargs))
        return real(op, *args, **kwargs)

    def stubbed() -> float:
        with mock.patch.object(model_module, "batch_invariant", answered):
            return decode_tokens_per_s(engine, batch, context, steps)

    def replayed() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            for op, args, kwargs in calls:
                real(op, *args, **kwargs)  # as the step runs them: emulated where bf16 is
        _sync(engine.device)
        return batch * steps / (time.perf_counter() - start)

    new, lengths, ids, cache = _prefilled(engine, batch, context, 1)
    with torch.no_grad(), mock.patch.object(model_module, "batch_invariant", recorded):
        engine._decode(new, lengths + 1, ids, cache, context + 1)
    stubbed()  # fills the table
    with torch.no_grad():
        rates = best_of(repeat, lambda: decode_tokens_per_s(engine, batch, context, steps), stubbed, replayed)
    step, rest, alone = (1e3 * batch / rate for rate in rates)
    return {
        f"b{batch}_decode_step_ms": step,
        f"b{batch}_decode_step_rest_ms": rest,
        f"b{batch}_matmul_attention_calls": len(calls),
        f"b{batch}_matmul_attention_in_step_ms": step - rest,
        f"b{batch}_matmul_attention_replayed_ms": alone,
    }


def linear_decode_scaling(args, device: str) -> dict:
    """Decode tokens/s at a long vs a short context on tiny-qwen35 with every
    layer Gated DeltaNet (O(1) state per sequence), and, for contrast, with every
    layer full attention (the KV read grows with the context)."""
    base = PRESETS["tiny-qwen35"]
    figures = {}
    for mixer in ("linear_attention", "full_attention"):
        model = build_model(dataclasses.replace(base, layer_types=(mixer,) * base.num_layers), seed=0)
        engine = TorchEngine(model, rollout_config("bf16"), device=device)
        decode_tokens_per_s(engine, 2, 8, 2)  # warm-up
        short, long = args.linear_contexts
        rates = best_of(
            args.repeat,
            *(
                lambda engine=engine, context=context: decode_tokens_per_s(
                    engine, args.linear_batch, context, args.linear_steps
                )
                for context in (short, long)
            ),
        )
        name = "linear" if mixer == "linear_attention" else "full"
        figures[f"{name}_decode_tokens_per_s_ctx{short}"] = rates[0]
        figures[f"{name}_decode_tokens_per_s_ctx{long}"] = rates[1]
        figures[f"{name}_decode_ratio_ctx{long}_to_ctx{short}"] = rates[1] / rates[0]
        print(
            f"{mixer} layers only: decode {rates[0]:8.1f} tok/s at context {short}, {rates[1]:8.1f} at {long}: "
            f"{rates[1] / rates[0]:.2f}x" + (" (target >= 0.8)" if name == "linear" else "")
        )
    return figures


def continuous_batching(args, model, device: str) -> dict:
    """``--batching-requests`` requests, ``--batching-rows`` at a time, whose
    responses end at a stop token drawn with probability 1/64 per token (the
    sampled tokens of random weights spread evenly over the vocabulary: a long
    tail of lengths up to ``--batching-new-tokens``). One call that runs them
    with ``max_running_requests`` (waiting requests take the rows of finished
    ones) against one call per static wave of as many (each wave runs until
    its longest response ends), in the same process on the same engine
    settings: response tokens per second, and the same responses."""
    rows, n = args.batching_rows, args.batching_requests
    stops = tuple(range(0, model.cfg.vocab_size, 64))
    sampling = SamplingParams(max_new_tokens=args.batching_new_tokens, seed=0, stop_tokens=stops)
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (n,), generator=gen)
    prompts = [torch.randint(0, model.cfg.vocab_size, (int(k),), generator=gen).tolist() for k in lengths]
    continuous = TorchEngine(model, rollout_config("bf16"), device=device, max_running_requests=rows)
    static = TorchEngine(model, rollout_config("bf16"), device=device)
    out, steps = {}, {}  # the decode steps of a rollout: where the time goes

    def in_waves():
        return [t for i in range(0, n, rows) for t in static.generate(prompts[i : i + rows], sampling, i, i)]

    def timed(name, engine, run):
        before, start = engine.decode_steps, time.perf_counter()
        out[name] = run()
        seconds, steps[name] = time.perf_counter() - start, engine.decode_steps - before
        return sum(len(t.response) for t in out[name]) / seconds

    continuous.generate(prompts[:2], SamplingParams(max_new_tokens=2))  # warm-up
    ours, waves = best_of(
        args.repeat,
        lambda: timed("continuous", continuous, lambda: continuous.generate(prompts, sampling, 0)),
        lambda: timed("waves", static, in_waves),
    )
    responses = [[(t.id, t.response, t.logprobs) for t in out[name]] for name in ("continuous", "waves")]
    figures = {
        "batching_rows": rows,
        "batching_requests": n,
        "batching_mean_response_tokens": sum(len(t.response) for t in out["waves"]) / n,
        "batching_max_response_tokens": max(len(t.response) for t in out["waves"]),
        "batching_continuous_tokens_per_s": ours,
        "batching_waves_tokens_per_s": waves,
        "batching_continuous_over_waves": ours / waves,
        "batching_continuous_decode_steps": steps["continuous"],
        "batching_waves_decode_steps": steps["waves"],
        "batching_same_responses": responses[0] == responses[1],
    }
    print(
        f"{n} requests, {rows} at a time, responses of {figures['batching_mean_response_tokens']:.0f} tokens on "
        f"average ({figures['batching_max_response_tokens']} at most): continuous batching {ours:.0f} tok/s, static "
        f"waves {waves:.0f} tok/s, {ours / waves:.2f}x, in {steps['continuous']} and {steps['waves']} decode steps; "
        f"same responses: {figures['batching_same_responses']}"
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each figure is the best round")
    parser.add_argument("--linear-contexts", type=int, nargs=2, default=[64, 512], help="short and long context")
    parser.add_argument("--linear-batch", type=int, default=8)
    parser.add_argument("--linear-steps", type=int, default=32, help="decode steps timed per context")
    parser.add_argument("--linear-decode-only", action="store_true", help="only the Gated DeltaNet decode row")
    parser.add_argument("--speed-only", action="store_true", help="only the engine against generate")
    parser.add_argument("--batching-rows", type=int, default=32, help="max_running_requests of the batching row")
    parser.add_argument("--batching-requests", type=int, default=128)
    parser.add_argument("--batching-new-tokens", type=int, default=256)
    parser.add_argument("--batching-only", action="store_true", help="only continuous batching against waves")
    parser.add_argument(
        "--anatomy-only", action="store_true", help="only where a decode step's time goes, at batch 1 and --batches"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # as in a step process on the CPU (steps.step_device); the engine and generate alike run with it
    freed_kept = device == "cpu" and keep_freed_memory()
    if args.linear_decode_only:
        print(json.dumps({"device": device, **cpu_kind(), **linear_decode_scaling(args, device)}))
        return
    model = build_model(args.preset, seed=0)
    if args.anatomy_only:
        engine = TorchEngine(model, rollout_config("bf16"), device=device)
        figures = {"device": device, **cpu_kind(), "preset": args.preset, "context": args.prompt_len}
        for batch in dict.fromkeys([1, *args.batches]):
            parts = step_anatomy(engine, batch, args.prompt_len, args.new_tokens, args.repeat)
            figures.update(parts)
            step, rest, alone = (
                parts[f"b{batch}_{name}_ms"]
                for name in ("decode_step", "decode_step_rest", "matmul_attention_replayed")
            )
            print(
                f"batch {batch:4}: decode step {step:.2f} ms; without its {parts[f'b{batch}_matmul_attention_calls']} "
                f"matmul and attention calls {rest:.2f} ms; those calls take {step - rest:.2f} ms in the step, "
                f"{alone:.2f} ms replayed back to back"
            )
        print(json.dumps(figures))
        return
    if args.batching_only:
        print(
            json.dumps(
                {"device": device, **cpu_kind(), "preset": args.preset, **continuous_batching(args, model, device)}
            )
        )
        return
    figures: dict = {
        "device": device,
        **cpu_kind(),
        "preset": args.preset,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "keep_freed_memory": freed_kept,
    }
    sampling = SamplingParams(max_new_tokens=args.new_tokens, seed=0)

    with tempfile.TemporaryDirectory() as tmp, others_on_the_cores(figures):
        save_model(model, f"{tmp}/policy")
        hf = hf_generate(f"{tmp}/policy", device)
        bf16 = TorchEngine(model, rollout_config("bf16"), device=device)
        figures["engine_cuda_graphs"] = bf16.uses_cuda_graphs()
        figures["stop_check_every"] = bf16.stop_check_every
        for batch in args.batches:
            prompts = torch.randint(0, model.cfg.vocab_size, (batch, args.prompt_len), device=device)
            n = batch * args.new_tokens
            bf16.generate(prompts[:2].tolist(), SamplingParams(max_new_tokens=2))  # warm-up
            hf(prompts[:2], 2)
            ours, theirs = best_of(
                args.repeat,
                lambda prompts=prompts, n=n: tokens_per_second(lambda: bf16.generate(prompts.tolist(), sampling), n),
                lambda prompts=prompts, n=n: tokens_per_second(lambda: hf(prompts, args.new_tokens), n),
            )
            figures[f"b{batch}_engine_tokens_per_s"] = ours
            figures[f"b{batch}_hf_generate_tokens_per_s"] = theirs
            figures[f"b{batch}_speedup_vs_hf"] = ours / theirs
            calls = [
                calls_per_decode_step(lambda k, p=prompts: bf16.generate(p.tolist(), SamplingParams(max_new_tokens=k))),
                calls_per_decode_step(lambda k, p=prompts: hf(p, k)),
            ]
            figures[f"b{batch}_engine_calls_per_decode_step"], figures[f"b{batch}_hf_calls_per_decode_step"] = calls
            print(
                f"batch {batch:4}: engine {ours:8.1f} tok/s, transformers generate {theirs:8.1f} tok/s, "
                f"{ours / theirs:.2f}x (target >= 2); torch calls per decode step {calls[0]:.0f} and {calls[1]:.0f}"
            )
    if args.speed_only:
        print(json.dumps(figures))
        return

    batch = args.batches[0]
    # the decode step's fixed cost: a step of one sequence against one of the first batch size
    one, full = best_of(
        args.repeat,
        lambda: decode_tokens_per_s(bf16, 1, args.prompt_len, args.new_tokens),
        lambda: decode_tokens_per_s(bf16, batch, args.prompt_len, args.new_tokens),
    )
    figures[f"decode_step_b1_over_b{batch}"] = (1 / one) / (batch / full)
    print(f"a decode step of 1 sequence takes {figures[f'decode_step_b1_over_b{batch}']:.2f}x one of {batch}")
    prompts = torch.randint(0, model.cfg.vocab_size, (batch, args.prompt_len)).tolist()
    n = batch * args.new_tokens
    max_tokens = batch * args.prompt_len
    fp4 = rollout_config("fp4_wa_kv")
    plain = TorchEngine(model, fp4, device=device)
    full = TorchEngine(model, fp4, device=device, capture=CaptureConfig(bits=4, max_tokens=max_tokens))
    layers = tuple(model.cfg.sparse_layers[len(model.cfg.sparse_layers) // 2 :])
    r1 = TorchEngine(model, fp4, device=device, capture=CaptureConfig(bits=1, layers=layers, max_tokens=max_tokens))
    for engine in (plain, full, r1):
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=2))
    if full.capture:
        full.drain_capture(), r1.drain_capture()
    captured = {}

    def with_capture(engine):  # a rollout step ends with its capture drained
        engine.generate(prompts, sampling)
        captured[engine] = engine.drain_capture().nbytes

    off, on, on_r1 = best_of(
        args.repeat + 2,
        lambda: tokens_per_second(lambda: plain.generate(prompts, sampling), n),
        lambda: tokens_per_second(lambda: with_capture(full), n),
        lambda: tokens_per_second(lambda: with_capture(r1), n),
    )
    tokens_in_context = batch * (args.prompt_len + args.new_tokens - 1)
    full_bytes, r1_bytes = captured[full] / tokens_in_context, captured[r1] / tokens_in_context
    figures.update(
        fp4_capture_off_tokens_per_s=off,
        fp4_capture_on_tokens_per_s=on,
        fp4_capture_r1_tokens_per_s=on_r1,
        capture_overhead=1 - on / off,
        capture_overhead_r1_deeper_half=1 - on_r1 / off,
        captured_bytes_per_token_full=full_bytes,
        captured_bytes_per_token_r1_deeper_half=r1_bytes,
        kv_bytes_per_token_bf16=bf16.kv_bytes_per_token(),
        kv_bytes_per_token_nvfp4=plain.kv_bytes_per_token(),
        kv_ratio_nvfp4_to_bf16=plain.kv_bytes_per_token() / bf16.kv_bytes_per_token(),
    )
    figures.update(continuous_batching(args, model, device))
    figures.update(linear_decode_scaling(args, device))
    print(
        f"capture overhead {figures['capture_overhead']:.1%} full, "
        f"{figures['capture_overhead_r1_deeper_half']:.1%} R-1bit (target <= 5%); "
        f"captured bytes/token full {full_bytes:.0f}, R-1bit deeper half {r1_bytes:.0f}; "
        f"NVFP4 KV {figures['kv_ratio_nvfp4_to_bf16']:.3f}x BF16 bytes"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
