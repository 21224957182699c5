"""The trainer: python -m jrl.train --config=configs/grpo_math.py [--config.a.b=v] [--workdir=DIR]

Read top to bottom: validate the config, build the tokenizer, task, reward and model, resume from
the workdir's newest valid checkpoint or warm up (optional supervised steps), then loop over RL
steps. Each RL step is one jitted call of the fused step (jrl/step.py); the host only feeds prompt
batches, writes metrics and saves checkpoints.

Multi-host (TPU pods, multi-node GPU): every process runs the same command with `--distributed`
(JAX reads coordinator, process count and id from the environment: Cloud TPU, SLURM, Open MPI,
JAX_COORDINATOR_ADDRESS) or with `--coordinator_address/--num_processes/--process_id`; the
workdir must be shared (gs:// or a shared filesystem). Each process feeds only the prompt rows
its devices hold; process 0 writes metrics, tensorboard and config.json; all save checkpoints.

Exit status: 0 done; 2 bad config or arguments (nothing written); 42 preempted (SIGTERM / SIGINT /
TPU preemption notice: the step finished and a checkpoint was written; rerun with the same
--workdir to continue); 43 a second signal stopped it at once (rerun resumes from the last
committed checkpoint); 3 stopped by the NaN guard (nan_guard.max_consecutive non-finite steps in
a row, or one with the guard off; the message names the quantity); 2 also when another live
run holds --workdir or a resume finds other config fields or input files (jrl/workdir.py); 4 a
write to the workdir failed (a full disk: the message names the path; rerun to resume).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import os
import sys
import time

from absl import app, flags, logging
from etils import epath
import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import config_flags

from jrl import checkpoint as checkpoint_lib
from jrl import console
from jrl import samples as samples_lib
from jrl import config as config_lib
from jrl import data, models, rewards, sharding, step as step_lib, tokenizer as tokenizer_lib
from jrl import logging as metric_files
from jrl import workdir as workdir_lib
from jrl.logging import MetricWriter, ProgressBar, to_python
from jrl.models import lora as lora_lib
from jrl.models import transformer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/*.py[:preset]).", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Output directory (checkpoints, metrics.jsonl, tensorboard events, config.json); a workdir "
    "with checkpoints resumes from the newest valid one. Default: runs/<config name>/<time>.",
)
_FRESH = flags.DEFINE_bool(
    "fresh",
    False,
    "Start from scratch even if --workdir has checkpoints (they are moved aside to "
    "checkpoints.<time>, not deleted).",
)
_ALLOW_CHANGES = flags.DEFINE_bool(
    "allow_changes",
    False,
    "Resume even if config fields that change the maths or the input files differ from the "
    "run's config.json (jrl/workdir.py lists the fields that may always change).",
)
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed",
    False,
    "Multi-host run: call jax.distributed.initialize() first; with no coordinator flags JAX reads "
    "them from the environment (Cloud TPU pods, SLURM, Open MPI, JAX_COORDINATOR_ADDRESS).",
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (implies --distributed)."
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes (implies --distributed)."
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's id, 0 .. num_processes - 1 (implies --distributed)."
)


def init_distributed() -> None:
    """jax.distributed.initialize() for --distributed / the coordinator flags; before anything
    touches a device. A single-process run skips it."""
    given = {
        "coordinator_address": _COORDINATOR.value,
        "num_processes": _NUM_PROCESSES.value,
        "process_id": _PROCESS_ID.value,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not (_DISTRIBUTED.value or given):
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
    frozen = {"param_dtype": cfg.model.dtype} if step_lib.lora_on(cfg) else {}
    if cfg.model.hf_path:  # the checkpoint's architecture, computed as model.* says
        hf_cfg = models.hf.load_config(cfg.model.hf_path, dtype=cfg.model.param_dtype)
        return dataclasses.replace(
            hf_cfg, **{k: cfg.model[k] for k in transformer.COMPUTE_FIELDS}, **frozen
        )
    fields = {k: v for k, v in cfg.model.items() if k not in ("hf_path", "vocab_size")}
    fields["head_dim"] = fields["head_dim"] or None
    vocab_size = cfg.model.get("vocab_size") or vocab_size  # 0: the tokenizer's size
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


def sampling_ids(tok, task) -> dict:
    """The token ids and response length that make_step / make_phases / make_eval take."""
    return {
        "eos_id": tok.eos_token_id,
        "pad_id": tok.pad_token_id,
        "max_new_tokens": task.max_response_length,
    }


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


def reward_options(cfg) -> dict:
    """Keyword options of the Python rewards (jrl.rewards.get_reward)."""
    t = cfg.task
    return {
        "gsm8k": dict(fallback=t.gsm8k_fallback, format_score=t.format_score),
        "math": dict(
            format_score=t.format_score,
            backend=t.math_backend,
            timeout_s=t.math_timeout_s,
            num_workers=t.math_workers,
        ),
    }.get(t.reward, {})


def build(cfg):
    """Tokenizer, task, reward function and the policy's model config of a run. Bad input (a
    missing data file or field, an unreadable tokenizer or checkpoint config) raises ConfigError
    with the loader's one-line message, before anything compiles."""
    try:
        return _build(cfg)
    except (ValueError, OSError) as e:
        if isinstance(e, config_lib.ConfigError):
            raise
        raise config_lib.ConfigError(str(e).splitlines()[0] if str(e) else repr(e)) from e


