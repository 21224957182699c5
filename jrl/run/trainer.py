"""The trainer as a library: `run(cfg, workdir)` trains (or resumes) one run; `build` (a
`Built`), `model_config`, `initial_params`, `jit_step` (a `JittedStep`) and `sampling_ids` are
the pieces the other tools (jrl.run.evaluator, jrl.run.exporter, jrl.run.benchmark) and the
tests share. The command line is jrl/train.py.

Read `run` top to bottom (`_run`): `set_up` validates the config and builds the tokenizer, task,
reward and model, the mesh, the checkpointer and the jitted step into a `Run`; `start_or_resume`
resumes from the workdir's newest valid checkpoint or warms up (optional supervised steps);
`open_loop` opens the metric writer, the progress bar and the eval; `train_steps` loops over RL
steps (batch, step, checks, eval, metrics row, checkpoint); `finish` saves, closes and releases
the workdir. Each RL step is one jitted call of the fused step (jrl/step.py); the host only
feeds prompt batches, writes metrics and saves checkpoints. Multi-host: every process runs the
same `run`; each feeds only the prompt rows its devices hold; process 0 writes metrics,
tensorboard and config.json; all save checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

from absl import logging
from etils import epath
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jrl import config as config_lib
from jrl import batching, data, models, rewards, sharding, sft, step as step_lib
from jrl import nan_guard
from jrl import train_state
from jrl import tokenizer as tokenizer_lib
from jrl.models import lora as lora_lib
from jrl.models import pretrained, transformer
from jrl.run import checkpoint as checkpoint_lib
from jrl.run import console
from jrl.run import metric_writers as metric_files
from jrl.run import samples as samples_lib
from jrl.run import workdir as workdir_lib
from jrl.run.metric_writers import MetricWriter, ProgressBar, to_python
from jrl.tools import base as tool_base
from jrl.tools import host as tool_host
from jrl.tools.metrics import multi_turn_metrics


def init_distributed(
    distributed: bool = False,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """jax.distributed.initialize() for a multi-host run (`distributed`, or any coordinator
    setting given; with none JAX reads them from the environment); before anything touches a
    device. A single-process run skips it."""
    given = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not (distributed or given):
        return
    jax.distributed.initialize(**given)
    logging.info(
        "process %d of %d: %d local devices, %d in all",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def model_config(cfg, vocab_size: int) -> transformer.ModelConfig:
    """The decoder of `model.*`, or of the HF checkpoint `model.hf_path` (in `model.dtype`).
    With LoRA the frozen base is held in the compute dtype (`model.dtype`)."""
    frozen = {"param_dtype": cfg.model.dtype} if lora_lib.lora_on(cfg) else {}
    if cfg.model.hf_path:  # the checkpoint's architecture, computed as model.* says
        hf_cfg = models.load_config(cfg.model.hf_path, dtype=cfg.model.param_dtype)
        return dataclasses.replace(
            hf_cfg, **{k: cfg.model[k] for k in transformer.COMPUTE_FIELDS}, **frozen
        )
    step_fields = (
        "hf_path",
        "vocab_size",
        "shared_prompt_forward",
        "response_buckets",
    )  # not the model's
    fields = {k: v for k, v in cfg.model.items() if k not in step_fields}
    fields["head_dim"] = fields["head_dim"] or None
    vocab_size = cfg.model.vocab_size or vocab_size  # 0: the tokenizer's size
    return transformer.ModelConfig(vocab_size=vocab_size, **{**fields, **frozen})


def initial_params(cfg, model_cfg: transformer.ModelConfig, key, mesh=None, shardings=None):
    """Fresh parameters, or the HF checkpoint's; parts the checkpoint lacks (a value head on a
    shared backbone) are freshly initialised. With `mesh` and `shardings` (the params' tree of
    NamedShardings) they are created in place on the devices."""
    loaded = {}
    if cfg.model.hf_path:  # streamed tensor by tensor, each straight into its shards
        _, loaded = models.load_pretrained(
            cfg.model.hf_path, dtype=model_cfg.param_dtype, shardings=shardings
        )

    def init():  # only what the checkpoint lacks (XLA drops the rest of the computation)
        fresh = transformer.init_params(model_cfg, key)
        return {k: v for k, v in fresh.items() if k not in loaded}

    if mesh is not None:
        abstract = jax.eval_shape(init)
        init = sharding.sharded_init(init, mesh, {k: shardings[k] for k in abstract})
    return {**init(), **loaded}


def policy_model(cfg) -> tuple:
    """(tokenizer, policy model config) of a run; unlike `build` it needs no data files."""
    tok = tokenizer_lib.get_tokenizer(cfg.tokenizer or cfg.model.hf_path)
    model_cfg, _ = train_state.model_configs(cfg, model_config(cfg, len(tok)))
    return tok, model_cfg


def sampling_ids(tok, task, cfg=None) -> dict:
    """The token ids and response length that make_step / make_phases / make_eval take; with
    `cfg`, its `rollout.stop` as `stop_ids` (its ids) and `stop_strings` (the tables of its
    strings, `tokenizer.stop_strings`), and with rollout.multi_turn.enable instead the
    multi-turn rollout's `tool_host`, whose stops take in rollout.stop's, built here once from
    the config and the tokenizer (`jrl.tools.host.make_tool_host`; ConfigError when a tool does
    not load, the format does not suit the tokenizer or a block does not fit)."""
    stop = tuple(cfg.rollout.stop) if cfg is not None else ()
    multi = cfg is not None and cfg.rollout.multi_turn.enable
    ids = {
        "eos_id": tok.eos_token_id,
        "pad_id": tok.pad_token_id,
        "max_new_tokens": task.max_response_length,
        "stop_ids": tokenizer_lib.stop_token_ids(tok, stop),
        "stop_strings": None if multi else tokenizer_lib.stop_strings(tok, stop),
    }
    if multi:
        ids["tool_host"] = tool_host.make_tool_host(
            cfg, tok, max_response_length=task.max_response_length
        )
    return ids


def prompt_counts(task) -> dict:
    """Prompts longer than data.max_prompt_length that the task dropped or truncated, as step-0
    metrics: `data/prompts_dropped`, `data/prompts_truncated` (`.../<split>` when counted per
    split)."""
    out = {}
    for name, attr in (("dropped", "num_dropped"), ("truncated", "num_truncated")):
        count = getattr(task, attr, 0)  # an int, or a dict per split
        if isinstance(count, dict):
            out.update({f"data/prompts_{name}/{split}": int(n) for split, n in count.items()})
        else:
            out[f"data/prompts_{name}"] = int(count)
    return out


def task_options(cfg) -> dict:
    """`data.task_options(cfg)`, and with rollout.multi_turn.enable and chat prompts the tools'
    schemas (`tools=`), which the chat template lists in every prompt."""
    options = data.task_options(cfg)
    if cfg.rollout.multi_turn.enable and cfg.task.prompt_format == "chat":
        if cfg.task.name not in data.ARITHMETIC_TASKS:  # the file tasks render chat prompts
            options["tools"] = [
                t.schema for t in tool_base.resolve_tools(cfg.rollout.multi_turn.tools)
            ]
    return options


@dataclasses.dataclass(frozen=True)
class Built:
    """What `build` makes of a config: the pieces of a run that need no device."""

    tokenizer: Any  # the run's tokenizer (config.tokenizer, else model.hf_path's)
    task: Any  # the prompts: train_batch(i, size, rows=...), eval_batch(), decode_responses
    reward_fn: Callable  # the task's reward (jrl.rewards.get_reward)
    model_cfg: transformer.ModelConfig  # the policy's


def build(cfg) -> Built:
    """Tokenizer, task, reward function and the policy's model config of a run. Bad input (a
    missing data file or field, an unreadable tokenizer or checkpoint config) raises ConfigError
    with the loader's one-line message, before anything compiles."""
    try:
        return _build(cfg)
    except (ValueError, OSError) as e:
        if isinstance(e, config_lib.ConfigError):
            raise
        raise config_lib.ConfigError(str(e).splitlines()[0] if str(e) else repr(e)) from e


