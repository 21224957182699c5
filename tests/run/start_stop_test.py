"""A run stopped or damaged at any moment resumes: SIGTERM while the trainer starts (its imports,
then its compiles and first step) exits 42 with nothing half-written; the run then goes to its
end; a checkpoint with 64 bytes changed on disk and garbage in metrics.jsonl are each skipped
with a warning, and the resumed run ends with every metrics row once, in order."""

import json
import os
import signal
import time

import numpy as np

from helpers.cli import TINY, cache_env, run, start, steps

TOTAL = 3
ARGS = [*TINY, "--config.checkpoint.every_steps=1", "--config.eval_every=0"]


def _catches_sigterm(pid: int) -> bool:
    """Whether process `pid` has a SIGTERM handler (Linux: its SigCgt mask)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


def _stopped_while_starting(workdir, wait_for: str | None) -> tuple[int, str]:
    """(exit status, stderr) of a start sent SIGTERM as soon as it handles the signal (wait_for
    None: the first lines of jrl/train.py, before its imports) or its stdout shows `wait_for`."""
    env = {**cache_env(), "PYTHONUNBUFFERED": "1"}
    proc = start([*ARGS, f"--config.total_steps={TOTAL}", f"--workdir={workdir}"], env)
    if wait_for is None:
        deadline = time.monotonic() + 60
        while not _catches_sigterm(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.002)
    else:
        for line in proc.stdout:
            if wait_for in line:
                break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def _half_written(workdir) -> list[str]:
    """Files a write in progress leaves: write_text's temporaries, orbax's uncommitted steps."""
    out = []
    for root, dirs, files in os.walk(workdir):
        out += [n for n in files + dirs if ".tmp-" in n or "orbax-checkpoint-tmp" in n]
    return out


def test_sigterm_while_starting_exits_42_and_damage_is_skipped_on_resume(tmp_path):
    workdir = tmp_path / "w"
    code, err = _stopped_while_starting(workdir, None)
    assert code == 42, err[-3000:]
    assert "SIGTERM while starting: exiting now with code 42" in err and "Traceback" not in err

    code, err = _stopped_while_starting(workdir, "workdir:")  # compiling, or in the first step
    assert code == 42, err[-3000:]
    assert "Traceback" not in err and not _half_written(workdir)
    assert (workdir / "jrl.lock").read_text() == ""  # released

    env = cache_env()
    code, err = run([*ARGS, f"--config.total_steps={TOTAL}", f"--workdir={workdir}"], env)
    assert code == 0, err[-3000:]
    assert steps(workdir) == list(range(TOTAL + 1))

    # 64 bytes of the newest checkpoint's largest array file changed (the size kept), and a line
    # of binary garbage inside metrics.jsonl.
    state = workdir / "checkpoints" / str(TOTAL) / "state"
    big = max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(big, "r+b") as f:
        f.seek(big.stat().st_size // 2)
        f.write(np.random.default_rng(0).bytes(64))
    lines = (workdir / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    garbage = bytes(range(128, 256)) + b"\n"  # not UTF-8
    (workdir / "metrics.jsonl").write_bytes(b"".join(lines[:2] + [garbage] + lines[2:]))

    code, err = run([*ARGS, f"--config.total_steps={TOTAL + 1}", f"--workdir={workdir}"], env)
    assert code == 0, err[-3000:]
    assert f"checkpoints/{TOTAL} (DamagedCheckpoint: checksums do not match" in err
    assert "metrics.jsonl: dropped 1 line(s)" in err
    assert (workdir / "checkpoints" / f"{TOTAL}.invalid").is_dir()
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(TOTAL + 2))  # resumed from TOTAL - 1
