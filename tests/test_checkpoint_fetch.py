"""Checkpoints from the artifact store: fetched from a real S3 server (SeaweedFS,
the s3_server plugin) into a local cache keyed by their checksums, verified
before use, and loaded by the prepare step."""

import concurrent.futures
import io
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import uuid

import pytest
import torch
from chat_checkpoint import chat_checkpoint

from tracefp4.components import checkpoint, steps
from tracefp4.components.checkpoint import (
    CONFIG,
    INDEX,
    LOCATION,
    MANIFEST,
    SINGLE,
    UNFINISHED,
    CheckpointError,
    fetch,
    fingerprint,
    folder_digest,
    load_model,
    save_model,
    write_location,
)
from tracefp4.components.model import build_model
from tracefp4.components.store import LocalStore, NoRoom, S3Store, StoreError, open_store
from tracefp4.components.tasks import Problem, format_example
from tracefp4.components.tokenizer import GENERATION_CONFIG, build_tokenizer, load_tokenizer
from tracefp4.pipelines.local import run_local
from tracefp4.schemas import ConfigError, load_config


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEFP4_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "checkpoints"


@pytest.fixture
def downloads(monkeypatch):
    """Names of the objects S3Store.download fetched."""
    names = []
    real = S3Store.download

    def counted(self, key, path):
        names.append(key)
        return real(self, key, path)

    monkeypatch.setattr(S3Store, "download", counted)
    return names


def saved(tmp_path, seed=1, manifest=True):
    model = build_model("smoke", seed=seed)
    extra = build_tokenizer().files()
    folder = save_model(model, tmp_path / f"ckpt-{seed}", max_shard_bytes=100_000, extra=extra)
    if not manifest:
        (folder / MANIFEST).unlink()
    return model, folder


def upload(server, folder, skip=(), flip=()) -> str:
    """``folder``'s files under a new prefix of the server's bucket; the middle byte of each in ``flip`` inverted."""
    prefix = f"models/{uuid.uuid4().hex[:12]}"
    store = server.store(prefix)
    for path in sorted(folder.iterdir()):
        data = bytearray(path.read_bytes())
        if path.name in flip:
            data[len(data) // 2] ^= 0xFF
        if path.name not in skip:
            store.put_bytes(path.name, bytes(data))
    return server.uri(prefix)


def shards(folder):
    return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))


def logits(model):
    tokens = torch.arange(12).view(2, 6)
    with torch.no_grad():
        return model(tokens, torch.arange(6).expand(2, 6))


def test_s3_checkpoint_loads_like_the_original_and_a_second_fetch_downloads_nothing(tmp_path, s3_env, cache, downloads):
    model, folder = saved(tmp_path)
    assert len(shards(folder)) > 1
    uri = upload(s3_env, folder)
    local = fetch(uri)
    assert local.parent == cache and sorted(downloads) == sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in folder.iterdir())
    assert torch.equal(logits(load_model(local)), logits(model))
    assert load_tokenizer(local).files() == build_tokenizer().files()

    downloads.clear()
    mtimes = {p.name: p.stat().st_mtime_ns for p in local.iterdir()}
    assert fetch(uri) == local and downloads == []  # the cache answers
    assert {p.name: p.stat().st_mtime_ns for p in local.iterdir()} == mtimes
    assert fetch(upload(s3_env, folder)) == local  # the same checkpoint elsewhere: same checksums, same cache entry
    assert downloads == []


def test_a_checkpoint_fetched_and_loaded_is_read_for_its_checksums_once_while_unchanged(
    tmp_path, s3_env, cache, monkeypatch
):
    """Rank 0 of a distributed round fetches the policy and loads it at once:
    fetch checks each file as it downloads it, and loading does not read them
    for their sha256 again (490 GB at Qwen3.5-35B-A3B). A file changed since
    (a flipped byte, or only its times touched) is checked again, and a
    folder this process did not download is checked in full."""
    model, folder = saved(tmp_path)
    uri = upload(s3_env, folder)
    hashed = []
    real = checkpoint.size_and_sha256
    monkeypatch.setattr(checkpoint, "size_and_sha256", lambda path: hashed.append(path.name) or real(path))
    local = fetch(uri)
    listed = sorted(json.loads((folder / MANIFEST).read_text())["files"])
    assert sorted(hashed) == listed
    hashed.clear()
    assert torch.equal(logits(load_model(local)), logits(model)) and hashed == []

    shard = local / shards(folder)[0]
    os.utime(shard)  # the same bytes, newer times
    load_model(local)
    assert hashed == [shard.name]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard}: sha256 does not match"):
        load_model(local)
    hashed.clear()
    load_model(folder)  # saved here, not fetched: every file checked
    assert sorted(hashed) == listed


