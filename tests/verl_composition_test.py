"""The step's composition from scores to advantages against verl 0.9.1's trainer: the score on the
last token, KL in the reward, rollout correction (rejecting a row's last token, or whole rows),
then each advantage estimator verl has, with rejection on and off. Expected numbers are verl's
own output on the same inputs (tests/golden/verl_composition.json, written by
scripts/make_verl_goldens.py with torch and verl 0.9.1 installed)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jrl import step as step_lib

from jrl import step_metrics

from jrl import train_state
from conftest import GOLDEN, tiny_config, tiny_model

with open(os.path.join(GOLDEN, "verl_composition.json")) as f:
    DATA = json.load(f)
ATOL = 2e-5


def _spec(case):
    """The StepSpec of the tiny config with the case's estimator, KL in the reward and rollout
    correction (verl's settings, in jrl's names)."""
    rc = DATA["corrections"][case["correction"]]
    kl = DATA["kl"][case["kl"]]
    changes = {
        "algorithm.adv_estimator": case["estimator"],
        "algorithm.gamma": DATA["gamma"],
        "algorithm.lam": DATA["lam"],
        "algorithm.use_kl_in_reward": kl is not None,
        "algorithm.kl_ctrl.type": "fixed",
        "algorithm.kl_ctrl.kl_coef": 0.0 if kl is None else kl,
        "algorithm.kl_penalty": case["kl"] if kl is not None else "kl",
        "algorithm.rollout_correction.enable": rc is not None,
        "rollout.n": DATA["n"],
    }
    if rc is not None:
        for name, value in rc.items():
            changes[f"algorithm.rollout_correction.{name}"] = str(value)
    cfg = tiny_config(**changes)
    return step_lib.make_spec(cfg, tiny_model(16), None, eos_id=1, pad_id=0, max_new_tokens=6)


def _state(spec):
    none = dict.fromkeys(("params", "opt_state", "critic_params", "critic_opt_state"))
    return train_state.TrainState(
        step=jnp.int32(0),
        ref_params=None,
        kl_coef=jnp.float32(spec.cfg.algorithm.kl_ctrl.kl_coef),
        group_threshold=jnp.float32(1.0),
        skipped_steps=jnp.int32(0),
        key=None,
        **none,
    )


def _experience(x):
    mask = np.asarray(x["response_mask"], np.int32)
    b, p = mask.shape[0], x["prompt_length"]
    names = ("scores", "old_log_prob", "ref_log_prob", "rollout_log_prob", "values")
    exp = {k: jnp.asarray(x[k], jnp.float32) for k in names + ("reward_baselines",)}
    exp["sum_pi_squared"] = jnp.asarray(x["sum_pi_squared"], jnp.float32)
    exp["response_mask"] = jnp.asarray(mask)
    exp["attention_mask"] = jnp.ones((b, p), jnp.int32)
    return exp


CASES = DATA["cases"]
IDS = [f"{c['estimator']}-kl_{c['kl']}-rs_{c['correction']}" for c in CASES]


def test_the_golden_covers_every_group_estimator_with_rejection_on_and_off():
    from jrl.algos import advantages as adv_lib

    group = {name for name in adv_lib.names() if "index" in adv_lib.needs(name)}
    covered = {(c["estimator"], c["correction"]) for c in CASES}
    for name in group:
        for correction in ("off", "token_k1", "seq_mean_k3"):
            assert (name, correction) in covered, (name, correction)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_advantages_match_verls_trainer(case):
    spec = _spec(case)
    exp, _, _ = step_lib.estimate_advantages(spec, _state(spec), _experience(DATA["inputs"]))
    kept = np.asarray(case["response_mask"])
    np.testing.assert_array_equal(np.asarray(exp.get("policy_mask", exp["response_mask"])), kept)
    # verl leaves values where the (rejected) mask is 0 at times (GAE's whitened advantages on
    # padding); jrl's are 0 there
    for name in ("advantages", "returns"):
        actual = np.asarray(exp[name])
        np.testing.assert_allclose(actual, np.asarray(case[name]) * kept, rtol=0, atol=ATOL)
        assert np.all(actual[kept == 0] == 0), name
    metrics = step_metrics.experience_metrics(exp, 6)
    for name, value in case["metrics"].items():
        np.testing.assert_allclose(metrics[name], value, rtol=0, atol=ATOL, err_msg=name)
