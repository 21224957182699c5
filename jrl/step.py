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
chains them and `make_step` binds it to a spec.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax

from jax.sharding import PartitionSpec

from jrl import config as config_lib
from jrl import rollout, sharding
from jrl.algos import advantages as adv_lib
from jrl.algos import group_ppo as group_lib
from jrl.algos import kl as kl_lib
from jrl.algos import losses
from jrl.algos import rollout_corr
from jrl.models import attention as attention_lib
from jrl.models import lora as lora_lib
from jrl.models import transformer

Batch = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    """Everything that changes across steps (so a checkpoint of it resumes a run exactly)."""

    step: jax.Array  # int32 scalar: RL steps taken
    params: Any  # policy parameters (with the value head when the critic shares the backbone)
    opt_state: Any  # policy optimizer state
    critic_params: Any  # separate critic (None without a critic or with a shared backbone)
    critic_opt_state: Any  # its optimizer state (None likewise)
    ref_params: Any  # frozen reference policy (None when neither KL loss nor KL reward is
    # used); with LoRA the frozen base, which is also the reference (adapters off)
    kl_coef: jax.Array  # float32 scalar: beta of KL-in-reward (its controller's state)
    group_threshold: jax.Array  # float32 scalar: GROUP-PPO's adaptive threshold tau
    skipped_steps: jax.Array  # int32 scalar: steps not applied because something was not finite
    key: jax.Array  # PRNG key


def needs_reference(cfg: ml_collections.ConfigDict) -> bool:
    return bool(cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def needs_critic(cfg: ml_collections.ConfigDict) -> bool:
    """Estimators that take `values` (gae, group_ppo) train a critic."""
    return "values" in adv_lib.needs(cfg.algorithm.adv_estimator)


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
    the rollout's before the advantages, as verl; bypass mode uses the rollout's instead), or
    values from a value head on the policy's own forward."""
    return (
        cfg.actor.ppo_epochs == 1
        and cfg.data.train_batch_size == cfg.actor.ppo_mini_batch_size
        and not cfg.algorithm.use_kl_in_reward
        and "old_log_prob" not in adv_lib.needs(cfg.algorithm.adv_estimator)
        and not cfg.algorithm.rollout_correction.enable
        and not (needs_critic(cfg) and cfg.critic.share_backbone)
    )


def model_configs(cfg, model_cfg: transformer.ModelConfig):
    """(policy model config, separate critic model config or None). With
    `critic.share_backbone` the policy network carries the value head itself."""
    if not needs_critic(cfg):
        return model_cfg, None
    if cfg.critic.share_backbone:
        return dataclasses.replace(model_cfg, value_head=True), None
    return model_cfg, dataclasses.replace(model_cfg, lm_head=False, value_head=True)


def _adamw(opt_cfg, lr_schedule_fn) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(opt_cfg.grad_clip),
        optax.adamw(
            lr_schedule_fn,
            b1=opt_cfg.betas[0],
            b2=opt_cfg.betas[1],
            weight_decay=opt_cfg.weight_decay,
        ),
    )


def lr_schedule(opt_cfg) -> optax.Schedule:
    """Learning rate per optimizer update: linear warm-up over `lr_warmup_steps`, then constant."""
    if opt_cfg.lr_warmup_steps <= 0:
        return optax.constant_schedule(opt_cfg.lr)
    return optax.linear_schedule(0.0, opt_cfg.lr, opt_cfg.lr_warmup_steps)


def make_optimizer(opt_cfg) -> optax.GradientTransformation:
    """AdamW with linear warm-up to a constant rate and global-norm clipping (verl's defaults);
    `opt_cfg` is the `actor` or the `critic` section."""
    return _adamw(opt_cfg, lr_schedule(opt_cfg))


def updates_per_step(cfg: ml_collections.ConfigDict) -> int:
    return cfg.actor.ppo_epochs * (cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size)


def init_state(cfg, model_cfg: transformer.ModelConfig, params, key) -> TrainState:
    """The first train state. `model_cfg` and `params` are the policy's (see `model_configs`); a
    separate critic starts from the policy's weights plus a fresh value head."""
    _, critic_cfg = model_configs(cfg, model_cfg)
    key, key_critic = jax.random.split(key)
    critic_params = critic_opt_state = None
    if lora_on(cfg):
        params, critic_params, ref = init_lora(cfg, critic_cfg, params, key_critic)
    else:
        if critic_cfg is not None:
            head = transformer.init_params(critic_cfg, key_critic)
            critic_params = {k: params.get(k, v) for k, v in head.items()}  # backbone from policy
            critic_params = jax.tree_util.tree_map(jnp.copy, critic_params)
        ref = jax.tree_util.tree_map(jnp.copy, params) if needs_reference(cfg) else None
    if critic_params is not None:
        critic_opt_state = make_optimizer(cfg.critic).init(critic_params)
    return TrainState(
        step=jnp.int32(0),
        params=params,
        opt_state=make_optimizer(cfg.actor).init(params),
        critic_params=critic_params,
        critic_opt_state=critic_opt_state,
        ref_params=ref,
        kl_coef=jnp.float32(cfg.algorithm.kl_ctrl.kl_coef),
        group_threshold=group_lib.init_threshold(cfg.algorithm),
        skipped_steps=jnp.int32(0),
        key=key,
    )


