"""Hugging Face checkpoints: logit parity with transformers, export round trips, clear errors.

The goldens under tests/golden/ come from scripts/make_hf_goldens.py: tiny random transformers
models (saved in bfloat16) and their float32 logits on a batch with one left-padded row. Only
test_transformers_live_parity_and_export_round_trip needs torch (it is skipped without it).
"""

import dataclasses
import json
import os
import shutil
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import save_file

import jrl.models
from conftest import GOLDEN
from helpers.tiny_decoders import random_params
from jrl import sharding
from jrl import tokenizer as tokenizer_lib
from jrl.models import hf
from jrl.models import transformer as tfm

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
IDS = np.load(os.path.join(GOLDEN, "input_ids.npy"))
MASK = np.load(os.path.join(GOLDEN, "attention_mask.npy"))
REAL = MASK.astype(bool)  # logits at padding positions mean nothing


@pytest.fixture(scope="module")
def loaded():
    """family -> (ModelConfig, params, jrl logits [B, T, V]); each family loaded and run once."""
    cache = {}

    def get(family):
        if family not in cache:
            cfg, params = jrl.models.load_pretrained(os.path.join(GOLDEN, family))
            logits = jrl.models.forward(cfg, params, jnp.asarray(IDS), jnp.asarray(MASK))
            cache[family] = (cfg, params, np.asarray(logits))
        return cache[family]

    return get


def _flat(params):
    return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(params).items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_goldens(loaded, family):
    cfg, _, logits = loaded(family)
    want = np.load(os.path.join(GOLDEN, family, "logits.npy"))
    assert cfg.hf_model_type == family
    np.testing.assert_allclose(logits[REAL], want[REAL], atol=1e-4, rtol=0)


@pytest.mark.parametrize("implementation", ["blockwise", "splash"])
def test_goldens_hold_on_every_attention_path_that_runs_here(loaded, implementation):
    """Blockwise attention (query blocks of 5 over 12 positions) and the TPU splash kernel (in
    the Pallas interpreter) give transformers' logits too: sliding windows (Mistral, Qwen2,
    Gemma), soft-capping (Gemma 2), GQA and left padding included."""
    for family in FAMILIES:
        cfg, params, _ = loaded(family)
        cfg = dataclasses.replace(cfg, attention=implementation, attention_block_size=5)
        logits = np.asarray(jrl.models.forward(cfg, params, jnp.asarray(IDS), jnp.asarray(MASK)))
        want = np.load(os.path.join(GOLDEN, family, "logits.npy"))
        np.testing.assert_allclose(logits[REAL], want[REAL], atol=1e-4, rtol=0, err_msg=family)


# Each family feature the goldens exercise: switching it off moves the logits far from them.
ABLATIONS = [
    ("llama", {"rope_scaling_type": "default"}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"sliding_window": None, "layer_types": None}),
    ("qwen2", {"qkv_bias": False}),
    ("qwen3", {"qk_norm": False}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": None}),
    ("gemma2", {"sliding_window": None, "layer_types": None}),
    ("gemma2", {"hidden_act": "silu"}),
    ("gemma3_text", {"rope_local_base_freq": None}),
    ("gemma3_text", {"rope_scaling_type": "default"}),
    ("gemma3_text", {"norm_unit_offset": False}),
    ("gemma3_text", {"scale_embeddings": False}),
    ("gemma3_text", {"sandwich_norms": False}),
]


