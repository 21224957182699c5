"""Long runs: a resumed run continues the same trajectory (bitwise on CPU), also after kill -9 and
SIGTERM, with multi-turn tool calls on, and a truncated newest checkpoint falls back to the one
before."""

import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO

# Tiny run, 8 steps, a checkpoint every step; no warm-up so each start is quick. Multi-turn
# rollouts with the calc tool (compact format): the random model's `>` pauses rows and the host
# answers them (mostly with errors: a `>` without a `<`), so resuming is checked with tools on;
# one-turn runs are killed and resumed at random moments in tests/run/kill_test.py.
TOTAL = 8
ARGS = [
    "--config=configs/grpo_math.py:tiny",
    f"--config.total_steps={TOTAL}",
    "--config.warmup.sft_steps=0",
    "--config.checkpoint.every_steps=1",
    "--config.checkpoint.async_save=False",
    "--config.data.max_response_length=16",
    "--config.rollout.multi_turn.enable=True",
    "--config.rollout.multi_turn.format=compact",
    "--config.rollout.multi_turn.max_tool_response_length=4",
]


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


def _newest_checkpoint(workdir) -> int:
    return max(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())


def test_sigterm_kill_9_and_a_truncated_checkpoint_then_resume_reach_the_same_metrics(tmp_path):
    """One run's three lives against an uninterrupted run, tools on: SIGTERM after checkpoint 2
    saves the step reached and exits 42; the resumed life is killed with SIGKILL after its first
    new checkpoint; the newest checkpoint is then cut in half, and the last life warns about it,
    resumes from the one before and ends with every metrics row of the uninterrupted run."""
    reference = tmp_path / "uninterrupted"
    _train(reference)
    assert sum(row.get("tool_call_counts/mean", 0) for row in _rows(reference)) > 0  # tools ran
    workdir = tmp_path / "interrupted"

    proc = _train(workdir, wait=False)
    _wait_for_checkpoint(workdir, 2, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 42
    last = _newest_checkpoint(workdir)
    assert last == _rows(workdir)[-1]["step"] and last < TOTAL

    proc = _train(workdir, wait=False)
    _wait_for_checkpoint(workdir, last + 1, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _rows(workdir)[-1]["step"] < TOTAL  # it really died before the end

    newest = _newest_checkpoint(workdir)
    for d, _, files in os.walk(workdir / "checkpoints" / str(newest) / "state"):
        for f in files:  # cut every file of the saved state in half
            path = os.path.join(d, f)
            with open(path, "r+b") as fh:
                fh.truncate(os.path.getsize(path) // 2)
    err = _train(workdir)
    assert f"checkpoints/{newest}" in err  # the warning names the skipped checkpoint
    assert "resumed from" in err and f"at step {newest - 1}" in err
    want, got = _rows(reference), _rows(workdir)
    assert [r["step"] for r in got] == list(range(TOTAL + 1))
    for a, b in zip(want, got):
        assert _comparable(a) == _comparable(b), a["step"]
