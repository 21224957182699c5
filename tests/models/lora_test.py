"""LoRA: adapters on a frozen base (jrl/models/lora.py), in the model, the fused step, checkpoints
and export."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jrl import config as config_lib
from jrl import nan_guard, rollout, train_state
from jrl.run import workdir as workdir_lib
from jrl.models import lora
from jrl.models import transformer as tfm
from conftest import REPO, tiny_config, tiny_model

CFG = tiny_model(23)
CFG = dataclasses.replace(CFG, num_kv_heads=2, qkv_bias=True, tie_word_embeddings=False)
LORA = ml_collections.ConfigDict(
    dict(rank=4, alpha=8.0, target_modules=",".join(lora.TARGETS), dropout=0.0)
)
IDS = np.array([[0, 0, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 8, 9]])
MASK = (np.arange(7)[None] >= np.array([[2], [0]])).astype(np.int32)


def _logits(cfg, params):
    return tfm.apply_full(cfg, params, jnp.asarray(IDS), jnp.asarray(MASK))[0]


def _moved(trainable, key):
    """`trainable` with random B (a trained adapter; B starts at zero)."""
    leaves, tree = jax.tree.flatten(trainable["lora"])
    keys = jax.random.split(key, len(leaves))
    leaves = [0.05 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    return {**trainable, "lora": jax.tree.unflatten(tree, leaves)}


@pytest.fixture(scope="module")
def model():
    params = tfm.init_params(CFG, jax.random.key(0))
    base, trainable = lora.init_trainable(params, LORA, jax.random.key(1))
    return params, base, _moved(trainable, jax.random.key(2))


def test_adapter_shapes_and_step0_equals_base(model):
    params, base, _ = model
    _, fresh = lora.init_trainable(params, LORA, jax.random.key(1))
    ad = fresh["lora"]["layers"]
    # A [L, *in, r], B [L, r, *out]: q_proj W [L, H, N, D], o_proj W [L, N, D, H].
    assert ad["attn"]["q_proj"]["a"].shape == (2, 32, 4)
    assert ad["attn"]["q_proj"]["b"].shape == (2, 4, 4, 8)
    assert ad["attn"]["o_proj"]["a"].shape == (2, 4, 8, 4)
    assert ad["attn"]["o_proj"]["b"].shape == (2, 4, 32)
    assert ad["mlp"]["down_proj"]["a"].shape == (2, 48, 4)
    bound = 1 / np.sqrt(32)  # PEFT: uniform in +-1/sqrt(fan_in)
    assert 0.5 * bound < np.abs(np.asarray(ad["attn"]["q_proj"]["a"])).max() <= bound
    full = lora.combine(base, fresh, lora.scale(LORA))
    np.testing.assert_array_equal(_logits(CFG, full), _logits(CFG, params))


def test_adapted_forward_equals_merged_weights(model):
    """x W + s x A B (the model) == x (W + s A B) (merged weights), on the layer-by-layer path,
    the rematerialised scan and the KV-cache rollout."""
    params, base, trainable = model
    s = lora.scale(LORA)
    full = lora.combine(base, trainable, s)
    merged = lora.merge(base, trainable, s)
    want = _logits(CFG, merged)
    assert np.abs(np.asarray(want - _logits(CFG, params))).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(_logits(CFG, full), want, atol=1e-5)
    remat = dataclasses.replace(CFG, remat="block")
    np.testing.assert_allclose(_logits(remat, full), want, atol=1e-5)
    # The rollout's log-probs (adapters in the decode loop) are the merged model's.
    prompt, pmask = jnp.asarray(IDS[:, :4]), jnp.asarray(MASK[:, :4])
    out = rollout.generate(
        CFG, full, prompt, pmask, jax.random.key(3), max_new_tokens=3, eos_id=22, pad_id=0
    )
    ids = jnp.concatenate([prompt, out.response_ids], 1)
    mask = jnp.concatenate([pmask, out.response_mask], 1)
    logp = jax.nn.log_softmax(tfm.apply_full(CFG, merged, ids, mask)[0][:, 3:-1], -1)
    want_logp = jnp.take_along_axis(logp, out.response_ids[..., None], -1)[..., 0]
    np.testing.assert_allclose(
        out.log_probs * out.response_mask, want_logp * out.response_mask, atol=1e-5
    )


def test_lora_config_errors():
    cfg = config_lib.base_config()
    cfg.lora.rank = 8
    config_lib.validate(cfg)
    for field, value, words in (
        ("rank", -1, "lora.rank=-1"),
        ("target_modules", "q_proj,qproj", "did you mean 'q_proj'"),
        ("target_modules", "", "lora.target_modules is empty"),
        ("dropout", 1.0, "lora.dropout=1.0"),
        ("alpha", 0.0, "lora.alpha=0.0"),
    ):
        bad = config_lib.base_config()
        bad.lora.rank = 8
        bad.lora[field] = value
        with pytest.raises(config_lib.ConfigError, match=words.replace("(", r"\(")):
            config_lib.validate(bad)


def test_dropout_drops_only_the_adapter_input(model):
    """lora.dropout: rate 0 (or no key) leaves the params as they are; the base projection never
    sees dropped inputs (fresh adapters with dropout compute the base exactly); masks depend on
    the key and are the same on the layer-by-layer and the rematerialised scan paths; and the
    adapter's output averaged over masks is the undropped one (x * mask / (1 - p))."""
    params, base, trainable = model
    s = lora.scale(LORA)
    full = lora.combine(base, trainable, s)
    assert lora.with_dropout(full, 0.0, jax.random.key(0)) is full
    assert lora.with_dropout(full, 0.3, None) is full
    _, fresh = lora.init_trainable(params, LORA, jax.random.key(1))
    dropped = lora.with_dropout(lora.combine(base, fresh, s), 0.5, jax.random.key(4))
    np.testing.assert_array_equal(_logits(CFG, dropped), _logits(CFG, params))
    want = _logits(CFG, full)
    one, two = (_logits(CFG, lora.with_dropout(full, 0.3, jax.random.key(k))) for k in (5, 6))
    assert (
        np.abs(np.asarray(one - want)).max() > 1e-3 and np.abs(np.asarray(one - two)).max() > 1e-3
    )
    remat = dataclasses.replace(CFG, remat="block")
    np.testing.assert_allclose(
        _logits(remat, lora.with_dropout(full, 0.3, jax.random.key(5))), one, atol=1e-5
    )

    # One MLP: down_proj's adapter output is linear in its input, so E[mask / (1 - p)] = 1.
    mlp = tfm.MLP(CFG)
    layer0 = jax.tree.map(lambda a: a[0], base["layers"]["mlp"])
    adapters = {
        "down_proj": jax.tree.map(lambda a: a[0], full["lora"]["layers"]["mlp"]["down_proj"])
    }
    x = jax.random.normal(jax.random.key(7), (1, 3, 32))
    apply = lambda lora_vars: mlp.apply({"params": layer0, "lora": lora_vars}, x)
    plain = apply(adapters)
    no_adapter = apply({})

    def sample(key):
        keyed = lora.with_dropout(
            {
                "lora": {
                    "layers": {"mlp": {"down_proj": full["lora"]["layers"]["mlp"]["down_proj"]}}
                }
            },
            0.5,
            key,
        )
        ab = jax.tree.map(lambda a: a[0], keyed["lora"]["layers"]["mlp"]["down_proj"])
        return apply({"down_proj": ab}) - no_adapter

    samples = jax.vmap(sample)(jax.random.split(jax.random.key(8), 4000))
    delta = np.asarray(plain - no_adapter)
    assert np.abs(np.asarray(samples[0]) - delta).max() > 0.1 * np.abs(delta).max()
    sem = np.asarray(samples.std(0)) / np.sqrt(4000)
    assert np.all(np.abs(np.asarray(samples.mean(0)) - delta) < 5 * sem + 1e-6)