def _build(cfg) -> Built:
    if cfg.model.hf_path:  # a damaged weight file stops the run here, before the workdir
        pretrained.check_files(cfg.model.hf_path)
    tok, policy_cfg = policy_model(cfg)
    task = data.make_task(cfg.task.name, tok, **task_options(cfg))
    tokenizer_lib.stop_token_ids(tok, cfg.rollout.stop)  # ids of this tokenizer
    tokenizer_lib.stop_strings(tok, cfg.rollout.stop)  # strings its text can be matched for
    reward_fn = rewards.get_reward(
        cfg.task.reward,
        task,
        tok,
        reward_timeout_s=reward_time_limit(cfg),
        **rewards.reward_options(cfg.task),
    )
    if len(tok) > policy_cfg.vocab_size:
        raise config_lib.ConfigError(
            f"the tokenizer has {len(tok)} tokens but the model's vocabulary has "
            f"{policy_cfg.vocab_size}; use the model's own tokenizer (--config.tokenizer='') or a "
            f"model with a vocabulary of at least {len(tok)}."
        )
    return Built(tokenizer=tok, task=task, reward_fn=reward_fn, model_cfg=policy_cfg)


# XLA's CPU collectives end the process (a fatal error, status 134) when one device waits for
# the others at a collective for 60 s, as they do while a host callback runs; a user reward's
# timed-out call can take three times its limit (jrl.rewards.worker: its sample is searched).
CPU_MESH_REWARD_S = 15.0


