"""The fused RL step: rollout -> reward -> old / reference log-probs and values -> advantages ->
PPO updates of the policy (and the critic).

`state, metrics = step(state, prompts)` is ONE function for `jax.jit` (with the state donated):
every shape is static (P prompt length, R response length, B_p prompts, n samples per prompt,
B = B_p * n rows), every variant is picked by name from the config at trace time, and nothing
leaves the device until the host reads `metrics`.

Alignment (docs/design.md#token-alignment, verl's convention): response position t is action
y_t. `log_probs[:, t]` is read from the logits at the position before y_t (the last prompt token
for t = 0), and so is `values[:, t]` = V(prompt, y_<t): the value of the state in which y_t is
chosen.

The step is three phases, module-level functions of a `StepSpec` (the config's static choices,
`make_spec`): `generate` (rollout + reward), `compute_advantages` (old / reference log-probs,
values, KL in the reward, advantages), `update` (PPO epochs of mini-batch updates); `rl_step`
chains them and `make_step` binds it to a spec. Read top to bottom: the spec, then each phase
and the functions only it uses, then the fused step. What the phases build on has its own home:
the train state and optimizers (`jrl.train_state`), the forwards (`jrl.logprobs`) and how they
run over rows (`jrl.batching`: micro-batches, shared prompts, buckets), reward shaping and DAPO's
dynamic sampling (`jrl.shaping`), the NaN guard (`jrl.nan_guard`), the batch's metrics
(`jrl.step_metrics`), a LoRA run's params (`jrl.models.lora`); what a variant needs (an
estimator's inputs and critic) the step reads from its registry entry.

With a tool host (`StepSpec.tool_host`, rollout.multi_turn.enable) the rollout is multi-turn
(`jrl.multi_turn`): tool tokens sit in the response with `response_mask` 0 and
`response_valid` 1; the reward and the forwards read `response_valid`, everything else
`response_mask` (docs/multi_turn.md#in-the-step).

A mixture-of-experts policy with routing replay (actor.router_replay.mode, `jrl.router_replay`)
carries recorded experts with the experience (`prompt_routed_experts`,
`response_routed_experts`): the rollout's (R3), replayed by the old-log-prob forward and the
update, or the old-log-prob forward's own (R2), replayed by the update.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax

from jrl import batching, logprobs, multi_turn, nan_guard, rollout, shaping, step_metrics
from jrl import router_replay
from jrl.algos import advantages as adv_lib
from jrl.algos import kl as kl_lib
from jrl.algos import losses
from jrl.algos import rollout_corr
from jrl.models import transformer
from jrl.models import lora as lora_lib
from jrl.models.lora import lora_on, policy_params, reference_params, with_base
from jrl.train_state import TrainState, needs_critic, needs_reference, policy_optimizer
from jrl.train_state import learning_rates, make_optimizer, model_configs

Batch = dict[str, jax.Array]


def bypass_mode(cfg: ml_collections.ConfigDict) -> bool:
    """Rollout correction's bypass mode: the old log-probs are the rollout's own (no old forward);
    the `bypass_mode` policy loss corrects against them."""
    rc = cfg.algorithm.rollout_correction
    return bool(rc.enable and rc.bypass_mode)


def on_policy_update(cfg: ml_collections.ConfigDict) -> bool:
    """Whether the update's own forward can stand in for the old-log-prob forward: one PPO epoch
    over one mini-batch runs on exactly the parameters the rollout is scored with, so
    old_log_prob = stop_gradient(log_prob) of the update's forward (TRL with num_iterations=1),
    and the scoring forward of the policy is skipped. Not when something needs the old
    log-probs before the update: KL in the reward, an estimator that reads them (GROUP-PPO, the
    optimal token baselines), rollout correction (its IS weights and rejection compare them with
    the rollout's before the advantages, as verl; bypass mode uses the rollout's instead),
    values from a value head on the policy's own forward, or LoRA dropout (the update's forward
    drops adapter inputs; the old log-probs are those of the policy without dropout, as verl's)."""
    return (
        cfg.actor.ppo_epochs == 1
        and cfg.data.train_batch_size == cfg.actor.ppo_mini_batch_size
        and not cfg.algorithm.use_kl_in_reward
        and "old_log_prob" not in adv_lib.needs(cfg.algorithm.adv_estimator)
        and not cfg.algorithm.rollout_correction.enable
        and not (needs_critic(cfg) and cfg.critic.share_backbone)
        and not lora_lib.lora_dropout_on(cfg)
    )