def test_processes_fetching_a_checkpoint_at_once_download_it_once(tmp_path, s3_env, cache, downloads, monkeypatch):
    """The ranks of a distributed train step fetch the same folders at once: one
    downloads, the others wait for it and find it cached. Threads here: each
    opens the lock file itself, so the kernel's lock keeps them apart as it does
    processes."""
    _, folder = saved(tmp_path)
    uri = upload(s3_env, folder)
    slow = S3Store.download  # the counting one: each object takes a while, so that the fetches overlap

    def download(self, key, path):
        time.sleep(0.05)
        return slow(self, key, path)

    monkeypatch.setattr(S3Store, "download", download)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        folders = list(pool.map(lambda _: fetch(uri), range(4)))
    assert len(set(folders)) == 1 and folders[0].parent == cache
    assert sorted(downloads) == sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)  # each object once
    assert not [p for p in cache.iterdir() if p.name.endswith(".partial")]


def test_a_fetch_sweeps_what_a_killed_download_of_its_entry_left(tmp_path, s3_env, cache, monkeypatch):
    """A process killed while downloading (out of memory, SIGKILL) cleans
    nothing up: its partial folder (at the paper's scale up to 70 GB of a
    policy, 420 GB of a trainer state) stayed in the cache for good. The next
    fetch of the same entry, holding the entry's lock, deletes it."""
    _, folder = saved(tmp_path)
    uri = upload(s3_env, folder)
    with monkeypatch.context() as m:
        m.setattr(S3Store, "download", lambda self, key, path: path.write_bytes(b"half") and sys.exit("killed"))
        m.setattr(shutil, "rmtree", lambda *a, **k: None)  # a killed process removes nothing
        with pytest.raises(SystemExit):
            fetch(uri)
    (partial,) = [p for p in cache.iterdir() if p.name.endswith(".partial")]
    assert any(partial.iterdir())
    fetched = fetch(uri)
    assert [p.name for p in cache.iterdir()] == [fetched.name]


def test_a_fetch_without_weights_has_the_rest_and_a_cache_entry_of_its_own(tmp_path, s3_env, cache, downloads):
    _, folder = saved(tmp_path)
    uri = upload(s3_env, folder)
    light = fetch(uri, weights=False)
    rest = sorted(p.name for p in folder.iterdir() if not p.name.endswith(".safetensors"))
    assert sorted(p.name for p in light.iterdir()) == rest and not [d for d in downloads if d.endswith(".safetensors")]
    assert load_tokenizer(light).files() == build_tokenizer().files()
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(light)
    full = fetch(uri)
    assert full != light and torch.equal(logits(load_model(full)), logits(saved(tmp_path)[0]))
    assert fetch(uri, weights=False) == light


def test_a_fetch_into_a_folder_checks_it_there_and_leaves_the_cache_alone(tmp_path, s3_env, cache, downloads):
    """What the TrainJob launcher does with the ranks' new policy and state: its
    step's output folder is the only local copy, not the cache and a copy of it."""
    model, folder = saved(tmp_path)
    uri = upload(s3_env, folder)
    out = tmp_path / "out"
    out.mkdir()  # empty, as a step's output folder may be
    assert fetch(uri, into=out) == out and not cache.exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in folder.iterdir())
    assert torch.equal(logits(load_model(out)), logits(model))
    downloads.clear()
    with pytest.raises(CheckpointError, match=f"{out}: not empty"):
        fetch(uri, into=out)
    assert downloads == []
    bad = shards(folder)[0]
    with pytest.raises(CheckpointError, match=f"{bad}: sha256 does not match"):
        fetch(upload(s3_env, folder, flip={bad}), into=tmp_path / "corrupt")
    assert not [p for p in tmp_path.iterdir() if "corrupt" in p.name]  # neither the folder nor a partial one
    copied = fetch(folder, into=tmp_path / "copied")  # a local folder is copied
    assert sorted(p.name for p in copied.iterdir()) == sorted(p.name for p in folder.iterdir())


