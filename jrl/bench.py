"""Benchmark of the fused RL step: python -m jrl.bench --workload=W1|W2 [--steps=10] [--json]

Workloads are fixed so that other systems can run the same ones (random-initialised Qwen2-style
decoder, the built-in character vocabulary, arithmetic prompts; GRPO, one optimizer update per
step, no reference model):
  W1: hidden 64, 2 layers, 4 heads, 2 KV heads, MLP 128, tied embeddings; 8 prompts x 4 samples x
      16 new tokens.
  W2: hidden 256, 4 layers, 8 heads, 4 KV heads, MLP 1024, tied embeddings; 16 prompts x 8
      samples x 64 new tokens.
Every response is exactly the stated number of new tokens (EOS does not stop decoding), so the
work per step does not depend on what the random model samples.

Reported: compile time of the fused step, steady-state seconds per step (median of `--steps`
steps after compile), tokens/s (generated tokens, and prompt + generated), and the split of a step
into rollout + reward / log-probs + advantages / update, timed by jitting the same three phase functions
(`jrl.step.make_phases`) separately.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app, flags
import jax
import numpy as np

from jrl import config as config_lib
from jrl import step as step_lib
from jrl import tokenizer as tokenizer_lib
from jrl.data.arithmetic import ArithmeticTask
from jrl.models import transformer
from jrl.rewards import get_reward
from jrl.train import model_config

WORKLOADS = {
    "W1": dict(
        model=dict(
            hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
        ),
        prompts=8,
        n=4,
        new_tokens=16,
    ),
    "W2": dict(
        model=dict(
            hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1024
        ),
        prompts=16,
        n=8,
        new_tokens=64,
    ),
}

_WORKLOAD = flags.DEFINE_enum("workload", "W1", sorted(WORKLOADS), "Which fixed workload to run.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps after compilation (median reported).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")


def workload_config(name: str):
    w = WORKLOADS[name]
    cfg = config_lib.base_config()
    cfg.model.update(w["model"])
    cfg.model.qkv_bias = True  # Qwen2-style
    cfg.model.tie_word_embeddings = True
    cfg.data.train_batch_size = w["prompts"]
    cfg.data.max_response_length = w["new_tokens"]
    cfg.rollout.n = w["n"]
    cfg.actor.ppo_mini_batch_size = w["prompts"]  # one optimizer update per step
    cfg.actor.ppo_epochs = 1
    config_lib.validate(cfg)
    return cfg


def _median_seconds(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(name: str, steps: int = 10) -> dict:
    cfg = workload_config(name)
    w = WORKLOADS[name]
    tok = tokenizer_lib.char_tokenizer()
    task = ArithmeticTask(tok, max_response_length=w["new_tokens"], seed=cfg.seed)
    model_cfg = model_config(cfg, len(tok))
    # eos_id=-1: no row ever stops early, so every step decodes exactly `new_tokens` tokens.
    ids = dict(eos_id=-1, pad_id=tok.pad_token_id, max_new_tokens=w["new_tokens"])
    reward_fn = get_reward(cfg.task.reward)
    key_init, key_state = jax.random.split(jax.random.key(cfg.seed))
    state = step_lib.init_state(
        cfg, model_cfg, transformer.init_params(model_cfg, key_init), key_state
    )
    batch = jax.device_put(task.train_batch(0, w["prompts"]))

    step = jax.jit(step_lib.make_step(cfg, model_cfg, reward_fn, **ids), donate_argnums=0)
    t = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    state, metrics = compiled(state, batch)  # one untimed step

    def one_step():
        nonlocal state
        state, m = compiled(state, batch)
        return m

    step_s = _median_seconds(one_step, steps)

    generate, score, update = (
        jax.jit(f) for f in step_lib.make_phases(cfg, model_cfg, reward_fn, **ids)
    )
    key = jax.random.key(1)
    exp, _ = jax.block_until_ready(generate(state, batch, key))
    scored, _, _ = jax.block_until_ready(score(state, exp))
    jax.block_until_ready(update(state, scored, key))
    phases = {
        "rollout_and_reward": _median_seconds(lambda: generate(state, batch, key), steps),
        "logprobs_and_advantages": _median_seconds(lambda: score(state, exp), steps),
        "update": _median_seconds(lambda: update(state, scored, key), steps),
    }
    rows = w["prompts"] * w["n"]
    generated = rows * w["new_tokens"]
    total = generated + int(np.sum(batch["attention_mask"])) * w["n"]
    return {
        "workload": name,
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "rows": rows,
        "new_tokens": w["new_tokens"],
        "compile_s": round(compile_s, 3),
        "step_s_median": round(step_s, 5),
        "generated_tokens_per_s": round(generated / step_s, 1),
        "total_tokens_per_s": round(total / step_s, 1),
        "phase_s_median": {k: round(v, 5) for k, v in phases.items()},
    }


def main(argv):
    del argv
    result = run(_WORKLOAD.value, _STEPS.value)
    if _JSON.value:
        print(json.dumps(result))
        return
    for k, v in result.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                print(f"{k}.{kk:<24} {vv}")
        else:
            print(f"{k:<28} {v}")


if __name__ == "__main__":
    app.run(main)
