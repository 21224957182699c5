"""Kills at any moment lose nothing: a run is SIGKILLed at random moments (while it starts up,
during a step, while an asynchronous checkpoint is being written, right after a metrics row is
flushed) at least 10 times and resumed each time. It ends with the parameters and metrics of an
uninterrupted run, metrics.jsonl holds every step once and in order, and no kill cost more than
checkpoint.every_steps steps (rows written before the kill minus the step resumed from)."""

import os
import random
import re
import signal
import time

import numpy as np
import orbax.checkpoint as ocp

from helpers.cli import TINY, cache_env, comparable, rows, run, start, steps

TOTAL, EVERY, KILLS = 24, 2, 10
ARGS = [*TINY, f"--config.total_steps={TOTAL}", f"--config.checkpoint.every_steps={EVERY}"]


def _state(workdir):
    path = os.path.join(workdir, "checkpoints", str(TOTAL), "state")
    return ocp.StandardCheckpointer().restore(path)


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {prefix + k: v})
    return out


def _saving(workdir) -> bool:
    """True while an asynchronous save has an unfinished (tmp) directory."""
    for sub in ("checkpoints", "reference"):
        d = os.path.join(workdir, sub)
        if os.path.isdir(d) and any("orbax-checkpoint-tmp" in n for n in os.listdir(d)):
            return True
    return False


def _kill_at(proc, workdir, moment, rng, first_new_row) -> bool:
    """Waits for `moment` and SIGKILLs; False if the run ended first."""
    deadline = time.time() + 240
    if moment == "startup":
        end = time.time() + rng.uniform(0.5, 6.0)
        while time.time() < end and proc.poll() is None:
            time.sleep(0.01)
    else:
        while proc.poll() is None and time.time() < deadline:
            new_rows = [s for s in steps(workdir) if s >= first_new_row]
            if moment == "checkpoint" and new_rows and _saving(workdir):
                break
            if moment in ("step", "row") and new_rows:
                break
            if moment == "checkpoint" and len(new_rows) > 2 * EVERY:
                break  # no save seen in flight: kill anyway
            time.sleep(0.002)
        if moment == "step":
            time.sleep(rng.uniform(0.0, 0.4))  # somewhere in the next step (or its save)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def test_sigkill_at_random_moments_then_resume_matches_uninterrupted(tmp_path_factory):
    env = {**cache_env(), "PYTHONUNBUFFERED": "1"}  # stdout up to the kill
    reference = tmp_path_factory.mktemp("kill_reference") / "w"
    code, err = run([*ARGS, f"--workdir={reference}"], env)
    assert code == 0, err[-3000:]

    workdir = tmp_path_factory.mktemp("killed") / "w"
    rng = random.Random(0)
    moments, losses, stderrs, pending = [], [], [], []  # pending: rows at kills not yet resumed
    while True:
        proc = start([*ARGS, f"--workdir={workdir}"], env)
        if len(moments) < KILLS:
            moment = rng.choice(["startup", "step", "checkpoint", "row"])
            first_new_row = (max(steps(workdir), default=-1) + 1) if moment != "startup" else 0
            killed = _kill_at(proc, workdir, moment, rng, first_new_row)
        else:
            killed = False
        out, err = proc.communicate(timeout=300)
        stderrs.append(err)
        resumed = re.search(r"resumed from \S+ at step (\d+)", out)
        if resumed or "step 0: val/accuracy" in out:  # this life got going: earlier kills' cost
            losses += [row - (int(resumed.group(1)) if resumed else 0) for row in pending]
            pending = []
        if not killed:
            assert proc.returncode == 0, err[-3000:]
            break
        moments.append(moment)
        pending.append(max(steps(workdir), default=0))  # the rows it had written

    assert len(moments) >= KILLS, moments
    assert steps(workdir) == list(range(TOTAL + 1))  # every step once, in order
    want, got = rows(reference), rows(workdir)
    for a, b in zip(want, got):
        assert comparable(a) == comparable(b), a["step"]
    assert len(losses) == len(moments) and max(losses) <= EVERY, (moments, losses)
    assert any("Taking over the lock" in e for e in stderrs)  # a killed run's lock, taken over
    ref_state, state = _flat(_state(reference)), _flat(_state(workdir))
    assert ref_state.keys() == state.keys()
    for name in ref_state:
        np.testing.assert_array_equal(np.asarray(state[name]), np.asarray(ref_state[name]), name)
    print("moments:", moments, "steps lost per kill:", losses)
