"""The real-scale presets of configs/grpo_math.py: they validate, their batch sizes split over
their meshes, and (abstractly, with jax.eval_shape: no arrays, no compile) the Qwen2.5 shapes have
the published parameter counts and their train state fits the target devices' memory."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from jrl import config as config_lib
from jrl.run import trainer
from conftest import REPO
from configs import grpo_math

# Published figures, independent of the code under test.
# Qwen2.5 model cards (Hugging Face, Qwen/Qwen2.5-*-Instruct): (parameters, of which
# non-embedding, layers, query heads, key / value heads, context length).
PUBLISHED = {
    "qwen2.5-0.5b": (0.49e9, 0.36e9, 24, 14, 2, 32768),
    "qwen2.5-1.5b": (1.54e9, 1.31e9, 28, 12, 2, 32768),
    "qwen2.5-7b": (7.61e9, 6.53e9, 28, 28, 4, 32768),
}
# (devices, memory of one device in bytes) of each mesh preset's hardware: H100 SXM 80 GB;
# Cloud TPU docs: a v4-8 is 4 chips of 32 GiB, a v5p-64 (topology 2x4x4) 32 chips on 8 hosts,
# 95 GB each.
HARDWARE = {
    "mesh=gpu8": (8, 80e9),
    "mesh=v4-8": (4, 32 * 2**30),
    "mesh=v5p-64": (32, 95e9),
    "mesh=gpu8-ep": (8, 80e9),
    "mesh=v5p-64-ep": (32, 95e9),
}
COMBINATIONS = (
    "model=qwen2.5-7b,data=gsm8k,mesh=v5p-64",
    "model=qwen3-30b-a3b,data=gsm8k,mesh=v5p-64-ep",
    "model=qwen2.5-0.5b,mesh=v4-8",
    "model=qwen2.5-0.5b,mesh=gpu8",
)
# Params + optimizer state + reference may take at most this fraction of a device's memory: the
# rest is for activations (logits, KV cache, gathered layers).
STATE_LIMIT = 0.5


def _with_user_paths(cfg, tmp_path, hf: bool):
    """What the command line must add to a preset: the data files of data= (and for data=custom
    a reward function), and for model= a checkpoint directory (hf) or a tokenizer for a random
    model of the preset's shape."""
    if cfg.task.name != "arithmetic":
        cfg.task.train_files = str(tmp_path / "train.jsonl")  # validate only checks it is set
    if cfg.task.name == "custom":
        cfg.task.reward = "my_reward.py:score"  # validate does not import it
    if cfg.tokenizer == "" and hf:
        (tmp_path / "config.json").write_text("{}")
        cfg.model.hf_path = str(tmp_path)
    elif cfg.tokenizer == "":
        cfg.tokenizer = "char"
    return cfg


def _mesh_preset(preset: str) -> str:
    return next(p for p in preset.split(",") if p.startswith("mesh="))


