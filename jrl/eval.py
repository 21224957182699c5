"""Evaluate a run's checkpoint on its task's eval split: greedy accuracy, mean@k and pass@k.

  python -m jrl.eval --workdir=DIR [--config=configs/X.py] [--step=N] [--k=4] [--temperature=1.0]
                    [--show=N]

The policy of checkpoint N (default: the newest that reads back) answers every eval prompt once
greedily and k times sampled at `--temperature` (with the run's `rollout.top_k` / `rollout.top_p`;
0 samples greedily); the run's reward function scores each answer. Figures:

  eval/greedy_accuracy  mean score of the greedy answers (the trainer's `val/accuracy`)
  eval/mean@k           mean score of the k sampled answers of every prompt
  eval/pass@k           fraction of prompts with a correct answer among their k samples: the
                        unbiased estimator 1 - C(n - c, k) / C(n, k) (Chen et al., 2021) with
                        n = k samples, c of them correct (score >= 1, a correct answer's score in
                        every built-in reward)

They are written to DIR/eval_<step>.json (replacing an earlier evaluation of that step), appended
to DIR's tensorboard events at global step N (a new event file per evaluation; the tags above
with k as a number and "@" as "_", which tensorboard tags cannot hold: `eval/greedy_accuracy`,
`eval/mean_4`, `eval/pass_4`) and printed as one JSON line. The config defaults to the one the
checkpoint was written with; `--config` (with `--config.a.b=v` overrides) replaces it, e.g. to
evaluate on other eval files. `--show=N` first prints the greedy answers to the first N eval
prompts, one line each (`reward R | 'prompt' -> 'completion'`).

Exit status: 0 done; 2 bad arguments (a workdir without checkpoints, a step that is not saved,
k < 1, a negative temperature, ...), with a one-line message on stderr.
"""

from __future__ import annotations

import json

from absl import app, flags

from jrl.run import cli
from jrl.run import samples as samples_lib
from jrl.run.evaluator import Evaluator, check_sampling

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """This CLI's flags, defined when it runs (importing the module defines none)."""
    cli.define_workdir("The run's directory (its checkpoints and config.json).")
    cli.define_config(" Default: the config the checkpoint was written with.")
    flags.DEFINE_integer("step", None, "Checkpoint step to evaluate; default: the newest readable.")
    flags.DEFINE_integer("k", 4, "Sampled answers per eval prompt (mean@k, pass@k).")
    flags.DEFINE_float("temperature", 1.0, "Sampling temperature of the k answers; 0: greedy.")
    flags.DEFINE_integer("seed", 0, "PRNG seed of the sampled answers.")
    flags.DEFINE_integer(
        "show", 0, "Print the greedy answers to the first N eval prompts (reward, prompt, answer)."
    )


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        if not FLAGS.workdir:
            raise ValueError("--workdir is required: the directory of the run to evaluate.")
        check_sampling(FLAGS.k, FLAGS.temperature)
        if FLAGS.show < 0:
            raise ValueError(f"--show={FLAGS.show} must be >= 0 (answers to print).")
        evaluator = Evaluator(
            FLAGS.workdir, step=FLAGS.step, cfg=FLAGS.config, num_samples=FLAGS.show
        )
    except ValueError as e:  # ExportError, CheckpointError, ConfigError, bad flags
        cli.fail(str(e))
    result = evaluator.evaluate(k=FLAGS.k, temperature=FLAGS.temperature, seed=FLAGS.seed)
    for line in samples_lib.lines(evaluator.sample_rows, width=1000):
        print(line)
    print(json.dumps(result))


if __name__ == "__main__":
    _define_flags()
    app.run(main, flags_parser=cli.parse_flags)