def _grpo_lora_cfg():


    cfg = tiny_config()
    cfg.lora.rank = 4
    cfg.actor.use_kl_loss = True
    cfg.actor.entropy_coeff = 0.01  # a gradient even when every reward is equal
    return cfg


def test_fused_step_trains_only_adapters_with_base_as_reference():
    """Two fused steps (one trace): the base (also the KL reference) stays bitwise as it was,
    every adapter matrix moves, the optimizer holds moments of the adapters only, and the score
    phase's reference log-probs are the base model's."""
    from jrl import logprobs
    from jrl import step as step_lib
    from jrl.run import trainer

    cfg = _grpo_lora_cfg()
    built = trainer.build(cfg)
    tok, task, reward_fn, model_cfg = built.tokenizer, built.task, built.reward_fn, built.model_cfg
    params = tfm.init_params(model_cfg, jax.random.key(0))
    want_base = jax.tree.map(np.asarray, params)
    state = train_state.init_state(cfg, model_cfg, params, jax.random.key(1))
    ids = trainer.sampling_ids(tok, task)
    traces = []
    fused = step_lib.make_step(cfg, model_cfg, reward_fn, **ids)

    @jax.jit
    def step(state, batch):
        traces.append(1)
        return fused(state, batch)

    start = state.params
    for i in range(2):
        state, metrics = step(state, task.train_batch(i, step_lib.prompts_per_step(cfg)))
    assert len(traces) == 1
    assert np.isfinite(float(metrics["actor/kl_loss"]))
    jax.tree.map(np.testing.assert_array_equal, state.ref_params, want_base)
    assert set(state.params) == {"lora"}
    for before, after in zip(jax.tree.leaves(start), jax.tree.leaves(state.params)):
        assert np.abs(np.asarray(after - before)).min() > 0  # every entry of A and B moved
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == 2 * sum(x.size for x in jax.tree.leaves(state.params))  # Adam mu, nu

    generate, score, _ = step_lib.make_phases(cfg, model_cfg, reward_fn, **ids)
    exp, _ = generate(state, task.train_batch(5, 4), jax.random.key(2))
    scored = jax.jit(lambda s, e: score(s, e)[0])(state, exp)
    args = [exp[k] for k in ("input_ids", "attention_mask", "response_ids", "response_mask")]
    mask = np.asarray(exp["response_mask"])
    base_logp = logprobs.response_outputs(model_cfg, params, *args, cfg.rollout.temperature)
    base_logp = base_logp["log_prob"]
    np.testing.assert_allclose(scored["ref_log_prob"] * mask, base_logp * mask, atol=1e-5)
    assert np.abs(np.asarray(scored["old_log_prob"] - base_logp) * mask).max() > 1e-4