def prompts_per_step(cfg: ml_collections.ConfigDict) -> int:
    """Prompts the host feeds one step: B_p, or a pool of max_num_gen_batches * B_p under DAPO's
    dynamic sampling (each generation round draws fresh prompts from it)."""
    fg = cfg.algorithm.filter_groups
    return cfg.data.train_batch_size * (fg.max_num_gen_batches if fg.enable else 1)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What the phases of a step read, fixed once from the config (static at trace time): the
    models, the sampling settings, the micro-batch counts, and the maths of the config's
    variants bound to their settings (`losses.make_policy_loss`, `advantages.make_estimator`,
    `kl.make_kl_controller`). Built by `make_spec`; every phase takes it as its first argument."""

    cfg: ml_collections.ConfigDict
    model_cfg: transformer.ModelConfig  # the policy's (see `model_configs`)
    critic_cfg: transformer.ModelConfig | None  # a separate critic's; None: none or shared
    reward_fn: Callable  # (batch, response_ids, response_valid, eos_id=) -> scores [B]
    eos_id: int
    pad_id: int
    max_new_tokens: int
    stop_ids: tuple[int, ...]  # more tokens that end a response as EOS does (rollout.stop)
    # how each forward runs over its rows, by role ("log_prob", "actor", "critic"): micro-batches,
    # shared-prompt groups, response buckets (`batching.plan`)
    batching: dict
    policy_loss: Callable  # (old_log_prob, log_prob, advantages, mask, *, counts, ...) -> loss, m
    estimator: Callable  # (token_level_rewards=, response_mask=, index=, ...) -> advantages, ...
    kl_controller: Callable  # (kl_coef, current_kl, n_steps) -> next kl_coef
    tx: optax.GradientTransformation  # the policy's optimizer (`policy_optimizer`)
    critic_tx: optax.GradientTransformation  # the separate critic's
    # the multi-turn rollout's host (`jrl.tools.host.make_tool_host`; rollout.multi_turn.enable),
    # bound into the compiled program: one host, one compile. None: one-turn rollouts.
    tool_host: Any = None
    # rollout.stop's strings (`jrl.stop_strings.StopStrings`) that end a one-turn response; None:
    # none (with a tool host they are the host's)
    stop_strings: Any = None
    # the benchmark's fixed response length of each of the B rows (`rollout.generate`'s
    # `forced_length`); None (every run): the policy decides where EOS falls
    forced_length: tuple[int, ...] | None = None

    @property
    def n(self) -> int:
        return self.cfg.rollout.n

    @property
    def sampling_ids(self) -> dict:  # what `make_spec` took of `jrl.run.trainer.sampling_ids`
        names = ("eos_id", "pad_id", "max_new_tokens", "stop_ids", "stop_strings", "tool_host")
        return {name: getattr(self, name) for name in names}

    @property
    def on_policy(self) -> bool:  # the update's own forward gives the old log-probs
        return on_policy_update(self.cfg)

    @property
    def use_critic(self) -> bool:
        return needs_critic(self.cfg)

    @property
    def shared(self) -> bool:  # the value head sits on the policy's backbone
        return self.use_critic and self.critic_cfg is None

    def needs(self, name: str) -> bool:
        """Whether the estimator reads the input `name` (`advantages.INPUTS`): the step
        computes it only then."""
        return name in adv_lib.needs(self.cfg.algorithm.adv_estimator)


def make_spec(
    cfg: ml_collections.ConfigDict,
    model_cfg: transformer.ModelConfig,
    reward_fn: Callable,
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    stop_ids: tuple[int, ...] = (),
    stop_strings=None,
    mesh=None,
    tool_host=None,
    forced_length=None,
) -> StepSpec:
    """The `StepSpec` of a config. `model_cfg` is the policy's (see `model_configs`); `mesh` (the
    one the step is jitted over) sets how many rows each device holds, which the micro-batch
    sizes divide; `tool_host`: the multi-turn host (`jrl.run.trainer.sampling_ids` builds it
    when rollout.multi_turn.enable), None for one-turn rollouts. Raises ConfigError for
    routing replay or a router aux loss on a dense policy (`router_replay.check_experts`)."""
    router_replay.check_experts(cfg, model_cfg is None or model_cfg.num_experts > 0)
    return StepSpec(
        cfg=cfg,
        model_cfg=model_cfg,
        critic_cfg=model_configs(cfg, model_cfg)[1],
        reward_fn=reward_fn,
        eos_id=eos_id,
        pad_id=pad_id,
        max_new_tokens=max_new_tokens,
        stop_ids=tuple(stop_ids),
        batching=batching.plan(cfg, mesh, max_new_tokens),
        policy_loss=losses.make_policy_loss(cfg.actor, cfg.algorithm.rollout_correction),
        estimator=adv_lib.make_estimator(cfg.algorithm),
        kl_controller=kl_lib.make_kl_controller(cfg.algorithm),
        tx=policy_optimizer(cfg),
        critic_tx=make_optimizer(cfg.critic),
        tool_host=tool_host,
        stop_strings=stop_strings,
        forced_length=None if forced_length is None else tuple(int(x) for x in forced_length),
    )


# ---------------------------------------------------------------------------------------------
# Phase 1, generate(spec, state, prompts, key) -> (experience, metrics): the rollout of
# B = B_p * n rows and its reward (`scores` [B]); with dynamic sampling, rounds of fresh prompts
# until B_p groups with signal are found.


def sample_responses(
    model_cfg, params, prompt_ids_BP, prompt_mask_BP, key, *, tool_host=None, **sampling
):
    """(rollout, response_valid [B, R]): `rollout.generate`'s answers (valid = their mask), or
    with a `tool_host` the multi-turn rollout's (`multi_turn.generate`: model and tool tokens,
    `response_mask` 1 on model tokens only, valid 1 on both up to the row's end). `sampling`:
    the keyword arguments both take (max_new_tokens, eos_id, pad_id, temperature, ...)."""
    if tool_host is None:
        out = rollout.generate(model_cfg, params, prompt_ids_BP, prompt_mask_BP, key, **sampling)
        return out, out.response_mask
    sampling.pop("stop_ids", None)  # a turn ends at the host's stops (rollout.stop's among them)
    sampling.pop("stop_strings", None)
    sampling.pop("compact_min_rows", None)  # rollout.compact_decode is one-turn only
    if sampling.pop("forced_length", None) is not None:
        raise ValueError("forced_length (the benchmark's fixed lengths) is one-turn only")
    out = multi_turn.generate(
        model_cfg, params, prompt_ids_BP, prompt_mask_BP, key, host=tool_host, **sampling
    )
    return out, out.valid


def sample_and_score(model_cfg, reward_fn, params, prompts: Batch, key, *, samples=1, **sampling):
    """(rollout, response_valid [B, R], reward [B]): `samples` answers to each prompt of the batch
    `prompts` (`sample_responses`; rows in `jnp.repeat` order, B = samples x the prompts) and
    `reward_fn` of them, which reads the model's final turn (`final_turn_mask`)."""
    rows = jax.tree_util.tree_map(lambda x: jnp.repeat(x, samples, axis=0), prompts)
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    out, valid = sample_responses(model_cfg, params, ids, mask, key, samples=samples, **sampling)
    read = shaping.final_turn_mask(out.response_mask, valid)
    return out, valid, reward_fn(rows, out.response_ids, read, eos_id=sampling["eos_id"])


