"""Test set-up: 8 host CPU devices for the multi-device tests, and one persistent compilation
cache for the whole session (its workers and the trainer processes the tests start), so a
program compiled once (the tiny config's step, above all) is loaded from disk afterwards. JAX logs
"Compiling ..." before it looks in the cache, so the tests that check a bad input stops before any
compile still see every compile.

What the tests share: `REPO` (on sys.path, so `from configs import grpo_math` works in every
test), `tiny_config` (the tiny demo config, with changes) and `tiny_model` (the small decoder of
the model-level tests)."""

import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jrl-tests-compile-cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # `configs/`: the run configs the tests start from


def tiny_config(config: str = "grpo_math", **changes):
    """`configs/<config>.py:tiny` (seconds-long runs) with `changes`, keyed by dotted field
    names: `tiny_config(**{"actor.ppo_mini_batch_size": 4, "algorithm.kl_ctrl.type": "fixed"})`."""
    import importlib

    cfg = importlib.import_module(f"configs.{config}").get_config("tiny")
    for name, value in changes.items():
        *parents, leaf = name.split(".")
        node = cfg
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return cfg


def tiny_model(vocab_size: int, **changes):
    """The small decoder of the model-level tests (hidden 32, 2 layers, 4 query and 2 key / value
    heads, MLP 48) with `vocab_size` and `changes` (any ModelConfig field)."""
    from jrl.models import transformer

    fields = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48)
    return transformer.ModelConfig(vocab_size=vocab_size, **{**fields, **changes})


def run_steps(cfg, steps: int, **step_kwargs):
    """`steps` fused steps of `cfg` from its seed-0 initial state on the task's batches 0, 1, ...:
    (final state, each step's metrics on the host). `step_kwargs` go to `make_step`."""
    import jax

    from jrl import step as step_lib
    from jrl.models import transformer
    from jrl.run import trainer

    tok, task, reward_fn, model_cfg = trainer.build(cfg)
    ids = trainer.sampling_ids(tok, task)
    step = jax.jit(step_lib.make_step(cfg, model_cfg, reward_fn, **ids, **step_kwargs))
    key = jax.random.key(0)
    state = step_lib.init_state(cfg, model_cfg, transformer.init_params(model_cfg, key), key)
    metrics = []
    for i in range(steps):
        state, m = step(state, task.train_batch(i, cfg.data.train_batch_size))
        metrics.append(jax.device_get(m))
    return state, metrics
