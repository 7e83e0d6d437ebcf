"""Checkpoints are untrusted input: our saves carry a checksum manifest that
load verifies, config.json is checked against the tensor headers before
anything is allocated, and every file read stays inside the folder."""

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_model import hf_model
from test_qwen35 import TEXT, VISION, randomize
from torch.utils._python_dispatch import TorchDispatchMode

from tracefp4.components import checkpoint
from tracefp4.components.architecture import PRESETS
from tracefp4.components.checkpoint import (
    INDEX,
    MANIFEST,
    SINGLE,
    CheckpointError,
    config_from_hf,
    config_to_hf,
    hub_to_stacked,
    load_model,
    save_model,
    stacked_to_hub,
)
from tracefp4.components.model import Transformer, build_model, empty_model


def saved(tmp_path, name="ckpt", sharded=False, manifest=True):
    folder = save_model(build_model("smoke", seed=1), tmp_path / name, max_shard_bytes=100_000 if sharded else 2 << 30)
    if not manifest:
        (folder / MANIFEST).unlink()
    return folder


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def rewrite_tensor(path, name, tensor):
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = tensor
    save_file(tensors, path)


def test_ropes_saved_inverse_frequencies_are_skipped_as_transformers_skips_them_and_others_are_named(tmp_path):
    """Older transformers saved each layer's rotary_emb.inv_freq buffer, which its loaders skip (config.json gives
    it): such a checkpoint was refused. A tensor of no known name is refused, naming it alone (with "missing []"
    beside it)."""
    folder = saved(tmp_path, manifest=False)
    reference = load_model(folder)
    rewrite_tensor(folder / "model.safetensors", "model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4))
    loaded = load_model(folder)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), reference.state_dict().values()))
    rewrite_tensor(folder / "model.safetensors", "model.layers.0.self_attn.extra", torch.ones(4))
    with pytest.raises(
        CheckpointError, match=r"do not match config.json: unexpected \['model.layers.0.self_attn.extra'\]$"
    ):
        load_model(folder)


def test_a_head_that_differs_from_the_tied_embedding_loads_untied_as_transformers_loads_it(tmp_path, caplog):
    """config.json ties the embedding and lm_head, the weights hold a trained
    head of its own (a fine-tune that untied it and kept the config): both are
    loaded, with a warning; tying dropped the head and gave other logits.
    A head equal to the embedding (the tied copy) stays tied."""
    folder = save_model(build_model(replace(PRESETS["smoke"], tie_word_embeddings=False), seed=1), tmp_path / "c")
    (folder / MANIFEST).unlink()
    edit_config(folder, tie_word_embeddings=True)
    with caplog.at_level(logging.WARNING, logger="tracefp4.checkpoint"):
        loaded = load_model(folder)
    head = files_of(folder)["lm_head.weight"]
    assert not loaded.cfg.tie_word_embeddings and torch.equal(loaded.lm_head.weight, head)
    assert "lm_head.weight differs from the embedding: loaded untied" in caplog.text
    rewrite_tensor(folder / "model.safetensors", "lm_head.weight", files_of(folder)["model.embed_tokens.weight"])
    tied = load_model(folder)
    assert tied.cfg.tie_word_embeddings and tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.parametrize("saved_in", [torch.float32, torch.bfloat16])
def test_config_json_names_the_dtype_the_weights_were_saved_in(tmp_path, saved_in):
    """Not the source checkpoint's (kept with its other keys): transformers loads
    the weights in the dtype config.json names, rounding fp32 weights said to
    be bf16 and computing bf16 ones said to be fp32 in fp32."""
    stale = "bfloat16" if saved_in == torch.float32 else "float32"
    cfg = replace(PRESETS["smoke"], extra={"dtype": stale, "torch_dtype": stale})
    folder = save_model(build_model(cfg, seed=1, dtype=saved_in), tmp_path / "c")
    hf = json.loads((folder / "config.json").read_text())
    assert hf["dtype"] == hf["torch_dtype"] == str(saved_in).removeprefix("torch.")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.dtype == saved_in


def test_a_config_that_is_not_json_is_named(tmp_path):
    folder = saved(tmp_path, manifest=False)
    (folder / "config.json").write_text('{"model_type": "qwen3_moe"}\n}')
    with pytest.raises(CheckpointError, match=r"ckpt/config.json: not JSON \(Extra data"):
        load_model(folder)