def rollout_and_reward(spec: StepSpec, params, prompts: Batch, key, greedy=False) -> Batch:
    """n samples of each prompt (one greedy answer with `greedy`), scored: `acc` is the task's
    reward, `scores` that after shaping (DAPO's overlong penalty) plus, in a multi-turn rollout,
    the tools' rewards. The reward reads the response; of a multi-turn one only the model's final
    turn (`final_turn_mask`), never a tool's answer. A multi-turn rollout also keeps
    `response_valid`, `rollout_log_prob`, `tool_reward`, `num_turns`, `assistant_turns` and
    `tool_stats`; routing replay R3 the experts of every token (`router_replay.KEYS`)."""
    cfg, n = spec.cfg, 1 if greedy else spec.n
    rows = jax.tree_util.tree_map(lambda x: jnp.repeat(x, n, axis=0), prompts)
    out, valid = sample_responses(
        spec.model_cfg,
        params,
        prompts["input_ids"],
        prompts["attention_mask"],
        key,
        samples=n,
        **spec.sampling_ids,
        temperature=1.0 if greedy else cfg.rollout.temperature,
        top_k=cfg.rollout.top_k,
        top_p=cfg.rollout.top_p,
        greedy=greedy,
        forced_length=None if greedy else spec.forced_length,
        compact_min_rows=cfg.rollout.compact_min_rows if cfg.rollout.compact_decode else 0,
        record_experts=router_replay.records_rollout(cfg) and not greedy,
    )
    exp = {**rows, "response_ids": out.response_ids, "response_mask": out.response_mask}
    if out.experts is not None:  # R3: what the training forwards replay
        exp[router_replay.PROMPT], exp[router_replay.RESPONSE] = out.experts
    multi = spec.tool_host is not None
    if multi:
        exp.update(
            response_valid=valid,  # model and tool tokens: what the forwards attend over
            tool_reward=out.tool_reward,
            num_turns=out.num_turns,
            assistant_turns=out.assistant_turns,
            tool_stats=out.stats,
        )
    replay = router_replay.mode(cfg) != "disabled"  # its metrics compare them with the old
    if multi or cfg.algorithm.rollout_correction.enable or replay:  # the rollout's own log-probs
        exp["rollout_log_prob"] = out.log_probs
    read = shaping.final_turn_mask(out.response_mask, valid)
    acc = spec.reward_fn(exp, out.response_ids, read, eos_id=spec.eos_id)
    scores, overlong = acc, cfg.reward.overlong_buffer
    if multi:
        scores = scores + out.tool_reward
    if overlong.enable:
        length = jnp.sum(valid, -1)
        scores = scores + shaping.overlong_penalty(
            length, spec.max_new_tokens, overlong.len, overlong.penalty_factor
        )
    if spec.needs("reward_baselines") and not greedy:  # ReMax: a greedy answer's reward,
        # shaped as the samples' (verl: the baseline's rm_scores, from the same reward manager)
        base = rollout_and_reward(spec, params, prompts, key, greedy=True)["scores"]
        exp["reward_baselines"] = jnp.repeat(base, n)
    return {**exp, "acc": acc, "scores": scores}


