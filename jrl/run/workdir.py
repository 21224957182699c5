"""A run's workdir: one writer at a time, what a resume checks, and write errors as clean stops.

- **Lock.** A run owns its workdir. A local (or shared-filesystem) workdir is locked with an OS
  lock (`flock`) on `<workdir>/jrl.lock`, which records the holder's host, pid, start time and
  command; the OS drops the lock when the process ends however it ends, so a lock file whose
  process is gone is simply taken over (with a warning naming the old holder). A `gs://` workdir
  holds a lease object `<workdir>/jrl.lock` instead: created only if absent (generation
  precondition 0), renewed by a background thread every `LEASE_RENEW_S` seconds (each renewal
  conditional on the generation it wrote last), deleted on exit, and taken over only once it has
  not been renewed for `LEASE_TTL_S` seconds. On a multi-process run process 0 holds it. A second
  run stops with `InUseError` (exit status 2) naming the holder.
- **Resume checks.** `config.json` records the run's config and fingerprints of its input files
  (data files, HF checkpoint, tokenizer directory: size, modification time, SHA-256 of the first
  and last MiB). A resume compares both with the config and files it is given; a change of a field
  that alters the maths, or of an input's size or content, stops with `ChangedInputsError`
  (exit 2) and a one-line diff, unless `--allow_changes`. The fields of
  `config.resume_safe_fields()` may change.
- **Write errors.** An OSError (a full disk, a quota, a read-only remount) while writing a
  checkpoint, `config.json` or metrics becomes `WriteError` naming the path (exit status 4); the
  checkpoints that had committed stay valid and the next start resumes from the newest.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import fnmatch
import functools
import hashlib
import json
import os
import re
import socket
import sys
import threading
import time

from absl import logging
import jax
import numpy as np

from jrl import config as config_lib

LOCK_FILE = "jrl.lock"
CONFIG_FILE = "config.json"
FINGERPRINTS_KEY = "input_fingerprints"  # config.json's record of the input files
WRITE_ERROR_EXIT_CODE = 4
LEASE_TTL_S = 120.0  # a gs:// lease not renewed for this long may be taken over
LEASE_RENEW_S = 30.0  # how often the holder renews it
_HASHED_BYTES = 1 << 20  # fingerprints hash the first and the last MiB of each file

class InUseError(config_lib.ConfigError):
    """Another live run holds the workdir."""


class ChangedInputsError(config_lib.ConfigError):
    """A resume with a config or input files other than the run's."""


class WriteError(RuntimeError):
    """Writing the workdir failed (OSError): the run stops; committed checkpoints stay valid."""

    def __init__(self, path, error: OSError):
        reason = f"[Errno {error.errno}] {error.strerror}" if error.errno else str(error)
        super().__init__(
            f"writing {path} failed: {reason}; free space (or fix the storage) and rerun the same "
            f"command: it resumes from the last checkpoint."
        )
        self.path, self.error = os.fspath(path), error


# ------------------------------------------------------------------------------ write errors

_TENSORSTORE_ERRNO = re.compile(r"os_error_code='?(\d+)")


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind `e`: itself, one in its cause / context chain, or one that a storage
    library reported in its message (tensorstore: "... [os_error_code='28']")."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        m = _TENSORSTORE_ERRNO.search(str(e))
        if m:
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def writing(path):
    """Turns an OSError raised inside the block (also one wrapped by a library) into WriteError
    naming `path`; other exceptions pass unchanged."""
    try:
        yield
    except WriteError:
        raise
    except Exception as e:
        os_error = _os_error(e)
        if os_error is None:
            raise
        raise WriteError(path, os_error) from e


class Guarded:
    """`target` with calls of its methods `methods` (default: all) inside `writing(path)`, and
    inside `hold()` when given (e.g. a PreemptionGuard's `writing`: no exit in mid-write)."""

    def __init__(self, target, path, methods: tuple[str, ...] | None = None, hold=None):
        self._target, self._path, self._methods = target, path, methods
        self._hold = hold or contextlib.nullcontext

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if not callable(attr) or (self._methods is not None and name not in self._methods):
            return attr

        @functools.wraps(attr)
        def call(*args, **kwargs):
            with writing(self._path), self._hold():
                return attr(*args, **kwargs)

        return call


