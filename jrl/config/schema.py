"""The config schema: every field a run reads, with its default and a comment.

`base_config()` holds every field a run reads, each with a comment (on the line above when it does
not fit beside the field), built section by section by the functions below it (one a section, in
the order of the fields in config.json); the files in `configs/` start from it and change what
their algorithm needs, with the bases and presets they share in `configs/common.py` (`math_base`,
`ppo_math_base`, `PRESETS`), which they read by path (`load_file`). Field names follow verl's
(`data.train_batch_size`, `rollout.n`, `actor.clip_ratio_high`, `algorithm.adv_estimator`, ...).
Also here: `flat_keys` (every field as a dotted path) and what a resume may change
(`RESUME_SAFE_SECTIONS`, `RESUME_SAFE_FIELDS`, `resume_safe_fields`).
"""

from __future__ import annotations

import fnmatch
import functools

import ml_collections
from ml_collections import config_dict


def base_config() -> ml_collections.ConfigDict:
    """Every field a run reads, with its default: the sections below, in this order."""
    c = ml_collections.ConfigDict()
    for add_section in (
        _run,
        _model,
        _task,
        _data,
        _rollout,
        _multi_turn,
        _actor,
        _algorithm,
        _rollout_correction,
        _group_params,
        _filter_groups,
        _critic,
        _reward,
        _nan_guard,
        _mesh,
        _checkpoint,
        _lora,
        _warmup,
    ):
        add_section(c)
    return c


def _run(c: ml_collections.ConfigDict) -> None:
    """The top-level fields: the seed, the run's length and its evals."""
    c.seed = 0  # PRNG seed: initialisation, sampling, minibatch shuffling, data order
    c.total_steps = 100  # RL steps to run
    # greedy eval every K steps (and always at the start and the end); 0: only those
    c.eval_every = 25
    # greedy eval answers kept per eval, at most the eval set (samples.jsonl, tensorboard text)
    c.eval_samples = 4


def _model(c: ml_collections.ConfigDict) -> None:
    """model.* (the policy's shape, dtypes and memory layout) and the tokenizer."""
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
    # Rollout (prefill, decode) and grouped forwards as one scan over the layers and a stacked KV
    # cache: one layer to compile instead of each (deep models); off: layer by layer (faster on CPU)
    c.model.scan_cached_layers = False
    # Forward a group's prompt once for its n responses in the scoring forwards, and in the update
    # when it has one mini-batch per epoch; where rows are short (attention "xla"), no remat
    # (jrl.batching.prompt_groups):
    c.model.shared_prompt_forward = True
    # Static response lengths below R (e.g. (R // 4, R // 2)) that the scoring and update forwards
    # trim to: rows are ordered by response length into micro-batches, and each micro-batch runs
    # at the smallest length holding its longest response (jrl/buckets.py). Off (()) until
    # measured to pay; each length compiles those forwards once more.
    c.model.response_buckets = ()

    # "char": built-in character tokenizer; a local HF tokenizer dir; "": model.hf_path
    c.tokenizer = "char"


def _task(c: ml_collections.ConfigDict) -> None:
    """task.*: the task, its reward and, for file-based tasks, its files and prompts."""
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


def _data(c: ml_collections.ConfigDict) -> None:
    """data.*: prompts per step and the prompt and response lengths."""
    c.data = ml_collections.ConfigDict()
    c.data.train_batch_size = 32  # prompts per RL step (B_p); rows per step = B_p * rollout.n
    c.data.max_prompt_length = 0  # P, left-padded; 0: the task's own prompt length
    c.data.max_response_length = 0  # R, new tokens per response; 0: the task's answer length


def _rollout(c: ml_collections.ConfigDict) -> None:
    """rollout.*: sampling, stop tokens and the decode's stages."""
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


def _multi_turn(c: ml_collections.ConfigDict) -> None:
    """rollout.multi_turn.*: multi-turn tool use (off by default)."""
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


def _actor(c: ml_collections.ConfigDict) -> None:
    """actor.*: the policy's optimizer, mini-batches and loss."""
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
    # Mixture-of-experts policies (Qwen3-MoE, Mixtral; docs/algorithms.md#routing-replay).
    # Weight of the router's load-balancing loss (Hugging Face's router_aux_loss_coef x its
    # load_balancing_loss_func, summed over the sparse layers) added to the actor loss; 0: none,
    # as verl adds none by default (the checkpoint's router_aux_loss_coef is not read: set
    # it here, e.g. 0.001 for Qwen3-MoE's, to train with it)
    c.actor.router_aux_loss_coef = 0.0
    # Routing replay (verl's actor_rollout_ref.actor.{megatron,veomni}.router_replay.mode):
    c.actor.router_replay = ml_collections.ConfigDict()
    # disabled | R2 (the update replays the old-log-prob forward's experts) | R3 (the old and
    # update forwards replay the experts the rollout chose; verl also needs
    # rollout.enable_rollout_routing_replay, which jrl implies)
    c.actor.router_replay.mode = "disabled"