# ---------------------------------------------------------------------------------------------
# LoRA (jrl/models/lora.py): `params` / `critic_params` hold only what trains (adapters and value
# heads, float32), `ref_params` the frozen base (model.dtype), shared by policy, critic and the
# KL reference (the base with the adapters off). Without LoRA these are the identity.


def lora_on(cfg) -> bool:
    return bool(cfg.lora.rank)


def init_lora(cfg, critic_cfg, params, key):
    """(policy trainable, critic trainable or None, base) of a LoRA run starting from `params`."""
    base, trainable = lora_lib.init_trainable(params, cfg.lora, jax.random.fold_in(key, 1))
    critic = None
    if critic_cfg is not None:  # its own adapters on the same base, and a fresh value head
        _, head = lora_lib.split(transformer.init_params(critic_cfg, key))
        _, critic = lora_lib.init_trainable(base, cfg.lora, jax.random.fold_in(key, 2))
        critic.update(head)
    return trainable, critic, base


def _with_base(cfg, base, trainable, dropout_key=None):
    """The full params of a model from its trainable part (see `init_lora`); with a
    `dropout_key` (the update's training forwards) and lora.dropout > 0 the adapters' inputs are
    dropped (`lora.with_dropout`)."""
    if not lora_on(cfg) or trainable is None:
        return trainable
    full = lora_lib.combine(base, trainable, lora_lib.scale(cfg.lora))
    return lora_lib.with_dropout(full, cfg.lora.dropout, dropout_key)


def lora_dropout_on(cfg) -> bool:
    """Whether the update's forwards drop adapter inputs (LoRA with lora.dropout > 0)."""
    return lora_on(cfg) and cfg.lora.dropout > 0


def policy_params(cfg, state: TrainState):
    """The policy's full params (with LoRA: base + adapters)."""
    return _with_base(cfg, state.ref_params, state.params)


def reference_params(cfg, state: TrainState):
    """The KL reference's params (with LoRA: the policy with its adapters off, no copy)."""
    if not lora_on(cfg):
        return state.ref_params
    return lora_lib.reference(state.ref_params, state.params)


def state_axes(cfg, abstract_state: TrainState, policy_axes, critic_axes=None) -> dict:
    """`jrl.sharding.state_shardings`' logical axes of a train state, from the full models' axes
    (`transformer.logical_axes`): with LoRA those of the trainable trees and of the base."""
    if not lora_on(cfg):
        return dict(policy_axes=policy_axes, critic_axes=critic_axes)
    critic = abstract_state.critic_params
    return dict(
        policy_axes=lora_lib.trainable_axes(policy_axes, abstract_state.params),
        critic_axes=None if critic is None else lora_lib.trainable_axes(critic_axes, critic),
        reference_axes={k: policy_axes[k] for k in abstract_state.ref_params},
    )


# ---------------------------------------------------------------------------------------------


def token_log_probs(
    model_cfg,
    hidden_BLH,
    head,
    targets_BL,
    temperature: float = 1.0,
    with_entropy=False,
    entropy_grad=True,
    with_sum_pi_squared=False,
):
    """(log softmax(logits / T)[target] [B, L], entropy of softmax(logits / T) [B, L] or None),
    plus sum_v softmax(logits / T)_v^2 [B, L] (no gradient) when `with_sum_pi_squared`,
    float32, with logits = `transformer.lm_logits(hidden, head)`. `entropy_grad=False`: the
    entropy is a value only (a metric), no gradient flows through it, so the backward skips its
    [B, L, V] work. With `logits_chunk_size` c set,
    the [B, L, V] logits never exist: positions go c at a time through a `lax.map` whose body is
    rematerialised, so the forward holds one chunk's [B, c, V] logits and the backward recomputes
    them chunk by chunk (the head's gradient accumulates over chunks)."""

    def chunk(h_BCH, t_BC):
        # Written around one [B, c, V] array, the logits: the log-partition and the entropy are
        # reductions over it (log_softmax would materialise a second one, its entropy a third).
        h_BCH = sharding.constrain(h_BCH, PartitionSpec("batch"))  # rows stay split (a mesh)
        logits = transformer.lm_logits(model_cfg, h_BCH, head) / temperature
        log_z = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take_along_axis(logits, t_BC[..., None], -1)[..., 0] - log_z
        extra = ()
        if with_sum_pi_squared:
            p = jax.lax.stop_gradient(jnp.exp(logits - log_z[..., None]))
            extra = (jnp.sum(p * p, axis=-1),)
        if not with_entropy:
            return (logp, None, *extra)
        if not entropy_grad:
            logits, log_z = jax.lax.stop_gradient((logits, log_z))
        p = jnp.exp(logits - log_z[..., None])  # H = log Z - sum_v p_v logit_v (finite logits)
        return (logp, log_z - jnp.sum(p * logits, axis=-1), *extra)

    b, l, _ = hidden_BLH.shape
    c = model_cfg.logits_chunk_size
    if not c or c >= l:
        return chunk(hidden_BLH, targets_BL)
    pad = -l % c  # the last chunk is padded (its extra positions are dropped)
    hidden_BLH = jnp.pad(hidden_BLH, ((0, 0), (0, pad), (0, 0)))
    targets_BL = jnp.pad(targets_BL, ((0, 0), (0, pad)))
    to_chunks = lambda x: jnp.moveaxis(x.reshape(b, -1, c, *x.shape[2:]), 1, 0)
    from_chunks = lambda x: None if x is None else jnp.moveaxis(x, 0, 1).reshape(b, -1)[:, :l]
    out = jax.lax.map(
        lambda xs: jax.checkpoint(chunk)(*xs), (to_chunks(hidden_BLH), to_chunks(targets_BL))
    )
    return tuple(from_chunks(x) for x in out)


