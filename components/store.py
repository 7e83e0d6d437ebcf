"""Artifact store for guidance shards and checkpoints passed between pipeline
steps: a local folder or an S3 bucket (MinIO, SeaweedFS, AWS) behind one small
interface. Writes are atomic, and S3 calls retry transient failures a bounded
number of times, so a flaky object store slows a step down instead of breaking it.
A bucket that does not exist is an error unless asked to create it, so a typo
in its name does not scatter a run's artifacts into a new bucket; a server that
cannot be reached, or that does not speak the TLS the endpoint asks for, fails
naming the endpoint and the likely cause.
"""

import contextlib
import errno
import io
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import BinaryIO, TypeVar
from urllib.parse import unquote, urlsplit

import certifi
import urllib3
from minio import Minio
from minio.error import InvalidResponseError, S3Error, ServerError
from minio.helpers import check_bucket_name

log = logging.getLogger("tracefp4.store")

T = TypeVar("T")
_TMP_SUFFIX = ".partial"  # temp files of atomic writes: ".<name>.<random>.partial"
_MAX_BACKOFF_S = 5.0
_MIN_PART = 5 * 2**20  # S3's smallest multipart part
_MAX_PARTS = 10_000  # S3's most parts of one object
_CHUNK = 2**20  # download buffer: a multi-GB object streams to disk, it is never held in memory
_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout"}
# what S3 answers a request signed with an access key it does not know, or with another secret key
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch"}
# what OpenSSL says when the other side answers a TLS hello with something else, plain HTTP most likely
_NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "UNKNOWN_PROTOCOL")
# The variables the S3 client reads besides the credentials; a cluster run's pods get them from the run config's
# store section (schemas/config.py, StoreConfig.pod_environment)
ENDPOINT_ENV, REGION_ENV = "TRACEFP4_S3_ENDPOINT", "TRACEFP4_S3_REGION"
CA_BUNDLE_ENV = "SSL_CERT_FILE"  # the CA bundle the client trusts instead of certifi's (OpenSSL's name for it)
_TRANSIENT_ERRORS = (
    urllib3.exceptions.TimeoutError,  # connect/read timeouts, connection refused
    urllib3.exceptions.ProtocolError,  # connection reset or dropped mid-response
    ConnectionError,
    TimeoutError,
)


def hide_secrets(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each of ``secrets`` that stands as a word of its own
    replaced by ``***``: an error may echo a credential it was sent, and a
    short one (KFP's default S3 secret minio123, a one-letter test key) must
    not cut the host names and words that happen to hold its letters."""
    for secret in filter(None, secrets):
        text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", "***", text)
    return text


class StoreError(RuntimeError):
    """A store operation failed; the message names the store URI and the key."""


class ArtifactNotFound(StoreError, KeyError):
    """The key does not exist in the store."""

    __str__ = RuntimeError.__str__  # KeyError would quote the message


def check_key(key: str, *, allow_empty: bool = False) -> str:
    """Return ``key`` if it is a safe relative key ("a/b.bin"), else raise ValueError."""
    if not isinstance(key, str):
        raise ValueError(f"store key must be a str, got {type(key).__name__}")
    if not key:
        if allow_empty:
            return key
        raise ValueError("store key must not be empty")
    if key.startswith("/") or "\\" in key or "\0" in key:
        raise ValueError(f"bad store key {key!r}: keys are relative, '/'-separated, without '\\' or NUL")
    parts = key.split("/")
    for i, part in enumerate(parts):
        if part in ("", ".", ".."):
            if part == "" and i == len(parts) - 1 and allow_empty:
                continue  # a prefix may end with "/"
            raise ValueError(f"bad store key {key!r}: no empty, '.' or '..' path segments")
        if part.startswith(".") and part.endswith(_TMP_SUFFIX):
            raise ValueError(f"bad store key {key!r}: '.*{_TMP_SUFFIX}' names are reserved for temp files")
    return key


def write_atomic(path: Path, fill: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through a temp file in its folder: fsync, rename into
    place, fsync the folder (so the new name, not only the data, survives a crash)."""
    for attempt in range(3):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TMP_SUFFIX)
            break
        except FileNotFoundError:  # a deletion beside it took the folder while it was empty (LocalStore.delete)
            if attempt == 2:
                raise
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Put a folder's entries on disk (fsync of a file syncs its data, not the name that points to it)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class NoRoom(OSError):
    """A write its filesystem has no room for, found before it starts."""


def ensure_room(folder: Path, needed: int, what: str) -> None:
    """Fail at once where ``folder``'s filesystem has fewer than ``needed``
    bytes free, naming both: at the paper's scale a policy (70 GB) or a
    trainer state (420 GB) takes many minutes to write or download, and a
    filesystem that fills up mid-way wastes them, and the same again at each
    of the step's retries, before it says no more than "No space left on device"."""
    usage = shutil.disk_usage(folder)
    free = usage.free
    if usage.total and needed > free:  # a filesystem that reports no size at all (some FUSE mounts) is not judged
        raise NoRoom(
            errno.ENOSPC,
            f"{what} needs {_size(needed)} at {folder}, but its filesystem has {_size(free)} free "
            '(a pipeline step\'s: the disk of its pod, docs/deploy.md, "Disk")',
        )


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / 1e9:.1f} GB)"


