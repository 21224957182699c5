"""Mixtures of experts in the RL step (jrl/router_replay.py): routing replay (the rollout's
experts, R3, or the old-log-prob forward's, R2, replayed by the training forwards) through
compaction, multi-turn rollouts and the fused step, the router's load-balancing loss in the
actor loss, and LoRA adapters on the experts.

Numbers: the bfloat16 gaps against a dense model's, the flip of a near-tie router, transformers'
load-balancing loss of the golden Qwen3-MoE (tests/golden/qwen3_moe/aux_loss.npy) and PEFT's
delta formula W + (alpha / r) B A on the exported tensors; the replayed log-probs of a float32
model against the rollout's own."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import GOLDEN, sample, tiny_config, tiny_model
from jrl import config as config_lib
from jrl import logprobs, multi_turn, rollout, router_replay
from jrl import step as step_lib
from jrl import train_state
from jrl.models import hf, lora
from jrl.models import transformer as tfm
from jrl.run import trainer
from helpers.scripted_host import CALL, EOS, PAD, PMASK, PROMPTS, ScriptedHost

IDS = np.load(os.path.join(GOLDEN, "input_ids.npy"))
MASK = np.load(os.path.join(GOLDEN, "attention_mask.npy"))
PROMPT, RESPONSE = router_replay.PROMPT, router_replay.RESPONSE
EXPERTS = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    moe_matmul="ragged",
)
WIDE = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)


def near_ties(params, scale=4.0, router=0.1):
    """Weights `scale` x larger (sharper outputs) and the routers' `router` x smaller: router
    probabilities close to uniform, so top-2 choices are near ties that rounding can flip."""
    params = jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, params)
    moe = {**params["layers"]["moe"], "router": params["layers"]["moe"]["router"] * router}
    return {**params, "layers": {**params["layers"], "moe": moe}}


def sampled(cfg, params, prompts, prompt_mask, key, r, **options):
    """A rollout (2 samples of each prompt, experts recorded for a model with experts) and the
    rows the scoring forwards take."""
    out = rollout.generate(
        cfg,
        params,
        jnp.asarray(prompts),
        jnp.asarray(prompt_mask),
        key,
        max_new_tokens=r,
        eos_id=EOS,
        pad_id=PAD,
        samples=2,
        record_experts=cfg.num_experts > 0,
        **options,
    )
    rows = {
        "input_ids": jnp.repeat(jnp.asarray(prompts), 2, 0),
        "attention_mask": jnp.repeat(jnp.asarray(prompt_mask), 2, 0),
        "response_ids": out.response_ids,
        "response_mask": out.response_mask,
    }
    if out.experts is not None:
        rows[PROMPT], rows[RESPONSE] = out.experts
    return out, rows


def scored(cfg, params, rows, replay: bool, **outputs):
    """`response_outputs` of the rows, replaying their recorded experts or not."""
    routing = router_replay.replayed(rows) if replay else None
    args = (rows["input_ids"], rows["attention_mask"], rows["response_ids"], rows["response_mask"])
    return logprobs.response_outputs(cfg, params, *args, routing=routing, **outputs)


def gap(out, res):
    """|log pi_train - log pi_rollout| of the sampled tokens."""
    mask = np.asarray(out.response_mask) > 0
    return np.abs(np.asarray(res["log_prob"]) - np.asarray(out.log_probs))[mask]


def test_replayed_bfloat16_log_probs_are_as_close_to_the_rollout_as_a_dense_models():
    """bfloat16 rollout and training forward of a dense model (MLP 64 wide) and of a mixture of
    8 experts (top 2 of width 32: 64 active) with near-tie routers and the same attention: the
    trainer's log-probs of the sampled tokens against the sampler's. Some tokens' experts flip
    between the two forwards' rounding (the replaying forward's own top 2 differ from the
    recorded ones); replayed (R3), the gap is the dense model's. Measured (2-core CPU): dense
    max 0.049 / mean 0.0065, experts replayed 0.046 / 0.0062 with 1.5% of the tokens routed
    apart (afresh, those moved the largest gap to 0.78 and the mean to 0.0102; the fused step's
    test below has that flip)."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 60, (16, 6)).astype(np.int32)
    mask = np.ones_like(prompts)
    key = jax.random.key(0)
    dense = tiny_model(64, **WIDE, intermediate_size=64, dtype="bfloat16")
    sparse = tiny_model(64, **WIDE, **EXPERTS, dtype="bfloat16")
    p_dense = jax.tree.map(lambda x: 4 * x if x.ndim > 1 else x, tfm.init_params(dense, key))
    p_sparse = near_ties(tfm.init_params(sparse, key))
    out, rows = sampled(dense, p_dense, prompts, mask, key, 24)
    floor = gap(out, scored(dense, p_dense, rows, False))
    out, rows = sampled(sparse, p_sparse, prompts, mask, key, 24)
    res = scored(sparse, p_sparse, rows, True, with_experts=True)
    flips = router_replay.mismatch_counts(rows, (res[PROMPT], res[RESPONSE]))
    flipped = np.sum(flips["mismatched_tokens"]) / np.sum(flips["tokens"])
    replayed = gap(out, res)
    print(
        f"dense {floor.max():.3f} / {floor.mean():.4f}, replayed {replayed.max():.3f} / "
        f"{replayed.mean():.4f}, routed apart {flipped:.3f}"
    )
    assert flipped > 0  # the two forwards' rounding routes some tokens apart
    assert replayed.mean() <= 1.25 * floor.mean() and replayed.max() <= 2 * floor.max()