def reward_time_limit(cfg) -> float:
    """`reward.timeout_s`; for a user reward on a CPU with several devices at most
    CPU_MESH_REWARD_S (with a warning), so that a hanging one stops the run with its own
    error."""
    limit = cfg.reward.timeout_s
    cpu_mesh = jax.default_backend() == "cpu" and jax.device_count() > 1
    if ":" in cfg.task.reward and cpu_mesh and limit > CPU_MESH_REWARD_S:
        logging.warning(
            "reward.timeout_s=%g is cut to %g s on this CPU mesh of %d devices: XLA ends the "
            "process when a host callback keeps the devices waiting for 60 s.",
            limit,
            CPU_MESH_REWARD_S,
            jax.device_count(),
        )
        limit = CPU_MESH_REWARD_S
    return limit


@dataclasses.dataclass(frozen=True)
class JittedStep:
    """What `jit_step` returns: the jitted fused step and the shapes and placement of its
    inputs."""

    step_fn: Callable  # (state, batch) -> (state, metrics); the state is donated
    abstract_state: Any  # the train state's shapes (jax.ShapeDtypeStruct leaves)
    state_sh: Any  # the train state's NamedShardings
    batch_sh: NamedSharding  # the prompt batch's


def state_shardings(cfg, model_cfg, mesh, abstract):
    """The NamedShardings over `mesh` of the abstract train state `abstract` of `cfg` (the policy's,
    the critic's and, with LoRA, the adapters' logical axes)."""
    critic_cfg = train_state.model_configs(cfg, model_cfg)[1]
    axes = lora_lib.state_axes(
        cfg,
        abstract,
        transformer.logical_axes(model_cfg),
        None if critic_cfg is None else transformer.logical_axes(critic_cfg),
    )
    return sharding.state_shardings(mesh, abstract, **axes)


def jit_step(cfg, model_cfg, reward_fn, ids: dict, mesh, init_state) -> JittedStep:
    """The fused step jitted over `mesh` (state donated) and the abstract train state of
    `init_state()` with its shardings (`JittedStep`). Nothing is allocated; the trainer and
    `python -m jrl.bench --memory` compile the same step."""
    abstract = jax.eval_shape(init_state)
    state_sh = state_shardings(cfg, model_cfg, mesh, abstract)
    batch_sh = sharding.batch_sharding(mesh, step_lib.prompts_per_step(cfg))
    step_fn = jax.jit(
        step_lib.make_step(cfg, model_cfg, reward_fn, **ids, mesh=mesh),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
    )
    return JittedStep(
        step_fn=step_fn, abstract_state=abstract, state_sh=state_sh, batch_sh=batch_sh
    )


# ---------------------------------------------------------------------------------------------
# A training run: `set_up` makes its `Run`, `start_or_resume` its train state, `open_loop` its
# outputs; `train_steps` loops over its steps and `finish` ends it.


