"""What `model.hf_path` names, loaded: a Hugging Face checkpoint directory (`jrl.models.hf`), a
`.gguf` file (`jrl.models.gguf`, the optional gguf package), or a Hub id `org/name` that is not a
local path (`jrl.models.hub`: downloaded into the Hugging Face cache first). `check_files` reads
the weight files' headers, so that a damaged file stops a run before it writes anything."""

from __future__ import annotations

import os
from typing import Any

from jrl.models import hf, hub
from jrl.models import transformer as tfm


def is_gguf(path) -> bool:
    return os.fspath(path).lower().endswith(".gguf")


def load_config(path, dtype: str = "float32") -> tfm.ModelConfig:
    """The ModelConfig of `path` (no weights are read), compute and weights in `dtype`; raises
    ValueError (one line) as the loader of its kind does."""
    path = hub.local_path(os.fspath(path))
    if is_gguf(path):
        from jrl.models import gguf  # the optional `gguf` package, only for .gguf files

        return gguf.load_config(path, dtype)
    return hf.load_config(path, dtype)


def check_files(path) -> None:
    """Raises ValueError (one line, naming the file) when the weights of `path` would not load:
    a safetensors file that is missing, truncated or damaged (its header and the tensors' byte
    ranges are checked), or a .gguf file whose header does not parse or whose tensors run past
    its end. Reads headers only."""
    path = hub.local_path(os.fspath(path))
    if is_gguf(path):
        from jrl.models import gguf

        gguf.open_file(path)
    else:
        hf.check_weights(path)


def load_pretrained(
    path, dtype: str = "float32", shardings=None, place: hf.Place | None = None
) -> tuple[tfm.ModelConfig, Any]:
    """(ModelConfig, params) of `path`, streamed tensor by tensor into the devices or into
    `shardings` (see `jrl.models.hf.load_pretrained`)."""
    path = hub.local_path(os.fspath(path))
    if is_gguf(path):
        from jrl.models import gguf  # the optional `gguf` package, only for .gguf files

        return gguf.load_pretrained(path, dtype, shardings, place)
    return hf.load_pretrained(path, dtype, shardings, place)