def moe_step(mode: str, **changes):
    """One fused step of the tiny config on a bfloat16 mixture of experts with near-tie
    routers (its dense MLP replaced by 8 experts), from seed-0 parameters: its metrics."""
    cfg = tiny_config(
        **{
            "warmup.sft_steps": 0,
            "model.dtype": "bfloat16",
            "data.max_response_length": 16,
            "actor.router_replay.mode": mode,
            **changes,
        }
    )
    built = trainer.build(cfg)
    tok, task, reward_fn = built.tokenizer, built.task, built.reward_fn
    model_cfg = dataclasses.replace(built.model_cfg, **{**EXPERTS, "moe_intermediate_size": 16})
    step = jax.jit(step_lib.make_step(cfg, model_cfg, reward_fn, **trainer.sampling_ids(tok, task)))
    key = jax.random.key(0)
    params = near_ties(tfm.init_params(model_cfg, key), scale=2.0)
    state = train_state.init_state(cfg, model_cfg, params, key)
    _, metrics = step(state, task.train_batch(0, cfg.data.train_batch_size))
    return jax.device_get(metrics)


def test_fused_step_replays_the_rollouts_experts_or_the_old_forwards():
    """The same rollout (same key; bfloat16, routers near ties) scored by the old-log-prob
    forward replaying it (R3) or routing afresh (R2; the update then replays the old forward's
    experts): the largest |log pi_old - log pi_rollout| is a flipped token's afresh and a
    rounding's replayed. Under the on-policy shortcut (one mini-batch: R3 in 4 micro-batches of
    a grouped update forward, with the load-balancing loss) the update's forward reports the
    same experts. Measured: R2 (afresh) 0.054, R3 0.0074 (on-policy 0.0038), with 0.62% of the
    recorded tokens routed apart in some layer (0.31% of the token-layer pairs) by the replaying
    forward's own top 2."""
    r3 = moe_step("R3")
    on_policy = {
        "actor.ppo_mini_batch_size": 4,
        "actor.ppo_micro_batch_size_per_device": 4,
        "actor.router_aux_loss_coef": 0.01,
    }
    r3_on = moe_step("R3", **on_policy)
    r2 = moe_step("R2")
    for name, m in (("R2", r2), ("R3", r3), ("R3 on-policy", r3_on)):
        print(name, {k: round(float(v), 4) for k, v in m.items() if "router" in k})
    diff = "router_replay/rollout_log_probs_diff_max"
    frac, layer_frac = "router_replay/mismatch_token_frac", "router_replay/mismatch_layer_frac"
    assert 0 < r3[frac] < 0.5 and r3[layer_frac] <= r3[frac]
    assert frac not in r2  # nothing recorded to compare with
    # the on-policy update's forward replays the same experts as the old one: the same tokens
    # routed apart, and a gap to the rollout at bfloat16 rounding (not the same rounding: the
    # grouped update forward computes in other shapes), far below routing afresh
    assert r2[diff] > 5 * max(r3[diff], r3_on[diff])
    for key in (frac, layer_frac):
        np.testing.assert_allclose(r3_on[key], r3[key], rtol=0.05, atol=1e-3, err_msg=key)
    assert 0 < r3_on["actor/router_aux_loss"] < 8 and "actor/router_aux_loss" not in r3
    for m in (r2, r3, r3_on):
        assert all(np.isfinite(v) for v in m.values()) and m["training/step_skipped"] == 0


