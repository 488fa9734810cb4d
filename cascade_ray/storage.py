"""Where a pipeline's outputs live: a local folder, or a URI on a ``pyarrow.fs`` filesystem.

``storage_path`` is either

- a local path (``~`` expanded, made absolute when the driver starts; Ray workers and jobs
  run in other working directories), kept as a :class:`pathlib.Path`; or
- a URI ``pyarrow.fs.FileSystem.from_uri`` understands: ``s3://bucket/prefix``,
  ``gs://bucket/prefix``, ``file:///abs/path`` (also ``hdfs://``, ``abfs://``), with query
  options kept (``s3://bucket/runs?endpoint_override=minio:9000``). It becomes a
  :class:`UriPath`, which has the few pathlib methods the pipeline uses, so the code that
  writes artifacts and summaries reads the same for both. Ray Train gets the URI string.

On a cluster of more than one machine every worker writes its checkpoints to
``storage_path`` and the driver reads them back, so it must be storage all nodes share:
:func:`check_shared_storage` refuses a path on a node-local filesystem there.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cascade_ray.errors import ConfigError, ConfigIssue, DataError
from cascade_ray.text import short_repr

# Schemes pyarrow.fs.FileSystem.from_uri resolves (Ray Train uses the same call).
URI_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
_URI = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>[^?]*)(?:\?(?P<query>.*))?$")

# Filesystem types (/proc/mounts) that every node can mount at the same path.
NETWORK_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "glusterfs",
        "afs",
        "wekafs",
        "panfs",
        "fuse.glusterfs",
        "fuse.ceph-fuse",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.juicefs",
        "fuse.mountpoint-s3",
        "fuse.sshfs",
        "fuse.rclone",
        "fuse.lustre",
    }
)
# ... and types that are certainly private to one machine.
LOCAL_FS_TYPES = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "zfs",
        "f2fs",
        "tmpfs",
        "ramfs",
        "overlay",
        "vfat",
        "exfat",
        "ntfs",
        "ntfs3",
    }
)

# URI query options that carry credentials (pyarrow's S3/GCS options): kept for the filesystem,
# never shown (str(), logs, summaries, error messages)
SECRET_OPTIONS = frozenset({"access_key", "secret_key", "session_token", "access_token", "credentials", "password"})
GLOB_CHARS = frozenset("*?[")

STORAGE_ACCESS_FIX = (
    "check the URI, and that this process (and the Ray workers, through runtime_env env_vars) can reach it: for "
    "s3:// set AWS_ENDPOINT_URL (S3-compatible servers), AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a profile / "
    "instance role) and AWS_DEFAULT_REGION; for gs:// GOOGLE_APPLICATION_CREDENTIALS or workload identity"
)

SHARED_STORAGE_FIX = (
    "point storage_path at storage every node reaches: s3://bucket/prefix, gs://bucket/prefix, or a "
    "shared (NFS, Lustre, ...) folder mounted at the same path on every node"
)


class UriPath:
    """A file or folder on a pyarrow filesystem, with the pathlib methods the pipeline uses.

    :attr:`uri` is the full URI, credentials included (what Ray Train's ``storage_path`` and
    ``pyarrow`` take); ``str()`` is the same URI without credentials (``user:secret@`` and
    the query's key/secret/token options), for logs, summaries and error messages. The
    filesystem is created on first use (``FileSystem.from_uri``), so building and joining
    paths needs no network; tests pass their own `fs`.
    """

    __slots__ = ("scheme", "path", "query", "auth", "_fs")

    def __init__(self, scheme: str, path: str, query: str = "", fs: pafs.FileSystem | None = None, *, auth: str = ""):
        self.scheme = scheme
        self.path = path.rstrip("/") or "/"
        self.query = query
        self.auth = auth  # "user:secret" of scheme://user:secret@bucket/..., "" when none
        self._fs = fs

    @property
    def fs(self) -> pafs.FileSystem:
        if self._fs is None:
            self._fs = pafs.FileSystem.from_uri(self.uri)[0]
        return self._fs

    @property
    def uri(self) -> str:
        """The full URI, credentials included: only for pyarrow and Ray, never for display."""
        return f"{self.scheme}://{self.auth + '@' if self.auth else ''}{self.path}" + (
            f"?{self.query}" if self.query else ""
        )

    def __str__(self) -> str:
        public = "&".join(o for o in self.query.split("&") if o and o.split("=", 1)[0] not in SECRET_OPTIONS)
        return f"{self.scheme}://{self.path}" + (f"?{public}" if public else "")

    def __repr__(self) -> str:
        return f"UriPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UriPath) and self.uri == other.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    def __truediv__(self, part: str) -> UriPath:
        return UriPath(self.scheme, f"{self.path}/{str(part).strip('/')}", self.query, self._fs, auth=self.auth)

    def _at(self, path: str) -> UriPath:
        return UriPath(self.scheme, path, self.query, self._fs, auth=self.auth)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> UriPath:
        head, sep, _ = self.path.rpartition("/")
        return self._at(head or "/") if sep else self  # a bucket is its own parent

    def _type(self) -> pafs.FileType:
        return self.fs.get_file_info(self.path).type

    def exists(self) -> bool:
        return self._type() != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self._type() == pafs.FileType.File

    def is_dir(self) -> bool:
        return self._type() == pafs.FileType.Directory

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        if not exist_ok and self.exists():
            raise FileExistsError(str(self))
        self.fs.create_dir(self.path, recursive=parents)

    def iterdir(self) -> Iterator[UriPath]:
        for info in self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True)):
            yield self._at(info.path)

    def rglob(self, pattern: str) -> Iterator[UriPath]:
        """Files anywhere below whose path relative to this folder matches `pattern` (``*`` spans ``/``)."""
        selector = pafs.FileSelector(self.path, recursive=True, allow_not_found=True)
        for info in self.fs.get_file_info(selector):
            rel = info.path[len(self.path) :].lstrip("/")
            if info.type == pafs.FileType.File and fnmatch.fnmatchcase(rel, pattern):
                yield self._at(info.path)

    def glob(self, pattern: str) -> Iterator[UriPath]:
        """Direct children whose name matches `pattern` (no ``/`` or ``**``)."""
        if "/" in pattern or "**" in pattern:
            raise ValueError(f"UriPath.glob matches names of direct children only, not {pattern!r}")
        return (child for child in self.iterdir() if fnmatch.fnmatchcase(child.name, pattern))

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as f:
            return f.read()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> int:
        self.fs.create_dir(self.parent.path, recursive=True)  # a no-op on object stores
        with self.fs.open_output_stream(self.path) as f:
            f.write(data)
        return len(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> int:
        return self.write_bytes(text.encode(encoding))

    def open(self, mode: str = "rb"):
        """Binary streams only: ``rb`` or ``wb``."""
        if mode == "rb":
            return self.fs.open_input_stream(self.path)
        if mode == "wb":
            self.fs.create_dir(self.parent.path, recursive=True)
            return self.fs.open_output_stream(self.path)
        raise ValueError(f"UriPath.open supports 'rb' and 'wb', not {mode!r}")

    def open_input_file(self) -> pa.NativeFile:
        """A random-access binary reader of the object (its ``size()`` known: one HEAD request on
        an object store); ``readinto`` fills a caller's buffer without an intermediate copy."""
        return self.fs.open_input_file(self.path)

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok and not self.exists():
            return
        self.fs.delete_file(self.path)


StorageDir = Path | UriPath


def parse_uri(uri: str, key: str = "storage_path") -> UriPath | None:
    """A :class:`UriPath` for ``scheme://...``, None for a plain local path.

    `key` is the config key or flag the URI came from, for the error.

    Raises:
        ConfigError: an unsupported scheme, a ``file://`` URI that is not absolute, or a
            URI without a bucket/host.
    """
    m = _URI.match(uri)
    if m is None:
        return None
    scheme, rest, query = m["scheme"].lower(), m["rest"], m["query"] or ""
    auth = ""
    if "@" in rest.split("/", 1)[0]:  # scheme://user:secret@bucket/...: kept apart, never shown
        auth, rest = rest.split("@", 1)
    shown = f"{scheme}://{rest}"
    if scheme not in URI_SCHEMES:
        raise ConfigError(
            [
                ConfigIssue(
                    key,
                    f"unsupported URI scheme {short_repr(scheme)} in {short_repr(shown)}",
                    f"use a local path or one of {', '.join(s + '://' for s in URI_SCHEMES)}",
                )
            ]
        )
    if scheme != "file" and any(part in (".", "..") for part in rest.split("/")):
        # an object store takes `..` as a literal key part while a reader may resolve it (file:// is
        # normalized below, as the local filesystem would): one URI naming two places is refused
        raise ConfigError(
            [
                ConfigIssue(
                    key,
                    f"{short_repr(shown)} has a '.' or '..' path segment",
                    "write the path without them, e.g. "
                    + ("file:///abs/runs" if scheme == "file" else f"{scheme}://bucket/runs"),
                )
            ]
        )
    if scheme == "file":
        # file:///abs/path (empty host) or file://localhost/abs/path
        path = rest[len("localhost") :] if rest.startswith("localhost/") else rest
        if not path.startswith("/"):
            raise ConfigError(
                [
                    ConfigIssue(
                        key,
                        f"{short_repr(shown)} is not an absolute file:// URI",
                        "write file:///absolute/path (three slashes)",
                    )
                ]
            )
        return UriPath("file", os.path.normpath(path), query)
    if not rest.strip("/"):
        raise ConfigError([ConfigIssue(key, f"{short_repr(shown)} names no bucket", f"write {scheme}://bucket/prefix")])
    return UriPath(scheme, rest.strip("/"), query, auth=auth)


def redact(text: str) -> str:
    """`text` with the credentials of any URI in it removed (``user:secret@`` and key/secret/token
    query options of a storage URI; ``user:secret@`` of any other, e.g. an MLflow ``https://`` tracking
    URI), for messages and files that quote a path as the user gave it."""

    def public(m: re.Match) -> str:
        try:
            uri = parse_uri(m.group(0))
        except ConfigError:
            uri = None
        return str(uri) if uri is not None else re.sub(r"^([^:]+://)[^/@?#]*@", r"\1", m.group(0))

    return re.sub(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+", public, text)


def as_storage(path: str | os.PathLike | StorageDir, key: str = "storage_path") -> StorageDir:
    """A folder or file named on the command line or in a record: a :class:`UriPath` for a URI,
    else a local :class:`Path` with ``~`` expanded."""
    if isinstance(path, UriPath):
        return path
    if isinstance(path, Path):
        return path.expanduser()
    return parse_uri(os.fspath(path), key) or Path(os.fspath(path)).expanduser()


def full_uri(path: StorageDir) -> str:
    """What Ray and pyarrow take: the full URI (credentials included), or the local path."""
    return path.uri if isinstance(path, UriPath) else str(path)


def read_table(path: StorageDir, **kwargs) -> pa.Table:
    """``pq.read_table`` of a local file or one on a pyarrow filesystem."""
    if isinstance(path, UriPath):
        return pq.read_table(path.path, filesystem=path.fs, **kwargs)
    return pq.read_table(path, **kwargs)


def write_table(table: pa.Table, path: StorageDir, row_group_rows: int | None = None) -> None:
    """``pq.write_table`` to a local file (parents created; written to a temporary name and renamed
    into place, so a reader never sees half a file) or one on a pyarrow filesystem (an object
    appears whole when its upload completes); `row_group_rows` rows per row group (None: pyarrow's)."""
    if isinstance(path, UriPath):
        with path.open("wb") as sink:
            pq.write_table(table, sink, row_group_size=row_group_rows)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, row_group_size=row_group_rows)
    tmp.rename(path)


def resolve_files(spec: str | os.PathLike, suffix: str = ".parquet") -> list[StorageDir]:
    """A file, every ``*<suffix>`` file under a folder or prefix, or the files a glob matches
    (``**`` spans folders), local or on a URI; sorted, so the row order is deterministic.
    Empty when nothing matches; files that are not regular (FIFOs, devices) are skipped in a
    folder or glob.

    Raises:
        DataError: `spec` names one local path that is not a regular file (FIFO, device, symlink loop).
    """
    where = as_storage(spec, "data.path")
    text = where.path if isinstance(where, UriPath) else str(where)
    if any(c in GLOB_CHARS for c in text):
        parts = text.split("/")
        fixed = next(i for i, part in enumerate(parts) if any(c in GLOB_CHARS for c in part))
        base_text, pattern = "/".join(parts[:fixed]) or "/", "/".join(parts[fixed:])
        if isinstance(where, UriPath):
            base = where._at(base_text)
            return sorted((f for f in base.rglob(pattern)), key=str)
        return sorted(Path(p) for p in glob.glob(text, recursive=True) if os.path.isfile(p))
    if isinstance(where, Path) and os.path.lexists(where) and not where.is_dir():
        reason = not_regular_reason(where)  # a FIFO, device or symlink loop: refused, never opened
        if reason is not None:
            raise DataError(f"{redact(str(where))!r} {reason}; point it at a .parquet file, a folder or a glob")
    if where.is_dir():
        if isinstance(where, UriPath):
            return sorted(where.rglob(f"*{suffix}"), key=str)
        return sorted(p for p in where.rglob(f"*{suffix}") if p.is_file())
    return [where] if where.is_file() else []


def not_regular_reason(path: StorageDir) -> str | None:
    """Why `path` is not a readable regular file (missing, a FIFO, a device, a folder, a symlink
    loop), or None. Only ``stat`` is used, never ``open``: opening a FIFO blocks until a writer
    appears. Objects on remote storage are always regular; only their absence is reported."""
    local = local_path(path)
    if local is None:
        return None if path.is_file() else "does not exist"
    try:
        mode = os.stat(local).st_mode  # follows symlinks: the target is what would be read
    except FileNotFoundError:
        return "does not exist (or is a dangling symlink)" if os.path.islink(local) else "does not exist"
    except OSError as exc:  # ELOOP (a symlink loop), EACCES on a parent folder, ...
        return f"cannot be inspected ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    kinds = {
        stat.S_ISDIR: "a folder",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
    }
    return (
        "is "
        + next((name for test, name in kinds.items() if test(mode)), "not a regular file")
        + ", not a regular file"
    )