def test_dropout_changes_the_update_only():
    """lora.dropout > 0: the rollout and the scoring forwards trace exactly as without dropout;
    the update's losses and gradients change, and with the update's key (the step's)."""
    from jrl import step as step_lib
    from jrl.run import trainer

    cfg = _grpo_lora_cfg()
    built = trainer.build(cfg)
    tok, task, reward_fn, model_cfg = built.tokenizer, built.task, built.reward_fn, built.model_cfg
    ids = trainer.sampling_ids(tok, task)
    state = train_state.init_state(
        cfg, model_cfg, tfm.init_params(model_cfg, jax.random.key(0)), jax.random.key(1)
    )
    state = state.replace(params=_moved(state.params, jax.random.key(3)))
    dropped = cfg.copy_and_resolve_references()
    dropped.lora.dropout = 0.2
    plain_phases = step_lib.make_phases(cfg, model_cfg, reward_fn, **ids)
    drop_phases = step_lib.make_phases(dropped, model_cfg, reward_fn, **ids)
    prompts, key = task.train_batch(0, cfg.data.train_batch_size), jax.random.key(2)
    exp = jax.eval_shape(plain_phases[0], state, prompts, key)[0]
    for phase, args in ((0, (state, prompts, key)), (1, (state, exp))):
        trace = lambda phases: str(jax.make_jaxpr(phases[phase])(*args))
        assert trace(drop_phases) == trace(plain_phases)
    # A made-up scored batch is enough for the update (no rollout compiled).
    b, r = exp["response_ids"].shape
    rng = np.random.default_rng(0)
    exp = {
        "input_ids": jnp.repeat(prompts["input_ids"], cfg.rollout.n, 0),
        "attention_mask": jnp.repeat(prompts["attention_mask"], cfg.rollout.n, 0),
        "response_ids": jnp.asarray(rng.integers(3, model_cfg.vocab_size, (b, r)), jnp.int32),
        "response_mask": jnp.asarray(np.arange(r)[None] < rng.integers(1, r, (b, 1)), jnp.int32),
        "advantages": jnp.asarray(rng.normal(size=(b, r)), jnp.float32),
        "old_log_prob": jnp.full((b, r), -3.0),
        "ref_log_prob": jnp.full((b, r), -3.2),
    }
    scored_state = state
    update = {id(p): jax.jit(p[2]) for p in (plain_phases, drop_phases)}
    run = lambda phases, k: update[id(phases)](scored_state, exp, jax.random.key(k))[1]
    plain, drop, drop_next = run(plain_phases, 4), run(drop_phases, 4), run(drop_phases, 5)
    for name in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert abs(float(drop[name]) - float(plain[name])) > 1e-6, name
        assert float(drop[name]) != float(drop_next[name]), name


