"""A step of guidance through a real S3 server, including the server dying in
the middle of the step's upload: the step either completes after retries or
fails clearly, and readers never see part of it."""

import threading
import time

import pytest
import torch

from tracefp4.components.capture import CaptureConfig
from tracefp4.components.guidance import GuidanceError, GuidanceLoader, read_manifest, write_step
from tracefp4.components.model import build_model
from tracefp4.components.quant_config import rollout_config
from tracefp4.components.rollout import SamplingParams, TorchEngine
from tracefp4.components.store import StoreError


@pytest.fixture(scope="module")
def records():
    engine = TorchEngine(build_model("smoke", seed=0), rollout_config("fp4_wa_kv"), capture=CaptureConfig())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (5,), generator=g).tolist() for _ in range(6)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    return [t.id for t in out], engine.drain_capture()


def test_step_round_trip_on_s3(s3_server, records):
    ids, captured = records
    store = s3_server.store("round-trip")
    manifest = write_step(store, captured, rl_step=0, policy_version=0, top_k=2, trajectories_per_shard=2)
    (mb,) = GuidanceLoader(store, 0, [ids])
    assert len(manifest["shards"]) == 3 and mb.missing == []
    for key, table in captured.tables.items():
        assert torch.equal(mb.tables[key].codes, table.codes) and torch.equal(mb.tables[key].scales, table.scales)


class _KillAfterFirstShard:
    """A store whose server dies right after the first shard of a step is put."""

    def __init__(self, store, server, down_s: float | None):
        self.store, self.server, self.down_s = store, server, down_s
        self.uri, self.puts = store.uri, 0

    def put_bytes(self, key, data):
        self.store.put_bytes(key, data)
        self.puts += 1
        if self.puts == 1:
            self.server.stop()
            if self.down_s is not None:
                threading.Timer(self.down_s, self.server.start).start()

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_upload_completes_after_the_server_comes_back(s3_server, records):
    ids, captured = records
    store = _KillAfterFirstShard(s3_server.store("killed", retries=8, backoff_s=0.5), s3_server, down_s=2.0)
    try:
        manifest = write_step(store, captured, rl_step=1, policy_version=0, top_k=2, trajectories_per_shard=2)
    finally:
        deadline = time.monotonic() + 30
        while not s3_server.running and time.monotonic() < deadline:
            time.sleep(0.1)
    assert store.puts == len(manifest["shards"]) + 1
    (mb,) = GuidanceLoader(s3_server.store("killed"), 1, [ids])
    assert torch.equal(mb.tables[(0, "moe_in")].codes, captured.tables[(0, "moe_in")].codes)


def test_upload_fails_clearly_and_no_partial_step_is_visible(s3_server, records):
    _, captured = records
    store = _KillAfterFirstShard(s3_server.store("dead", retries=2, backoff_s=0.1), s3_server, down_s=None)
    try:
        with pytest.raises(StoreError, match="attempts"):
            write_step(store, captured, rl_step=2, policy_version=0, top_k=2, trajectories_per_shard=2)
    finally:
        s3_server.start()
    reader = s3_server.store("dead")
    assert reader.list("guidance/step-000002") == ["guidance/step-000002/shard-00000.bin"]  # a shard, no manifest
    with pytest.raises(GuidanceError, match="no manifest, so step 2 is missing or incomplete"):
        read_manifest(reader, 2)