def in_ray_job() -> bool:
    """True inside a ``ray job submit`` entrypoint (the job supervisor sets this)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def storage_root(storage_path: str) -> StorageDir:
    """``storage_path`` as an absolute local :class:`Path` or a :class:`UriPath`.

    Raises:
        ConfigError: a bad URI, or a relative local path inside a Ray job (it would land in
            the job's temporary copy of the working dir, which Ray deletes).
    """
    uri = parse_uri(storage_path)
    if uri is not None:
        return uri
    path = Path(storage_path).expanduser()
    if not path.is_absolute() and in_ray_job():
        raise ConfigError(
            [
                ConfigIssue(
                    "storage_path",
                    f"relative path {storage_path!r} inside a Ray job resolves into the job's temporary "
                    f"copy of the working dir ({Path.cwd()}), which Ray deletes after the job",
                    "give an absolute path (storage_path=/shared/cascade-runs) or a URI (s3://bucket/runs)",
                )
            ]
        )
    return path.resolve()


def is_node_local(path: StorageDir) -> bool:
    """True for a local path or ``file://`` URI (only shared if the folder is a shared mount)."""
    return isinstance(path, Path) or path.scheme == "file"


def local_path(path: StorageDir) -> Path | None:
    """The path on this machine for a local path or ``file://`` URI; None for remote storage."""
    if isinstance(path, Path):
        return path
    return Path(path.path) if path.scheme == "file" else None


def filesystem_type(path: Path, mounts_file: str = "/proc/mounts") -> str | None:
    """Type of the filesystem holding `path` (or its nearest existing parent), from /proc/mounts."""
    try:
        lines = Path(mounts_file).read_text().splitlines()
    except OSError:
        return None
    probe = Path(os.path.realpath(path))
    best, fstype = -1, None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].encode().decode("unicode_escape")  # /proc/mounts writes a space as \040
        if (probe == Path(mount) or Path(mount) in probe.parents) and len(mount) > best:
            best, fstype = len(mount), fields[2]
    return fstype


