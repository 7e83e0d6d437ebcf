"""Artifact store: both backends against real storage (a folder, and SeaweedFS
S3 from the s3_server plugin), including retries across a server restart, a
missing bucket, and endpoints that are wrong about TLS."""

import contextlib
import datetime
import hashlib
import ipaddress
import logging
import os
import socket
import ssl
import tempfile
import threading
import time
import tracemalloc
import uuid

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tracefp4.components import checkpoint
from tracefp4.components.checkpoint import UNFINISHED, commit_folder, fetch, upload_folder, verify_folder
from tracefp4.components.store import (
    ArtifactNotFound,
    LocalStore,
    S3Store,
    StoreError,
    hide_secrets,
    open_store,
)

MiB = 2**20


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(tmp_path.as_uri())
    return request.getfixturevalue("s3_server").store(_prefix(), part_size=5 * MiB)


def test_round_trip(store):
    assert store.list() == []
    store.put_bytes("a.bin", b"one")
    store.put_bytes("dir/b.bin", b"")
    store.put_bytes("dir/sub/c.bin", bytes(range(256)) * 100)
    assert store.get_bytes("a.bin") == b"one"
    assert store.get_bytes("dir/b.bin") == b""
    assert store.get_bytes("dir/sub/c.bin") == bytes(range(256)) * 100
    assert store.list() == ["a.bin", "dir/b.bin", "dir/sub/c.bin"]  # a "folder" is not an artifact
    assert store.sizes("dir/") == {"dir/b.bin": 0, "dir/sub/c.bin": 25600}
    with pytest.raises(ArtifactNotFound):
        store.get_bytes("dir")

    store.put_bytes("a.bin", b"two")  # overwrite
    assert store.get_bytes("a.bin") == b"two"
    assert store.list() == ["a.bin", "dir/b.bin", "dir/sub/c.bin"]


def test_list_prefixes_sorted(store):
    keys = ["z.bin", "shard/10.bin", "shard/2.bin", "shard/1.bin", "shardx.bin", "shard/deep/a/b.bin", "ckpt/model.st"]
    for key in keys:
        store.put_bytes(key, key.encode())
    assert store.list() == sorted(keys)
    assert store.list("shard/") == ["shard/1.bin", "shard/10.bin", "shard/2.bin", "shard/deep/a/b.bin"]
    assert store.list("shard") == ["shard/1.bin", "shard/10.bin", "shard/2.bin", "shard/deep/a/b.bin", "shardx.bin"]
    assert store.list("shard/1") == ["shard/1.bin", "shard/10.bin"]
    assert store.list("shard/deep/") == ["shard/deep/a/b.bin"]
    assert store.list("nothing/") == []


def test_delete_removes_one_object_and_a_missing_one_is_no_error(store):
    for key in ("ckpt/step-1/a", "ckpt/step-1/.metadata", "ckpt/step-2/a"):
        store.put_bytes(key, b"x")
    store.delete("ckpt/step-1/.metadata")
    store.delete("ckpt/step-1/.metadata")
    assert store.list("ckpt/") == ["ckpt/step-1/a", "ckpt/step-2/a"]
    with pytest.raises(ArtifactNotFound):
        store.get_bytes("ckpt/step-1/.metadata")


def test_a_local_deletion_takes_the_folders_it_leaves_empty(tmp_path):
    """As on S3, a folder stands while keys lie under it: deleting a round's
    keys leaves no empty tree behind; the root and folders still holding keys stay."""
    store = LocalStore(tmp_path / "store")
    for key in ("run/round-1/state/a", "run/round-1/state/b", "run/round-2/a"):
        store.put_bytes(key, b"x")
    store.delete("run/round-1/state/a")
    assert (tmp_path / "store/run/round-1/state").is_dir()
    store.delete_folder("run/round-1", ".metadata")
    assert sorted(p.name for p in (tmp_path / "store/run").iterdir()) == ["round-2"]
    store.delete("run/round-2/a")
    assert list((tmp_path / "store").iterdir()) == []
    store.put_bytes("run/round-3/a", b"y")  # the tree comes back with a key
    assert store.list() == ["run/round-3/a"]


