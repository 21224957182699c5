"""PPO (GAE advantages, a learned critic) on math; the default is the built-in arithmetic demo.

Run:
  python -m jrl.train --config=configs/ppo_math.py --workdir=/tmp/jrl/ppo_math
  python -m jrl.train --config=configs/ppo_math.py:shared   # critic shares the policy's backbone
  python -m jrl.train --config=configs/ppo_math.py:tiny     # seconds-long smoke run

Built by jrl.config.ppo_math_base (GRPO-on-math base + GAE and a critic); fields in jrl/config.py.
"""

from jrl import config as config_lib

PRESETS = config_lib.PRESETS  # the presets after ':' (plus `shared`), jrl/config.py


def get_config(arg: str | None = None):
    return config_lib.ppo_math_base(arg)  # PPO on math: jrl/config.py `ppo_math_base`
