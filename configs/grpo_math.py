"""GRPO on math. The default trains the built-in character-level model on built-in arithmetic.

Run:
  python -m jrl.train --config=configs/grpo_math.py --workdir=/tmp/jrl/grpo_math
Overrides and presets (comma-separated after ':'; mesh= presets apply last):
  python -m jrl.train --config=configs/grpo_math.py --config.rollout.n=16 --config.total_steps=50
  python -m jrl.train --config=configs/grpo_math.py:tiny     # seconds-long smoke run (tests)
  python -m jrl.train --config=configs/grpo_math.py:drgrpo   # Dr.GRPO (no std normalisation)
  python -m jrl.train --config=configs/grpo_math.py:model=qwen2.5-7b,lora,data=gsm8k ...  # LoRA
Real models and data (local paths; a model may be a Hub id). model=hf: any checkpoint, its own
architecture and tokenizer, lr 1e-6, one update per step, verl's KL loss; data=custom: your own
question / answer records and reward function (docs/usage.md "Your own data, end to end"):
  python -m jrl.train --config=configs/grpo_math.py:model=hf,data=custom \
    --config.model.hf_path=/models/gemma-3-270m --config.task.reward=my_reward.py:exact \
    --config.task.train_files=train.jsonl --config.task.eval_files=eval.jsonl
  python -m jrl.train --config=configs/grpo_math.py:model=qwen2.5-0.5b,data=gsm8k \
    --config.model.hf_path=/models/Qwen2.5-0.5B-Instruct \
    --config.task.train_files=/data/gsm8k/train.parquet \
    --config.task.eval_files=/data/gsm8k/test.parquet --workdir=/tmp/jrl/qwen05_gsm8k
  python -m jrl.train --config=configs/grpo_math.py:model=qwen2.5-1.5b,data=math \
    --config.model.hf_path=/models/Qwen2.5-1.5B-Instruct \
    --config.task.train_files=/data/math/train.jsonl --config.task.eval_files=/data/math/test.jsonl
Real hardware (mesh= sets the device mesh and the batch sizes that fit it):
  python -m jrl.train --config=configs/grpo_math.py:model=qwen2.5-0.5b,mesh=gpu8 \
    --config.model.hf_path=/models/Qwen2.5-0.5B-Instruct          # one host, 8 GPUs
  python -m jrl.train --config=configs/grpo_math.py:model=qwen2.5-0.5b,mesh=v4-8 \
    --config.model.hf_path=/models/Qwen2.5-0.5B-Instruct          # one TPU v4 host, 4 chips
  python -m jrl.train --config=configs/grpo_math.py:model=qwen2.5-7b,data=gsm8k,mesh=v5p-64 \
    --config.model.hf_path=/models/Qwen2.5-7B-Instruct \
    --config.task.train_files=... --config.task.eval_files=...  # the same on every host
Without model.hf_path a model= preset random-initialises a model of exactly that checkpoint's
shape (benchmarks, dry runs); it then needs a tokenizer, e.g. the built-in arithmetic task with
the character tokenizer:
  python -m jrl.train --config=configs/grpo_math.py:model=qwen2.5-7b,mesh=v5p-64 \
    --config.tokenizer=char

Fields are documented in jrl/config/schema.py; the base and the presets are in configs/common.py.
"""

from jrl import config as config_lib

# The bases and presets the files here share, read by path (from any working directory).
common = config_lib.load_file("common.py", next_to=__file__)

PRESETS = common.PRESETS  # the presets after ':' (configs/common.py)


def get_config(arg: str | None = None):
    return common.math_base(arg)  # GRPO on math: configs/common.py `math_base`
