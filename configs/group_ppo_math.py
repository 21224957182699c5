"""GROUP-PPO on math (segment-level advantages, docs/algorithms.md); default: built-in arithmetic.

Run:
  python -m jrl.train --config=configs/group_ppo_math.py --workdir=/tmp/jrl/group_ppo_math
  python -m jrl.train --config=configs/group_ppo_math.py:tiny   # seconds-long smoke run

Starts from configs/common.py `ppo_math_base` (PPO on math: same model, warm-up, critic); fields
in jrl/config/schema.py.
"""

from jrl import config as config_lib

# The bases and presets the files here share, read by path (from any working directory).
common = config_lib.load_file("common.py", next_to=__file__)

PRESETS = common.PRESETS  # the presets after ':' (configs/common.py)


def get_config(arg: str | None = None):
    c = common.ppo_math_base(arg, "configs/group_ppo_math.py")
    c.algorithm.adv_estimator = "group_ppo"  # one advantage per segment, critic at its start
    g = c.algorithm.group_params
    g.group_variance_threshold = 1.0  # initial threshold tau on rho = r_grpo / r_ppo
    g.group_max_size = 16  # most tokens per segment
    g.group_epsilon = 1e-6  # eps in rho
    g.adaptive_threshold = True  # adapt tau once per step from the critic's explained variance
    g.threshold_lr = 0.01  # step size of the log-space tau update
    g.min_threshold = 0.1  # lower bound on tau
    g.max_threshold = 10.0  # upper bound on tau
    return c
