"""Long runs: a resumed run continues the same trajectory (bitwise on CPU), also after kill -9 and
SIGTERM, with multi-turn tool calls on, and a truncated newest checkpoint falls back to the one
before."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO

# Tiny run, 6 steps, a checkpoint every step; no warm-up so each start is quick. Multi-turn
# rollouts with the calc tool (compact format): the random model's `>` pauses rows and the host
# answers them (mostly with errors: a `>` without a `<`), so resuming is checked with tools on;
# one-turn runs are killed and resumed at random moments in tests/kill_test.py.
ARGS = [
    "--config=configs/grpo_math.py:tiny",
    "--config.total_steps=6",
    "--config.warmup.sft_steps=0",
    "--config.checkpoint.every_steps=1",
    "--config.checkpoint.async_save=False",
    "--config.data.max_response_length=16",
    "--config.rollout.multi_turn.enable=True",
    "--config.rollout.multi_turn.format=compact",
    "--config.rollout.multi_turn.max_tool_response_length=4",
]


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """A persistent compilation cache shared by the runs: each start after the first loads the
    compiled step from disk instead of compiling it again."""
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    yield
    for k in (
        "JAX_COMPILATION_CACHE_DIR",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
    ):
        os.environ.pop(k, None)


def _train(workdir, *extra, wait=True):
    """Runs the trainer in a subprocess; with wait, returns its stdout + stderr (and checks
    exit 0)."""
    cmd = [sys.executable, "-m", "jrl.train", f"--workdir={workdir}", *ARGS, *extra]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if not wait:
        return proc
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out + err


def _rows(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def _comparable(row):
    # wall-clock figures differ between runs (agent_loop/tool_calls/*: seconds in tool calls)
    skip = ("timing_s", "perf/throughput", "agent_loop/")
    return {k: v for k, v in row.items() if not k.startswith(skip)}


def _wait_for_checkpoint(workdir, step, proc, timeout=240):
    path = os.path.join(workdir, "checkpoints", str(step))
    t = time.time()
    while not os.path.isdir(path):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() - t < timeout
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    _train(workdir)
    assert sum(row.get("tool_call_counts/mean", 0) for row in _rows(workdir)) > 0  # tools ran
    return workdir


def test_kill_9_then_resume_with_tools_on_reaches_the_same_metrics(reference_run, tmp_path):
    proc = _train(tmp_path, wait=False)
    _wait_for_checkpoint(tmp_path, 3, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(_rows(tmp_path)) < 7  # it really died before the end
    _train(tmp_path)
    want, got = _rows(reference_run), _rows(tmp_path)
    assert [r["step"] for r in got] == list(range(7))
    for a, b in zip(want, got):
        assert _comparable(a) == _comparable(b), a["step"]


def test_sigterm_saves_the_step_reached_and_exits_42(reference_run, tmp_path):
    proc = _train(tmp_path, wait=False)
    _wait_for_checkpoint(tmp_path, 2, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 42
    last = max(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
    assert last == _rows(tmp_path)[-1]["step"] and last < 6
    _train(tmp_path)
    assert _comparable(_rows(tmp_path)[-1]) == _comparable(_rows(reference_run)[-1])


def test_truncated_newest_checkpoint_falls_back_to_previous(reference_run, tmp_path):
    _train(tmp_path, "--config.total_steps=4")
    newest = tmp_path / "checkpoints" / "4" / "state"
    for d, _, files in os.walk(newest):  # cut every file of the saved state in half
        for f in files:
            path = os.path.join(d, f)
            with open(path, "r+b") as fh:
                fh.truncate(os.path.getsize(path) // 2)
    err = _train(tmp_path)
    assert "checkpoints/4" in err  # the warning names the skipped checkpoint
    assert "resumed from" in err and "at step 3" in err
    assert _comparable(_rows(tmp_path)[-1]) == _comparable(_rows(reference_run)[-1])
