"""Where a run's files live: a local directory, or a storage URI (`s3://bucket/run`, `gs://...`, `file:///...`) that
every node reaches through `pyarrow.fs`, as Ray Train's `RunConfig(storage_path=...)` does.

With a URI, each process writes to a staging directory on its own node (`staging_dir`) and copies what is complete
to the URI: the controller its run files after every step (`RunMirror`), each learner rank its checkpoint parts, the
checkpoint's `tandem.json` last (a checkpoint without it is incomplete and never resumed from). Credentials and the
endpoint come from each node's environment as pyarrow reads them (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, ...),
never from the job file."""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
import shutil
import time
from pathlib import Path

from tandem.core.errors import TandemError

STAGING_ENV = "TANDEM_STAGING_DIR"


def is_uri(location: str | os.PathLike | None) -> bool:
    return location is not None and "://" in str(location)


def staging_dir(location: str) -> Path:
    """This node's local directory for a storage URI (the same URI, the same directory on every node)."""
    base = Path(os.environ.get(STAGING_ENV) or Path.home() / ".cache" / "tandem" / "staging")
    tail = location.rstrip("/").rsplit("/", 1)[-1] or "run"
    return base / f"{tail}-{hashlib.sha256(location.encode()).hexdigest()[:12]}"


def local_run_dir(output_dir: str) -> Path:
    """Where this node keeps a run directory's files: the directory itself, or a URI's staging directory."""
    return staging_dir(output_dir) if is_uri(output_dir) else Path(output_dir)


def join(location: str, *parts: str) -> str:
    """A path below a location: '/'-joined for a URI, os.path for a local path."""
    if is_uri(location):
        return "/".join([location.rstrip("/"), *parts])
    return os.path.join(location, *parts)


def basename(location: str) -> str:
    return str(location).rstrip("/").rsplit("/", 1)[-1]


class Location(str):
    """A local path or a storage URI, with the two things callers ask of a path: its name, and a path below it."""

    @property
    def name(self) -> str:
        return basename(self)

    def __truediv__(self, part: str) -> Location:
        return Location(join(self, part))


class StorageError(TandemError, OSError):
    """A storage URI that this node cannot read or write, named with the error the filesystem gave."""


