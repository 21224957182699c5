"""`sharding.sharded_init(..., donate_argnums=...)`: building a train state from initial params
can reuse the params' buffers, so the caller's params, the state's policy and its reference copy
are not all alive at once (8 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import sharding
from jrl.run import trainer
from jrl import train_state
from jrl.models import transformer
from conftest import tiny_config, tiny_model

CFG = tiny_model(32, hidden_size=16, num_layers=1, intermediate_size=32)


def buffers(x) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def placed_params(mesh):
    params = jax.device_get(transformer.init_params(CFG, jax.random.key(0)))
    shardings = sharding.param_shardings(
        mesh, jax.eval_shape(lambda: params), transformer.logical_axes(CFG)
    )
    return sharding.put(params, shardings), shardings


def to_state(params):  # the policy plus a reference copy, as a KL-regularised state has
    return {"params": params, "ref": jax.tree.map(jnp.copy, params)}


@pytest.mark.parametrize("donate", [False, True])
def test_donated_params_are_consumed_and_their_buffers_reused(donate):
    mesh = sharding.make_mesh(shape=(2, 2, 2))
    params, shardings = placed_params(mesh)
    before = {k: buffers(v) for k, v in params.items() if not isinstance(v, dict)}
    values = jax.device_get(params)
    kwargs = {"donate_argnums": 0} if donate else {}
    init = sharding.sharded_init(to_state, mesh, {"params": shardings, "ref": shardings}, **kwargs)
    state = init(params)

    leaves = jax.tree.leaves(params)
    if donate:  # consumed: only the state holds the policy now (and the reference copy)
        assert all(x.is_deleted() for x in leaves)
        for k, ptrs in before.items():  # the state's policy lives in the donated buffers
            assert buffers(state["params"][k]) == ptrs
    else:  # the default keeps the caller's params
        assert not any(x.is_deleted() for x in leaves)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["params"]), values)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["ref"]), values)


def test_train_state_from_donated_params():
    cfg = tiny_config()
    cfg.actor.use_kl_loss = True  # reference params in the state too
    cfg.model.num_layers = 1
    model_cfg = trainer.build(cfg).model_cfg
    mesh = sharding.make_mesh(shape=(2, 2, 2))
    init = lambda p: train_state.init_state(cfg, model_cfg, p, jax.random.key(1))
    host = jax.device_get(transformer.init_params(model_cfg, jax.random.key(0)))
    abstract = jax.eval_shape(init, host)
    state_sh = sharding.state_shardings(mesh, abstract, transformer.logical_axes(model_cfg))
    params = sharding.put(host, state_sh.params)
    embed = buffers(params["embed"])
    state = sharding.sharded_init(init, mesh, state_sh, donate_argnums=0)(params)
    assert all(x.is_deleted() for x in jax.tree.leaves(params))
    assert buffers(state.params["embed"]) == embed
    np.testing.assert_array_equal(jax.device_get(state.ref_params["embed"]), host["embed"])
    np.testing.assert_array_equal(jax.device_get(state.params["embed"]), host["embed"])
