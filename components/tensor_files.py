"""Named tensors in safetensors files, written and read one tensor at a time.

A set of tensors is one ``<stem>.safetensors`` or, above a size, numbered
shards ``<stem>-00001-of-0000N.safetensors`` with an index
``<stem>.safetensors.index.json`` (``{"metadata": {"total_size": bytes},
"weight_map": {name: file}}``): the way transformers names a model's
shards, used here for the policy (stem ``model``) and the trainer state
(stem ``state``).

Why streamed: at the paper's scale the trainer's float32 parameters are
140 GB and their AdamW moments 280 GB, gathered one tensor at a time from
the ranks that hold them. :class:`TensorWriter` takes the tensors as they come and writes
each file once its tensors are in, so the writer holds one file's worth, not
the whole set; the file names carry the count, so the tensors' sizes are
given up front (their shapes and dtypes are known before any value is).
"""

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from .store import ensure_room

# safetensors' names of the dtypes read here: weights, moments and masters; step counts and other optimizer state
DTYPES = {
    **{"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16},
    **{"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8},
    "BOOL": torch.bool,
}


def single_name(stem: str) -> str:
    return f"{stem}.safetensors"


def index_name(stem: str) -> str:
    return f"{stem}.safetensors.index.json"


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class TensorWriter:
    """Writes the tensors ``layout`` names, in its order, into ``folder`` as
    files of at most ``max_shard_bytes`` each (a larger tensor alone in its
    file). ``layout`` gives each tensor's shape and dtype: meta tensors will
    do. :meth:`add` the values in the same order; a file is written, its
    tensors made contiguous and let go, once its last tensor is in.
    :meth:`close` checks that every tensor came and writes the index."""

    def __init__(self, folder: Path, layout: Mapping[str, Tensor], stem: str, max_shard_bytes: int = 2 << 30):
        self.folder, self.stem = Path(folder), stem
        files, current, size = [], [], 0
        for name, t in layout.items():
            if current and size + nbytes(t) > max_shard_bytes:
                files.append(current)
                current, size = [], 0
            current.append(name)
            size += nbytes(t)
        files.append(current)
        count = len(files)
        self.names = (
            [single_name(stem)]
            if count == 1
            else [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        )
        self.files = files
        self.layout = {name: (tuple(t.shape), t.dtype) for name, t in layout.items()}
        self.total = sum(nbytes(t) for t in layout.values())
        ensure_room(self.folder, self.total, f"{count} {stem} file(s)")
        self.pending: dict[str, Tensor] = {}
        self.written = 0  # files written so far

    def add(self, name: str, tensor: Tensor) -> None:
        """The value of the next tensor of the layout (a view will do: it is copied when its file is written)."""
        expected = self.files[self.written][len(self.pending)] if self.written < len(self.files) else None
        if name != expected:
            raise ValueError(f"{self.folder}: got tensor {name!r}, the layout's next is {expected!r}")
        if (tuple(tensor.shape), tensor.dtype) != self.layout[name]:
            raise ValueError(
                f"{self.folder}: tensor {name!r} is {list(tensor.shape)} {tensor.dtype}, the layout said "
                f"{list(self.layout[name][0])} {self.layout[name][1]}"
            )
        self.pending[name] = tensor
        if len(self.pending) == len(self.files[self.written]):
            self._write_file()

    def _write_file(self) -> None:
        contiguous = {key: t.detach().cpu().contiguous() for key, t in self.pending.items()}
        path = self.folder / self.names[self.written]
        save_file(contiguous, path, metadata={"format": "pt"})
        os.chmod(path, 0o644)  # safetensors (0.8) writes 0o600: a serving engine of another user could not read it
        self.pending.clear()
        self.written += 1

    def close(self) -> None:
        """Check that every tensor of the layout came; write the index of a sharded set."""
        if not self.layout:  # no tensor: one file without any
            self._write_file()
        if self.written != len(self.files):
            missing = [n for names in self.files[self.written :] for n in names if n not in self.pending]
            raise ValueError(f"{self.folder}: {len(missing)} tensors of the layout never came, {missing[:4]}")
        if len(self.files) > 1:
            weight_map = {name: file for file, names in zip(self.names, self.files) for name in names}
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.folder / index_name(self.stem)).write_text(json.dumps(index, indent=2))


def layout_of(tensors: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """A :class:`TensorWriter` layout of ``tensors``: meta tensors of their shapes, in their dtype or ``dtype``."""
    return {name: torch.empty(t.shape, dtype=dtype or t.dtype, device="meta") for name, t in tensors.items()}


def write_tensors(folder: Path, tensors: Mapping[str, Tensor], stem: str, max_shard_bytes: int = 2 << 30) -> None:
    """``tensors`` (already in memory) as :class:`TensorWriter` writes them."""
    writer = TensorWriter(folder, tensors, stem, max_shard_bytes)
    for name, t in tensors.items():
        writer.add(name, t)
    writer.close()


def tensor_files(folder: Path, stem: str) -> dict[str, Path]:
    """Which file of ``folder`` holds each tensor of the set ``stem`` (the
    index of a sharded set, or the single file's header)."""
    folder = Path(folder)
    index = folder / index_name(stem)
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / Path(file).name for name, file in weight_map.items()}
    single = folder / single_name(stem)
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def read_tensor(files: Mapping[str, Path], name: str) -> Tensor:
    """One tensor of a set (:func:`tensor_files`), its file mapped only while it is read."""
    with safe_open(files[name], framework="pt") as f:
        return f.get_tensor(name)


def read_tensors(folder: Path, stem: str) -> dict[str, Tensor]:
    """Every tensor of the set ``stem`` in ``folder``, each file opened once."""
    out = {}
    for path in sorted(set(tensor_files(folder, stem).values())):
        with safe_open(path, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def tensor_layout(files: Mapping[str, Path]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each tensor's shape and dtype, from the files' headers (no data read)."""
    layout = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                header = f.get_slice(name)
                layout[name] = (tuple(header.get_shape()), DTYPES[header.get_dtype()])
    return layout