def _data_fsdp(cfg, devices: int) -> int:
    """data x fsdp (x expert) of the preset's mesh on `devices` devices (-1: what the others
    leave): the devices a batch's rows split over."""
    fixed = math.prod(s for s in cfg.mesh.shape if s != -1)
    sizes = dict(zip(cfg.mesh.axes, (devices // fixed if s == -1 else s for s in cfg.mesh.shape)))
    assert math.prod(sizes.values()) == devices, (sizes, devices)
    return sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1)


@pytest.mark.parametrize("preset", list(grpo_math.PRESETS) + list(COMBINATIONS))
@pytest.mark.parametrize("hf", [False, True])
def test_preset_validates(preset, hf, tmp_path):
    cfg = _with_user_paths(grpo_math.get_config(preset), tmp_path, hf)
    config_lib.validate(cfg)


def test_without_a_tokenizer_or_checkpoint_the_error_names_both():
    with pytest.raises(config_lib.ConfigError, match="model.hf_path=DIR.*tokenizer=DIR"):
        config_lib.validate(grpo_math.get_config("model=qwen2.5-7b"))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("vocab_size", -1, "model.vocab_size=-1 must be an integer >= 0"),
        ("num_kv_heads", 3, "model.num_heads=4 is not a multiple of model.num_kv_heads=3"),
        ("rope_theta", 0.0, "model.rope_theta=0.0 must be > 0"),
        ("max_position_embeddings", 0, "model.max_position_embeddings=0 must be >= 1"),
        ("dtype", "float8", "model.dtype='float8' is unknown"),
    ],
)
def test_bad_model_fields_give_one_line_errors(field, value, message):
    cfg = grpo_math.get_config()
    cfg.model[field] = value
    with pytest.raises(config_lib.ConfigError, match=message) as e:
        config_lib.validate(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_model_presets_have_the_published_shape(name):
    m = grpo_math.get_config(f"model={name}").model
    _, _, layers, q_heads, kv_heads, context = PUBLISHED[name]
    assert (m.num_layers, m.num_heads, m.num_kv_heads) == (layers, q_heads, kv_heads)
    assert m.max_position_embeddings == context and m.qkv_bias and m.vocab_size > 150_000


def test_qwen3_30b_a3b_preset_is_the_checkpoints_architecture():
    """The preset's model is what jrl reads from Qwen3-30B-A3B's config.json (its fields as
    tests/helpers/moe_configs.py holds them), the dtypes and memory settings aside."""
    from helpers.moe_configs import QWEN3_30B_A3B
    from jrl.models import hf, transformer

    cfg = grpo_math.get_config("model=qwen3-30b-a3b")
    preset = trainer.model_config(cfg, 0)
    compute = {k: getattr(preset, k) for k in transformer.COMPUTE_FIELDS}
    read = hf.model_config_from_hf(QWEN3_30B_A3B, cfg.model.param_dtype)
    assert dataclasses.replace(read, **compute) == dataclasses.replace(
        preset, hf_model_type="qwen3_moe"
    )


def test_hf_preset_is_verl_grpo_for_any_checkpoint_with_one_update_per_step(tmp_path):
    cfg = grpo_math.get_config("model=hf")
    base = grpo_math.get_config()
    # verl's GSM8K GRPO example (examples/grpo_trainer): lr 1e-6, KL loss 0.001 low_var_kl,
    # no KL in the reward, no entropy bonus; a constant rate, no weight decay.
    assert (cfg.actor.lr, cfg.actor.lr_warmup_steps, cfg.actor.weight_decay) == (1e-6, 0, 0.0)
    assert (cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef) == (True, 0.001)
    assert cfg.actor.kl_loss_type == "low_var_kl" and not cfg.algorithm.use_kl_in_reward
    assert cfg.actor.entropy_coeff == 0.0 and cfg.algorithm.adv_estimator == "grpo"
    # One optimizer update per step: the mini-batch is the step's prompts, one epoch.
    assert cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size == 8
    assert cfg.actor.ppo_epochs == 1
    # the demo's 32 prompts in mini-batches of 16: two updates
    assert base.data.train_batch_size // base.actor.ppo_mini_batch_size == 2
    # The checkpoint's own tokenizer, no warm-up, float32 (no bf16 unless asked for).
    assert cfg.tokenizer == "" and cfg.warmup.sft_steps == 0
    assert (cfg.model.dtype, cfg.model.param_dtype) == ("float32", "float32")
    # The checkpoint's own architecture: model.* shape fields are the base's (config.json wins).
    shape = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")
    assert {k: cfg.model[k] for k in shape} == {k: base.model[k] for k in shape}
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "vocab_size": 96,
                "hidden_size": 48,
                "num_hidden_layers": 3,
                "num_attention_heads": 6,
                "num_key_value_heads": 2,
                "intermediate_size": 80,
            }
        )
    )
    cfg.model.hf_path = str(tmp_path)
    config_lib.validate(cfg)
    mc = trainer.model_config(cfg, vocab_size=0)
    assert (mc.vocab_size, mc.hidden_size, mc.num_layers, mc.num_heads) == (96, 48, 3, 6)
    assert (mc.num_kv_heads, mc.intermediate_size, mc.dtype) == (2, 80, "float32")


def test_custom_data_preset_asks_for_a_reward():
    cfg = grpo_math.get_config("data=custom")
    assert (cfg.task.name, cfg.task.template, cfg.warmup.sft_steps) == ("custom", "", 0)
    cfg.task.train_files = "train.jsonl"
    with pytest.raises(config_lib.ConfigError) as e:  # the demo's in-graph reward cannot score it
        config_lib.validate(cfg)
    assert str(e.value) == (
        "task.reward='arithmetic_exact_match' scores the built-in arithmetic tasks only; for "
        "task.name='custom' set --config.task.reward to your function (path/to/reward.py:function "
        "or package.module:function) or one of first_line, format, gsm8k, math."
    )


def test_mesh_presets_apply_last():
    a = grpo_math.get_config("mesh=v5p-64,model=qwen2.5-7b")
    b = grpo_math.get_config("model=qwen2.5-7b,mesh=v5p-64")
    assert a.to_dict() == b.to_dict()


@pytest.mark.parametrize("preset", list(HARDWARE) + list(COMBINATIONS))
def test_batch_sizes_split_over_the_mesh(preset):
    cfg = grpo_math.get_config(preset)
    n = _data_fsdp(cfg, HARDWARE[_mesh_preset(preset)][0])
    # Prompts of a step are split over data x fsdp (x expert), and so are the rows of every
    # mini-batch (jrl.step draws them from all rows, not by prompt).
    assert cfg.data.train_batch_size % n == 0, (cfg.data.train_batch_size, n)
    assert cfg.actor.ppo_mini_batch_size * cfg.rollout.n % n == 0, (cfg.actor, n)