def test_dropout_keeps_the_ratio_and_clipping_on_in_a_one_epoch_update():
    """One PPO epoch over one mini-batch with lora.dropout = 0.5 and clip ratio 0.01: the old
    log-probs are the policy's without dropout (verl's), so the update's dropped-out forward
    gives a ratio != 1 (actor/ppo_kl != 0) that the clip bounds (actor/pg_clipfrac > 0). Without
    dropout the one-epoch shortcut stays (old = the update's own forward). (The shortcut took the
    dropped-out forward's own log-probs as the old ones: ratio 1, ppo_kl and clipfrac 0.)"""
    from jrl import step as step_lib
    from jrl.run import trainer

    cfg = _grpo_lora_cfg()
    cfg.actor.use_kl_loss = False
    cfg.actor.ppo_mini_batch_size = cfg.data.train_batch_size
    cfg.actor.clip_ratio = 0.01
    assert step_lib.on_policy_update(cfg)
    cfg.lora.dropout = 0.5
    assert not step_lib.on_policy_update(cfg)
    built = trainer.build(cfg)
    tok, task, model_cfg = built.tokenizer, built.task, built.model_cfg
    params = tfm.init_params(model_cfg, jax.random.key(0))
    state = train_state.init_state(cfg, model_cfg, params, jax.random.key(1))
    state = state.replace(params=_moved(state.params, jax.random.key(3)))

    def parity_reward(batch, response_ids, response_mask, *, eos_id):  # groups' rewards differ
        return (response_ids[:, 0] % 2).astype(jnp.float32)

    ids = trainer.sampling_ids(tok, task)
    step = jax.jit(step_lib.make_step(cfg, model_cfg, parity_reward, **ids))
    _, metrics = step(state, task.train_batch(0, step_lib.prompts_per_step(cfg)))
    assert float(metrics["critic/advantages/max"]) > 0
    assert abs(float(metrics["actor/ppo_kl"])) > 1e-4
    assert float(metrics["actor/pg_clipfrac"]) > 0


@pytest.fixture
def compile_cache(tmp_path):
    """A persistent compilation cache for one test: runs of the same config in one process
    (a run and its resume) compile each program once."""
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {name: getattr(jax.config, name) for name in names}
    jax.config.update(names[0], str(tmp_path / "compile_cache"))
    jax.config.update(names[1], 0.0)
    jax.config.update(names[2], 0)
    yield
    for name, value in before.items():
        jax.config.update(name, value)


