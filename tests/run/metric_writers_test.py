"""Metric writers: metrics.jsonl rows and tensorboard scalars in a local workdir, and in a gs://
workdir served by a fake epath backend (no network: the "bucket" is a local directory behind a
backend that, like an object store, refuses append and shows a written object only when its
upload is closed). Nothing here talks to Google Cloud Storage."""

import io
import json
import math
import os
import shutil
import struct

from etils import epath
from etils.epath import backend as epath_backend
from etils.epath import gpath
import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from jrl.run import metric_writers

ROWS = [
    {"actor/pg_loss": 0.5, "critic/score/mean": 0.25, "perf/total_num_tokens": 120},
    {"actor/pg_loss": -1.5, "critic/score/mean": float("nan"), "perf/total_num_tokens": 64},
    {"actor/pg_loss": 2.0, "critic/score/mean": 1.0, "response_length/hist": [1, 2]},
]


def read_events(data: bytes) -> dict:
    """{(tag, step): value} of the scalar summaries in a tensorboard event file's bytes, checking
    each record's framing (length, masked CRC32C of the length and of the payload)."""
    scalars, pos = {}, 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header)
        payload = data[pos + 12 : pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] == (
            masked_crc32c(payload)
        )
        pos += 16 + length
        event = event_pb2.Event.FromString(payload)
        for value in event.summary.value:
            scalars[(value.tag, event.step)] = value.simple_value
    return scalars


def event_files(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("events.out.tfevents"))


def expected_scalars(rows, first_step=0) -> dict:
    """The finite int / float values of `rows`, keyed (tag, step), as float32 like the events."""
    want = {}
    for step, row in enumerate(rows, first_step):
        for k, v in row.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                want[(k, step)] = struct.unpack("<f", struct.pack("<f", v))[0]
    return want


