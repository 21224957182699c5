"""Test set-up: 8 host CPU devices for the multi-device tests, and one persistent compilation
cache for the whole session (its workers and the trainer processes the tests start), so a
program compiled once (the tiny config's step, above all) is loaded from disk afterwards. JAX logs
"Compiling ..." before it looks in the cache, so the tests that check a bad input stops before any
compile still see every compile. XLA compiles at -O0 with its simpler fusion emitters (see
below).

What the tests share: `REPO` (on sys.path, so `from configs import grpo_math` works in every
test), `GOLDEN` (tests/golden/), `tiny_config` (the tiny demo config, with changes), `tiny_model`
(the small decoder of the model-level tests) and `tiny_gemma` (the same with Gemma's options),
`sample` (a rollout of NumPy prompts), `run_steps` (fused steps from the initial state) and
`assert_same_run`. This folder is on sys.path too (pytest puts a conftest's folder there), for
the tests in its subfolders as well: `from conftest import ...`, and the helper modules several
tests share as `from helpers.<module> import ...` (tests/helpers/__init__.py lists them)."""

import os
import sys
import tempfile

# The tests' programs are tiny, so XLA's compile time is most of a test's time. LLVM at -O0
# halves it (the tiny fused step: 15 s -> 7.5 s), and XLA:CPU's older loop emitters for fusions
# (`xla_cpu_use_fusion_emitters=false`) cut what is left by about 3x (the tiny fused step: 5.5
# -> 1.8 s of CPU time; an eager op: about 40 -> 15 ms); both run the programs no slower (30
# tiny steps: 0.3 to 0.5 s either way). Values differ from the default settings' only by float
# rounding; tests compare values within a tolerance.
# COMPILE_FLAGS are for the subprocesses that set XLA_FLAGS of their own (one device, say).
COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
XLA_FLAGS = f"--xla_force_host_platform_device_count=8 {COMPILE_FLAGS}"
os.environ.setdefault("XLA_FLAGS", XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jrl-tests-compile-cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # `configs/`: the run configs the tests start from
GOLDEN = os.path.join(REPO, "tests", "golden")  # reference outputs (scripts/make_*_goldens.py)


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


def tiny_gemma(vocab_size: int, layer_types, **changes):
    """`tiny_model` as a Gemma 2 / 3 decoder: every family option on (GELU-tanh MLP, RMSNorm on
    queries and keys, RMSNorm scaling by 1 + w, scaled embeddings, sandwich norms), head_dim
    16, one layer per `layer_types` entry (sliding ones: window 3), and `changes`."""
    gemma = dict(
        hidden_act="gelu_pytorch_tanh",
        qk_norm=True,
        norm_unit_offset=True,
        scale_embeddings=True,
        sandwich_norms=True,
    )
    layers = dict(num_layers=len(layer_types), layer_types=tuple(layer_types), sliding_window=3)
    return tiny_model(vocab_size, head_dim=16, **{**gemma, **layers, **changes})


def sample(generate, cfg, params, prompts, prompt_mask, key, **options):
    """`generate` (`jrl.rollout.generate` or `jrl.multi_turn.generate`) of NumPy prompt arrays,
    with its keyword `options` (max_new_tokens, eos_id, pad_id, ...): the sampler tests' call."""
    import jax.numpy as jnp

    return generate(cfg, params, jnp.asarray(prompts), jnp.asarray(prompt_mask), key, **options)


def run_steps(cfg, steps: int, **step_kwargs):
    """`steps` fused steps of `cfg` from its seed-0 initial state on the task's batches 0, 1, ...:
    (final state, each step's metrics on the host). `step_kwargs` go to `make_step`."""
    import jax

    from jrl import step as step_lib

    from jrl import train_state
    from jrl.models import transformer
    from jrl.run import trainer

    built = trainer.build(cfg)
    tok, task, reward_fn, model_cfg = built.tokenizer, built.task, built.reward_fn, built.model_cfg
    ids = trainer.sampling_ids(tok, task)
    step = jax.jit(step_lib.make_step(cfg, model_cfg, reward_fn, **ids, **step_kwargs))
    key = jax.random.key(0)
    state = train_state.init_state(cfg, model_cfg, transformer.init_params(model_cfg, key), key)
    metrics = []
    for i in range(steps):
        state, m = step(state, task.train_batch(i, cfg.data.train_batch_size))
        metrics.append(jax.device_get(m))
    return state, metrics


def assert_same_run(got, want, rtol: float):
    """Two runs' (params, [metrics per step]) equal within rtol (atol 1e-6): every metric of
    `want` at every step, and every parameter."""
    import jax
    import numpy as np

    (got_params, got_metrics), (want_params, want_metrics) = got, want
    for g, w in zip(got_metrics, want_metrics):
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=rtol, atol=1e-6, err_msg=k)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6), got_params, want_params
    )