def check_shared_storage(
    path: StorageDir,
    *,
    hosts: int,
    may_add_nodes: bool,
    log: Callable[[str], None] = print,
    mounts_file: str = "/proc/mounts",
) -> None:
    """Refuse (or warn about) node-local storage on a cluster of more than one machine.

    Args:
        path: the run folder.
        hosts: distinct machines among the alive nodes.
        may_add_nodes: the autoscaler can add machines later.
        log: where the warning goes when the filesystem type is unknown.
        mounts_file: the mount table to read (tests pass their own).

    Raises:
        ConfigError: `path` is on a filesystem private to this machine and the cluster
            has (or may get) other machines.
    """
    local = local_path(path)
    if local is None or (hosts <= 1 and not may_add_nodes):
        return
    fstype = filesystem_type(local, mounts_file)
    if fstype in NETWORK_FS_TYPES:
        return
    cluster = f"{hosts} machines" if hosts > 1 else "an autoscaler that can add machines"
    message = (
        f"{path} is on this machine's {fstype or 'unknown'} filesystem, but the cluster has {cluster}: "
        "workers on other machines would write checkpoints there that this driver cannot read"
    )
    if fstype in LOCAL_FS_TYPES:
        raise ConfigError([ConfigIssue("storage_path", message, SHARED_STORAGE_FIX)])
    log(f"WARNING: storage_path: {message} (unless it is a shared mount).\n    fix: {SHARED_STORAGE_FIX}")