def test_a_checkpoint_its_filesystem_has_no_room_for_is_refused_before_a_download(
    tmp_path, s3_env, cache, downloads, monkeypatch
):
    """At the paper's scale the TrainJob step fetches about 490 GB: a disk that
    fills up mid-way would waste the download, and again at each retry."""
    _, folder = saved(tmp_path)
    uri = upload(s3_env, folder)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.name != MANIFEST)  # read first, held in memory
    usage = shutil.disk_usage(tmp_path)
    free = size - 1
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free))
    for into in (None, tmp_path / "out"):
        with pytest.raises(NoRoom, match=f"downloading {uri} .* needs {size:,} bytes .* has {free:,} bytes"):
            fetch(uri, into=into)
        assert downloads == [] and not (tmp_path / "out").exists()
        assert not cache.exists() or list(cache.iterdir()) == []
    free = size
    assert fetch(uri, into=tmp_path / "out").is_dir()


def test_a_folder_standing_for_a_stored_one_is_followed_there_while_that_is_the_same(tmp_path, s3_env, cache):
    """How a TrainJob round hands on its trainer state: the ranks' folder stays in
    the store, and the step's output holds its manifest and where it is."""
    model, folder = saved(tmp_path)
    uri = upload(s3_env, folder)
    standing = write_location(tmp_path / "standing", uri, (folder / MANIFEST).read_bytes())
    assert sorted(p.name for p in standing.iterdir()) == [MANIFEST, LOCATION]
    assert folder_digest(standing) == folder_digest(folder)  # it pins the same content
    assert torch.equal(logits(load_model(fetch(standing))), logits(model))
    # the same folder uploaded as a pipeline step's output, read from the store: followed too
    kfp_copy = upload(s3_env, standing)
    assert fetch(kfp_copy) == fetch(standing) and (fetch(kfp_copy, into=tmp_path / "into") / INDEX).exists()
    with pytest.raises(CheckpointError, match="not empty; it cannot stand for"):
        write_location(standing, uri, b"{}")
    # a folder standing for one rewritten, deleted, or itself standing for another, is refused
    other = upload(s3_env, saved(tmp_path, seed=2)[1])
    store = s3_env.store(other.removeprefix(s3_env.uri("")).strip("/"))
    rewritten = write_location(tmp_path / "rewritten", other, (folder / MANIFEST).read_bytes())
    with pytest.raises(CheckpointError, match=f"stands for {other}, whose {MANIFEST} differs: rewritten since"):
        fetch(rewritten)
    for key in store.list():
        store.delete(key)
    with pytest.raises(CheckpointError, match=f"stands for {other}, which is gone"):
        fetch(rewritten)
    chained = write_location(tmp_path / "chained", kfp_copy, (folder / MANIFEST).read_bytes())
    with pytest.raises(CheckpointError, match="which stands for another folder in turn"):
        fetch(chained)


def test_a_corrupt_shard_fails_naming_it_and_nothing_is_cached(tmp_path, s3_env, cache):
    _, folder = saved(tmp_path)
    bad = shards(folder)[0]
    uri = upload(s3_env, folder, flip={bad})
    with pytest.raises(CheckpointError, match=f"{uri}/{bad}: sha256 does not match {MANIFEST}"):
        fetch(uri)
    assert list(cache.iterdir()) == []  # neither a cache entry nor a partial download is left


def concurrent_calls(patch, cls, method: str) -> tuple[list, dict, list]:
    """``cls.method`` patched so that its first call waits for a second to
    start: the calls started, in order; how many had ended when each started;
    and whether that first one saw another (one call at a time, it would
    wait in vain)."""
    lock, second, calls, ended_before, waited = threading.Lock(), threading.Event(), [], {}, []
    ended = []
    real = getattr(cls, method)

    def waiting(self, key, path):
        with lock:
            first = not calls
            calls.append(key)
            ended_before[key] = len(ended)
        if first:
            waited.append(second.wait(timeout=10))
        else:
            second.set()
        real(self, key, path)
        with lock:
            ended.append(key)

    patch.setattr(cls, method, waiting)
    return calls, ended_before, waited


