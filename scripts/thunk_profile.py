"""Where a benchmark workload's fused step spends its time, per XLA operation (thunk), on the CPU.

    python scripts/thunk_profile.py --workload=W1 --steps=10 --top=30

Traces `--steps` steps with `jax.profiler` (after warm-up) and prints, per step: the number of
thunks run, the time by part of the step (decode loop / update / rest, then attention / MLP /
random numbers / other, from each operation's `op_name`), and the most expensive thunks with
their shapes. Times come from the trace and include the profiler's own overhead (small thunks
look ~2x slower than they run untraced): compare parts and counts, and time changes with
`python -m jrl.bench` or `scripts/phase_ab.py`. docs/performance.md, "Third round", used it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax

from jrl.run import benchmark
from jrl import step as step_lib


def _step(name: str):
    w = benchmark.setup(name)
    step = step_lib.make_step(w.cfg, w.model_cfg, w.reward_fn, **w.ids)
    return jax.jit(step, donate_argnums=0), w.state, w.batch


def _op_names(hlo: str) -> dict[str, tuple[str, str]]:
    """thunk (instruction) name -> (shape, op_name) from the optimised HLO text."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?op_name=\"([^\"]*)\"", line)
        if m:
            out[m.group(1)] = (m.group(2), m.group(3))
    return out


def _part(op: str) -> tuple[str, str]:
    # the update runs in scans over epochs and mini-batches, the rollout in a while loop
    if "jvp(" in op or "while/body/closed_call" in op:
        phase = "update"
    elif "while/body" in op:
        phase = "decode loop"
    else:
        phase = "rest"
    if "/attn/" in op:
        kind = "attention"
    elif "/mlp/" in op:
        kind = "mlp"
    elif re.search(r"threefry|_uniform|random|_gumbel|permutation", op):
        kind = "random numbers"
    else:
        kind = "other"
    return phase, kind


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="W1", choices=sorted(benchmark.WORKLOADS))
    parser.add_argument("--steps", type=int, default=10, help="steps traced")
    parser.add_argument("--top", type=int, default=25, help="thunks listed")
    args = parser.parse_args()
    step, state, batch = _step(args.workload)
    for _ in range(3):  # compile and warm up
        state, _ = jax.block_until_ready(step(state, batch))
    names = _op_names(step.lower(state, batch).compile().as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(args.steps):
                state, _ = jax.block_until_ready(step(state, batch))
        (trace,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
        events = json.load(gzip.open(trace))["traceEvents"]
    us, calls = collections.Counter(), collections.Counter()
    for e in events:
        # thunks only; a while loop's own event spans its body's thunks, so it is left out
        if e.get("ph") == "X" and e["name"] in names and not e["name"].startswith("while"):
            us[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    per_step = lambda x: x / args.steps
    print(
        f"{args.workload}: {per_step(sum(calls.values())):.0f} thunks per step, "
        f"{per_step(sum(us.values())) / 1e3:.2f} ms of thunk time per step (traced)"
    )
    parts, part_calls = collections.Counter(), collections.Counter()
    for n, t in us.items():
        parts[_part(names[n][1])] += t
        part_calls[_part(names[n][1])] += calls[n]
    print("\nms per step   thunks   part")
    for p, t in parts.most_common():
        print(f"{per_step(t) / 1e3:11.3f} {per_step(part_calls[p]):8.0f}   {' / '.join(p)}")
    print(f"\nms per step   calls   us per call   thunk   shape   op_name (top {args.top})")
    for n, t in us.most_common(args.top):
        shape, op = names[n]
        print(
            f"{per_step(t) / 1e3:11.3f} {per_step(calls[n]):7.0f} {t / calls[n]:13.1f}   "
            f"{n}   {shape}   {op.removeprefix('jit(rl_step)/')[:90]}"
        )


if __name__ == "__main__":
    main()
