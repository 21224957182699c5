"""GRPO on math. The default trains the built-in character-level model on built-in arithmetic.

Run:
  python -m jrl.train --config=configs/grpo_math.py --workdir=/tmp/jrl/grpo_math
Overrides and presets:
  python -m jrl.train --config=configs/grpo_math.py --config.rollout.n=16 --config.total_steps=50
  python -m jrl.train --config=configs/grpo_math.py:tiny     # seconds-long smoke run (tests)
  python -m jrl.train --config=configs/grpo_math.py:drgrpo   # Dr.GRPO (no std normalisation)

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
        if preset == "tiny":  # a few-second run for tests and smoke checks
            c.total_steps = 3
            c.eval_every = 0
            c.model.hidden_size = 32
            c.model.intermediate_size = 64
            c.warmup.sft_steps = 2
            c.task.eval_size = 16
            c.data.train_batch_size = 4
            c.rollout.n = 4
            c.actor.ppo_mini_batch_size = 2
        elif preset == "drgrpo":
            c.algorithm.norm_adv_by_std_in_grpo = False
        else:
            raise config_lib.ConfigError(
                f"unknown preset '{preset}' in configs/grpo_math.py:{arg}; valid presets: tiny, drgrpo."
            )
    return c