def test_a_local_write_survives_a_deletion_taking_its_empty_folder(tmp_path, monkeypatch):
    """A deletion beside a write may take the write's folder between its
    ``mkdir`` and its temp file: the write makes the folder again."""
    store = LocalStore(tmp_path)
    mkstemp, taken = tempfile.mkstemp, []

    def folder_taken_once(dir, **kwargs):
        if not taken:
            taken.append(dir)
            os.rmdir(dir)
        return mkstemp(dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", folder_taken_once)
    store.put_bytes("run/round-1/a", b"x")
    assert taken and store.get_bytes("run/round-1/a") == b"x"


def test_delete_folder_deletes_each_marker_first_and_keeps_the_rest(store):
    """A folder deleted part way never reads as whole: every folder's marker
    goes before any of its other files; ``keep`` and other prefixes stay."""
    keys = ["ck/1/a", "ck/1/.metadata", "ck/2/b", "ck/2/.metadata", "ck/3/c", "ck/3/.metadata", "ckx/d"]
    for key in keys:
        store.put_bytes(key, b"x")
    deleted = []
    delete = store.delete
    store.delete = lambda key: (deleted.append(key), delete(key))
    store.delete_folder("ck", ".metadata", keep="ck/3")
    assert sorted(deleted) == ["ck/1/.metadata", "ck/1/a", "ck/2/.metadata", "ck/2/b"]
    assert {k for k in deleted[:2]} == {"ck/1/.metadata", "ck/2/.metadata"}
    assert store.list() == ["ck/3/.metadata", "ck/3/c", "ckx/d"]


def test_a_local_folder_deletion_takes_what_killed_writers_left_in_it(tmp_path):
    """A write killed before its rename leaves its temp file, which no listing
    shows; deleting the folder takes it too (it can be a whole shard), so the
    folder goes, while ``keep`` and other folders keep theirs."""
    store = LocalStore(tmp_path)
    for key in ["state/1/shard", "state/1/.metadata", "state/2/.metadata", "other/a"]:
        store.put_bytes(key, b"x")
    left = [tmp_path / "state/1/.shard.x1.partial", tmp_path / "state/1/sub/.y.x2.partial"]
    kept = [tmp_path / "state/2/.z.x3.partial", tmp_path / "other/.a.x4.partial"]
    for path in left + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
    store.delete_folder("state", ".metadata", keep="state/2")
    assert not (tmp_path / "state/1").exists()
    assert all(path.exists() for path in kept)
    assert store.list() == ["other/a", "state/2/.metadata"]


def tracefp4_folder(path, files: dict[str, bytes]):
    """A folder of ``files`` with its checksum manifest, as a step writes one."""
    tmp = path.with_name(path.name + "-tmp")
    tmp.mkdir()
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    return commit_folder(tmp, path)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_folder_uploaded_again_holds_the_new_files_alone(tmp_path, request, backend, monkeypatch):
    """A retried step uploads its output folder again to the same store
    folder (a round's trainer state, a TrainJob round's inputs). The files of
    the earlier upload that the new one lacks stayed there, and a fetch took
    them with it: here the earlier policy's generation config, which sets the
    rollout's sampling defaults. And an upload cut short left the earlier
    manifest vouching for files the new upload had replaced; with it gone,
    the earlier files the new upload had not yet replaced would mix with the
    new ones unchecked (a fetch of a folder without a manifest: the new
    config with the earlier weights here), so they go first."""
    uri = request.getfixturevalue("s3_env").uri(_prefix()) if backend == "s3" else (tmp_path / "store").as_uri()
    target = open_store(uri)
    earlier = tracefp4_folder(tmp_path / "a", {"model.safetensors": b"a" * 10, "generation_config.json": b"{}"})
    upload_folder(earlier, target)
    again = tracefp4_folder(tmp_path / "b", {"model.safetensors": b"b" * 12, "config.json": b'{"b": 1}'})
    monkeypatch.setattr(checkpoint, "TRANSFER_THREADS", 1)  # in name order: config.json, then the weights
    upload = target.upload

    def killed_after_one_file(key, path):
        monkeypatch.setattr(target, "upload", fail)
        upload(key, path)

    def fail(key, path):
        raise StoreError("killed")

    monkeypatch.setattr(target, "upload", killed_after_one_file)
    with pytest.raises(StoreError, match="killed"):
        upload_folder(again, target)
    assert target.list() == [UNFINISHED, "config.json"] and target.get_bytes("config.json") == b'{"b": 1}'
    monkeypatch.setattr(target, "upload", upload)
    upload_folder(again, target)
    assert target.list() == sorted(p.name for p in again.iterdir())
    fetched = fetch(uri, into=tmp_path / "fetched")
    assert sorted(p.name for p in fetched.iterdir()) == target.list()
    verify_folder(fetched)


def test_missing_key(store):
    with pytest.raises(ArtifactNotFound, match="nope/x.bin") as info:
        store.get_bytes("nope/x.bin")
    assert store.uri in str(info.value)
    assert isinstance(info.value, KeyError) and isinstance(info.value, StoreError)


def test_a_range_of_an_object_is_read_alone(store):
    """A guidance shard's header is read without its payload (get_range): the
    bytes asked for, fewer where the object ends first."""
    data = bytes(range(256)) * 40
    store.put_bytes("obj", data)
    assert store.get_range("obj", 0, 8) == data[:8]
    assert store.get_range("obj", 1000, 300) == data[1000:1300]
    assert store.get_range("obj", len(data) - 5, 100) == data[-5:]
    with pytest.raises(ArtifactNotFound):
        store.get_range("nope", 0, 8)


def test_download_streams_to_a_file_and_stat(store, tmp_path):
    data = os.urandom(6 * MiB + 7)  # more than one part and one download chunk
    store.put_bytes("dir/big.bin", data)
    target = tmp_path / "out" / "big.bin"
    store.download("dir/big.bin", target)
    assert hashlib.sha256(target.read_bytes()).digest() == hashlib.sha256(data).digest()
    size, tag = store.stat("dir/big.bin")
    assert size == len(data) and tag
    store.put_bytes("dir/big.bin", data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped: never the same bytes
    if isinstance(store, S3Store):  # the ETag follows the content (a file's mtime may not tick between writes)
        assert store.stat("dir/big.bin")[1] != tag
    with pytest.raises(ArtifactNotFound, match="nope.bin"):
        store.download("nope.bin", tmp_path / "out" / "nope.bin")
    with pytest.raises(ArtifactNotFound, match="nope.bin"):
        store.stat("nope.bin")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["big.bin"]  # no temp file left behind


def test_upload_streams_a_file_without_holding_it(store, tmp_path):
    """What the TrainJob launcher and the distributed checkpoints upload can outgrow
    the pod's memory: ``upload`` holds a part (5 MiB here) or a copy chunk, not the file."""
    data = os.urandom(40 * MiB + 5)
    source = tmp_path / "state.safetensors"
    source.write_bytes(data)
    del data
    tracemalloc.start()
    try:
        store.upload("run/state/tensors.safetensors", source)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 * MiB, peak
    assert store.get_bytes("run/state/tensors.safetensors") == source.read_bytes()
    with pytest.raises(StoreError, match="nope.bin"):
        store.upload("run/nope.bin", tmp_path / "nope.bin")
    assert store.list("run/") == ["run/state/tensors.safetensors"]
    if isinstance(store, LocalStore):  # list hides a local write's temp files: none left on disk either
        assert [p.name for p in (store.root / "run").rglob("*")] == ["state", "tensors.safetensors"]


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "a//b", "./a", "a/", "a\\b"])
def test_bad_keys(store, key):
    with pytest.raises(ValueError, match="key"):
        store.put_bytes(key, b"x")
    with pytest.raises(ValueError, match="key"):
        store.get_bytes(key)


