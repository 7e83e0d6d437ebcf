"""Throughput of the FP4 kernels, each as a ratio to a clone() of the same
input timed in the same run (a memory-bound floor), plus NVFP4 quantize
against torchao's eager ``nvfp4_quantize``.

    python benchmarks/fp4_kernels.py [--size 4096] [--repeat 5]

CUDA tensors take the Triton path, CPU tensors the torch reference. The last
line is one JSON object with every figure, and the CPU it was measured on
(model, bf16 native or emulated, torch threads): CPU figures differ between
machines.
"""

import argparse
import json
import logging
import time

import torch

from tracefp4.components.device import cpu_kind
from tracefp4.kernels import Guidance, compact_codes, dequantize, fake_quantize, quantize, unpack_codes


def best_seconds(fn, repeat: int) -> float:
    """Fastest of `repeat` timed calls after one warm-up call."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def torchao_nvfp4_quantize():
    """torchao's eager two-level NVFP4 quantize, or None where it is not installed."""
    try:
        logging.getLogger("torchao").setLevel(logging.ERROR)  # its optional CUDA extensions
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    except ImportError:
        return None
    return lambda x: nvfp4_quantize(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="the input is size x size float32")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(args.size, args.size, device=device)
    rollout = quantize(x * 1.001, "nvfp4")
    guide = Guidance.from_rollout(rollout, bits=1)
    codes = unpack_codes(rollout)

    clone_s = best_seconds(x.clone, args.repeat)
    codes_clone_s = best_seconds(codes.clone, args.repeat)
    ops = {
        "quantize_nvfp4": (lambda: quantize(x, "nvfp4"), clone_s),
        "quantize_mxfp4": (lambda: quantize(x, "mxfp4"), clone_s),
        "dequantize_nvfp4": (lambda: dequantize(rollout), clone_s),
        "fake_quantize_nvfp4": (lambda: fake_quantize(x, "nvfp4"), clone_s),
        "guided_fake_quantize_nvfp4_r1": (lambda: fake_quantize(x, "nvfp4", guide=guide), clone_s),
        "compact_codes_r1": (lambda: compact_codes(codes, 1), codes_clone_s),
        "compact_codes_r4": (lambda: compact_codes(codes, 4), codes_clone_s),
    }
    figures = {"device": device, **cpu_kind(), "elements": x.numel(), "clone_seconds": clone_s}
    print(f"{'op':34} {'seconds':>9} {'x clone':>8} {'Gelem/s':>8}")
    for name, (fn, baseline_s) in ops.items():
        seconds = best_seconds(fn, args.repeat)
        figures[f"{name}_seconds"] = seconds
        figures[f"{name}_vs_clone"] = seconds / baseline_s
        print(f"{name:34} {seconds:9.4f} {seconds / baseline_s:8.2f} {x.numel() / seconds / 1e9:8.3f}")

    theirs = torchao_nvfp4_quantize()
    if theirs is None:  # said, and null in the JSON line: not a figure that silently went missing
        figures["torchao_nvfp4_quantize_seconds"] = figures["nvfp4_quantize_speedup_vs_torchao"] = None
        print("NVFP4 quantize vs torchao eager: not measured, torchao is not installed (a dev extra of tracefp4)")
    else:
        theirs_s = best_seconds(lambda: theirs(x), args.repeat)
        figures["torchao_nvfp4_quantize_seconds"] = theirs_s
        figures["nvfp4_quantize_speedup_vs_torchao"] = theirs_s / figures["quantize_nvfp4_seconds"]
        print(
            f"NVFP4 quantize vs torchao eager: {figures['nvfp4_quantize_speedup_vs_torchao']:.2f}x faster (target >= 3)"
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