def _build(cfg):
    tok = tokenizer_lib.get_tokenizer(cfg.tokenizer or cfg.model.hf_path)
    t = cfg.task
    common = dict(
        seed=cfg.seed,
        eval_size=t.eval_size,
        max_prompt_length=cfg.data.max_prompt_length or None,
        max_response_length=cfg.data.max_response_length or None,
    )
    if t.name == "arithmetic":
        task = data.make_task(t.name, tok, num_digits=t.num_digits, ops=tuple(t.ops), **common)
    else:
        given = dict(
            question_field=t.question_field, answer_field=t.answer_field, template=t.template
        )
        task = data.make_task(
            t.name,
            tok,
            train_files=t.train_files,
            eval_files=t.eval_files,
            prompt_format=t.prompt_format,
            system_prompt=t.system_prompt or None,
            overlong_prompts=t.overlong_prompts,
            **common,
            **{k: v for k, v in given.items() if v},
        )
    reward_fn = rewards.get_reward(t.reward, task, tok, **reward_options(cfg))
    policy_cfg, _ = step_lib.model_configs(cfg, model_config(cfg, len(tok)))
    if len(tok) > policy_cfg.vocab_size:
        raise config_lib.ConfigError(
            f"the tokenizer has {len(tok)} tokens but the model's vocabulary has "
            f"{policy_cfg.vocab_size}; use the model's own tokenizer (--config.tokenizer='') or a "
            f"model with a vocabulary of at least {len(tok)}."
        )
    return tok, task, reward_fn, policy_cfg


def jit_step(cfg, model_cfg, reward_fn, ids: dict, mesh, init_state):
    """The fused step jitted over `mesh` (state donated) and the abstract train state of
    `init_state()` with its shardings: (step_fn, abstract_state, state_shardings, batch_sharding).
    Nothing is allocated; the trainer and `python -m jrl.bench --memory` compile the same step."""
    abstract = jax.eval_shape(init_state)
    critic_cfg = step_lib.model_configs(cfg, model_cfg)[1]
    axes = step_lib.state_axes(
        cfg,
        abstract,
        transformer.logical_axes(model_cfg),
        None if critic_cfg is None else transformer.logical_axes(critic_cfg),
    )
    state_sh = sharding.state_shardings(mesh, abstract, **axes)
    batch_sh = sharding.batch_sharding(mesh, step_lib.prompts_per_step(cfg))
    step_fn = jax.jit(
        step_lib.make_step(cfg, model_cfg, reward_fn, **ids, mesh=mesh),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
    )
    return step_fn, abstract, state_sh, batch_sh


# ---------------------------------------------------------------------------------------------
# LoRA on a Hugging Face checkpoint: the frozen base is not saved with the run; checkpoints hold
# the trainable state and the base's identity, and a resume reloads the base from model.hf_path.


def lora_base_from_hf(cfg) -> bool:
    return step_lib.lora_on(cfg) and bool(cfg.model.hf_path)


def reload_lora_base(cfg, model_cfg, state, extra, key, mesh, params_sh):
    """`state` with its frozen base loaded from model.hf_path; CheckpointError (one line) when
    that is not the base the checkpoint was trained on."""
    message = lora_lib.check_base(extra.get("lora_base") or {}, cfg.model.hf_path)
    if message:
        raise checkpoint_lib.CheckpointError(message)
    base, _ = lora_lib.split(initial_params(cfg, model_cfg, key, mesh, params_sh))
    return state.replace(ref_params=base)


# ---------------------------------------------------------------------------------------------