def rows_of(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize(
    "use_kl_loss, use_kl_in_reward, shown",
    [(False, False, None), (True, False, "kl=2.5e-03"), (False, True, "kl=7.0e-04")],
)
def test_progress_bar_shows_kl_only_with_a_kl_term(use_kl_loss, use_kl_in_reward, shown):
    from jrl import config as config_lib
    from jrl.run import trainer

    cfg = config_lib.base_config()
    cfg.actor.use_kl_loss, cfg.algorithm.use_kl_in_reward = use_kl_loss, use_kl_in_reward
    out = io.StringIO()
    bar = metric_writers.ProgressBar(2, kl=trainer.kl_metric(cfg), file=out)
    metrics = {
        "critic/score/mean": 0.5,
        "actor/ppo_kl": 0.0,  # one update per step: no policy change to measure, always 0
        "actor/kl_loss": 0.0025,
        "actor/reward_kl_penalty": 0.0007,
        "perf/throughput": 1000.0,
    }
    bar.update(metrics)
    bar.update(metrics)
    bar.close()
    last = out.getvalue().split("\r")[-1]
    assert "reward=0.500" in last and "tok/s=1000" in last
    if shown is None:
        assert "kl=" not in last
    else:
        assert shown in last and last.count("kl=") == 1
    assert "calls=" not in last and "tool err=" not in last  # one-turn: no tool fields


def test_progress_bar_shows_tool_calls_and_errors_with_tools():
    out = io.StringIO()
    bar = metric_writers.ProgressBar(1, file=out)
    bar.update({"critic/score/mean": 0.5, "tool_call_counts/mean": 0.75, "tool_calls/errors": 3})
    bar.close()
    last = out.getvalue().split("\r")[-1]
    assert "calls=0.75" in last and "tool err=3" in last


def test_local_workdir_appends_flushed_rows_and_writes_events_in_place(tmp_path):
    earlier = {"step": 0, "val/accuracy": 0.125}  # a row of an earlier (resumed) run
    (tmp_path / "metrics.jsonl").write_text(json.dumps(earlier) + "\n")
    writer = metric_writers.MetricWriter(str(tmp_path))
    for step, row in enumerate(ROWS, 1):
        writer.write(step, row)
    # Every row is on disk before close (flushed one by one).
    got = rows_of((tmp_path / "metrics.jsonl").read_text())
    assert got[0] == earlier
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    assert got[2]["actor/pg_loss"] == -1.5 and math.isnan(got[2]["critic/score/mean"])
    assert got[3]["response_length/hist"] == [1, 2]
    writer.close()
    writer.close()  # a second close is a no-op
    (events,) = event_files(tmp_path)
    assert read_events((tmp_path / events).read_bytes()) == expected_scalars(ROWS, first_step=1)
    assert sorted(os.listdir(tmp_path)) == sorted(["metrics.jsonl", events])


def test_disabled_writer_writes_nothing(tmp_path):
    writer = metric_writers.MetricWriter(str(tmp_path / "w"), enabled=False)
    writer.write(1, ROWS[0])
    assert writer.flush()
    writer.close()
    assert not (tmp_path / "w").exists()


def test_trim_metrics_and_write_text_local(tmp_path):
    lines = [json.dumps({"step": s, "x": s * 0.5}) for s in range(6)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + '\n{"step": 6, "x"')  # a torn last row (killed run)
    metric_writers.trim_metrics(str(tmp_path), 3)
    assert path.read_text() == "\n".join(lines[:4]) + "\n"
    metric_writers.trim_metrics(str(tmp_path / "none"), 3)  # no metrics.jsonl: nothing created
    assert not (tmp_path / "none").exists()
    metric_writers.write_text(str(tmp_path / "config.json"), '{"a": 1}')
    metric_writers.write_text(str(tmp_path / "config.json"), '{"a": 2}')
    assert (tmp_path / "config.json").read_text() == '{"a": 2}'
    assert sorted(os.listdir(tmp_path)) == ["config.json", "metrics.jsonl"]


def test_trim_metrics_drops_damaged_lines_with_a_warning(tmp_path, caplog):
    """Bytes that are not UTF-8, JSON that is not a row (a list, a row without an int step)
    among good rows: dropped, counted in one warning; the good rows kept in order."""
    good = [json.dumps({"step": s}).encode() for s in range(4)]
    bad = [bytes(range(128, 256)), b"[1, 2]", b'{"x": 1}', b'{"step": "2"}']
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n".join([good[0], bad[0], good[1], *bad[1:], good[2], good[3]]) + b"\n")
    with caplog.at_level("WARNING"):
        metric_writers.trim_metrics(str(tmp_path), 2)
    assert path.read_bytes() == b"\n".join(good[:3]) + b"\n"
    (warning,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert warning.startswith(f"{path}: dropped 4 line(s) that are not JSON rows with a step")


class _Upload(io.BytesIO):
    """A write handle of the fake store: the object appears, whole, when the handle closes."""

    def __init__(self, target: str, text: bool):
        super().__init__()
        self._target, self._text = target, text

    def write(self, data):
        return super().write(data.encode() if self._text else data)

    def close(self):
        if not self.closed:
            os.makedirs(os.path.dirname(self._target), exist_ok=True)
            with open(self._target, "wb") as f:
                f.write(self.getvalue())
        super().close()


class FakeObjectStore(epath_backend._OsPathBackend):
    """An epath backend for gs:// paths that keeps objects under a local directory."""

    def __init__(self, root: str):
        self.root = root
        self.fail_writes = False
        self.opened_modes: list[str] = []

    def local(self, path) -> str:
        path = os.fspath(path)
        assert path.startswith("gs://"), path
        return os.path.join(self.root, path[len("gs://") :])

    def open(self, path, mode):
        self.opened_modes.append(mode)
        if "a" in mode or "+" in mode:
            raise NotImplementedError(f"the object store cannot open {path} in mode {mode!r}")
        if "w" in mode:
            if self.fail_writes:
                raise OSError(f"simulated upload failure of {path}")
            return _Upload(self.local(path), text="b" not in mode)
        return super().open(self.local(path), mode)


for _name in ("exists", "isdir", "listdir", "glob", "makedirs", "mkdir", "rmtree", "remove"):

    def _translated(self, path, *args, _method=getattr(epath_backend._OsPathBackend, _name), **kw):
        return _method(self, self.local(path), *args, **kw)

    setattr(FakeObjectStore, _name, _translated)


@pytest.fixture
def fake_gs(tmp_path, monkeypatch):
    """gs:// paths in this test resolve to FakeObjectStore(tmp_path / 'store'); cwd is tmp_path
    (so a gs:// path wrongly taken as local would show up there as a 'gs:' directory)."""
    store = FakeObjectStore(str(tmp_path / "store"))
    monkeypatch.setitem(gpath._PREFIX_TO_BACKEND, "gs", store)
    monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
    monkeypatch.chdir(tmp_path)
    return store


def test_gs_workdir_on_fake_backend_uploads_rows_and_events_throttled_and_on_close(fake_gs):
    remote = "gs://bucket/run"
    bucket_dir = os.path.join(fake_gs.root, "bucket", "run")
    assert isinstance(epath.Path(remote)._backend, FakeObjectStore)
    writer = metric_writers.MetricWriter(remote, upload_every_s=3600)
    writer.write(0, ROWS[0])  # the first write uploads at once
    jsonl = os.path.join(bucket_dir, "metrics.jsonl")
    assert [r["step"] for r in rows_of(open(jsonl).read())] == [0]
    (events,) = event_files(bucket_dir)
    writer.write(1, ROWS[1])
    writer.write(2, ROWS[2])
    assert [r["step"] for r in rows_of(open(jsonl).read())] == [0]  # not yet: under an hour
    spool = writer._spool
    writer.close()
    got = rows_of(open(jsonl).read())
    assert [r["step"] for r in got] == [0, 1, 2]
    assert got[2]["response_length/hist"] == [1, 2] and got[1]["actor/pg_loss"] == -1.5
    assert event_files(bucket_dir) == [events]
    with open(os.path.join(bucket_dir, events), "rb") as f:
        assert read_events(f.read()) == expected_scalars(ROWS)
    assert not os.path.exists(spool)  # uploaded: the local spool is gone
    assert not os.path.exists("gs:")  # nothing went to a local directory named after the URI
    assert all("a" not in m for m in fake_gs.opened_modes)

    # Resume: trim the rows after step 1, then a new writer continues the same object.
    metric_writers.trim_metrics(remote, 1)
    assert [r["step"] for r in rows_of(open(jsonl).read())] == [0, 1]
    with metric_writers.MetricWriter(remote, upload_every_s=3600) as writer:
        writer.write(2, {"actor/pg_loss": 7.0})
    got = rows_of(open(jsonl).read())
    assert [r["step"] for r in got] == [0, 1, 2] and got[2] == {"step": 2, "actor/pg_loss": 7.0}
    second = [n for n in event_files(bucket_dir) if n != events]
    assert len(second) == 1
    with open(os.path.join(bucket_dir, second[0]), "rb") as f:
        assert read_events(f.read()) == {("actor/pg_loss", 2): 7.0}
    metric_writers.write_text(remote + "/config.json", '{"seed": 0}')
    assert open(os.path.join(bucket_dir, "config.json")).read() == '{"seed": 0}'


def test_gs_failed_uploads_are_retried_and_exit_uploads_an_unclosed_writer(fake_gs, monkeypatch):
    exit_hooks = []
    monkeypatch.setattr(metric_writers.atexit, "register", exit_hooks.append)
    jsonl = os.path.join(fake_gs.root, "bucket", "run", "metrics.jsonl")
    writer = metric_writers.MetricWriter("gs://bucket/run", upload_every_s=0)
    fake_gs.fail_writes = True
    writer.write(0, ROWS[0])  # the upload fails: logged, the run goes on
    writer.write(1, ROWS[0])
    assert not writer.flush()
    assert not os.path.exists(jsonl)
    fake_gs.fail_writes = False
    assert writer.flush()  # the retry uploads every row written so far
    assert [r["step"] for r in rows_of(open(jsonl).read())] == [0, 1]
    writer._upload_every_s = 3600
    writer.write(2, ROWS[2])
    assert [r["step"] for r in rows_of(open(jsonl).read())] == [0, 1]
    assert writer.close in exit_hooks  # never closed: interpreter exit uploads the rest
    writer.close()
    assert [r["step"] for r in rows_of(open(jsonl).read())] == [0, 1, 2]

    fake_gs.fail_writes = True  # the last upload fails: the local spool is kept
    writer = metric_writers.MetricWriter("gs://bucket/run2", upload_every_s=3600)
    writer.write(5, ROWS[0])
    writer.close()
    with open(os.path.join(writer._spool, "metrics.jsonl")) as f:
        assert rows_of(f.read()) == [{"step": 5, **ROWS[0]}]
    shutil.rmtree(writer._spool)
