"""Writes tests/golden/verl_composition.json: verl 0.9.1's trainer run on fixed inputs from the
reward to the advantages (needs torch and verl 0.9.1: `pip install torch==2.13.0
verl==0.9.1` and the modules its trainer imports, e.g. cachetools, fastapi, uvicorn).

    python scripts/make_verl_goldens.py [--out tests/golden/verl_composition.json]

Every case runs the order of `RayPPOTrainer.fit` in verl/trainer/ppo/ray_trainer.py, with verl's
own functions on a `DataProto`: the score on each row's last response token
(`token_level_scores`), `apply_kl_penalty` (KL in the reward, a fixed controller) or
token_level_rewards = token_level_scores, `compute_rollout_correction_and_add_to_batch`
(rollout correction: rejection replaces `response_mask`), `compute_advantage`, then
`compute_data_metrics`. Cases: every advantage estimator of verl that jrl registers, with KL in
the reward off and on, and rollout correction off, rejecting tokens (`token_k1`, which rejects
row 0's last token) and rejecting whole rows (`seq_mean_k3`), with token IS weights. The inputs
are stored beside the outputs; tests/verl_composition_test.py feeds them to
`jrl.step.estimate_advantages`.
"""

import argparse
import json
import os

import numpy as np
import torch
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.metric_utils import compute_data_metrics
from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

ESTIMATORS = (
    "gae",
    "grpo",
    "grpo_vectorized",
    "grpo_passk",
    "rloo",
    "rloo_vectorized",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "gdpo",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
)
# rollout correction: None (off), or verl's rollout_corr_config
CORRECTIONS = {
    "off": None,
    "token_k1": dict(
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k1",
        rollout_rs_threshold="0.5_2.0",
    ),
    "seq_mean_k3": dict(
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="seq_mean_k3",
        rollout_rs_threshold=0.05,
    ),
}
KL = {"off": None, "low_var_kl": 0.05}  # KL in the reward: kind -> fixed coefficient
GAMMA, LAM = 1.0, 0.95
N = 4  # rows per group


def inputs(seed: int = 0) -> dict:
    """Two groups of four rows, six response tokens, two prompt tokens; scores on each row's
    last token; log-probs random everywhere (padding included: it must not matter), the
    rollout's within 0.03 of the old ones except row 0's last token (rejected by token_k1) and
    row 5 (off by 0.6 on every token: rejected by seq_mean_k3)."""
    rng = np.random.default_rng(seed)
    lengths = np.array([6, 4, 2, 5, 3, 6, 1, 4])
    b, t, p = len(lengths), 6, 2
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    scores = np.array([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.0], np.float32)
    old = -rng.uniform(0.05, 3.0, (b, t)).astype(np.float32)
    ref = (old + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    rollout = (old + rng.uniform(-0.03, 0.03, (b, t))).astype(np.float32)
    rollout[0, lengths[0] - 1] = old[0, lengths[0] - 1] + 2.0  # ratio e^-2 < 0.5
    rollout[5] = old[5] - 0.6  # k3 of log-ratio 0.6 is 0.22 > 0.05
    return {
        "response_mask": mask,
        "scores": scores,
        "old_log_prob": old,
        "ref_log_prob": ref,
        "rollout_log_prob": rollout,
        "values": rng.normal(0, 0.5, (b, t)).astype(np.float32),
        "reward_baselines": rng.uniform(0, 1, b).astype(np.float32),
        "sum_pi_squared": rng.uniform(0.05, 0.9, (b, t)).astype(np.float32),
        "index": (np.arange(b) // N).astype(np.int32),
        "prompt_length": p,
    }


def verl_run(x: dict, estimator: str, kl: str, correction: str) -> dict:
    t = lambda a: torch.tensor(np.asarray(a))
    mask = t(x["response_mask"])
    b, r = mask.shape
    last = (mask.sum(-1) - 1).long()
    scores = torch.zeros(b, r)
    scores[torch.arange(b), last] = t(x["scores"])
    p = x["prompt_length"]
    batch = DataProto.from_dict(
        tensors={
            "prompts": torch.ones(b, p, dtype=torch.long),
            "responses": torch.ones(b, r, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(b, p), mask], -1).long(),
            "response_mask": mask,
            "token_level_scores": scores,
            "old_log_probs": t(x["old_log_prob"]),
            "ref_log_prob": t(x["ref_log_prob"]),
            "rollout_log_probs": t(x["rollout_log_prob"]),
            # what the trainer has for this estimator only (the others take no such argument)
            **({"values": t(x["values"])} if estimator == "gae" else {}),
            **({"reward_baselines": t(x["reward_baselines"])} if estimator == "remax" else {}),
            **({"sum_pi_squared": t(x["sum_pi_squared"])} if "token_baseline" in estimator else {}),
        },
        non_tensors={"uid": np.array([f"g{i}" for i in x["index"]], dtype=object)},
    )
    if KL[kl] is None:
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    else:
        ctrl = core_algos.FixedKLController(kl_coef=KL[kl])
        batch, _ = apply_kl_penalty(batch, kl_ctrl=ctrl, kl_penalty=kl)
    if CORRECTIONS[correction] is not None:
        batch, _ = compute_rollout_correction_and_add_to_batch(batch, CORRECTIONS[correction])
    config = AlgoConfig(gamma=GAMMA, lam=LAM, adv_estimator=estimator)
    batch = compute_advantage(
        batch,
        adv_estimator=estimator,
        gamma=GAMMA,
        lam=LAM,
        num_repeat=N,
        norm_adv_by_std_in_grpo=True,
        # verl's trainer asserts gdpo_reward_keys when it passes its config to gdpo; without
        # them gdpo is GRPO of the one score, whitened: what jrl's gdpo computes
        config=None if estimator == "gdpo" else config,
    )
    metrics = compute_data_metrics(batch, use_critic=estimator == "gae")
    keep = ("critic/advantages/mean", "critic/advantages/max", "critic/advantages/min")
    keep += ("critic/returns/mean", "critic/rewards/mean")
    return {
        "advantages": batch.batch["advantages"].tolist(),
        "returns": batch.batch["returns"].tolist(),
        "response_mask": batch.batch["response_mask"].tolist(),
        "metrics": {k: float(metrics[k]) for k in keep},
    }


def _rounded(x):
    if isinstance(x, float):
        return float(f"{x:.8g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tests/golden/verl_composition.json")
    out = parser.parse_args().out
    x = inputs()
    cases = []
    for estimator in ESTIMATORS:
        for kl in KL:
            for correction in CORRECTIONS:
                expected = verl_run(x, estimator, kl, correction)
                cases.append(dict(estimator=estimator, kl=kl, correction=correction, **expected))
    data = {
        "verl": "0.9.1",
        "gamma": GAMMA,
        "lam": LAM,
        "n": N,
        "kl": KL,
        "corrections": CORRECTIONS,
        "inputs": {k: np.asarray(v).tolist() for k, v in x.items()},
        "cases": cases,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:  # 8 significant digits: float32's, in a smaller file
        json.dump(_rounded(data), f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