@dataclasses.dataclass(frozen=True)
class Run:
    """What a training run is made of once set up (`set_up`), before its train state exists:
    what starting, the loop over steps and the ending read."""

    cfg: Any  # validated
    workdir: str  # absolute (orbax needs absolute paths), or a gs:// URL
    guard: Any  # the checkpoint.PreemptionGuard `run` entered
    built: Built  # tokenizer, task, reward function, the policy's model config
    mesh: jax.sharding.Mesh
    ids: dict  # `sampling_ids` (with the config's stops and multi-turn tool host)
    key_init: Any  # the initial parameters' key (the seed's first half)
    init: Callable  # params -> the train state at step 0 (its key the seed's second half)
    inputs: dict  # the input files' fingerprints (config.json; a resume checks them)
    ckpt: Any  # the run's Checkpointer, its saves guarded (`open_checkpoints`)
    jitted: JittedStep  # the fused step and its state's shapes and shardings
    long_prompts: dict  # `prompt_counts`: step 0's data/prompts_* metrics
    main_process: bool  # process 0: it writes metrics and config.json, and prints
    base_from_hf: bool  # checkpoints leave out the LoRA base (reloaded from model.hf_path)
    config_json: dict  # the config as each checkpoint records it

    def say(self, *args, **kwargs) -> None:
        """`print` on the main process (the few lines a run shows), nothing on the others."""
        if self.main_process:
            print(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Loop:
    """What the loop over steps uses beside the `Run` (`open_loop`): the metric writer, the
    progress bar, the eval that writes to both, and this host's share of each prompt batch."""

    writer: Any  # a MetricWriter, its writes guarded
    bar: ProgressBar
    evaluate: Callable  # (state, step) -> metrics (`make_evaluate`)
    batch_size: int  # prompts per step
    rows: slice  # the rows of each batch this host reads (sharding.process_rows)


# LoRA on a Hugging Face checkpoint: a resume reloads the frozen base from model.hf_path
# (checkpoint_lib.lora_base_from_hf).


def reload_lora_base(run: Run, state, extra: dict, params_sh):
    """`state` with its frozen base loaded from model.hf_path; CheckpointError (one line) when
    that is not the base the checkpoint was trained on."""
    cfg = run.cfg
    message = lora_lib.check_base(extra.get("lora_base") or {}, cfg.model.hf_path)
    if message:
        raise checkpoint_lib.CheckpointError(message)
    params = initial_params(cfg, run.built.model_cfg, run.key_init, run.mesh, params_sh)
    base, _ = lora_lib.split(params)
    return state.replace(ref_params=base)


# ---------------------------------------------------------------------------------------------


class NonFiniteError(RuntimeError):
    """The run stopped because steps kept producing non-finite values."""


def check_finite(cfg, metrics: dict, consecutive: int) -> int:
    """Counts consecutive skipped steps; raises NonFiniteError naming the first bad quantity when
    the guard is off or `nan_guard.max_consecutive` steps in a row were skipped."""
    if not metrics["training/step_skipped"]:
        return 0
    bad = [k for k in nan_guard.GUARDED_METRICS if metrics.get(f"training/finite/{k}") == 0]
    consecutive += 1
    step = metrics["step"]
    if not cfg.nan_guard.enable:
        raise NonFiniteError(f"step {step}: {bad[0]} is not finite (nan_guard is off).")
    logging.warning(
        "step %d skipped: %s not finite (%d in a row)", step, ", ".join(bad), consecutive
    )
    if consecutive >= cfg.nan_guard.max_consecutive:
        raise NonFiniteError(
            f"stopped at step {step}: {consecutive} steps in a row were skipped because {bad[0]} "
            f"was not finite; check the reward, lower actor.lr, or resume from a checkpoint."
        )
    return consecutive


def check_rewards(reward_fn) -> None:
    """`rewards.check(reward_fn)` agreed by every process (all raise when a reward failed on
    any: they stop at the same step). RewardFailed names the sample on the process it failed
    on; RewardInterrupted when a stop request abandoned a user reward."""
    error = None
    try:
        rewards.check(reward_fn)
    except rewards.RewardFailed as e:
        error = e
    if jax.process_count() > 1:
        code = 2 if error is None else int(isinstance(error, rewards.RewardInterrupted))
        worst = int(min(multihost_utils.process_allgather(np.int32(code))))
        if error is None and worst < 2:
            kind = rewards.RewardInterrupted if worst == 1 else rewards.RewardFailed
            error = kind("a reward failed on another process (its error names the sample)")
    if error is not None:
        raise error


def check_writable(workdir: str) -> None:
    """Creates `workdir` (local or gs://) and writes and deletes a probe file in it; ConfigError
    with the reason if that fails, before anything else is written."""
    probe = epath.Path(workdir) / f".jrl-write-probe-{os.getpid()}-{jax.process_index()}"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except Exception as e:  # OSError locally; a storage client's own errors for gs://
        reason = getattr(e, "strerror", None) or f"{type(e).__name__}: {e}".splitlines()[0]
        raise config_lib.ConfigError(
            f"--workdir={workdir} is not writable ({reason}); choose a directory you can "
            f"create and write to."
        ) from None


def prepare_workdir(workdir: str, *, fresh: bool, guard=None) -> None:
    """Checks `workdir` is writable, takes its lock (InUseError while another live run holds
    it), sends INFO logs to workdir/train.log and, with `fresh`, moves old checkpoints aside
    (only once the lock is ours: --fresh never breaks a live run). With `guard` (a
    PreemptionGuard), a signal's exit at once waits for these writes and releases the lock."""
    guard = guard or checkpoint_lib.PreemptionGuard()
    with guard.writing():
        check_writable(workdir)
        workdir_lib.acquire(workdir)
        guard.on_exit.append(lambda: workdir_lib.release(workdir))
    console.log_to_file(workdir, jax.process_index())
    if fresh and jax.process_index() == 0:
        with guard.writing():
            start_fresh(workdir)
    if jax.process_count() > 1:  # the others wait until process 0 moved old checkpoints
        multihost_utils.sync_global_devices("jrl.train: workdir ready")


def same_on_every_host(tree):
    """`tree` (host values) as process 0 holds it, on every process. Values a host computed on
    its own (the supervised warm-up) may differ in the last bits between hosts; `sharding.put`
    assumes every host passes the same values, so process 0's are sent to all."""
    if jax.process_count() == 1:
        return tree
    return multihost_utils.broadcast_one_to_all(tree)


def warm_params(run: Run, params_sh):
    """The small demo model after its supervised warm-up (run on each host, then process 0's
    result placed into `params_sh`); the warm-up's evals are greedy (`make_eval`)."""
    cfg, model_cfg, task = run.cfg, run.built.model_cfg, run.built.task
    evaluate_fn = make_eval(model_cfg, run.built.reward_fn, **run.ids)
    params = initial_params(cfg, model_cfg, run.key_init)
    t0 = time.perf_counter()
    params, steps, acc = sft.sft_warmup(cfg, model_cfg, task, params, jax.jit(evaluate_fn))
    run.say(
        f"warm-up: {steps} supervised steps in {time.perf_counter() - t0:.1f}s, greedy "
        f"train accuracy {acc:.3f} (target {cfg.warmup.target_accuracy})",
        flush=True,
    )
    return sharding.put(same_on_every_host(jax.device_get(params)), params_sh)


def open_checkpoints(cfg, workdir: str, inputs: dict, allow_changes: bool):
    """The run's Checkpointer, its saves raising workdir.WriteError (exit 4) when they fail. A
    workdir with checkpoints must hold a run of the same maths and input files (`inputs`, the
    fingerprints), unless `allow_changes`."""
    ckpt = checkpoint_lib.Checkpointer(
        workdir,
        every_steps=cfg.checkpoint.every_steps,
        max_to_keep=cfg.checkpoint.max_to_keep,
        async_save=cfg.checkpoint.async_save,
    )
    if ckpt.all_steps():  # a resume: same maths and input files as the run that saved them
        workdir_lib.check_resume(workdir, cfg, inputs, allow_changes=allow_changes)
    return workdir_lib.Guarded(ckpt, ckpt.directory, ("save", "maybe_save", "wait", "close"))


def start_or_resume(run: Run) -> tuple:
    """(state, the checkpoint's extra or None, start step): the newest valid checkpoint's state
    (the warm-up is skipped: policy, critic and reference come from it; a LoRA base from
    model.hf_path is reloaded and checked), else a fresh state at step 0 from the warmed-up or
    initial params (`run.key_init`'s), placed into the state's shardings by `run.init`."""
    cfg, mesh, state_sh = run.cfg, run.mesh, run.jitted.state_sh
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        run.jitted.abstract_state,
        state_sh,
    )
    resumed = run.ckpt.restore_latest(
        target.replace(ref_params=None) if run.base_from_hf else target
    )
    params_sh = state_sh.params  # the model's; with LoRA those of the base and the heads
    if lora_lib.lora_on(cfg):
        params_sh = lora_lib.reference_params(cfg, state_sh)
    if resumed is not None:
        state, extra, start = resumed
        if run.base_from_hf:
            state = reload_lora_base(run, state, extra, params_sh)
        run.say(f"resumed from {run.ckpt.directory} at step {start}", flush=True)
        return state, extra, start
    if cfg.warmup.sft_steps:  # the small demo model, warmed up, then placed
        params = warm_params(run, params_sh)
    else:  # straight into the shards: no host holds the whole model
        params = initial_params(cfg, run.built.model_cfg, run.key_init, mesh, params_sh)
    # the initial params are donated: the state takes their buffers, no third copy
    return sharding.sharded_init(run.init, mesh, state_sh, donate_argnums=0)(params), None, 0