def test_a_checkpoints_files_download_several_at_once_and_the_first_bad_one_is_named(tmp_path, s3_env, cache):
    """Several steps fetch a 70 GB policy every round, and one S3 GET streams
    at a fraction of what the store and the network take: the files download
    up to TRANSFER_THREADS at once, each checked as it lands. Of two corrupt
    shards the error names the first in name order, whichever download ends
    first, and nothing is cached."""
    model, folder = saved(tmp_path)
    first, second = shards(folder)[:2]
    corrupt = upload(s3_env, folder, flip={first, second})
    with pytest.raises(CheckpointError, match=f"{corrupt}/{first}: sha256 does not match {MANIFEST}"):
        fetch(corrupt)
    assert list(cache.iterdir()) == []
    uri = upload(s3_env, folder)
    with pytest.MonkeyPatch.context() as patch:
        calls, _, waited = concurrent_calls(patch, S3Store, "download")
        local = fetch(uri)
    assert waited == [True] and len(calls) == len(list(folder.iterdir())) - 1  # all but the manifest, read first
    assert torch.equal(logits(load_model(local)), logits(model))


def test_a_folder_uploads_several_files_at_once_and_its_manifest_once_they_are_all_there(tmp_path, s3_env):
    """upload_folder (the steps' outputs, the TrainJob's inputs): the files up
    to TRANSFER_THREADS at once, the manifest that makes the folder whole once
    every other file is in the store."""
    model, folder = saved(tmp_path)
    prefix = f"models/{uuid.uuid4().hex[:12]}"
    with pytest.MonkeyPatch.context() as patch:
        calls, ended_before, waited = concurrent_calls(patch, S3Store, "upload")
        checkpoint.upload_folder(folder, s3_env.store(prefix))
    assert waited == [True] and sorted(calls) == sorted(p.name for p in folder.iterdir())
    assert calls[-1] == MANIFEST and ended_before[MANIFEST] == len(calls) - 1  # once all others had ended
    assert torch.equal(logits(load_model(fetch(s3_env.uri(prefix)))), logits(model))


@pytest.mark.parametrize("backend", ["s3", "local"])
def test_a_folder_whose_upload_was_cut_short_is_refused_naming_it_until_an_upload_finishes(
    tmp_path, request, cache, monkeypatch, backend
):
    """A step killed while upload_folder wrote its output (a round's trainer
    state, a TrainJob round's policy) once config.json and every shard were
    in the store but not the manifest left a folder that fetch took for a
    checkpoint from elsewhere: loaded unverified, with no more than a
    warning. Every reader refuses it, naming it, until an upload there
    finishes; one killed once the manifest was there (before the marker
    left) committed the folder, which loads. A ``file://`` store's folder
    likewise, loaded as a folder too."""
    model, folder = saved(tmp_path)
    if backend == "s3":
        uri = request.getfixturevalue("s3_env").uri(f"models/{uuid.uuid4().hex[:12]}")
    else:
        uri = (tmp_path / "store").as_uri()
    target = open_store(uri)
    where = target.uri if backend == "s3" else str(tmp_path / "store")  # a file:// URI is read as its folder
    files = sorted(p.name for p in folder.iterdir())
    monkeypatch.setattr(checkpoint, "TRANSFER_THREADS", 1)  # in name order
    upload, uploaded = type(target).upload, []

    def killed_after(count):
        def cut(self, key, path):
            if len(uploaded) == count:
                raise StoreError("killed")
            upload(self, key, path)
            uploaded.append(key)

        return cut

    others = [name for name in files if name != MANIFEST]
    with monkeypatch.context() as m:
        m.setattr(type(target), "upload", killed_after(len(others)))  # every file but the manifest
        with pytest.raises(StoreError, match="killed"):
            checkpoint.upload_folder(folder, target)
    assert uploaded == others and {CONFIG, INDEX, *shards(folder)} <= set(uploaded)
    assert target.list() == sorted([UNFINISHED, *others])
    unfinished = re.escape(f"{where}: its upload or deletion did not finish (it holds {UNFINISHED} and no {MANIFEST})")
    for read in (fetch, fingerprint):
        with pytest.raises(CheckpointError, match=unfinished + ", so it is not whole: re-run the step that uploads it"):
            read(uri)
    if backend == "local":
        with pytest.raises(CheckpointError, match=unfinished):
            load_model(tmp_path / "store")
    assert not cache.exists() or list(cache.iterdir()) == []

    delete = type(target).delete

    def killed_at_the_marker(self, key):
        if key == UNFINISHED:
            raise StoreError("killed")
        delete(self, key)

    with monkeypatch.context() as m:  # killed once the manifest is there, before the marker leaves
        m.setattr(type(target), "delete", killed_at_the_marker)
        with pytest.raises(StoreError, match="killed"):
            checkpoint.upload_folder(folder, target)
    assert target.list() == sorted([UNFINISHED, *files])
    assert torch.equal(logits(load_model(fetch(uri))), logits(model))
    checkpoint.upload_folder(folder, target)
    assert target.list() == files


