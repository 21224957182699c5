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
evaluate on other eval files. `--show=N` first prints the greedy answers to the first N eval prompts,
one line each (`reward R | 'prompt' -> 'completion'`).

Exit status: 0 done; 2 bad arguments (a workdir without checkpoints, a step that is not saved,
k < 1, a negative temperature, ...), with a one-line message on stderr.
"""

from __future__ import annotations

import json
import sys
import uuid

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from etils import epath
from tensorboardX import SummaryWriter

from jrl import config as config_lib
from jrl import export as export_lib
from jrl import rollout, train
from jrl import samples as samples_lib
from jrl import step as step_lib
from jrl.logging import to_python

FLAGS = flags.FLAGS

CORRECT_SCORE = 1.0  # a sample counts as correct for pass@k when its score reaches this


def pass_at_k(n, c, k: int) -> np.ndarray:
    """Unbiased pass@k of prompts with `n` samples, `c` of them correct: the probability that k
    of the n samples drawn without replacement include a correct one, 1 - C(n-c, k) / C(n, k)
    (Chen et al., 2021). `n`, `c` broadcast; k <= n. With n = k: 1 if any sample is correct."""
    n, c = np.broadcast_arrays(np.asarray(n, np.int64), np.asarray(c, np.int64))
    if np.any(k > n) or np.any(c > n) or np.any(c < 0):
        raise ValueError(f"pass@{k} needs 0 <= c <= n and k <= n; got n={n}, c={c}.")
    out = np.ones(n.shape, np.float64)
    for i in np.ndindex(n.shape):
        if n[i] - c[i] >= k:  # else every k-subset holds a correct sample
            out[i] = 1.0 - np.prod(1.0 - k / np.arange(n[i] - c[i] + 1, n[i] + 1))
    return out


def make_sampled_scores(
    model_cfg,
    reward_fn,
    *,
    k: int,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
):
    """`scores(params, batch, key, temperature) -> [N, k]`: the reward of k answers sampled for
    each of the N prompts (row i * k + j of the rollout is sample j of prompt i). The temperature
    is an argument, so one compile serves every temperature; `greedy` decodes by argmax."""

    def scores(params, batch, key, temperature):
        rows = jax.tree_util.tree_map(lambda x: jnp.repeat(x, k, axis=0), batch)
        out = rollout.generate(
            model_cfg,
            params,
            rows["input_ids"],
            rows["attention_mask"],
            key,
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
            pad_id=pad_id,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            greedy=greedy,
        )
        s = reward_fn(rows, out.response_ids, out.response_mask, eos_id=eos_id)
        return s.reshape(-1, k)

    return scores


def tensorboard_tag(name: str) -> str:
    """The tensorboard tag of a figure: "@" is not allowed in tags, so `eval/pass@4` is written
    as `eval/pass_4` (what tensorboardX would rename it to, with a warning)."""
    return name.replace("@", "_")


def check_sampling(k: int, temperature: float) -> None:
    """Raises ValueError for k < 1 or a negative temperature."""
    if k < 1:
        raise ValueError(f"--k={k} must be >= 1 (samples per prompt).")
    if not temperature >= 0:
        raise ValueError(f"--temperature={temperature} must be >= 0 (0: greedy samples).")


class Evaluator:
    """The policy of one checkpoint of a run, with the run's task and reward, ready to evaluate.

    Restores once and compiles once per k (the temperature and seed are arguments), so a
    temperature sweep costs one compile. `cfg` replaces the config the checkpoint was written
    with (default); `step` defaults to the newest checkpoint that reads back.
    """

    def __init__(self, workdir: str, *, step: int | None = None, cfg=None, num_samples: int = 0):
        if cfg is None:
            cfg = export_lib.load_config(workdir, step)
        config_lib.validate(cfg)
        self.workdir, self.cfg = workdir, cfg
        self.tokenizer, self.task, self.reward_fn, self.model_cfg = train.build(cfg)
        self.params, self.step = export_lib.restore_params(workdir, cfg, self.model_cfg, step)
        self.batch = self.task.eval_batch()
        self._ids = {
            "eos_id": self.tokenizer.eos_token_id,
            "pad_id": self.tokenizer.pad_token_id,
            "max_new_tokens": self.task.max_response_length,
        }
        self._greedy = None
        self._sampled = {}
        self.num_samples = num_samples  # greedy answers kept for `sample_rows`
        self.sample_rows: list[dict] = []  # {"prompt", "completion", "reward"}, after greedy()

    def greedy(self) -> dict:
        """`val/accuracy` and `val/response_length` of greedy answers (jrl.step.make_eval); the
        first `num_samples` answers go to `sample_rows`."""
        if self._greedy is None:
            evaluate = jax.jit(
                step_lib.make_eval(
                    self.model_cfg, self.reward_fn, **self._ids, num_samples=self.num_samples
                )
            )
            metrics, found = samples_lib.split(to_python(evaluate(self.params, self.batch)))
            self.sample_rows = samples_lib.rows(self.task, self.batch, found)
            self._greedy = metrics
        return self._greedy

    def sample_scores(self, k: int, temperature: float, seed: int = 0) -> np.ndarray:
        """Scores [N, k] of k answers sampled for each of the N eval prompts."""
        check_sampling(k, temperature)
        greedy = temperature == 0
        if (k, greedy) not in self._sampled:
            self._sampled[k, greedy] = jax.jit(
                make_sampled_scores(
                    self.model_cfg,
                    self.reward_fn,
                    k=k,
                    top_k=self.cfg.rollout.top_k,
                    top_p=self.cfg.rollout.top_p,
                    greedy=greedy,
                    **self._ids,
                )
            )
        scores = self._sampled[k, greedy](
            self.params, self.batch, jax.random.key(seed), jnp.float32(temperature or 1.0)
        )
        return np.asarray(scores)

    def evaluate(
        self, k: int = 4, temperature: float = 1.0, seed: int = 0, write: bool = True
    ) -> dict:
        """The figures of the module docstring with their settings; with `write`, also saved to
        `workdir/eval_<step>.json` and appended to the workdir's tensorboard events."""
        scores = self.sample_scores(k, temperature, seed)
        correct = np.sum(scores >= CORRECT_SCORE, axis=1)
        greedy = self.greedy()
        result = {
            "step": self.step,
            "eval/greedy_accuracy": greedy["val/accuracy"],
            f"eval/mean@{k}": float(np.mean(scores)),
            f"eval/pass@{k}": float(np.mean(pass_at_k(k, correct, k))),
            "eval/greedy_response_length": greedy["val/response_length"],
            "num_prompts": int(scores.shape[0]),
            "k": k,
            "temperature": float(temperature),
            "top_k": int(self.cfg.rollout.top_k),
            "top_p": float(self.cfg.rollout.top_p),
            "seed": seed,
        }
        if write:
            self.write(result)
        return result

    def write(self, result: dict) -> None:
        """`result` to `workdir/eval_<step>.json` (replacing an earlier one) and its eval/ figures
        to a new tensorboard event file in the workdir, at global step `result["step"]`."""
        step = result["step"]
        path = epath.Path(self.workdir) / f"eval_{step}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        # A unique file name: event files are opened for writing, and named to the second.
        writer = SummaryWriter(
            logdir=str(self.workdir), filename_suffix=f".eval_{step}.{uuid.uuid4().hex[:8]}"
        )
        k = result["k"]
        for tag in ("eval/greedy_accuracy", f"eval/mean@{k}", f"eval/pass@{k}"):
            writer.add_scalar(tensorboard_tag(tag), result[tag], global_step=step)
        writer.close()


# ------------------------------------------------------------------------------ CLI


def _define_flags() -> None:
    """This CLI's own flags. `--workdir` and `--config` are jrl.train's (registered when it is
    imported): the run's directory and, optionally, a config file replacing the saved one."""
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
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    result = evaluator.evaluate(k=FLAGS.k, temperature=FLAGS.temperature, seed=FLAGS.seed)
    for line in samples_lib.lines(evaluator.sample_rows, width=1000):
        print(line)
    print(json.dumps(result))


if __name__ == "__main__":
    _define_flags()
    app.run(main)
