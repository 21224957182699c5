"""In-process A/B timing of a benchmark workload's phases (docs/performance.md).

    python scripts/phase_ab.py --workload=W2 --micro_batches=0,16 [--rounds=5]
    python scripts/phase_ab.py --workload=W2 --prefill
    python scripts/phase_ab.py --workload=W2 --shared_prompt
    python scripts/phase_ab.py --workload=W3 --fixed_length --rounds=3 --reps=1
    python scripts/phase_ab.py --workload=W2 --compact_decode
    python scripts/phase_ab.py --workload=W2 --against=W2-MoE --rounds=3 --reps=1

The machine's speed drifts by 10-30% between processes on a shared CPU, more than most single
changes buy, so the variants are compiled in one process and timed in alternating rounds (A B A B
...); the medians of all rounds are printed.

--micro_batches: the update phase (`jrl.step.make_phases`) with each `--micro_batch` of
`python -m jrl.bench` (rows per forward / backward; 0: all rows at once).
--prefill: the rollout (`jrl.rollout.generate`) with each prompt prefilled once for its n samples
(`samples=n`) against the same prompts repeated n times and each row prefilled (`samples=1`);
it also checks that both sample the same tokens.
--shared_prompt: the fused step and the update phase with `model.shared_prompt_forward` on
(each group's prompt forwarded once) and off.
--fixed_length: the fused step of a workload with forced lengths (W3) against the same config
with every response at the budget (`python -m jrl.bench --fixed_length`); it also prints how many
times each step compiled.
--compact_decode: the fused step and the rollout phase with `rollout.compact_decode` on and off.
--against=OTHER: the fused step, the rollout and the update of --workload and of workload OTHER
(W2 against W2-MoE: a dense model against the mixture of experts of the same active
parameters), each workload's state and prompts its own, and the ratios OTHER / --workload.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jrl import rollout
from jrl.run import benchmark
from jrl import step as step_lib


def _scored(name: str):
    """The workload (`benchmark.setup`), a key, and its first step's scored experience."""
    w = benchmark.setup(name)
    key = jax.random.key(1)
    generate, score, _ = (
        jax.jit(f) for f in step_lib.make_phases(w.cfg, w.model_cfg, w.reward_fn, **w.ids)
    )
    return w, key, score(w.state, generate(w.state, w.batch, key)[0])[0]


def update_variants(name: str, micro_batches: list[int]) -> dict:
    """{"micro_batch=m": timed update} for each m, all on the same state and experience."""
    w, key, scored = _scored(name)
    cfg, model_cfg, reward_fn, ids, state, batch = w
    variants = {}
    for m in micro_batches:
        cfg_m = benchmark.workload_config(name, m)
        update = jax.jit(step_lib.make_phases(cfg_m, model_cfg, reward_fn, **ids)[2])
        variants[f"micro_batch={m}"] = lambda u=update: u(state, scored, key)
    return variants


def prefill_variants(name: str) -> dict:
    """The workload's rollout with each prompt prefilled once, and with every row prefilled."""
    cfg, model_cfg, _, ids, state, batch = benchmark.setup(name)
    params = state.params
    n, key = cfg.rollout.n, jax.random.key(1)
    prompts, mask = batch["input_ids"], batch["attention_mask"]
    once = jax.jit(lambda p: rollout.generate(model_cfg, p, prompts, mask, key, samples=n, **ids))
    rows = jnp.repeat(prompts, n, 0), jnp.repeat(mask, n, 0)
    every = jax.jit(lambda p: rollout.generate(model_cfg, p, *rows, key, **ids))
    a, b = once(params), every(params)
    same = bool(jnp.all(a.response_ids == b.response_ids))
    print(f"same tokens with the prompt prefilled once and per row: {same}")
    return {"prefill once": lambda: once(params), "prefill every row": lambda: every(params)}


def _switched(cfg, model_cfg, reward_fn, ids, section: str, field: str, phase: int) -> dict:
    """{on: (fused step, `make_phases`' phase number `phase`)}, jitted, with the config switch
    `section.field` on and off."""
    out = {}
    for on in (True, False):
        cfg_on = cfg.copy_and_resolve_references()
        setattr(cfg_on[section], field, on)
        out[on] = (
            jax.jit(step_lib.make_step(cfg_on, model_cfg, reward_fn, **ids)),
            jax.jit(step_lib.make_phases(cfg_on, model_cfg, reward_fn, **ids)[phase]),
        )
    return out