def generate(spec: StepSpec, state: TrainState, prompts: Batch, key):
    """Phase 1 (see above)."""
    cfg, params = spec.cfg, policy_params(spec.cfg, state)
    sample = lambda prompts, key: rollout_and_reward(spec, params, prompts, key)
    if cfg.algorithm.filter_groups.enable:  # DAPO: rounds of fresh prompts from the pool
        filter_groups, b_p = cfg.algorithm.filter_groups, cfg.data.train_batch_size
        return shaping.dynamic_sampling(sample, prompts, key, spec.n, filter_groups, b_p)
    return sample(prompts, key), {}


# ---------------------------------------------------------------------------------------------
# Phase 2, compute_advantages(spec, state, experience) -> (experience, metrics, state): old /
# reference log-probs and values of the rollout, KL in the reward, rollout correction,
# advantages, returns and the critic's mask; the state carries the next KL coefficient and
# GROUP-PPO threshold.


def forward(spec: StepSpec, model_cfg, params, rows: Batch, name: str, **outputs):
    """`response_outputs` of `rows` (prompt + response) at the rollout's temperature; the
    entropy, when asked for, has a gradient only if the loss uses it (entropy_coeff != 0).
    `name`: "log_prob", "actor" or "critic", the role whose prompt groups apply."""
    return logprobs.response_outputs(
        model_cfg,
        params,
        rows["input_ids"],
        rows["attention_mask"],
        rows["response_ids"],
        rows.get("response_valid", rows["response_mask"]),  # tool tokens are attended
        spec.cfg.rollout.temperature,
        entropy_grad=spec.cfg.actor.entropy_coeff != 0,
        group=spec.batching[name].group,
        **outputs,
    )


def _moe_outputs(rows: Batch, **outputs) -> dict:
    """`response_outputs`' routing arguments of a policy forward: the experts `rows` carry to
    replay (routing replay; none: the routers' own), and the `outputs` asked for when true."""
    replay = router_replay.replayed(rows)
    extra = {"routing": replay} if replay is not None else {}
    return {**extra, **{k: True for k, on in outputs.items() if on}}


