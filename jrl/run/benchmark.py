"""The benchmark's workloads and measurements: `run(workload)` times the fused step and its three
phases, `memory_report(cfg)` compiles a config's step and reads XLA's memory analysis. The
command line and what is reported: jrl/bench.py."""

from __future__ import annotations

import statistics
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from jrl import config as config_lib
from jrl import logprobs
from jrl import rollout
from jrl import sharding
from jrl import step as step_lib
from jrl import train_state
from jrl import tokenizer as tokenizer_lib
from jrl.run import targets, trainer
from jrl.data.arithmetic import ArithmeticTask
from jrl.models import transformer
from jrl.rewards import get_reward

_W2 = dict(
    model=dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1024),
    prompts=16,
    n=8,
    new_tokens=64,
    # Rows per forward / backward of the update (gradients summed over the 8 micro-batches of
    # the one optimizer update). On the 2-core CPU, 16 rows (~1.1k tokens) ran the update
    # 1.25x faster than all 128 at once: each micro-batch's activations stay in cache.
    micro_batch=16,
)
WORKLOADS = {
    "W1": dict(
        model=dict(
            hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
        ),
        prompts=8,
        n=4,
        new_tokens=16,
    ),
    "W2": _W2,
    # W2's model and rows with a 512-token budget; each response ends at EOS at a fixed length
    # (`response_lengths`): long-tailed, mean ~R/4, as in reasoning RL.
    "W3": {
        **_W2,
        "new_tokens": 512,
        "lengths": dict(sigma=1.0, seed=0),
        # what a user runs for such lengths: the update's micro-batches trimmed to buckets, rows
        # (not GRPO groups: the shared-prompt forward saves nothing at 7-token prompts) ordered
        # by length into them; the decode compacted (rollout.compact_decode, on by default)
        "config": {"model.response_buckets": (64, 128, 256), "model.shared_prompt_forward": False},
    },
    # W2 with a mixture of experts in every layer: 8 experts of width 512, top 2 (weights
    # renormalised, as Mixtral). Each token runs 2 x 512 = 1024 of MLP width, W2's dense width,
    # through the same three projections: the same active parameters (786k per layer's MLP),
    # plus the router (256 x 8, +0.3%); its 8 x 512 experts hold 4x W2's MLP parameters. Against
    # W2 it times the routing, sort and grouped matmuls (`jrl.models.moe`) against one matmul.
    "W2-MoE": {
        **_W2,
        "model": {
            **_W2["model"],
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 512,
            "norm_topk_prob": True,
        },
    },
}


def response_lengths(name: str, fixed_length: bool = False) -> np.ndarray | None:
    """[B] response lengths (EOS included) that workload `name` forces (`rollout.generate`'s
    `forced_length`), or None for a workload without them (W1, W2, W2-MoE: EOS never stops a
    row). A log-normal of shape sigma around a mean of R/4, rounded and clipped to [1, R], from a
    fixed seed: the same lengths every run (W3: mean 125.2, median 85.5, 2 of 128 rows at 512).
    `fixed_length`: every row at the budget R instead."""
    w = WORKLOADS[name]
    if "lengths" not in w:
        return None
    rows, r = w["prompts"] * w["n"], w["new_tokens"]
    if fixed_length:
        return np.full((rows,), r, np.int32)
    sigma, seed = w["lengths"]["sigma"], w["lengths"]["seed"]
    mu = np.log(r / 4) - sigma**2 / 2  # the log-normal's mean is exp(mu + sigma^2 / 2) = R / 4
    drawn = np.random.default_rng(seed).lognormal(mu, sigma, rows)
    return np.clip(np.round(drawn), 1, r).astype(np.int32)


