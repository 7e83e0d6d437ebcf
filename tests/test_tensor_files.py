"""Named tensors in safetensors files, written one tensor at a time (components/tensor_files.py)."""

import gc
import json
import shutil
import weakref

import pytest
import torch

from tracefp4.components.checkpoint import save_model
from tracefp4.components.model import build_model
from tracefp4.components.store import NoRoom
from tracefp4.components.tensor_files import (
    TensorWriter,
    index_name,
    read_tensors,
    tensor_files,
    tensor_layout,
    write_tensors,
)


def tensors(sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    return {name: torch.arange(n, dtype=torch.float32) + i for i, (name, n) in enumerate(sizes.items())}


def test_a_set_over_the_limit_is_sharded_as_transformers_names_shards_and_reads_back(tmp_path):
    data = tensors({"a": 100, "b": 100, "c": 300, "d": 10})  # 400, 400, 1200, 40 bytes
    write_tensors(tmp_path, data, "state", max_shard_bytes=800)
    files = tensor_files(tmp_path, "state")
    assert files == {
        "a": tmp_path / "state-00001-of-00003.safetensors",
        "b": tmp_path / "state-00001-of-00003.safetensors",
        "c": tmp_path / "state-00002-of-00003.safetensors",  # larger than a file: alone in one
        "d": tmp_path / "state-00003-of-00003.safetensors",
    }
    index = json.loads((tmp_path / index_name("state")).read_text())
    assert index["metadata"]["total_size"] == 2040
    got = read_tensors(tmp_path, "state")
    assert sorted(got) == sorted(data) and all(torch.equal(got[k], data[k]) for k in data)
    assert tensor_layout(files) == {name: ((t.numel(),), torch.float32) for name, t in data.items()}


def test_a_set_under_the_limit_is_one_file_without_index_and_an_empty_set_one_empty_file(tmp_path):
    one, none = tmp_path / "one", tmp_path / "none"
    one.mkdir()
    none.mkdir()
    write_tensors(one, tensors({"a": 3, "b": 4}), "model")
    assert sorted(p.name for p in one.iterdir()) == ["model.safetensors"]
    write_tensors(none, {}, "state")
    assert [p.name for p in none.iterdir()] == ["state.safetensors"] and read_tensors(none, "state") == {}


def test_the_writer_holds_one_files_tensors_at_a_time(tmp_path):
    """Each file is written once its last tensor is in and its tensors let go:
    a value given to the writer is freed before the next file's tensors come."""
    layout = {f"t{i}": torch.empty(256, device="meta") for i in range(6)}  # 1 KiB each, 2 per file
    writer = TensorWriter(tmp_path, layout, "model", max_shard_bytes=2048)
    alive = []
    for i, name in enumerate(layout):
        value = torch.full((256,), float(i))
        alive.append(weakref.ref(value))
        writer.add(name, value)
        del value
        gc.collect()
        held = sum(ref() is not None for ref in alive)
        assert held == (0 if i % 2 else 1), i  # the first of a file's two waits; the second writes both
        assert len(list(tmp_path.glob("model-*.safetensors"))) == (i + 1) // 2
    writer.close()
    got = read_tensors(tmp_path, "model")
    assert all(torch.equal(got[f"t{i}"], torch.full((256,), float(i))) for i in range(6))


def test_tensors_out_of_the_layouts_order_or_shape_or_missing_are_refused(tmp_path):
    layout = {"a": torch.empty(2, 3, device="meta"), "b": torch.empty(4, device="meta")}
    with pytest.raises(ValueError, match=r"got tensor 'b', the layout's next is 'a'"):
        TensorWriter(tmp_path, layout, "state").add("b", torch.zeros(4))
    with pytest.raises(ValueError, match=r"tensor 'a' is \[3, 2\] torch.float32, the layout said \[2, 3\]"):
        TensorWriter(tmp_path, layout, "state").add("a", torch.zeros(3, 2))
    writer = TensorWriter(tmp_path, layout, "state")
    writer.add("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"1 tensors of the layout never came, \['b'\]"):
        writer.close()


def test_a_set_its_filesystem_has_no_room_for_is_refused_before_a_byte_is_written(tmp_path, monkeypatch):
    """Running out mid-way would waste the write (at the paper's scale minutes of
    it, and again at each retry) and end in a bare "No space left on device"."""
    usage, free = shutil.disk_usage(tmp_path), 2039  # a byte short of the 2,040 bytes below
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free))
    data = tensors({"a": 100, "b": 100, "c": 300, "d": 10})
    with pytest.raises(NoRoom, match=r"3 state file\(s\) needs 2,040 bytes .* at .* has 2,039 bytes .* free") as e:
        write_tensors(tmp_path, data, "state", max_shard_bytes=800)
    assert e.value.errno == 28 and list(tmp_path.iterdir()) == []  # ENOSPC, and nothing written
    with pytest.raises(NoRoom, match=r"1 model file\(s\) needs"):  # a policy: no folder, nor a half-written one
        save_model(build_model("smoke"), tmp_path / "policy")
    assert list(tmp_path.iterdir()) == []
    free = 2040
    write_tensors(tmp_path, data, "state", max_shard_bytes=800)  # room enough
