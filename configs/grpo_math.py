"""GRPO on math. The default trains the built-in character-level model on built-in arithmetic.

Run:
  python -m jrl.train --config=configs/grpo_math.py --workdir=/tmp/jrl/grpo_math
Overrides and presets:
  python -m jrl.train --config=configs/grpo_math.py --config.rollout.n=16 --config.total_steps=50
  python -m jrl.train --config=configs/grpo_math.py:tiny     # seconds-long smoke run (tests)
  python -m jrl.train --config=configs/grpo_math.py:drgrpo   # Dr.GRPO (no std normalisation)
Real models and data (local paths; nothing is downloaded):
  python -m jrl.train --config=configs/grpo_math.py:model=qwen2.5-0.5b,data=gsm8k \
    --config.model.hf_path=/models/Qwen2.5-0.5B-Instruct \
    --config.task.train_files=/data/gsm8k/train.parquet \
    --config.task.eval_files=/data/gsm8k/test.parquet --workdir=/tmp/jrl/qwen05_gsm8k
  python -m jrl.train --config=configs/grpo_math.py:model=qwen2.5-1.5b,data=math \
    --config.model.hf_path=/models/Qwen2.5-1.5B-Instruct \
    --config.task.train_files=/data/math/train.jsonl --config.task.eval_files=/data/math/test.jsonl

Fields are documented in jrl/config.py; here only what differs from its defaults.
"""

from jrl import config as config_lib


def get_config(arg: str | None = None):
    c = config_lib.base_config()
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

    for preset in filter(None, (arg or "").split(",")):
        if preset in PRESETS:
            PRESETS[preset](c)
        else:
            raise config_lib.ConfigError(
                f"unknown preset '{preset}' in configs/grpo_math.py:{arg}; valid presets: "
                f"{', '.join(PRESETS)}."
            )
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
    """A real Qwen2.5 policy from a local HF directory (--config.model.hf_path=DIR, required):
    its own tokenizer, bfloat16 compute over float32 master weights, no warm-up, a KL loss to the
    reference as in verl's GSM8K GRPO example, a learning rate for a pretrained model."""
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


def _qwen05(c):  # Qwen2.5-0.5B(-Instruct) on one GPU / a v4-8: 64 prompts x 8 samples per step
    _hf_model(c, batch_size=64, mini_batch_size=16)


def _qwen15(c):  # Qwen2.5-1.5B(-Instruct): 32 prompts x 8 samples per step
    _hf_model(c, batch_size=32, mini_batch_size=8)


def _gsm8k(c):  # GSM8K from local files (--config.task.train_files=..., eval_files=...)
    c.task.name = "gsm8k"
    c.task.reward = "gsm8k"  # the number after "####" (else the last number), compared exactly
    c.task.eval_size = 256  # eval rows (of the eval file)
    c.data.max_prompt_length = 256  # P: GSM8K questions fit in 256 tokens
    c.data.max_response_length = 512  # R: room for the reasoning


def _math(c):  # MATH from local files (--config.task.train_files=..., eval_files=...)
    c.task.name = "math"
    c.task.reward = "math"  # last \boxed{...}, checked by math-verify or sympy
    c.task.eval_size = 256  # eval rows (of the eval file)
    c.data.max_prompt_length = 512  # P
    c.data.max_response_length = 1024  # R


PRESETS = {
    "tiny": _tiny,
    "drgrpo": _drgrpo,
    "model=qwen2.5-0.5b": _qwen05,
    "model=qwen2.5-1.5b": _qwen15,
    "data=gsm8k": _gsm8k,
    "data=math": _math,
}