def run(
    cfg, workdir: str, *, fresh: bool = False, allow_changes: bool = False, guard=None
) -> dict:
    """Trains (or resumes); returns the last step's metrics (with the final eval). `fresh`: move
    old checkpoints aside first; `allow_changes`: resume despite other config / input files.
    Raises ConfigError / CheckpointError (before anything is written), NonFiniteError,
    rewards.RewardFailed (nothing of the step it failed in is kept), workdir.WriteError, or
    checkpoint.Preempted (after saving the step it stopped at, or, when a stop abandoned a
    step's reward, with the checkpoints committed before that step).

    Signals (SIGTERM, SIGINT): `guard` is a `checkpoint.PreemptionGuard` already entered; the
    command line enters one with `at_once` before anything else: until the first step of this
    start is done a signal exits at once (status 42: nothing new to save, no file half-written),
    from then on it stops the loop after the step, which is saved. Default: one entered here
    without `at_once` (a library caller's process is never ended by it): a signal while starting
    stops the run after its first step."""
    with contextlib.ExitStack() as stack:
        if guard is None:
            guard = stack.enter_context(checkpoint_lib.PreemptionGuard())
        return _run(cfg, workdir, fresh=fresh, allow_changes=allow_changes, guard=guard)


def _run(cfg, workdir: str, *, fresh: bool, allow_changes: bool, guard) -> dict:
    """`run` inside its guard: set up, start or resume, the loop over steps, the ending."""
    run = set_up(cfg, workdir, fresh=fresh, allow_changes=allow_changes, guard=guard)
    state, resumed, start = start_or_resume(run)
    check_rewards(run.built.reward_fn)  # the warm-up's evals
    loop = open_loop(run, start, resumed=resumed is not None)
    try:
        metrics, first_accuracy = first_eval(run, loop, state, start, resumed)
        state, metrics, done = train_steps(run, loop, state, start, metrics, first_accuracy)
    except rewards.RewardFailed as e:  # nothing of this step is kept; earlier saves commit
        stop_after_reward_failure(e, run.ckpt, [loop.bar, loop.writer], run.workdir)
    finish(run, loop, state, done, first_accuracy)  # Preempted when it stopped before the end
    metrics["val/accuracy_first"] = first_accuracy
    return metrics


