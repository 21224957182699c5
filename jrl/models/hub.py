"""`model.hf_path` as a Hugging Face Hub id: `org/name` (not an existing local path) is downloaded
into the Hugging Face cache with `huggingface_hub.snapshot_download` (with its progress bar),
config, safetensors and tokenizer files only; offline (HF_HUB_OFFLINE=1, or no network) a model
already in the cache is used, and one that is not gives a one-line error naming what to pass
instead."""

from __future__ import annotations

import functools
import os
import re

# What a checkpoint directory needs: config, weights, tokenizer (no .bin, .gguf or onnx copies).
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "*.model",
    "chat_template*",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(name_or_path: str) -> bool:
    """`org/name` that is not an existing local path."""
    name = os.fspath(name_or_path)
    return bool(_HUB_ID.match(name)) and not os.path.exists(name) and not name.endswith(".gguf")


@functools.cache
def local_path(name_or_path: str) -> str:
    """`name_or_path` itself when it is not a Hub id, else the snapshot directory of the Hub id in
    the Hugging Face cache (downloaded once; memoised for the process). Raises ValueError, one
    line, when it can be neither found in the cache nor downloaded."""
    name = os.fspath(name_or_path)
    if not is_hub_id(name):
        return name
    import huggingface_hub

    try:
        return huggingface_hub.snapshot_download(name, allow_patterns=list(ALLOW_PATTERNS))
    except Exception as e:  # offline, no network, unknown or gated repository, ...
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
        raise ValueError(
            f"model.hf_path='{name}' is not a local path, and downloading it from the Hugging "
            f"Face Hub failed ({reason}); pass a local checkpoint directory (config.json + "
            f"safetensors) or a .gguf file instead, e.g. --config.model.hf_path=/path/to/model."
        ) from None