class Store:
    """A directory of a filesystem pyarrow knows; paths below it are '/'-separated and relative."""

    def __init__(self, location: str | os.PathLike):
        import pyarrow.fs as pafs

        self.location = str(location)
        if is_uri(self.location):
            try:
                self.fs, self.root = pafs.FileSystem.from_uri(self.location)
            except (ValueError, OSError) as e:  # an unknown scheme, a bucket name pyarrow refuses
                raise StorageError(f"{self.location!r}: not a storage URI pyarrow.fs can open ({e}); allowed: "
                                   "s3://bucket/path, gs://bucket/path, file:///path, hdfs://..., or a local path") from None
        else:
            self.fs, self.root = pafs.LocalFileSystem(), str(Path(self.location).absolute())
        self.root = self.root.rstrip("/")

    def _p(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _info(self, rel: str):
        return self.fs.get_file_info(self._p(rel))

    def exists(self, rel: str = "") -> bool:
        import pyarrow.fs as pafs

        return self._info(rel).type != pafs.FileType.NotFound

    def is_file(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        return self._info(rel).type == pafs.FileType.File

    def size(self, rel: str) -> int:
        return self._info(rel).size or 0

    def children(self, rel: str = "") -> list[tuple[str, bool]]:
        """(name, is_dir) of what lies directly below rel; [] where nothing does."""
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self._p(rel), allow_not_found=True))
        return sorted((i.base_name, i.type == pafs.FileType.Directory) for i in infos)

    def files(self, rel: str = "") -> list[str]:
        """Every file below rel, as paths relative to rel."""
        return sorted(self.sizes(rel))

    def sizes(self, rel: str = "") -> dict[str, int]:
        """{path relative to rel: size} of every file below rel, from one listing."""
        import pyarrow.fs as pafs

        base = self._p(rel)
        infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return {i.path[len(base) + 1:]: i.size for i in infos if i.type == pafs.FileType.File}

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self._p(rel)) as f:
            return f.read()

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode()

    def open_input(self, rel: str):
        """A seekable file (zipfile reads a checkpoint part's index from its end)."""
        return self.fs.open_input_file(self._p(rel))

    def _make_parent(self, rel: str) -> None:
        """A local filesystem (file://) needs the directories an object store does without."""
        import pyarrow.fs as pafs

        if isinstance(self.fs, pafs.LocalFileSystem):
            self.fs.create_dir(self._p(rel).rsplit("/", 1)[0], recursive=True)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Whole or not at all: an object store's PUT is; a local file is written beside and renamed."""
        if is_uri(self.location):
            self._make_parent(rel)
            with self.fs.open_output_stream(self._p(rel)) as f:
                f.write(data)
            return
        p = Path(self._p(rel))
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".part")
        tmp.write_bytes(data)
        os.replace(tmp, p)

    def delete(self, rel: str = "") -> None:
        """A file or a directory and all below it; nothing where nothing is."""
        import pyarrow.fs as pafs

        info = self._info(rel)
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self._p(rel))
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(self._p(rel))

    def upload(self, local: Path, rel: str = "", names: list[str] | None = None, last: str | None = None) -> None:
        """Local files (those named, relative to `local`; default every file below it) to rel; `last` after all
        the others, so that whoever sees it sees them all."""
        names = sorted(str(f.relative_to(local)) for f in Path(local).rglob("*") if f.is_file()) \
            if names is None else names
        for name in sorted(names, key=lambda n: n == last):
            self.put_file(Path(local) / name, join(rel, name) if rel else name)

    def put_file(self, local: Path, rel: str) -> None:
        import pyarrow.fs as pafs

        if not is_uri(self.location):
            dst = Path(self._p(rel))
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + ".part")
            shutil.copyfile(local, tmp)
            os.replace(tmp, dst)
            return
        self._make_parent(rel)
        pafs.copy_files(str(local), self._p(rel), source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.fs)

    def download(self, rel: str, local: Path) -> None:
        """Every file below rel into the local directory (made; what was there stays unless overwritten)."""
        import pyarrow.fs as pafs

        Path(local).mkdir(parents=True, exist_ok=True)
        if not self.exists(rel):
            return
        pafs.copy_files(self._p(rel), str(local), source_filesystem=self.fs,
                        destination_filesystem=pafs.LocalFileSystem())

    def copy_to(self, rel: str, other: Store, other_rel: str = "") -> None:
        """A directory below this store to a directory of another (or the same) store, replacing it."""
        import pyarrow.fs as pafs

        other.delete(other_rel)
        if isinstance(other.fs, pafs.LocalFileSystem):
            other.fs.create_dir(other._p(other_rel), recursive=True)
        pafs.copy_files(self._p(rel), other._p(other_rel), source_filesystem=self.fs, destination_filesystem=other.fs)


def check_reachable(location: str, field: str) -> str | None:
    """Why this node cannot write and read back a storage URI (no credentials, no bucket, no endpoint), or None.
    Written, read back and deleted: a file of its own, never one of the run's."""
    import uuid

    name = f".tandem-reach-{uuid.uuid4().hex[:8]}"
    try:
        store = Store(location)
        store.write_bytes(name, b"ok")
        back = store.read_bytes(name)
        store.delete(name)
    except OSError as e:
        back, why = None, first_line(e)
    if back == b"ok":
        return None
    if back is not None:
        why = "a file written there read back different"
    if missing := missing_credentials(location):
        return (f"{field} = {location!r}: this node has no credentials for it ({missing}), and it cannot write "
                f"there ({why}); allowed: credentials in this node's environment, or a local path")
    return (f"{field} = {location!r}: this node cannot write there ({why}); allowed: a storage URI whose credentials "
            "and endpoint this node's environment gives (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, "
            "GOOGLE_APPLICATION_CREDENTIALS, ...) or a local path")


