"""Compile-time cost of the token sampler alone (docs/performance.md, "The sampler").

    JAX_PLATFORMS=cpu python scripts/sampler_cost.py                      # XLA:CPU
    python scripts/sampler_cost.py --tpu                                  # one TPU v5p chip, ahead
    JAX_PLATFORMS=cpu python scripts/sampler_cost.py --time --vs=OLD.py   # CPU time, A/B

Compiles (does not run) `jrl.rollout.sample_token` on [B] uniforms and [B, V] float32 logits
for each vocabulary and setting, and prints XLA's cost analysis (bytes accessed, flops) and the
number of ops in the optimised HLO: the instructions of the entry computation and of the
computations its loops and conditionals call, a fusion counting as one (parameters, constants,
tuples and their elements, bitcasts left out). A conditional's ops are those of all its
branches; XLA's cost analysis takes the larger of its branches' figures. With top-k / top-p the
sampler is also compiled with its `lax.cond` replaced by either branch: "(candidates)" is the
cost when every row's kept set lies among the largest logits, "(exact path)" when not.

--tpu compiles for one chip of a v5p topology from abstract inputs (libtpu, no TPU needed).
--vs=FILE also measures the `sample_token` of another file (an older `jrl/rollout.py`, say)
side by side. --time runs each on the host: rounds alternating the samplers (A B A B ...),
each round the median of --reps calls, on fixed random logits; prints the medians of the rounds.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import re
import statistics
import time

SETTINGS = {
    "plain": {},
    "top_k=50": {"top_k": 50},
    "top_p=0.9": {"top_p": 0.9},
    "top_k=50+top_p=0.9": {"top_k": 50, "top_p": 0.9},
    "greedy": {"greedy": True},
}
_SKIPPED = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")


def hlo_ops(text: str) -> int:
    """Instructions of the entry computation and of the computations that loops and
    conditionals call (a fusion is one instruction), without the bookkeeping ones."""
    computations, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = "ENTRY" if line.startswith("ENTRY") else head.group(1)
            computations[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and "=" in line:
            computations[name].append(line)
    count, todo, seen = 0, ["ENTRY"], set()
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in computations:
            continue
        seen.add(comp)
        for line in computations[comp]:
            op = re.search(r"\s([a-z][\w\-]*)\(", line.split("=", 1)[1])
            if op is None or op.group(1) in _SKIPPED:
                continue
            count += 1
            if op.group(1) in ("while", "conditional", "call"):
                todo += re.findall(r"(?:body|condition|to_apply)=%?([\w.\-]+)", line)
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                todo += re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []
    return count


def load(path: str | None):
    if path is None:
        from jrl import rollout

        return rollout.sample_token
    spec = importlib.util.spec_from_file_location("sampler_vs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sample_token


def abstract(batch: int, vocab: int, tpu: bool):
    import jax
    import jax.numpy as jnp

    sharding = None
    if tpu:
        from jax.experimental import topologies
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        topo = topologies.get_topology_desc("v5p:2x2x1", "tpu")
        sharding = NamedSharding(Mesh(topo.devices[:1], ("x",)), PartitionSpec())
    u = jax.ShapeDtypeStruct((batch,), jnp.float32, sharding=sharding)
    logits = jax.ShapeDtypeStruct((batch, vocab), jnp.float32, sharding=sharding)
    return u, logits


def cost(fn, args, branch: int | None = None):
    """(bytes, flops, ops) of fn compiled for args; branch 0 / 1: every `lax.cond` replaced by
    its false / true branch (the exact path / the candidates), None: as it is."""
    import jax

    cond = jax.lax.cond
    if branch is not None:
        jax.lax.cond = lambda pred, if_true, if_false, *ops: (if_false, if_true)[branch](*ops)
    try:
        compiled = jax.jit(fn).lower(*args).compile()
    finally:
        jax.lax.cond = cond
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return analysis["bytes accessed"], analysis["flops"], hlo_ops(compiled.as_text())


def timings(samplers: dict, batch: int, vocab: int, kw: dict, rounds: int, reps: int):
    import jax

    k1, k2 = jax.random.split(jax.random.key(0))
    logits = jax.random.normal(k1, (batch, vocab)) * 3.0
    u = jax.random.uniform(k2, (batch,))
    fns = {name: jax.jit(functools.partial(f, **kw)) for name, f in samplers.items()}
    for f in fns.values():
        jax.block_until_ready(f(u, logits))
    per = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            calls = []
            for _ in range(reps):
                start = time.perf_counter()
                jax.block_until_ready(f(u, logits))
                calls.append(time.perf_counter() - start)
            per[name].append(statistics.median(calls))
    return {name: (statistics.median(t), min(t), max(t)) for name, t in per.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--vocab", default="151936,262144")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="names of SETTINGS")
    parser.add_argument("--tpu", action="store_true")
    parser.add_argument("--vs", default=None, help="a file whose sample_token is measured too")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.tpu:
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: no chip held
    samplers = {"this": load(None)}
    if args.vs:
        samplers["vs"] = load(args.vs)
    names = [s for s in SETTINGS if s in args.settings.split(",")]
    for vocab in (int(v) for v in args.vocab.split(",")):
        inputs = abstract(args.batch, vocab, args.tpu)
        for setting in names:
            kw = SETTINGS[setting]
            for name, f in samplers.items():
                branches = {"": None}
                if "top_k" in kw or "top_p" in kw:
                    branches = {"": None, " (candidates)": 1, " (exact path)": 0}
                seen = set()
                for label, branch in branches.items():
                    # a new partial each time: jit would reuse the trace of the same function
                    figures = cost(functools.partial(f, **kw), inputs, branch)
                    if figures in seen:  # no lax.cond: the same program
                        continue
                    seen.add(figures)
                    nbytes, flops, ops = figures
                    print(
                        f"{'tpu' if args.tpu else 'cpu'} V={vocab} {setting:20s} {name + label:18s}"
                        f" bytes {nbytes / 1e6:8.1f} MB  flops {flops / 1e6:8.1f} M  ops {ops:4d}",
                        flush=True,
                    )
            if args.time:
                for name, (med, lo, hi) in timings(
                    samplers, args.batch, vocab, kw, args.rounds, args.reps
                ).items():
                    print(
                        f"  time {name:5s} median {med * 1e3:7.2f} ms "
                        f"(rounds {lo * 1e3:.2f}-{hi * 1e3:.2f})",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
