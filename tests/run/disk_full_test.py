"""A full disk while writing metrics, config.json or a checkpoint stops the run with exit status 4
and one line naming the path and the error; the checkpoints committed before stay valid and the
next start resumes from the newest (tests/helpers/write_fault.py injects the errors)."""

import os

from helpers.cli import TINY, cache_env, last_line, run, steps

FAULT = ("tests/helpers/write_fault.py",)


def test_full_disk_exits_4_naming_the_path_and_the_next_start_resumes(tmp_path_factory):
    env = cache_env()
    workdir = tmp_path_factory.mktemp("disk_full") / "w"
    args = [
        *TINY,
        f"--workdir={workdir}",
        "--config.total_steps=6",
        "--config.checkpoint.every_steps=2",
    ]

    def committed():
        return sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())

    # Rows are written for steps 0, 1, 2 (checkpoint 2 commits before row 3), then row 3 fails.
    code, err = run(["metrics:4", *args], env, main=FAULT)
    assert code == 4, err[-3000:]
    assert last_line(err) == (
        f"error: writing {workdir}/metrics.jsonl failed: [Errno 28] No space left on device; "
        "free space (or fix the storage) and rerun the same command: it resumes from the last "
        "checkpoint."
    )
    assert committed() == [2] and steps(workdir) == [0, 1, 2]

    # A resume whose config.json write fails: nothing else is touched.
    code, err = run(["config:1", *args], env, main=FAULT)
    assert code == 4, err[-3000:]
    assert last_line(err).startswith(
        f"error: writing {workdir}/config.json failed: [Errno 28] No space left on device; "
    )
    assert committed() == [2] and steps(workdir) == [0, 1, 2]

    # The save of step 4 fails inside tensorstore, in the background (the file-size limit).
    code, err = run(["checkpoint:4", *args], env, main=FAULT)
    assert code == 4, err[-3000:]
    assert last_line(err).startswith(
        f"error: writing {workdir}/checkpoints failed: [Errno 27] File too large; "
    ), last_line(err)
    assert committed() == [2]
    assert steps(workdir)[-1] == 4

    code, err = run(args, env)
    assert code == 0, err[-3000:]
    assert "at step 2" in err and "Skipping incomplete checkpoint" in err
    assert steps(workdir) == [0, 1, 2, 3, 4, 5, 6]
    assert committed()[-1] == 6
