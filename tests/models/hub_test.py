"""model.hf_path as a Hub id (jrl/models/hub.py), with a local fake of snapshot_download: the
network is never used."""

import os

import huggingface_hub
import pytest

from jrl import config as config_lib
from jrl import models
from jrl.models import hf, hub
from conftest import GOLDEN, tiny_config


@pytest.fixture(autouse=True)
def fresh_memo():
    hub.local_path.cache_clear()
    yield
    hub.local_path.cache_clear()


def test_hub_id_is_downloaded_once_into_the_cache_and_loaded(monkeypatch):
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return os.path.join(GOLDEN, "qwen3")  # stands in for the snapshot in the HF cache

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    cfg = models.load_config("someorg/tiny-qwen3")
    cfg2, _ = models.load_pretrained("someorg/tiny-qwen3")
    assert cfg == cfg2 == hf.load_config(os.path.join(GOLDEN, "qwen3"))
    assert [c[0] for c in calls] == ["someorg/tiny-qwen3"]  # memoised: one call per process
    patterns = calls[0][1]["allow_patterns"]
    assert "*.safetensors" in patterns and "config.json" in patterns and "*.bin" not in patterns


def test_local_paths_are_never_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("org/name")
    assert not hub.is_hub_id("org/name")  # an existing directory wins
    assert not hub.is_hub_id("/abs/path") and not hub.is_hub_id("./org/x")
    assert not hub.is_hub_id("org/model.gguf") and not hub.is_hub_id("a/b/c")
    assert hub.is_hub_id("google/gemma-3-270m") and hub.is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")


def test_offline_gives_one_line_naming_what_to_pass(monkeypatch):
    def offline(repo_id, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError(
            "Cannot find an appropriate cached snapshot folder.\nsecond line"
        )

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError) as e:
        models.load_config("someorg/tiny")
    message = str(e.value)
    assert "\n" not in message
    assert message == (
        "model.hf_path='someorg/tiny' is not a local path, and downloading it from the Hugging "
        "Face Hub failed (LocalEntryNotFoundError: Cannot find an appropriate cached snapshot "
        "folder.); pass a local checkpoint directory (config.json + safetensors) or a .gguf file "
        "instead, e.g. --config.model.hf_path=/path/to/model."
    )


def test_validate_accepts_hub_ids_and_gguf_files(tmp_path):
    cfg = tiny_config()
    cfg.tokenizer = ""
    cfg.model.hf_path = "someorg/tiny"
    config_lib.validate(cfg)  # fetched later, by the loader
    cfg.model.hf_path = str(tmp_path / "m.gguf")
    with pytest.raises(config_lib.ConfigError, match="no such .gguf file"):
        config_lib.validate(cfg)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    config_lib.validate(cfg)
    cfg.model.hf_path = str(tmp_path)
    with pytest.raises(config_lib.ConfigError, match="has no config.json; point it at a local"):
        config_lib.validate(cfg)