def test_s3_parts_grow_so_that_no_object_needs_more_than_10000(s3_server):
    store = s3_server.store(_prefix(), part_size=16 * MiB)
    assert store._part_size(12 * MiB) == 16 * MiB
    assert store._part_size(280 * 10**9) == 27 * MiB  # a 35B model's AdamW moments: 26.7 MiB parts
    assert -(-280 * 10**9 // store._part_size(280 * 10**9)) <= 10_000


def test_s3_multipart_upload(s3_server):
    store = s3_server.store(_prefix(), part_size=5 * MiB)
    data = os.urandom(12 * MiB + 123)
    store.put_bytes("big.bin", data)
    # 3 parts of <= 5 MiB: S3 multipart ETags end in "-<parts>"
    stat = store._client.stat_object(s3_server.bucket, f"{store.prefix}/big.bin")
    assert stat.etag.endswith("-3") and stat.size == len(data)
    assert hashlib.sha256(store.get_bytes("big.bin")).digest() == hashlib.sha256(data).digest()


def test_bad_uris(tmp_path):
    for uri in ["gs://bucket/x", "http://host/x", "ftp://h"]:
        with pytest.raises(ValueError, match="unsupported store URI") as info:
            open_store(uri)
        assert uri in str(info.value) and "s3://bucket/prefix" in str(info.value)
    with pytest.raises(ValueError, match="file:///absolute/path"):
        open_store("file://host/x")
    with pytest.raises(ValueError, match="bad store URI 's3://b/a/../c'"):
        open_store("s3://b/a/../c", env={})
    with pytest.raises(ValueError, match="s3://bucket"):
        open_store("s3:///only-prefix", env={})
    with pytest.raises(ValueError, match="bad store URI 's3://x/p': invalid bucket name x"):
        open_store("s3://x/p", env={})
    with pytest.raises(ValueError) as info:
        open_store("s3://AKIA:hunter2@bucket/p", env={})
    assert "hunter2" not in str(info.value)
    # nor under a scheme it does not serve, or a file URI's host, whose errors echo the URI
    # a secret holding '/' (as AWS secret keys may) ends urlsplit's host part before the '@'
    slashed = ["s3://AKIA:hunt/er2@bucket/p", "https://AKIA:hunt/er2@minio:9000/b", "file://AKIA:hunt/er2@host/x"]
    for uri in [
        "https://AKIA:hunter2@minio:9000/bucket",
        "gs://AKIA:hunter2@bucket/p",
        "file://AKIA:hunter2@host/x",
    ] + slashed:
        with pytest.raises(ValueError, match="store URIs must not carry credentials") as info:
            open_store(uri)
        assert "hunter2" not in str(info.value) and "hunt/" not in str(info.value), uri
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert open_store(tmp_path.as_uri()).uri == tmp_path.as_uri()


def test_a_file_uri_names_the_folder_its_store_and_checkpoints_use(tmp_path):
    """``Path.as_uri`` percent-encodes (a space is %20), and a local run's store
    URI is made that way: the store wrote under a folder named ``My%20Runs``
    while checkpoint fetches read ``My Runs``."""
    folder = tmp_path / "My Runs" / "store"
    uri = LocalStore(folder).uri
    assert "%20" in uri and open_store(uri).root == folder
    open_store(uri).put_bytes("run/policy/config.json", b"{}")
    assert fetch(uri + "/run/policy") == folder / "run" / "policy" and (folder / "run/policy/config.json").exists()
    assert fetch("file://localhost" + folder.as_uri().removeprefix("file://")) == folder
    with pytest.raises(ValueError, match="bad file URI 'file://host/x'"):
        fetch("file://host/x")  # not the relative folder host/x
    # a local run's relative store, percent-encoded or at localhost, lands where the store then writes
    from tracefp4.pipelines.local import localize
    from tracefp4.schemas import get_preset

    smoke = get_preset("smoke")
    at = lambda uri: smoke.model_copy(update={"store": smoke.store.model_copy(update={"uri": uri})})  # noqa: E731
    localhost = "file://localhost" + folder.as_uri().removeprefix("file://")  # not <output>/localhost/...
    for uri, where in (("file://./My%20Runs/s", tmp_path / "My Runs" / "s"), (localhost, folder)):
        assert open_store(localize(at(uri), tmp_path).store.uri).root == where


def test_missing_env_names_variable(s3_server):
    with pytest.raises(StoreError, match="TRACEFP4_S3_ENDPOINT") as info:
        open_store("s3://bucket/p", env={})
    assert "s3://bucket/p" in str(info.value)
    with pytest.raises(StoreError, match="TRACEFP4_S3_ACCESS_KEY"):
        open_store("s3://bucket/p", env={"TRACEFP4_S3_ENDPOINT": s3_server.endpoint})
    with pytest.raises(StoreError, match="TRACEFP4_S3_SECRET_KEY"):
        open_store("s3://bucket/p", env={"TRACEFP4_S3_ENDPOINT": s3_server.endpoint, "TRACEFP4_S3_ACCESS_KEY": "k"})
    with pytest.raises(StoreError, match="host:port") as info:
        open_store(
            "s3://bucket/p", env=dict(s3_server.env, TRACEFP4_S3_ENDPOINT=f"http://u:pw1234@{s3_server.endpoint}")
        )
    assert "pw1234" not in str(info.value)


def test_env_from_process_and_aws_fallback(s3_env, monkeypatch):
    store = open_store(s3_env.uri(_prefix()))  # os.environ, set by the s3_env fixture
    store.put_bytes("k", b"v")
    for name in s3_env.env:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3_env.endpoint}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_env.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.secret_key)
    assert open_store(store.uri.replace("s3://", "minio://")).get_bytes("k") == b"v"


