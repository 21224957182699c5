"""Mixtures of experts (jrl/models/moe.py, `transformer.MoE`): the dispatch against a per-token
loop, routing and its replay, the load-balancing loss by hand, and the Qwen3-MoE / Mixtral
checkpoints against transformers (goldens from scripts/make_hf_goldens.py: logits and the
load-balancing loss), their export round trip and the layouts they come in."""

import dataclasses
import json
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import save_file

from conftest import GOLDEN, tiny_model
from helpers.moe_configs import MIXTRAL_8X7B, QWEN3_30B_A3B
from jrl import sharding
from jrl.models import hf, lora, moe
from jrl.models import transformer as tfm

# golden directory -> family; qwen3_moe: layer 0 sparse (8 experts, top 2, weights as the
# softmax gives them), layer 1 dense (mlp_only_layers); qwen3_moe_topk_norm: layer 0 dense,
# layer 1 sparse (decoder_sparse_step 2), top-2 weights renormalised; mixtral: both sparse.
GOLDENS = {"qwen3_moe": "qwen3_moe", "qwen3_moe_topk_norm": "qwen3_moe", "mixtral": "mixtral"}
IDS = np.load(os.path.join(GOLDEN, "input_ids.npy"))
MASK = np.load(os.path.join(GOLDEN, "attention_mask.npy"))
REAL = MASK.astype(bool)
silu = jax.nn.silu


def _naive(x, experts, weights, gate, up, down):
    """sum_j w[t, j] * down[e](silu(x_t gate[e]) * x_t up[e]), token by token (numpy)."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t], weights[t]):
            g = x[t] @ gate[e]
            out[t] += w * ((g / (1 + np.exp(-g)) * (x[t] @ up[e])) @ down[e])
    return out


def _gathered(x, experts, weights, gate, up, down):
    """The same in JAX through each pair's gathered expert weights (no sorting, no grouped
    matmul): the reference for gradients."""
    g = jnp.einsum("th,tkhi->tki", x, gate[experts])
    u = jnp.einsum("th,tkhi->tki", x, up[experts])
    return jnp.einsum("tki,tkih,tk->th", silu(g) * u, down[experts], weights)


def _expert_weights(e=4, h=6, i=5, seed=0):
    rng = np.random.default_rng(seed)
    w = lambda *s: jnp.asarray(0.5 * rng.standard_normal(s), jnp.float32)
    return w(e, h, i), w(e, h, i), w(e, i, h)


# 14 (token, expert) pairs: expert 0 has 6, expert 1 5, expert 2 none, expert 3 3.
EXPERTS = np.array([[0, 1], [1, 0], [3, 1], [0, 3], [1, 0], [3, 0], [0, 1]], np.int32)


@pytest.mark.parametrize("implementation", ["ragged", "tiled", "capacity", "chunks"])
def test_dispatch_equals_a_loop_over_each_tokens_experts_and_so_do_its_gradients(
    implementation, monkeypatch
):
    """The sorted rows in groups of 6, 5, 0 and 3; "tiled" in tiles of 4 rows, so groups start
    and end inside tiles and a tile holds two groups; "capacity" in passes of 4 rows per
    expert, so two passes, the second with rows of two groups only; "chunks" in chunks of 4
    rows: every group's first chunk together (group 2's empty), then the second chunks of
    groups 0 and 1 as one batch of E / 2 = 2 items, each with its expert's weights taken out."""
    monkeypatch.setattr(moe, "TILE", 4)
    gate, up, down = _expert_weights()
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((7, 6)), jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (7, 2)), jnp.float32)
    experts = jnp.asarray(EXPERTS)
    run = lambda *a: moe.experts_forward(
        a[0], experts, a[1], *a[2:], silu, jnp.float32, implementation=implementation
    )
    y = run(x, weights, gate, up, down)
    want = _naive(x, EXPERTS, np.asarray(weights), gate, up, down)
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=0)

    cot = jnp.asarray(rng.standard_normal((7, 6)), jnp.float32)
    ours = jax.grad(lambda *a: jnp.sum(run(*a) * cot), argnums=range(5))(x, weights, gate, up, down)
    ref = jax.grad(
        lambda x, w, g, u, d: jnp.sum(_gathered(x, experts, w, g, u, d) * cot), argnums=range(5)
    )(x, weights, gate, up, down)
    for name, a, b in zip(("x", "weights", "gate", "up", "down"), ours, ref):
        assert np.isfinite(np.asarray(a)).all(), name
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=name)
    assert not np.asarray(ours[2][2]).any()  # the expert no token reached: no gradient