def set_up(cfg, workdir: str, *, fresh: bool, allow_changes: bool, guard) -> Run:
    """The `Run` of `cfg` in `workdir`, its summary printed: the config validated and the
    pieces built (ConfigError before anything is written), the workdir prepared (its lock, the
    log file, --fresh), the checkpoints opened (a resume must have the same inputs) and the step
    jitted. Failed rewards are deferred to `check_rewards`; a stop request reaches the rewards."""
    config_lib.validate(cfg)
    if "://" not in workdir:
        workdir = os.path.abspath(workdir)  # orbax needs absolute paths
    built = build(cfg)
    try:
        mesh = sharding.make_mesh(cfg.mesh.axes, cfg.mesh.shape)
    except ValueError as e:
        raise config_lib.ConfigError(str(e)) from None
    batching.micro_batch_counts(cfg, mesh)  # micro-batch sizes divide each device's rows
    rewards.defer_failures(built.reward_fn)  # a failing reward ends the step; the loop checks it
    rewards.clear_stop()
    guard.on_request.append(rewards.request_stop)  # SIGTERM: a user reward gets a grace period
    prepare_workdir(workdir, fresh=fresh, guard=guard)
    long_prompts = prompt_counts(built.task)
    if any(long_prompts.values()):
        logging.warning("prompts longer than data.max_prompt_length: %s", long_prompts)

    ids = sampling_ids(built.tokenizer, built.task, cfg)
    key_init, key_state = jax.random.split(jax.random.key(cfg.seed))
    init = lambda params: train_state.init_state(cfg, built.model_cfg, params, key_state)
    inputs = workdir_lib.fingerprints(cfg)
    ckpt = open_checkpoints(cfg, workdir, inputs, allow_changes)
    jitted = jit_step(
        cfg,
        built.model_cfg,
        built.reward_fn,
        ids,
        mesh,
        lambda: init(transformer.init_params(built.model_cfg, key_init)),
    )
    run = Run(
        cfg=cfg,
        workdir=workdir,
        guard=guard,
        built=built,
        mesh=mesh,
        ids=ids,
        key_init=key_init,
        init=init,
        inputs=inputs,
        ckpt=ckpt,
        jitted=jitted,
        long_prompts=long_prompts,
        main_process=jax.process_index() == 0,  # the one that writes metrics and config.json
        base_from_hf=checkpoint_lib.lora_base_from_hf(cfg),
        config_json=json.loads(cfg.to_json_best_effort()),
    )
    run.say("\n".join(summary(run)), flush=True)
    return run


def summary(run: Run) -> list[str]:
    """The lines a run shows before it starts (`console.run_summary`)."""
    task, abstract = run.built.task, run.jitted.abstract_state
    return console.run_summary(
        run.cfg,
        run.built.model_cfg,
        sum(x.size for x in jax.tree.leaves(abstract.params)),
        run.mesh,
        run.workdir,
        eval_prompts=len(task.eval_batch()["input_ids"]),  # what is evaluated, not task.eval_size
        prompt=first_prompt(task),
        checkpoint_bytes=checkpoint_lib.nbytes(abstract.replace(ref_params=None)),
    )


def open_loop(run: Run, start: int, *, resumed: bool) -> Loop:
    """The run's outputs once its state is there: process 0 trims metrics.jsonl to the rows
    before `start` (all of them when not `resumed`: they are redone) and writes config.json;
    then the metric writer, the progress bar and the eval, and this host's rows of a batch."""
    workdir, guard = run.workdir, run.guard
    metrics_path = os.path.join(workdir, metric_files.METRICS_FILE)
    if run.main_process:  # after a successful restore; rows past it (all, when fresh) are redone
        with workdir_lib.writing(metrics_path), guard.writing():
            metric_files.trim_metrics(workdir, start if resumed else -1)
        config_path = os.path.join(workdir, workdir_lib.CONFIG_FILE)
        with workdir_lib.writing(config_path), guard.writing():
            metric_files.write_text(config_path, workdir_lib.config_json(run.cfg, run.inputs))
    with workdir_lib.writing(metrics_path), guard.writing():
        writer = workdir_lib.Guarded(
            MetricWriter(workdir, enabled=run.main_process), metrics_path, hold=guard.writing
        )
    kl = kl_metric(run.cfg)
    bar = ProgressBar(run.cfg.total_steps, initial=start, enabled=run.main_process, kl=kl)
    evaluate = make_evaluate(run, writer, bar)
    batch_size = step_lib.prompts_per_step(run.cfg)
    rows = sharding.process_rows(run.jitted.batch_sh, batch_size)  # this host's share
    return Loop(writer=writer, bar=bar, evaluate=evaluate, batch_size=batch_size, rows=rows)