def test_missing_bucket_is_an_error_unless_create_bucket(s3_server):
    """The run's store names store.create_bucket; a bucket no setting creates (a checkpoint's) does not."""
    bucket = f"fresh-{uuid.uuid4().hex[:8]}"
    missing = f"s3://{bucket}/p: bucket '{bucket}' does not exist at http://{s3_server.endpoint}; check its name"
    with pytest.raises(StoreError) as info:
        open_store(f"s3://{bucket}/p", env=s3_server.env, create_bucket=False)
    assert str(info.value) == f"{missing}, or set store.create_bucket: true to create it"
    with pytest.raises(StoreError) as info:
        open_store(f"s3://{bucket}/p", env=s3_server.env)
    assert str(info.value) == missing
    assert not s3_server.store()._client.bucket_exists(bucket)  # nothing was created
    store = open_store(f"s3://{bucket}/p", env=s3_server.env, create_bucket=True)
    assert isinstance(store, S3Store)
    store.put_bytes("k", b"v")
    assert open_store(f"s3://{bucket}/p", env=s3_server.env).list() == ["k"]  # it exists now: no flag needed


def test_an_endpoint_that_answers_but_not_as_s3_says_so():
    """A web server's page where S3 answers in XML (a wrong port, a proxy): a loopback HTTP server answering
    every request with an HTML 404."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html><body>Not Found</body></html>")

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    env = {"TRACEFP4_S3_ENDPOINT": endpoint, "TRACEFP4_S3_ACCESS_KEY": "a", "TRACEFP4_S3_SECRET_KEY": "b"}
    try:
        with pytest.raises(StoreError, match=f"no S3 answer: is {endpoint} the S3 server's address"):
            open_store("s3://bucket/p", env=env, retries=0)
    finally:
        server.shutdown()
        server.server_close()


def test_https_endpoint_on_a_plain_http_server_says_so(s3_server):
    env = dict(s3_server.env, TRACEFP4_S3_ENDPOINT=f"https://{s3_server.endpoint}", TRACEFP4_S3_SECURE="")
    start = time.monotonic()
    with pytest.raises(StoreError) as info:
        open_store(s3_server.uri("p"), env=env, retries=5, backoff_s=1.0)
    assert time.monotonic() - start < 3.0  # a handshake does not heal: not retried
    assert str(info.value).startswith(
        f"{s3_server.uri('p')}: open bucket failed: https endpoint https://{s3_server.endpoint} answered without "
        f"TLS, most likely plain HTTP: use http://{s3_server.endpoint} (or TRACEFP4_S3_SECURE=0), or fix the "
        "server's TLS ("
    )
    env["TRACEFP4_S3_SECURE"] = "0"  # the same endpoint with TLS turned off works
    assert open_store(s3_server.uri("p"), env=env).uri == s3_server.uri("p")


def test_untrusted_certificate_says_so(s3_server, tmp_path):
    cert, key = _self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def handshake():  # a TLS server whose certificate the client does not trust
            conn, _ = listener.accept()
            with contextlib.suppress(ssl.SSLError, OSError):
                context.wrap_socket(conn, server_side=True).close()
            conn.close()

        thread = threading.Thread(target=handshake, daemon=True)
        thread.start()
        env = dict(s3_server.env, TRACEFP4_S3_ENDPOINT=f"https://127.0.0.1:{port}", TRACEFP4_S3_SECURE="")
        with pytest.raises(
            StoreError,
            match=rf"the TLS certificate of https://127.0.0.1:{port} is not trusted: "
            r"set SSL_CERT_FILE to the CA bundle that signed it, or in a cluster run store.ca_bundle_secret "
            r"\(.*CERTIFICATE_VERIFY_FAILED",
        ):
            open_store("s3://bucket/p", env=env, retries=0)
        thread.join(10)


def _self_signed(folder):
    """A certificate for 127.0.0.1 signed by itself, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return folder / "cert.pem", folder / "key.pem"


