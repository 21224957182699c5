"""PPO (GAE advantages, a learned critic) on math; the default is the built-in arithmetic demo.

Run:
  python -m jrl.train --config=configs/ppo_math.py --workdir=/tmp/jrl/ppo_math
  python -m jrl.train --config=configs/ppo_math.py:shared   # critic shares the policy's backbone
  python -m jrl.train --config=configs/ppo_math.py:tiny     # seconds-long smoke run

Built by configs/common.py `ppo_math_base` (GRPO-on-math base + GAE and a critic); fields in
jrl/config/schema.py.
"""

from jrl import config as config_lib

# The bases and presets the files here share, read by path (from any working directory).
common = config_lib.load_file("common.py", next_to=__file__)

PRESETS = common.PRESETS  # the presets after ':' (plus `shared`), configs/common.py


def get_config(arg: str | None = None):
    return common.ppo_math_base(arg)  # PPO on math: configs/common.py `ppo_math_base`