def first_eval(run: Run, loop: Loop, state, start: int, resumed: dict | None) -> tuple:
    """(the metrics the loop starts from, the first eval's val/accuracy): a fresh run evaluates
    step 0 and writes it with the prompt counts; a resumed one has the accuracy in its checkpoint
    and evaluates only when no step is left."""
    if resumed is None:
        metrics = loop.evaluate(state, 0)
        first_accuracy = metrics["val/accuracy"]
        loop.writer.write(0, {**metrics, **run.long_prompts})
        return metrics, first_accuracy
    first_accuracy = resumed["val/accuracy_first"]
    metrics = loop.evaluate(state, start) if start >= run.cfg.total_steps else {}
    return metrics, first_accuracy


def train_steps(run: Run, loop: Loop, state, start: int, metrics: dict, first_accuracy) -> tuple:
    """(state, last metrics, steps done): the RL steps from `start` to cfg.total_steps, or
    until a stop request (every process stops after the same step). Each step: its batch, the
    step, the checks (rewards, then finite values), the eval when due, its metrics row, and a
    checkpoint every checkpoint.every_steps."""
    cfg, ckpt = run.cfg, run.ckpt
    consecutive_skips, done = 0, start
    for i in range(start, cfg.total_steps):
        batch = next_batch(run, loop, i)
        state, metrics = train_step(run, state, batch)  # its rewards checked, its timings
        done = i + 1
        if done == cfg.total_steps or (cfg.eval_every and done % cfg.eval_every == 0):
            metrics.update(loop.evaluate(state, done))
        ckpt.wait()  # the last save committed before this row: a kill loses <= every_steps
        loop.writer.write(done, metrics)
        loop.bar.update(metrics)
        consecutive_skips = check_finite(cfg, {**metrics, "step": done}, consecutive_skips)
        if ckpt.maybe_save(done, saved(run, state), checkpoint_extra(run, done, first_accuracy)):
            loop.writer.flush()  # a resumed run does not redo the rows up to a checkpoint
        if run.guard.should_stop(done) and done < cfg.total_steps:  # every process, every step
            break
    return state, metrics, done


def next_batch(run: Run, loop: Loop, i: int):
    """Prompt batch `i` as one global array; this host reads only its own rows of it."""
    local = run.built.task.train_batch(i, loop.batch_size, rows=loop.rows)
    return sharding.global_batch(local, run.jitted.batch_sh, loop.batch_size)


def train_step(run: Run, state, batch) -> tuple:
    """(state, metrics as Python values): one jitted step, then its rewards checked (before
    anything of the step is written or saved) and its time measured."""
    t = time.perf_counter()
    with jax.set_mesh(run.mesh):
        state, metrics = run.jitted.step_fn(state, batch)
    metrics = to_python(jax.device_get(metrics))
    check_rewards(run.built.reward_fn)  # before anything of the step is written or saved
    run.guard.defer()  # this start has a step to save: a signal now stops after a step
    elapsed = time.perf_counter() - t
    metrics["timing_s/step"] = elapsed
    metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / elapsed
    return state, metrics


def saved(run: Run, state):
    """What a checkpoint holds of `state`: all of it, or without the LoRA base from
    model.hf_path (reloaded on resume)."""
    return state.replace(ref_params=None) if run.base_from_hf else state


def checkpoint_extra(run: Run, done: int, first_accuracy) -> dict:
    """What a checkpoint records next to the state after `done` steps."""
    base = {"lora_base": lora_lib.base_identity(run.cfg.model.hf_path)} if run.base_from_hf else {}
    return {
        "next_batch": done,  # the data position: batch i is task.train_batch(i, ...)
        "val/accuracy_first": first_accuracy,
        "config": run.config_json,
        **base,
    }


def finish(run: Run, loop: Loop, state, done: int, first_accuracy) -> None:
    """The one way out (done, or preempted after step `done`): save, close, release; raises
    checkpoint.Preempted when the run stopped before cfg.total_steps."""
    total = run.cfg.total_steps
    if run.cfg.checkpoint.at_end or done < total:  # a preempted run always saves
        extra = checkpoint_extra(run, done, first_accuracy)
        run.ckpt.save(done, saved(run, state), extra)  # no-op if already saved
    run.ckpt.close()
    loop.bar.close()
    loop.writer.close()
    workdir_lib.release(run.workdir)
    if done < total:
        raise checkpoint_lib.Preempted(done)


def stop_after_reward_failure(error, ckpt, closing, workdir: str) -> None:
    """Ends a run whose reward failed in a step: the checkpoints started before that step commit
    (nothing of the step is saved or written), `closing` are closed and the workdir released.
    Raises `error`, or `checkpoint.Preempted` when a stop request abandoned the reward."""
    ckpt.close()
    for thing in closing:
        thing.close()
    workdir_lib.release(workdir)
    if isinstance(error, rewards.RewardInterrupted):
        last = ckpt.latest_step()
        resume = f"checkpoint {last}" if last is not None else "the start"
        logging.warning("%s: the step is not saved; a rerun resumes from %s.", error, resume)
        raise checkpoint_lib.Preempted(last or 0) from None
    raise error


