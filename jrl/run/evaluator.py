"""Evaluation of a run's checkpoint on its task's eval split: greedy accuracy, mean@k and pass@k
(`Evaluator`; the command line is jrl/eval.py, whose docstring defines the figures)."""

from __future__ import annotations

import json
import uuid

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from tensorboardX import SummaryWriter

from jrl import config as config_lib
from jrl import step as step_lib
from jrl.run import checkpoint as checkpoint_lib
from jrl.run import trainer
from jrl.run import samples as samples_lib
from jrl.run.metric_writers import to_python

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


def make_sampled_scores(model_cfg, reward_fn, *, k: int, **sampling):
    """`scores(params, batch, key, temperature) -> [N, k]`: the reward of k answers sampled for
    each of the N prompts (row i * k + j of the rollout is sample j of prompt i). The temperature
    is an argument, so one compile serves every temperature. `sampling`: the other keywords of
    `jrl.step.sample_responses` (eos_id, pad_id, max_new_tokens, top_k, top_p, stop_ids; `greedy`
    decodes by argmax; with a `tool_host` the answers are multi-turn, with the tools, and the
    reward reads tool tokens too)."""

    def scores(params, batch, key, temperature):
        _, _, s = step_lib.sample_and_score(
            model_cfg, reward_fn, params, batch, key, samples=k, temperature=temperature, **sampling
        )
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
            cfg = checkpoint_lib.load_config(workdir, step)
        config_lib.validate(cfg)
        self.workdir, self.cfg = workdir, cfg
        built = trainer.build(cfg)
        self.tokenizer, self.task = built.tokenizer, built.task
        self.reward_fn, self.model_cfg = built.reward_fn, built.model_cfg
        self.params, self.step = checkpoint_lib.restore_params(workdir, cfg, self.model_cfg, step)
        self.batch = self.task.eval_batch()
        self._ids = trainer.sampling_ids(self.tokenizer, self.task, cfg)
        self._greedy = None
        self._sampled = {}
        self.num_samples = num_samples  # greedy answers kept for `sample_rows`
        self.sample_rows: list[dict] = []  # {"prompt", "completion", "reward"}, after greedy()

    def greedy(self) -> dict:
        """`val/accuracy` and `val/response_length` of greedy answers (jrl.run.trainer.make_eval);
        the first `num_samples` answers go to `sample_rows`."""
        if self._greedy is None:
            evaluate = jax.jit(
                trainer.make_eval(
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
