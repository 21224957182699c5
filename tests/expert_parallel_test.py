"""Expert parallelism (the "expert" mesh axis, `jrl.models.moe.dispatch`): the rules that split a
sparse layer's experts over it, and a fused GRPO step of a tiny mixture-of-experts model on
meshes with an expert axis over 8 CPU devices giving the metrics and parameters of one device."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import tiny_config
from jrl import sharding
from jrl import step as step_lib
from jrl import train_state
from jrl.models import transformer
from jrl.run import trainer
from helpers.meshes import shard_shapes, varied_reward

AXES = sharding.EXPERT_MESH_AXES  # data, fsdp, expert, tensor


def _tiny_moe():
    """The tiny demo config with one layer, and its decoder made sparse: 8 experts of width 16,
    top 2, weights renormalised (Qwen3-MoE's norm_topk_prob)."""
    cfg = tiny_config(**{"model.num_layers": 1, "actor.use_kl_loss": True})
    built = trainer.build(cfg)
    tok, task, model_cfg = built.tokenizer, built.task, built.model_cfg
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    model_cfg = dataclasses.replace(model_cfg, **experts, norm_topk_prob=True)
    return cfg, tok, task, model_cfg


def test_rules_split_experts_over_the_expert_axis_and_the_rest_over_fsdp_and_expert():
    cfg, _, _, model_cfg = _tiny_moe()
    abstract = jax.eval_shape(lambda: transformer.init_params(model_cfg, jax.random.key(0)))
    axes = transformer.logical_axes(model_cfg)
    mesh = sharding.make_mesh(AXES, (1, 2, 2, 2))
    sh = sharding.param_shardings(mesh, abstract, axes)
    layer = sh["layers"]
    # gate [1 layer, E 8, H 32, I 16]: experts over expert, H over fsdp (expert is taken), I over
    # tensor; the dense weights' "embed" over fsdp x expert
    assert layer["moe"]["gate_proj"].spec == P(None, "expert", "fsdp", "tensor")
    assert layer["moe"]["down_proj"].spec == P(None, "expert", "tensor", "fsdp")
    assert layer["attn"]["q_proj"].spec == P(None, ("fsdp", "expert"), "tensor", None)
    assert sh["embed"].spec == P("tensor", ("fsdp", "expert"))
    assert sharding.batch_sharding(mesh, 8).spec == P(("data", "fsdp", "expert"))
    assert sharding.batch_sharding(mesh, 2).spec == P(("data", "fsdp"))
    # without an expert axis the rules are those of data x fsdp x tensor
    plain = sharding.param_shardings(sharding.make_mesh(shape=(2, 2, 2)), abstract, axes)
    assert plain["layers"]["moe"]["gate_proj"].spec == P(None, None, "fsdp", "tensor")
    assert plain["embed"].spec == P("tensor", "fsdp")
    with pytest.raises(ValueError, match="no sharding rule maps anything onto 'experts'"):
        sharding.make_mesh(("data", "experts", "tensor"), (2, 2, 2))


# (data, fsdp, expert, tensor): experts 2 per device with the rows split over data too; 4 per
# device beside fsdp and tensor; 1 per device (the 8-way split of rows too)
MESHES = [(2, 1, 4, 1), (1, 2, 2, 2), (1, 1, 8, 1)]


def _run(cfg, tok, task, model_cfg, mesh, steps=2):
    """`steps` fused steps jitted over `mesh` (`trainer.jit_step`) from the seed-0 state:
    (final params on the host, each step's metrics, the expert weights' shard shapes)."""
    init = lambda: train_state.init_state(
        cfg, model_cfg, transformer.init_params(model_cfg, jax.random.key(0)), jax.random.key(1)
    )
    ids = trainer.sampling_ids(tok, task)
    jitted = trainer.jit_step(cfg, model_cfg, varied_reward, ids, mesh, init)
    step, state_sh, batch_sh = jitted.step_fn, jitted.state_sh, jitted.batch_sh
    state = sharding.sharded_init(init, mesh, state_sh)()
    shards = shard_shapes(state.params["layers"]["moe"]["gate_proj"])
    metrics = []
    for i in range(steps):
        batch = jax.device_put(task.train_batch(i, step_lib.prompts_per_step(cfg)), batch_sh)
        with jax.set_mesh(mesh):
            state, m = step(state, batch)
        metrics.append(jax.device_get(m))
    return jax.device_get(state.params), metrics, shards


@pytest.fixture(scope="module")
def one_device():
    moe = _tiny_moe()
    return moe, _run(*moe, sharding.make_mesh(AXES, (1, 1, 1, 1), jax.devices()[:1]))


@pytest.mark.parametrize("shape", MESHES)
def test_fused_step_with_experts_split_matches_one_device(one_device, shape):
    moe, (want_params, want_metrics, _) = one_device
    params, metrics, shards = _run(*moe, sharding.make_mesh(AXES, shape))
    data, fsdp, expert, tensor = shape
    assert shards == {(1, 8 // expert, 32 // fsdp, 16 // tensor)}  # E / ep experts per device
    assert float(want_metrics[0]["actor/grad_norm"]) > 0.1  # a real update, not noise
    for got, want in zip(metrics, want_metrics):
        assert set(got) == set(want)
        for name in ("critic/score/mean", "response_length/mean", "perf/total_num_tokens"):
            assert float(got[name]) == float(want[name]), name  # the same samples
        for name in want:  # float32: the experts' outputs are summed in another order
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, want_params
    )
