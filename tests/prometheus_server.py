"""Pytest plugin: a real Pushgateway and Prometheus (the Debian packages that
``make install-dev`` (and so ``make test`` and .ci/run) install) on loopback, Prometheus scraping the
gateway every second with ``honor_labels`` as the cluster's config does, and evaluating the committed
alerting rules (``manifests/base/prometheus/alerts.yml``) every second.
Fixture: ``prometheus`` (one per session) with ``.pushgateway`` and ``.url``."""

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

BINARIES = ("prometheus", "prometheus-pushgateway")
RULES = Path(__file__).resolve().parents[1] / "manifests/base/prometheus/alerts.yml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def _wait_ready(url: str, process: subprocess.Popen, log: Path, deadline: float = 30) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}:\n{log.read_text()[-2000:]}")
        try:
            _get(url, timeout=1)
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {deadline} s:\n{log.read_text()[-2000:]}")


class Prometheus:
    """A Pushgateway and a Prometheus scraping it, with data under ``root``."""

    def __init__(self, root: Path):
        missing = [b for b in BINARIES if shutil.which(b) is None]
        if missing:
            raise RuntimeError(
                f"{', '.join(missing)} not on PATH: `make install-dev` installs the Debian packages "
                "(apt-get install prometheus prometheus-pushgateway)"
            )
        gateway_port, port = _free_port(), _free_port()
        self.pushgateway, self.url = f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{port}"
        config = root / "prometheus.yml"
        config.write_text(
            json.dumps(
                {  # JSON is YAML
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES)],
                    "scrape_configs": [
                        {
                            "job_name": "pushgateway",
                            "honor_labels": True,
                            "static_configs": [{"targets": [f"127.0.0.1:{gateway_port}"]}],
                        }
                    ],
                }
            )
        )
        self.processes = []
        for name, args, ready in (
            (
                "prometheus-pushgateway",
                [f"--web.listen-address=127.0.0.1:{gateway_port}", "--persistence.file="],
                f"{self.pushgateway}/-/ready",
            ),
            (
                "prometheus",
                [
                    f"--config.file={config}",
                    f"--storage.tsdb.path={root / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                f"{self.url}/-/ready",
            ),
        ):
            log = root / f"{name}.log"
            process = subprocess.Popen([name, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT)
            self.processes.append(process)
            try:
                _wait_ready(ready, process, log)
            except RuntimeError:
                self.stop()
                raise

    def query(self, promql: str) -> list[dict]:
        """An instant query's result vector (an error names the query)."""
        body = json.loads(_get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
        if body.get("status") != "success":
            raise AssertionError(f"{promql}: {body}")
        return body["data"]["result"]

    def wait_for(self, promql: str, deadline: float = 20) -> list[dict]:
        """The query's result once it is not empty (Prometheus scrapes every second)."""
        end = time.monotonic() + deadline
        while not (result := self.query(promql)) and time.monotonic() < end:
            time.sleep(0.5)
        return result

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.wait(10)


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory):
    for attempt in range(3):  # the ports are free when chosen, but another test file's process may take one first
        try:
            server = Prometheus(tmp_path_factory.mktemp("prometheus"))
            break
        except RuntimeError:
            if attempt == 2:
                raise
    yield server
    server.stop()
