"""Advantage estimators, picked by `algorithm.adv_estimator`: `make_estimator(algorithm) -> fn`.

Numerically the same as verl 0.9.1 (`verl/trainer/ppo/core_algos.py`) at every valid position.

Conventions (verl's token alignment):
  * Arrays are batch-major: token quantities [B, T] float32, per-response ones [B].
  * Position t of `token_level_rewards`, `values`, `advantages`, `returns` belongs to action t,
    the response token y_{t+1} chosen in state (prompt, y_1..y_t); `values[:, t]` = V(s_{t+1}) is
    read *before* the token is chosen.
  * `response_mask` [B, T] is 1 on real response tokens and 0 on padding (and on observation
    tokens in multi-turn data, which may leave holes inside a row).
  * `index` [B] int32 is the group (prompt) id of each row, values in [0, B); group statistics use
    segment sums with num_segments = B.
  * The sequence score of a row is s_b = sum_t r[b, t] * mask[b, t].

Masking rules (applied once, by the function `make_estimator` returns):
  * token inputs are zeroed where mask == 0 before anything else, so garbage there never
    matters; `token_level_rewards` are zeroed outside `reward_mask` instead (default: the
    response mask). Under rollout correction's rejection the step passes the mask from before
    rejection there and the rejected one as `response_mask`, as verl's trainer does: the group
    estimators sum each row's rewards unmasked (a rejected last token keeps its row's score in
    the group statistics), while GAE, REINFORCE++, ReMax, the optimal token baselines and
    GROUP-PPO ignore rewards where response_mask == 0, as verl's functions do;
  * both outputs are exactly 0 where mask == 0. verl leaves non-zero junk at some masked positions
    (GAE's whitened advantages and returns on padding, remax inside holes); jrl zeros them. Valid
    positions are unaffected;
  * outputs carry no gradient (verl computes them under `torch.no_grad`).

`make_estimator(algorithm)` binds the estimator's parameters (`estimator_params`: gamma, lam,
norm_adv_by_std_in_grpo, f_norm, group_params) once from the config section and returns
`fn(*, token_level_rewards, response_mask, index, ...) -> {"advantages", "returns",
"critic_mask", "metrics", "next_threshold", ...}`, the same keys for every estimator (see
`make_estimator`).

Register a new estimator with `@register("name", needs=("index",))` (the inputs of `INPUTS` it
reads; `critic=True` for one that reads a critic's values, so the step trains one). It returns
either `(advantages, returns)` or a dict holding at least those two keys (and any of the others
above, plus extras such as `group_ppo`'s "token_returns"). Shared recurrences live in
`jrl.algos.recurrences`; GROUP-PPO's maths in `jrl.algos.group_ppo` (registered here).
"""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from jrl.algos import group_ppo as group_lib
from jrl.algos import masked_whiten, zero_masked
from jrl.algos.recurrences import discounted_returns, gae_advantages, reward_to_go
from jrl.registry import Registry

GRPO_EPS = 1e-6  # verl's `epsilon` in the group-normalised estimators

Estimator = Callable[..., Any]  # -> (advantages, returns) or a dict (see the module docstring)


class Input(NamedTuple):
    """An input an estimator may read besides `token_level_rewards` and `response_mask`."""

    shape: str  # "row" [B], "token" [B, T] (zeroed where response_mask == 0) or "scalar" []
    dtype: Any
    always: bool  # the step always has it for an estimator that reads it (else: None at times)


# Every input an estimator may read, by its keyword name; the step passes these under the same
# names (from its experience, the group of each row and the train state), `make_estimator`
# checks and casts them. A new input is one line here, and its producer in the step.
INPUTS: dict[str, Input] = {
    "index": Input("row", jnp.int32, True),  # the group (prompt) of each row
    "values": Input("token", jnp.float32, True),  # the critic's V(prompt, y_<t)
    "reward_baselines": Input("row", jnp.float32, True),  # ReMax: a greedy answer's reward
    "old_log_prob": Input("token", jnp.float32, True),  # log pi_old(y_t)
    "threshold": Input("scalar", jnp.float32, True),  # GROUP-PPO's tau (the train state's)
    "sum_pi_squared": Input("token", jnp.float32, True),  # sum_v pi_old(v)^2 at each position
    "rollout_is_weights": Input("token", jnp.float32, False),  # rollout correction's IS weights
}