def test_goldens_exercise_every_family_feature(loaded):
    for family, change in ABLATIONS:
        cfg, params, _ = loaded(family)
        cfg = dataclasses.replace(cfg, **change)  # weights it no longer uses are ignored
        logits = np.asarray(jrl.models.forward(cfg, params, jnp.asarray(IDS), jnp.asarray(MASK)))
        want = np.load(os.path.join(GOLDEN, family, "logits.npy"))
        assert np.abs(logits[REAL] - want[REAL]).max() > 0.1, (family, change)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_then_load_gives_identical_config_and_params(loaded, family, tmp_path):
    cfg, params, _ = loaded(family)
    hf.save_pretrained(cfg, params, tmp_path)
    with open(tmp_path / "config.json") as f:
        written = json.load(f)
    assert written["model_type"] == family
    assert written["architectures"] == [hf.FAMILIES[family].architecture]
    assert written["dtype"] == "float32"
    cfg2, params2 = hf.load_pretrained(tmp_path)
    assert cfg2 == cfg
    a, b = _flat(params), _flat(params2)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].dtype == np.float32
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_native_model_round_trip_infers_family_and_drops_value_head(loaded, tmp_path):
    """A jrl critic-and-policy model with no recorded family exports as qwen2 (it has qkv bias)."""
    cfg, params, _ = loaded("qwen2")
    cfg = dataclasses.replace(cfg, hf_model_type=None, value_head=True)
    params = {**params, "value_head": jnp.ones((32, 1)), "value_head_bias": jnp.ones((1,))}
    hf.save_pretrained(cfg, params, tmp_path)
    cfg2, params2 = hf.load_pretrained(tmp_path)
    assert cfg2 == dataclasses.replace(cfg, hf_model_type="qwen2", value_head=False)
    a, b = _flat(params), _flat(params2)
    assert set(a) - set(b) == {("value_head",), ("value_head_bias",)}
    for k in b:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_sharded_checkpoint_loads_like_single_file(loaded, tmp_path):
    src = os.path.join(GOLDEN, "qwen3")
    with safe_open(os.path.join(src, hf.WEIGHTS_FILE), framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, shard in shards.items():
        save_file({k: tensors[k] for k in shard}, tmp_path / file, metadata={"format": "pt"})
    index = {"weight_map": {k: file for file, shard in shards.items() for k in shard}}
    (tmp_path / hf.INDEX_FILE).write_text(json.dumps(index))
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    _, params = hf.load_pretrained(tmp_path)
    _, want, _ = loaded("qwen3")
    a, b = _flat(want), _flat(params)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_bfloat16_load_and_save_keep_the_stored_values(loaded, tmp_path):
    cfg, params = hf.load_pretrained(os.path.join(GOLDEN, "gemma2"), dtype="bfloat16")
    assert cfg.dtype == cfg.param_dtype == "bfloat16"
    f32 = _flat(loaded("gemma2")[1])
    for k, v in _flat(params).items():
        assert v.dtype == jnp.bfloat16
        np.testing.assert_array_equal(v.astype(np.float32), f32[k])  # goldens are bf16-exact
    hf.save_pretrained(cfg, params, tmp_path)
    with safe_open(tmp_path / hf.WEIGHTS_FILE, framework="np") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == jnp.bfloat16
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


def test_tokenizer_and_generation_config_are_written(loaded, tmp_path):
    import transformers

    cfg, params, _ = loaded("llama")
    tok = tokenizer_lib.char_tokenizer()
    hf.save_pretrained(cfg, params, tmp_path, tokenizer=tok)
    config = json.loads((tmp_path / "config.json").read_text())
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 0)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded("12+3=")["input_ids"] == tok("12+3=")["input_ids"] == [5, 6, 14, 7, 18]


