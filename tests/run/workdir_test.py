"""One writer per workdir: the local flock and the gs:// lease (against a fake GCS client with
generation preconditions); config-file errors that keep their reason."""

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from helpers.cli import REPO, TINY, cache_env, last_line, steps
from helpers.cli import run as cli_run
from helpers.cli import start as cli_start
from jrl.run import workdir as workdir_lib


def _hold_lock(path):
    """Another process that holds the OS lock on `path` (and records itself, as a run does) until
    its stdin closes."""
    code = textwrap.dedent(
        f"""
        import fcntl, json, os, socket, sys
        fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({{"host": socket.gethostname(), "pid": os.getpid(),
                                 "since": "2026-01-01T00:00:00+00:00"}}).encode())
        print("locked", flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_two_runs_on_one_workdir_one_trains_the_other_exits_2(tmp_path_factory):
    """The same command twice on one workdir: the first trains; the second, started while the
    first holds the lock (the first is paused with SIGSTOP meanwhile, so that it is surely still
    running), stops before compiling with the holder's pid and host; metrics.jsonl has each step
    once."""
    env = cache_env()
    workdir = tmp_path_factory.mktemp("two_runs") / "w"
    lock = workdir / workdir_lib.LOCK_FILE
    first = cli_start([*TINY, f"--workdir={workdir}"], env)
    while not (lock.exists() and lock.read_text()):
        assert first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)
    try:
        code, second_err = cli_run([*TINY, f"--workdir={workdir}"], env)
    finally:
        first.send_signal(signal.SIGCONT)
    first_out, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err[-3000:]
    assert code == 2, second_err[-3000:]
    last = last_line(second_err)
    assert last.startswith(
        f"error: --workdir={workdir} is in use by pid {first.pid} on host {socket.gethostname()} "
        "since "
    ), last
    assert "Compiling" not in second_err
    assert steps(workdir) == [0, 1, 2, 3]
    assert lock.read_text() == ""  # released at the end
    print(f"first (exit 0), stdout: {first_out.strip()}\nsecond (exit 2), stderr: {last}")


def test_fresh_never_breaks_a_live_lock(tmp_path):
    workdir = tmp_path / "w"
    (workdir / "checkpoints" / "2").mkdir(parents=True)
    holder = _hold_lock(workdir / workdir_lib.LOCK_FILE)
    try:
        code, err = cli_run([*TINY, f"--workdir={workdir}", "--fresh"], os.environ, timeout=120)
    finally:
        holder.stdin.close()
        holder.wait()
    assert code == 2
    assert f"is in use by pid {holder.pid} on host {socket.gethostname()}" in err.splitlines()[-1]
    assert sorted(os.listdir(workdir)) == ["checkpoints", workdir_lib.LOCK_FILE]  # not moved
    assert os.listdir(workdir / "checkpoints") == ["2"]


def test_local_lock_stale_takeover_and_in_use(tmp_path, caplog):
    path = tmp_path / workdir_lib.LOCK_FILE
    stale = {"host": "gone-host", "pid": 999999, "since": "2026-01-01T00:00:00+00:00"}
    path.write_text(json.dumps(stale))  # left by a killed run: no process holds the OS lock
    lock = workdir_lib.LocalLock(str(tmp_path))
    with caplog.at_level("WARNING"):
        lock.acquire()
    assert "Taking over the lock" in caplog.text and "pid 999999 on host gone-host" in caplog.text
    record = json.loads(path.read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    # A second lock on the same file (another open file description, as another process has).
    with pytest.raises(workdir_lib.InUseError, match=rf"in use by pid {os.getpid()} on host "):
        workdir_lib.LocalLock(str(tmp_path)).acquire()
    lock.release()
    assert path.read_text() == ""
    with caplog.at_level("WARNING"):
        caplog.clear()
        again = workdir_lib.LocalLock(str(tmp_path))
        again.acquire()  # released cleanly: no takeover warning
        again.release()
    assert "Taking over" not in caplog.text


def test_acquire_is_reentrant_within_a_process_and_release_unlocks(tmp_path):
    workdir_lib.acquire(str(tmp_path))
    workdir_lib.acquire(str(tmp_path / "."))  # the same directory: already held, no error
    holder_pid = json.loads((tmp_path / workdir_lib.LOCK_FILE).read_text())["pid"]
    assert holder_pid == os.getpid()
    workdir_lib.release(str(tmp_path))
    probe = _hold_lock(tmp_path / workdir_lib.LOCK_FILE)  # another process can take it now
    probe.stdin.close()
    probe.wait()


# ------------------------------------------------------------------------- gs:// lease (fake)


class HttpError(Exception):
    def __init__(self, code):
        super().__init__(f"HTTP {code}")
        self.code = code


class FakeStore:
    """Objects {name: (bytes, generation, updated)} with GCS's generation preconditions."""

    def __init__(self):
        self.objects, self.next_generation, self.now = {}, 1, 1_000_000.0

    def bucket(self, name):
        return FakeBucket(self, name)


class FakeBucket:
    def __init__(self, store, name):
        self.store, self.name = store, name

    def blob(self, name):
        return FakeBlob(self.store, f"{self.name}/{name}")


class FakeBlob:
    def __init__(self, store, name):
        self.store, self.name = store, name
        self.generation, self.updated = None, None

    def _check(self, if_generation_match):
        current = self.store.objects.get(self.name)
        generation = current[1] if current else 0
        if if_generation_match is not None and if_generation_match != generation:
            raise HttpError(412)

    def upload_from_string(self, data, content_type=None, if_generation_match=None):
        self._check(if_generation_match)
        self.generation = self.store.next_generation
        self.store.next_generation += 1
        self.store.objects[self.name] = (data.encode(), self.generation, self.store.now)
        self.updated = datetime.datetime.fromtimestamp(self.store.now, datetime.timezone.utc)

    def reload(self):
        if self.name not in self.store.objects:
            raise HttpError(404)
        _, self.generation, updated = self.store.objects[self.name]
        self.updated = datetime.datetime.fromtimestamp(updated, datetime.timezone.utc)

    def download_as_text(self):
        if self.name not in self.store.objects:
            raise HttpError(404)
        return self.store.objects[self.name][0].decode()

    def delete(self, if_generation_match=None):
        if self.name not in self.store.objects:
            raise HttpError(404)
        self._check(if_generation_match)
        del self.store.objects[self.name]


@pytest.fixture
def gcs(monkeypatch):
    store = FakeStore()
    monkeypatch.setattr(workdir_lib.time, "time", lambda: store.now)
    return store


def _lease(store, **kwargs):
    lost = []
    lease = workdir_lib.GcsLease(
        "gs://bucket/run", store, ttl_s=120, renew_s=3600, on_lost=lost.append, **kwargs
    )
    return lease, lost


def test_gcs_lease_created_only_if_absent_renewed_and_released(gcs):
    a, lost_a = _lease(gcs)
    a.acquire()
    data, generation, _ = gcs.objects["bucket/run/jrl.lock"]
    assert json.loads(data)["pid"] == os.getpid() and generation == a.generation == 1
    gcs.now += 100  # younger than the TTL: a second run is refused, naming the holder
    b, _ = _lease(gcs)
    with pytest.raises(workdir_lib.InUseError, match=r"in use by pid \d+ on host .* renewed 100s"):
        b.acquire()
    assert a.renew() and a.generation == 2 and not lost_a  # conditional on its own generation
    gcs.now += 100  # renewed 100 s ago: still refused
    with pytest.raises(workdir_lib.InUseError):
        b.acquire()
    a.release()
    assert "bucket/run/jrl.lock" not in gcs.objects
    b.acquire()  # free again
    assert gcs.objects["bucket/run/jrl.lock"][1] == b.generation
    b.release()


def test_gcs_lease_taken_over_only_when_expired_and_the_old_holder_stops(gcs, caplog):
    a, lost_a = _lease(gcs)
    a.acquire()
    gcs.now += 121  # not renewed for longer than the TTL (the holder hangs or died)
    b, _ = _lease(gcs)
    with caplog.at_level("WARNING"):
        b.acquire()
    assert "Took over the lease gs://bucket/run/jrl.lock" in caplog.text
    assert gcs.objects["bucket/run/jrl.lock"][1] == b.generation == 2
    assert not a.renew() and lost_a == [a]  # the old holder's next renewal finds it lost
    a.release()  # deletes nothing of b's
    assert gcs.objects["bucket/run/jrl.lock"][1] == b.generation


def test_gcs_lease_race_for_an_expired_lease_has_one_winner(gcs):
    a, _ = _lease(gcs)
    a.acquire()
    gcs.now += 500
    b, _ = _lease(gcs)
    c, _ = _lease(gcs)
    # c reads the expired generation 1, then b takes it over before c writes.
    real_reload = FakeBlob.reload

    def reload_then_b_wins(blob):
        real_reload(blob)
        if blob is c._blob and b.generation is None:
            b.acquire()

    FakeBlob.reload = reload_then_b_wins
    try:
        with pytest.raises(workdir_lib.InUseError, match="is in use by pid"):
            c.acquire()
    finally:
        FakeBlob.reload = real_reload
    assert gcs.objects["bucket/run/jrl.lock"][1] == b.generation


# ------------------------------------------------------------------------ config-file errors


def _config_error(spec):
    proc = subprocess.run(
        [sys.executable, "-m", "jrl.train", f"--config={spec}", "--workdir=/nonexistent/w"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    return proc.stderr.strip().splitlines()[-1]


def test_preset_typo_gives_the_reason_and_the_valid_presets():
    last = _config_error("configs/grpo_math.py:modle=qwen")
    assert last.startswith("error: unknown preset 'modle=qwen' (did you mean 'model=qwen2.5-"), last
    assert "valid presets: tiny, drgrpo, model=qwen2.5-0.5b," in last and "mesh=v5p-64-ep." in last


def test_exception_inside_a_config_file_gives_type_message_line_and_presets(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(
        "PRESETS = {'small': None, 'large': None}\n"
        "\n"
        "def get_config(arg=None):\n"
        "    return {'a': 1}['b']\n"
    )
    last = _config_error(f"{path}:small")
    assert last == (
        f"error: --config={path}:small: KeyError: 'b' (line 4 of {path}); valid presets: "
        f"small, large."
    ), last