class Entry(NamedTuple):
    """An estimator's registry entry: the function, what it reads, whether it trains a critic."""

    fn: Estimator
    needs: tuple[str, ...]  # the INPUTS it reads (the step computes those only for it)
    critic: bool  # it trains a critic, whose values it reads (`needs` holds "values")


ESTIMATORS = Registry("advantage estimator")  # name -> Entry


def register(name: str, needs: Sequence[str] = (), critic: bool = False):
    """Decorator: registers `fn(*, token_level_rewards, response_mask, index, values, ...,
    **params)` under `name`, with every input of INPUTS (None where not given) and `params` those
    of `estimator_params` (take `**_` for the inputs and parameters you do not use); `needs` names
    the inputs it reads, `critic` whether the step trains a critic for it (then it reads
    "values")."""
    unknown = set(needs) - set(INPUTS)
    if unknown:
        raise ValueError(f"unknown inputs {sorted(unknown)}; valid: {', '.join(INPUTS)}.")
    if critic != ("values" in needs):
        raise ValueError(f"estimator {name!r}: critic=True goes with needs=('values', ...).")

    def decorator(fn: Estimator) -> Estimator:
        ESTIMATORS.add(name, Entry(fn, tuple(needs), critic))
        return fn

    return decorator


def names() -> list[str]:
    """Sorted names of the registered advantage estimators."""
    return ESTIMATORS.names()


def needs(name: str) -> tuple[str, ...]:
    """The inputs of INPUTS (`index`, `values`, ...) the estimator `name` reads."""
    return ESTIMATORS.get(name).needs


def trains_critic(name: str) -> bool:
    """Whether the step trains a critic for the estimator `name` (it reads its values)."""
    return ESTIMATORS.get(name).critic


def estimator_params(algorithm) -> dict[str, Any]:
    """Every estimator parameter, bound from the `algorithm` config section (each field must be
    present; defaults and comments in jrl.config.schema.base_config): gamma, lam,
    norm_adv_by_std_in_grpo, f_norm, and group_params (a validated `group_ppo.GroupParams`)."""
    return {
        "gamma": algorithm.gamma,
        "lam": algorithm.lam,
        "norm_adv_by_std_in_grpo": bool(algorithm.norm_adv_by_std_in_grpo),
        "f_norm": algorithm.f_norm,
        "group_params": group_lib.group_params(algorithm),
    }


def _prepare(name: str, x, mask):
    """Input `name` checked against INPUTS and cast; a token input is 0 where mask == 0 (None
    stays None)."""
    if x is None:
        return None
    spec = INPUTS[name]
    x = jnp.asarray(x, spec.dtype)
    if spec.shape == "token":
        chex.assert_equal_shape([mask, x])
        return zero_masked(x, mask)
    chex.assert_shape(x, {"row": mask.shape[:1], "scalar": ()}[spec.shape])
    return x