def score_forwards(spec: StepSpec, state: TrainState, rows: Batch) -> Batch:
    """Old (unless on-policy or bypass mode) and reference log-probs and values of some rows.
    (Bypass mode with a value head on the policy still runs the policy's forward, for the
    values; its log-probs are then replaced by the rollout's.) Under routing replay the old
    forward replays the rollout's experts (R3: then also `routing_mismatch`, how often its own
    differ, `router_replay.mismatch_counts`) or records its own (R2); the reference routes on
    its own, as verl's."""
    cfg, out = spec.cfg, {}
    if not (spec.on_policy or (bypass_mode(cfg) and not spec.shared)):
        with_spp = spec.needs("sum_pi_squared")
        policy = policy_params(cfg, state)
        replaying = router_replay.replayed(rows) is not None  # R3: the rollout's experts
        with_experts = replaying or router_replay.records_old(cfg)
        moe_outputs = _moe_outputs(rows, with_experts=with_experts)
        old = forward(
            spec,
            spec.model_cfg,
            policy,
            rows,
            "log_prob",
            with_sum_pi_squared=with_spp,
            **moe_outputs,
        )
        out["old_log_prob"] = old["log_prob"]
        if with_spp:
            out["sum_pi_squared"] = old["sum_pi_squared"]
        own = tuple(old.get(k) for k in router_replay.KEYS)
        if replaying:
            out["routing_mismatch"] = router_replay.mismatch_counts(rows, own)
        elif with_experts:  # R2: what the update replays
            out.update(zip(router_replay.KEYS, own))
    if needs_reference(cfg):
        ref = forward(spec, spec.model_cfg, reference_params(cfg, state), rows, "log_prob")
        out["ref_log_prob"] = ref["log_prob"]
    if spec.use_critic and spec.shared:
        out["values"] = old["values"]
    elif spec.use_critic:
        critic_params = with_base(cfg, state.ref_params, state.critic_params)
        out["values"] = forward(spec, spec.critic_cfg, critic_params, rows, "log_prob")["values"]
    return out


def compute_advantages(spec: StepSpec, state: TrainState, exp: Batch):
    """Phase 2 (see above): the scoring forwards, then `estimate_advantages`. Under routing
    replay, with an old-log-prob forward, its `router_replay/*` metrics (`replay_metrics`)."""
    cfg, mask = spec.cfg, exp["response_mask"]
    names = ("input_ids", "attention_mask", "response_ids", "response_mask", "response_valid")
    rows = {k: exp[k] for k in (*names, *router_replay.KEYS) if k in exp}
    score = lambda r: score_forwards(spec, state, r)
    scored = batching.in_micro_batches(score, rows, spec.batching["log_prob"])
    scored = jax.lax.stop_gradient(scored)
    mismatch = scored.pop("routing_mismatch", None)
    metrics = {}
    if router_replay.mode(cfg) != "disabled" and "old_log_prob" in scored:
        metrics = replay_metrics(spec, mismatch, scored["old_log_prob"], exp)
    exp = {**exp, **scored}
    if spec.use_critic:
        exp["values"] = exp["values"] * mask
    if bypass_mode(cfg):
        exp["old_log_prob"] = exp["rollout_log_prob"] * mask
    exp, adv_metrics, state = estimate_advantages(spec, state, exp)
    return exp, {**metrics, **adv_metrics}, state


def replay_metrics(spec: StepSpec, mismatch, log_prob, rows: Batch, tokens=None) -> dict:
    """`router_replay.metrics` of rows scored by `log_prob` (the old forward's, or the
    on-policy update's own) against the rollout's log-probs; `mismatch`: the rows' summed
    `mismatch_counts` (R3) or None."""
    layers = len(spec.model_cfg.sparse_layers())
    rollout_log_prob, mask = rows["rollout_log_prob"], rows["response_mask"]
    return router_replay.metrics(mismatch, layers, log_prob, rollout_log_prob, mask, tokens)