def response_outputs(
    model_cfg,
    params,
    prompt_ids_BP,
    prompt_mask_BP,
    response_ids_BR,
    response_mask_BR,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    with_sum_pi_squared: bool = False,
    group: int = 1,
) -> dict[str, jax.Array]:
    """One forward over prompt + response. Returns, for response positions [B, R] (verl alignment):
    `log_prob` = log pi(y_t | prompt, y_<t) under softmax(logits / T) (with an lm head),
    `entropy` of that distribution (if asked; without a gradient unless `entropy_grad`),
    `values` = V(prompt, y_<t) (with a value head), `sum_pi_squared` = sum_v pi(v)^2 (if asked).
    Logits are taken `model_cfg.logits_chunk_size` positions at a time (`token_log_probs`).
    `group` = n > 1: every n consecutive rows share their prompt (a GRPO group); where
    `grouped_forward_suits`, each prompt then runs once (`transformer.grouped_response_forward`;
    responses padded only after their last real token, as the rollout writes them)."""
    p, length = prompt_ids_BP.shape[1], prompt_ids_BP.shape[1] + response_ids_BR.shape[1]
    if group > 1 and grouped_forward_suits(model_cfg, length):
        prompts = slice(None, None, group)  # the first row of each group
        hidden, head, values, _ = transformer.grouped_response_forward(
            model_cfg, params, prompt_ids_BP[prompts], prompt_mask_BP[prompts], response_ids_BR
        )
    else:
        ids = jnp.concatenate([prompt_ids_BP, response_ids_BR], axis=1)
        mask = jnp.concatenate([prompt_mask_BP, response_mask_BR], axis=1)
        hidden, head, values, _ = transformer.full_forward(model_cfg, params, ids, mask)
        hidden, values = hidden[:, p - 1 : -1], None if values is None else values[:, p - 1 : -1]
    out = {}
    if head is not None:
        log_prob, entropy, *extra = token_log_probs(
            model_cfg,
            hidden,
            head,
            response_ids_BR,
            temperature,
            with_entropy,
            entropy_grad,
            with_sum_pi_squared,
        )
        out["log_prob"] = log_prob
        if with_entropy:
            out["entropy"] = entropy
        if with_sum_pi_squared:
            out["sum_pi_squared"] = extra[0]
    if values is not None:
        out["values"] = values
    return out


def grouped_forward_suits(model_cfg, length: int) -> bool:
    """Whether a forward of `length` tokens per row may run each group's prompt once: without
    remat (the grouped forward runs the layers one by one, as the rollout does) and where the
    full forward's attention would be the materialised "xla" one (short rows: the grouped
    forward attends through a [rows, R, P + R] mask, no more memory than that)."""
    impl = attention_lib.resolve_implementation(
        model_cfg.attention,
        seq_len=length,
        head_dim=model_cfg.head_size,
        dtype=model_cfg.dtype,
        softcap=model_cfg.attn_logit_softcapping,
        block_size=model_cfg.attention_block_size,
    )
    return model_cfg.remat == "none" and impl == "xla"


def prompt_group(cfg: ml_collections.ConfigDict, micro: dict[str, int]) -> dict[str, int]:
    """Rows per prompt that the forwards of "log_prob", "actor" and "critic" share
    (`model.shared_prompt_forward`): n when it is on and every micro-batch of that forward
    (`micro_batch_counts`) holds whole groups, else 1. In the update only with one mini-batch per
    epoch (several are drawn row by row, as before: in the default demo, mini-batches of whole
    groups learnt less) and without LoRA dropout (a mask per row, prompt included)."""
    n = cfg.rollout.n
    prompts = {
        "log_prob": cfg.data.train_batch_size,
        "actor": cfg.actor.ppo_mini_batch_size,
        "critic": cfg.actor.ppo_mini_batch_size,
    }
    on = cfg.model.shared_prompt_forward and n > 1
    one_mini_batch = cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
    update_ok = one_mini_batch and not lora_dropout_on(cfg)
    suits = {"log_prob": True, "actor": update_ok, "critic": update_ok}
    whole = lambda name: prompts[name] % micro[name] == 0
    return {name: n if on and whole(name) and suits[name] else 1 for name in micro}


def response_logprobs(
    model_cfg,
    params,
    prompt_ids,
    prompt_mask,
    response_ids,
    response_mask,
    temperature: float = 1.0,
):
    """log pi(y_t | prompt, y_<t) [B, R] (see `response_outputs`)."""
    return response_outputs(
        model_cfg, params, prompt_ids, prompt_mask, response_ids, response_mask, temperature
    )["log_prob"]


def last_token_scores(scores_B, response_mask_BR):
    """token_level_scores [B, R]: the sequence score placed on the last valid response token."""
    last = jnp.sum(response_mask_BR, -1) - 1
    return jax.nn.one_hot(last, response_mask_BR.shape[1], dtype=jnp.float32) * scores_B[:, None]


def overlong_penalty(length_B, max_new_tokens: int, buffer_len: int, penalty_factor: float):
    """DAPO's soft overlong punishment: 0 up to R - buffer_len tokens, then falling linearly to
    -penalty_factor at R: min(-(len - (R - buffer_len)) / buffer_len * factor, 0)."""
    exceed = length_B.astype(jnp.float32) - (max_new_tokens - buffer_len)
    return jnp.minimum(-exceed / buffer_len * penalty_factor, 0.0)