def make_estimator(algorithm) -> Callable[..., dict[str, Any]]:
    """The estimator named by `algorithm.adv_estimator`, its parameters bound from the section:

        fn(*, token_level_rewards, response_mask, reward_mask=None, **inputs)
        -> {"advantages", "returns", "critic_mask", "next_threshold", "metrics", ...}

      advantages [B, T], returns [B, T]  0 where response_mask == 0, no gradient
      critic_mask [B, T] float32         where the value loss applies: response_mask, except
                                         group_ppo's segment starts
      metrics                            dict of float32 scalars ({} for most estimators)
      next_threshold                     group_ppo: the adapted threshold for the next step;
                                         others: `threshold` as passed (None if not passed)
    plus estimator-specific extras (group_ppo: "token_returns" [B, T], the per-token GAE returns).
    `reward_mask` (default response_mask) is where the rewards were placed: the response mask
    before rollout correction's rejection (see the masking rules above). `inputs` are any of
    INPUTS by name (`index` [B], each row's group id; `values`,
    `old_log_prob`, ... [B, T]; `threshold`, a float32 scalar: pass the train state's always, so
    switching estimators needs no other change); an input the estimator reads (`needs`) and
    cannot run without raises ValueError when missing, an unknown name TypeError.
    """
    name = algorithm.adv_estimator
    entry = ESTIMATORS.get(name)
    params = estimator_params(algorithm)

    def estimate(
        *,
        token_level_rewards: jax.Array,
        response_mask: jax.Array,
        reward_mask: jax.Array | None = None,
        **inputs,
    ) -> dict[str, Any]:
        unknown = set(inputs) - set(INPUTS)
        if unknown:
            raise TypeError(f"unknown estimator inputs {sorted(unknown)}; valid: {list(INPUTS)}.")
        missing = [k for k in entry.needs if INPUTS[k].always and inputs.get(k) is None]
        if missing:
            raise ValueError(f"advantage estimator {name!r} needs {', '.join(missing)}.")
        mask = jnp.asarray(response_mask, jnp.float32)
        chex.assert_rank(mask, 2)
        chex.assert_equal_shape([mask, token_level_rewards])
        inputs = {k: _prepare(k, inputs.get(k), mask) for k in INPUTS}
        reward_mask = mask if reward_mask is None else jnp.asarray(reward_mask, jnp.float32)
        chex.assert_equal_shape([mask, reward_mask])
        rewards = zero_masked(jnp.asarray(token_level_rewards, jnp.float32), reward_mask)

        out = entry.fn(token_level_rewards=rewards, response_mask=mask, **inputs, **params)
        if not isinstance(out, Mapping):
            out = dict(zip(("advantages", "returns"), out))
        out = {"critic_mask": mask, "metrics": {}, "next_threshold": inputs["threshold"], **out}
        for key in ("advantages", "returns", "critic_mask"):
            out[key] = zero_masked(out[key], mask)
        return jax.lax.stop_gradient(out)

    return estimate


# ----------------------------------------------------------------------------- shared pieces


def _group_sum(x, index):
    """Per-row sum of `x` [B] over the row's group (segment_sum, num_segments = B, gathered
    back)."""
    return jax.ops.segment_sum(x, index, num_segments=x.shape[0])[index]


def _group_moments(scores, index):
    """Per-row group size n, mean, and unbiased std (torch.std) of `scores` [B] grouped by `index`.

    Groups of size 1 get std 0 here; each estimator applies verl's singleton convention itself.
    """
    n = _group_sum(jnp.ones_like(scores), index)
    mean = _group_sum(scores, index) / n
    sq_dev = _group_sum(jnp.square(scores - mean), index)
    std = jnp.sqrt(sq_dev / jnp.maximum(n - 1.0, 1.0))
    return n, mean, std


def _broadcast(per_row, mask):
    """[B] -> [B, T]: the row's scalar on every valid token, 0 elsewhere."""
    return per_row[:, None] * mask


# ----------------------------------------------------------------------------- estimators


@register("gae", needs=("values",), critic=True)
def gae(*, token_level_rewards, response_mask, values, gamma, lam, **_):
    """Generalised advantage estimation (Schulman et al. 2015, arXiv:1506.02438).

    Reverse scan over t with carries (nextV, A_next), both 0 past the end:
        delta_t = r_t + gamma * nextV - V_t
        A_t     = delta_t + gamma * lam * A_next
    and only where mask_t = 1 are the carries replaced (nextV <- V_t, A_next <- A_t); masked
    positions pass them through unchanged, so holes are skipped.
    returns = A + V (before whitening); advantages = masked_whiten(A) over the whole batch.
    Parameters: gamma, lam.
    """
    raw = gae_advantages(token_level_rewards, response_mask, values, gamma, lam)
    return masked_whiten(raw, response_mask), raw + values


