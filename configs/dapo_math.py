"""DAPO on math: clip-higher, token-mean loss, soft overlong punishment and dynamic sampling.

Run:
  python -m jrl.train --config=configs/dapo_math.py --workdir=/tmp/jrl/dapo_math
  python -m jrl.train --config=configs/dapo_math.py:tiny   # seconds-long smoke run

Starts from configs/common.py `math_base` (GRPO on math: same model, warm-up, batch sizes);
fields in jrl/config/schema.py.
Dynamic sampling runs inside the jitted step: each step the host hands over
`max_num_gen_batches` x `train_batch_size` prompts and the step keeps drawing generation rounds
from them until `train_batch_size` groups whose rewards differ are found.
"""

from jrl import config as config_lib

# The bases and presets the files here share, read by path (from any working directory).
common = config_lib.load_file("common.py", next_to=__file__)

PRESETS = common.PRESETS  # the presets after ':' (configs/common.py)


def get_config(arg: str | None = None):
    c = common.math_base(arg, "configs/dapo_math.py")
    c.algorithm.adv_estimator = "grpo"  # group-relative advantages
    c.actor.clip_ratio_low = 0.2  # decoupled clip: lower bound 1 - 0.2 ...
    c.actor.clip_ratio_high = 0.28  # ... upper bound 1 + 0.28 (clip-higher)
    c.actor.loss_agg_mode = "token-mean"  # token-level policy-gradient loss
    c.actor.use_kl_loss = False  # no KL term
    c.algorithm.use_kl_in_reward = False  # no KL in the reward
    c.algorithm.filter_groups.enable = True  # dynamic sampling
    c.algorithm.filter_groups.metric = "acc"  # keep groups whose task rewards differ
    c.algorithm.filter_groups.max_num_gen_batches = 3  # at most 3 generation rounds per step
    c.data.max_response_length = 8  # room past the longest answer (4 tokens) for the buffer
    c.reward.overlong_buffer.enable = True  # soft overlong punishment ...
    c.reward.overlong_buffer.len = 3  # ... of responses longer than 8 - 3 = 5 tokens ...
    c.reward.overlong_buffer.penalty_factor = 1.0  # ... falling to -1 at 8
    return c