@pytest.mark.parametrize("name", ["tiny", "smoke", "tiny-qwen2"])
def test_config_round_trips_through_hf(name):
    cfg = PRESETS[name]
    assert config_from_hf(config_to_hf(cfg)) == cfg
    hf = {**config_to_hf(cfg), "torch_dtype": "bfloat16"}
    assert config_from_hf(hf).extra == {"torch_dtype": "bfloat16"}
    assert config_to_hf(config_from_hf(hf))["torch_dtype"] == "bfloat16"  # unknown keys survive a save


def test_save_writes_a_manifest_of_every_file(tmp_path):
    folder = save_model(build_model("smoke"), tmp_path / "ckpt", max_shard_bytes=100_000, extra={"note.txt": b"hi"})
    files = json.loads((folder / MANIFEST).read_text())["files"]
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    assert sorted(files) == on_disk and "note.txt" in files and INDEX in files
    assert sum(name.endswith(".safetensors") for name in files) > 1
    for name, entry in files.items():
        data = (folder / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # written in a temp folder, renamed into place


def test_a_folders_files_are_hashed_several_at_once_and_checked_in_the_manifests_order(tmp_path, monkeypatch):
    """Saving and verifying a policy hash its files on threads (a Qwen3.5-35B-A3B
    policy is 70 GB, saved and verified every round): the first hash here
    waits for a second to start. Of two corrupt files the
    error names the first the manifest lists, whichever hash ends first."""
    folder = save_model(build_model("smoke"), tmp_path / "ckpt", max_shard_bytes=100_000)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: hashed one at a time")
    lock, second, calls, waited = threading.Lock(), threading.Event(), [], []
    hash_file = checkpoint.size_and_sha256

    def waiting(path):
        with lock:
            first = not calls
            calls.append(path)
        if first:  # waits for another file's hash to start: hashed one at a time, none would
            waited.append(second.wait(timeout=10))
        else:
            second.set()
        return hash_file(path)

    monkeypatch.setattr(checkpoint, "size_and_sha256", waiting)
    checkpoint.verify_folder(folder)
    assert waited == [True]
    monkeypatch.setattr(checkpoint, "size_and_sha256", hash_file)
    shards = sorted(p for p in folder.iterdir() if p.name.endswith(".safetensors"))
    for shard in shards[:2]:
        shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with pytest.raises(CheckpointError, match=f"{shards[0].name}: sha256 does not match"):
        checkpoint.verify_folder(folder)


def test_work_at_once_comes_back_in_order_and_a_failure_once_what_still_runs_has_ended():
    """checkpoint.each_at_once (hashes, downloads, uploads): results in the
    items' order; of two failures the earlier item's, though the later one
    failed first, once what still runs has ended (the caller then cleans up
    after it: a download would write on into a partial folder removed)."""
    assert checkpoint.each_at_once(lambda i: i * i, list(range(10)), 3, "t") == [i * i for i in range(10)]
    ended = []

    def two_fail(i):
        if i == 1:
            time.sleep(0.2)
            raise ValueError("one")
        if i == 2:
            raise ValueError("two")
        time.sleep(0.5)
        ended.append(i)

    with pytest.raises(ValueError, match="one"):
        checkpoint.each_at_once(two_fail, [0, 1, 2, 3], 4, "t")
    assert sorted(ended) == [0, 3]


def test_a_saved_folder_replaces_the_old_one_and_its_rename_is_synced(tmp_path, monkeypatch):
    save_model(build_model("smoke", seed=0), tmp_path / "ckpt")
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd))
    save_model(build_model("smoke", seed=1), tmp_path / "ckpt")
    assert str(tmp_path) in synced  # the folder holding the renamed entries, after the renames
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the old folder moved aside, then deleted
    assert torch.equal(load_model(tmp_path / "ckpt").lm_head.weight, build_model("smoke", seed=1).lm_head.weight)