SMALL = tiny_model(11, **{**EXPERTS, "num_experts": 4, "moe_intermediate_size": 16})


def assert_replayed(cfg, params, rows, log_probs, model_mask):
    """The float32 training forward over the rows routes every recorded token as the rollout did
    (its own experts are the recorded ones) and, replaying them, gives the rollout's log-probs
    of the model's tokens."""
    res = scored(cfg, params, rows, True, with_experts=True)
    counts = router_replay.mismatch_counts(rows, (res[PROMPT], res[RESPONSE]))
    assert np.sum(counts["mismatched_pairs"]) == 0 and np.sum(counts["tokens"]) > 0
    np.testing.assert_allclose(
        np.asarray(res["log_prob"])[model_mask], np.asarray(log_probs)[model_mask], atol=1e-5
    )


def test_compacted_decode_records_each_tokens_experts_at_its_row_and_the_trainer_replays_them():
    """16 rows of skewed forced lengths decoded in stages of 16 and 8 rows (compact_min_rows=8):
    each token a forward fed (a row's tokens but a last one at slot R - 1) has experts, -1 the
    rest, and they are the float32 training forward's own at the same row and position."""
    import compact_decode_test as plain  # its prompts and skewed lengths

    params = tfm.init_params(SMALL, jax.random.key(1))
    lengths = jnp.asarray(plain.LENGTHS)
    out, rows = sampled(
        SMALL,
        params,
        plain.PROMPTS,
        plain.PMASK,
        jax.random.key(2),
        plain.R,
        forced_length=lengths,
        compact_min_rows=8,
    )
    fed = np.arange(plain.R)[None] < np.minimum(plain.LENGTHS, plain.R - 1)[:, None]
    np.testing.assert_array_equal(np.asarray(rows[RESPONSE])[..., 0, 0] >= 0, fed)
    assert_replayed(SMALL, params, rows, out.log_probs, np.asarray(out.response_mask) > 0)


def test_multi_turn_rollout_records_tool_tokens_experts_from_the_block_forward():
    """Each row: a model token, a call, a 2-token tool answer (the host's), a model token and
    EOS. The tool tokens' experts are those of the block forward that wrote them into the
    cache, which a full forward over model and tool tokens computes again."""
    r = 8
    force = np.full((4, r), -1, np.int32)
    force[:, [0, 1, 4, 5]] = [5, CALL, 6, EOS]
    host = ScriptedHost({row: [([9, 10], False), ([], True)] for row in range(4)})
    params = tfm.init_params(SMALL, jax.random.key(1))
    ids = dict(max_new_tokens=r, eos_id=EOS, pad_id=PAD, force_ids=jnp.asarray(force))
    key = jax.random.key(0)
    out = sample(
        multi_turn.generate,
        SMALL,
        params,
        PROMPTS,
        PMASK,
        key,
        host=host,
        **ids,
        record_experts=True,
    )
    np.testing.assert_array_equal(out.response_ids[:, :6], [[5, CALL, 9, 10, 6, EOS]] * 4)
    recorded = np.asarray(out.experts.response)[..., 0, 0] >= 0
    np.testing.assert_array_equal(recorded, np.arange(r)[None].repeat(4, 0) < 6)
    rows = {
        "input_ids": jnp.asarray(PROMPTS),
        "attention_mask": jnp.asarray(PMASK),
        "response_ids": out.response_ids,
        "response_mask": out.response_mask,
        "response_valid": out.valid,
        PROMPT: out.experts.prompt,
        RESPONSE: out.experts.response,
    }
    res = logprobs.response_outputs(
        SMALL,
        params,
        rows["input_ids"],
        rows["attention_mask"],
        out.response_ids,
        out.valid,
        routing=router_replay.replayed(rows),
        with_experts=True,
    )
    counts = router_replay.mismatch_counts(rows, (res[PROMPT], res[RESPONSE]))
    assert np.sum(counts["mismatched_pairs"]) == 0
    np.testing.assert_array_equal(counts["tokens"], np.asarray(PMASK).sum(1) + 6)
    model = np.asarray(out.response_mask) > 0
    np.testing.assert_allclose(
        np.asarray(res["log_prob"])[model], np.asarray(out.log_probs)[model], atol=1e-5
    )