@pytest.mark.parametrize("implementation", ["capacity", "chunks"])
def test_crowded_groups_and_their_gradients(implementation, monkeypatch):
    """Expert 0 gets 12 of 24 pairs, expert 1 9, expert 3 3, expert 2 none ("capacity": three
    passes of 4 rows per expert). Chunks of 4 rows
    (TILE 4): the first chunks hold 4 + 4 + 0 + 3 rows, then 2 + 2 more chunks (expert 1's last
    one row) in two loop batches of E / 2 = 2; output and gradients against the pair-by-pair
    references."""
    monkeypatch.setattr(moe, "TILE", 4)
    experts = np.array([[0, 1]] * 9 + [[0, 3]] * 2 + [[3, 0]], np.int32)
    assert np.bincount(experts.ravel(), minlength=4).tolist() == [12, 9, 0, 3]
    gate, up, down = _expert_weights(seed=2)
    rng = np.random.default_rng(3)
    t = experts.shape[0]
    x = jnp.asarray(rng.standard_normal((t, 6)), jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (t, 2)), jnp.float32)
    run = lambda *a: moe.experts_forward(
        a[0], jnp.asarray(experts), a[1], *a[2:], silu, jnp.float32, implementation=implementation
    )
    y = run(x, weights, gate, up, down)
    np.testing.assert_allclose(
        y, _naive(x, experts, np.asarray(weights), gate, up, down), atol=1e-5
    )
    cot = jnp.asarray(rng.standard_normal((t, 6)), jnp.float32)
    ours = jax.grad(lambda *a: jnp.sum(run(*a) * cot), argnums=range(5))(x, weights, gate, up, down)
    ref = jax.grad(
        lambda *a: jnp.sum(_gathered(a[0], jnp.asarray(experts), *a[1:]) * cot), argnums=range(5)
    )(x, weights, gate, up, down)
    for name, a, b in zip(("x", "weights", "gate", "up", "down"), ours, ref):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=name)


def test_rows_per_item_of_the_expert_mlp():
    # "capacity": twice the mean group, rounded up to a power of two; "chunks": the mean group,
    # rounded down; both 8 to TILE (128). W2-MoE: 256 pairs in a decode step, 2,272 in an update
    # micro-batch, 8 experts.
    assert [moe.capacity_rows(m, 8) for m in (10, 256, 2272)] == [8, 64, 128]
    assert [moe.chunk_rows(m, 8) for m in (10, 256, 2272, 1000)] == [8, 32, 128, 64]
    assert moe.resolve_matmul("auto", "cpu") == "chunks"
    assert moe.resolve_matmul("auto", "gpu") == moe.resolve_matmul("auto", "tpu") == "ragged"


def test_route_takes_the_top_k_of_the_softmax_and_renormalises_on_request():
    logits = jnp.log(jnp.asarray([[0.1, 0.5, 0.15, 0.25], [0.4, 0.3, 0.2, 0.1]]))
    experts, weights, probs, own = moe.route(logits, 2, normalize=False)
    np.testing.assert_array_equal(experts, [[1, 3], [0, 1]])
    np.testing.assert_array_equal(own, experts)
    np.testing.assert_allclose(weights, [[0.5, 0.25], [0.4, 0.3]], rtol=1e-6)
    np.testing.assert_allclose(probs[0], [0.1, 0.5, 0.15, 0.25], rtol=1e-6)
    _, normed, _, _ = moe.route(logits, 2, normalize=True)
    np.testing.assert_allclose(normed, [[2 / 3, 1 / 3], [4 / 7, 3 / 7]], rtol=1e-6)
    # replay: the given experts, weighted by their probabilities; the own top k still reported
    given = jnp.asarray([[2, 0], [3, 1]])
    experts, weights, _, own = moe.route(logits, 2, normalize=True, experts_TK=given)
    np.testing.assert_array_equal(experts, given)
    np.testing.assert_array_equal(own, [[1, 3], [0, 1]])
    np.testing.assert_allclose(weights, [[0.6, 0.4], [0.25, 0.75]], rtol=1e-6)