def _algorithm(c: ml_collections.ConfigDict) -> None:
    """algorithm.*: the advantage estimator and the KL in the reward."""
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


def _rollout_correction(c: ml_collections.ConfigDict) -> None:
    """algorithm.rollout_correction.*: IS weights and rejection (off by default)."""
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


def _group_params(c: ml_collections.ConfigDict) -> None:
    """algorithm.group_params.*: GROUP-PPO's segments and threshold."""
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


def _filter_groups(c: ml_collections.ConfigDict) -> None:
    """algorithm.filter_groups.*: DAPO's dynamic sampling (off by default)."""
    c.algorithm.filter_groups = ml_collections.ConfigDict()
    # DAPO dynamic sampling: drop groups whose scores all agree
    c.algorithm.filter_groups.enable = False
    # what must differ within a group: acc (task reward) | score (acc + overlong)
    c.algorithm.filter_groups.metric = "acc"
    # generation rounds (of fresh prompts) per step
    c.algorithm.filter_groups.max_num_gen_batches = 4


def _critic(c: ml_collections.ConfigDict) -> None:
    """critic.*: the value model of the estimators that train one, and its optimizer."""
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


def _reward(c: ml_collections.ConfigDict) -> None:
    """reward.*: user reward functions' time limit and DAPO's overlong buffer."""
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


def _nan_guard(c: ml_collections.ConfigDict) -> None:
    """nan_guard.*: skipping steps that are not finite."""
    c.nan_guard = ml_collections.ConfigDict()
    # skip (do not apply) a step whose reward, loss or gradients are not finite
    c.nan_guard.enable = True
    c.nan_guard.max_consecutive = 3  # stop the run after this many skipped steps in a row


def _mesh(c: ml_collections.ConfigDict) -> None:
    """mesh.*: the device mesh."""
    c.mesh = ml_collections.ConfigDict()
    # mesh axis names (jrl.sharding.DEFAULT_RULES map logical axes onto them)
    c.mesh.axes = ("data", "fsdp", "tensor")
    c.mesh.shape = (-1, 1, 1)  # devices per mesh axis; -1: all the devices the other axes leave


def _checkpoint(c: ml_collections.ConfigDict) -> None:
    """checkpoint.*: when checkpoints are written and how many are kept."""
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 50  # save every K RL steps; 0: none (but at_end / preemption)
    # save at the end of the run; False: only the periodic ones (with every_steps=0 the run then
    # writes none, and cannot be resumed, evaluated or exported); a preemption always saves
    c.checkpoint.at_end = True
    c.checkpoint.max_to_keep = 3  # newest checkpoints kept under <workdir>/checkpoints; 0: keep all
    c.checkpoint.async_save = True  # write checkpoints in the background while training goes on


def _lora(c: ml_collections.ConfigDict) -> None:
    """lora.*: low-rank adapters (off by default)."""
    c.lora = ml_collections.ConfigDict()  # low-rank adapters on a frozen base (jrl/models/lora.py)
    c.lora.rank = 0  # adapter rank r; 0: off, every parameter trains
    c.lora.alpha = 32.0  # adapters add (alpha / r) x A B (PEFT's lora_alpha)
    c.lora.target_modules = (  # adapted projections of every block (Hugging Face names)
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    )
    c.lora.dropout = 0.0  # dropout probability on the adapters' input in the update (PEFT's)


def _warmup(c: ml_collections.ConfigDict) -> None:
    """warmup.*: the supervised warm-up before RL (off by default)."""
    c.warmup = ml_collections.ConfigDict()
    # at most this many supervised steps on the task's answers before RL; 0: none
    c.warmup.sft_steps = 0
    # stop the warm-up once greedy accuracy on train problems reaches this
    c.warmup.target_accuracy = 1.0
    c.warmup.check_every = 25  # warm-up steps between accuracy checks
    c.warmup.sft_lr = 3e-3  # Adam learning rate of the warm-up
    c.warmup.sft_batch_size = 64  # problems per warm-up step


def flat_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Every leaf field as a dotted path ("rollout.n", "algorithm.kl_ctrl.type", ...)."""
    keys = []
    for k, v in cfg.items():
        if isinstance(v, ml_collections.ConfigDict):
            keys += flat_keys(v, f"{prefix}{k}.")
        else:
            keys.append(f"{prefix}{k}")
    return keys


def _field(cfg: ml_collections.ConfigDict, path: str):
    """The value of the dotted field `path` ("a.b.c") of cfg."""
    for key in path.split("."):
        cfg = cfg[key]
    return cfg


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
    "model.scan_cached_layers",
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