# ------------------------------------------------------------------------------------- lock


def _holder() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def _describe(holder: dict) -> str:
    if not holder:
        return "another run (starting up)"
    return f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}"


def _parse(text: str) -> dict:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class LocalLock:
    """`flock` on `<directory>/jrl.lock` (local disks, NFS and other shared filesystems)."""

    def __init__(self, directory: str):
        self.workdir = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: int | None = None

    def _read(self, fd: int) -> dict:
        return _parse(os.pread(fd, 1 << 16, 0).decode(errors="replace"))

    def acquire(self) -> None:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read(fd)
            os.close(fd)
            raise InUseError(
                f"--workdir={self.workdir} is in use by {_describe(holder)} (lock {self.path}); "
                f"wait for that run to end or stop it, or choose another --workdir."
            ) from None
        except OSError as e:  # ENOLCK / EOPNOTSUPP: a filesystem without locks
            os.close(fd)
            logging.warning(
                "Cannot lock %s (%s): nothing stops a second run from writing to this workdir.",
                self.path,
                e.strerror,
            )
            return
        previous = self._read(fd)
        if previous:  # written by a run that ended without releasing it (killed)
            logging.warning(
                "Taking over the lock %s of %s, which is gone.", self.path, _describe(previous)
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # an empty lock file: released, not abandoned
            os.close(self._fd)
            self._fd = None


def _status(e: BaseException) -> int | None:
    """HTTP status of a google-api-core error (412 PreconditionFailed, 404 NotFound)."""
    code = getattr(e, "code", None)
    return code if isinstance(code, int) else None


def _gcs_client():
    """A google-cloud-storage client, or None (with a warning) when it cannot be made."""
    try:
        from google.cloud import storage

        return storage.Client()
    except Exception as e:  # not installed, no credentials
        logging.warning("No Google Cloud Storage client (%s: %s).", type(e).__name__, e)
        return None


class GcsLease:
    """A lease object `<gs://bucket/dir>/jrl.lock` (google-cloud-storage client API).

    Created with `if_generation_match=0` (only if absent); renewed every `renew_s` seconds with
    `if_generation_match=<the generation it wrote last>`; taken over, again conditionally on the
    generation read, only when the object's server-side update time is older than `ttl_s`;
    deleted (conditionally) by `release`. A renewal that finds another generation means another
    run took the lease: `on_lost` is called (default: exit at once with status 2, before this
    run writes more).
    """

    def __init__(self, uri: str, client, *, ttl_s=LEASE_TTL_S, renew_s=LEASE_RENEW_S, on_lost=None):
        bucket, _, prefix = uri[len("gs://") :].partition("/")
        self.workdir, self.path = uri, f"{uri.rstrip('/')}/{LOCK_FILE}"
        self._blob = client.bucket(bucket).blob(f"{prefix.strip('/')}/{LOCK_FILE}".lstrip("/"))
        self.ttl_s, self.renew_s = ttl_s, renew_s
        self._on_lost = on_lost or self._exit_lost
        self.generation: int | None = None
        self._record: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self, if_generation_match: int) -> None:
        self._record["renewed"] = time.time()
        self._blob.upload_from_string(
            json.dumps(self._record),
            content_type="application/json",
            if_generation_match=if_generation_match,
        )
        self.generation = self._blob.generation

    def _busy(self, holder: dict, age: float) -> InUseError:
        return InUseError(
            f"--workdir={self.workdir} is in use by {_describe(holder)} (lease {self.path}, "
            f"renewed {age:.0f}s ago, taken over after {self.ttl_s:.0f}s without renewal); wait "
            f"for that run to end or stop it, or choose another --workdir."
        )

    def acquire(self) -> None:
        self._record = {**_holder(), "ttl_s": self.ttl_s}
        for _ in range(3):  # a lease released between our two requests: try again
            try:
                self._write(if_generation_match=0)
                break
            except Exception as e:
                if _status(e) != 412:
                    raise
            try:
                self._blob.reload()
                holder = _parse(self._blob.download_as_text())
            except Exception as e:
                if _status(e) == 404:
                    continue
                raise
            generation = self._blob.generation
            age = time.time() - self._blob.updated.timestamp()
            if age < self.ttl_s:
                raise self._busy(holder, age)
            try:
                self._write(if_generation_match=generation)
            except Exception as e:
                if _status(e) == 412:  # another run took it over first
                    raise self._busy(holder, 0.0) from None
                raise
            logging.warning(
                "Took over the lease %s of %s, not renewed for %.0fs.",
                self.path,
                _describe(holder),
                age,
            )
            break
        else:
            raise self._busy({}, 0.0)
        self._thread = threading.Thread(target=self._renew, name="jrl-lease", daemon=True)
        self._thread.start()

    def renew(self) -> bool:
        """One renewal; False when the lease was lost (`on_lost` has been called)."""
        try:
            self._write(if_generation_match=self.generation)
        except Exception as e:
            if _status(e) in (412, 404):
                self._on_lost(self)
                return False
            logging.warning("Renewing the lease %s failed (%s); retrying.", self.path, e)
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_s):
            if not self.renew():
                return

    @staticmethod
    def _exit_lost(lease) -> None:
        os.write(
            2,
            f"\nerror: the lease {lease.path} was taken over by another run; stopping at once "
            f"(the checkpoints committed so far stay valid).\n".encode(),
        )
        os._exit(2)

    def release(self) -> None:
        self._stop.set()
        if self.generation is None:
            return
        try:
            self._blob.delete(if_generation_match=self.generation)
        except Exception as e:  # lost, or already gone: nothing of ours to delete
            logging.warning("Could not delete the lease %s (%s).", self.path, e)
        self.generation = None