def test_a_save_never_replaces_a_folder_that_holds_anything_but_a_save(tmp_path):
    """A save replaces its folder whole: named at a folder of the user's (a
    folder of runs given as --output, say) it deleted everything there."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=f"mine: holds files tracefp4 did not save .*{MANIFEST}"):
        save_model(build_model("smoke"), tmp_path / "mine")
    assert [p.name for p in tmp_path.iterdir()] == ["mine"] and (tmp_path / "mine" / "notes.txt").read_text() == "x"
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="file: a file, not a folder"):
        save_model(build_model("smoke"), tmp_path / "file")
    (tmp_path / "empty").mkdir()
    save_model(build_model("smoke"), tmp_path / "empty")  # an empty folder, or an earlier save, is replaced
    save_model(build_model("smoke", seed=1), tmp_path / "empty")


def test_a_save_killed_between_its_renames_loses_no_folder_when_the_next_save_fails_too(tmp_path, monkeypatch):
    """Killed after moving the old folder aside and before renaming the new
    one into place, a save leaves no folder, the old one whole beside it and
    the new one staged; the next save puts the old one back before it stages
    (its leftovers swept), so that where it fails as well the folder is still
    there, as it was (it used to delete both copies first)."""
    save_model(build_model("smoke", seed=0), tmp_path / "ckpt")
    real_rename = Path.rename

    def killed_at_the_second_rename(self, target):
        if self.name.startswith(".ckpt.tmp-"):
            raise KeyboardInterrupt  # stands for the SIGKILL: nothing after this line of commit_folder runs
        return real_rename(self, target)

    with monkeypatch.context() as m:
        m.setattr(Path, "rename", killed_at_the_second_rename)
        m.setattr(shutil, "rmtree", lambda *a, **k: None)  # a killed process cleans nothing up
        with pytest.raises(KeyboardInterrupt):
            save_model(build_model("smoke", seed=1), tmp_path / "ckpt")
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == [".ckpt.old", ".ckpt.tmp"]

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tracefp4.components.tensor_files.save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_model(build_model("smoke", seed=2), tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert torch.equal(load_model(tmp_path / "ckpt").lm_head.weight, build_model("smoke", seed=0).lm_head.weight)


def test_a_failed_save_leaves_nothing_beside_the_folder_and_a_dead_save_blocks_no_later_one(tmp_path, monkeypatch):
    """The staging and moved-aside folders were named by process id, which a
    container's processes share from run to run: a save killed while deleting
    the old folder left ``.ckpt.old-<pid>``, and every later save of that pid
    failed renaming onto it; a failed write left its full-size staging copy."""
    save_model(build_model("smoke", seed=0), tmp_path / "ckpt")
    (tmp_path / f".ckpt.old-{os.getpid()}" / "leftover").mkdir(parents=True)  # a save that died deleting it
    (tmp_path / f".ckpt.tmp-{os.getpid()}" / "leftover").mkdir(parents=True)
    (tmp_path / ".other.tmp-1").mkdir()  # another folder's: not this save's to delete
    save_model(build_model("smoke", seed=1), tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-1", "ckpt"]  # the leftovers swept
    assert torch.equal(load_model(tmp_path / "ckpt").lm_head.weight, build_model("smoke", seed=1).lm_head.weight)
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o755  # readable by a serving engine of another user
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "ckpt").iterdir()} == {0o644}  # safetensors wrote 0o600
    before = sorted(p.name for p in tmp_path.iterdir())

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tracefp4.components.tensor_files.save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_model(build_model("smoke", seed=2), tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no staging copy left
    assert torch.equal(load_model(tmp_path / "ckpt").lm_head.weight, build_model("smoke", seed=1).lm_head.weight)


def test_flipped_byte_fails_naming_the_file(tmp_path):
    folder = saved(tmp_path)
    data = bytearray((folder / SINGLE).read_bytes())
    data[-10] ^= 0x01  # a weight's byte, not the header: safetensors alone would not notice
    (folder / SINGLE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{SINGLE}: sha256 does not match {MANIFEST}"):
        load_model(folder)


def test_truncated_missing_or_added_files_fail(tmp_path):
    folder = saved(tmp_path, sharded=True)
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:-1])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: {len(data) - 1} bytes, but {MANIFEST} says {len(data)}"):
        load_model(folder)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: listed in {MANIFEST} but missing"):
        load_model(folder)
    shard.write_bytes(data)
    (folder / "model-extra.safetensors").write_bytes(data)
    with pytest.raises(CheckpointError, match=r"\['model-extra.safetensors'\] not covered by"):
        load_model(folder)
    (folder / "model-extra.safetensors").unlink()
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")  # read by load_tokenizer
    with pytest.raises(CheckpointError, match=r"\['chat_template.jinja'\] not covered by"):
        load_model(folder)
    (folder / "chat_template.jinja").unlink()
    load_model(folder)  # restored: loads again


def test_bad_manifests_fail(tmp_path):
    folder = saved(tmp_path)
    (folder / MANIFEST).write_text('{"files": {"../config.json": {"size": 1, "sha256": "0"}}}')
    with pytest.raises(CheckpointError, match="outside the folder"):
        load_model(folder)
    (folder / MANIFEST).write_text("[]")
    with pytest.raises(CheckpointError, match=f"{MANIFEST}: not a checksum manifest"):
        load_model(folder)


def test_checkpoint_without_manifest_loads_with_a_warning(tmp_path, caplog):
    folder = saved(tmp_path, manifest=False)
    with caplog.at_level(logging.WARNING, logger="tracefp4.checkpoint"):
        model = load_model(folder)
    assert f"{folder} has no {MANIFEST}: loading it unverified" in caplog.text
    assert torch.equal(model.lm_head.weight, build_model("smoke", seed=1).lm_head.weight)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tracefp4.checkpoint"):
        load_model(saved(tmp_path, "verified"))
    assert "unverified" not in caplog.text


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_hidden_layers": 1e9}, r"num_hidden_layers must be an integer in 1\.\.16777216, got 1000000000\.0"),
        ({"num_hidden_layers": 10**12}, r"num_hidden_layers must be an integer in 1\.\.16777216, got 1000000000000"),
        ({"hidden_size": -64}, "hidden_size must be an integer"),
        ({"vocab_size": 256.5}, "vocab_size must be an integer"),
        ({"num_experts": True}, "num_experts must be an integer"),
        ({"head_dim": "32"}, "head_dim must be an integer"),
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({"mlp_only_layers": [5]}, r"mlp_only_layers must list layers in 0\.\.1"),
        ({"num_experts_per_tok": 9}, "top_k 9 must lie in 1..num_experts"),
        ({"num_experts_per_tok": None}, "lacks num_experts_per_tok"),
        ({"num_experts": None}, "lacks num_experts$"),  # the key all three model types write
        ({"num_experts": None, "num_local_experts": 0}, "num_local_experts must be an integer"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "scaled RoPE"),
        (
            {"rope_parameters": {"type": "yarn", "factor": 4.0}},
            "scaled RoPE",
        ),  # the older key, as transformers reads it
        ({"use_sliding_window": True, "sliding_window": 4096}, r"use_sliding_window is true \(sliding_window 4096\)"),
        ({"use_sliding_window": "no"}, "use_sliding_window must be true or false"),
        # read, then written back as silu and a whole-head rotation: another model, silently
        ({"hidden_act": "gelu"}, "hidden_act is 'gelu'; tracefp4 implements silu only"),
        (
            {"partial_rotary_factor": 0.5},
            "partial_rotary_factor is 0.5; tracefp4 rotates part of each head for qwen3_5",
        ),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor is 0.5"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types must list 2 of \('full_attention',\)"),
        ({"layer_types": ["linear_attention", "full_attention"]}, r"layer_types must list 2 of \('full_attention',\)"),
    ],
)
def test_absurd_config_is_a_value_error_naming_the_field(tmp_path, changes, message):
    folder = saved(tmp_path, manifest=False)
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(folder)


@pytest.mark.parametrize(
    "changes, message",
    [
        # within the bounds, so only the tensors can tell: fails before a model of that size is described
        ({"num_hidden_layers": 16_000_000}, r"num_hidden_layers is 16000000, but the weights hold 2 \(missing"),
        ({"num_experts": 4000}, r"num_experts is 4000, but the weights hold 4"),
        # transformers 5's qwen3_moe writes the count as num_local_experts alone: named as the file names it
        ({"num_experts": None, "num_local_experts": 8}, r"num_local_experts is 8, but the weights hold 4"),
        # would allocate ~0.5 GB per embedding if it were built before the check
        ({"vocab_size": 2**21}, r"embed_tokens.weight has shape \[256, 64\], but config.json implies \[2097152, 64\]"),
        ({"moe_intermediate_size": 96}, r"0.gate_proj.weight has shape \[64, 64\], but config.json implies \[96,"),
        ({"num_hidden_layers": 1}, r"num_hidden_layers is 1, but the weights hold 2 \(unexpected model.layers.1"),
    ],
)
def test_config_is_checked_against_the_tensor_headers(tmp_path, changes, message):
    folder = saved(tmp_path, manifest=False)
    edit_config(folder, **changes)
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        load_model(folder)
    assert time.monotonic() - start < 5


def test_dtype_or_shape_of_a_tensor_must_match(tmp_path):
    folder = saved(tmp_path, manifest=False)
    rewrite_tensor(folder / SINGLE, "model.norm.weight", torch.ones(64, dtype=torch.int64))
    with pytest.raises(CheckpointError, match=r"model.norm.weight is I64; weights must be one of"):
        load_model(folder)
    rewrite_tensor(folder / SINGLE, "model.norm.weight", torch.ones(65))
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \[65\], but config.json implies \[64\]"):
        load_model(folder)
    rewrite_tensor(folder / SINGLE, "model.norm.weight", torch.ones(64, dtype=torch.bfloat16))
    assert load_model(folder).model.norm.weight.dtype == torch.float32  # any float dtype loads


def test_missing_or_extra_tensors_are_named(tmp_path):
    folder = saved(tmp_path, manifest=False)
    with safe_open(folder / SINGLE, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.0.extra.weight"] = tensors.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    save_file(tensors, folder / SINGLE)
    with pytest.raises(
        CheckpointError,
        match=r"missing \['model.layers.1.mlp.experts.3.up_proj.weight'\], "
        r"unexpected \['model.layers.0.extra.weight'\]",
    ):
        load_model(folder)


def index_of(folder):
    return json.loads((folder / INDEX).read_text())


def write_index(folder, index):
    (folder / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("shard", ["../other/model.safetensors", "/etc/passwd", "a\\..\\b", "", 7])
def test_index_paths_stay_inside_the_folder(tmp_path, shard):
    folder = saved(tmp_path, sharded=True, manifest=False)
    index = index_of(folder)
    index["weight_map"]["model.norm.weight"] = shard
    write_index(folder, index)
    with pytest.raises(CheckpointError, match=rf"{INDEX} for tensor model.norm.weight names .*(outside|not a file)"):
        load_model(folder)


def test_symlinked_shard_may_not_leave_the_folder(tmp_path):
    folder = saved(tmp_path, sharded=True, manifest=False)
    shard = folder / index_of(folder)["weight_map"]["model.norm.weight"]
    outside = shard.rename(tmp_path / "outside.safetensors")
    shard.symlink_to(outside)
    with pytest.raises(
        CheckpointError, match=rf"{shard} \({INDEX} for tensor .*\) is a link to .*outside.safetensors, outside"
    ):
        load_model(folder)
    shard.unlink()
    outside.rename(folder / "moved.safetensors")
    shard.symlink_to("moved.safetensors")  # a link within the folder is fine
    load_model(folder)


def hub_cache(folder, repository):
    """``folder``'s files laid out as Hugging Face's cache holds them: a
    snapshot folder of links into the repository's blobs."""
    blobs, snapshot = repository / "blobs", repository / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        file.rename(blobs / blob)
        (snapshot / file.name).symlink_to(f"../../blobs/{blob}")
    return snapshot