def test_transformers_live_parity_and_export_round_trip(loaded, tmp_path):
    """transformers' own forward == jrl's; jrl's export loads back into transformers unchanged."""
    torch = pytest.importorskip("torch")
    import transformers

    positions = torch.tensor(np.maximum(np.cumsum(MASK, -1) - 1, 0))

    def hf_logits(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
        with torch.no_grad():
            out = model(
                input_ids=torch.tensor(IDS, dtype=torch.long),
                attention_mask=torch.tensor(MASK),
                position_ids=positions,
            )
        return model.config.model_type, out.logits.numpy()

    for family in FAMILIES:
        cfg, params, logits = loaded(family)
        _, live = hf_logits(os.path.join(GOLDEN, family))
        np.testing.assert_allclose(logits[REAL], live[REAL], atol=1e-4, rtol=0, err_msg=family)
        out = hf.save_pretrained(cfg, params, tmp_path / family)
        model_type, exported = hf_logits(out)
        assert model_type == family
        np.testing.assert_allclose(exported, live, atol=1e-6, rtol=0, err_msg=family)


# ---------------------------------------------------------------------------------------------
# errors


def _copy_golden(family, tmp_path):
    dst = tmp_path / family
    shutil.copytree(os.path.join(GOLDEN, family), dst)
    return dst


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _rewrite_weights(path, edit):
    with safe_open(path / hf.WEIGHTS_FILE, framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    edit(tensors)
    save_file(tensors, path / hf.WEIGHTS_FILE, metadata={"format": "pt"})


def test_missing_directory_and_config_raise(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        hf.load_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="has no config.json"):
        hf.load_pretrained(tmp_path)


def test_unsupported_model_type_lists_the_supported_ones(tmp_path):
    path = _copy_golden("llama", tmp_path)
    _edit_config(path, model_type="gpt2")
    with pytest.raises(
        ValueError,
        match="unknown Hugging Face model_type 'gpt2'.*valid names are gemma2, gemma3_text, "
        "llama, mistral, mixtral, qwen2, qwen3, qwen3_moe",
    ):
        hf.load_pretrained(path)


def test_unsupported_rope_type_and_bias_raise(tmp_path):
    path = _copy_golden("llama", tmp_path)
    _edit_config(path, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(
        ValueError, match="unknown RoPE scaling .*'dynamic'.*default, linear, llama3"
    ):
        hf.load_pretrained(path)
    _edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 1e4}, mlp_bias=True)
    with pytest.raises(ValueError, match="mlp_bias=true are not supported"):
        hf.load_pretrained(path)


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path):
    path = _copy_golden("qwen2", tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match="lacks tensors: model.layers.1.self_attn.k_proj.bias"):
        hf.load_pretrained(path)

    path = _copy_golden("llama", tmp_path)
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.mlp.gate_proj.bias": np.zeros(4)}))
    with pytest.raises(ValueError, match="does not use: model.layers.0.mlp.gate_proj.bias"):
        hf.load_pretrained(path)

    path = _copy_golden("mistral", tmp_path)
    _edit_config(path, intermediate_size=40)
    with pytest.raises(
        ValueError, match=r"model.layers.0.mlp.\w+_proj.weight has shape \(32, 32\)"
    ):
        hf.load_pretrained(path)


def test_missing_safetensors_raise(tmp_path):
    path = _copy_golden("llama", tmp_path)
    os.remove(path / hf.WEIGHTS_FILE)
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        hf.load_pretrained(path)


def test_export_refuses_architectures_without_a_hf_family(tmp_path):
    base = {"vocab_size": 11, "hidden_size": 16, "num_heads": 2, "num_kv_heads": 1}
    cfg = tfm.ModelConfig(**base, qk_norm=True, qkv_bias=True)  # Qwen3 has no q/k/v-only bias
    with pytest.raises(ValueError, match=r"qkv_bias=True cannot be written as a qwen3 checkpoint"):
        hf.save_pretrained(cfg, {}, tmp_path)  # the config is checked before any weight
    cfg = tfm.ModelConfig(**base, value_head=True, lm_head=False)
    with pytest.raises(ValueError, match="critic-only"):
        hf.save_pretrained(cfg, {}, tmp_path)


# ---------------------------------------------------------------------------------------------
# sharded, streaming loads


def _mesh_shardings(path, mesh_shape):
    cfg = hf.load_config(path)
    mesh = sharding.make_mesh(shape=mesh_shape)
    return sharding.param_shardings(mesh, hf.abstract_params(cfg), tfm.logical_axes(cfg))