AWS_CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                       "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")


def missing_credentials(location: str) -> str | None:
    """Where an s3:// URI's credentials would come from and none is there: what the AWS SDK looks at (its variables,
    its shared files, and an instance role where AWS_EC2_METADATA_DISABLED is set), said in a few words; None where
    one is there or the URI is not s3://. An unsigned request is what the SDK sends without them, which a store refuses
    with a bare code (INTERNAL_FAILURE, ACCESS_DENIED) or, on some test servers, takes."""
    if not location.startswith("s3://"):
        return None
    home = Path(os.environ.get("HOME", "~")).expanduser()
    files = [Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", home / ".aws" / "credentials")),
             Path(os.environ.get("AWS_CONFIG_FILE", home / ".aws" / "config"))]
    if any(os.environ.get(v) for v in AWS_CREDENTIAL_VARS) or any(f.is_file() for f in files):
        return None
    if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true":
        return None  # an instance role may answer: the SDK's own error says whether it did
    return "none of AWS_ACCESS_KEY_ID, AWS_PROFILE, ~/.aws/credentials, a web identity or a container role"


def first_line(e: BaseException) -> str:
    """An error in one line: pyarrow's S3 errors put the cause after what was being done ("When ...: AWS Error
    NO_SUCH_BUCKET during ...: The specified bucket does not exist")."""
    text = " ".join(x.strip() for x in str(e).strip().splitlines() if x.strip()) or type(e).__name__
    if "AWS Error" in text:
        text = text[text.index("AWS Error"):]
    return text[:300]


# what the run mirror leaves on the node: the driver's lock and Ray address, probes, partial copies
LOCAL_ONLY = (".tandem.lock", "ray_address")


class RunMirror:
    """A run directory staged on this node and copied to its storage URI: `pull` what the URI holds (a resumed
    run's record), `push` what changed since the last push (each file whole: object stores have no append)."""

    def __init__(self, local: Path, location: str, skip: tuple[str, ...] = ()):
        self.local, self.store, self.skip = Path(local), Store(location), skip
        self._sent: dict[str, tuple[int, int]] = {}

    def _mine(self, rel: str) -> bool:
        top = rel.split("/", 1)[0]
        return not (top in LOCAL_ONLY or any(fnmatch.fnmatch(top, s) for s in self.skip) or top.startswith(".tandem-")
                    or rel.endswith(".part"))

    def pull(self) -> None:
        """The staging directory made anew (the lock and Ray address kept) with what the URI holds."""
        if self.local.is_dir():
            for p in self.local.iterdir():
                if p.name not in LOCAL_ONLY:
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        self.local.mkdir(parents=True, exist_ok=True)
        for rel in self.store.files():
            if self._mine(rel):
                dst = self.local / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(self.store.read_bytes(rel))
                st = dst.stat()
                self._sent[rel] = (st.st_size, st.st_mtime_ns)

    def push(self) -> list[str]:
        """-> the files copied."""
        sent = []
        for f in sorted(self.local.rglob("*")) if self.local.is_dir() else []:
            rel = str(f.relative_to(self.local))
            if not f.is_file() or not self._mine(rel):
                continue
            st = f.stat()
            if self._sent.get(rel) != (st.st_size, st.st_mtime_ns):
                self.store.put_file(f, rel)
                self._sent[rel] = (st.st_size, st.st_mtime_ns)
                sent.append(rel)
        return sent


def run_mirror(cfg) -> RunMirror | None:
    """The mirror of a job whose output_dir is a storage URI (None for a local path). Checkpoints are written to the
    URI by the learner (TRL's checkpoint-N copies too), and the published adapter copied there: none is staged."""
    if not is_uri(cfg.logging.output_dir):
        return None
    return RunMirror(Path(cfg.run_dir), cfg.logging.output_dir, skip=("checkpoints", "adapter", "model", "checkpoint-*"))