def estimate_advantages(spec: StepSpec, state: TrainState, exp: Batch):
    """Phase 2 after its forwards, in verl 0.9.1's trainer order: the score on each row's last
    token, KL in the reward (over the response mask), rollout correction (IS weights; rejection
    gives the losses, the whitening, the critic and the metrics a new mask, `policy_mask`), then
    the estimator. The rewards stay zeroed with the mask from before rejection (`reward_mask`):
    a group estimator sums a rejected row's score into its group, as verl's do; the token-level
    ones drop rewards on rejected tokens, as verl's do (docs/algorithms.md#rollout-correction).
    `exp` holds the rollout, its scores and the forwards' outputs (`old_log_prob`, ...)."""
    cfg, algo, exp = spec.cfg, spec.cfg.algorithm, dict(exp)
    mask = exp["response_mask"]
    b = mask.shape[0]
    metrics = {}
    token_level_scores = shaping.last_token_scores(exp["scores"], mask)
    token_level_rewards, kl_coef = token_level_scores, state.kl_coef
    if algo.use_kl_in_reward:
        token_level_rewards, kl_metrics = kl_lib.apply_kl_penalty(
            token_level_scores,
            exp["old_log_prob"],
            exp["ref_log_prob"],
            mask,
            state.kl_coef,
            algo.kl_penalty,
        )
        metrics.update(kl_metrics)
        kl_coef = spec.kl_controller(state.kl_coef, kl_metrics["actor/reward_kl_penalty"], b)
    if algo.rollout_correction.enable and not bypass_mode(cfg):
        # verl's order: after KL in the reward, before the advantages
        settings = rollout_corr.settings(algo.rollout_correction)
        weights, mask, corr_metrics = rollout_corr.correct(
            exp["old_log_prob"], exp["rollout_log_prob"], mask, settings
        )
        metrics.update(corr_metrics)
        exp["policy_mask"] = mask  # the rejection-masked response_mask of the losses
        if weights is not None:
            exp["rollout_is_weights"] = weights
    # every estimator input there is, by name (`advantages.INPUTS`); each reads its own
    index = jnp.arange(b, dtype=jnp.int32) // spec.n  # the prompt (group) of each row
    given = {**exp, "index": index, "threshold": state.group_threshold}
    inputs = {k: given[k] for k in adv_lib.INPUTS if k in given}
    adv = spec.estimator(
        token_level_rewards=token_level_rewards,
        response_mask=mask,
        reward_mask=exp["response_mask"],
        **inputs,
    )
    metrics.update(adv["metrics"])
    exp.update(
        token_level_rewards=token_level_rewards,
        advantages=adv["advantages"],
        returns=adv["returns"],
        critic_mask=adv["critic_mask"],  # where the value loss applies (GROUP-PPO: segments)
    )
    return exp, metrics, state.replace(kl_coef=kl_coef, group_threshold=adv["next_threshold"])


# ---------------------------------------------------------------------------------------------
# Phase 3, update(spec, state, experience, key, ok) -> (state, metrics): ppo_epochs passes of
# shuffled mini-batch updates (`lax.scan`) of the policy and the critic.


def policy_terms(spec: StepSpec, out: Batch, mb: Batch, counts, key):
    """Policy loss (+ KL loss - entropy bonus) of a (micro-)batch from the forward `out`;
    `counts` normalise by the whole mini-batch (`losses.batch_counts`); `key` is the loss's
    own randomness (clip_cov's choice of tokens)."""
    actor = spec.cfg.actor
    mask = mb.get("policy_mask", mb["response_mask"])  # rejection-masked under correction
    on_policy = spec.on_policy
    old_log_prob = jax.lax.stop_gradient(out["log_prob"]) if on_policy else mb["old_log_prob"]
    pg_loss, metrics = spec.policy_loss(
        old_log_prob,
        out["log_prob"],
        mb["advantages"],
        mask,
        counts=counts,
        rollout_is_weights=mb.get("rollout_is_weights"),
        key=key,
    )
    aggregate = lambda x: losses.agg_loss(
        x, mask, actor.loss_agg_mode, actor.loss_scale_factor or None, counts
    )
    entropy = aggregate(out["entropy"])
    loss = pg_loss - actor.entropy_coeff * entropy
    metrics = {**metrics, "actor/pg_loss": pg_loss, "actor/entropy": entropy}
    if actor.use_kl_loss:
        kl = kl_lib.kl_penalty(out["log_prob"], mb["ref_log_prob"], actor.kl_loss_type)
        kl_loss = aggregate(kl)
        loss = loss + actor.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss
    return loss, metrics


def value_terms(spec: StepSpec, out: Batch, mb: Batch, counts):
    """verl's clipped value loss of a (micro-)batch and its metrics."""
    critic = spec.cfg.critic
    vf_loss, vf_clipfrac = losses.value_loss(
        out["values"],
        mb["returns"],
        mb["values"],
        mb["critic_mask"],
        critic.cliprange_value,
        critic.loss_agg_mode,
        counts,
    )
    metrics = {
        "critic/vf_loss": vf_loss,
        "critic/vf_clipfrac": vf_clipfrac,
        "critic/vpred_mean": losses.token_mean(out["values"], mb["critic_mask"], counts),
    }
    return vf_loss, metrics