def test_load_balancing_loss_by_hand():
    """E = 2, k = 1, two layers. Layer a: tokens with probabilities (.75, .25), (.25, .75),
    (.6, .4) and a padding token (.1, .9) -> top 1: e0, e1, e0 (padding not counted): load
    (2, 1), probs (1.6, 1.4), 3 tokens. Layer b: (.9, .1), (.8, .2), (.3, .7), padding (.5, .5)
    -> load (2, 1), probs (2.0, 1.0). Together over 6 tokens: f = (4, 2) / 6, P = (3.6, 2.4) /
    6 = (.6, .4); loss = 2 * (2/3 * .6 + 1/3 * .4) = 16 / 15."""
    valid = jnp.asarray([1, 1, 1, 0])
    layers = []
    layer_a = [[0.75, 0.25], [0.25, 0.75], [0.6, 0.4], [0.1, 0.9]]
    layer_b = [[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.5, 0.5]]
    for p in (layer_a, layer_b):
        probs = jnp.asarray(p, jnp.float32)
        _, _, _, own = moe.route(jnp.log(probs), 1, normalize=False)
        layers.append(moe.routing_stats(own, probs, valid))
    np.testing.assert_allclose(layers[0][0], [2, 1])
    np.testing.assert_allclose(layers[0][1], [1.6, 1.4], rtol=1e-6)
    stacked = moe.Routing(None, *(jnp.stack(s) for s in zip(*layers)))
    np.testing.assert_allclose(moe.load_balancing_loss(stacked), 16 / 15, rtol=1e-6)


# conftest's tiny decoder (hidden 32) with 3 layers, 0 and 2 sparse: 4 experts of width 8, top 2
EXPERTS_ON = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
TINY = tiny_model(23, num_layers=3, mlp_only_layers=(1,), **EXPERTS_ON)


def _random_params(cfg, seed=0, std=0.3):
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda k: tfm.init_params(cfg, k), jax.random.key(0))
    return jax.tree.map(lambda s: std * rng.standard_normal(s.shape).astype(np.float32), shapes)


