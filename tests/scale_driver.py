"""`python tests/scale_driver.py <jrl.train flags>`: the trainer with the `divisible_by_3` reward
registered, for runs in fresh processes (one device, or one of several jax.distributed processes).

The built-in arithmetic reward is 0 for an untrained policy, so every advantage would be 0 and the
updates mere rounding noise; this reward differs within each group, so runs on different meshes
are compared on real updates."""

import os
import sys

from absl import app
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jrl import rewards, train  # noqa: E402


def divisible_by_3(batch, response_ids, response_mask, *, eos_id):
    """The share of response tokens whose id is divisible by 3."""
    hits = jnp.sum((response_ids % 3 == 0) * response_mask, -1)
    return hits / jnp.maximum(jnp.sum(response_mask, -1), 1)


rewards.REWARDS["divisible_by_3"] = divisible_by_3

if __name__ == "__main__":
    app.run(train.main, flags_parser=train.parse_flags)
