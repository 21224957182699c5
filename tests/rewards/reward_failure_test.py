"""A user reward that fails in any way stops the run cleanly (jrl/rewards/worker.py): it runs in a
worker process, and inside the jitted step a failure is recorded (the step goes on with zero
scores) for the trainer to read after the step, as one line naming the sample.

In process: every way a reward function can fail (an exception, NaN, a wrong count, None,
strings, sys.exit, KeyboardInterrupt, os._exit, a hang past its time limit, a stop request while
it runs), each named by `rewards.check` after a jitted call. Through the command line (one
workdir, two starts): SIGTERM while a reward hangs ends in status 42 with the checkpoints before
that step intact, and the resumed run whose reward calls os._exit ends in status 5 with one
`error:` line, nothing of the failed step written or saved.
"""

import json
import os
import re
import signal
import textwrap
import time

import jax
import numpy as np
import pytest

from helpers.cli import TINY, cache_env, last_line, start
from helpers.reward_batches import TEXTS, char_gsm8k_task, jitted, response_arrays, rows_of
from jrl import rewards
from jrl.rewards import worker

FAULTY = textwrap.dedent(
    """
    import os, sys, time
    from fractions import Fraction

    def _three(responses):  # TEXTS[1] is "so 3": sample 1 fails
        return any("3" in r for r in responses)

    def raises(rs, ts):
        if _three(rs):
            raise ValueError("cannot score")
        return [0.0] * len(rs)

    def nan(rs, ts):
        return [float("nan") if "3" in r else 0.0 for r in rs]

    def one_score(rs, ts):
        return [0.0]

    def none(rs, ts):
        return None

    def text(rs, ts):
        return ["1.0"] * len(rs)

    def exits(rs, ts):
        if _three(rs):
            sys.exit(3)
        return [0.0] * len(rs)

    def interrupts(rs, ts):
        if _three(rs):
            raise KeyboardInterrupt("pressed")
        return [0.0] * len(rs)

    def os_exit(rs, ts):
        if _three(rs):
            os._exit(0)
        return [0.0] * len(rs)

    def hangs(rs, ts):
        if _three(rs):
            time.sleep(600)
        return [0.0] * len(rs)

    def noisy_fractions(rs, ts):  # prints on stdout, returns Fractions: both fine
        print("scoring", len(rs))
        return [Fraction(len(r), 2) for r in rs]
    """
)

SAMPLE_1 = "sample 1 \\(split eval, row_id 0, response 'so 3'\\)"
CASES = {
    "raises": f"failed on {SAMPLE_1}: ValueError: cannot score; fix the reward function.",
    "nan": f"returned nan for {SAMPLE_1}: return a finite float.",
    "one_score": "returned 1 scores for 4 responses: return one float per response.",
    "none": "returned a NoneType, not a sequence: return one float per response \\(4\\).",
    "text": "returned '1.0' \\(str\\) for sample 0 \\(split eval, row_id 0, response '#### 2'\\): "
    "return a float.",
    "exits": f"failed on {SAMPLE_1}: SystemExit: 3; fix the reward function.",
    "interrupts": f"failed on {SAMPLE_1}: KeyboardInterrupt: pressed; fix the reward function.",
    "os_exit": "ended its process \\(exit status 0: os._exit, a crash or the OOM killer\\) on "
    "sample 1 \\(response 'so 3'\\); fix the reward function.",
    "hangs": "took longer than reward.timeout_s=0.5s on sample 1 \\(response 'so 3'\\); fix the "
    "reward function, or raise reward.timeout_s.",
}


@pytest.fixture
def task(tmp_path):
    return char_gsm8k_task(tmp_path)


@pytest.fixture
def faulty(tmp_path, monkeypatch):
    (tmp_path / "jrlfaulty.py").write_text(FAULTY)
    monkeypatch.syspath_prepend(str(tmp_path))  # passed on to the worker processes
    return "jrlfaulty"


def deferred(name, task, timeout_s=0.5):
    reward = rewards.get_reward(name, task, reward_timeout_s=timeout_s)
    rewards.defer_failures(reward)
    return reward


@pytest.mark.parametrize("fn", list(CASES))
def test_each_failure_is_one_line_naming_the_sample(task, faulty, fn):
    name = f"{faulty}:{fn}"
    reward = deferred(name, task)
    batch, (r, mk) = rows_of(task), response_arrays()
    scores = jax.block_until_ready(jitted(reward)(batch, r, mk))  # no exception: zeros
    np.testing.assert_array_equal(np.asarray(scores), np.zeros(4))
    with pytest.raises(rewards.RewardFailed) as e:
        rewards.check(reward)
    assert not isinstance(e.value, rewards.RewardInterrupted)
    message = str(e.value)
    assert "\n" not in message
    assert re.fullmatch(f"reward '{name}' {CASES[fn]}", message), message
    rewards.check(reward)  # the record was cleared
    if fn in ("os_exit", "hangs"):  # the worker is gone: later calls fail at once, same message
        t = time.monotonic()
        jax.block_until_ready(jitted(reward)(batch, r, mk))
        assert time.monotonic() - t < 0.5
        with pytest.raises(rewards.RewardFailed, match="on sample 1"):
            rewards.check(reward)