_HELD: dict[str, object] = {}


def _key(workdir: str) -> str:
    return workdir if "://" in workdir else os.path.realpath(workdir)


def _agree(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))


def acquire(workdir: str, *, client=None) -> None:
    """Locks `workdir` for this process (process 0 of a multi-process run; every process calls
    this). Raises InUseError naming the holder if a live run holds it. A process that holds the
    lock already keeps it. Held until `release(workdir)` or the process ends."""
    key, error = _key(workdir), None
    if jax.process_index() == 0 and key not in _HELD:
        if "://" not in workdir:
            lock = LocalLock(workdir)
        elif workdir.startswith("gs://") and (client := client or _gcs_client()) is not None:
            lock = GcsLease(workdir, client)
        else:
            lock = None
            logging.warning(
                "--workdir=%s is not locked (a gs:// lease needs google-cloud-storage: pip "
                "install 'jrl[gcs]'); make sure only one run uses it.",
                workdir,
            )
        try:
            if lock is not None:
                lock.acquire()
                _HELD[key] = lock
        except InUseError as e:
            error = e
    if not _agree(error is None):
        raise error or InUseError(f"--workdir={workdir} is in use by another run (see process 0).")


def release(workdir: str) -> None:
    """Releases the lock `acquire` took (no-op when not held)."""
    lock = _HELD.pop(_key(workdir), None)
    if lock is not None:
        lock.release()


@atexit.register
def _release_all() -> None:
    for key in list(_HELD):
        with contextlib.suppress(Exception):
            _HELD.pop(key).release()


# --------------------------------------------------------------------------- resume checks


def _file_fingerprint(path: str) -> dict:
    st = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_HASHED_BYTES))
        if st.st_size > _HASHED_BYTES:
            f.seek(max(_HASHED_BYTES, st.st_size - _HASHED_BYTES))
            digest.update(f.read())
    mtime = datetime.datetime.fromtimestamp(st.st_mtime).astimezone()
    return {
        "path": os.path.abspath(path),
        "size": st.st_size,
        "mtime": mtime.isoformat(timespec="seconds"),
        "sha256_head_tail": digest.hexdigest(),
    }