def qwen3_moe():
    """The golden Qwen3-MoE (layer 0 sparse: 8 experts, top 2; layer 1 dense)."""
    model_cfg, params = hf.load_pretrained(os.path.join(GOLDEN, "qwen3_moe"))
    return dataclasses.replace(model_cfg, moe_matmul="ragged"), params  # compiles faster


def test_aux_loss_adds_its_coefficient_times_transformers_load_balancing_loss():
    """The actor loss of the golden rows (split into prompt and response) with
    actor.router_aux_loss_coef = c is the loss without it plus c x the load-balancing loss
    transformers computed for those rows (aux_loss.npy), which it reports."""
    model_cfg, params = qwen3_moe()
    want = float(np.load(os.path.join(GOLDEN, "qwen3_moe", "aux_loss.npy")))
    p = 4  # row 1's prompt is left-padded
    mb = {
        "input_ids": IDS[:, :p],
        "attention_mask": MASK[:, :p],
        "response_ids": IDS[:, p:],
        "response_mask": MASK[:, p:],
        "advantages": np.linspace(-1, 1, IDS[:, p:].size).reshape(2, -1).astype(np.float32),
        "old_log_prob": np.full(IDS[:, p:].shape, -4.0, np.float32),
    }
    mb = jax.tree.map(jnp.asarray, mb)
    losses = {}
    for coef in (0.0, 0.25):
        cfg = tiny_config(**{"rollout.n": 2, "actor.router_aux_loss_coef": coef})
        spec = step_lib.make_spec(cfg, model_cfg, None, eos_id=1, pad_id=0, max_new_tokens=8)
        counts = step_lib.mini_batch_counts(spec, mb)
        loss = lambda p, spec=spec, counts=counts: step_lib.actor_loss(
            p, mb, spec, counts, None, 1.0, jax.random.key(0)
        )
        losses[coef] = jax.jit(loss)(params)
    (plain, _), (with_aux, metrics) = losses[0.0], losses[0.25]
    np.testing.assert_allclose(metrics["actor/router_aux_loss"], want, rtol=1e-5)
    np.testing.assert_allclose(with_aux, plain + 0.25 * want, rtol=1e-5)


def test_lora_on_experts_starts_at_the_base_trains_each_expert_and_exports_as_peft():
    """Default targets on the golden Qwen3-MoE: adapters on attention, the dense MLP (layer 1)
    and every expert (one A / B each); B = 0 gives the base's logits; gradients reach the B of
    the experts layer 0 routes real tokens to, and of no other; with B random the adapted
    forward is the merged weights', the rollout's folding (`fold_expert_adapters`) computes the
    same, and PEFT's delta of the exported tensors, W + (alpha / r) B A, is the merge's."""
    model_cfg, params = qwen3_moe()
    lora_cfg = ml_collections.ConfigDict(
        dict(rank=2, alpha=4.0, target_modules=",".join(lora.TARGETS), dropout=0.0)
    )
    base, trainable = lora.init_trainable(params, lora_cfg, jax.random.key(0))
    s = lora.scale(lora_cfg)
    experts = trainable["lora"]["layers"]["moe"]
    e, h = model_cfg.num_experts, model_cfg.hidden_size
    assert experts["gate_proj"]["a"].shape == (2, e, h, 2)
    assert experts["down_proj"]["b"].shape == (2, e, 2, h)
    ids, mask = jnp.asarray(IDS), jnp.asarray(MASK)
    logits = jax.jit(lambda p: tfm.forward(model_cfg, p, ids, mask))
    np.testing.assert_array_equal(logits(lora.combine(base, trainable, s)), logits(params))

    def loss(t):
        picked = jnp.take_along_axis(logits(lora.combine(base, t, s)), ids[..., None], -1)
        return jnp.sum(picked[..., 0] * mask)

    grads = jax.jit(jax.grad(loss))(trainable)["lora"]["layers"]["moe"]
    routed = tfm.full_forward(model_cfg, params, ids, mask).routing.experts[0]  # layer 0's
    used = np.isin(np.arange(e), np.asarray(routed)[np.asarray(MASK) > 0])
    for name in lora.EXPERT_TARGETS:
        norms = np.abs(np.asarray(grads[name]["b"])).sum((2, 3))  # [layers, experts]
        np.testing.assert_array_equal(norms[0] > 0, used, err_msg=name)
        assert not norms[1].any()  # layer 1 is dense: its experts compute nothing

    rng = np.random.default_rng(0)
    noisy = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype), trainable)
    adapted, merged = lora.combine(base, noisy, s), lora.merge(base, noisy, s)
    np.testing.assert_allclose(logits(adapted), logits(merged), atol=1e-5)
    folded = tfm.fold_expert_adapters(model_cfg, adapted)
    assert "moe" not in folded["lora"]["layers"]
    np.testing.assert_allclose(logits(folded), logits(adapted), atol=1e-6)

    tensors = lora.peft_tensors(noisy, model_cfg)
    hf_weights = load_file(os.path.join(GOLDEN, "qwen3_moe", hf.WEIGHTS_FILE))
    for layer, name in ((0, "mlp.experts.3.down_proj"), (1, "mlp.gate_proj")):
        prefix = f"base_model.model.model.layers.{layer}.{name}"
        a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
        w = hf_weights[f"model.layers.{layer}.{name}.weight"]  # [out, in]
        jrl = merged["layers"]["moe" if "experts" in name else "mlp"][name.rsplit(".", 1)[1]]
        jrl = jrl[0, 3] if "experts" in name else jrl[1]
        np.testing.assert_allclose(w + s * b @ a, np.asarray(jrl).T, atol=1e-6, err_msg=name)
    misplaced = (".layers.0.mlp.gate_proj.", ".layers.1.mlp.experts.")  # dense, sparse layers
    assert not any(m in k for m in misplaced for k in tensors)
    assert sum(".experts." in k for k in tensors) == 3 * e * 2  # 3 projections, A and B
    assert lora.peft_config(lora_cfg, "", model_cfg)["target_modules"] == list(lora.TARGETS)
    mixtral = hf.load_config(os.path.join(GOLDEN, "mixtral"))
    names = lora.peft_target_modules(lora_cfg, mixtral)
    assert names == ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2"]