def sft_warmup(cfg, model_cfg, task, params, accuracy_fn):
    """Supervised steps on the task's reference answers until the greedy accuracy on a fixed batch
    of train problems reaches `warmup.target_accuracy` or `warmup.sft_steps` steps are done.
    Accuracy is checked every `warmup.check_every` steps and, once it is past half the target,
    after every step: the warm-up stops at the first step at or above the target (the accuracy
    moves by up to 0.1 in one step), not at a later check that overshot it. Stopping at an
    accuracy, not a step count, leaves RL a policy that is partly right whatever the seed or
    machine. Returns (params, steps, accuracy)."""
    tx, sft_step = step_lib.make_sft_step(cfg, model_cfg)
    sft_step = jax.jit(sft_step, donate_argnums=(0, 1))
    opt_state = tx.init(params)
    probe = task.train_batch(0, 256, stream=2)  # fixed train problems for the stopping test
    accuracy, steps = float(accuracy_fn(params, probe)["val/accuracy"]), 0
    while steps < cfg.warmup.sft_steps and accuracy < cfg.warmup.target_accuracy:
        batch = task.train_batch(
            steps, cfg.warmup.sft_batch_size, stream=1
        )  # not the RL steps' data
        params, opt_state, _ = sft_step(params, opt_state, batch)
        steps += 1
        near = accuracy >= cfg.warmup.target_accuracy / 2  # then check after every step
        if near or steps % cfg.warmup.check_every == 0 or steps == cfg.warmup.sft_steps:
            accuracy = float(accuracy_fn(params, probe)["val/accuracy"])
    return params, steps, accuracy


class NonFiniteError(RuntimeError):
    """The run stopped because steps kept producing non-finite values."""


def check_finite(cfg, metrics: dict, consecutive: int) -> int:
    """Counts consecutive skipped steps; raises NonFiniteError naming the first bad quantity when
    the guard is off or `nan_guard.max_consecutive` steps in a row were skipped."""
    if not metrics["training/step_skipped"]:
        return 0
    bad = [k for k in step_lib.GUARDED_METRICS if metrics.get(f"training/finite/{k}") == 0]
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