def test_a_snapshot_in_the_hugging_face_cache_loads_and_links_elsewhere_do_not(tmp_path):
    """What ``snapshot_download`` (``hf download`` without ``--local-dir``)
    gives: files linking to ``../../blobs``, outside the snapshot folder."""
    model = build_model("smoke", seed=1)
    snapshot = hub_cache(save_model(model, tmp_path / "ckpt", max_shard_bytes=100_000), tmp_path / "models--a--b")
    loaded = load_model(snapshot)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    config = snapshot / "config.json"
    elsewhere = tmp_path / "config.json"  # a snapshot's link to another folder than its blobs
    elsewhere.write_bytes(config.read_bytes())
    config.unlink()
    config.symlink_to(elsewhere)
    with pytest.raises(
        CheckpointError,
        match=r"config.json \(the config\) is a link to .*config.json, outside the folder; copy .* \(cp -rL\)",
    ):
        load_model(snapshot)


def test_bad_index_or_missing_shard_names_the_tensor(tmp_path):
    folder = saved(tmp_path, sharded=True, manifest=False)
    index = index_of(folder)
    shard = index["weight_map"]["model.norm.weight"]
    other = next(s for s in index["weight_map"].values() if s != shard)
    write_index(folder, {**index, "weight_map": {**index["weight_map"], "model.norm.weight": other}})
    with pytest.raises(CheckpointError, match=rf"{INDEX} puts model.norm.weight in .*{other}, which does not hold it"):
        load_model(folder)
    write_index(folder, index)
    (folder / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"{shard}: missing, but {INDEX} puts .* there"):
        load_model(folder)
    for bad in ("not json", "[]", '{"weight_map": {"a": null}}'):
        (folder / INDEX).write_text(bad)
        with pytest.raises(CheckpointError, match=rf"{INDEX}"):
            load_model(folder)


