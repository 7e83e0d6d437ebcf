"""Starting a distributed train step on this machine: ``torchrun`` (torch.distributed.run)
with one rank of :mod:`.distributed` per process.

The train step hands over its inputs as files, runs torchrun as a child
process, streams its output into the step's log and reads the history rows
rank 0 wrote. torchrun watches its ranks: when one dies the others are
stopped and torchrun exits non-zero, naming the rank and its error (the
ranks' ``@record``; for a rank a signal killed, what the ranks printed last:
:func:`failure`); a rank that hangs trips the process group's timeout
(``train.timeout_seconds``). Either way the step fails with that text, never
hangs. A Kubeflow Trainer TrainJob (:mod:`tracefp4.pipelines.trainjob`)
starts the same program on a cluster.
"""

import json
import re
import subprocess
import sys
from collections import deque
from pathlib import Path

from tracefp4.schemas import RunConfig

from .distributed import DistributedError

MODULE = "tracefp4.components.distributed"
_TAIL = 120  # lines of torchrun's output kept for the error: its own account (about 45) and the ranks' before it
_RANK_LINES = 20  # the ranks' last lines in the error where a signal killed one
_TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} .*torch/distributed/elastic/")  # torchrun's own log lines (glog format)
# a collective that waited past the process group's timeout: gloo's words, and NCCL's watchdog's
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ms|Watchdog caught collective operation timeout")


def rank_arguments(
    config: str,
    policy: str,
    state: str,
    trajectories: str,
    guidance: str,
    round_stats: str,
    run_id: str,
    out: str,
    out_state: str,
    history: str,
    inputs: tuple[str, str, int] | None = None,
) -> list[str]:
    """The arguments of :func:`tracefp4.components.distributed.main` (paths or
    store URIs); ``inputs`` (the URI of the round's record of its inputs, that
    record's sha256, and how long to wait for it): the ranks wait for it
    before they read anything (:func:`tracefp4.components.distributed.wait_for_inputs`)."""
    return [
        *("--config", config, "--policy", policy, "--state", state, "--trajectories", trajectories),
        *("--guidance", guidance, "--round-stats", round_stats, "--run-id", run_id),
        *("--out", out, "--out-state", out_state, "--history", history),
        *(("--inputs", *map(str, inputs)) if inputs else ()),
    ]


def torchrun(
    config: RunConfig,
    policy: Path,
    state: Path,
    trajectories: Path,
    guidance: Path,
    out: Path,
    out_state: Path,
    workdir: Path,
    run_id: str,
    round_stats: dict,
    echo=print,
) -> list[dict]:
    """The train step over ``config.train.processes_per_node`` local processes;
    the new policy goes to ``out``, its trainer state to ``out_state``. Returns the history rows; raises
    :class:`DistributedError` with the failing rank's error."""
    if config.train.nodes != 1:
        raise DistributedError(f"torchrun starts one node; train.nodes is {config.train.nodes} (use a TrainJob)")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    files = {"config.json": config.model_dump_json(), "round_stats.json": json.dumps(round_stats)}
    for name, text in files.items():
        (workdir / name).write_text(text)
    history = workdir / "history.json"
    history.unlink(missing_ok=True)
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"),
        *("--nproc-per-node", str(config.train.processes_per_node), "--max-restarts", "0"),
        *("-m", MODULE),
        *rank_arguments(
            str(workdir / "config.json"),
            str(policy),
            str(state),
            str(trajectories),
            str(guidance),
            str(workdir / "round_stats.json"),
            run_id,
            str(out),
            str(out_state),
            str(history),
        ),
    ]
    tail: deque[str] = deque(maxlen=_TAIL)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        for line in process.stdout:
            tail.append(line.rstrip("\n"))
            echo(line.rstrip("\n"))
        code = process.wait()
    if code != 0:
        raise DistributedError(f"distributed training failed (torchrun exit {code}):\n{failure(list(tail))}")
    return json.loads(history.read_text())


def failure(lines: list[str]) -> str:
    """torchrun's account of the first failure (rank, exit code, error) from
    its last lines, or those lines when it printed none. A rank a signal
    killed (a C++ abort, such as gloo's on a broken or timed-out collective;
    the kernel's OOM killer) has no traceback there, only the signal: its
    reason is in what the ranks printed last, before torchrun's own lines,
    which then come first, and so do the other ranks' failures.

    A collective that timed out fails the rank that waited, not the one that
    hung: the account then says so first, and the other ranks' ends come
    with it (among the ranks torchrun stopped, the one waited for)."""
    for i, line in enumerate(lines):
        if "Root Cause" in line:
            account = lines[i:]
            signalled = any(re.search(r"Signal \d+ \(SIG\w+\) received", line) for line in account)
            timed_out = any(_COLLECTIVE_TIMEOUT.search(line) for line in account)
            if not (signalled or timed_out):
                return "\n".join(account)
            others = next((j for j, line in enumerate(lines[:i]) if line.startswith("Failures:")), i)
            if timed_out:
                waited = (
                    "a collective timed out (train.timeout_seconds): the root cause below is a rank that waited "
                    "for another, which hung; torchrun then stopped the ranks under Failures"
                )
                return "\n".join([waited, *lines[others:]])
            own = next((j for j, line in enumerate(lines) if _TORCHRUN_LOG.match(line)), i)
            last = [line for line in lines[max(0, own - _RANK_LINES) : own] if line.strip()]
            return "\n".join(["the ranks' last lines:", *last, *lines[others:]])
    return "\n".join(lines)
