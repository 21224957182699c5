"""What a response budget costs the rollout when every response ends before it
(docs/performance.md, "Decode"):

    python scripts/decode_budget.py [--budgets=256,4096] [--length=256] [--rounds=3]

W2's model (`jrl.run.benchmark`: hidden 256, 4 layers, float32, random weights), 8 prompts x 8
samples of the built-in arithmetic task left-padded to 64 tokens, every response forced to end at
EOS at `--length` tokens (`rollout.generate`'s `forced_length`), the decode compacted as the
config does by default (`rollout.compact_decode`). The rollout is compiled once per budget
(`max_new_tokens`) and the budgets are timed in alternating rounds in one process; the seconds
per rollout of each round and their medians are printed, and the ratio of each budget's median
to the first's. What the rollout computes is the same under every budget (the tokens are
checked equal), so a ratio above 1 is what the budget alone costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jrl import rollout
from jrl import tokenizer as tokenizer_lib
from jrl.data.arithmetic import ArithmeticTask
from jrl.models import transformer
from jrl.run import benchmark, trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="256,4096", help="response budgets to compare")
    parser.add_argument("--length", type=int, default=256, help="every response's length")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt_length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--shared_prompt",
        choices=("auto", "on", "off"),
        default="auto",
        help="read each prompt once per group in the decode (auto: rollout.shares_prompt)",
    )
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    if min(budgets) < args.length:
        parser.error(f"--length={args.length} must fit every budget ({budgets})")

    cfg = benchmark.workload_config("W2")
    tok = tokenizer_lib.char_tokenizer()
    model_cfg = trainer.model_config(cfg, len(tok))
    task = ArithmeticTask(
        tok, max_response_length=args.length, max_prompt_length=args.prompt_length, seed=0
    )
    batch = task.train_batch(0, args.prompts)
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    params = transformer.init_params(model_cfg, jax.random.key(0))
    rows = args.prompts * args.samples
    lengths = jnp.full((rows,), args.length, jnp.int32)
    min_rows = cfg.rollout.compact_min_rows if cfg.rollout.compact_decode else 0

    def compiled(budget: int):
        fn = jax.jit(
            lambda params, key: (
                rollout.generate(
                    model_cfg,
                    params,
                    ids,
                    mask,
                    key,
                    max_new_tokens=budget,
                    eos_id=tok.eos_token_id,
                    pad_id=tok.pad_token_id,
                    temperature=cfg.rollout.temperature,
                    samples=args.samples,
                    forced_length=lengths,
                    compact_min_rows=min_rows,
                    shared_prompt={"auto": None, "on": True, "off": False}[args.shared_prompt],
                ).response_ids
            )
        )
        return fn.lower(params, jax.random.key(0)).compile()

    programs = {b: compiled(b) for b in budgets}
    outs = {b: np.asarray(p(params, jax.random.key(1))) for b, p in programs.items()}
    for b in budgets[1:]:  # the same responses under every budget
        np.testing.assert_array_equal(outs[b][:, : args.length], outs[budgets[0]][:, : args.length])
    times = {b: [] for b in budgets}
    for i in range(args.rounds):
        for b, program in programs.items():
            t = time.perf_counter()
            jax.block_until_ready(program(params, jax.random.key(2 + i)))
            times[b].append(time.perf_counter() - t)
    first = statistics.median(times[budgets[0]])
    for b in budgets:
        median = statistics.median(times[b])
        rounds = " ".join(f"{x:.2f}" for x in times[b])
        print(f"budget {b:>5}: {median:.2f} s median ({rounds}); x{median / first:.2f}")


if __name__ == "__main__":
    main()