def test_unreadable_files_are_checkpoint_errors(tmp_path):
    folder = saved(tmp_path, manifest=False)
    (folder / "config.json").write_bytes(b"\xff{")
    with pytest.raises(CheckpointError, match=str(folder)):
        load_model(folder)
    folder = saved(tmp_path, "other", manifest=False)
    (folder / SINGLE).write_bytes((folder / SINGLE).read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=rf"{SINGLE}: not a readable safetensors file"):
        load_model(folder)
    (folder / SINGLE).unlink()
    (folder / SINGLE).mkdir()  # was an IndexError
    with pytest.raises(CheckpointError, match=rf"{SINGLE}: not a file"):
        load_model(folder)


def files_of(folder):
    tensors = {}
    for shard in folder.glob("*.safetensors"):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize("preset, tied", [("smoke", False), ("smoke", True), ("tiny-qwen2", False)])
def test_lean_load_holds_exactly_the_files_tensors_in_their_dtype(tmp_path, preset, tied):
    model = build_model(replace(PRESETS[preset], tie_word_embeddings=tied), seed=4, dtype=torch.bfloat16)
    folder = save_model(model, tmp_path / "ckpt", max_shard_bytes=100_000)  # experts of a layer span shards
    loaded = load_model(folder)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    state = loaded.state_dict()
    if tied:
        state.pop("lm_head.weight")
    on_disk, again = files_of(folder), stacked_to_hub(state, loaded.cfg)
    assert sorted(on_disk) == sorted(again)
    for key, t in on_disk.items():
        assert t.dtype == again[key].dtype and torch.equal(t, again[key]), key
    # the loader and the in-memory conversion (weight sync) agree, and a dtype asked for is honoured
    stacked = hub_to_stacked(on_disk, loaded.cfg)
    for key, t in loaded.state_dict().items():
        if not (tied and key == "lm_head.weight"):
            assert torch.equal(stacked[key], t), key
    wide = load_model(folder, dtype=torch.float32)
    for (key, t), w in zip(loaded.state_dict().items(), wide.state_dict().values()):
        assert w.dtype == torch.float32 and torch.equal(w, t.float()), key


