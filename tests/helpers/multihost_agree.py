"""One process of tests/run/multihost_test.py: `python tests/helpers/multihost_agree.py PORT
PROCESS_ID`. Each process holds its own values of a tree (as after a warm-up run on every host)
and prints what `jrl.run.trainer.same_on_every_host` makes of them, as JSON."""

import json
import sys

import jax
import numpy as np

port, process_id = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)

from jrl.run import trainer  # noqa: E402

mine = {
    "embed": np.full((2, 3), process_id + 1.0, np.float32),
    "layers": {"w": np.arange(4, dtype=np.float32) * (process_id + 1)},
}
agreed = trainer.same_on_every_host(mine)
print(json.dumps(jax.tree.map(lambda x: np.asarray(x).tolist(), agreed)))
