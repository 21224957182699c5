"""Meshes, logical axis rules, and sharded runs matching the single-device ones (8 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jrl import sharding
from jrl.run import trainer
from jrl import step as step_lib
from jrl import train_state
from jrl.models import transformer
from conftest import tiny_config, tiny_model
from helpers.meshes import shard_shapes, varied_reward

# vocab 32, hidden 16, 4 query heads, 2 kv heads of width 4, MLP 32: every dim divides 2x2x2.
CFG = tiny_model(32, hidden_size=16, num_layers=1, intermediate_size=32)


@pytest.fixture(scope="module")
def params():
    return jax.jit(lambda k: transformer.init_params(CFG, k))(jax.random.key(0))


def test_make_mesh_shapes_and_errors():
    assert dict(sharding.make_mesh().shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert dict(sharding.make_mesh(shape=(2, 2, 2)).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert dict(sharding.make_mesh(shape=(1, -1, 4)).shape) == {"data": 1, "fsdp": 2, "tensor": 4}
    with pytest.raises(ValueError, match=r"needs 3 devices but 8 are available"):
        sharding.make_mesh(shape=(3, 1, 1))
    with pytest.raises(ValueError, match="multiply to 3, which does not divide the 8 devices"):
        sharding.make_mesh(shape=(-1, 3, 1))
    with pytest.raises(ValueError, match="more than one -1"):
        sharding.make_mesh(shape=(-1, -1, 1))


def test_logical_to_mesh_rules():
    # "expert" (expert parallelism) is one more FSDP axis for rows and "embed"; a mesh without
    # it drops it (`present`)
    fsdp = ("fsdp", "expert")
    assert sharding.logical_to_mesh(P("vocab", "embed")) == P("tensor", fsdp)
    assert sharding.logical_to_mesh(P("embed", "heads", "head_dim")) == P(fsdp, "tensor", None)
    assert sharding.logical_to_mesh(P("batch", None)) == P(("data", *fsdp), None)
    mesh = sharding.make_mesh(shape=(2, 2, 2))
    assert sharding.present(mesh, P("tensor", fsdp)) == P("tensor", "fsdp")
    # A mesh axis serves one dimension per array: the later one is replicated.
    rules = (("embed", "fsdp"), ("mlp", "fsdp"))
    assert sharding.logical_to_mesh(P("embed", "mlp"), rules) == P("fsdp", None)
    assert sharding.logical_to_mesh(P("layers", "embed", "mlp")) == P(None, fsdp, "tensor")
    assert sharding.logical_to_mesh(P("expert", "embed", "mlp")) == P("expert", "fsdp", "tensor")
    with pytest.raises(ValueError, match="logical axis 'experts' has no sharding rule"):
        sharding.logical_to_mesh(P("experts", "embed"))


@pytest.mark.parametrize(
    "shape, expected",
    [
        # embed [V=32, H=16] -> (tensor, fsdp); gate [L=1, H, F=32] -> (-, fsdp, tensor);
        # q_proj [L, H, N=4, D=4] -> (-, fsdp, tensor, -); k_proj [L, H, K=2, D] likewise
        ((2, 2, 2), {"embed": (16, 8), "gate": (1, 8, 16), "q": (1, 8, 2, 4), "k": (1, 8, 1, 4)}),
        # tensor=4 does not divide K=2: k_proj keeps its kv heads whole (replicated dim)
        ((1, 2, 4), {"embed": (8, 8), "gate": (1, 8, 8), "q": (1, 8, 1, 4), "k": (1, 8, 2, 4)}),
        (
            (8, 1, 1),
            {"embed": (32, 16), "gate": (1, 16, 32), "q": (1, 16, 4, 4), "k": (1, 16, 2, 4)},
        ),
    ],
)
def test_params_really_split(params, shape, expected):
    mesh = sharding.make_mesh(shape=shape)
    shardings = sharding.param_shardings(mesh, params, transformer.logical_axes(CFG))
    placed = jax.device_put(params, shardings)
    layer = placed["layers"]
    got = {
        "embed": placed["embed"],
        "gate": layer["mlp"]["gate_proj"],
        "q": layer["attn"]["q_proj"],
        "k": layer["attn"]["k_proj"],
    }
    assert {k: shard_shapes(v) for k, v in got.items()} == {k: {v} for k, v in expected.items()}
    np.testing.assert_array_equal(np.asarray(placed["embed"]), np.asarray(params["embed"]))


def test_non_divisible_dims_fall_back_to_replicated():
    mesh = sharding.make_mesh(shape=(1, 2, 4))
    odd = transformer.ModelConfig(
        vocab_size=30,
        hidden_size=12,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=12,
    )
    abstract = jax.eval_shape(lambda k: transformer.init_params(odd, k), jax.random.key(0))
    sh = sharding.param_shardings(mesh, abstract, transformer.logical_axes(odd))
    assert sh["embed"].spec == P(None, "fsdp")  # 30 % 4 != 0: vocab replicated
    assert sh["layers"]["attn"]["q_proj"].spec == P(None, "fsdp", None, None)  # 2 heads over 4
    assert sh["layers"]["mlp"]["gate_proj"].spec == P(None, "fsdp", "tensor")  # 12 % 4 == 0
    placed = jax.device_put(jnp.zeros((30, 12)), sh["embed"])
    assert shard_shapes(placed) == {(30, 6)}
    # Batch rows keep the longest prefix of (data, fsdp) that divides them.
    mesh222 = sharding.make_mesh(shape=(2, 2, 2))
    assert sharding.batch_sharding(mesh222, batch_size=8).spec == P(("data", "fsdp"))
    assert sharding.batch_sharding(mesh222, batch_size=2).spec == P("data")
    assert sharding.batch_sharding(sharding.make_mesh(), batch_size=4).spec == P(None)
    assert sharding.cache_sharding(mesh).spec == P(("data", "fsdp"), "tensor", None, None)
    assert sharding.cache_sharding(mesh, (4, 2, 10, 8)).spec == P(
        ("data", "fsdp"), None, None, None
    )
    cache = jax.device_put(
        transformer.init_cache(CFG, 8, 10), sharding.cache_sharding(mesh222, (8, 2, 10, 4))
    )
    assert shard_shapes(cache[0]["k"]) == shard_shapes(cache[0]["v"]) == {(2, 1, 10, 4)}
    with pytest.raises(ValueError, match="mesh axis 'model' but the mesh has axes"):
        sharding.named_sharding(mesh, P("embed"), (12,), (("embed", "model"),))


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 2, 4)])
def test_sharded_forward_matches_unsharded(params, shape):
    ids = jax.random.randint(jax.random.key(1), (8, 6), 0, CFG.vocab_size)
    mask = jnp.ones_like(ids).at[:3, :2].set(0)  # some left padding
    fwd = lambda p, i, m: transformer.forward(CFG, p, i, m)
    expected = jax.jit(fwd)(params, ids, mask)
    mesh = sharding.make_mesh(shape=shape)
    p_sh = sharding.param_shardings(mesh, params, transformer.logical_axes(CFG))
    b_sh = sharding.batch_sharding(mesh, batch_size=8)
    got = jax.jit(fwd, in_shardings=(p_sh, b_sh, b_sh))(params, ids, mask)
    assert got.shape == (8, 6, CFG.vocab_size)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=0, atol=1e-5)


def test_state_shardings_mirror_params_in_optimizer_states():
    """PPO with a separate critic and a reference: every part of the state gets its sharding."""
    cfg = tiny_config("ppo_math")
    cfg.actor.use_kl_loss = True
    policy_cfg, critic_cfg = train_state.model_configs(cfg, CFG)
    init = lambda: train_state.init_state(
        cfg, policy_cfg, transformer.init_params(policy_cfg, jax.random.key(0)), jax.random.key(1)
    )
    abstract = jax.eval_shape(init)
    mesh = sharding.make_mesh(shape=(2, 2, 2))
    sh = sharding.state_shardings(
        mesh, abstract, transformer.logical_axes(policy_cfg), transformer.logical_axes(critic_cfg)
    )
    gate = P(None, "fsdp", "tensor")  # [layers, embed, mlp]
    adam = sh.opt_state[1][0]  # chain(clip_by_global_norm, adamw): ScaleByAdamState
    assert sh.params["layers"]["mlp"]["gate_proj"].spec == gate
    assert adam.mu["layers"]["mlp"]["gate_proj"].spec == gate
    assert adam.nu["embed"].spec == P("tensor", "fsdp")
    assert adam.count.spec == P()
    assert sh.ref_params["embed"].spec == P("tensor", "fsdp")
    assert sh.critic_params["value_head"].spec == P("fsdp", None)
    assert sh.critic_opt_state[1][0].mu["value_head"].spec == P("fsdp", None)
    assert sh.critic_opt_state[1][0].mu["layers"]["attn"]["o_proj"].spec == P(
        None, "tensor", None, "fsdp"
    )
    model_parts = ("params", "opt_state", "critic_params", "critic_opt_state", "ref_params")
    rest = sh.replace(**dict.fromkeys(model_parts))  # step, kl_coef, key, ...: replicated
    assert {s.spec for s in jax.tree.leaves(rest)} == {P()}
    assert jax.tree.structure(sh) == jax.tree.structure(abstract)
    with pytest.raises(ValueError, match="critic_axes is None"):
        sharding.state_shardings(mesh, abstract, transformer.logical_axes(policy_cfg))


def test_fused_step_on_2x2x2_mesh_matches_one_device():
    cfg = tiny_config()
    cfg.actor.use_kl_loss = True  # reference params in the state too
    cfg.model.num_layers = 1
    built = trainer.build(cfg)
    tok, task, model_cfg = built.tokenizer, built.task, built.model_cfg
    step = step_lib.make_step(cfg, model_cfg, varied_reward, **trainer.sampling_ids(tok, task))
    init = lambda: train_state.init_state(
        cfg, model_cfg, transformer.init_params(model_cfg, jax.random.key(0)), jax.random.key(1)
    )
    batches = [task.train_batch(i, step_lib.prompts_per_step(cfg)) for i in range(2)]

    mesh = sharding.make_mesh(shape=(2, 2, 2))
    state_sh = sharding.state_shardings(
        mesh, jax.eval_shape(init), transformer.logical_axes(model_cfg)
    )
    batch_sh = sharding.batch_sharding(mesh, batch_size=step_lib.prompts_per_step(cfg))
    state = sharding.sharded_init(init, mesh, state_sh)()
    assert shard_shapes(state.params["embed"]) == {(44, 16)}  # vocab 88 / 2, hidden 32 / 2
    assert shard_shapes(state.opt_state[1][0].mu["embed"]) == {(44, 16)}
    single = jax.device_get(state)  # the same initial state for the 1-device run

    sharded_step = jax.jit(
        step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=0
    )
    sharded_metrics = []
    for i, batch in enumerate(batches):
        batch = jax.device_put(batch, batch_sh)
        if i == 0:
            state, metrics = sharded_step(state, batch)
        else:  # steady state: nothing moves between host and devices
            with jax.transfer_guard("disallow"):
                state, metrics = sharded_step(state, batch)
        sharded_metrics.append(jax.device_get(metrics))
    assert (
        state.params["layers"]["mlp"]["up_proj"].sharding
        == state_sh.params["layers"]["mlp"]["up_proj"]
    )

    # float32 tolerances: metrics rtol 1e-5 / atol 1e-6 and params atol 1e-6 (observed: relative
    # metric gaps <= 3e-7 away from zero, absolute <= 6e-8; params <= 2e-8).
    one_device = jax.jit(step)
    for batch, got in zip(batches, sharded_metrics):
        single, want = one_device(single, batch)
        want = jax.device_get(want)
        assert set(got) == set(want)
        assert float(want["actor/grad_norm"]) > 0.1  # a real update, not noise
        for name in ("critic/score/mean", "response_length/mean", "perf/total_num_tokens"):
            assert float(got[name]) == float(want[name]), name  # same samples, bit for bit
        for name in want:
            np.testing.assert_allclose(
                float(got[name]), float(want[name]), rtol=1e-5, atol=1e-6, err_msg=name
            )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6),
        jax.device_get(state.params),
        jax.device_get(single.params),
    )
    assert int(state.step) == 2


def test_constrain_pins_the_kv_cache_under_a_mesh_and_is_a_no_op_without():
    pin = jax.jit(lambda c: sharding.constrain(c, sharding.CACHE_AXES))
    cache = transformer.init_cache(CFG, 8, 10)  # every layer's k / v: [8, 2 kv heads, 10, 4]
    mesh = sharding.make_mesh(shape=(2, 2, 2))
    with jax.set_mesh(mesh):
        pinned = pin(cache)
    want = jax.sharding.NamedSharding(mesh, P(("data", "fsdp"), "tensor", None, None))
    for entry in jax.tree.leaves(pinned):
        assert entry.sharding.is_equivalent_to(want, 4)
        assert shard_shapes(entry) == {(2, 1, 10, 4)}
    with jax.set_mesh(sharding.make_mesh(shape=(1, 2, 4))):  # 4 does not divide 2 kv heads
        assert shard_shapes(pin(cache)[0]["k"]) == {(4, 2, 10, 4)}
    free = pin(cache)  # no mesh in context: left to the compiler (one device here)
    assert len(free[0]["k"].sharding.device_set) == 1