def shared_prompt_variants(name: str) -> dict:
    """The workload's fused step and update phase with model.shared_prompt_forward on and off."""
    w, key, scored = _scored(name)
    state, batch = w[4:]
    variants = {}
    for on, (step, update) in _switched(*w[:4], "model", "shared_prompt_forward", 2).items():
        variants[f"step shared={on}"] = lambda f=step: f(state, batch)
        variants[f"update shared={on}"] = lambda f=update: f(state, scored, key)
    return variants


def fixed_length_variants(name: str) -> dict:
    """The workload's fused step with its own response lengths and with all at the budget."""
    variants = {}
    for fixed in (False, True):
        cfg, model_cfg, reward_fn, ids, state, batch = benchmark.setup(name, fixed_length=fixed)
        step = jax.jit(step_lib.make_step(cfg, model_cfg, reward_fn, **ids))
        variants[f"step fixed_length={fixed}"] = lambda f=step, s=state, b=batch: f(s, b)
        variants[f"step fixed_length={fixed}"].jitted = step
    return variants


def compact_decode_variants(name: str) -> dict:
    """The workload's fused step and rollout phase with rollout.compact_decode on and off."""
    cfg, model_cfg, reward_fn, ids, state, batch = benchmark.setup(name)
    key, variants = jax.random.key(1), {}
    for on, (step, generate) in _switched(
        cfg, model_cfg, reward_fn, ids, "rollout", "compact_decode", 0
    ).items():
        variants[f"step compact={on}"] = lambda f=step: f(state, batch)
        variants[f"rollout compact={on}"] = lambda f=generate: f(state, batch, key)
    return variants


def workload_variants(names: list[str]) -> dict:
    """The fused step, the rollout (+ reward) and the update of each workload, on its own first
    state, prompts and scored experience."""
    variants = {}
    for name in names:
        w, key, scored = _scored(name)
        step = jax.jit(step_lib.make_step(w.cfg, w.model_cfg, w.reward_fn, **w.ids))
        generate, _, update = (
            jax.jit(f) for f in step_lib.make_phases(w.cfg, w.model_cfg, w.reward_fn, **w.ids)
        )
        variants[f"{name} step"] = lambda f=step, w=w: f(w.state, w.batch)
        variants[f"{name} rollout"] = lambda f=generate, w=w: f(w.state, w.batch, key)
        variants[f"{name} update"] = lambda f=update, w=w, s=scored: f(w.state, s, key)
    return variants


def alternate(variants: dict, rounds: int, reps: int) -> dict:
    """Median seconds of each variant over `rounds` alternating rounds of `reps` calls."""
    for f in variants.values():
        jax.block_until_ready(f())  # compile
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, f in variants.items():
            for _ in range(reps):
                t = time.perf_counter()
                jax.block_until_ready(f())
                times[k].append(time.perf_counter() - t)
    for k, v in times.items():
        print(f"{k:<24} each call: {' '.join(f'{x:.3f}' for x in v)} s")
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W2", choices=sorted(benchmark.WORKLOADS))
    parser.add_argument("--micro_batches", default="0,16", help="comma-separated rows, 0: all")
    parser.add_argument("--prefill", action="store_true", help="time the rollout's prefill")
    parser.add_argument(
        "--shared_prompt", action="store_true", help="model.shared_prompt_forward on / off"
    )
    parser.add_argument(
        "--fixed_length", action="store_true", help="W3 against W3 with every response at R"
    )
    parser.add_argument(
        "--compact_decode", action="store_true", help="rollout.compact_decode on / off"
    )
    parser.add_argument(
        "--against", default=None, choices=sorted(benchmark.WORKLOADS), help="another workload"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3, help="calls per variant per round")
    args = parser.parse_args()
    if args.prefill:
        variants = prefill_variants(args.workload)
    elif args.shared_prompt:
        variants = shared_prompt_variants(args.workload)
    elif args.fixed_length:
        variants = fixed_length_variants(args.workload)
    elif args.compact_decode:
        variants = compact_decode_variants(args.workload)
    elif args.against:
        variants = workload_variants([args.workload, args.against])
    else:
        micro = [int(m) for m in args.micro_batches.split(",")]
        variants = update_variants(args.workload, micro)
    medians = alternate(variants, args.rounds, args.reps)
    for k, s in medians.items():
        print(f"{args.workload} {k:<20} median {s:.4f} s")
    if args.against:
        for part in ("step", "rollout", "update"):
            ratio = medians[f"{args.against} {part}"] / medians[f"{args.workload} {part}"]
            print(f"{args.against} / {args.workload} {part:<8} {ratio:.2f}x")
    for k, f in variants.items():
        if hasattr(f, "jitted"):
            print(f"{args.workload} {k:<20} compiled {f.jitted._cache_size()} time(s)")


if __name__ == "__main__":
    main()