def killed_after_one_deletion(monkeypatch, store_type, action) -> list[str]:
    """Run ``action`` with ``store_type``'s deletions failing after the first
    (the step killed right after a folder's manifest went); the keys deleted."""
    deleted, real = [], store_type.delete

    def killed(self, key):
        if deleted:
            raise StoreError("killed")
        real(self, key)
        deleted.append(key)

    with monkeypatch.context() as m:
        m.setattr(store_type, "delete", killed)
        with pytest.raises(StoreError, match="killed"):
            action()
    return deleted


@pytest.mark.parametrize("backend", ["s3", "local", "folder"])
def test_a_folder_whose_deletion_was_cut_short_is_refused_like_a_cut_upload(
    tmp_path, request, cache, monkeypatch, backend
):
    """Deleting a tracefp4 folder (a round's trainer state two rounds on, a
    TrainJob round's outputs before a new attempt) deleted its manifest first
    and wrote no marker: a step killed right after left config.json and every
    shard, which fetch loaded as a checkpoint from elsewhere, unverified. A
    deletion writes UNFINISHED first, as an upload does, so every reader
    refuses the folder, naming it, and the marker goes last once a deletion
    finishes: in the real S3 server, a file:// store and a local folder."""
    model, folder = saved(tmp_path)
    files = sorted(p.name for p in folder.iterdir())
    if backend == "folder":
        store, prefix, uri, where = LocalStore(tmp_path), folder.name, str(folder), str(folder)

        def delete():
            checkpoint.remove_folder(folder)

    else:
        root = request.getfixturevalue("s3_env").uri("models") if backend == "s3" else (tmp_path / "store").as_uri()
        store, prefix = open_store(root), uuid.uuid4().hex[:12]
        uri = f"{root}/{prefix}"
        checkpoint.upload_folder(folder, open_store(uri))
        where = open_store(uri).uri if backend == "s3" else str(tmp_path / "store" / prefix)

        def delete():
            checkpoint.delete_folder(store, prefix)

    assert killed_after_one_deletion(monkeypatch, type(store), delete) == [f"{prefix}/{MANIFEST}"]
    assert store.list(f"{prefix}/") == sorted(f"{prefix}/{name}" for name in [UNFINISHED, *files] if name != MANIFEST)
    unfinished = re.escape(f"{where}: its upload or deletion did not finish (it holds {UNFINISHED} and no {MANIFEST})")
    for read in (fetch, fingerprint):
        with pytest.raises(CheckpointError, match=unfinished):
            read(uri)
    if backend != "s3":
        with pytest.raises(CheckpointError, match=unfinished):
            load_model(where)
    assert not cache.exists() or list(cache.iterdir()) == []
    delete()
    assert store.list(f"{prefix}/") == []
    if backend != "s3":
        assert not os.path.exists(where)