def actor_loss(params, mb: Batch, spec: StepSpec, counts, base, actor_on, key):
    """The policy's loss (with the value loss when the critic shares its backbone). `base`: the
    frozen base under LoRA (`params` are then the adapters), else None. `actor_on` (0 / 1): 0
    during critic warm-up, when only a shared value head's loss trains the network. `key`: the
    micro-batch's randomness, split between LoRA dropout and the policy loss (clip_cov), so no
    draw of one is a draw of the other.

    A mixture-of-experts policy replays the experts the mini-batch carries (routing replay)
    and, with actor.router_aux_loss_coef, adds that times its router's load-balancing loss (of
    this micro-batch's forward, a 1 / micro-batches share of it: the sum is their mean)."""
    cfg = spec.cfg
    dropout_key, loss_key = jax.random.split(key)
    full = with_base(cfg, base, params, dropout_key)
    aux_coef = cfg.actor.router_aux_loss_coef
    # the on-policy update's forward is the step's old one: the routing-replay metrics' source
    replay_metrics_on = spec.on_policy and router_replay.mode(cfg) != "disabled"
    compared = replay_metrics_on and router_replay.records_rollout(cfg)  # R3: own vs recorded
    out = forward(
        spec,
        spec.model_cfg,
        full,
        mb,
        "actor",
        with_entropy=True,
        **_moe_outputs(mb, with_experts=compared, with_aux_loss=aux_coef != 0),
    )
    loss, metrics = policy_terms(spec, out, mb, counts["policy"], loss_key)
    if aux_coef:
        aux = out["router_aux_loss"] / spec.batching["actor"].micro
        loss = loss + aux_coef * aux
        metrics["actor/router_aux_loss"] = aux
    if replay_metrics_on:
        own = tuple(out.get(k) for k in router_replay.KEYS)
        mismatch = router_replay.mismatch_counts(mb, own) if compared else None
        log_prob = jax.lax.stop_gradient(out["log_prob"])
        metrics.update(replay_metrics(spec, mismatch, log_prob, mb, counts.get("routing")))
    if spec.shared:
        vf_loss, vf_metrics = value_terms(spec, out, mb, counts["value"])
        loss = actor_on * loss + spec.cfg.critic.vf_coef * vf_loss
        metrics.update(vf_metrics)
    return loss, metrics


def critic_loss(critic_params, mb: Batch, spec: StepSpec, counts, base, key):
    full = with_base(spec.cfg, base, critic_params, key)
    out = forward(spec, spec.critic_cfg, full, mb, "critic")
    return value_terms(spec, out, mb, counts["value"])


def mini_batch_counts(spec: StepSpec, mb: Batch) -> dict:
    """The whole mini-batch's normalisers of the losses; under rejection (verl's trainer): the
    tokens left, but every response row for the seq-mean modes. With the on-policy update's
    routing-replay metrics (R3), its recorded real tokens (`routing`)."""
    counts = {"policy": losses.batch_counts(mb.get("policy_mask", mb["response_mask"]))}
    counts["policy"]["seqs"] = losses.batch_counts(mb["response_mask"])["seqs"]
    if spec.use_critic:
        counts["value"] = losses.batch_counts(mb["critic_mask"])
    if spec.on_policy and router_replay.records_rollout(spec.cfg):
        counts["routing"] = router_replay.recorded_tokens(mb)
    return counts


def update_minibatch(spec: StepSpec, carry, xs):
    """One optimizer update of the policy (and the critic) on a mini-batch `xs` = (rows, key).
    carry = (state, actor_on, ok): the policy is updated only if `actor_on` (past
    critic.critic_warmup; verl skips the actor's update entirely, weight decay and Adam's
    count included); under the NaN guard (`ok` not None) nothing is applied unless everything
    so far is finite."""
    state, actor_on, ok = carry
    mb, key = xs
    actor_key, critic_key = jax.random.split(key)  # policy and critic draw their own masks
    counts = mini_batch_counts(spec, mb)
    base = state.ref_params if lora_on(spec.cfg) else None

    def grads_of(role, loss_fn, params, *args, key):  # summed over the role's micro-batches
        b = spec.batching[role]
        return batching.accumulate_grads(loss_fn, params, mb, b, spec, counts, base, *args, key=key)

    grads, metrics = grads_of("actor", actor_loss, state.params, actor_on, key=actor_key)
    metrics["actor/grad_norm"] = optax.tree.norm(grads)
    critic_grads = None
    if spec.use_critic and not spec.shared:
        critic_grads, critic_metrics = grads_of(
            "critic", critic_loss, state.critic_params, key=critic_key
        )
        critic_metrics["critic/grad_norm"] = optax.tree.norm(critic_grads)
        metrics.update(critic_metrics)
    if ok is not None:
        ok = ok & nan_guard.all_finite(metrics)
    apply_actor = ok
    # a shared backbone trains through the value loss during warm-up (its pg loss is zeroed)
    if spec.cfg.critic.critic_warmup > 0 and not spec.shared:
        apply_actor = actor_on if ok is None else ok & actor_on
    params, opt_state = nan_guard.apply_grads(
        spec.tx, grads, state.params, state.opt_state, apply_actor
    )
    state = state.replace(params=params, opt_state=opt_state)
    if critic_grads is not None:
        critic_params, critic_opt_state = nan_guard.apply_grads(
            spec.critic_tx, critic_grads, state.critic_params, state.critic_opt_state, ok
        )
        state = state.replace(critic_params=critic_params, critic_opt_state=critic_opt_state)
    return (state, actor_on, ok), metrics