def test_lora_run_on_hf_checkpoint_resumes_exactly_and_exports(tmp_path, compile_cache):
    """A LoRA run on a tiny HF checkpoint: checkpoints hold no base; a resume from step 1
    reaches step 2's metrics and state exactly; a changed base is refused in one line; the merged
    export computes the adapted model's logits; the PEFT export has PEFT's names and shapes."""
    import json
    import shutil

    import safetensors.numpy

    from jrl import models
    from jrl import tokenizer as tokenizer_lib
    from jrl.run import checkpoint as checkpoint_lib
    from jrl.run import exporter as export_lib
    from jrl.run import trainer

    hf_dir = str(tmp_path / "base")
    base_cfg = dataclasses.replace(CFG, vocab_size=96, tie_word_embeddings=True)
    models.save_pretrained(
        base_cfg,
        tfm.init_params(base_cfg, jax.random.key(0)),
        hf_dir,
        tokenizer=tokenizer_lib.char_tokenizer(),
    )
    cfg = _grpo_lora_cfg()
    cfg.model.hf_path, cfg.tokenizer, cfg.warmup.sft_steps = hf_dir, "", 0
    cfg.checkpoint.every_steps, cfg.checkpoint.async_save, cfg.checkpoint.max_to_keep = 1, False, 0
    cfg.total_steps, cfg.data.train_batch_size, cfg.rollout.n = 2, 2, 2  # 2 updates per step
    cfg.actor.ppo_mini_batch_size, cfg.task.eval_size = 1, 4
    first, second = str(tmp_path / "run"), str(tmp_path / "resumed")
    trainer.run(cfg, first)
    reference = os.path.join(first, checkpoint_lib.REFERENCE_DIR)
    assert not os.path.exists(reference) or not os.listdir(reference)  # no base saved
    shutil.copytree(first, second)
    shutil.rmtree(os.path.join(second, "checkpoints", "2"))
    trainer.run(cfg, second)  # resumes from step 1
    rows = [
        [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
        for d in (first, second)
    ]
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("timing_s", "perf/thr"))}
    assert [strip(r) for r in rows[0]] == [strip(r) for r in rows[1]]
    _, policy_cfg = trainer.policy_model(cfg)
    base, want, _ = checkpoint_lib.restore_lora(first, cfg, policy_cfg)
    _, got, _ = checkpoint_lib.restore_lora(second, cfg, policy_cfg)
    jax.tree.map(np.testing.assert_array_equal, got, want)

    changed = str(tmp_path / "changed")
    shutil.copytree(hf_dir, changed)
    hf_config = json.load(open(os.path.join(changed, "config.json")))
    hf_config["rms_norm_eps"] = 1e-5
    json.dump(hf_config, open(os.path.join(changed, "config.json"), "w"))
    other = cfg.copy_and_resolve_references()
    other.model.hf_path = changed
    with pytest.raises(workdir_lib.ChangedInputsError, match="model.hf_path/config.json"):
        trainer.run(other, second)  # the run's input check: the base's files changed
    with pytest.raises(checkpoint_lib.CheckpointError, match="not the one the LoRA checkpoints"):
        trainer.run(other, second, allow_changes=True)  # and past it, the checkpoint's own record

    merged_dir, peft_dir = str(tmp_path / "merged"), str(tmp_path / "peft")
    export_lib.export(first, merged_dir)
    export_lib.export(first, peft_dir, adapter_only=True)
    merged_cfg, merged = models.load_pretrained(merged_dir)
    full = lora.combine(base, want, lora.scale(cfg.lora))
    adapted = _logits(policy_cfg, full)
    np.testing.assert_allclose(_logits(merged_cfg, merged), adapted, atol=1e-5)
    assert np.abs(np.asarray(adapted - _logits(policy_cfg, base))).max() > 1e-6  # it trained

    peft_config = json.load(open(os.path.join(peft_dir, "adapter_config.json")))
    assert peft_config["peft_type"] == "LORA" and peft_config["r"] == 4
    assert peft_config["lora_alpha"] == 32.0 and peft_config["target_modules"] == list(lora.TARGETS)
    tensors = safetensors.numpy.load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    prefix = "base_model.model.model.layers.1."
    # PEFT: lora_A [r, in_features], lora_B [out_features, r] (HF q_proj: 32 -> 4 heads x 8).
    assert tensors[prefix + "self_attn.q_proj.lora_A.weight"].shape == (4, 32)
    assert tensors[prefix + "self_attn.k_proj.lora_B.weight"].shape == (16, 4)
    assert tensors[prefix + "self_attn.o_proj.lora_A.weight"].shape == (4, 32)
    assert tensors[prefix + "mlp.down_proj.lora_A.weight"].shape == (4, 48)
    assert tensors[prefix + "mlp.up_proj.lora_B.weight"].shape == (48, 4)
    # The same delta as PEFT computes it: W_hf + (alpha / r) B_peft A_peft [out, in].
    a = tensors[prefix + "self_attn.q_proj.lora_A.weight"]
    b = tensors[prefix + "self_attn.q_proj.lora_B.weight"]
    merged_q = safetensors.numpy.load_file(os.path.join(merged_dir, "model.safetensors"))
    base_q = safetensors.numpy.load_file(os.path.join(hf_dir, "model.safetensors"))
    name = "model.layers.1.self_attn.q_proj.weight"
    np.testing.assert_allclose(merged_q[name], base_q[name] + 8.0 * b @ a, atol=1e-6)


