"""PPO (GAE advantages, a learned critic) on math; the default is the built-in arithmetic demo.

Run:
  python -m jrl.train --config=configs/ppo_math.py --workdir=/tmp/jrl/ppo_math
  python -m jrl.train --config=configs/ppo_math.py:shared   # critic shares the policy's backbone
  python -m jrl.train --config=configs/ppo_math.py:tiny     # seconds-long smoke run

Starts from configs/grpo_math.py (same model, warm-up, batch sizes); fields in jrl/config.py.
"""

from configs import grpo_math


def get_config(arg: str | None = None):
    presets = [p for p in (arg or "").split(",") if p]
    shared = "shared" in presets
    c = grpo_math.get_config(",".join(p for p in presets if p != "shared"))
    c.algorithm.adv_estimator = "gae"  # per-token advantages from the critic's values
    c.algorithm.gamma = 1.0  # no discount (verl's default)
    c.algorithm.lam = 1.0  # GAE lambda (verl's default)
    c.critic.share_backbone = shared  # separate critic network unless the `shared` preset
    c.critic.lr = 1e-3  # critic learning rate: it learns from scratch on a value head
    c.critic.cliprange_value = 0.5  # value clipping around the rollout-time values
    c.critic.critic_warmup = 0  # steps of critic-only training before the policy moves
    return c