def update(spec: StepSpec, state: TrainState, exp: Batch, key, ok=None):
    """Phase 3 (see above). `ok` (the NaN guard: are the reward and advantages finite?) None:
    every update is applied; else an update is applied only if `ok` and it and every update
    before it in this step are finite."""
    actor, cfg = spec.cfg.actor, spec.cfg
    keys = ["input_ids", "attention_mask", "response_ids", "response_mask", "advantages"]
    keys += [] if spec.on_policy else ["old_log_prob"]
    keys += [k for k in ("response_valid", "policy_mask", "rollout_is_weights") if k in exp]
    keys += [k for k in router_replay.KEYS if k in exp]  # replayed (routing replay)
    if spec.on_policy and router_replay.mode(cfg) != "disabled":  # for the replay metrics
        keys += ["rollout_log_prob"]
    keys += ["ref_log_prob"] if needs_reference(cfg) else []
    keys += ["values", "returns", "critic_mask"] if spec.use_critic else []
    data = {k: exp[k] for k in keys}
    b = exp["response_mask"].shape[0]
    mb_rows = actor.ppo_mini_batch_size * spec.n
    num_mb = b // mb_rows
    actor_on = state.step >= cfg.critic.critic_warmup

    # Mini-batches of rows drawn at random; but a shared-prompt update (`batching.prompt_groups`)
    # has one mini-batch, whose row order changes nothing but the summation: rollout order, group
    # by group.
    grouped = spec.batching["actor"].group > 1 or spec.batching["critic"].group > 1

    def epoch(carry, key):
        perm = jnp.arange(b) if grouped else jax.random.permutation(key, b)
        mbs = jax.tree_util.tree_map(lambda x: x[perm].reshape(num_mb, mb_rows, *x.shape[1:]), data)
        mb_keys = jax.random.split(jax.random.fold_in(key, 1), num_mb)  # fresh at every update
        return jax.lax.scan(functools.partial(update_minibatch, spec), carry, (mbs, mb_keys))

    (state, _, _), metrics = jax.lax.scan(
        epoch, (state, actor_on, ok), jax.random.split(key, actor.ppo_epochs)
    )
    return state, jax.tree_util.tree_map(jnp.mean, metrics)


def make_phases(*args, **kwargs):
    """The three phases bound to the config's `StepSpec` (the arguments are `make_spec`'s):
    (generate, compute_advantages, update). The fused step chains them; the benchmark jits them
    one by one to time each."""
    spec = make_spec(*args, **kwargs)
    return tuple(functools.partial(f, spec) for f in (generate, compute_advantages, update))


# ---------------------------------------------------------------------------------------------
# The fused step.


def rl_step(spec: StepSpec, state: TrainState, prompts: Batch):
    """One RL step: (state, prompts) -> (next state, metrics); see `make_step`."""
    key, k_roll, k_shuffle = jax.random.split(state.key, 3)
    exp, metrics = generate(spec, state, prompts, k_roll)
    exp, adv_metrics, scored_state = compute_advantages(spec, state, exp)
    metrics.update(adv_metrics)
    metrics.update(step_metrics.experience_metrics(exp, spec.max_new_tokens))
    # NaN / Inf guard: no update is applied when the reward or advantages are not finite,
    # nor from the first mini-batch whose loss or gradient is not finite on (`update`).
    guard = nan_guard.all_finite(metrics) if spec.cfg.nan_guard.enable else None
    new_state, update_metrics = update(spec, scored_state, exp, k_shuffle, guard)
    metrics.update(update_metrics)
    # the learning rates of this step's first update
    metrics.update(learning_rates(spec.cfg, state, spec.shared, "values" in exp))
    new_state, metrics = nan_guard.settle(spec.cfg, state, new_state, metrics)
    return new_state.replace(step=state.step + 1, key=key), metrics


def make_step(*args, **kwargs):
    """`step(state, prompts) -> (state, metrics)`, one function for `jax.jit`; `prompts` holds
    `prompts_per_step(cfg)` rows of the task batch. The arguments are `make_spec`'s."""
    return functools.partial(rl_step, make_spec(*args, **kwargs))
