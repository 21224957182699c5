"""A loss over a batch sharded across 8 devices equals the one-device loss, for every aggregation
mode (jrl's global means need no dp_size / global_batch_size arguments, unlike verl)."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl.algos import kl as kl_lib
from jrl.algos import losses as loss_lib

from helpers import algos_fixtures as fx


def all_losses(x, mode):
    """The policy loss of several kinds (with IS weights), its gradient, KL loss and value loss."""
    out = {}
    for name in ("vanilla", "gspo", "geo_mean"):
        f = lambda lp, name=name: fx.run_loss(
            name, x["old"], lp, x["adv"], x["mask"], mode, weights=x["w"], clip_ratio_high=0.28
        )
        out[name] = jax.value_and_grad(f, has_aux=True)(x["new"])
    mask = x["mask"]
    out["kl"] = loss_lib.agg_loss(kl_lib.kl_penalty(x["new"], x["old"], "low_var_kl"), mask, mode)
    out["value"] = loss_lib.value_loss(x["new"], x["adv"], x["old"], mask, 0.2, mode)
    return out


def test_sharded_loss_equals_one_device_loss_in_every_mode():
    assert jax.device_count() == 8
    rng = np.random.default_rng(0)
    b, t = 16, 6
    lengths = rng.integers(1, t + 1, b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    mask[3] = 0  # a row without tokens on one device
    old = rng.uniform(-2, -0.1, (b, t)).astype(np.float32)
    x = {
        "mask": mask,
        "old": old,
        "new": (old + rng.normal(0, 0.2, (b, t))).astype(np.float32),
        "adv": rng.normal(0, 1, (b, t)).astype(np.float32),
        "w": rng.uniform(0.5, 1.5, (b, t)).astype(np.float32),
    }
    fn = jax.jit(lambda x: {mode: all_losses(x, mode) for mode in loss_lib.loss_agg_modes()})
    one = fn(jax.device_put(x, jax.devices()[0]))
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    sharded_x = jax.device_put(x, rows)
    assert len(sharded_x["mask"].sharding.device_set) == 8
    sharded = fn(sharded_x)
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-6),
        sharded,
        one,
    )