def test_wrong_credentials_fail_fast_without_leaking(s3_server):
    secret = "wrong-secret-" + uuid.uuid4().hex
    env = dict(s3_server.env, TRACEFP4_S3_SECRET_KEY=secret)
    start = time.monotonic()
    with pytest.raises(StoreError) as info:
        open_store(s3_server.uri("p"), env=env, retries=5, backoff_s=1.0)
    assert time.monotonic() - start < 3.0  # not retried
    message = str(info.value)
    assert "SignatureDoesNotMatch" in message or "AccessDenied" in message
    assert s3_server.uri("p") in message
    if "SignatureDoesNotMatch" in message:  # SeaweedFS's answer: which settings to check
        assert "the server refuses the credentials: check TRACEFP4_S3_ACCESS_KEY and TRACEFP4_S3_SECRET_KEY" in message
    for text in (message, repr(info.value), str(info.value.__cause__)):
        assert secret not in text

    bad_key = dict(s3_server.env, TRACEFP4_S3_ACCESS_KEY="nobody-" + uuid.uuid4().hex)
    with pytest.raises(StoreError, match="InvalidAccessKeyId|AccessDenied") as info:
        open_store(s3_server.uri("p"), env=bad_key)
    assert s3_server.secret_key not in str(info.value)

    store = s3_server.store("p")
    for text in (repr(store), str(store), store.uri):
        assert s3_server.secret_key not in text