LEASE = ".tandem-lease.json"  # not mirrored (RunMirror skips .tandem-*)


class RunLease:
    """One job at a time writes to a storage URI, whichever node it runs from: a lease object at the URI's root
    (who holds it: a run id, host, pid, since; a heartbeat every `beat_s`). `acquire` refuses while another job's
    lease is live: on this host, while its process lives; from another host, until `ttl_s` after its last
    heartbeat (a job that died frees the URI then). Object stores give no atomic create through pyarrow, so a lease
    is written, then read back after `settle_s`: of two jobs starting at the same moment, the one whose write was
    overwritten sees the other's and refuses (a write-then-verify lease; S3 reads its writes at once)."""

    def __init__(self, location: str, field: str = "logging.output_dir", ttl_s: float = 60.0, beat_s: float = 15.0,
                 settle_s: float = 2.0):
        import socket
        import uuid

        self.store, self.location, self.field = Store(location), location, field
        self.ttl_s, self.beat_s, self.settle_s = ttl_s, beat_s, settle_s
        self.me = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        self._stop = None

    def holder(self) -> dict | None:
        import json

        try:
            h = json.loads(self.store.read_bytes(LEASE))
        except (OSError, ValueError):  # none, or a torn or foreign file: nobody holds it
            return None
        return h if isinstance(h, dict) and {"id", "host", "pid", "beat"} <= h.keys() else None

    def live(self, h: dict) -> bool:
        """Another job's lease that still holds."""
        if h["id"] == self.me["id"]:
            return False
        if h["host"] == self.me["host"]:
            return pid_alive(int(h["pid"]))
        return time.time() - float(h["beat"]) < self.ttl_s

    def _refuse(self, h: dict, how: str) -> None:
        from tandem.core.errors import JobConfigError

        raise JobConfigError(
            f"{self.field} = {self.location!r}: {how} (pid {h['pid']} on {h['host']}, running since "
            f"{_clock(h.get('since'))}, its last heartbeat {time.time() - float(h['beat']):.0f} s ago); allowed: another "
            f"URI, or this one once that job has ended (a job that died frees it {self.ttl_s:.0f} s after its last "
            "heartbeat)")

    def _write(self) -> None:
        import json

        self.store.write_bytes(LEASE, json.dumps(dict(self.me, beat=time.time())).encode())

    def acquire(self) -> None:
        import threading

        h = self.holder()
        if h is not None and self.live(h):
            self._refuse(h, "another job is writing to it")
        self._write()
        time.sleep(self.settle_s)
        h = self.holder()
        if h is None or h["id"] != self.me["id"]:
            self._refuse(h or dict(self.me, beat=time.time()), "another job took it at the same moment")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._write()
            except OSError:  # the store is unreachable for a moment: the next beat tries again
                pass

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join(timeout=30)  # a beat in progress lands before the lease goes, never after
        h = self.holder()
        if h is not None and h["id"] == self.me["id"]:
            self.store.delete(LEASE)


def _clock(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t))) if t else "?"


def as_named(path: str) -> str:
    """A local path as the user's own machine names it. Under `tandem submit` the job runs in Ray's copy of the
    directory it sent (TANDEM_COPY_DIR, on the cluster), which is TANDEM_SOURCE_DIR on the submitting machine: a path
    inside the copy is named inside the source, so that what a run records (the adapter's base model, the data's
    path in its checkpoints) names what the user named, not a temporary copy. Elsewhere: the path resolved."""
    p = Path(path).resolve()
    source, copy = os.environ.get("TANDEM_SOURCE_DIR"), os.environ.get("TANDEM_COPY_DIR")
    if source and copy:
        with contextlib.suppress(ValueError):
            return str(Path(source) / p.relative_to(Path(copy).resolve()))
    return str(p)


def pid_alive(pid: int) -> bool:
    """A process of this host with this pid exists (another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