# Hand-computed per-device shard shapes, mesh (data, fsdp, tensor). The golden llama: V=64, H=32,
# 4 heads and 2 kv heads of 8, MLP 32. embed [V, H] is split (tensor, fsdp), q_proj [H, N, D]
# (fsdp, tensor, -), k_proj [H, K, D] too unless tensor does not divide K, down_proj [F, H]
# (tensor, fsdp); norms [H] over fsdp.
SHARD_SHAPES = {
    (2, 2, 2): {
        ("embed",): (32, 16),
        ("lm_head",): (16, 32),
        ("layers", "attn", "q_proj"): (2, 16, 2, 8),  # 2 layers, stacked
        ("layers", "attn", "k_proj"): (2, 16, 1, 8),
        ("layers", "mlp", "down_proj"): (2, 16, 16),
        ("final_norm", "scale"): (16,),
    },
    (1, 2, 4): {
        ("embed",): (16, 16),
        ("lm_head",): (16, 16),
        ("layers", "attn", "q_proj"): (2, 16, 1, 8),
        ("layers", "attn", "k_proj"): (2, 16, 2, 8),  # 2 kv heads over tensor=4: replicated
        ("layers", "mlp", "down_proj"): (2, 8, 16),
        ("final_norm", "scale"): (16,),
    },
}


@pytest.mark.parametrize("mesh_shape", list(SHARD_SHAPES))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sharded_load_places_every_param_in_its_sharding(loaded, family, mesh_shape):
    path = os.path.join(GOLDEN, family)
    shardings = _mesh_shardings(path, mesh_shape)
    cfg, params = hf.load_pretrained(path, shardings=shardings)
    assert cfg == loaded(family)[0]
    want = traverse_util.flatten_dict(shardings)
    got = traverse_util.flatten_dict(params)
    assert got.keys() == want.keys()
    for k, v in got.items():
        assert v.sharding == want[k], k
        shapes = {s.data.shape for s in v.addressable_shards}
        assert shapes == {want[k].shard_shape(v.shape)}, k
        assert len(v.addressable_shards) == 8
    if family == "llama":
        for k, shape in SHARD_SHAPES[mesh_shape].items():
            assert {s.data.shape for s in got[k].addressable_shards} == {shape}, k
    unsharded = _flat(loaded(family)[1])
    for k, v in _flat(params).items():
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, unsharded[k], err_msg=str(k))


def test_sharded_load_takes_a_state_params_shardings_tree_and_names_missing_entries():
    path = os.path.join(GOLDEN, "qwen3")
    shardings = _mesh_shardings(path, (2, 2, 2))
    replicated = NamedSharding(shardings["embed"].mesh, PartitionSpec())
    _, params = hf.load_pretrained(path, shardings={**shardings, "value_head": replicated})
    assert "value_head" not in params  # an entry the checkpoint has no tensor for is ignored
    assert params["embed"].sharding == shardings["embed"]
    del shardings["layers"]["mlp"]
    with pytest.raises(ValueError, match="shardings has no entry for params: layers/mlp/"):
        hf.load_pretrained(path, shardings=shardings)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """(path, float32 bytes of its params): a llama checkpoint whose largest tensor is ~1/16 of
    the model, so holding every tensor at once is far above holding one."""
    cfg = tfm.ModelConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=1024,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        hf_model_type="llama",
    )
    params = random_params(cfg, std=1.0)
    path = hf.save_pretrained(cfg, params, tmp_path_factory.mktemp("wide"))
    return path, sum(x.nbytes for x in jax.tree.leaves(params))


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
def test_loading_streams_one_tensor_at_a_time(wide_checkpoint, mesh_shape):
    """Peak traced host memory (numpy and Python buffers; device buffers are XLA's) while loading
    stays far below the model: reading every tensor before placing any reaches ~1.2x of it."""
    path, model_bytes = wide_checkpoint
    shardings = None if mesh_shape is None else _mesh_shardings(path, mesh_shape)
    hf.load_pretrained(path, shardings=shardings)  # imports and caches outside the measurement
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        _, params = hf.load_pretrained(path, shardings=shardings)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < model_bytes / 3, (peak, model_bytes)
    assert sum(x.nbytes for x in jax.tree.leaves(params)) == model_bytes