def test_a_runs_clean_cut_short_leaves_its_policies_refused_not_loadable(tmp_path, cache, monkeypatch):
    """``runs clean`` deletes a run's folders all at once, each folder's
    manifest first: cut short after a policy's, it left config.json and every
    shard, which loaded as a checkpoint from elsewhere. Each checkpoint folder
    gets UNFINISHED first, which goes last (a cut upload's too), so the
    policy is refused, and a clean run again leaves nothing."""
    from tracefp4.pipelines.clean import RunFolder, delete, survey

    _, folder = saved(tmp_path)
    root = (tmp_path / "store").as_uri()
    checkpoint.upload_folder(folder, open_store(f"{root}/run/policy"))
    cut = open_store(f"{root}/run/cut")  # an upload cut short: its marker, no manifest
    cut.put_bytes(UNFINISHED, b"x")
    cut.upload("config.json", folder / "config.json")
    run = RunFolder("store", root, "run")
    assert killed_after_one_deletion(monkeypatch, LocalStore, lambda: delete(survey(run))) == [f"run/policy/{MANIFEST}"]
    for uri in (f"{root}/run/policy", f"{root}/run/cut"):
        with pytest.raises(CheckpointError, match="its upload or deletion did not finish"):
            fetch(uri)
    delete(survey(run))
    assert open_store(root).list("run/") == []


@pytest.mark.parametrize("manifest", [True, False])
def test_a_missing_shard_fails_naming_it(tmp_path, s3_env, cache, manifest):
    _, folder = saved(tmp_path, manifest=manifest)
    gone = shards(folder)[-1]
    uri = upload(s3_env, folder, skip={gone})
    said = f"listed in {MANIFEST} but missing" if manifest else f"missing from the store, but {INDEX} puts"
    with pytest.raises(CheckpointError, match=f"{uri}/{gone}: {said}"):
        fetch(uri)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_without_a_manifest_it_loads_unverified_and_a_rewritten_shard_is_fetched_again(
    tmp_path, s3_env, cache, downloads, caplog
):
    model, folder = saved(tmp_path, manifest=False)
    uri = upload(s3_env, folder)
    with caplog.at_level(logging.WARNING, logger="tracefp4.checkpoint"):
        local = fetch(uri)
        assert torch.equal(logits(load_model(local)), logits(model))
    assert f"has no {MANIFEST}: loading it unverified" in caplog.text
    assert fetch(uri) == local

    other, second = saved(tmp_path, seed=2, manifest=False)  # new weights at the same URI, same config and index
    assert (second / INDEX).read_bytes() == (folder / INDEX).read_bytes()
    for name in shards(second):
        s3_env.store(uri.removeprefix(s3_env.uri() + "/")).put_bytes(name, (second / name).read_bytes())
    downloads.clear()
    fresh = fetch(uri)
    assert fresh != local and set(shards(second)) <= set(downloads)  # keyed by the objects' ETags: no stale weights
    assert torch.equal(logits(load_model(fresh)), logits(other))


def test_a_bad_index_or_two_sets_of_weights_fail_naming_them(tmp_path, s3_env, cache):
    _, folder = saved(tmp_path, manifest=False)
    (folder / INDEX).write_text('{"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}')
    uri = upload(s3_env, folder)
    with pytest.raises(CheckpointError, match="names '../elsewhere.safetensors', outside the folder"):
        fetch(uri)
    (folder / INDEX).write_text("[]")
    uri = upload(s3_env, folder)
    with pytest.raises(CheckpointError, match=f"{uri}/{INDEX}: not a safetensors index"):
        fetch(uri)
    # a stale single file beside the index and its shards: two sets of weights, here and in the store
    _, other = saved(tmp_path, seed=2, manifest=False)
    save_model(build_model("smoke", seed=3), tmp_path / "single")  # one file
    (tmp_path / "single" / SINGLE).rename(other / SINGLE)
    uri = upload(s3_env, other)
    with pytest.raises(CheckpointError, match=f"{uri}: holds both {SINGLE} and {INDEX}, two sets of weights"):
        fetch(uri)
    with pytest.raises(CheckpointError, match=f"{other}: holds both"):
        load_model(other)