def test_a_working_function_with_prints_and_fractions(task, faulty):
    reward = deferred(f"{faulty}:noisy_fractions", task)
    batch, (r, mk) = rows_of(task), response_arrays()
    scores = np.asarray(jitted(reward)(batch, r, mk))
    np.testing.assert_array_equal(scores, [len(t) / 2 for t in TEXTS])
    rewards.check(reward)


def test_without_defer_a_failure_still_raises_inside_jit(task, faulty):
    reward = rewards.get_reward(f"{faulty}:os_exit", task, reward_timeout_s=5.0)
    batch, (r, mk) = rows_of(task), response_arrays()
    with pytest.raises(Exception, match="ended its process \\(exit status 0"):
        jax.block_until_ready(jitted(reward)(batch, r, mk))


def test_a_stop_request_abandons_a_running_reward(task, faulty, monkeypatch):
    monkeypatch.setattr(worker, "STOP_GRACE_S", 0.2)
    reward = deferred(f"{faulty}:hangs", task, timeout_s=600.0)
    batch, (r, mk) = rows_of(task), response_arrays()
    rewards.request_stop()
    try:
        t = time.monotonic()
        jax.block_until_ready(jitted(reward)(batch, r, mk))
        assert time.monotonic() - t < 5.0
        with pytest.raises(rewards.RewardInterrupted, match="still running 0s after the stop"):
            rewards.check(reward)
    finally:
        rewards.clear_stop()


def test_a_cpu_mesh_cuts_a_user_reward_s_time_limit():
    """XLA ends the process when a host callback holds 8 CPU devices at a collective for 60 s:
    a user reward gets at most 15 s there (the tests' 8 host devices), jrl's own rewards keep
    the setting (they run in process, without it)."""
    from conftest import tiny_config
    from jrl.run import trainer

    assert jax.device_count() == 8 and jax.default_backend() == "cpu"
    assert trainer.reward_time_limit(tiny_config(**{"task.reward": "mod:fn"})) == 15.0
    assert trainer.reward_time_limit(tiny_config(**{"task.reward": "gsm8k"})) == 300.0
    short = tiny_config(**{"task.reward": "mod:fn", "reward.timeout_s": 2.0})
    assert trainer.reward_time_limit(short) == 2.0


# ---------------------------------------------------------------------------- command line

ROWS = [
    {"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2)]
]
# One user reward, told by the environment what to do on its AT-th call in a process.
REWARD = textwrap.dedent(
    """
    import os, time

    CALLS = [0]

    def score(responses, truths):
        CALLS[0] += 1
        if CALLS[0] == int(os.environ.get("AT", "0")):
            if os.environ["MODE"] == "hang":
                open(os.environ["MARK"], "w").close()
                time.sleep(600)
            os._exit(0)
        return [float(t in r) for r, t in zip(responses, truths)]
    """
)


def _checkpoints(workdir) -> list[int]:
    return sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())


def _steps(workdir) -> list[int]:
    return [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]


def test_cli_sigterm_in_a_hanging_reward_exits_42_then_os_exit_in_it_exits_5(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (tmp_path / "my_reward.py").write_text(REWARD)
    workdir, mark = tmp_path / "w", tmp_path / "hanging"
    args = [
        *TINY,
        "--config.task.name=gsm8k",
        f"--config.task.train_files={data}",
        "--config.task.eval_size=1",
        "--config.task.template={question} Answer:",
        "--config.data.max_response_length=8",
        f"--config.task.reward={tmp_path / 'my_reward.py'}:score",
        "--config.total_steps=4",
        "--config.checkpoint.every_steps=1",
        f"--workdir={workdir}",
    ]
    # Calls: 1 the step-0 eval, 2 step 1, 3 step 2, which hangs until SIGTERM (5 s of grace).
    env = {**cache_env(), "MODE": "hang", "AT": "3", "MARK": str(mark)}
    proc = start(args, env)
    deadline = time.time() + 280
    while not mark.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 42, err[-3000:]
    assert time.monotonic() - t < 100  # the 5 s of grace and the step's end, not the hang
    assert "still running 5s after the stop request" in err and "Traceback" not in err
    assert _checkpoints(workdir) == [1] and _steps(workdir) == [0, 1]  # nothing of step 2

    # Resumed at step 1 (no eval at a resume): call 1 is step 2's, and it calls os._exit.
    proc = start(args, {**cache_env(), "MODE": "exit", "AT": "1"})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 5, err[-3000:]
    assert last_line(err).startswith(
        f"error: reward '{tmp_path / 'my_reward.py'}:score' ended its process (exit status 0"
    ), last_line(err)
    assert "Traceback" not in err
    assert _checkpoints(workdir) == [1] and _steps(workdir) == [0, 1]
