"""`model.scan_cached_layers`: the forwards with a KV cache (prefill, decode, the grouped forward)
run the layers as one scan over a stacked cache. They compute what the layer-by-layer forwards
compute: the same rollouts (tokens, masks, experts; log-probs to float32 rounding), with a
shared prompt, compaction, tool turns, LoRA, experts, sliding windows and a mesh, and the same
grouped forward and gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jrl import multi_turn, rollout, sharding
from jrl.models import lora
from jrl.models import transformer as tfm

from conftest import sample, tiny_model
from helpers import tiny_decoders
from helpers.scripted_host import EOS, PAD

PROMPTS = np.array([[0, 0, 1, 5, 6], [1, 7, 8, 9, 4], [0, 1, 3, 3, 3]], np.int32)
PMASK = (np.arange(5)[None] >= np.array([[2], [0], [1]])).astype(np.int32)
IDS = dict(max_new_tokens=12, eos_id=2, pad_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
LORA = ml_collections.ConfigDict(dict(rank=2, alpha=4.0, target_modules="all-linear", dropout=0.0))


def _params(cfg, kind):
    if kind == "gemma":
        return tiny_decoders.random_params(cfg, seed=1, std=0.05)
    params = tfm.init_params(cfg, jax.random.key(1))
    if kind != "lora":
        return params
    base, trainable = lora.init_trainable(params, LORA, jax.random.key(2))
    rng = np.random.default_rng(0)  # B != 0: the adapters change the outputs
    trainable = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.2, x.shape), x.dtype), trainable)
    return lora.combine(base, trainable, lora.scale(LORA))


def _cfg(kind, scan):
    cfg = {
        "dense": lambda: tiny_model(11, num_layers=3),
        "moe": lambda: tiny_model(11, num_layers=3, **MOE),
        "lora": lambda: tiny_model(11, num_layers=3),
        "gemma": lambda: dataclasses.replace(tiny_decoders.GEMMA_CFG, vocab_size=11),
    }[kind]()
    return dataclasses.replace(cfg, scan_cached_layers=scan)


@pytest.mark.parametrize(
    "kind, shared",
    [("dense", True), ("dense", False), ("moe", True), ("gemma", True), ("lora", False)],
)
def test_the_scanned_rollout_samples_what_the_layer_by_layer_one_does(kind, shared):
    params = _params(_cfg(kind, False), kind)

    def run(scan):
        cfg = _cfg(kind, scan)
        gen = lambda p: sample(
            rollout.generate,
            cfg,
            p,
            PROMPTS,
            PMASK,
            jax.random.key(3),
            **IDS,
            samples=4,
            shared_prompt=shared,
            compact_min_rows=3,  # stages of 12, 6, 3 rows: the caches' rows gathered
            record_experts=kind == "moe",
        )
        return jax.jit(gen)(params)

    want, got = run(False), run(True)
    np.testing.assert_array_equal(got.response_ids, want.response_ids)
    np.testing.assert_array_equal(got.response_mask, want.response_mask)
    np.testing.assert_allclose(got.log_probs, want.log_probs, rtol=1e-5, atol=1e-6)
    assert len(set(np.asarray(want.response_mask).sum(1))) > 2  # rows end apart: compaction ran
    if kind == "moe":
        np.testing.assert_array_equal(got.experts.prompt, want.experts.prompt)
        np.testing.assert_array_equal(got.experts.response, want.experts.response)


def test_prepare_keeps_the_stack_for_the_scan_and_casts_its_matrices():
    cfg = dataclasses.replace(_cfg("dense", True), dtype="bfloat16")
    params = tfm.init_params(cfg, jax.random.key(0))
    layers = rollout.prepare(cfg, params)["params"]["layers"]
    q = layers["attn"]["q_proj"]
    assert q.shape == params["layers"]["attn"]["q_proj"].shape and q.dtype == jnp.bfloat16
    assert layers["input_norm"]["scale"].dtype == jnp.float32  # 1-D scales stay as stored
    split = rollout.prepare(dataclasses.replace(cfg, scan_cached_layers=False), params)
    assert len(split["params"]["layers"]) == cfg.num_layers
    # a forward without a cache (remat "none": layer by layer) is not touched by the flag
    ids = jnp.asarray(PROMPTS)
    np.testing.assert_array_equal(
        tfm.forward(cfg, params, ids, PMASK),
        tfm.forward(dataclasses.replace(cfg, scan_cached_layers=False), params, ids, PMASK),
    )


class _Tool:
    """Answers every CALL (token 3) with the block (9, 10); a row ends at EOS or its third turn."""

    block_size, stop_ids, stat_names = 4, (EOS, 3), ()

    def __init__(self):
        self.blocks = 0

    def __call__(self, ids, length, turn_start, waiting, turns):
        from helpers.scripted_host import turn_result

        b = ids.shape[0]
        blocks, finished = {}, np.zeros(b, bool)
        for row in np.flatnonzero(waiting):
            if ids[row, length[row] - 1] == EOS or turns[row] >= 3:
                finished[row] = True
            else:
                blocks[row] = [9, 10]
        self.blocks += len(blocks)
        return turn_result(b, blocks, finished, np.zeros(b, np.float32), np.zeros((b, 0)))


def test_the_scanned_multi_turn_rollout_writes_tool_blocks_where_the_layered_one_does():
    params = _params(_cfg("dense", False), "dense")

    def run(scan):
        host = _Tool()
        gen = lambda p: sample(
            multi_turn.generate,
            _cfg("dense", scan),
            p,
            PROMPTS,
            PMASK,
            jax.random.key(4),
            max_new_tokens=16,
            eos_id=EOS,
            pad_id=PAD,
            host=host,
            samples=4,
        )
        return jax.jit(gen)(params), host.blocks

    (want, blocks), (got, again) = run(False), run(True)
    assert blocks == again and blocks >= 2  # tool blocks were written
    for name in multi_turn.MultiTurnRollout._fields:
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        if name == "log_probs":
            np.testing.assert_allclose(a, b, atol=1e-6)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_scanned_grouped_forward_gives_the_same_outputs_and_gradients(kind):
    """Each prompt once and its rows' responses over its cache (`grouped_response_forward`, the
    scoring and update forwards of `model.shared_prompt_forward`), scanned and not."""
    params = _params(_cfg(kind, False), kind)
    rng = np.random.default_rng(0)
    prompt, pmask = jnp.asarray(PROMPTS), jnp.asarray(PMASK)
    resp = jnp.asarray(rng.integers(1, 11, (6, 4)), jnp.int32)  # 2 rows per prompt

    def outputs(scan):
        cfg = _cfg(kind, scan)

        def total(p):
            out = tfm.grouped_response_forward(cfg, p, prompt, pmask, resp)
            return jnp.sum(tfm.lm_logits(cfg, out.hidden, out.head) ** 2) / 1e3, out.hidden

        return jax.jit(jax.value_and_grad(total, has_aux=True))(params)

    (want, want_hidden), want_grad = outputs(False)
    (got, got_hidden), got_grad = outputs(True)
    np.testing.assert_allclose(got_hidden, want_hidden, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_grad, want_grad
    )


def test_the_scanned_rollout_under_a_mesh_is_the_unsharded_one():
    cfg = _cfg("dense", True)
    params = _params(cfg, "dense")
    gen = lambda p: sample(
        rollout.generate, cfg, p, PROMPTS, PMASK, jax.random.key(5), **IDS, samples=4
    )
    want = jax.jit(gen)(params)
    mesh = sharding.make_mesh(shape=(2, 2, 2))
    with jax.set_mesh(mesh):
        p = jax.device_put(params, sharding.param_shardings(mesh, params, tfm.logical_axes(cfg)))
        got = jax.jit(gen)(p)
    np.testing.assert_array_equal(got.response_ids, want.response_ids)
    np.testing.assert_allclose(got.log_probs, want.log_probs, atol=1e-6)
