"""Helpers of the tests that run the trainer's CLI in subprocesses (kills, full disks, resume
checks): their environment, with the session's persistent compilation cache (each start after the
first loads the compiled step from disk instead of compiling it), and metrics.jsonl readers."""

import json
import os
import subprocess
import sys

from conftest import REPO

# The tiny config without the supervised warm-up: each start is a few seconds.
TINY = ["--config=configs/grpo_math.py:tiny", "--config.warmup.sft_steps=0"]


def cache_env() -> dict:
    """os.environ on CPU: with the session's persistent compilation cache (tests/conftest.py),
    which the trainer runs in this process and in other workers share, and this checkout first
    on PYTHONPATH (a script such as tests/helpers/write_fault.py imports its jrl, whatever jrl
    is installed)."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}


def start(args, env, main=("-m", "jrl.train")) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *main, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(args, env, main=("-m", "jrl.train"), timeout=300) -> tuple[int, str]:
    """(exit status, stdout + stderr) of a finished run (the run's own lines are on stdout, so
    the last line is stderr's last, e.g. an `error: ...` line)."""
    proc = start(args, env, main)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


def steps(workdir) -> list[int]:
    """The steps of metrics.jsonl's complete rows, in file order (a torn last line is skipped)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line)["step"])
            except ValueError:
                pass
    return out


def rows(workdir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def comparable(row: dict) -> dict:
    """A metrics row without its timings (which differ from run to run)."""
    return {k: v for k, v in row.items() if not k.startswith(("timing_s", "perf/throughput"))}