class Allocations(TorchDispatchMode):
    """Every new tensor with storage an aten op makes (no view, no in-place result): (dtype, elements)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = all(r.alias_info is None for r in func._schema.returns)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if fresh and isinstance(t, torch.Tensor) and not t.is_meta:
                self.made.append((t.dtype, t.numel()))
        return out


def test_a_bf16_checkpoint_with_a_few_float32_vectors_loads_in_bf16(tmp_path, caplog):
    """As the published Qwen3.5 checkpoints are (A_log and norms F32 among BF16
    matrices): the dtype of most of the bytes, not float32 for every weight."""
    folder = save_model(build_model("smoke", seed=2, dtype=torch.bfloat16), tmp_path / "ckpt")
    (folder / MANIFEST).unlink()
    rewrite_tensor(folder / SINGLE, "model.norm.weight", torch.full((64,), 1 + 2**-10))  # not a bf16 value
    with caplog.at_level(logging.INFO, "tracefp4.checkpoint"):
        model = load_model(folder)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert "rounded to it from another dtype: model.norm.weight (1 in all)" in caplog.text


def test_a_bf16_checkpoint_loads_without_a_float32_copy(tmp_path):
    folder = save_model(build_model("smoke", seed=2, dtype=torch.bfloat16), tmp_path / "ckpt")
    with Allocations() as seen:
        model = load_model(folder)
    params = sum(p.numel() for p in model.parameters())
    floats = [(dtype, n) for dtype, n in seen.made if dtype.is_floating_point and dtype != torch.bfloat16]
    assert not floats, f"tensors of another float dtype made while loading: {floats[:5]}"
    bf16 = sum(n for dtype, n in seen.made if dtype == torch.bfloat16 and n > 1)
    assert bf16 <= params  # the parameters, allocated once: no second stacked copy of the experts


def test_meta_init_has_no_storage_and_nothing_to_compute():
    with torch.device("meta"):
        model = Transformer(PRESETS["tiny"])
    assert all(p.is_meta for p in model.parameters())
    assert not list(model.buffers())  # else empty_model and load_model would have to compute them
    empty = empty_model(PRESETS["smoke"], torch.bfloat16)
    assert {p.dtype for p in empty.parameters()} == {torch.bfloat16} and not any(p.is_meta for p in empty.parameters())


def test_weight_sync_conversion_names_missing_parts():
    cfg = PRESETS["smoke"]
    hub = stacked_to_hub(build_model(cfg).state_dict(), cfg)
    del hub["model.layers.1.mlp.experts.2.up_proj.weight"], hub["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(KeyError, match=r"lacks \['model.layers.0.self_attn.v_proj.weight'\] of .*qkv_proj.weight"):
        hub_to_stacked(hub, cfg)
    hub["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(3, 64)
    with pytest.raises(ValueError, match=r"v_proj.weight has shape \[3, 64\], but the config implies \[32, 64\]"):
        hub_to_stacked(hub, cfg)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_sliding_window_attention_is_refused(tmp_path, kind):
    """transformers masks attention to a window where use_sliding_window is
    true (every layer of qwen3_moe, the sliding_attention layer_types of
    qwen2_moe); tracefp4 attends to the whole prefix, so such a config is
    refused rather than loaded as another model. Its own configs, which say
    false (as the published ones do), load."""
    hf_model(kind).save_pretrained(tmp_path / "hf")
    folder = tmp_path / "hf"
    written = json.loads((folder / "config.json").read_text())
    assert written["use_sliding_window"] is False
    assert written.get("layer_types", ["full_attention"] * 3) == ["full_attention"] * 3  # qwen2_moe writes them
    load_model(folder)
    edit_config(folder, use_sliding_window=True, sliding_window=8, max_window_layers=3)
    with pytest.raises(CheckpointError, match=r"config.json: use_sliding_window is true \(sliding_window 8\)"):
        load_model(folder)
    edit_config(folder, use_sliding_window=False, layer_types=["sliding_attention", "full_attention", "full_attention"])
    with pytest.raises(CheckpointError, match=r"layer_types must list 3 of \('full_attention',\), got \['sliding"):
        load_model(folder)


def transformers_model(kind):
    """A small random transformers model of ``kind``; qwen3_5_moe is the
    multimodal one the Hub publishes."""
    if kind != "qwen3_5_moe":
        return hf_model(kind)
    config = transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    randomize(model, 0)
    return model


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "qwen3_5_moe"])
def test_fused_experts_load_like_transformers(tmp_path, kind):
    """transformers 5 holds a layer's experts fused and writes them so where
    nothing reverts it (``save_original_format=False``, a resave of fused
    files); the published Qwen3.5-MoE checkpoints are fused. They load to
    transformers' logits and to the very bits of the per-expert layout, and
    saving still writes per expert."""
    reference = transformers_model(kind)
    reference.save_pretrained(tmp_path / "fused", save_original_format=False, max_shard_size="40KB")
    reference.save_pretrained(tmp_path / "per_expert")
    fused = tmp_path / "fused"
    index = json.loads((fused / INDEX).read_text())
    experts = ("model.language_model." if kind == "qwen3_5_moe" else "model.") + "layers.0.mlp.experts"
    on_disk = files_of(fused)
    text = reference.config.get_text_config()
    e, i, h = text.num_experts, text.moe_intermediate_size, text.hidden_size
    assert on_disk[f"{experts}.gate_up_proj"].shape == (e, 2 * i, h)
    assert on_disk[f"{experts}.down_proj"].shape == (e, h, i)
    assert not any(".experts.0." in k for k in on_disk)
    if kind == "qwen3_5_moe":  # the Hub's multi-token-prediction head keeps its experts one by one: skipped
        save_file({"mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(i, h)}, fused / "mtp.safetensors")
        index["weight_map"]["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = "mtp.safetensors"
        (fused / INDEX).write_text(json.dumps(index))
    ours = load_model(fused).eval()
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        got = ours(tokens, torch.arange(17).expand(2, -1))
    assert (got - expected).abs().max().item() < 1e-4
    per_expert = load_model(tmp_path / "per_expert")
    for (name, a), b in zip(ours.state_dict().items(), per_expert.state_dict().values()):
        assert torch.equal(a, b), name
    if kind != "qwen3_5_moe":  # a weight sync takes transformers' in-memory (fused) state as it is
        stacked = hub_to_stacked(reference.state_dict(), ours.cfg)
        for name, t in ours.state_dict().items():
            assert torch.equal(stacked[name], t), name
    saved = files_of(save_model(ours, tmp_path / "ours"))
    assert sorted(saved) == sorted(stacked_to_hub(ours.state_dict(), ours.cfg))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in saved and not any(k.endswith("_proj") for k in saved)


def test_fused_experts_are_checked(tmp_path):
    """A fused tensor of the wrong shape fails naming it and its dims, an
    absurd expert count fails before anything is described, and a mix of the
    two layouts is refused, by the loader and by the weight sync alike."""
    hf_model("qwen3_moe").save_pretrained(tmp_path / "hf", save_original_format=False)
    folder, experts = tmp_path / "hf", "model.layers.0.mlp.experts"
    good = load_file(folder / SINGLE)
    rewrite_tensor(folder / SINGLE, f"{experts}.down_proj", good[f"{experts}.down_proj"].transpose(1, 2).contiguous())
    with pytest.raises(
        CheckpointError,
        match=r"down_proj has shape \[4, 32, 64\], but config.json implies \[4, 64, 32\] "
        r"\(\[num_experts, hidden_size, moe_intermediate_size\]\)",
    ):
        load_model(folder)
    save_file(good, folder / SINGLE)
    edit_config(folder, num_experts=16_000_000)
    start = time.monotonic()  # the router is compared first
    with pytest.raises(
        CheckpointError, match=r"gate.weight has shape \[4, 64\], but config.json implies \[16000000, 64"
    ):
        load_model(folder)
    assert time.monotonic() - start < 5
    edit_config(folder, num_experts=4)
    mixed = dict(good)
    gate, up = mixed.pop(f"{experts}.gate_up_proj").chunk(2, dim=1)  # layer 0: gate and up per expert, down fused
    for e in range(4):
        mixed[f"{experts}.{e}.gate_proj.weight"], mixed[f"{experts}.{e}.up_proj.weight"] = gate[e], up[e]
    save_file({k: t.contiguous() for k, t in mixed.items()}, folder / SINGLE)
    message = (
        rf"holds {experts}.down_proj \(a layer's experts fused\) and {experts}.0.gate_proj.weight "
        r"\(one expert's\): the experts must be all fused or all per expert"
    )
    with pytest.raises(CheckpointError, match=message):
        load_model(folder)
    with pytest.raises(ValueError, match=message):
        hub_to_stacked(mixed, config_from_hf(json.loads((folder / "config.json").read_text())))
    del good[f"{experts}.down_proj"]
    save_file(good, folder / SINGLE)
    with pytest.raises(CheckpointError, match=rf"missing \['{experts}.down_proj'\]"):
        load_model(folder)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_a_config_without_norm_topk_prob_routes_as_transformers_does(kind):
    hf = config_to_hf(PRESETS["tiny" if kind == "qwen3_moe" else "tiny-qwen2"])
    del hf["norm_topk_prob"]
    default = transformers.AutoConfig.for_model(kind).norm_topk_prob
    assert config_from_hf(hf).norm_topk_prob is default is False
