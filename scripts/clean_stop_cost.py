"""What the clean-stop machinery costs (docs/performance.md, "Clean stops"):

  python scripts/clean_stop_cost.py reward      # a user reward in its worker vs in the trainer
  python scripts/clean_stop_cost.py checksums   # CRC-32 lists of a 512 MB checkpoint

`reward`: `checked_scores` of a trivial score function (exact match on the first line) on 64 and
128 responses of 300 characters, in this process and in its worker process
(`jrl.rewards.worker.ProcessScore`), the two alternated 400 times; prints the medians and the
added time per call. `checksums`: saves a 512 MB float32 state once, then times writing and
checking its checksum list five times (`write_checksums`, `damage`).
"""

import os
import random
import shutil
import statistics
import string
import sys
import tempfile
import time


def exact(responses, ground_truths):
    return [float(r.split("\n")[0].strip() == g.strip()) for r, g in zip(responses, ground_truths)]


def reward_cost(rounds: int = 400) -> None:
    from jrl.rewards import worker
    from jrl.rewards.python import checked_scores

    rng = random.Random(0)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the worker imports this file
    for rows in (64, 128):
        responses = ["".join(rng.choices(string.ascii_letters + " ", k=300)) for _ in range(rows)]
        truths = [str(rng.randrange(1000)) for _ in range(rows)]
        in_worker = worker.ProcessScore("clean_stop_cost:exact", name="exact", timeout_s=60.0)
        times = {exact: [], in_worker: []}
        for _ in range(rounds):
            for fn in times:
                t = time.perf_counter()
                checked_scores(fn, responses, truths)
                times[fn].append(time.perf_counter() - t)
        in_worker.close()
        added = sorted(b - a for a, b in zip(times[exact], times[in_worker]))
        ms = lambda x: f"{x * 1e3:.3f} ms"
        print(
            f"{rows} rows: in process {ms(statistics.median(times[exact]))}, in the worker "
            f"{ms(statistics.median(times[in_worker]))}; added {ms(statistics.median(added))} "
            f"(p10 {ms(added[len(added) // 10])}, p90 {ms(added[len(added) * 9 // 10])})"
        )


def checksum_cost(megabytes: int = 512, rounds: int = 5) -> None:
    import jax.numpy as jnp
    import numpy as np

    from jrl.run import checkpoint

    n = megabytes * (1 << 20) // 4 // 8
    rngs = [np.random.default_rng(i) for i in range(8)]
    state = {f"w{i}": jnp.asarray(rng.standard_normal(n, np.float32)) for i, rng in enumerate(rngs)}
    root = tempfile.mkdtemp(prefix="jrl-checksum-cost-")
    try:
        with checkpoint.Checkpointer(root, every_steps=1, max_to_keep=1) as ckpt:
            ckpt.save(1, state, {})
        step = os.path.join(root, checkpoint.CHECKPOINTS_DIR, "1")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step) for f in fs)
        write, check = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            checkpoint.write_checksums(step)
            write.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert checkpoint.damage(step) is None
            check.append(time.perf_counter() - t)
        w, c = statistics.median(write), statistics.median(check)
        print(
            f"{size / 1e6:.0f} MB of files: writing the list {w:.2f} s ({size / 1e6 / w:.0f} MB/s; "
            f"{min(write):.2f} to {max(write):.2f}), checking it {c:.2f} s ({min(check):.2f} to "
            f"{max(check):.2f})"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    {"reward": reward_cost, "checksums": checksum_cost}[sys.argv[1]]()