def group_has_signal(scores_B, n: int):
    """[B / n] bool: the group's scores are not all equal (DAPO dynamic sampling keeps these)."""
    g = scores_B.reshape(-1, n)
    return jnp.max(g, -1) > jnp.min(g, -1)


def _stats(name, x, mask=None):
    """verl-style mean / max / min of x over valid entries."""
    if mask is None:
        mask = jnp.ones_like(x)
    mask = mask.astype(bool)
    big = jnp.finfo(jnp.float32).max
    return {
        f"{name}/mean": jnp.sum(jnp.where(mask, x, 0)) / jnp.maximum(jnp.sum(mask), 1),
        f"{name}/max": jnp.max(jnp.where(mask, x, -big)),
        f"{name}/min": jnp.min(jnp.where(mask, x, big)),
    }


def _select(pred, on_true, on_false):
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def all_finite(metrics: dict) -> jax.Array:
    """Whether every quantity of GUARDED_METRICS present in `metrics` is finite (bool scalar)."""
    return jnp.all(jnp.stack([jnp.isfinite(metrics[k]) for k in GUARDED_METRICS if k in metrics]))


# Quantities whose non-finite value makes the NaN guard skip a step (in this order of blame).
GUARDED_METRICS = (
    "critic/score/mean",
    "critic/advantages/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/grad_norm",
)


def prompts_per_step(cfg: ml_collections.ConfigDict) -> int:
    """Prompts the host feeds one step: B_p, or a pool of max_num_gen_batches * B_p under DAPO's
    dynamic sampling (each generation round draws fresh prompts from it)."""
    fg = cfg.algorithm.filter_groups
    return cfg.data.train_batch_size * (fg.max_num_gen_batches if fg.enable else 1)


def micro_batch_counts(cfg: ml_collections.ConfigDict, mesh=None) -> dict[str, int]:
    """How many micro-batches each forward / backward is split into (verl's sizes, in rows per
    device): "log_prob" (old / reference log-probs and values of a step's B rows,
    rollout.log_prob_micro_batch_size_per_device), "actor" and "critic" (a mini-batch's rows,
    actor / critic.ppo_micro_batch_size_per_device). A size of 0 means one micro-batch. Raises
    ConfigError, naming the field and the fix, when a size does not divide the rows a device
    holds (rows over the mesh's batch axes; no mesh: one device)."""
    n = cfg.rollout.n
    sizes = {
        "log_prob": ("rollout.log_prob_micro_batch_size_per_device", cfg.data.train_batch_size * n),
        "actor": ("actor.ppo_micro_batch_size_per_device", cfg.actor.ppo_mini_batch_size * n),
        "critic": ("critic.ppo_micro_batch_size_per_device", cfg.actor.ppo_mini_batch_size * n),
    }
    counts = {}
    for name, (field, rows) in sizes.items():
        size = cfg[field.split(".")[0]][field.split(".")[1]]
        per_device = (
            rows if mesh is None else sharding.batch_sharding(mesh, rows).shard_shape((rows,))[0]
        )
        if size < 0 or (size and per_device % size):
            raise config_lib.ConfigError(
                f"{field}={size} does not divide the {per_device} rows each device holds "
                f"({rows} rows over {rows // per_device} device(s)); use a divisor of "
                f"{per_device}, or 0 for one micro-batch."
            )
        counts[name] = per_device // size if size else 1
    return counts


