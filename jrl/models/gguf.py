"""GGUF files (llama.cpp's format) in: `model.hf_path=/path/to/model.gguf`, no conversion step.

Weights are dequantized to float with the `gguf` package (numpy only; `pip install 'jrl[gguf]'`)
and handed to `jrl.models.hf.load_tensors` under their Hugging Face names and layouts, so they
stream into devices or shards as a safetensors checkpoint does. The model config and the tokenizer
come from the file's metadata; torch is never needed.

What llama.cpp's converter (convert_hf_to_gguf.py) changed, undone here:
  - tensor names: `blk.{i}.attn_q.weight` is `model.layers.{i}.self_attn.q_proj.weight`, ...
    (`GGUF_NAMES`; a GGUF matrix's numpy shape is already HF's [out, in]);
  - llama: the rows of each q / k head are reordered from HF's rotate-half rope layout to
    interleaved pairs (`_unpermute` puts them back);
  - gemma: every RMSNorm weight is stored as 1 + w (HF's w is restored; the offset stays in
    `norm_unit_offset`);
  - fields llama.cpp fixes per architecture instead of storing them (Gemma 3: the local rope base
    10000, every 6th layer global, the query scale 1 / sqrt(head_dim)) are set as llama.cpp does.
Supported `general.architecture`s: `ARCHITECTURES`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import transformers

from jrl.models import hf
from jrl.models import transformer as tfm

# GGUF general.architecture -> Hugging Face model_type.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

# llama.cpp's tensor names -> Hugging Face's ("{i}": the layer).
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",  # the norm before the MLP (Llama's name)
    "post_attention_norm": "post_attention_layernorm",  # Gemma's sandwich norms
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma's norm before the MLP is pre_feedforward_layernorm (post_attention_layernorm is the one
# after attention).
_GEMMA_BLOCK_NAMES = {**_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm"}

# Gemma 3 fields llama.cpp does not store (llama-model.cpp sets them for LLM_ARCH_GEMMA3).
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_GLOBAL_EVERY = 6  # layers 5, 11, 17, ... attend globally, the others in a window


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ValueError(
            "reading a .gguf file needs the gguf package: pip install 'jrl[gguf]' (or pip "
            "install gguf)."
        ) from None
    return gguf


# GGUF metadata value types (gguf's GGUFValueType) -> numpy scalar types; 8 is a string, 9 an array.
_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


class GGUFFile:
    """A GGUF file's header: `metadata` (key -> value, arrays as lists) and `tensors` (llama.cpp
    name -> (ggml type, numpy shape, byte offset)). Parsed here rather than with gguf.GGUFReader,
    which reads a 262k-token vocabulary one memmap slice at a time (over a minute); the tensor
    bytes are memory-mapped and read only by `tensor(name)`."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise ValueError(f"GGUF file {path!r} does not exist; pass a local .gguf file.")
        self.path = path
        self._data = np.memmap(path, np.uint8, mode="r")
        self._pos = 0
        try:
            self._parse()
        except (KeyError, ValueError, struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{path!r} is not a readable GGUF file ({e}).") from None
        self._check_sizes()

    def _check_sizes(self) -> None:
        """Every tensor's bytes lie within the file (a truncated download fails here, not in
        the middle of loading the weights)."""
        gguf = _gguf()
        for name, (kind, shape, offset) in self.tensors.items():
            try:
                block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            except (KeyError, ValueError):
                raise ValueError(
                    f"{self.path!r} is not a readable GGUF file (tensor {name} has the unknown "
                    f"type {kind})."
                ) from None
            end = offset + int(np.prod(shape)) // block * size
            if end > len(self._data):
                raise ValueError(
                    f"{self.path!r} is truncated: tensor {name} ends at byte {end} but the file "
                    f"has {len(self._data)}; download or copy it again."
                )

    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._data):
            raise ValueError("the file ends inside its header")
        out = self._data[self._pos : self._pos + n].tobytes()
        self._pos += n
        return out

    def _unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self._take(struct.calcsize("<" + fmt)))[0]

    def _string(self) -> str:
        return self._take(self._unpack("Q")).decode("utf-8")

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("I"), self._unpack("Q")
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item])
                return np.frombuffer(self._take(count * dtype.itemsize), dtype).tolist()
            return [self._value(item) for _ in range(count)]
        value = np.frombuffer(self._take(np.dtype(_SCALARS[kind]).itemsize), _SCALARS[kind])[0]
        # float32 as written (1e-06, not 9.99999997e-07): the shortest repr that reads back
        return float(str(value)) if kind == 6 else value.item()

    def _parse(self) -> None:
        if self._take(4) != b"GGUF":
            raise ValueError("no GGUF magic")
        version = self._unpack("I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old (2 or newer)")
        tensors, kvs = self._unpack("Q"), self._unpack("Q")
        self.metadata = {}
        for _ in range(kvs):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("I"))
        infos = []
        for _ in range(tensors):
            name = self._string()
            dims = [self._unpack("Q") for _ in range(self._unpack("I"))]
            infos.append((name, self._unpack("I"), tuple(reversed(dims)), self._unpack("Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = {name: (kind, shape, start + off) for name, kind, shape, off in infos}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def tensor(self, name: str) -> np.ndarray:
        """One tensor dequantized to float32, in its numpy shape (a matrix: [out, in])."""
        gguf = _gguf()
        kind, shape, offset = self.tensors[name]
        qtype = gguf.GGMLQuantizationType(kind)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.asarray(self._data[offset : offset + int(np.prod(shape)) // block * size])
        return np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(shape)


def _rope(get) -> dict:
    kind = get("rope.scaling.type", "none")
    theta = float(get("rope.freq_base", 10000.0))
    if kind in ("none", None):
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {
            "rope_type": "linear",
            "rope_theta": theta,
            "factor": float(get("rope.scaling.factor")),
        }
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported (only none and linear).")


def hf_config(meta: dict, tensor_shapes: dict) -> dict:
    """The `config.json` dict (Hugging Face's fields) the GGUF metadata describes."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}."
        )
    if "rope_freqs.weight" in tensor_shapes:
        raise ValueError(
            "this GGUF file has per-frequency rope factors (rope_freqs, Llama 3.1+ rope "
            "scaling), which jrl does not read from GGUF; pass the Hugging Face checkpoint."
        )
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    layers = int(get("block_count"))
    rope = _rope(get)
    out = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": int(tensor_shapes["token_embd.weight"][0]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length", 8192)),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "rope_parameters": rope,
    }
    if arch == "gemma3":
        scale = get("attention.scale")  # llama.cpp: 1 / sqrt(query_pre_attn_scalar)
        if scale is None:  # llama.cpp's rule: 27B (62 layers) scales by hidden / heads
            scalar = hidden // heads if layers == 62 else head_dim
        else:
            scalar = 1.0 / float(scale) ** 2
        local = {
            "rope_type": "default",
            "rope_theta": float(get("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)),
        }
        out.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=hf._int_if_whole(scalar),
            final_logit_softcapping=get("final_logit_softcapping"),
            sliding_window=int(get("attention.sliding_window")),
            layer_types=[
                tfm.FULL_ATTENTION if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else tfm.SLIDING_ATTENTION
                for i in range(layers)
            ],
            rope_parameters={tfm.FULL_ATTENTION: rope, tfm.SLIDING_ATTENTION: local},
        )
    else:
        out["hidden_act"] = "silu"
    return out


def _hf_name(name: str, gemma: bool) -> str:
    """A llama.cpp tensor name as Hugging Face spells it (unknown names are kept, so that the
    loader names them as tensors jrl does not use)."""
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    parts = name.split(".")
    names = _GEMMA_BLOCK_NAMES if gemma else _BLOCK_NAMES
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return name


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q / k row permutation: within each head, row 2j + h (interleaved
    rope pairs) goes back to row h * D/2 + j (HF's rotate-half halves)."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


@functools.lru_cache(maxsize=4)
def _parsed(path: str, stamp: tuple) -> GGUFFile:
    del stamp  # part of the cache key only: a rewritten file is parsed again
    return GGUFFile(path)


def open_file(path) -> GGUFFile:
    """The parsed header of `path`, kept for the next caller (config, weights and tokenizer each
    read it; a 262k-token vocabulary takes seconds to parse)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return GGUFFile(path)  # raises its one-line error
    st = os.stat(path)
    return _parsed(os.path.abspath(path), (st.st_mtime_ns, st.st_size))


def _file_and_config(path: str, dtype: str) -> tuple[GGUFFile, tfm.ModelConfig]:
    f = open_file(path)
    shapes = {name: f.shape(name) for name in f.tensors}
    return f, hf.model_config_from_hf(hf_config(f.metadata, shapes), dtype)


def load_config(path, dtype: str = "float32") -> tfm.ModelConfig:
    """ModelConfig of a .gguf file (its metadata; no tensor is read), in `dtype`."""
    return _file_and_config(os.fspath(path), dtype)[1]


@contextlib.contextmanager
def open_tensors(path, cfg: tfm.ModelConfig) -> Iterator[hf.TensorSource]:
    """The file's tensors under Hugging Face names and layouts, dequantized to float32 one at a
    time as `hf.load_tensors` reads them."""
    f, _ = _file_and_config(os.fspath(path), cfg.param_dtype)
    gemma = cfg.norm_unit_offset
    by_name = {_hf_name(name, gemma): name for name in f.tensors}
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}
    llama = cfg.hf_model_type == "llama"

    def read(name: str) -> np.ndarray:
        w = f.tensor(by_name[name])
        proj = name.split(".")[-2]
        if llama and proj in heads and name.endswith(".weight"):
            w = _unpermute(w, heads[proj])
        if gemma and name.endswith("norm.weight"):
            w = w - 1.0
        return w

    yield hf.TensorSource(
        shapes=lambda: {hf_name: f.shape(name) for hf_name, name in by_name.items()}, read=read
    )


def load_pretrained(
    path, dtype: str = "float32", shardings=None, place: hf.Place | None = None
) -> tuple[tfm.ModelConfig, Any]:
    """(ModelConfig, params) of a .gguf file, streamed into devices or `shardings` one tensor at
    a time as `jrl.models.hf.load_pretrained` does."""
    path = os.fspath(path)
    cfg = load_config(path, dtype)
    with open_tensors(path, cfg) as source:
        return cfg, hf.load_tensors(cfg, source, path, dtype, shardings, place)


def _tokenizer_builders():
    """transformers' GGUF tokenizer builders (`GGUF_TOKENIZER_MAPPING`, `convert_gguf_tokenizer`
    in `transformers.integrations.gguf.gguf_tokenizer_mapping`); a one-line ValueError where
    this transformers has them elsewhere or not at all."""
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping
    except ImportError:
        mapping = None
    if not all(hasattr(mapping, n) for n in ("GGUF_TOKENIZER_MAPPING", "convert_gguf_tokenizer")):
        raise ValueError(
            f"transformers {transformers.__version__} lacks the GGUF tokenizer builders jrl uses "
            "(transformers.integrations.gguf.gguf_tokenizer_mapping, 5.18 on): pip install -U "
            "transformers, or pass --config.tokenizer=DIR (a tokenizer saved by transformers)."
        )
    return mapping


def load_tokenizer(path) -> transformers.PreTrainedTokenizerFast:
    """The tokenizer the file's metadata describes, built with transformers' GGUF tokenizer
    builders (without its torch-based file reader)."""
    mapping = _tokenizer_builders()
    path = os.fspath(path)
    meta = open_file(path).metadata
    arch = meta.get("general.architecture")
    groups = {
        group: {
            name: meta[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in meta
        }
        for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()
    }
    spec, config = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in spec:
        raise ValueError(f"GGUF file {path!r} has no tokenizer (no tokenizer.ggml.tokens).")
    if spec.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unk_token_id"),
        ("pad_token", "pad_token_id"),
    ):
        if spec.get(key) is not None:
            config[name] = spec["tokens"][spec[key]]
    try:
        backend, extra = mapping.convert_gguf_tokenizer(arch, spec)
    except ValueError as e:
        raise ValueError(f"cannot build the tokenizer of {path!r}: {e}") from None
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
