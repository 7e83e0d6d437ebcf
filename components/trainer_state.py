"""The trainer-state artifact: what a trainer needs to continue besides the
policy's weights, kept out of the policy folder so that the policy stays a
clean Hugging Face checkpoint (a serving engine's ``*.safetensors`` glob sees
only weights) and so that a step that only reads the policy (rollout,
evaluation) never downloads optimizer moments.

A state folder holds its tensors (any named tensors: optimizer moments,
master weights) as :data:`TENSORS`, or above 2 GiB as numbered shards of it
with an index (:mod:`.tensor_files`, stem :data:`STEM`), :data:`META` (JSON: the run id, the policy
version, the digest of the policy folder it belongs to, and whatever else the
trainer records, e.g. optimizer groups) and the checksum manifest over both,
written atomically like a checkpoint. Reading checks the checksums and refuses,
naming both sides, a state of another run, of another policy version, or of
another policy folder (in a comparison the methods share a run id and step
count, so only the digest tells their states apart).
"""

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from torch import Tensor

from .checkpoint import (
    MANIFEST,
    CheckpointError,
    commit_folder,
    folder_digest,
    recommit,
    staging_folder,
    verify_folder,
)
from .tensor_files import TensorWriter, read_tensors, single_name

STEM = "state"
TENSORS = single_name(STEM)
META = "state.json"
_REQUIRED = ("run_id", "policy_version", "policy_sha256")


class StateMismatch(ValueError):
    """A trainer state that belongs to another run, policy version or policy folder."""


def save_state(
    path: str | os.PathLike,
    layout: Mapping[str, Tensor],
    values: Iterable[tuple[str, Tensor]],
    meta: dict,
    policy: str | os.PathLike,
) -> Path:
    """Write the tensors ``layout`` names (shapes and dtypes; meta tensors will
    do), whose ``values`` come in the same order and are let go file by file
    (:class:`~.tensor_files.TensorWriter`: a distributed trainer gathers them
    one at a time), and ``meta`` (which must name ``run_id`` and
    ``policy_version``) at ``path``, pinned to the policy folder ``policy`` (already saved)."""
    missing = [key for key in ("run_id", "policy_version") if key not in meta]
    if missing:
        raise ValueError(f"trainer state meta lacks {missing}")
    folder = Path(path)
    record = {**meta, "policy_sha256": folder_digest(policy)}
    with staging_folder(folder) as tmp:
        writer = TensorWriter(tmp, layout, STEM)
        for name, t in values:
            writer.add(name, t)
        writer.close()
        (tmp / META).write_text(json.dumps(record, indent=1))
        return commit_folder(tmp, folder, {key: record[key] for key in ("run_id", "policy_version")})


def read_meta(path: str | os.PathLike) -> dict:
    """A state folder's metadata, after its files were checked against the manifest."""
    folder = Path(path)
    if not (folder / MANIFEST).exists():
        raise FileNotFoundError(f"{folder / MANIFEST}: missing, so {folder} is not a trainer state")
    verify_folder(folder)
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder / META}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or any(key not in meta for key in _REQUIRED):
        raise CheckpointError(f"{folder / META}: must be an object with {list(_REQUIRED)}")
    return meta


def load_state(path: str | os.PathLike, policy: str | os.PathLike, run_id: str) -> tuple[dict[str, Tensor], dict]:
    """The tensors and metadata of the state at ``path``, refused unless it was
    saved by run ``run_id`` together with the policy folder ``policy``."""
    meta = check_state(path, policy, run_id)
    return state_tensors(path), meta


def state_tensors(path: str | os.PathLike) -> dict[str, Tensor]:
    """The tensors of the state at ``path`` (:func:`check_state` checks it first)."""
    return read_tensors(Path(path), STEM)


def check_state(path: str | os.PathLike, policy: str | os.PathLike, run_id: str | None) -> dict:
    """The metadata of the state at ``path``, its files checked against their
    checksums, refused unless it was saved by run ``run_id`` (None: any run)
    together with the policy folder ``policy``; no tensor is read (:func:`state_tensors`)."""
    folder = Path(path)
    meta = read_meta(folder)
    if run_id is not None and meta["run_id"] != run_id:
        raise StateMismatch(f"{folder}: trainer state of run {meta['run_id']!r}, this is run {run_id!r}")
    digest = folder_digest(policy)
    if meta["policy_sha256"] != digest:
        raise StateMismatch(
            f"{folder}: trainer state of policy version {meta['policy_version']} saved with another policy "
            f"folder than {policy} (manifest sha256 {meta['policy_sha256'][:12]}..., found {digest[:12]}...)"
        )
    return meta


def repin_state(
    source: str | os.PathLike, meta: dict, path: str | os.PathLike, policy: str | os.PathLike, run_id: str
) -> Path:
    """A copy of the state at ``source`` (``meta``: its metadata, as
    :func:`check_state` read it) at ``path``, its tensors as they are, of run
    ``run_id`` and pinned to the policy folder ``policy`` (a copy of the one
    it was saved with, taken on by that run): a continuation goes on from the
    state of the run it continues as a run of its own."""
    record = {**meta, "run_id": run_id, "policy_sha256": folder_digest(policy)}
    provenance = {"run_id": run_id, "policy_version": meta["policy_version"]}
    return recommit(Path(source), Path(path), provenance, {META: json.dumps(record, indent=1)})