# Where ArtifactStore.check_access writes its object, under the store's root
ACCESS_CHECK, ACCESS_CHECK_BYTES = ".access-check", b"tracefp4 checks that its steps can write here\n"


class ArtifactStore(ABC):
    """Keys are relative '/'-separated names under the store root ``uri``."""

    uri: str

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``; readers see the whole object or nothing."""

    @abstractmethod
    def upload(self, key: str, path: str | os.PathLike) -> None:
        """Store the file ``path`` under ``key``, streamed: memory holds one part,
        not the file (a trainer state can outgrow the pod's memory); readers see
        the whole object or nothing."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Return the object; ArtifactNotFound if it is missing."""

    @abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` (> 0) bytes of the object from ``offset`` (within it),
        fewer where it ends before; ArtifactNotFound if it is missing. A
        shard's header alone (:func:`~tracefp4.components.guidance.read_shard_tables`)."""

    @abstractmethod
    def download(self, key: str, path: str | os.PathLike) -> None:
        """Stream the object to the file ``path`` through a temp file beside it,
        renamed into place when complete; ArtifactNotFound if it is missing."""

    @abstractmethod
    def stat(self, key: str) -> tuple[int, str]:
        """The object's size in bytes and a tag that changes when it is rewritten
        (S3's ETag; a file's modification time); ArtifactNotFound if it is missing."""

    @abstractmethod
    def sizes(self, prefix: str = "") -> dict[str, int]:
        """The keys starting with ``prefix`` and their sizes in bytes, from one listing (S3's carries
        them: a run's thousand objects need no request each)."""

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys starting with ``prefix``."""
        return sorted(self.sizes(prefix))

    def check_access(self) -> None:
        """Write, read back, list and delete an object of a few bytes under the
        root, as the steps will. A bucket answers that it exists to credentials
        that may not write under the run's prefix (multi-user Kubeflow gives a
        profile's S3 user a few prefixes of its bucket alone): found here, by a
        run's first task, instead of by its first GPU step."""
        key = f"{ACCESS_CHECK}/{uuid.uuid4().hex}"
        self.put_bytes(key, ACCESS_CHECK_BYTES)
        try:
            if self.get_bytes(key) != ACCESS_CHECK_BYTES or key not in self.list(f"{ACCESS_CHECK}/"):
                raise StoreError(f"{self.uri}/{key}: what was written does not read or list back")
        finally:
            self.delete(key)

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing one is no error."""

    def delete_folder(self, prefix: str, marker: str, keep: str | None = None) -> None:
        """Delete the keys under ``prefix`` (but those under ``keep``), each
        folder's ``marker`` (the file that says the folder is whole: a
        manifest, a checkpoint's ``.metadata``) first, so that a half-deleted
        folder is never read as whole."""
        keys = [k for k in self.list(prefix.rstrip("/") + "/") if keep is None or not k.startswith(keep + "/")]
        self.delete_keys(keys, (marker,))

    def delete_keys(self, keys: Iterable[str], markers: tuple[str, ...]) -> None:
        """Delete ``keys``, every folder's marker (any of ``markers``: a run's
        folders have each their own kind) first (:meth:`delete_folder`)."""
        for key in sorted(keys, key=lambda k: k.rpartition("/")[2] not in markers):
            self.delete(key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


class LocalStore(ArtifactStore):
    """A folder; a key "a/b" is the file ``root/a/b``."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).absolute()
        self.uri = self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _error(self, op: str, key: str, e: OSError) -> StoreError:
        return StoreError(f"{self.uri}: {op} {key!r} failed: {e}")

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            write_atomic(path, lambda f: f.write(data))
        except OSError as e:
            raise self._error("put", key, e) from e

    def upload(self, key: str, path: str | os.PathLike) -> None:
        target = self._path(key)
        try:
            with open(path, "rb") as src:
                write_atomic(target, lambda f: shutil.copyfileobj(src, f, _CHUNK))
        except OSError as e:
            raise self._error("upload", key, e) from e

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ArtifactNotFound(f"{self.uri}: no artifact {key!r}") from None
        except OSError as e:
            raise self._error("get", key, e) from e

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(length)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ArtifactNotFound(f"{self.uri}: no artifact {key!r}") from None
        except OSError as e:
            raise self._error("get", key, e) from e

    def download(self, key: str, path: str | os.PathLike) -> None:
        try:
            src = open(self._path(key), "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ArtifactNotFound(f"{self.uri}: no artifact {key!r}") from None
        except OSError as e:
            raise self._error("download", key, e) from e
        try:
            with src:
                write_atomic(Path(path), lambda f: shutil.copyfileobj(src, f, _CHUNK))
        except OSError as e:
            raise self._error("download", key, e) from e

    def stat(self, key: str) -> tuple[int, str]:
        path = self._path(key)
        try:
            info = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise ArtifactNotFound(f"{self.uri}: no artifact {key!r}") from None
        if not path.is_file():
            raise ArtifactNotFound(f"{self.uri}: no artifact {key!r}")
        return info.st_size, str(info.st_mtime_ns)

    def sizes(self, prefix: str = "") -> dict[str, int]:
        check_key(prefix, allow_empty=True)
        start = self.root / prefix.rpartition("/")[0]  # deepest folder the prefix names
        found = {}
        for folder, _, files in os.walk(start):
            for name in files:
                if name.startswith(".") and name.endswith(_TMP_SUFFIX):
                    continue
                path = Path(folder, name)
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):  # deleted since the walk read its folder
                        found[key] = path.stat().st_size
        return found

    def delete(self, key: str) -> None:
        """Remove the file, and the folders that leaves empty up to the root: a
        folder stands while keys lie under it, as on S3, so that deleting a
        round's folder does not leave its empty tree behind at every round."""
        self._remove(self._path(key), key)

    def delete_folder(self, prefix: str, marker: str, keep: str | None = None) -> None:
        """:meth:`ArtifactStore.delete_folder`, and the temp files that killed
        writers left in the folder, which no listing shows: each can be as
        large as the object it was to become (a trainer state's shard), and
        the folder would stand for it. Nothing writes a folder being deleted."""
        super().delete_folder(prefix, marker, keep)
        folder = self._path(prefix.rstrip("/"))
        kept = None if keep is None else self._path(keep)
        for path in sorted(folder.rglob(f".*{_TMP_SUFFIX}")):
            if kept is None or not path.is_relative_to(kept):
                self._remove(path, path.relative_to(self.root).as_posix())

    def _remove(self, path: Path, key: str) -> None:
        """Remove the file at ``path`` (``key``'s), and the folders that leaves empty up to the root."""
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise self._error("delete", key, e) from e
        for folder in path.parents:
            if folder == self.root:
                break
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): the folders above it stand too
                break


def _s3_settings(uri: str, env: Mapping[str, str]) -> dict:
    """Endpoint, credentials and TLS flag from TRACEFP4_S3_* (or AWS_*) variables."""

    def need(name: str, fallback: str) -> str:
        value = env.get(name) or env.get(fallback)
        if not value:
            raise StoreError(f"{uri}: set {name} (or {fallback}) in the environment")
        return value

    endpoint = need(ENDPOINT_ENV, "AWS_ENDPOINT_URL")
    scheme, sep, hostport = endpoint.partition("://")
    if not sep:
        scheme, hostport = "", endpoint
    hostport = hostport.rstrip("/")
    if scheme not in ("", "http", "https") or not hostport or "/" in hostport or "@" in hostport:
        shown = "(not shown: it holds '@')" if "@" in endpoint else repr(endpoint)
        raise StoreError(f"{uri}: the S3 endpoint must be host:port or http(s)://host:port, got {shown}")
    secure = scheme == "https"
    flag = env.get("TRACEFP4_S3_SECURE", "").strip().lower()
    if flag:
        if flag not in ("1", "true", "yes", "0", "false", "no"):
            raise StoreError(f"{uri}: TRACEFP4_S3_SECURE must be 1/true/yes or 0/false/no, got {flag!r}")
        secure = flag in ("1", "true", "yes")
    return {
        "endpoint": hostport,
        "access_key": need("TRACEFP4_S3_ACCESS_KEY", "AWS_ACCESS_KEY_ID"),
        "secret_key": need("TRACEFP4_S3_SECRET_KEY", "AWS_SECRET_ACCESS_KEY"),
        "secure": secure,
        "region": env.get(REGION_ENV) or None,
    }


class S3Store(ArtifactStore):
    """A bucket plus optional prefix on an S3 server. A missing bucket is a
    StoreError unless ``create_bucket``: a typo must not write to a new bucket.
    ``create_bucket`` is the run's ``store.create_bucket``, which the error
    names where it is False; None where no setting creates the bucket (a
    checkpoint's, which is read)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        scheme: str = "s3",
        env: Mapping[str, str] | None = None,
        part_size: int = 16 * 2**20,
        retries: int = 5,
        backoff_s: float = 0.2,
        create_bucket: bool | None = None,
    ):
        if part_size < _MIN_PART:
            raise ValueError(f"part_size must be at least 5 MiB (S3's minimum part), got {part_size}")
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"retries and backoff_s must be >= 0, got {retries} and {backoff_s}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"{scheme}://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.part_size = part_size
        self.retries = retries
        self.backoff_s = backoff_s
        settings = _s3_settings(self.uri, os.environ if env is None else env)
        self.endpoint = f"{'https' if settings['secure'] else 'http'}://{settings['endpoint']}"
        self._secret = settings["secret_key"]  # the access key is no secret: every signed request names it
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=2.0, read=30.0),
            retries=False,  # the retry policy is ours (_call), and bounded
            maxsize=8,
            cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get(CA_BUNDLE_ENV) or certifi.where(),
        )
        self._client = Minio(**settings, http_client=http)
        if not self._call("open bucket", "", lambda: self._client.bucket_exists(self.bucket)):
            if not create_bucket:
                created = "" if create_bucket is None else ", or set store.create_bucket: true to create it"
                raise StoreError(
                    f"{self.uri}: bucket {bucket!r} does not exist at {self.endpoint}; check its name{created}"
                )
            self._call("create bucket", "", self._make_bucket)

    def _make_bucket(self) -> None:
        try:
            self._client.make_bucket(self.bucket)
        except S3Error as e:
            if e.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):  # another step won the race
                raise

    def _name(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _scrub(self, text: str) -> str:
        """An error's own text without the secret key (a client may echo what it sent); what tracefp4 adds
        around it (the URI, the endpoint, its hints) is left as it is."""
        return hide_secrets(text, [self._secret])

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient failures with capped exponential backoff."""
        where = f"{self.uri}: {op}" + (f" {key!r}" if key else "")
        attempts = self.retries + 1
        for attempt in range(attempts):
            try:
                return fn()
            except S3Error as e:
                if e.code == "NoSuchKey":
                    raise ArtifactNotFound(f"{self.uri}: no artifact {key!r}") from None
                reason = self._scrub(f"{e.code}: {e.message}")
                if e.code in _CREDENTIAL_CODES:
                    reason += (
                        "; the server refuses the credentials: check TRACEFP4_S3_ACCESS_KEY and "
                        "TRACEFP4_S3_SECRET_KEY (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY where those are unset)"
                    )
                if e.code not in _TRANSIENT_CODES and e.response.status < 500:
                    raise StoreError(f"{where} failed: {reason}") from e
            except (ServerError, InvalidResponseError) as e:
                # minio keeps the HTTP status of a non-XML answer only in _code
                status = e.status_code if isinstance(e, ServerError) else getattr(e, "_code", 0)
                reason = self._scrub(f"HTTP {status}: {e}")
                if isinstance(e, InvalidResponseError):  # S3 answers in XML; a web server, a proxy's page do not
                    reason += f" (no S3 answer: is {self.endpoint} the S3 server's address?)"
                if status < 500:
                    raise StoreError(f"{where} failed: {reason}") from e
            except urllib3.exceptions.SSLError as e:  # before _TRANSIENT_ERRORS: a handshake does not heal
                raise StoreError(f"{where} failed: {self._tls_problem(e)}") from e
            except _TRANSIENT_ERRORS as e:
                reason = self._scrub(f"{type(e).__name__}: {e}")
                if isinstance(e, urllib3.exceptions.NameResolutionError):
                    reason += (
                        f" (the host of {self.endpoint} does not resolve: check the run config's store.endpoint, "
                        f"else {ENDPOINT_ENV})"
                    )
                elif isinstance(e, urllib3.exceptions.ConnectTimeoutError):  # refused, or no answer at all
                    reason += f" (nothing answers at {self.endpoint}: is the S3 server up, and the endpoint right?)"
            if attempt + 1 < attempts:
                delay = min(self.backoff_s * 2**attempt, _MAX_BACKOFF_S)
                log.warning(
                    "%s: attempt %d/%d failed (%s); retrying in %.2f s", where, attempt + 1, attempts, reason, delay
                )
                time.sleep(delay)
        raise StoreError(f"{where} failed after {attempts} attempts; last error: {reason}")

    def _tls_problem(self, e: urllib3.exceptions.SSLError) -> str:
        """The TLS failure in words, with the endpoint and its likely cause."""
        text = self._scrub(str(e))
        if any(marker in text for marker in _NOT_TLS):
            plain = self.endpoint.replace("https://", "http://", 1)
            return (
                f"https endpoint {self.endpoint} answered without TLS, most likely plain HTTP: use {plain} "
                f"(or TRACEFP4_S3_SECURE=0), or fix the server's TLS ({text})"
            )
        if "CERTIFICATE_VERIFY_FAILED" in text:
            return (
                f"the TLS certificate of {self.endpoint} is not trusted: set {CA_BUNDLE_ENV} to the CA bundle "
                f"that signed it, or in a cluster run store.ca_bundle_secret ({text})"
            )
        return f"TLS with {self.endpoint} failed ({text})"

    def put_bytes(self, key: str, data: bytes) -> None:
        name = self._name(key)
        self._call(
            "put",
            key,
            lambda: self._client.put_object(
                self.bucket, name, io.BytesIO(data), len(data), part_size=self._part_size(len(data))
            ),
        )

    def _part_size(self, size: int) -> int:
        """``part_size``, or for an object of more than 10,000 such parts (S3's
        limit: 156 GiB at 16 MiB, less than a large trainer state) the whole MiB
        that makes 10,000."""
        return max(self.part_size, -(-size // (_MAX_PARTS * 2**20)) * 2**20)

    def upload(self, key: str, path: str | os.PathLike) -> None:
        name = self._name(key)

        def put() -> None:  # a retry reads the file from its start
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                # one part at a time: minio's parallel uploads queue every part read ahead, unbounded, so a file
                # read faster than the network takes it would end up whole in memory
                self._client.put_object(
                    self.bucket, name, f, size, part_size=self._part_size(size), num_parallel_uploads=1
                )

        try:
            self._call("upload", key, put)
        except StoreError:
            raise
        except OSError as e:  # the local side: a file we may not read
            raise StoreError(f"{self.uri}: upload {path} to {key!r} failed: {e}") from e

    def get_bytes(self, key: str) -> bytes:
        return self._get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._get(key, offset=offset, length=length)

    def _get(self, key: str, **part) -> bytes:
        """The object, or ``part`` of it (get_object's offset and length)."""
        name = self._name(key)

        def get() -> bytes:
            response = self._client.get_object(self.bucket, name, **part)
            try:
                return response.read()
            finally:
                response.close()
                response.release_conn()

        return self._call("get", key, get)

    def download(self, key: str, path: str | os.PathLike) -> None:
        name = self._name(key)

        def get() -> None:  # a retry starts a fresh temp file: a dropped connection leaves nothing behind
            response = self._client.get_object(self.bucket, name)
            try:  # urllib3 checks the length against Content-Length: a short body raises, and is retried
                write_atomic(Path(path), lambda f: shutil.copyfileobj(response, f, _CHUNK))
            finally:
                response.close()
                response.release_conn()

        try:
            self._call("download", key, get)
        except StoreError:
            raise
        except OSError as e:  # the local side: a full disk, a folder we may not write
            raise StoreError(f"{self.uri}: download {key!r} to {path} failed: {e}") from e

    def stat(self, key: str) -> tuple[int, str]:
        name = self._name(key)
        info = self._call("stat", key, lambda: self._client.stat_object(self.bucket, name))
        return info.size, info.etag

    def sizes(self, prefix: str = "") -> dict[str, int]:
        check_key(prefix, allow_empty=True)
        root = f"{self.prefix}/" if self.prefix else ""

        def listing() -> dict[str, int]:
            objects = self._client.list_objects(self.bucket, prefix=root + prefix, recursive=True)
            return {
                o.object_name[len(root) :]: o.size for o in objects if not o.is_dir and not o.object_name.endswith("/")
            }

        return self._call("list", prefix, listing)

    def delete(self, key: str) -> None:
        name = self._name(key)
        self._call("delete", key, lambda: self._client.remove_object(self.bucket, name))  # S3: missing is no error


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """The bucket and prefix of ``s3://bucket/prefix`` (or ``minio://``),
    checked as an S3 store needs them, without connecting (the run config
    validates a store URI with it): no credentials, query or fragment, a
    valid bucket name, a prefix of valid key segments."""
    parts = _without_credentials(uri)
    if not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"bad store URI {uri!r}: use {parts.scheme}://bucket/optional/prefix")
    prefix = parts.path.strip("/")
    try:
        check_key(prefix, allow_empty=True)
        check_bucket_name(parts.netloc)
    except ValueError as e:
        raise ValueError(f"bad store URI {uri!r}: {e}") from None
    return parts.netloc, prefix


def _without_credentials(uri: str):
    """``uri`` split (urlsplit); a ValueError that does not echo it where it carries credentials: an '@' in
    its host part, or after a host part with a ':' (a secret holding '/' ends urlsplit's host part early)."""
    parts = urlsplit(uri)
    if "@" in parts.netloc or (":" in parts.netloc and "@" in uri):  # do not echo the URI: it may hold credentials
        raise ValueError("store URIs must not carry credentials; set TRACEFP4_S3_ACCESS_KEY/_SECRET_KEY")
    return parts


def unexpanded_home(path: str) -> str:
    """What an error of a path not found adds where the path holds a ``~``: given in a setting
    (``model.checkpoint=~/x``), no shell expanded it."""
    return " (~ is no home folder here: write the folder's path)" if "~" in Path(path).parts else ""


def file_path(uri: str) -> Path:
    """The path a ``file://`` URI names, percent-decoded (``Path.as_uri``
    encodes a space as %20): ``file:///abs`` or ``file://localhost/abs``, and
    ``file://./relative`` (the schema's default store) from the working directory."""
    _without_credentials(uri)
    rest = uri.removeprefix("file://")
    rest = rest.removeprefix("localhost") if rest.startswith("localhost/") else rest
    if not rest.startswith(("/", "./")):
        raise ValueError(f"bad file URI {uri!r}: use file:///absolute/path or file://./relative/path")
    return Path(unquote(rest))


def open_store(
    uri: str,
    *,
    part_size: int = 16 * 2**20,
    retries: int = 5,
    backoff_s: float = 0.2,
    env: Mapping[str, str] | None = None,
    create_bucket: bool | None = None,
) -> ArtifactStore:
    """Open ``file:///path`` (or a plain path) as a LocalStore, ``s3://bucket/prefix``
    or ``minio://bucket/prefix`` as an S3Store. S3 settings come from ``env``,
    which defaults to ``os.environ`` (tests pass their own mapping); a missing
    bucket is an error unless ``create_bucket`` (the run store's
    store.create_bucket; None for a bucket no setting creates, such as a
    checkpoint's). A local folder is always created on the first write."""
    if "://" not in uri:
        if not uri:
            raise ValueError("empty store URI")
        return LocalStore(uri)
    parts = _without_credentials(uri)  # every error below echoes the URI
    if parts.scheme == "file":
        path = file_path(uri)
        if not path.is_absolute():
            raise ValueError(f"bad store URI {uri!r}: use file:///absolute/path")
        return LocalStore(path)
    if parts.scheme in ("s3", "minio"):
        bucket, prefix = parse_s3_uri(uri)
        return S3Store(
            bucket,
            prefix,
            scheme=parts.scheme,
            env=env,
            part_size=part_size,
            retries=retries,
            backoff_s=backoff_s,
            create_bucket=create_bucket,
        )
    raise ValueError(
        f"unsupported store URI {uri!r}: use file:///absolute/path, a plain path, "
        "s3://bucket/prefix or minio://bucket/prefix"
    )
