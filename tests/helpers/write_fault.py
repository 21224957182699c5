"""`python tests/helpers/write_fault.py TARGET:N <python -m jrl.train arguments>`: the trainer's
CLI with a write failing as on a full disk (tests/run/disk_full_test.py):

- metrics:N     the N-th row written to metrics.jsonl raises ENOSPC;
- config:N      the N-th write of config.json raises ENOSPC;
- checkpoint:N  from the save of step N on, files may grow to 32 KiB only (RLIMIT_FSIZE, SIGXFSZ
                ignored), so the checkpoint's array files fail for real inside tensorstore, in the
                background of the asynchronous save (EFBIG), while the small files still write.
"""

import errno
import os
import resource
import signal
import sys

from absl import app

from jrl.run import checkpoint as checkpoint_lib
from jrl.run import metric_writers as metric_files
from jrl import train
from jrl.run import cli


def _enospc(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


class _FailingFile:
    """A text file whose n-th write raises ENOSPC."""

    def __init__(self, f, n):
        self._f, self._left = f, n

    def write(self, text):
        self._left -= 1
        if self._left == 0:
            raise _enospc(self._f.name)
        return self._f.write(text)

    def __getattr__(self, name):
        return getattr(self._f, name)


def install(target: str, n: int) -> None:
    if target == "metrics":
        real_open = open

        def fake_open(path, mode="r", *args, **kwargs):
            f = real_open(path, mode, *args, **kwargs)
            is_metrics = os.path.basename(os.fspath(path)) == metric_files.METRICS_FILE
            return _FailingFile(f, n) if is_metrics and "a" in mode else f

        metric_files.open = fake_open  # the name MetricWriter opens files with
    elif target == "config":
        real_write_text, count = metric_files.write_text, [0]

        def write_text(path, text):
            if os.path.basename(os.fspath(path)) == "config.json":
                count[0] += 1
                if count[0] == n:
                    raise _enospc(path)
            return real_write_text(path, text)

        metric_files.write_text = write_text
    elif target == "checkpoint":
        real_save = checkpoint_lib.Checkpointer.save

        def save(self, step, *args, **kwargs):
            if step == n:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
                resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, hard))
            return real_save(self, step, *args, **kwargs)

        checkpoint_lib.Checkpointer.save = save
    else:
        raise SystemExit(f"unknown target {target!r}")


if __name__ == "__main__":
    target, _, n = sys.argv.pop(1).partition(":")
    install(target, int(n))
    app.run(train.main, flags_parser=cli.parse_flags)