def test_a_local_path_or_file_uri_is_the_folder_itself(tmp_path, cache):
    _, folder = saved(tmp_path)
    assert fetch(folder) == folder and fetch(str(folder)) == folder
    assert fetch(folder.as_uri()) == folder
    assert fetch(f"file://localhost{folder}") == folder
    assert not cache.exists()


def test_prepare_loads_an_s3_checkpoint(tmp_path, s3_env, cache):
    model, folder = saved(tmp_path)
    uri = upload(s3_env, folder)
    # fp32_master keeps the policy in float32: the weights come back exactly (bf16 would round them)
    overrides = {"model.checkpoint": uri, "bootstrap.enabled": False, "train.precision": "fp32_master"}
    config = load_config(None, preset="smoke", overrides=overrides)
    assert config.model.preset is None and config.model.checkpoint == uri
    steps.prepare(config, tmp_path / "p0", "run")
    assert torch.equal(logits(load_model(tmp_path / "p0")), logits(model))
    assert load_tokenizer(tmp_path / "p0").files() == build_tokenizer().files()


def test_the_smoke_pipeline_runs_from_an_s3_chat_checkpoint_and_stops_on_its_eos(tmp_path, s3_env, cache):
    """A qwen3_moe checkpoint with a BPE tokenizer and a Qwen-style chat template,
    from s3:// through the whole DAG: prompts are the template's rendering, a
    response ends at the first eos it samples, and every saved policy carries
    the tokenizer files."""
    source = chat_checkpoint(tmp_path / "qwen")
    tok = load_tokenizer(source)
    # enough SFT for the policy to end some answers with <|im_end|> within the 8 new tokens
    overrides = {"model.checkpoint": upload(s3_env, source), "bootstrap.steps": 40, "bootstrap.learning_rate": 1e-2}
    config = load_config(None, preset="smoke", overrides=overrides)
    run_local(config, tmp_path / "run", out=io.StringIO())
    root = next((tmp_path / "run" / "pipeline_root").iterdir())
    for policy in (root / "prepare" / "policy", root / "train" / "new_policy"):
        assert load_tokenizer(policy).files() == tok.files()
        generation = json.loads((policy / GENERATION_CONFIG).read_text())
        assert generation["eos_token_id"] == list(tok.eos_ids) == [tok.end_id, tok.pad_id]
    lines = (root / "rollout" / "trajectories").read_text().splitlines()
    records = [json.loads(line) for line in lines[1:]]
    assert len(records) == config.rollout.prompts_per_step * config.rollout.group_size
    stopped = 0
    for record in records:
        t, problem = record["trajectory"], Problem(**record["problem"])
        assert t["prompt"] == tok.encode_prompt(format_example(problem))
        assert tok.hf.decode(t["prompt"]).startswith("<|im_start|>user\n")
        eos_at = [i for i, token in enumerate(t["response"]) if token in tok.eos_ids]
        if t["finish_reason"] == "stop":
            assert eos_at == [len(t["response"]) - 1]  # ends at its first eos
            stopped += 1
        else:
            assert not eos_at and len(t["response"]) == config.rollout.max_new_tokens
    assert stopped > 0


def test_an_s3_checkpoint_without_its_tokenizer_is_refused_before_the_run_starts(tmp_path, s3_env, cache, downloads):
    """Its config.json and tokenizer files are read as prepare reads them, its weights are not, and the error
    names the URI given, not the cache entry: the run had started and failed in prepare, after downloading the
    weights of one without a manifest (a Hugging Face folder). So is a prefix that holds no checkpoint."""
    _, folder = saved(tmp_path, manifest=False)
    uri = upload(s3_env, folder, skip=["tokenizer.json"])
    for given, problem in [
        (uri, f"model.checkpoint: {uri}/tokenizer.json does not exist: a checkpoint folder must carry its tokenizer"),
        (f"{uri}-not-there", f"{uri}-not-there/config.json does not exist"),
    ]:
        config = load_config(None, preset="smoke", overrides={"model.checkpoint": given})
        with pytest.raises(ConfigError) as refused:
            run_local(config, tmp_path / "run", out=io.StringIO())
        assert problem in str(refused.value) and str(cache) not in str(refused.value)
    assert not (tmp_path / "run").exists() and not any(key.endswith(".safetensors") for key in downloads)