def split_rows(tree, k: int, group: int = 1):
    """[rows, ...] -> [k, rows / k, ...] in blocks of `group` consecutive rows: micro-batch i
    holds blocks i, i + k, i + 2k, ..., so each is spread over the devices like the whole batch
    (pinned there under a mesh) and keeps a group's rows together."""

    def split(x):
        blocks = x.reshape(x.shape[0] // (k * group), k, group, *x.shape[1:]).swapaxes(0, 1)
        return blocks.reshape(k, -1, *x.shape[1:])

    return sharding.constrain(jax.tree.map(split, tree), PartitionSpec(None, "batch"))


def join_rows(tree, group: int = 1):
    """The inverse of `split_rows`."""

    def join(x):
        k = x.shape[0]
        blocks = x.reshape(k, -1, group, *x.shape[2:]).swapaxes(0, 1)
        return blocks.reshape(-1, *x.shape[2:])

    return jax.tree.map(join, tree)


def in_micro_batches(fn: Callable, rows, k: int, group: int = 1):
    """fn(rows) computed k micro-batches at a time (`lax.map`), results in row order."""
    if k == 1:
        return fn(rows)
    return join_rows(jax.lax.map(fn, split_rows(rows, k, group)), group)


def accumulate_grads(loss_fn: Callable, params, batch, k: int, *args, key=None, group: int = 1):
    """(gradient, metrics) of `loss_fn(params, batch, *args) -> (loss, metrics)` over `batch` in k
    micro-batches: one forward / backward each (`lax.scan`), gradients summed in float32. The loss
    and every metric of a micro-batch must be its share of the whole batch's (normalised by the
    whole batch: `losses.batch_counts`), so the sums equal the whole batch's. With a `key` (LoRA
    dropout) micro-batch i gets `loss_fn(..., key=split(key, k)[i])`. `group`: see `split_rows`."""
    grad_fn = jax.grad(loss_fn, has_aux=True)
    keys = None if key is None else jax.random.split(key, k)
    with_key = lambda kk: {} if kk is None else {"key": kk}
    if k == 1:
        return grad_fn(params, batch, *args, **with_key(None if keys is None else keys[0]))

    def micro(acc, xs):
        mb, kk = xs
        grads, metrics = grad_fn(params, mb, *args, **with_key(kk))
        return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads), metrics

    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    grads, metrics = jax.lax.scan(micro, zeros, (split_rows(batch, k, group), keys))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return grads, jax.tree.map(lambda m: jnp.sum(m, axis=0), metrics)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What the phases of a step read, fixed once from the config (static at trace time): the
    models, the sampling settings, the micro-batch counts, and the maths of the config's
    variants bound to their settings (`losses.make_policy_loss`, `advantages.make_estimator`,
    `kl.make_kl_controller`). Built by `make_spec`; every phase takes it as its first argument."""

    cfg: ml_collections.ConfigDict
    model_cfg: transformer.ModelConfig  # the policy's (see `model_configs`)
    critic_cfg: transformer.ModelConfig | None  # a separate critic's; None: none or shared
    reward_fn: Callable  # (batch, response_ids, response_mask, eos_id=) -> scores [B]
    eos_id: int
    pad_id: int
    max_new_tokens: int
    stop_ids: tuple[int, ...]  # more tokens that end a response as EOS does (rollout.stop)
    micro: dict  # micro-batch counts of "log_prob", "actor", "critic" (`micro_batch_counts`)
    group: dict  # rows per prompt that the forwards share (`prompt_group`): n, or 1, per forward
    policy_loss: Callable  # (old_log_prob, log_prob, advantages, mask, *, counts, ...) -> loss, m
    estimator: Callable  # (token_level_rewards=, response_mask=, index=, ...) -> advantages, ...
    kl_controller: Callable  # (kl_coef, current_kl, n_steps) -> next kl_coef
    tx: optax.GradientTransformation  # the policy's optimizer
    critic_tx: optax.GradientTransformation  # the separate critic's

    @property
    def n(self) -> int:
        return self.cfg.rollout.n

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
        """Whether the estimator takes the optional input `name`."""
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
    mesh=None,
) -> StepSpec:
    """The `StepSpec` of a config. `model_cfg` is the policy's (see `model_configs`); `mesh` (the
    one the step is jitted over) sets how many rows each device holds, which the micro-batch
    sizes divide."""
    micro = micro_batch_counts(cfg, mesh)
    return StepSpec(
        cfg=cfg,
        model_cfg=model_cfg,
        critic_cfg=model_configs(cfg, model_cfg)[1],
        reward_fn=reward_fn,
        eos_id=eos_id,
        pad_id=pad_id,
        max_new_tokens=max_new_tokens,
        stop_ids=tuple(stop_ids),
        micro=micro,
        group=prompt_group(cfg, micro),
        policy_loss=losses.make_policy_loss(cfg.actor, cfg.algorithm.rollout_correction),
        estimator=adv_lib.make_estimator(cfg.algorithm),
        kl_controller=kl_lib.make_kl_controller(cfg.algorithm),
        tx=make_optimizer(cfg.actor),
        critic_tx=make_optimizer(cfg.critic),
    )


# ---------------------------------------------------------------------------------------------
# Phase 1, generate(spec, state, prompts, key) -> (experience, metrics): the rollout of
# B = B_p * n rows and its reward (`scores` [B]); with dynamic sampling, rounds of fresh prompts
# until B_p groups with signal are found.


def rollout_and_reward(spec: StepSpec, params, prompts: Batch, key, greedy=False) -> Batch:
    """n samples of each prompt (one greedy answer with `greedy`), scored: `acc` is the task's
    reward, `scores` that after shaping (DAPO's overlong penalty)."""
    cfg, n = spec.cfg, 1 if greedy else spec.n
    rows = jax.tree_util.tree_map(lambda x: jnp.repeat(x, n, axis=0), prompts)
    out = rollout.generate(
        spec.model_cfg,
        params,
        prompts["input_ids"],
        prompts["attention_mask"],
        key,
        samples=n,
        max_new_tokens=spec.max_new_tokens,
        eos_id=spec.eos_id,
        pad_id=spec.pad_id,
        stop_ids=spec.stop_ids,
        temperature=1.0 if greedy else cfg.rollout.temperature,
        top_k=cfg.rollout.top_k,
        top_p=cfg.rollout.top_p,
        greedy=greedy,
    )
    exp = {**rows, "response_ids": out.response_ids, "response_mask": out.response_mask}
    if cfg.algorithm.rollout_correction.enable:  # the rollout's own log-probs (IS / bypass)
        exp["rollout_log_prob"] = out.log_probs
    acc = spec.reward_fn(exp, out.response_ids, out.response_mask, eos_id=spec.eos_id)
    scores, overlong = acc, cfg.reward.overlong_buffer
    if overlong.enable:
        length = jnp.sum(out.response_mask, -1)
        scores = acc + overlong_penalty(
            length, spec.max_new_tokens, overlong.len, overlong.penalty_factor
        )
    if spec.needs("reward_baselines") and not greedy:  # ReMax: a greedy answer's reward
        base = rollout_and_reward(spec, params, prompts, key, greedy=True)["acc"]
        exp["reward_baselines"] = jnp.repeat(base, n)
    return {**exp, "acc": acc, "scores": scores}


def dynamic_sampling(spec: StepSpec, params, pool: Batch, key):
    """DAPO: keep groups whose scores differ; draw fresh prompts from the pool until B_p such
    groups are found or the pool's max_num_gen_batches rounds are used (`lax.while_loop`). Slots
    still empty at the end hold groups without signal from the first round (advantages 0)."""
    filter_groups, n, b_p = spec.cfg.algorithm.filter_groups, spec.n, spec.cfg.data.train_batch_size
    rounds = filter_groups.max_num_gen_batches
    chunks = jax.tree_util.tree_map(lambda x: x.reshape(rounds, b_p, *x.shape[1:]), pool)
    take = lambda i: jax.tree_util.tree_map(lambda x: x[i], chunks)
    signal = lambda e: group_has_signal(e[filter_groups.metric], n)

    first = rollout_and_reward(spec, params, take(0), jax.random.fold_in(key, 0))
    keep = signal(first)
    order = jnp.argsort(~keep, stable=True)  # groups with signal first
    rows = (order[:, None] * n + jnp.arange(n)).reshape(-1)
    buf = jax.tree_util.tree_map(lambda x: x[rows], first)

    def cond(carry):
        i, filled, _ = carry
        return (i < rounds) & (filled < b_p)

    def body(carry):
        i, filled, buf = carry
        new = rollout_and_reward(spec, params, take(i), jax.random.fold_in(key, i))
        keep = signal(new)
        dest = jnp.where(keep, filled + jnp.cumsum(keep) - 1, b_p)  # b_p: dropped
        dest_rows = (dest[:, None] * n + jnp.arange(n)).reshape(-1)
        buf = jax.tree_util.tree_map(lambda b, x: b.at[dest_rows].set(x, mode="drop"), buf, new)
        return i + 1, jnp.minimum(filled + jnp.sum(keep), b_p), buf

    i, filled, buf = jax.lax.while_loop(cond, body, (jnp.int32(1), jnp.sum(keep), buf))
    return buf, {"training/num_gen_batches": i, "training/filled_groups_ratio": filled / b_p}


def generate(spec: StepSpec, state: TrainState, prompts: Batch, key):
    """Phase 1 (see above)."""
    params = policy_params(spec.cfg, state)
    if spec.cfg.algorithm.filter_groups.enable:
        return dynamic_sampling(spec, params, prompts, key)
    return rollout_and_reward(spec, params, prompts, key), {}


# ---------------------------------------------------------------------------------------------
# Phase 2, compute_advantages(spec, state, experience) -> (experience, metrics, state): old /
# reference log-probs and values of the rollout, KL in the reward, rollout correction,
# advantages, returns and the critic's mask; the state carries the next KL coefficient and
# GROUP-PPO threshold.


def forward(spec: StepSpec, model_cfg, params, rows: Batch, name: str, **outputs):
    """`response_outputs` of `rows` (prompt + response) at the rollout's temperature; the
    entropy, when asked for, has a gradient only if the loss uses it (entropy_coeff != 0).
    `name`: "log_prob", "actor" or "critic", whose `spec.group` applies."""
    return response_outputs(
        model_cfg,
        params,
        rows["input_ids"],
        rows["attention_mask"],
        rows["response_ids"],
        rows["response_mask"],
        spec.cfg.rollout.temperature,
        entropy_grad=spec.cfg.actor.entropy_coeff != 0,
        group=spec.group[name],
        **outputs,
    )


def score_forwards(spec: StepSpec, state: TrainState, rows: Batch) -> Batch:
    """Old (unless on-policy or bypass mode) and reference log-probs and values of some rows.
    (Bypass mode with a value head on the policy still runs the policy's forward, for the
    values; its log-probs are then replaced by the rollout's.)"""
    cfg, out = spec.cfg, {}
    if not (spec.on_policy or (bypass_mode(cfg) and not spec.shared)):
        with_spp = spec.needs("sum_pi_squared")
        policy = policy_params(cfg, state)
        old = forward(spec, spec.model_cfg, policy, rows, "log_prob", with_sum_pi_squared=with_spp)
        out["old_log_prob"] = old["log_prob"]
        if with_spp:
            out["sum_pi_squared"] = old["sum_pi_squared"]
    if needs_reference(cfg):
        ref = forward(spec, spec.model_cfg, reference_params(cfg, state), rows, "log_prob")
        out["ref_log_prob"] = ref["log_prob"]
    if spec.use_critic and spec.shared:
        out["values"] = old["values"]
    elif spec.use_critic:
        critic_params = _with_base(cfg, state.ref_params, state.critic_params)
        out["values"] = forward(spec, spec.critic_cfg, critic_params, rows, "log_prob")["values"]
    return out


def compute_advantages(spec: StepSpec, state: TrainState, exp: Batch):
    """Phase 2 (see above)."""
    cfg, algo = spec.cfg, spec.cfg.algorithm
    mask = exp["response_mask"]
    b = mask.shape[0]
    rows = {k: exp[k] for k in ("input_ids", "attention_mask", "response_ids", "response_mask")}
    score = lambda r: score_forwards(spec, state, r)
    scored = in_micro_batches(score, rows, spec.micro["log_prob"], spec.group["log_prob"])
    exp = {**exp, **jax.lax.stop_gradient(scored)}
    if spec.use_critic:
        exp["values"] = exp["values"] * mask
    if bypass_mode(cfg):
        exp["old_log_prob"] = exp["rollout_log_prob"] * mask
    metrics = {}
    token_level_scores = last_token_scores(exp["scores"], mask)
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
    adv = spec.estimator(
        token_level_rewards=token_level_rewards,
        response_mask=mask,
        index=jnp.arange(b, dtype=jnp.int32) // spec.n,  # the prompt (group) of each row
        values=exp.get("values"),
        reward_baselines=exp.get("reward_baselines"),
        old_log_prob=exp.get("old_log_prob"),
        threshold=state.group_threshold,
        sum_pi_squared=exp.get("sum_pi_squared"),
        rollout_is_weights=exp.get("rollout_is_weights"),
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
    micro-batch's randomness (LoRA dropout, then the policy loss's)."""
    full = _with_base(spec.cfg, base, params, key)
    out = forward(spec, spec.model_cfg, full, mb, "actor", with_entropy=True)
    loss, metrics = policy_terms(spec, out, mb, counts["policy"], jax.random.fold_in(key, 1))
    if spec.shared:
        vf_loss, vf_metrics = value_terms(spec, out, mb, counts["value"])
        loss = actor_on * loss + spec.cfg.critic.vf_coef * vf_loss
        metrics.update(vf_metrics)
    return loss, metrics


def critic_loss(critic_params, mb: Batch, spec: StepSpec, counts, base, key):
    full = _with_base(spec.cfg, base, critic_params, key)
    out = forward(spec, spec.critic_cfg, full, mb, "critic")
    return value_terms(spec, out, mb, counts["value"])


def mini_batch_counts(spec: StepSpec, mb: Batch) -> dict:
    """The whole mini-batch's normalisers of the losses; under rejection (verl's trainer): the
    tokens left, but every response row for the seq-mean modes."""
    counts = {"policy": losses.batch_counts(mb.get("policy_mask", mb["response_mask"]))}
    counts["policy"]["seqs"] = losses.batch_counts(mb["response_mask"])["seqs"]
    if spec.use_critic:
        counts["value"] = losses.batch_counts(mb["critic_mask"])
    return counts


def apply_grads(tx, grads, params, opt_state, apply):
    """(params, opt_state) after one optimizer update with `grads`, or unchanged where `apply`
    (a bool scalar, or None: always) is False: a select fused into the elementwise update, so
    no second copy of the state."""
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new = (optax.apply_updates(params, updates), new_opt_state)
    return new if apply is None else _select(apply, new, (params, opt_state))


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
    grads, metrics = accumulate_grads(
        actor_loss,
        state.params,
        mb,
        spec.micro["actor"],
        spec,
        counts,
        base,
        actor_on,
        key=actor_key,
        group=spec.group["actor"],
    )
    metrics["actor/grad_norm"] = optax.tree.norm(grads)
    critic_grads = None
    if spec.use_critic and not spec.shared:
        critic_grads, critic_metrics = accumulate_grads(
            critic_loss,
            state.critic_params,
            mb,
            spec.micro["critic"],
            spec,
            counts,
            base,
            key=critic_key,
            group=spec.group["critic"],
        )
        critic_metrics["critic/grad_norm"] = optax.tree.norm(critic_grads)
        metrics.update(critic_metrics)
    if ok is not None:
        ok = ok & all_finite(metrics)
    apply_actor = ok
    # a shared backbone trains through the value loss during warm-up (its pg loss is zeroed)
    if spec.cfg.critic.critic_warmup > 0 and not spec.shared:
        apply_actor = actor_on if ok is None else ok & actor_on
    params, opt_state = apply_grads(spec.tx, grads, state.params, state.opt_state, apply_actor)
    state = state.replace(params=params, opt_state=opt_state)
    if critic_grads is not None:
        critic_params, critic_opt_state = apply_grads(
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
    keys += [k for k in ("policy_mask", "rollout_is_weights") if k in exp]
    keys += ["ref_log_prob"] if needs_reference(cfg) else []
    keys += ["values", "returns", "critic_mask"] if spec.use_critic else []
    data = {k: exp[k] for k in keys}
    b = exp["response_mask"].shape[0]
    mb_rows = actor.ppo_mini_batch_size * spec.n
    num_mb = b // mb_rows
    actor_on = state.step >= cfg.critic.critic_warmup

    # Mini-batches of rows drawn at random; but a shared-prompt update (`prompt_group`) has one
    # mini-batch, whose row order changes nothing but the summation: rollout order, group by group.
    grouped = spec.group["actor"] > 1 or spec.group["critic"] > 1

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


def schedule_count(opt_state) -> jax.Array:
    """Optimizer updates applied so far: the count of the learning-rate schedule's state (it
    does not advance on an update the NaN guard or critic warm-up left out)."""
    is_count = lambda x: isinstance(x, optax.ScaleByScheduleState)
    (found,) = [s for s in jax.tree.leaves(opt_state, is_leaf=is_count) if is_count(s)]
    return found.count


def rl_step(spec: StepSpec, state: TrainState, prompts: Batch):
    """One RL step: (state, prompts) -> (next state, metrics); see `make_step`."""
    cfg = spec.cfg
    key, k_roll, k_shuffle = jax.random.split(state.key, 3)
    exp, metrics = generate(spec, state, prompts, k_roll)
    exp, adv_metrics, scored_state = compute_advantages(spec, state, exp)
    metrics.update(adv_metrics)
    metrics.update(experience_metrics(exp, spec.max_new_tokens))
    # NaN / Inf guard: no update is applied when the reward or advantages are not finite,
    # nor from the first mini-batch whose loss or gradient is not finite on (`update`).
    guard = all_finite(metrics) if cfg.nan_guard.enable else None
    new_state, update_metrics = update(spec, scored_state, exp, k_shuffle, guard)
    metrics.update(update_metrics)
    # the learning rate of this step's first update (the optimizers' own counts)
    metrics["actor/lr"] = lr_schedule(cfg.actor)(schedule_count(state.opt_state))
    if "values" in exp:
        opt_state = state.opt_state if spec.shared else state.critic_opt_state
        metrics["critic/lr"] = lr_schedule(cfg.critic)(schedule_count(opt_state))
    finite = {k: jnp.isfinite(metrics[k]) for k in GUARDED_METRICS if k in metrics}
    ok = jnp.all(jnp.stack(list(finite.values())))
    if cfg.nan_guard.enable:  # a skipped step keeps its KL coefficient and GROUP-PPO tau
        new_state = new_state.replace(
            kl_coef=jnp.where(ok, new_state.kl_coef, state.kl_coef),
            group_threshold=jnp.where(ok, new_state.group_threshold, state.group_threshold),
        )
    metrics.update({f"training/finite/{k}": v.astype(jnp.int32) for k, v in finite.items()})
    metrics["training/step_skipped"] = (~ok).astype(jnp.int32)
    skipped = state.skipped_steps + (~ok).astype(jnp.int32)
    metrics["training/skipped_steps"] = skipped
    return new_state.replace(step=state.step + 1, skipped_steps=skipped, key=key), metrics


def make_step(*args, **kwargs):
    """`step(state, prompts) -> (state, metrics)`, one function for `jax.jit`; `prompts` holds
    `prompts_per_step(cfg)` rows of the task batch. The arguments are `make_spec`'s."""
    return functools.partial(rl_step, make_spec(*args, **kwargs))


