"""The model layer imports nothing from the runtime (sharding, step, train, ...), jrl.sharding
nothing from the models, and the named variants are `jrl.registry.Registry`s with one error."""

import subprocess
import sys

import pytest

from jrl import data, rewards
from jrl.models import attention, hf, transformer
from jrl.registry import Registry, UnknownName

RUNTIME = (
    "jrl.sharding",
    "jrl.step",
    "jrl.logprobs",
    "jrl.batching",
    "jrl.train",
    "jrl.eval",
    "jrl.rollout",
    "jrl.algos",
)


def imported_by(module: str) -> set[str]:
    """The jrl modules a fresh interpreter has loaded after `import <module>`."""
    code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.startswith('jrl')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["jrl.models", "jrl.models.lora"])
def test_models_import_no_runtime_module(module):
    loaded = imported_by(module)
    assert not {m for m in loaded if m.startswith(RUNTIME)}, loaded


def test_sharding_imports_no_model_module():
    assert not {m for m in imported_by("jrl.sharding") if m.startswith("jrl.models")}


@pytest.mark.parametrize(
    "table",
    [
        data.TASKS,
        rewards.REWARDS,
        rewards.HOST_REWARDS,
        hf.FAMILIES,
        transformer.ACTIVATIONS,
        transformer.ROPE_SCALINGS,
        transformer.REMAT_POLICIES,
        transformer.LAYER_TYPES,
        attention.IMPLEMENTATIONS,
    ],
)
def test_named_variants_are_registries(table):
    assert isinstance(table, Registry)
    with pytest.raises(UnknownName, match=r"unknown .*'nope'.*: valid names are "):
        table.get("nope")


def test_unknown_model_options_raise_the_registry_error():
    with pytest.raises(UnknownName, match=r"unknown MLP activation .*'gelu_fast'.*did you mean"):
        transformer.ModelConfig(vocab_size=8, hidden_act="gelu_fast")
    with pytest.raises(UnknownName, match=r"unknown remat policy .*'blocks'.*did you mean 'block'"):
        transformer.ModelConfig(vocab_size=8, remat="blocks")
    with pytest.raises(UnknownName, match=r"unknown attention implementation .*'flash'"):
        transformer.ModelConfig(vocab_size=8, attention="flash")
    with pytest.raises(UnknownName, match=r"unknown layer type .*'local'"):
        transformer.ModelConfig(vocab_size=8, num_layers=1, layer_types=("local",))
    with pytest.raises(UnknownName, match=r"unknown task 'gsm9k' \(did you mean 'gsm8k'\?\)"):
        data.make_task("gsm9k", None)
    with pytest.raises(UnknownName, match=r"unknown reward 'gsm9k'.*package.module:function"):
        rewards.get_reward("gsm9k")