def test_a_short_secret_hides_in_the_servers_words_alone():
    """KFP's default credentials (minio / minio123): the secret key is hidden
    where an error's own text holds it, and nothing of what tracefp4 writes
    around it (the URI, the endpoint, its hints) is cut where it holds the
    secret's or the access key's letters, which are no secret (every signed
    request names the access key)."""
    env = {
        "TRACEFP4_S3_ENDPOINT": "minio-service.kubeflow.invalid:9000",
        "TRACEFP4_S3_ACCESS_KEY": "minio",
        "TRACEFP4_S3_SECRET_KEY": "minio123",
        "TRACEFP4_S3_SECURE": "0",
    }
    with pytest.raises(StoreError) as info:
        open_store("minio://mlpipeline/tracefp4", env=env, retries=0)
    message = str(info.value)
    assert message.startswith("minio://mlpipeline/tracefp4: open bucket failed after 1 attempts")
    assert "(the host of http://minio-service.kubeflow.invalid:9000 does not resolve" in message
    assert "***" not in message


def test_a_secret_is_hidden_where_it_stands_alone_not_inside_other_words():
    """A one-letter secret key cut the host name in a resolver's error
    (``seaweedfs.ku***eflow``); a secret echoed as a word of its own is hidden."""
    env = {
        "TRACEFP4_S3_ENDPOINT": "seaweedfs.kubeflow.invalid:8333",
        "TRACEFP4_S3_ACCESS_KEY": "a",
        "TRACEFP4_S3_SECRET_KEY": "b",
    }
    with pytest.raises(StoreError) as info:
        open_store("s3://bucket/p", env=env, retries=0)
    assert "seaweedfs.kubeflow.invalid" in str(info.value) and "***" not in str(info.value)
    assert "check the run config's store.endpoint, else TRACEFP4_S3_ENDPOINT" in str(info.value)
    echoed = "signed with b, in http://a:b@host and Cookie: b; kubeflow"
    assert hide_secrets(echoed, ["b", ""]) == "signed with ***, in http://a:***@host and Cookie: ***; kubeflow"
    assert hide_secrets("x=s3cr+t/", ["s3cr+t/"]) == "x=***"  # a secret's own signs are matched as they are