def test_peft_loads_the_adapter_export(tmp_path):
    """scripts/check_peft_export.py: PEFT's PeftModel.from_pretrained on the HF base, with jrl's
    --adapter_only export of a LoRA run (and of large random adapters), computes jrl's logits
    to 1e-4; so does the merged export through transformers. Needs an interpreter with torch,
    transformers and peft: $JRL_PEFT_PYTHON, or this one if it has them; skipped otherwise."""
    import importlib.util
    import subprocess
    import sys

    peft_python = os.environ.get("JRL_PEFT_PYTHON")
    if not peft_python:
        if not all(importlib.util.find_spec(m) for m in ("peft", "torch")):
            pytest.skip(
                "peft / torch not importable; set JRL_PEFT_PYTHON to an interpreter with them"
            )
        peft_python = sys.executable
    script = os.path.join(REPO, "scripts", "check_peft_export.py")
    out = subprocess.run(
        [sys.executable, script, f"--peft_python={peft_python}", f"--out={tmp_path}"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert '"max_abs_logit_diff"' in out.stdout


@pytest.mark.parametrize("shared", [False, True], ids=["separate_critic", "shared_backbone"])
def test_value_heads_train_in_float32_over_a_bfloat16_base(shared):
    """A LoRA run holds its frozen base in the compute dtype, but the value head (trained in
    full, on a separate critic or on the policy's backbone) has float32 master weights: one
    optimizer update at a verl-like critic rate (1e-5, Adam's first step is lr * sign(g)) moves
    every entry of it, where bfloat16 storage keeps entries whose step is under half an ulp."""
    from jrl.run import trainer

    cfg = tiny_config(
        **{
            "lora.rank": 4,
            "model.dtype": "bfloat16",
            "algorithm.adv_estimator": "gae",
            "critic.share_backbone": shared,
            "critic.lr": 1e-5,
        }
    )
    model_cfg = trainer.build(cfg).model_cfg
    key = jax.random.key(0)
    state = train_state.init_state(cfg, model_cfg, trainer.initial_params(cfg, model_cfg, key), key)
    assert state.ref_params["embed"].dtype == jnp.bfloat16  # the frozen base
    params = state.params if shared else state.critic_params
    opt_state = state.opt_state if shared else state.critic_opt_state
    tx = train_state.policy_optimizer(cfg) if shared else train_state.make_optimizer(cfg.critic)
    for name in lora.HEAD_KEYS:
        assert params[name].dtype == jnp.float32, name
    rng = np.random.default_rng(0)
    grads = jax.tree.map(jnp.zeros_like, params)
    for name in lora.HEAD_KEYS:
        grads[name] = jnp.asarray(rng.normal(size=params[name].shape), jnp.float32)
    new, _ = nan_guard.apply_grads(tx, grads, params, opt_state, None)
    head = np.asarray(params["value_head"], np.float32)
    moved = np.asarray(new["value_head"], np.float32) != head
    assert moved.all(), f"{moved.sum()} of {moved.size} value-head entries moved"


def test_dropout_and_the_policy_loss_draw_from_keys_of_their_own(monkeypatch):
    """The update's micro-batch key is split between LoRA dropout and the policy loss: the key
    clip_cov draws its uniforms from is neither the dropout key nor any projection's key derived
    from it (`with_dropout`: fold_in(key, i) per projection)."""
    from jrl import step as step_lib
    from jrl.run import trainer

    cfg = _grpo_lora_cfg()
    cfg.lora.dropout = 0.2
    cfg.actor.policy_loss = "clip_cov"
    built = trainer.build(cfg)
    tok, task, reward_fn, model_cfg = built.tokenizer, built.task, built.reward_fn, built.model_cfg
    ids = trainer.sampling_ids(tok, task)
    key = jax.random.key(1)
    state = train_state.init_state(cfg, model_cfg, tfm.init_params(model_cfg, key), key)
    seen = {}
    with_base = lora.with_base

    def recording_with_base(cfg_, base, trainable, dropout_key=None):
        seen["dropout"] = dropout_key
        return with_base(cfg_, base, trainable, dropout_key)

    monkeypatch.setattr(step_lib, "with_base", recording_with_base)
    spec = step_lib.make_spec(cfg, model_cfg, reward_fn, **ids)

    def recording_loss(*args, key=None, **kwargs):
        seen["loss"] = key
        return policy_loss(*args, key=key, **kwargs)

    policy_loss = spec.policy_loss
    spec = dataclasses.replace(spec, policy_loss=recording_loss)
    b, p, r = 4, 3, 5
    rng = np.random.default_rng(0)
    mb = {
        "input_ids": jnp.full((b, p), 3, jnp.int32),
        "attention_mask": jnp.ones((b, p), jnp.int32),
        "response_ids": jnp.asarray(rng.integers(3, model_cfg.vocab_size, (b, r)), jnp.int32),
        "response_mask": jnp.ones((b, r), jnp.int32),
        "advantages": jnp.asarray(rng.normal(size=(b, r)), jnp.float32),
        "old_log_prob": jnp.full((b, r), -3.0),
        "ref_log_prob": jnp.full((b, r), -3.2),
    }
    counts = step_lib.mini_batch_counts(spec, mb)
    step_lib.actor_loss(state.params, mb, spec, counts, state.ref_params, 1, jax.random.key(7))
    data = lambda k: tuple(np.asarray(jax.random.key_data(k)).tolist())
    dropout = [seen["dropout"]] + [jax.random.fold_in(seen["dropout"], i) for i in range(16)]
    assert data(seen["loss"]) not in {data(k) for k in dropout}