def first_prompt(task) -> str:
    """The task's first eval prompt as the model sees it: template, chat markup and special
    tokens included."""
    batch = task.eval_batch()
    ids, mask = batch["input_ids"][:1], batch["attention_mask"][:1]
    return task.decode_responses(ids, mask, skip_special_tokens=False)[0]


def kl_metric(cfg) -> str | None:
    """The metric of the run's KL to the reference (for the progress bar), None without one."""
    if cfg.actor.use_kl_loss:
        return "actor/kl_loss"
    if cfg.algorithm.use_kl_in_reward:
        return "actor/reward_kl_penalty"
    return None


def make_eval(
    model_cfg: transformer.ModelConfig,
    reward_fn: Callable,
    *,
    num_samples: int = 0,
    **ids,
):
    """`evaluate(params, batch) -> {"val/accuracy", "val/response_length"}` with greedy decoding;
    `ids`: `sampling_ids`' (eos_id, pad_id, max_new_tokens, stop_ids and, multi-turn, the
    `tool_host`: the reward reads the model's final turn, the length counts tool tokens, and
    "val/tool_calls" (calls per answer) and "val/tool_errors" (calls answered with an error, in
    all) come too). With
    `num_samples` > 0 also the first `num_samples` rows' answers to look at:
    "samples/response_ids" and "samples/response_mask" [num_samples, R] (the mask covering tool
    tokens too), "samples/score" [num_samples] (jrl.samples splits them off the metrics)."""

    def evaluate(params, batch: dict):
        key = jax.random.key(0)
        out, valid, scores = step_lib.sample_and_score(
            model_cfg, reward_fn, params, batch, key, greedy=True, **ids
        )
        metrics = {
            "val/accuracy": jnp.mean(scores),
            "val/response_length": jnp.mean(jnp.sum(valid, -1).astype(jnp.float32)),
        }
        if ids.get("tool_host") is not None:  # the greedy answers' calls
            calls = multi_turn_metrics(out.stats, out.assistant_turns, jnp.sum(valid, -1))
            metrics["val/tool_calls"] = calls["tool_call_counts/mean"]
            metrics["val/tool_errors"] = calls["tool_calls/errors"]
        if num_samples:
            metrics["samples/response_ids"] = out.response_ids[:num_samples]
            metrics["samples/response_mask"] = valid[:num_samples]
            metrics["samples/score"] = scores[:num_samples]
        return metrics

    return evaluate


def make_evaluate(run: Run, writer, bar):
    """`evaluate(state, step) -> metrics`: greedy accuracy on the task's eval batch; also writes
    the eval's sample answers (`writer`) and shows the first (`bar`)."""
    cfg, mesh, task, reward_fn = run.cfg, run.mesh, run.built.task, run.built.reward_fn
    model_cfg, ids, state_sh = run.built.model_cfg, run.ids, run.jitted.state_sh
    num_samples = min(cfg.eval_samples, len(task.eval_batch()["input_ids"]))
    eval_samples_fn = make_eval(model_cfg, reward_fn, **ids, num_samples=num_samples)
    replicated = NamedSharding(mesh, PartitionSpec())
    eval_fn = jax.jit(
        lambda state, batch: eval_samples_fn(lora_lib.policy_params(cfg, state), batch),
        in_shardings=(state_sh, replicated),
        out_shardings=replicated,
    )
    eval_batch = sharding.put(task.eval_batch(), replicated)

    def evaluate(state, step):
        with jax.set_mesh(mesh):  # traced under the mesh: the KV cache is pinned to it
            metrics, found = samples_lib.split(to_python(eval_fn(state, eval_batch)))
        check_rewards(reward_fn)
        rows = samples_lib.rows(task, task.eval_batch(), found) if jax.process_index() == 0 else []
        writer.write_samples(step, rows, samples_lib.markdown(rows))
        tools = ""
        if "val/tool_calls" in metrics:
            tools = (
                f" (tool calls per answer {metrics['val/tool_calls']:.2f}, "
                f"errors {metrics['val/tool_errors']:.0f})"
            )
        bar.write(f"step {step}: val/accuracy {metrics['val/accuracy']:.3f}{tools}")
        for line in samples_lib.lines(rows[:1]):
            bar.write(f"  e.g. {line}")
        return metrics

    return evaluate


def start_fresh(workdir: str) -> None:
    """--fresh: move existing checkpoints/, reference/, metrics.jsonl and samples.jsonl aside
    (nothing saved is deleted)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in (
        checkpoint_lib.CHECKPOINTS_DIR,
        checkpoint_lib.REFERENCE_DIR,
        *metric_files.JSONL_FILES,
    ):
        old = epath.Path(workdir) / name
        if old.exists():
            old.rename(old.parent / f"{name}.{stamp}")