@register("grpo", needs=("index",))
@register("grpo_vectorized", needs=("index",))
def grpo(*, token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo, **_):
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300); Dr.GRPO (arXiv:2503.20783).

    s_b = sum_t r[b, t]; per group: mean and unbiased std (a group of one: mean 0, std 1).
        A_b = (s_b - mean) / (std + 1e-6)    if norm_adv_by_std_in_grpo (default True)
        A_b =  s_b - mean                    otherwise (Dr.GRPO)
    broadcast over the row's valid tokens; returns = advantages. Also registered as
    `grpo_vectorized` (verl's segment-op version of the same maths).
    Parameters: norm_adv_by_std_in_grpo.
    """
    scores = jnp.sum(token_level_rewards, axis=-1)
    n, mean, std = _group_moments(scores, index)
    mean = jnp.where(n > 1, mean, 0.0)
    std = jnp.where(n > 1, std, 1.0)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + GRPO_EPS)
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register("grpo_passk", needs=("index",))
def grpo_passk(*, token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo, **_):
    """Pass@k advantage (Chen et al. 2025, arXiv:2503.19595).

    Only the best response of each group gets a non-zero advantage:
        A_best = r_max - r_second_max, divided by (unbiased group std + 1e-6) when
        norm_adv_by_std_in_grpo (default True); every other row gets 0.
    Ties for the maximum give 0 whichever row is picked (jrl picks the lowest row). verl raises
    for a group with fewer than 2 samples; under jit that cannot be checked, so such a group gets
    advantage 0 (validate n >= 2 in the config).
    Parameters: norm_adv_by_std_in_grpo.
    """
    scores = jnp.sum(token_level_rewards, axis=-1)
    batch = scores.shape[0]
    rows = jnp.arange(batch)
    group_max = jax.ops.segment_max(scores, index, num_segments=batch)[index]
    first_best = jax.ops.segment_min(
        jnp.where(scores == group_max, rows, batch), index, num_segments=batch
    )
    is_best = rows == first_best[index]
    runner_up = jax.ops.segment_max(
        jnp.where(is_best, -jnp.inf, scores), index, num_segments=batch
    )[index]
    n, _, std = _group_moments(scores, index)
    gap = jnp.where(n > 1, group_max - runner_up, 0.0)
    if norm_adv_by_std_in_grpo:
        gap = gap / (std + GRPO_EPS)
    adv = _broadcast(jnp.where(is_best, gap, 0.0), response_mask)
    return adv, adv


def _rloo(token_level_rewards, response_mask, index, singleton_keeps_score):
    scores = jnp.sum(token_level_rewards, axis=-1)
    n, mean, _ = _group_moments(scores, index)
    scale = n / jnp.maximum(n - 1.0, 1.0)
    alone = scores if singleton_keeps_score else jnp.zeros_like(scores)
    adv = _broadcast(jnp.where(n > 1, scores * scale - mean * scale, alone), response_mask)
    return adv, adv


@register("rloo", needs=("index",))
def rloo(*, token_level_rewards, response_mask, index, **_):
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740).

    For a group of n > 1: A_b = s_b * n/(n-1) - mean * n/(n-1) = s_b - mean of the other n-1;
    a group of one keeps A_b = s_b. Broadcast over valid tokens; returns = advantages.
    """
    return _rloo(token_level_rewards, response_mask, index, singleton_keeps_score=True)


@register("rloo_vectorized", needs=("index",))
def rloo_vectorized(*, token_level_rewards, response_mask, index, **_):
    """`rloo` as verl's vectorised version computes it: the same for groups of n > 1, but a group
    of one gets A_b = 0 (verl's `rloo` keeps s_b there). jrl's step always has n >= 2."""
    return _rloo(token_level_rewards, response_mask, index, singleton_keeps_score=False)


@register("reinforce_plus_plus")
def reinforce_plus_plus(*, token_level_rewards, response_mask, gamma, **_):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262).

    Discounted return-to-go, reverse over t, carry c (c_T = 0):
        G_t = r_t + gamma * c_{t+1};   c_t = G_t where mask_t = 1, else c_{t+1} (passed through)
    so rewards propagate past observation tokens (holes) undiscounted by them (verl 0.9.1).
    advantages = masked_whiten(G) * mask; returns = G * mask. Parameters: gamma.
    """
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask) * response_mask, returns


@register("reinforce_plus_plus_baseline", needs=("index",))
def reinforce_plus_plus_baseline(*, token_level_rewards, response_mask, index, **_):
    """REINFORCE++ with a group-mean baseline (Hu 2025, arXiv:2501.03262).

    A = masked_whiten((s_b - group mean) on valid tokens) * mask, whitened over the whole batch
    (a group of one: mean 0); returns = advantages.
    """
    scores = jnp.sum(token_level_rewards, axis=-1)
    n, mean, _ = _group_moments(scores, index)
    centered = _broadcast(scores - jnp.where(n > 1, mean, 0.0), response_mask)
    adv = masked_whiten(centered, response_mask) * response_mask
    return adv, adv


@register("remax", needs=("reward_baselines",))
def remax(*, token_level_rewards, response_mask, reward_baselines, **_):
    """ReMax (Li et al. 2023, arXiv:2310.10505).

    returns_t = sum_{t' >= t} r_{t'} * mask_{t'} (undiscounted reward-to-go);
    A_t = returns_t - b * mask_t, b = `reward_baselines` [B], the reward of the greedy response
    to the same prompt.
    """
    returns = reward_to_go(token_level_rewards * response_mask)
    return returns - _broadcast(reward_baselines, response_mask), returns


@register("opo", needs=("index",))
def opo(*, token_level_rewards, response_mask, index, **_):
    """On-policy RL with the optimal reward baseline, OPO (Hao et al. 2025, arXiv:2505.23585).

    Length-weighted group baseline b = sum_g(len * s) / sum_g(len), len = number of valid tokens;
    A_b = s_b - b (a group of one: b = 0). Broadcast over valid tokens; returns = advantages.
    """
    scores = jnp.sum(token_level_rewards, axis=-1)
    lengths = jnp.sum(response_mask, axis=-1)
    n = _group_sum(jnp.ones_like(scores), index)
    total_len = _group_sum(lengths, index)
    baseline = _group_sum(lengths * scores, index) / jnp.where(total_len > 0, total_len, 1.0)
    adv = _broadcast(scores - jnp.where(n > 1, baseline, 0.0), response_mask)
    return adv, adv


@register("gpg", needs=("index",))
def gpg(*, token_level_rewards, response_mask, index, f_norm, **_):
    """Group Policy Gradient, GPG (Chu et al. 2025, arXiv:2504.02546).

    alpha = B / max(1, #rows with s_b != 0) over the whole batch;
    A_b = alpha * (s_b - group mean) / f_norm (a group of one: mean 0).
    Broadcast over valid tokens; returns = advantages.
    Parameters: f_norm (algorithm.f_norm; verl's default 1.0).
    """
    scores = jnp.sum(token_level_rewards, axis=-1)
    alpha = scores.shape[0] / jnp.maximum(jnp.count_nonzero(scores), 1).astype(jnp.float32)
    n, mean, _ = _group_moments(scores, index)
    adv = alpha * (scores - jnp.where(n > 1, mean, 0.0)) / f_norm
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register("gdpo", needs=("index",))
def gdpo(*, token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo, **_):
    """GDPO, group reward-decoupled normalisation (arXiv:2601.05242).

    Each reward component k is GRPO-normalised within its group on its own, the components are
    summed with weights w_k, and the sum is whitened over the batch:
        A = masked_whiten(sum_k w_k GRPO(r_k)) * mask;  returns = advantages.
    jrl's rewards give one score per response, so there is one component (w = 1):
    A = masked_whiten(GRPO(r)) * mask, as verl computes without `gdpo_reward_keys`.
    Parameters: norm_adv_by_std_in_grpo.
    """
    adv, _ = grpo(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        index=index,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )
    adv = masked_whiten(adv, response_mask) * response_mask
    return adv, adv


OTB_EPS = 1e-8  # verl's epsilon in the optimal-token-baseline denominator


def _path_variance(old_log_prob, sum_pi_squared, rollout_is_weights, mask):
    """W_t = sum_{j <= t} w_j m_j with w_j = (1 - 2 pi_j + sum_v pi(v)^2) * rho_j^2 (rho = 1
    without rollout IS weights), and the reward-to-go G_t (callers pass masked rewards)."""
    w = 1.0 - 2.0 * jnp.exp(old_log_prob) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * jnp.square(rollout_is_weights)
    return jnp.cumsum(w * mask, axis=-1)


def _token_baseline(returns, w_cum, mask, index, members):
    """(returns - B) * mask with B_t = sum_g(G_t W_t m_t) / (sum_g(W_t m_t) + 1e-8) per group
    and position (0 for groups of fewer than two `members`), and the zero tail: a group's
    unique longest row gets B = 0 from the second-longest row's length on."""
    batch = mask.shape[0]
    seg = lambda x: jax.ops.segment_sum(x, index, num_segments=batch)[index]  # noqa: E731
    num, den = seg(returns * w_cum * mask), seg(w_cum * mask) + OTB_EPS
    n = _group_sum(members.astype(jnp.float32), index)
    baseline = jnp.where((n > 1)[:, None], num / den, 0.0)
    lengths = jnp.sum(mask, axis=-1)
    longest = jax.ops.segment_max(lengths, index, num_segments=batch)[index]
    n_longest = _group_sum((lengths == longest).astype(jnp.float32), index)
    second = jax.ops.segment_max(
        jnp.where(lengths < longest, lengths, 0.0), index, num_segments=batch
    )[index]
    tail = (lengths == longest) & (n_longest == 1) & (n > 1)
    cols = jnp.arange(mask.shape[1])[None, :]
    baseline = jnp.where(tail[:, None] & (cols >= second[:, None]), 0.0, baseline)
    return (returns - baseline) * mask


OTB_NEEDS = ("index", "old_log_prob", "sum_pi_squared", "rollout_is_weights")


def _optimal_token_baseline(
    packed,
    *,
    token_level_rewards,
    response_mask,
    index,
    old_log_prob,
    sum_pi_squared,
    rollout_is_weights,
    **_,
):
    """Optimal token baseline, OTB (verl 0.9.1): a baseline per group and position that minimises
    the policy-gradient variance under a path-variance proxy.

        G_t = sum_{t' >= t} r_t' m_t'  (reward-to-go);  w_t = 1 - 2 pi_old(y_t) + sum_v pi_old(v)^2
        (||score||^2 of a softmax policy), times rho_t^2 with rollout IS weights rho;
        W_t = sum_{j <= t} w_j m_j;  B_t = sum_group(G_t W_t m_t) / (sum_group(W_t m_t) + 1e-8)
        A_t = (G_t - B_t) m_t;  returns = G.
    Groups of one: B = 0. Zero tail: a group's unique longest row gets B = 0 from the
    second-longest length on (no other row estimates it there). Needs sum_pi_squared from the old
    forward (the step computes it when this estimator is chosen).

    packed=False (`optimal_token_baseline`): positions are the padded columns.
    packed=True (`tir_optimal_token_baseline`, for multi-turn / tool-integrated rollouts): each
    row's valid tokens are first packed to the left (the k-th valid token of every row share one
    baseline position k, skipping observation holes), empty rows join no group, and the
    advantages are scattered back to the tokens' own positions. Identical to packed=False for
    right-padded rows without holes and empty rows.
    """
    returns = reward_to_go(token_level_rewards * response_mask)
    w_cum = _path_variance(old_log_prob, sum_pi_squared, rollout_is_weights, response_mask)
    if not packed:
        members = jnp.ones(response_mask.shape[:1], bool)
        return _token_baseline(returns, w_cum, response_mask, index, members), returns
    b, t = response_mask.shape
    valid = response_mask != 0
    slot = jnp.where(valid, jnp.cumsum(response_mask, axis=-1).astype(jnp.int32) - 1, t)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    pack = lambda x: jnp.zeros((b, t), jnp.float32).at[rows, slot].set(x, mode="drop")  # noqa: E731
    packed_mask = pack(response_mask)
    members = jnp.sum(response_mask, axis=-1) > 0
    packed_adv = _token_baseline(pack(returns), pack(w_cum), packed_mask, index, members)
    adv = jnp.take_along_axis(packed_adv, jnp.minimum(slot, t - 1), axis=-1) * response_mask
    return adv, returns


optimal_token_baseline = register("optimal_token_baseline", needs=OTB_NEEDS)(
    functools.partial(_optimal_token_baseline, False)
)
tir_optimal_token_baseline = register("tir_optimal_token_baseline", needs=OTB_NEEDS)(
    functools.partial(_optimal_token_baseline, True)
)


@register("group_ppo", needs=("values", "old_log_prob", "threshold"), critic=True)
def group_ppo(
    *,
    token_level_rewards,
    response_mask,
    values,
    old_log_prob,
    threshold,
    gamma,
    lam,
    group_params,
    **_,
):
    """GROUP-PPO (`jrl.algos.group_ppo`): segment advantages, returns, the critic mask of the
    segment starts, group/* metrics, and the adapted threshold for the next step.
    Parameters: gamma, lam, group_params."""
    out = group_lib.group_ppo(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        values=values,
        old_log_prob=old_log_prob,
        threshold=threshold,
        gamma=gamma,
        lam=lam,
        params=group_params,
    )
    return {
        "advantages": out.advantages,
        "returns": out.returns,
        "critic_mask": out.critic_mask,
        "metrics": out.metrics,
        "token_returns": out.token_returns,
        "next_threshold": group_lib.update_threshold(
            threshold, out.token_returns, values, response_mask, params=group_params
        ),
    }