# Run in a subprocess with as many host CPU devices as the largest mesh: the abstract train state
# of each (model, mesh) preset, its shardings, and per-device bytes from their shard shapes.
_PROBE = textwrap.dedent(
    """
    import json, math, sys
    import jax
    sys.path.insert(0, sys.argv[1])
    from configs import grpo_math
    from jrl import sharding, step
    from jrl import train_state
    from jrl.run import trainer
    from jrl.models import transformer

    def model_cfg(cfg):  # the presets' model.vocab_size is their checkpoint's
        return trainer.model_config(cfg, cfg.model.vocab_size)

    def nbytes(tree, shardings):
        return sum(
            math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
            for x, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))
        )

    out = {"counts": {}, "state": {}}
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-30b-a3b"):
        mc = model_cfg(grpo_math.get_config("model=" + name))
        params = jax.eval_shape(lambda: transformer.init_params(mc, jax.random.key(0)))
        total = sum(x.size for x in jax.tree.leaves(params))
        embeddings = sum(params[k].size for k in ("embed", "lm_head") if k in params)
        out["counts"][name] = [total, total - embeddings]
    for preset, devices in json.loads(sys.argv[2]).items():
        cfg = grpo_math.get_config(preset)
        mc, _ = train_state.model_configs(cfg, model_cfg(cfg))
        mesh = sharding.make_mesh(cfg.mesh.axes, cfg.mesh.shape, jax.devices()[:devices])
        key = jax.random.key(0)
        abstract = jax.eval_shape(
            lambda: train_state.init_state(cfg, mc, transformer.init_params(mc, key), key)
        )
        sh = trainer.state_shardings(cfg, mc, mesh, abstract)
        out["state"][preset] = {
            "mesh": dict(mesh.shape),
            "params": nbytes(abstract.params, sh.params),
            "opt_state": nbytes(abstract.opt_state, sh.opt_state),
            "ref_params": nbytes(abstract.ref_params, sh.ref_params)
            if abstract.ref_params is not None else 0,
            "total": nbytes(abstract, sh),
        }
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def probe():
    meshes = {p: HARDWARE[_mesh_preset(p)][0] for p in COMBINATIONS}
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={max(meshes.values())}",
    )
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, REPO, json.dumps(meshes)],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_match_the_published_ones(probe, name):
    total, non_embedding = probe["counts"][name]
    published_total, published_non_embedding = PUBLISHED[name][:2]
    assert abs(total - published_total) / published_total < 0.01, total
    assert abs(non_embedding - published_non_embedding) / published_non_embedding < 0.01


def test_qwen3_30b_a3b_parameter_counts_match_the_published_ones(probe):
    # Qwen/Qwen3-30B-A3B model card: 30.5B parameters, 29.9B without the embeddings.
    total, non_embedding = probe["counts"]["qwen3-30b-a3b"]
    assert abs(total - 30.5e9) / 30.5e9 < 0.01 and abs(non_embedding - 29.9e9) / 29.9e9 < 0.01


@pytest.mark.parametrize("preset", COMBINATIONS)
def test_state_per_device_fits_with_room_for_activations(probe, preset):
    state = probe["state"][preset]
    hbm = HARDWARE[_mesh_preset(preset)][1]
    cfg = grpo_math.get_config(preset)
    assert cfg.actor.use_kl_loss and state["ref_params"] > 0  # the reference is counted
    assert state["mesh"]["fsdp"] > 1 and state["mesh"]["tensor"] == 1
    # float32 params: 4 bytes each, split over fsdp (x expert: the experts over it, the rest's
    # "embed" over fsdp x expert; a little replicated: norms, biases).
    total_params = probe["counts"][preset.split(",")[0].split("=")[1]][0]
    shards = state["mesh"]["fsdp"] * state["mesh"].get("expert", 1)
    assert state["params"] < 1.05 * 4 * total_params / shards
    assert state["opt_state"] < 2.01 * state["params"] + 1024  # Adam mu, nu (+ a step count)
    print(f"{preset}: {state['total'] / 1e9:.2f} GB of {hbm / 1e9:.1f} GB per device")
    assert state["total"] < STATE_LIMIT * hbm, (state, hbm)


def test_gemma_cpu_config_validates_and_stops_at_a_newline(tmp_path):
    from configs import grpo_gemma_cpu

    cfg = grpo_gemma_cpu.get_config()
    cfg.model.hf_path = str(tmp_path / "gemma.gguf")  # validate checks only that it exists
    (tmp_path / "gemma.gguf").write_bytes(b"GGUF")
    config_lib.validate(cfg)
    assert cfg.rollout.stop == ("\n",) and cfg.task.reward == "first_line"
    assert cfg.data.train_batch_size == cfg.actor.ppo_mini_batch_size  # one update per step
    with pytest.raises(config_lib.ConfigError, match="this config has no presets"):
        grpo_gemma_cpu.get_config("tiny")