def test_replay_and_the_aux_loss_need_a_model_with_experts_and_r2_an_old_forward():
    cfg = tiny_config(**{"actor.router_replay.mode": "R3"})
    with pytest.raises(config_lib.ConfigError, match="router_replay.mode='R3' replays") as e:
        config_lib.validate(cfg)  # model.* fields: a dense model
    assert "\n" not in str(e.value)
    with pytest.raises(config_lib.ConfigError, match="but the policy is dense"):
        step_lib.make_spec(cfg, tiny_model(11), None, eos_id=1, pad_id=0, max_new_tokens=4)
    cfg = tiny_config(**{"actor.router_aux_loss_coef": 0.01})
    with pytest.raises(config_lib.ConfigError, match="router_aux_loss_coef=0.01 weighs"):
        config_lib.validate(cfg)
    cfg = tiny_config(**{"actor.router_replay.mode": "R4"})
    with pytest.raises(config_lib.ConfigError, match="mode='R4' is unknown; valid names: R2, R3"):
        config_lib.validate(cfg)
    cfg = tiny_config(**{"actor.router_replay.mode": "R2", "actor.policy_loss": "bypass_mode"})
    cfg.algorithm.rollout_correction.update(enable=True, bypass_mode=True)
    with pytest.raises(config_lib.ConfigError, match="bypass mode does not run"):
        config_lib.validate(cfg)


def test_buckets_trim_the_response_experts_and_keep_the_prompts_at_any_width():
    """P = 4 prompt slots and R = 4 response slots, trimmed to 2: the prompt's experts pass
    through whole, in and out, though their second axis is R long."""
    from jrl import buckets

    rows = {
        "input_ids": jnp.ones((2, 4), jnp.int32),
        "response_mask": jnp.asarray([[1, 1, 0, 0], [1, 0, 0, 0]]),
        PROMPT: jnp.arange(16).reshape(2, 4, 1, 2),
        RESPONSE: jnp.arange(16).reshape(2, 4, 1, 2),
    }
    seen = []  # each branch's shapes (lax.switch traces both)

    def fn(cut):
        seen.append((cut[PROMPT].shape, cut[RESPONSE].shape))
        return {PROMPT: cut[PROMPT], RESPONSE: cut[RESPONSE]}

    out = buckets.trimmed(fn, rows, (2, 4))
    assert seen == [((2, 4, 1, 2), (2, 2, 1, 2)), ((2, 4, 1, 2), (2, 4, 1, 2))]
    np.testing.assert_array_equal(out[PROMPT], rows[PROMPT])
    np.testing.assert_array_equal(out[RESPONSE][:, :2], rows[RESPONSE][:, :2])
    assert not np.asarray(out[RESPONSE][:, 2:]).any()