def run(cfg, workdir: str, *, fresh: bool = False, allow_changes: bool = False) -> dict:
    """Trains (or resumes); returns the last step's metrics (with the final eval). `fresh`: move
    old checkpoints aside first; `allow_changes`: resume despite other config / input files."""
    config_lib.validate(cfg)
    if "://" not in workdir:
        workdir = os.path.abspath(workdir)  # orbax needs absolute paths
    tok, task, reward_fn, model_cfg = build(cfg)
    try:
        mesh = sharding.make_mesh(cfg.mesh.axes, cfg.mesh.shape)
    except ValueError as e:
        raise config_lib.ConfigError(str(e)) from None
    step_lib.micro_batch_counts(cfg, mesh)  # micro-batch sizes divide each device's rows
    check_writable(workdir)
    workdir_lib.acquire(workdir)  # InUseError (exit 2) while another run holds it
    console.log_to_file(workdir, jax.process_index())  # INFO logs: workdir/train.log
    main_process = jax.process_index() == 0  # the one that writes metrics and config.json
    say = print if main_process else lambda *_, **__: None  # the few lines a run shows
    if fresh and main_process:  # only once the lock is ours: --fresh never breaks a live run
        start_fresh(workdir)
    if jax.process_count() > 1:  # the others wait until process 0 moved old checkpoints
        multihost_utils.sync_global_devices("jrl.train: workdir ready")
    long_prompts = prompt_counts(task)
    if any(long_prompts.values()):
        logging.warning("prompts longer than data.max_prompt_length: %s", long_prompts)

    ids = sampling_ids(tok, task)
    evaluate_fn = step_lib.make_eval(model_cfg, reward_fn, **ids)
    num_samples = min(cfg.eval_samples, len(task.eval_batch()["input_ids"]))
    eval_samples_fn = step_lib.make_eval(model_cfg, reward_fn, **ids, num_samples=num_samples)
    key_init, key_state = jax.random.split(jax.random.key(cfg.seed))
    init = lambda params: step_lib.init_state(cfg, model_cfg, params, key_state)
    ckpt = checkpoint_lib.Checkpointer(
        workdir,
        every_steps=cfg.checkpoint.every_steps,
        max_to_keep=cfg.checkpoint.max_to_keep,
        async_save=cfg.checkpoint.async_save,
    )
    inputs = workdir_lib.fingerprints(cfg)
    if ckpt.all_steps():  # a resume: same maths and input files as the run that saved them
        workdir_lib.check_resume(workdir, cfg, inputs, allow_changes=allow_changes)
    saving = ("save", "maybe_save", "wait", "close")  # a failed save: WriteError, exit 4
    ckpt = workdir_lib.Guarded(ckpt, ckpt.directory, saving)
    step_fn, abstract, state_sh, batch_sh = jit_step(
        cfg, model_cfg, reward_fn, ids, mesh, lambda: init(transformer.init_params(model_cfg, key_init))
    )
    num_params = sum(x.size for x in jax.tree.leaves(abstract.params))
    say("\n".join(console.run_summary(cfg, model_cfg, num_params, mesh, workdir)), flush=True)
    batch_size = step_lib.prompts_per_step(cfg)
    replicated = NamedSharding(mesh, PartitionSpec())
    my_rows = sharding.process_rows(batch_sh, batch_size)  # this host's share of each batch
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh
    )
    base_from_hf = lora_base_from_hf(cfg)
    resumed = ckpt.restore_latest(target.replace(ref_params=None) if base_from_hf else target)
    params_sh = state_sh.params  # the model's; with LoRA those of the base and the heads
    if step_lib.lora_on(cfg):
        params_sh = step_lib.reference_params(cfg, state_sh)
    if resumed is None:
        if cfg.warmup.sft_steps:  # the small demo model, warmed up on each host, then placed
            params = initial_params(cfg, model_cfg, key_init)
            t0 = time.perf_counter()
            params, steps, acc = sft_warmup(cfg, model_cfg, task, params, jax.jit(evaluate_fn))
            say(
                f"warm-up: {steps} supervised steps in {time.perf_counter() - t0:.1f}s, greedy "
                f"train accuracy {acc:.3f} (target {cfg.warmup.target_accuracy})",
                flush=True,
            )
            params = sharding.put(jax.device_get(params), params_sh)
        else:  # straight into the shards: no host holds the whole model
            params = initial_params(cfg, model_cfg, key_init, mesh, params_sh)
        state, start = sharding.sharded_init(init, mesh, state_sh)(params), 0
    else:  # the warm-up is skipped: policy, critic and reference come from the checkpoint
        state, extra, start = resumed
        if base_from_hf:
            state = reload_lora_base(cfg, model_cfg, state, extra, key_init, mesh, params_sh)
        say(f"resumed from {ckpt.directory} at step {start}", flush=True)
    metrics_path = os.path.join(workdir, metric_files.METRICS_FILE)
    if main_process:  # after a successful restore; rows past it (all, when fresh) are redone
        with workdir_lib.writing(metrics_path):
            metric_files.trim_metrics(workdir, start if resumed else -1)
        config_path = os.path.join(workdir, workdir_lib.CONFIG_FILE)
        with workdir_lib.writing(config_path):
            metric_files.write_text(config_path, workdir_lib.config_json(cfg, inputs))
    eval_fn = jax.jit(
        lambda state, batch: eval_samples_fn(step_lib.policy_params(cfg, state), batch),
        in_shardings=(state_sh, replicated),
        out_shardings=replicated,
    )
    eval_batch = sharding.put(task.eval_batch(), replicated)

    def evaluate(state, step):  # also writes the eval's sample answers and shows the first
        with jax.set_mesh(mesh):  # traced under the mesh: the KV cache is pinned to it
            metrics, found = samples_lib.split(to_python(eval_fn(state, eval_batch)))
        rows = samples_lib.rows(task, task.eval_batch(), found) if main_process else []
        writer.write_samples(step, rows, samples_lib.markdown(rows))
        bar.write(f"step {step}: val/accuracy {metrics['val/accuracy']:.3f}")
        for line in samples_lib.lines(rows[:1]):
            bar.write(f"  e.g. {line}")
        return metrics

    with workdir_lib.writing(metrics_path):
        writer = workdir_lib.Guarded(MetricWriter(workdir, enabled=main_process), metrics_path)
    bar = ProgressBar(cfg.total_steps, initial=start, enabled=main_process)
    if resumed is None:
        metrics = evaluate(state, 0)
        first_accuracy = metrics["val/accuracy"]
        writer.write(0, {**metrics, **long_prompts})
    else:
        first_accuracy = extra["val/accuracy_first"]
        metrics = evaluate(state, start) if start >= cfg.total_steps else {}
    config_json = json.loads(cfg.to_json_best_effort())
    extra = lambda done: {
        "next_batch": done,  # the data position: batch i is task.train_batch(i, ...)
        "val/accuracy_first": first_accuracy,
        "config": config_json,
        **({"lora_base": lora_lib.base_identity(cfg.model.hf_path)} if base_from_hf else {}),
    }
    saved = lambda state: state.replace(ref_params=None) if base_from_hf else state
    consecutive_skips = 0
    with checkpoint_lib.PreemptionGuard() as guard:
        for i in range(start, cfg.total_steps):
            local = task.train_batch(i, batch_size, rows=my_rows)  # only this host's rows
            batch = sharding.global_batch(local, batch_sh, batch_size)
            t = time.perf_counter()
            with jax.set_mesh(mesh):
                state, metrics = step_fn(state, batch)
            metrics = to_python(jax.device_get(metrics))
            elapsed = time.perf_counter() - t
            metrics["timing_s/step"] = elapsed
            metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / elapsed
            done = i + 1
            if done == cfg.total_steps or (cfg.eval_every and done % cfg.eval_every == 0):
                metrics.update(evaluate(state, done))
            ckpt.wait()  # the last save committed before this row: a kill loses <= every_steps
            writer.write(done, metrics)
            bar.update(metrics)
            consecutive_skips = check_finite(cfg, {**metrics, "step": done}, consecutive_skips)
            if ckpt.maybe_save(done, saved(state), extra(done)):
                writer.flush()  # a resumed run does not redo the rows up to a checkpoint
            if guard.should_stop(done) and done < cfg.total_steps:  # every process, every step
                ckpt.save(done, saved(state), extra(done))
                ckpt.close()
                bar.close()
                writer.close()
                raise checkpoint_lib.Preempted(done)
    ckpt.save(cfg.total_steps, saved(state), extra(cfg.total_steps))  # no-op if already saved
    ckpt.close()
    bar.close()
    writer.close()
    workdir_lib.release(workdir)
    metrics["val/accuracy_first"] = first_accuracy
    return metrics


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


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    console.quiet_console(verbosity_given=flags.FLAGS["verbosity"].present)
    cfg = _CONFIG.value
    if cfg is None:
        sys.exit("error: --config is required, e.g. --config=configs/grpo_math.py")
    init_distributed()
    if jax.process_count() > 1 and not _WORKDIR.value:
        print(
            "error: a multi-process run needs --workdir, shared by all processes "
            "(gs://bucket/run or a shared filesystem).",
            file=sys.stderr,
        )
        sys.exit(2)
    workdir = _WORKDIR.value or os.path.join(
        "runs",
        os.path.splitext(os.path.basename(config_flags.get_config_filename(flags.FLAGS["config"])))[
            0
        ],
        time.strftime("%Y%m%d-%H%M%S"),
    )
    failure = None
    try:
        config_lib.validate(cfg)
        # raises ConfigError only before anything is written
        final = run(cfg, workdir, fresh=_FRESH.value, allow_changes=_ALLOW_CHANGES.value)
    except (config_lib.ConfigError, checkpoint_lib.CheckpointError) as e:
        failure = (2, str(e))
    except workdir_lib.WriteError as e:
        failure = (workdir_lib.WRITE_ERROR_EXIT_CODE, str(e))
    except NonFiniteError as e:
        failure = (3, str(e))
    if failure and failure[0] == workdir_lib.WRITE_ERROR_EXIT_CODE:
        # Failing background writers (orbax) keep printing tracebacks until the process ends:
        # silence them, then print the error line last and leave at once.
        gc.collect()  # the run's frames go: the progress bar draws itself last
        sys.stdout.flush()
        sys.stderr.flush()
        console_fd = os.dup(2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        workdir_lib.release(workdir)
        # on a line of its own: a writer may have left a partial line
        os.write(console_fd, f"\nerror: {failure[1]}\n".encode())
        os._exit(failure[0])
    if failure:  # printed once the run's frames are gone (a progress bar draws itself last)
        gc.collect()
        print(f"error: {failure[1]}", file=sys.stderr)
        sys.exit(failure[0])
    print(
        json.dumps(
            {
                "workdir": workdir,
                "val/accuracy_first": final["val/accuracy_first"],
                "val/accuracy": final["val/accuracy"],
            }
        )
    )


def _load_config_file(spec: str):
    """The ConfigDict of `--config=path.py[:arg]` (to explain a bad override)."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_jrl_config", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # config_lib.config_file_error finds its PRESETS
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)


def parse_flags(argv):
    """absl flag parsing, with a one-line error (exit 2) for an override of an unknown field or a
    config file that raises (the reason, not absl's 'Error whilst parsing config file')."""
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError) as e:
        spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
        message = None
        if spec:
            try:
                message = config_lib.unknown_override(_load_config_file(spec), argv)
            except Exception as file_error:  # a bad preset, or an error inside the config file
                message = config_lib.config_file_error(spec, file_error)
        print(f"error: {message or str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
