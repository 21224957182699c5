"""The trainer: python -m jrl.train --config=configs/grpo_math.py [--config.a.b=v] [--workdir=DIR]

Flags and exit codes only; the training itself is `jrl.run.trainer.run`.

Multi-host (TPU pods, multi-node GPU): every process runs the same command with `--distributed`
(JAX reads coordinator, process count and id from the environment: Cloud TPU, SLURM, Open MPI,
JAX_COORDINATOR_ADDRESS) or with `--coordinator_address/--num_processes/--process_id`; the
workdir must be shared (gs:// or a shared filesystem).

Exit status: 0 done; 2 bad config, arguments or input files (nothing written); 42 preempted
(SIGTERM / SIGINT / TPU preemption notice: the step finished and a checkpoint was written; during
start-up, before the first step was done, or when a stop abandoned a user reward, it exits at once
and the committed checkpoints are the resume point; rerun with the same --workdir to continue); 43
a second signal stopped it at once (rerun resumes from the last committed checkpoint); 3 stopped
by the NaN guard (nan_guard.max_consecutive non-finite steps in a row, or one with the guard off;
the message names the quantity); 2 also when another live run holds --workdir or a resume finds
other config fields or input files (jrl/run/workdir.py); 4 a write to the workdir failed (a full
disk: the message names the path; rerun to resume); 5 the reward function failed (it raised,
returned something other than one finite float per response, exited, or ran past
reward.timeout_s: the message names the sample; nothing of that step is kept, the checkpoints
before it are intact).
"""

from __future__ import annotations

import os
import signal

if __name__ == "__main__":  # a signal while the modules below load: nothing to save yet
    from jrl.run import host

    host.use_huge_pages()  # before JAX loads (it may start this command again, once)

    def _exit_preempted(signum, frame):
        name = signal.Signals(signum).name
        os.write(2, f"\n{name} while starting: exiting now with code 42.\n".encode())
        os._exit(42)  # checkpoint.PREEMPTED_EXIT_CODE

    signal.signal(signal.SIGTERM, _exit_preempted)
    signal.signal(signal.SIGINT, _exit_preempted)

import gc
import json
import sys
import time

from absl import app, flags
import jax

from jrl.run import checkpoint as checkpoint_lib
from jrl.run import cli, console, targets, trainer
from jrl import config as config_lib
from jrl import rewards
from jrl.run import workdir as workdir_lib

_CONFIG = cli.define_config()
_WORKDIR = cli.define_workdir(
    "Output directory (checkpoints, metrics.jsonl, tensorboard events, config.json); a workdir "
    "with checkpoints resumes from the newest valid one. Default: runs/<config name>/<time> "
    "under the current directory."
)
_FRESH = flags.DEFINE_bool(
    "fresh",
    False,
    "Start from scratch even if --workdir has checkpoints (they are moved aside to "
    "checkpoints.<time>, not deleted).",
)
_ALLOW_CHANGES = flags.DEFINE_bool(
    "allow_changes",
    False,
    "Resume even if config fields that change the maths or the input files differ from the "
    "run's config.json (jrl/run/workdir.py lists the fields that may always change).",
)
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed",
    False,
    "Multi-host run: call jax.distributed.initialize() first; with no coordinator flags JAX reads "
    "them from the environment (Cloud TPU pods, SLURM, Open MPI, JAX_COORDINATOR_ADDRESS).",
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (implies --distributed)."
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes (implies --distributed)."
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's id, 0 .. num_processes - 1 (implies --distributed)."
)


def _exit_after_write_error(code: int, message: str, workdir: str) -> None:
    """Failing background writers (orbax) keep printing tracebacks until the process ends:
    silence them, then print the error line last and leave at once."""
    gc.collect()  # the run's frames go: the progress bar draws itself last
    sys.stdout.flush()
    sys.stderr.flush()
    console_fd = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    workdir_lib.release(workdir)
    # on a line of its own: a writer may have left a partial line
    os.write(console_fd, f"\nerror: {message}\n".encode())
    os._exit(code)


REWARD_ERROR_EXIT_CODE = 5  # the reward function failed (README's exit-status table)


def main(argv):
    del argv  # cli.parse_flags refused positional arguments
    # A signal from here on: before the first step is done, exit 42 at once; then, stop after
    # the step and save it (jrl/run/checkpoint.py, PreemptionGuard).
    with checkpoint_lib.PreemptionGuard(at_once=True) as guard:
        _main(guard)


def _main(guard):
    console.quiet_console(verbosity_given=flags.FLAGS["verbosity"].present)
    targets.use_gpu_flags()  # before any device use (XLA reads XLA_FLAGS when it starts)
    cfg = _CONFIG.value
    if cfg is None:
        sys.exit("error: --config is required, e.g. --config=configs/grpo_math.py")
    trainer.init_distributed(
        _DISTRIBUTED.value, _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value
    )
    guard.reinstall()  # after JAX's preemption notifier took SIGTERM (multi-process runs)
    if jax.process_count() > 1 and not _WORKDIR.value:
        cli.fail(
            "a multi-process run needs --workdir, shared by all processes "
            "(gs://bucket/run or a shared filesystem)."
        )
    config_name = os.path.splitext(os.path.basename(cli.config_filename()))[0]
    workdir = _WORKDIR.value or os.path.join("runs", config_name, time.strftime("%Y%m%d-%H%M%S"))
    try:
        config_lib.validate(cfg)  # raises ConfigError only before anything is written
        final = trainer.run(
            cfg, workdir, fresh=_FRESH.value, allow_changes=_ALLOW_CHANGES.value, guard=guard
        )
    except (config_lib.ConfigError, checkpoint_lib.CheckpointError) as e:
        failure = (2, str(e))
    except workdir_lib.WriteError as e:
        _exit_after_write_error(workdir_lib.WRITE_ERROR_EXIT_CODE, str(e), workdir)
    except trainer.NonFiniteError as e:
        failure = (3, str(e))
    except rewards.RewardFailed as e:
        failure = (REWARD_ERROR_EXIT_CODE, str(e))
    else:
        summary = {k: final[k] for k in ("val/accuracy_first", "val/accuracy")}
        print(json.dumps({"workdir": workdir, **summary}))
        return
    gc.collect()  # printed once the run's frames are gone (a progress bar draws itself last)
    cli.fail(failure[1], failure[0])


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
