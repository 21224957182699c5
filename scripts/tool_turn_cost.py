"""The cost of a tool turn: the fused step of a multi-turn run with its tools and without them.

  python scripts/tool_turn_cost.py WORKDIR [STEPS]

WORKDIR is a finished run of configs/tool_math.py (its config.json and a checkpoint, e.g. the
docs/demos.md command's). Both steps start from that checkpoint's params, whose model calls the
tool (the demo's after RL: about once per row), and run the same batches (train batches 1001, ...
of the run's task); the two steps are called alternately, STEPS times each (default 8) after their
compile, so that both see the same machine load. Without tools the config is the run's with
`rollout.multi_turn.enable=False` (the other multi-turn fields back to their defaults, as on the
command line). Prints one JSON object per variant: seconds per step (median, min) and, from the
step's metrics, response tokens per row, tool calls per row, `timing_s/tool_host` (the host
callbacks: parsing, the tool calls on threads, rendering) and the tool tokens' share.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax

from jrl import config as config_lib
from jrl import step as step_lib
from jrl import train_state
from jrl.run import checkpoint, trainer


def variants(workdir: str) -> dict:
    """{"tools": cfg, "no_tools": cfg} of the run in `workdir`."""
    on, off = checkpoint.load_config(workdir), checkpoint.load_config(workdir)
    off.rollout.multi_turn.enable = False
    config_lib.reset_switched_off(off, on, ["--config.rollout.multi_turn.enable=False"])
    config_lib.validate(off)
    return {"tools": on, "no_tools": off}


def main(workdir: str, steps: int) -> None:
    runs = {}
    for name, cfg in variants(workdir).items():
        built = trainer.build(cfg)
        tok, task = built.tokenizer, built.task
        reward_fn, model_cfg = built.reward_fn, built.model_cfg
        params, _ = checkpoint.restore_params(workdir, cfg, model_cfg)
        state = train_state.init_state(cfg, model_cfg, params, jax.random.key(1))
        ids = trainer.sampling_ids(tok, task, cfg)
        step = jax.jit(step_lib.make_step(cfg, model_cfg, reward_fn, **ids))
        size = step_lib.prompts_per_step(cfg)
        batch = lambda i, task=task, size=size: task.train_batch(1000 + i, size)  # noqa: E731
        jax.block_until_ready(step(state, batch(0)))  # compile
        runs[name] = dict(step=step, state=state, batch=batch, seconds=[], metrics=[])
    for i in range(1, steps + 1):
        for r in runs.values():
            t = time.perf_counter()
            _, metrics = r["step"](r["state"], r["batch"](i))
            metrics = jax.device_get(metrics)
            r["seconds"].append(time.perf_counter() - t)
            r["metrics"].append({k: float(v) for k, v in metrics.items()})
    out = {}
    for name, r in runs.items():
        median = lambda k, r=r: (  # noqa: E731
            statistics.median(m[k] for m in r["metrics"]) if k in r["metrics"][0] else None
        )
        out[name] = {
            "s_per_step_median": round(statistics.median(r["seconds"]), 3),
            "s_per_step_min": round(min(r["seconds"]), 3),
            "response_length_mean": median("response_length/mean"),
            "tool_calls_per_row": median("tool_call_counts/mean"),
            "tool_host_s_per_step": median("timing_s/tool_host"),
            "tool_token_share": median("tool_calls/response_token_share"),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8)