def test_server_down_gives_up_then_retries_across_restart(s3_server, caplog):
    store = s3_server.store(_prefix(), retries=2, backoff_s=0.01)
    # attempts at 0, 0.05, 0.15, ... 3.15, 6.35, 11.35, 16.35, 21.35 s: covers a restart, even one
    # where the server waits ~5 s for its volumes to register on a machine that another test file shares
    patient = s3_server.store(store.prefix, retries=10, backoff_s=0.05)
    data = os.urandom(MiB)
    caplog.set_level(logging.WARNING, logger="tracefp4.store")
    s3_server.stop()
    try:
        # down, small budget: gives up quickly and says how many attempts failed
        start = time.monotonic()
        with pytest.raises(StoreError, match=r"put 'x.bin' failed after 3 attempts; last error: .*refused") as info:
            store.put_bytes("x.bin", b"x")
        assert f"(nothing answers at http://{s3_server.endpoint}: is the S3 server up" in str(info.value)
        with pytest.raises(StoreError, match=r"open bucket failed after 3 attempts"):
            s3_server.store("p", retries=2, backoff_s=0.01)
        assert time.monotonic() - start < 3.0
        assert "attempt 2/3 failed" in caplog.text

        # down, then back while the put is retrying: it completes
        errors = []
        thread = threading.Thread(target=_capture, args=(errors, patient.put_bytes, "y.bin", data))
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive()  # still retrying: the server is down
        s3_server.start()
        thread.join(30)
        assert not thread.is_alive() and errors == []
    finally:
        if not s3_server.running:
            s3_server.start()
    assert store.get_bytes("y.bin") == data
    assert "x.bin" not in store.list()
    assert "attempt 1/11 failed" in caplog.text
    assert s3_server.secret_key not in caplog.text


def _capture(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:  # reported by the main thread
        errors.append(e)


def test_restart_keeps_data(s3_server):
    store = s3_server.store(_prefix())
    store.put_bytes("kept.bin", b"persistent")
    s3_server.restart()
    assert store.get_bytes("kept.bin") == b"persistent"


def test_local_readers_never_see_partial_objects(tmp_path):
    store = LocalStore(tmp_path)
    versions = [os.urandom(8 * MiB) for _ in range(3)]
    digests = {hashlib.sha256(v).digest() for v in versions}
    seen = {"missing": 0, "full": 0, "bad": 0}
    done = threading.Event()

    def reader():
        while not done.is_set():
            try:
                data = store.get_bytes("shard.bin")
            except ArtifactNotFound:
                seen["missing"] += 1
                continue
            seen["full" if hashlib.sha256(data).digest() in digests else "bad"] += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        time.sleep(0.05)
        for _ in range(3):
            for v in versions:
                store.put_bytes("shard.bin", v)
        time.sleep(0.05)
    finally:
        done.set()
        thread.join(30)
    assert seen["bad"] == 0
    assert seen["missing"] > 0 and seen["full"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["shard.bin"]  # no temp file left behind (list hides them)


def test_a_local_write_syncs_the_file_then_the_folder_that_names_it(tmp_path, monkeypatch):
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd))
    LocalStore(tmp_path).put_bytes("run/shard.bin", b"x")
    assert len(synced) == 2 and synced[0].startswith(str(tmp_path / "run" / ".shard.bin."))  # the temp file's data
    assert synced[1] == str(tmp_path / "run")  # then the rename, after it


def test_a_runs_folders_lose_their_markers_before_anything_else(tmp_path):
    """``runs clean`` deletes a run's folders of every kind at once: each one's
    marker (a checkpoint's checksums, a guidance step's manifest, a sharded
    checkpoint's .metadata) goes before any other file, so that a deletion cut
    short never leaves a folder that reads as whole without its files."""
    from tracefp4.pipelines.clean import FOLDER_MARKERS

    store = LocalStore(tmp_path)
    folders = {"policy": "checksums.json", "guidance/step-000000": "manifest.json", "ckpt/step-000001": ".metadata"}
    keys = [f"{folder}/{name}" for folder, marker in folders.items() for name in ("a.bin", marker, "b.bin")]
    for key in keys:
        store.put_bytes(key, b"x")
    order = []
    delete = store.delete
    store.delete = lambda key: order.append(key) or delete(key)
    store.delete_keys(keys, FOLDER_MARKERS)
    markers = {f"{folder}/{marker}" for folder, marker in folders.items()}
    assert set(order[: len(markers)]) == markers and sorted(order) == sorted(keys) and not store.list("")
