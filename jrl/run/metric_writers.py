"""Metric writers: `metrics.jsonl` and tensorboard events in the workdir; a console progress bar.

The workdir may be a local directory or any `etils.epath` URI (`gs://bucket/run`, ...). Local
workdirs are written in place: rows are appended to `metrics.jsonl` and flushed one by one, and
tensorboardX writes its event file straight into the directory. Object stores have no append and
show an object only once its upload is complete, so for a URI workdir the writer spools both files
in a local temporary directory and uploads them whole (see `MetricWriter`).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import tempfile
import time
from typing import Mapping

from absl import logging as absl_logging
from etils import epath
import numpy as np
import tqdm

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # a few eval answers per eval: {"step", "prompt", "completion", ...}
JSONL_FILES = (METRICS_FILE, SAMPLES_FILE)

# Progress-bar fields: (label, metric name, format); "kl" only for a run with a KL term.
_BAR_FIELDS = (
    ("reward", "critic/score/mean", "{:.3f}"),
    ("acc", "val/accuracy", "{:.3f}"),
    ("kl", None, "{:.1e}"),  # the metric of the run's KL to the reference (ProgressBar's `kl`)
    ("tok/s", "perf/throughput", "{:.0f}"),
    ("calls", "tool_call_counts/mean", "{:.2f}"),  # multi-turn: tool calls per answer
    ("tool err", "tool_calls/errors", "{:.0f}"),  # multi-turn: calls answered with an error
)


def to_python(metrics: Mapping) -> dict:
    """Host floats / ints from device or numpy scalars."""
    out = {}
    for k, v in metrics.items():
        v = np.asarray(v)
        out[k] = v.item() if v.ndim == 0 else v.tolist()
    return out


def is_remote(path) -> bool:
    """True for a URI (`gs://...`, `s3://...`): a path that etils.epath maps to a remote store."""
    return "://" in os.fspath(path)


def write_text(path, text: str) -> None:
    """Replaces the file at `path` (local or an epath URI) with `text`, all or nothing.

    Local: written to a sibling temporary file, then renamed over `path` (a crash leaves the old
    or the new content, never half of it). URI: one whole-object upload, which object stores
    such as GCS commit atomically.
    """
    if is_remote(path):
        epath.Path(path).write_text(text)
        return
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def trim_metrics(workdir, last_step: int) -> None:
    """On resume, drops the `metrics.jsonl` and `samples.jsonl` rows of steps after `last_step`
    (they are redone).

    Works for local and URI workdirs; a missing file is left missing. A line that is not a JSON
    object with an integer "step" (the torn last line of a killed run, or bytes damaged on disk)
    is dropped, with a warning counting them.
    """
    for name in JSONL_FILES:
        path = epath.Path(workdir) / name
        if not path.exists():
            continue
        kept, dropped = [], 0
        for line in path.read_bytes().splitlines():
            step = _step_of(line)
            if step is None:
                dropped += line.strip() != b""
            elif step <= last_step:
                kept.append(line.decode("utf-8") + "\n")
        if dropped:
            absl_logging.warning(
                "%s: dropped %d line(s) that are not JSON rows with a step (a line cut short by "
                "a kill, or damaged bytes).",
                path,
                dropped,
            )
        write_text(os.fspath(path), "".join(kept))


def _step_of(line: bytes) -> int | None:
    """The "step" of a metrics / samples row, or None for a line that is not one."""
    try:
        row = json.loads(line.decode("utf-8"))
    except ValueError:  # not UTF-8 (UnicodeDecodeError is a ValueError) or not JSON
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class MetricWriter:
    """Writes one JSON object per `write` to `workdir/metrics.jsonl` and the same scalars (the
    finite int / float ones) to tensorboard events in `workdir`. `enabled=False` (every process
    but 0 in a multi-host run) writes nothing.

    Local `workdir`: rows are appended to `metrics.jsonl` and flushed one by one; the event file
    is written in `workdir` by tensorboardX.

    URI `workdir` (`gs://bucket/run` or anything else `etils.epath` opens): rows are appended to
    a local spool copy of `metrics.jsonl` (seeded with the remote file's rows, so a resumed run
    keeps its history) and tensorboardX writes events into a local spool directory (its own
    gs:// writer needs google-cloud-storage, which jrl does not depend on); both files are
    uploaded through epath as whole objects (each upload is atomic on GCS: a reader sees the
    previous or the new version) at the first write, then at most every `upload_every_s`
    seconds, on `flush()`, on `close()`, and at interpreter exit if `close()` was never called.
    Rewriting whole objects costs bandwidth in proportion to the files (metrics.jsonl grows about
    2 KB a step) but needs no append, no object composition and no locking. A failed upload is
    logged and retried at the next one; nothing is lost, as each upload rewrites the files whole.
    If the upload in `close()` fails, the spool directory is kept and its path logged. A process
    killed outright (SIGKILL) loses the rows written since the last upload: call `flush()` after
    each checkpoint save, so that every step a resumed run will not redo has its row uploaded.
    """

    def __init__(self, workdir, enabled: bool = True, upload_every_s: float = 60.0):
        self.enabled = enabled
        self._closed = not enabled
        if not enabled:
            return
        from tensorboardX import SummaryWriter  # imports torch when installed: only when used

        self.remote = is_remote(workdir)
        self._upload_every_s = upload_every_s
        if not self.remote:
            workdir = os.fspath(workdir)
            os.makedirs(workdir, exist_ok=True)
            self._workdir = workdir
            self._files = {METRICS_FILE: open(os.path.join(workdir, METRICS_FILE), "a")}
            self._jsonl = self._files[METRICS_FILE]  # samples.jsonl: opened by its first rows
            self._tb = SummaryWriter(logdir=workdir)
            return
        self._remote = epath.Path(workdir)
        self._spool = tempfile.mkdtemp(prefix="jrl-metrics-")
        self._tb_dir = os.path.join(self._spool, "events")
        self._uploaded: dict[str, int] = {}  # spool file -> size at its last upload
        self._names: dict[str, str] = {}  # spool file -> its name in the workdir
        self._last_upload = -math.inf
        self._files = {}
        for name in JSONL_FILES:
            local, remote = os.path.join(self._spool, name), self._remote / name
            with open(local, "w") as f:
                if remote.exists():
                    text = remote.read_text()
                    f.write(text if not text or text.endswith("\n") else text + "\n")
            self._uploaded[local] = os.path.getsize(local)
            self._files[name] = open(local, "a")
        self._jsonl = self._files[METRICS_FILE]
        self._tb = SummaryWriter(logdir=self._tb_dir)
        atexit.register(self.close)

    def write(self, step: int, metrics: Mapping) -> None:
        if not self.enabled:
            return
        metrics = to_python(metrics)
        self._jsonl.write(json.dumps({"step": int(step), **metrics}) + "\n")
        self._jsonl.flush()
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self._tb.add_scalar(k, v, global_step=step)
        if self.remote and time.monotonic() - self._last_upload >= self._upload_every_s:
            self._upload()

    def write_samples(self, step: int, rows: list[dict], text: str) -> None:
        """Appends `rows` (each with "step" added) to `samples.jsonl` and `text` (markdown) to
        tensorboard as the text summary "samples" at `step`."""
        if not self.enabled:
            return
        if SAMPLES_FILE not in self._files:  # local workdirs only (a URI's spool file exists)
            self._files[SAMPLES_FILE] = open(os.path.join(self._workdir, SAMPLES_FILE), "a")
        f = self._files[SAMPLES_FILE]
        for row in rows:
            f.write(json.dumps({"step": int(step), **row}) + "\n")
        f.flush()
        self._tb.add_text("samples", text, global_step=step)

    def flush(self) -> bool:
        """Makes every row and event written so far durable in the workdir (for a URI workdir:
        uploads now). Returns False if an upload failed (the failure is logged)."""
        if not self.enabled or self._closed:
            return True
        for f in self._files.values():
            f.flush()
        self._tb.flush()
        return self._upload() if self.remote else True

    def close(self) -> None:
        """Flushes and closes; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        for f in self._files.values():
            f.close()
        self._tb.close()
        if not self.remote:
            return
        atexit.unregister(self.close)
        if self._upload():
            shutil.rmtree(self._spool, ignore_errors=True)
        else:
            absl_logging.error(
                "metrics for %s were not uploaded; they are kept in %s (copy them there by hand).",
                self._remote,
                self._spool,
            )

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _remote_path(self, local: str) -> epath.Path:
        """Where a spool file goes. An event file is named after the second it was opened in and
        the host; one of an earlier writer with that name (a quick restart) is never replaced."""
        if local not in self._names:
            name = os.path.basename(local)
            if local not in {f.name for f in self._files.values()}:
                base, n = name, 0
                while (self._remote / name).exists():
                    n += 1
                    name = f"{base}.{n}"
            self._names[local] = name
        return self._remote / self._names[local]

    def _upload(self) -> bool:
        """Uploads the spool files that changed since their last upload, whole."""
        self._last_upload = time.monotonic()  # a failed attempt also waits for the next slot
        self._tb.flush()
        files = [f.name for f in self._files.values()]
        if os.path.isdir(self._tb_dir):
            files += [os.path.join(self._tb_dir, n) for n in sorted(os.listdir(self._tb_dir))]
        try:
            for local in files:
                size = os.path.getsize(local)
                if self._uploaded.get(local) == size:
                    continue  # both files only grow: the same size is the same content
                with open(local, "rb") as f:
                    self._remote_path(local).write_bytes(f.read())
                self._uploaded[local] = size
        except Exception as e:  # a transient store error must not stop a long run
            absl_logging.warning(
                "uploading metrics to %s failed (%s: %s); retrying at the next upload.",
                self._remote,
                type(e).__name__,
                e,
            )
            return False
        return True


class ProgressBar:
    """tqdm bar over RL steps: reward, last eval accuracy, KL to the reference (the metric named
    `kl`, e.g. "actor/kl_loss"; None: no KL shown), tokens/s (ETA from tqdm) and, with tools,
    tool calls per answer and tool errors of the step."""

    def __init__(
        self, total: int, initial: int = 0, enabled: bool = True, kl: str | None = None, **tqdm_args
    ):
        self._bar = tqdm.tqdm(
            total=total,
            initial=initial,
            disable=not enabled,
            unit="step",
            dynamic_ncols=True,
            **tqdm_args,
        )
        self._fields = [(label, kl if label == "kl" else key, f) for label, key, f in _BAR_FIELDS]
        self._shown: dict[str, str] = {}

    def update(self, metrics: Mapping, advance: int = 1) -> None:
        for label, key, fmt in self._fields:
            if key is not None and key in metrics:
                self._shown[label] = fmt.format(float(metrics[key]))
        self._bar.set_postfix(self._shown, refresh=False)
        self._bar.update(advance)

    def write(self, line: str) -> None:
        self._bar.write(line)

    def close(self) -> None:
        self._bar.close()
