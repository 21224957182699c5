"""The numbers of a few RL steps of each algorithm's tiny config, to check that a change of the
code's shape changed nothing it computes:

    python scripts/step_fingerprint.py [--steps=2] [--only=grpo,ppo] > after.txt
    (cd OTHER_CHECKOUT && python /path/to/scripts/step_fingerprint.py) > before.txt
    diff before.txt after.txt

For each config it runs `python -m jrl.train` in the current directory (so the jrl found there
is the one measured: another checkout's, with this script given by path), with the `tiny` preset,
1-digit problems (tool_math: 2) and a supervised warm-up of up to 300 steps at lr 1e-2 (to the
config's target accuracy, so that rewards, and hence advantages and updates, are not all zero),
then prints every metric of every step except the timings (`repr` floats: bitwise), and a
SHA-256 of each array of the final train state (parameters, optimizer states, critic, PRNG key)
read back from the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CONFIGS = {
    "grpo": "configs/grpo_math.py:tiny",
    "ppo": "configs/ppo_math.py:tiny",
    "dapo": "configs/dapo_math.py:tiny",
    "group_ppo": "configs/group_ppo_math.py:tiny",
    "lora": "configs/grpo_math.py:tiny,lora",
    "tool_math": "configs/tool_math.py:tiny",
}
WARM_UP = ("--config.warmup.sft_steps=300", "--config.warmup.sft_lr=1e-2")
# tool_math keeps its 2-digit problems: at 1 digit its response budget holds no tool answer
OVERRIDES = {name: ("--config.task.num_digits=1", *WARM_UP) for name in CONFIGS}
OVERRIDES["tool_math"] = WARM_UP
TIMINGS = ("timing_s/", "perf/throughput", "perf/time_per_step", "tokens_per_s")

HASH_STATE = """
import hashlib, sys
import jax, numpy as np, orbax.checkpoint as ocp
state = ocp.PyTreeCheckpointer().restore(sys.argv[1])
for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    a = np.asarray(jax.random.key_data(leaf) if jax.dtypes.issubdtype(
        getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key) else leaf)
    digest = hashlib.sha256(a.tobytes()).hexdigest()[:16]
    print(f"  {jax.tree_util.keystr(path)} {a.dtype} {a.shape} {digest}")
"""


def fingerprint(name: str, spec: str, steps: int) -> list[str]:
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [
            sys.executable,
            "-m",
            "jrl.train",
            f"--config={spec}",
            f"--config.total_steps={steps}",
            *OVERRIDES[name],
            f"--workdir={workdir}",
        ]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            return [f"{name}: exit {run.returncode}: {run.stderr.strip().splitlines()[-1:]}"]
        lines = [f"== {name} ({spec} {' '.join(OVERRIDES[name])}, {steps} steps)"]
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            for record in map(json.loads, f):
                kept = {k: v for k, v in record.items() if not k.startswith(TIMINGS)}
                lines += [f"  step {record['step']} {k} {v!r}" for k, v in sorted(kept.items())]
        state = os.path.join(workdir, "checkpoints", str(steps), "state")
        hashed = subprocess.run(
            [sys.executable, "-c", HASH_STATE, state], capture_output=True, text=True
        )
        lines += hashed.stdout.rstrip().splitlines() or [f"  no state: {hashed.stderr[-300:]}"]
        return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated names of " + ",".join(CONFIGS))
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CONFIGS)
    for name in names:
        print("\n".join(fingerprint(name, CONFIGS[name], args.steps)), flush=True)


if __name__ == "__main__":
    main()