def test_block_uses_replayed_experts_and_reports_its_own():
    block = tfm.MoE(dataclasses.replace(TINY, norm_topk_prob=True))
    x = jax.random.normal(jax.random.key(1), (2, 3, 32))
    params = nn.unbox(block.init(jax.random.key(0), x))
    y, routing = block.apply(params, x)
    assert routing.experts.shape == (2, 3, 2)
    same, again = block.apply(params, x, routing.experts)
    np.testing.assert_array_equal(same, y)  # its own choice replayed: the same numbers
    np.testing.assert_array_equal(again.experts, routing.experts)
    # other experts: the output of those, weighted by the router's renormalised probabilities
    given = (routing.experts + 1) % 4
    y2, routing2 = block.apply(params, x, given)
    np.testing.assert_array_equal(routing2.experts, routing.experts)  # still its own top k
    p = params["params"]
    x2 = np.asarray(x).reshape(6, 32)
    probs = np.asarray(jax.nn.softmax(x2 @ np.asarray(p["router"]), -1))
    e = np.asarray(given).reshape(6, 2)
    w = np.take_along_axis(probs, e, -1)
    w = w / w.sum(-1, keepdims=True)
    want = _naive(x2, e, w, p["gate_proj"], p["up_proj"], p["down_proj"])
    np.testing.assert_allclose(np.asarray(y2).reshape(6, 32), want, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tiny_params():
    return _random_params(TINY)


def test_replay_through_the_model_changes_only_what_it_should(tiny_params):
    ids = jnp.asarray([[0, 0, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]])
    mask = (ids > 0).astype(jnp.int32)
    out = tfm.full_forward(TINY, tiny_params, ids, mask)
    assert out.routing.experts.shape == (2, 2, 7, 2)  # [sparse layers, B, L, k]
    np.testing.assert_array_equal(out.routing.tokens, [12, 12])  # padding not counted
    replayed = tfm.full_forward(TINY, tiny_params, ids, mask, routing=out.routing.experts)
    np.testing.assert_array_equal(replayed.hidden, out.hidden)
    # other experts (each + 1 mod 4: another pair) for row 0's token 4 in the last layer: that
    # position changes, every other keeps its hidden state (no attention after the last MoE)
    other = out.routing.experts.at[1, 0, 4].set((out.routing.experts[1, 0, 4] + 1) % 4)
    moved = tfm.full_forward(TINY, tiny_params, ids, mask, routing=other)
    diff = np.abs(np.asarray(moved.hidden - out.hidden)).max(-1)
    assert diff[0, 4] > 1e-3
    diff[0, 4] = 0
    assert diff.max() == 0
    # in the first layer: position 4 and, through attention, the later ones of that row (its
    # real tokens before it keep theirs; its padding, 0 and 1, is garbage either way)
    early = out.routing.experts.at[0, 0, 4].set((out.routing.experts[0, 0, 4] + 1) % 4)
    moved = tfm.full_forward(TINY, tiny_params, ids, mask, early)
    diff = np.abs(np.asarray(moved.hidden - out.hidden)).max(-1)
    assert (diff[0, 4:] > 1e-4).all() and diff[0, 2:4].max() == 0 and diff[1].max() == 0


def test_rematerialised_scan_and_decode_with_a_cache_compute_the_full_forward(tiny_params):
    """The remat path scans the layers, choosing each one's MLP with `nn.cond`; the rollout's
    path (`decode`: products accumulated in float32) prefills and decodes token by token."""
    ids = jnp.asarray([[0, 0, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]])
    mask = (ids > 0).astype(jnp.int32)
    out = tfm.full_forward(TINY, tiny_params, ids, mask)
    remat = tfm.full_forward(dataclasses.replace(TINY, remat="block"), tiny_params, ids, mask)
    np.testing.assert_allclose(remat.hidden, out.hidden, atol=1e-5)
    np.testing.assert_array_equal(remat.routing.experts, out.routing.experts)
    np.testing.assert_allclose(remat.routing.probs, out.routing.probs, rtol=1e-5)

    model = tfm.Transformer(TINY, decode=True)
    variables = tfm.variables(tfm.unstack_layers(TINY, tiny_params))
    p = 5
    pre = tfm.prefill(model, variables, ids[:, :p], mask[:, :p], 1, 2)
    np.testing.assert_allclose(pre.last.hidden[:, 0], out.hidden[:, p - 1], atol=1e-5)
    position = pre.first_position[:, None]
    step = model.apply(variables, ids[:, p : p + 1], position, pre.key_valid, pre.cache, p)
    np.testing.assert_allclose(step.hidden[:, 0], out.hidden[:, p], atol=1e-5)
    np.testing.assert_array_equal(step.routing.experts[:, :, 0], out.routing.experts[:, :, p])


def test_bad_expert_settings_raise_one_line_errors():
    base = dict(vocab_size=11, num_layers=2, num_experts=4)
    for change, match in [
        ({"num_experts_per_tok": 0}, r"num_experts_per_tok=0 must be in \[1, model.num_experts=4"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 must be in \[1"),
        ({"num_experts_per_tok": 2, "decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ({"num_experts_per_tok": 2, "mlp_only_layers": (2,)}, r"mlp_only_layers=\[2\] names"),
        ({"num_experts_per_tok": 2, "moe_intermediate_size": 0}, "moe_intermediate_size=0"),
        ({"num_experts": -1}, "num_experts=-1"),
    ]:
        with pytest.raises(ValueError, match=match) as e:
            tfm.ModelConfig(**{**base, **change})
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoints


@pytest.fixture(scope="module")
def loaded():
    """name -> (ModelConfig, params, logits [B, T, V], load-balancing loss), each run once."""
    cache = {}

    def get(name):
        if name not in cache:
            cfg, params = hf.load_pretrained(os.path.join(GOLDEN, name))
            out = tfm.full_forward(cfg, params, jnp.asarray(IDS), jnp.asarray(MASK))
            logits = np.asarray(tfm.lm_logits(cfg, out.hidden, out.head))
            cache[name] = (cfg, params, logits, float(moe.load_balancing_loss(out.routing)))
        return cache[name]

    return get


def _flat(params):
    return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(params).items()}


@pytest.mark.parametrize("name", list(GOLDENS))
def test_logits_and_load_balancing_loss_match_transformers(loaded, name):
    cfg, params, logits, aux = loaded(name)
    assert cfg.hf_model_type == GOLDENS[name]
    want = np.load(os.path.join(GOLDEN, name, "logits.npy"))
    np.testing.assert_allclose(logits[REAL], want[REAL], atol=1e-4, rtol=0)
    np.testing.assert_allclose(aux, np.load(os.path.join(GOLDEN, name, "aux_loss.npy")), rtol=1e-5)
    kinds = {"qwen3_moe": (0,), "qwen3_moe_topk_norm": (1,), "mixtral": (0, 1)}
    assert cfg.sparse_layers() == kinds[name]
    assert cfg.norm_topk_prob == (name != "qwen3_moe")
    assert (cfg.router_aux_loss_coef, cfg.output_router_logits) == (0.001, False)
    # jax.lax.ragged_dot gives them too ("auto" is "chunks" on CPU)
    ragged = dataclasses.replace(cfg, moe_matmul="ragged")
    got = np.asarray(tfm.forward(ragged, params, jnp.asarray(IDS), jnp.asarray(MASK)))
    np.testing.assert_allclose(got[REAL], want[REAL], atol=1e-4, rtol=0)
    # the renormalisation matters here: flipped, the logits move far from transformers'
    flipped = dataclasses.replace(cfg, norm_topk_prob=not cfg.norm_topk_prob)
    other = np.asarray(tfm.forward(flipped, params, jnp.asarray(IDS), jnp.asarray(MASK)))
    assert np.abs(other[REAL] - want[REAL]).max() > 0.1


@pytest.mark.parametrize("name", list(GOLDENS))
def test_export_round_trip_gives_identical_config_params_and_logits(loaded, name, tmp_path):
    cfg, params, logits, _ = loaded(name)
    hf.save_pretrained(cfg, params, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == GOLDENS[name]
    assert written["architectures"] == [hf.FAMILIES[GOLDENS[name]].architecture]
    with safe_open(tmp_path / hf.WEIGHTS_FILE, framework="np") as f:
        names = set(f.keys())
    with safe_open(os.path.join(GOLDEN, name, hf.WEIGHTS_FILE), framework="np") as f:
        assert names == set(f.keys())  # the released layout: one tensor per expert
    cfg2, params2 = hf.load_pretrained(tmp_path)
    assert cfg2 == cfg
    a, b = _flat(params), _flat(params2)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
    again = np.asarray(tfm.forward(cfg2, params2, jnp.asarray(IDS), jnp.asarray(MASK)))
    np.testing.assert_array_equal(again, logits)


def _fuse(src, dst, mixtral: bool):
    """The golden at `src` rewritten at `dst` with its experts fused as transformers 5 holds
    them (save_original_format=False): gate_up_proj [E, 2I, H] (gate rows, then up rows) and
    down_proj [E, H, I] per layer, Mixtral's block under `mlp.`."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    with safe_open(dst / hf.WEIGHTS_FILE, framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    block = "block_sparse_moe" if mixtral else "mlp"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}.{block}."
        if prefix + "gate.weight" not in tensors:  # a dense layer
            continue
        expert = lambda e, n: tensors.pop(f"{prefix}experts.{e}.{n}.weight")
        experts = range(config["num_local_experts"])
        gate_up = [np.concatenate([expert(e, gate), expert(e, up)]) for e in experts]
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(gate_up)
        tensors[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(
            [expert(e, down) for e in experts]
        )
        tensors[f"model.layers.{i}.mlp.gate.weight"] = tensors.pop(prefix + "gate.weight")
    save_file(tensors, dst / hf.WEIGHTS_FILE, metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_fused_experts_load_as_the_per_expert_layout(loaded, name, tmp_path):
    _fuse(os.path.join(GOLDEN, name), tmp_path / name, mixtral=name == "mixtral")
    with safe_open(tmp_path / name / hf.WEIGHTS_FILE, framework="np") as f:
        assert not [k for k in f.keys() if ".experts.0." in k or "block_sparse" in k]
    _, params = hf.load_pretrained(tmp_path / name)
    a, b = _flat(loaded(name)[1]), _flat(params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_sharded_load_streams_experts_into_their_shards(loaded):
    """Mesh (data 2, fsdp 2, tensor 2); "expert" is replicated: Mixtral's gate_proj [2 layers,
    4 experts, H 32, I 32] splits H over fsdp and I over tensor."""
    path = os.path.join(GOLDEN, "mixtral")
    cfg = hf.load_config(path)
    mesh = sharding.make_mesh(shape=(2, 2, 2))
    shardings = sharding.param_shardings(mesh, hf.abstract_params(cfg), tfm.logical_axes(cfg))
    _, params = hf.load_pretrained(path, shardings=shardings)
    gate = params["layers"]["moe"]["gate_proj"]
    assert {s.data.shape for s in gate.addressable_shards} == {(2, 4, 16, 16)}
    for k, v in _flat(params).items():
        np.testing.assert_array_equal(v, _flat(loaded("mixtral")[1])[k], err_msg=str(k))


@pytest.mark.parametrize(
    "config, experts, expert_shape",
    [
        (QWEN3_30B_A3B, (128, 8, 768), (48, 128, 2048, 768)),
        (MIXTRAL_8X7B, (8, 2, 14336), (32, 8, 4096, 14336)),
    ],
)
def test_released_configs_read_and_write_back(config, experts, expert_shape):
    cfg = hf.model_config_from_hf(config, "bfloat16")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_size) == experts
    assert cfg.sparse_layers() == tuple(range(cfg.num_layers)) and cfg.norm_topk_prob
    layer = hf.abstract_params(cfg)["layers"]
    assert "mlp" not in layer and layer["moe"]["gate_proj"].shape == expert_shape
    assert layer["moe"]["router"].shape == (*expert_shape[:1], expert_shape[2], expert_shape[1])
    assert hf.model_config_from_hf(hf.hf_config_dict(cfg, "bfloat16"), "bfloat16") == cfg


def test_checkpoint_errors_name_the_expert_tensor(tmp_path):
    path = tmp_path / "q"
    shutil.copytree(os.path.join(GOLDEN, "qwen3_moe"), path)
    with safe_open(path / hf.WEIGHTS_FILE, framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors.pop("model.layers.0.mlp.experts.7.up_proj.weight")
    save_file(tensors, path / hf.WEIGHTS_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks tensors: model.layers.0.mlp.experts.7.up_proj"):
        hf.load_pretrained(path)
    path = tmp_path / "m"
    shutil.copytree(os.path.join(GOLDEN, "mixtral"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "router_jitter_noise": 0.1}))
    with pytest.raises(ValueError, match="router_jitter_noise=0.1 are not supported"):
        hf.load_pretrained(path)


def test_lora_adapts_attention_and_experts_where_no_layer_has_a_dense_mlp(loaded):
    """The default targets adapt Mixtral's attention and its experts (one A / B per expert:
    tests/moe_step_test.py), no dense MLP (it has none)."""
    targets = lora.target_list("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    adapters = lora.init_adapters(loaded("mixtral")[1], targets, 2, jax.random.key(0))
    assert set(adapters["layers"]) == {"attn", "moe"}


def test_transformers_loads_the_export(loaded, tmp_path):
    """transformers' forward of each golden and of jrl's export of it agree, and jrl loads what
    transformers writes with its experts fused (needs torch; skipped without it)."""
    torch = pytest.importorskip("torch")
    import transformers

    positions = torch.tensor(np.maximum(np.cumsum(MASK, -1) - 1, 0))

    def hf_logits(model):
        with torch.no_grad():
            ids = torch.tensor(IDS, dtype=torch.long)
            return model(input_ids=ids, attention_mask=torch.tensor(MASK), position_ids=positions)

    load = lambda path: transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    for name in GOLDENS:
        cfg, params, logits, _ = loaded(name)
        live = hf_logits(load(os.path.join(GOLDEN, name))).logits.numpy()
        np.testing.assert_allclose(logits[REAL], live[REAL], atol=1e-4, rtol=0, err_msg=name)
        model = load(hf.save_pretrained(cfg, params, tmp_path / name))
        assert model.config.model_type == GOLDENS[name]
        np.testing.assert_allclose(hf_logits(model).logits.numpy(), live, atol=1e-6, err_msg=name)
        model.save_pretrained(tmp_path / f"{name}_fused", save_original_format=False)
        _, fused = hf.load_pretrained(tmp_path / f"{name}_fused")
        for k, v in _flat(fused).items():
            np.testing.assert_array_equal(v, _flat(params)[k], err_msg=f"{name} {k}")