@contextmanager
def staged_dir(path: StorageDir) -> Iterator[Path]:
    """A local folder for code that writes with local-path APIs (``pq.write_table``, ``savefig``):
    `path` itself on this machine, else a temporary folder whose files are copied to `path`
    when the block ends without an error."""
    local = local_path(path)
    if local is not None:
        local.mkdir(parents=True, exist_ok=True)
        yield local
        return
    with tempfile.TemporaryDirectory(prefix="cascade-ray-stage-") as tmp:
        yield Path(tmp)
        for file in sorted(Path(tmp).rglob("*")):
            if file.is_file():
                with file.open("rb") as src, (path / file.relative_to(tmp).as_posix()).open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)


def file_sha256(path: StorageDir | str) -> str:
    """sha256 of a file's bytes (local or remote), read in 1 MiB chunks."""
    h = hashlib.sha256()
    with (Path(path) if isinstance(path, str) else path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def local_copy(path: StorageDir) -> Iterator[Path]:
    """`path` itself when it is on this machine, else a temporary download of the file."""
    local = local_path(path)
    if local is not None:
        yield local
        return
    with tempfile.TemporaryDirectory(prefix="cascade-ray-") as tmp:
        target = Path(tmp) / path.name
        with path.open("rb") as src, target.open("wb") as dst:  # streamed: the object never whole in memory
            shutil.copyfileobj(src, dst, 1 << 20)
        yield target