def decode_row_steps(lengths, r: int, stages: tuple[int, ...]) -> int:
    """Rows x steps the decode computes for responses of `lengths` [B] (EOS included) under a
    budget of `r` tokens: each step t runs the rows of its stage (`rollout.decode_stages`; (B,):
    no compaction), from token 0 until the last row's last token, as `rollout.generate` does (a
    stage runs while more rows are live than the next one holds)."""
    lengths = np.asarray(lengths)
    total, stage = 0, 0
    for t in range(min(r, int(lengths.max()))):
        live = int(np.sum(lengths > t))
        while stage + 1 < len(stages) and live <= stages[stage + 1]:
            stage += 1
        total += stages[stage]
    return total


def token_shares(spec: step_lib.StepSpec, prompt_mask, lengths) -> dict:
    """Share of the positions each phase computes that hold real tokens (prompt tokens, response
    tokens up to and including EOS), for responses of `lengths` [B] and prompts `prompt_mask`
    [B_p, P]. decode: the rows each step runs (`decode_row_steps`); scoring and update: each
    forward's prompt positions (with a shared-prompt forward each prompt once: B_p x P, else
    B x P) and response positions, each micro-batch at the response length it is trimmed to
    (`model.response_buckets`, rows ordered by length as `jrl.buckets.length_order` does; one
    mini-batch per epoch, as in the workloads). scoring is None when it runs no forward (an
    on-policy update without reference or critic)."""
    prompt_mask, lengths = np.asarray(prompt_mask), np.asarray(lengths)
    b, r, (b_p, p) = len(lengths), spec.max_new_tokens, prompt_mask.shape
    n, real_response = b // b_p, int(lengths.sum())
    cfg = spec.cfg.rollout
    stages = rollout.decode_stages(b, 1, cfg.compact_min_rows) if cfg.compact_decode else (b,)

    def forward_share(name):
        role = spec.batching[name]
        grouped = role.group > 1 and logprobs.grouped_forward_suits(spec.model_cfg, p + r)
        copies = 1 if grouped else n
        group, sizes = role.group, np.asarray(role.buckets or (r,))
        block_ends = np.sort(lengths.reshape(-1, group).max(axis=1))
        response = sum(
            len(mb) * group * int(sizes[np.searchsorted(sizes, mb.max())])
            for mb in np.array_split(block_ends, role.micro)
        )
        return (copies * int(prompt_mask.sum()) + real_response) / (copies * b_p * p + response)

    scoring_forwards = (
        (not (spec.on_policy or step_lib.bypass_mode(spec.cfg)))
        + train_state.needs_reference(spec.cfg)
        + (spec.use_critic and not spec.shared)
    )
    return {
        "decode": round(real_response / decode_row_steps(lengths, r, stages), 4),
        "scoring": round(forward_share("log_prob"), 4) if scoring_forwards else None,
        "update": round(forward_share("actor"), 4),
    }


def workload_config(name: str, micro_batch: int | None = None):
    """The workload's config; `micro_batch` overrides its update micro-batch (rows, 0: all)."""
    w = WORKLOADS[name]
    cfg = config_lib.base_config()
    cfg.model.update(w["model"])
    cfg.model.qkv_bias = True  # Qwen2-style
    cfg.model.tie_word_embeddings = True
    cfg.data.train_batch_size = w["prompts"]
    cfg.data.max_response_length = w["new_tokens"]
    cfg.rollout.n = w["n"]
    cfg.actor.ppo_mini_batch_size = w["prompts"]  # one optimizer update per step
    cfg.actor.ppo_epochs = 1
    if micro_batch is None:
        micro_batch = w.get("micro_batch", 0)
    cfg.actor.ppo_micro_batch_size_per_device = micro_batch  # 0: the whole mini-batch at once
    for field, value in w.get("config", {}).items():
        section, name = field.split(".")
        cfg[section][name] = value
    config_lib.validate(cfg)
    return cfg


