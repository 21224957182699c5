"""How far the rollout's log-probs are from the training forward's (docs/performance.md,
"Decode"):

    python scripts/decode_logprob_gap.py [--dtype=bfloat16] [--length=128] [--seeds=3]
        [--decode_attention=blockwise|xla]

W2's model shape (`jrl.run.benchmark`: hidden 256, 4 layers, 8 query / 4 kv heads, random
weights from seed 0) computing in `--dtype` over float32 weights, 8 prompts x 8 samples of the
built-in arithmetic task left-padded to 64 tokens, every response forced to `--length` tokens
(`rollout.generate`'s `forced_length`, temperature 1). For each seed, the log-probs the rollout
recorded are compared with those of the scoring forward the step runs (`jrl.logprobs`, in
`--dtype`, the shared-prompt forward as the step runs it) and with a float32 forward
(`transformer.forward` of the same weights): the mean and largest absolute differences over the
response tokens, averaged / maxed over the seeds. The floor: the same scoring forward with each
row's prompt run for it alone (group 1) against the shared-prompt one, two training forwards of
the same maths in other shapes, whose gap is what `--dtype` rounding alone gives.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jrl import logprobs, rollout
from jrl import tokenizer as tokenizer_lib
from jrl.data.arithmetic import ArithmeticTask
from jrl.models import transformer
from jrl.run import benchmark, trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--decode_attention", default="blockwise", help="blockwise | xla")
    args = parser.parse_args()
    cfg = benchmark.workload_config("W2")
    tok = tokenizer_lib.char_tokenizer()
    f32_cfg = trainer.model_config(cfg, len(tok))
    model_cfg = dataclasses.replace(
        f32_cfg, dtype=args.dtype, decode_attention=args.decode_attention
    )
    task = ArithmeticTask(tok, max_response_length=args.length, max_prompt_length=64, seed=0)
    batch = task.train_batch(0, 8)
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    n, r = 8, args.length
    rows_ids, rows_mask = jnp.repeat(ids, n, 0), jnp.repeat(mask, n, 0)
    params = transformer.init_params(f32_cfg, jax.random.key(0))

    @jax.jit
    def gaps(params, key):
        out = rollout.generate(
            model_cfg,
            params,
            ids,
            mask,
            key,
            max_new_tokens=r,
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
            samples=n,
            forced_length=jnp.full((ids.shape[0] * n,), r, jnp.int32),
        )
        score = lambda group: logprobs.response_outputs(
            model_cfg, params, rows_ids, rows_mask, out.response_ids, out.response_mask, group=group
        )["log_prob"]
        scored = score(n)
        full = jnp.concatenate([rows_ids, out.response_ids], 1)
        full_mask = jnp.concatenate([rows_mask, out.response_mask], 1)
        logits = transformer.forward(f32_cfg, params, full, full_mask)[:, ids.shape[1] - 1 : -1]
        exact = jnp.take_along_axis(
            jax.nn.log_softmax(logits, -1), out.response_ids[..., None], -1
        )[..., 0]
        m = out.response_mask.astype(bool)

        def gap(ref, of=out.log_probs):  # mean and largest |difference| over the response tokens
            d = jnp.where(m, jnp.abs(of - ref), 0.0)
            return jnp.sum(d) / jnp.sum(m), jnp.max(d)

        return {"scoring": gap(scored), "float32": gap(exact), "floor": gap(scored, score(1))}

    results = [jax.device_get(gaps(params, jax.random.key(s))) for s in range(args.seeds)]
    what = {
        "scoring": f"rollout ({args.decode_attention}) vs the scoring forward",
        "float32": f"rollout ({args.decode_attention}) vs the float32 forward",
        "floor": "floor: the scoring forward, prompts per row vs shared",
    }
    for ref, label in what.items():
        mean = np.mean([x[ref][0] for x in results])
        worst = np.max([x[ref][1] for x in results])
        print(f"{label} ({args.dtype}): mean |diff| {mean:.3e}, max {worst:.3e}")


if __name__ == "__main__":
    main()
