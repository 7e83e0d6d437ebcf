"""What would read the device on CUDA, watched on the CPU.

On CUDA every read of a value from the device (``.item()``, ``float(t)``,
``.tolist()``, a shape that depends on values: ``nonzero``, boolean-mask
indexing) makes the host wait for the GPU. On the CPU nothing syncs, so the
tests watch the ops themselves (tests/test_trainer_syncs.py,
tests/test_decode_graphs.py)."""

import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# values to Python (item, float, bool: _local_scalar_dense; under inference mode item arrives whole) and
# outputs whose shape depends on values
READS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
# reads that are host reads by design: the CPU's expert grid reads its width (bf16 on CUDA multiplies with
# grouped_mm, which reads nothing); the reference AdamW's step counters live on the host (fused AdamW: on the
# device); the CPU's erasure solver selects its pending blocks (on CUDA the Triton solver,
# kernels/triton_syndrome.py, reads nothing)
HOST_ONLY = ("ExpertRows.__init__", "torch/optim/", "kernels/syndrome.py:solve_erasures")


def reads_device(func, args) -> bool:
    """Whether the op ``func(*args)`` reads the device on CUDA."""
    masks = args[1] if func in INDEXING else ()
    return func in READS or any(isinstance(m, torch.Tensor) and m.dtype == torch.bool for m in masks)


class DeviceReads(TorchDispatchMode):
    """While ``watching``, the ops that would read the device on CUDA, each with
    the calls it came from. ``tolist`` dispatches nothing on the CPU: the tensors
    made while watching are kept (weakly), and ``tolist`` of one of them counts."""

    def __init__(self, watching: bool = False):
        super().__init__()
        self.watching, self.reads, self.host_reads = watching, [], 0
        self.made: dict[int, weakref.ref] = {}  # by id: a WeakSet would compare tensors with ==

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.watching:
            if reads_device(func, args):
                self.record(str(func))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.made[id(t)] = weakref.ref(t)
        return out

    def was_made(self, t: torch.Tensor) -> bool:
        ref = self.made.get(id(t))
        return ref is not None and ref() is t

    def record(self, what: str) -> None:
        frame, calls = sys._getframe(1), []
        while frame is not None:
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_qualname}:{frame.f_lineno}")
            frame = frame.f_back
        if not any(allowed in call for call in calls for allowed in HOST_ONLY):
            self.reads.append((what, [c for c in calls if "/components/" in c or "/kernels/" in c][:3]))