def experience_metrics(exp: Batch, max_new_tokens: int) -> dict[str, jax.Array]:
    """verl's data metrics of a scored batch: scores, rewards, advantages, returns, values,
    lengths."""
    mask = exp["response_mask"]
    length = jnp.sum(mask, -1)
    prompt_length = jnp.sum(exp["attention_mask"], -1)
    metrics = {}
    metrics.update(_stats("critic/score", exp["scores"]))
    metrics.update(_stats("critic/rewards", jnp.sum(exp["token_level_rewards"] * mask, -1)))
    metrics.update(_stats("critic/advantages", exp["advantages"], mask))
    metrics.update(_stats("critic/returns", exp["returns"], mask))
    if "values" in exp:
        metrics.update(_stats("critic/values", exp["values"], mask))
        metrics["critic/vf_explained_var"] = group_lib.explained_variance(
            exp["returns"], exp["values"], mask
        )
    metrics.update(_stats("response_length", length.astype(jnp.float32)))
    metrics.update(_stats("prompt_length", prompt_length.astype(jnp.float32)))
    metrics["response_length/clip_ratio"] = jnp.mean(length >= max_new_tokens)
    metrics["perf/total_num_tokens"] = jnp.sum(length) + jnp.sum(prompt_length)
    return metrics


def make_eval(
    model_cfg: transformer.ModelConfig,
    reward_fn: Callable,
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    num_samples: int = 0,
    stop_ids: tuple[int, ...] = (),
):
    """`evaluate(params, batch) -> {"val/accuracy", "val/response_length"}` with greedy decoding;
    with `num_samples` > 0 also the first `num_samples` rows' answers to look at:
    "samples/response_ids" and "samples/response_mask" [num_samples, R], "samples/score"
    [num_samples] (jrl.samples splits them off the metrics)."""

    def evaluate(params, batch: Batch):
        out = rollout.generate(
            model_cfg,
            params,
            batch["input_ids"],
            batch["attention_mask"],
            jax.random.key(0),
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
            pad_id=pad_id,
            greedy=True,
            stop_ids=tuple(stop_ids),
        )
        scores = reward_fn(batch, out.response_ids, out.response_mask, eos_id=eos_id)
        metrics = {
            "val/accuracy": jnp.mean(scores),
            "val/response_length": jnp.mean(jnp.sum(out.response_mask, -1).astype(jnp.float32)),
        }
        if num_samples:
            metrics["samples/response_ids"] = out.response_ids[:num_samples]
            metrics["samples/response_mask"] = out.response_mask[:num_samples]
            metrics["samples/score"] = scores[:num_samples]
        return metrics

    return evaluate


def make_sft_step(cfg: ml_collections.ConfigDict, model_cfg: transformer.ModelConfig):
    """Supervised warm-up: `(params, opt_state, batch) -> (params, opt_state, loss)` on the task's
    reference answers (`answer_ids`, answer plus EOS), mean negative log-likelihood per token."""
    tx = optax.adam(cfg.warmup.sft_lr)

    def loss_fn(params, batch):
        target = batch["answer_ids"]
        mask = (jnp.arange(target.shape[1])[None] <= batch["answer_len"][:, None]).astype(jnp.int32)
        out = response_outputs(
            model_cfg, params, batch["input_ids"], batch["attention_mask"], target, mask
        )
        return -jnp.sum(out["log_prob"] * mask) / jnp.sum(mask)

    def sft_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, sft_step