def _median_seconds(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Workload(NamedTuple):
    """A workload ready to run: its config, model, reward, sampling ids, first state and prompts."""

    cfg: Any
    model_cfg: transformer.ModelConfig
    reward_fn: Any
    ids: dict  # eos_id / pad_id / max_new_tokens of `step.make_step`
    state: train_state.TrainState
    batch: dict  # the prompts of one step, on the device


def setup(name: str, micro_batch: int | None = None, fixed_length: bool = False) -> Workload:
    """Workload `name` (`workload_config`) with a random-initialised model and its first prompts.
    `fixed_length`: a workload with forced lengths (W3) forces every response to the budget."""
    cfg = workload_config(name, micro_batch)
    w = WORKLOADS[name]
    tok = tokenizer_lib.char_tokenizer()
    task = ArithmeticTask(tok, max_response_length=w["new_tokens"], seed=cfg.seed)
    model_cfg = trainer.model_config(cfg, len(tok))
    lengths = response_lengths(name, fixed_length)
    if lengths is None:
        # eos_id=-1: no row ever stops early, so every step decodes exactly `new_tokens` tokens.
        ids = dict(eos_id=-1, pad_id=tok.pad_token_id, max_new_tokens=w["new_tokens"])
    else:  # every row ends at EOS at its forced length, whatever the model samples
        ids = dict(
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
            max_new_tokens=w["new_tokens"],
            forced_length=lengths,
        )
    key_init, key_state = jax.random.split(jax.random.key(cfg.seed))
    state = train_state.init_state(
        cfg, model_cfg, transformer.init_params(model_cfg, key_init), key_state
    )
    batch = jax.device_put(task.train_batch(0, w["prompts"]))
    return Workload(cfg, model_cfg, get_reward(cfg.task.reward), ids, state, batch)


def run(
    name: str, steps: int = 10, micro_batch: int | None = None, fixed_length: bool = False
) -> dict:
    cfg, model_cfg, reward_fn, ids, state, batch = setup(name, micro_batch, fixed_length)
    w = WORKLOADS[name]

    step = jax.jit(step_lib.make_step(cfg, model_cfg, reward_fn, **ids), donate_argnums=0)
    t = time.perf_counter()
    state, metrics = jax.block_until_ready(step(state, batch))  # compiles; untimed
    compile_s = time.perf_counter() - t  # compile + the first step

    def one_step():  # the jitted function, as the trainer calls it (jax's C++ dispatch path)
        nonlocal state
        state, m = step(state, batch)
        return m

    step_s = _median_seconds(one_step, steps)

    generate, score, update = (
        jax.jit(f) for f in step_lib.make_phases(cfg, model_cfg, reward_fn, **ids)
    )
    key = jax.random.key(1)
    exp, _ = jax.block_until_ready(generate(state, batch, key))
    scored, _, _ = jax.block_until_ready(score(state, exp))
    jax.block_until_ready(update(state, scored, key))
    phases = {
        "rollout_and_reward": _median_seconds(lambda: generate(state, batch, key), steps),
        "logprobs_and_advantages": _median_seconds(lambda: score(state, exp), steps),
        "update": _median_seconds(lambda: update(state, scored, key), steps),
    }
    rows = w["prompts"] * w["n"]
    lengths = ids.get("forced_length", np.full((rows,), w["new_tokens"]))
    if int(np.sum(exp["response_mask"])) != int(np.sum(lengths)):
        raise RuntimeError("the rollout's response lengths differ from the workload's")
    generated = int(np.sum(lengths))  # real response tokens (EOS included)
    total = generated + int(np.sum(batch["attention_mask"])) * w["n"]
    spec = step_lib.make_spec(cfg, model_cfg, reward_fn, **ids)
    extra = {}
    if "forced_length" in ids:
        extra = {
            "fixed_length": fixed_length,
            "response_length_mean": round(float(np.mean(lengths)), 1),
            "response_length_max": int(np.max(lengths)),
            "real_token_share": token_shares(spec, batch["attention_mask"], lengths),
        }
    return {
        "workload": name,
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "rows": rows,
        "new_tokens": w["new_tokens"],
        **extra,
        "micro_batch": cfg.actor.ppo_micro_batch_size_per_device,
        "compile_s": round(compile_s, 3),
        "compiles": step._cache_size(),  # of the fused step over the run: 1 = no retrace
        "step_s_median": round(step_s, 5),
        "generated_tokens_per_s": round(generated / step_s, 1),
        "total_tokens_per_s": round(total / step_s, 1),
        "phase_s_median": {k: round(v, 5) for k, v in phases.items()},
    }


def memory_report(cfg, target: targets.Target | None = None) -> dict:
    """XLA's compile-time memory analysis of the fused step of `cfg` on the current devices and
    `cfg.mesh`, per device, from abstract inputs: nothing is allocated or run. Bytes:
    `argument_bytes` (train state + prompt batch), `output_bytes`, `alias_bytes` (outputs written
    into the donated state), `temp_bytes` (everything the step allocates while it runs), and
    `peak_bytes` = arguments + outputs - aliased + temporaries (XLA's own `peak_memory_in_bytes`
    is not filled in on every backend).

    With `target` (`jrl.run.targets`), the step is compiled by the TPU compiler for the target's
    chips and `cfg.mesh` over them instead: the figures are per chip, the report names the
    `compiler` and the `target`, and `compiler_peak_bytes` is the compiler's own peak. A step
    larger than a chip's memory gives `fits: False` and the compiler's message instead of the
    figures."""
    config_lib.validate(cfg)
    built = trainer.build(cfg)
    task, model_cfg = built.task, built.model_cfg
    if target is None:
        mesh = sharding.make_mesh(cfg.mesh.axes, cfg.mesh.shape)
    else:
        mesh = targets.mesh_for(target, cfg)
    key = jax.random.key(0)
    params = lambda: transformer.init_params(model_cfg, key)
    init = lambda: train_state.init_state(cfg, model_cfg, params(), key)
    ids = trainer.sampling_ids(built.tokenizer, task, cfg)
    jitted = trainer.jit_step(cfg, model_cfg, built.reward_fn, ids, mesh, init)
    abstract = jitted.abstract_state
    batch = task.train_batch(0, step_lib.prompts_per_step(cfg))  # host arrays: only shapes used
    args = (targets.abstract(abstract, jitted.state_sh), targets.abstract(batch, jitted.batch_sh))
    prompts = step_lib.prompts_per_step(cfg)
    shapes = {
        "devices": mesh.size,
        "device": str(mesh.devices.flat[0].device_kind),
        "mesh": dict(mesh.shape),
        "prompts": prompts,
        "rows": prompts * cfg.rollout.n,
        "mini_batch_rows": cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
        "prompt_length": int(batch["input_ids"].shape[1]),
        "response_length": int(task.max_response_length),
        "params": int(sum(x.size for x in jax.tree.leaves(abstract.params))),
    }
    about = {}
    if target is not None:
        about = {"compiler": targets.compiler_name(), "target": target.describe()}
    t = time.perf_counter()
    try:
        compiled = targets.compile(jitted.step_fn, args, target, mesh)
    except targets.DoesNotFit as e:
        compile_s = round(time.perf_counter() - t, 1)
        failed = {"fits": False, "compiler_message": str(e), "compile_s": compile_s}
        return {**about, **failed, **shapes}
    compile_s = time.perf_counter() - t
    m = compiled.memory_analysis()
    argument, output, alias, temp = (
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.alias_size_in_bytes,
        m.temp_size_in_bytes,
    )
    peak = argument + output - alias + temp
    figures = {
        "temp_bytes": int(temp),
        "argument_bytes": int(argument),
        "output_bytes": int(output),
        "alias_bytes": int(alias),
        "peak_bytes": int(peak),
        "peak_gb": round(peak / 1e9, 2),
    }
    if target is not None:
        figures = {
            **about,
            "fits": True,
            **figures,
            "compiler_peak_bytes": int(getattr(m, "peak_memory_in_bytes", 0)),
        }
    return {**figures, "compile_s": round(compile_s, 1), **shapes}