def fingerprints(cfg) -> dict[str, dict]:
    """{input name: fingerprint} of the run's local input files: `task.train_files[i]`,
    `task.eval_files[i]`, `model.hf_path/<file>` and `tokenizer/<file>` (a tokenizer directory);
    the modification time is recorded but only size and content are compared."""
    out = {}
    for field in ("task.train_files", "task.eval_files"):
        value = cfg.task[field.split(".")[1]]
        for i, path in enumerate(p.strip() for p in value.split(",") if p.strip()):
            if os.path.isfile(path):
                out[f"{field}[{i}]"] = _file_fingerprint(path)
    for field, directory in (("model.hf_path", cfg.model.hf_path), ("tokenizer", cfg.tokenizer)):
        if directory and os.path.isdir(directory):
            for name in sorted(os.listdir(directory)):
                if os.path.isfile(os.path.join(directory, name)):
                    out[f"{field}/{name}"] = _file_fingerprint(os.path.join(directory, name))
    return out


def config_json(cfg, prints: dict) -> str:
    """The text of `config.json`: the config's fields and, under FINGERPRINTS_KEY, `prints` as a
    list of {"input": name, ...} (no dotted keys: the file still loads as a ConfigDict)."""
    records = [{"input": name, **fingerprint} for name, fingerprint in prints.items()]
    fields = json.loads(cfg.to_json_best_effort())
    return json.dumps({**fields, FINGERPRINTS_KEY: records}, indent=2)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _safe(field: str) -> bool:
    return any(fnmatch.fnmatchcase(field, p) for p in config_lib.resume_safe_fields())


def changes(saved: dict, cfg, prints: dict) -> list[str]:
    """What differs between the saved `config.json` contents and this run's config and input
    fingerprints: fields outside `config.resume_safe_fields()` ("actor.lr 0.001 -> 0.002"), and
    inputs whose size or content changed, appeared or disappeared. Fields that only one side has
    (added to or removed from jrl in between) are not compared."""
    saved = dict(saved)
    saved_prints = saved.pop(FINGERPRINTS_KEY, None)
    if saved_prints is not None:
        saved_prints = {r["input"]: r for r in saved_prints}
    old, new = _flat(saved), _flat(json.loads(cfg.to_json_best_effort()))
    out = [
        f"{k} {old[k]!r} -> {new[k]!r}"
        for k in sorted(old.keys() & new.keys())
        if old[k] != new[k] and not _safe(k)
    ]
    if saved_prints is None:  # a workdir of a jrl version that recorded none
        return out
    for name in sorted(saved_prints.keys() | prints.keys()):
        a, b = saved_prints.get(name), prints.get(name)
        if a is None:
            out.append(f"{name} {b['path']} is new")
        elif b is None:
            out.append(f"{name} {a['path']} is gone")
        elif a["size"] != b["size"]:
            out.append(f"{name} {b['path']} changed ({a['size']} -> {b['size']} bytes)")
        elif a["sha256_head_tail"] != b["sha256_head_tail"]:
            out.append(f"{name} {b['path']} changed (same size, other content)")
    return out


def check_resume(workdir: str, cfg, prints: dict, *, allow_changes: bool = False) -> None:
    """Before resuming from `workdir`'s checkpoints: compares its `config.json` with this run's
    config and input fingerprints; raises ChangedInputsError with a one-line diff when they
    differ (a warning instead with `allow_changes`). A workdir without config.json is not
    checked."""
    from etils import epath

    path = epath.Path(workdir) / CONFIG_FILE
    if not path.exists():
        return
    diff = changes(_parse(path.read_text()), cfg, prints)
    if not diff:
        return
    if allow_changes:
        logging.warning("Resuming %s with changes (--allow_changes): %s", workdir, "; ".join(diff))
        return
    shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
    raise ChangedInputsError(
        f"--workdir={workdir} was trained with other inputs: {shown}; resume with the same "
        f"config and files, pass --allow_changes to resume anyway, or start over with --fresh "
        f"or another --workdir."
    )
