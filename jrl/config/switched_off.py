"""Switched-off settings: a section that acts only while its switch is on (LoRA, multi-turn tool
use, the critic, the KL loss, ...). A field of it set while the switch is off would have no effect,
so `validate` stops the run and names the switch rather than ignore the setting. "Set": different
from base_config()'s default (in a config file or on the command line: `_check_switched_off`), or
named on the command line at all (`unused_override`). `reset_switched_off` puts back the fields
of a feature that a config file turned on and the command line turned off.
"""

from __future__ import annotations

import ml_collections

from jrl.algos import advantages
from jrl.config.errors import SwitchedOffError
from jrl.config.files import override_keys
from jrl.config.schema import _field, base_config, flat_keys


def _switch(cfg: ml_collections.ConfigDict, flag: str, feature: str, fields=None) -> tuple:
    """The row of `_sections` of a feature that the boolean field `flag` turns on; its fields, when
    not given: the flag's section."""
    fields = fields or flag.rpartition(".")[0]
    return (_field(cfg, flag), feature, f"{flag}=False", f"{flag}=True", fields)


def _sections(cfg: ml_collections.ConfigDict) -> tuple:
    """(is it on, feature, how its switch is off, the flag that turns it on, its section or its
    dotted fields) of every on/off section, outer switches first."""
    a = cfg.algorithm
    critic = sorted(n for n in advantages.names() if "values" in advantages.needs(n))
    estimator = f"algorithm.adv_estimator='{a.adv_estimator}'"
    kl_in_reward = ["algorithm.kl_penalty", *(f"algorithm.kl_ctrl.{k}" for k in a.kl_ctrl)]
    kl_loss = ["actor.kl_loss_coef", "actor.kl_loss_type"]
    return (
        _switch(cfg, "algorithm.rollout_correction.enable", "rollout correction"),
        (cfg.lora.rank, "LoRA", "lora.rank=0", "lora.rank=16 (any rank >= 1)", "lora"),
        _switch(cfg, "rollout.multi_turn.enable", "multi-turn tool use"),
        _switch(cfg, "algorithm.filter_groups.enable", "dynamic sampling"),
        _switch(cfg, "reward.overlong_buffer.enable", "the overlong buffer"),
        _switch(cfg, "algorithm.use_kl_in_reward", "KL in the reward", kl_in_reward),
        (
            a.kl_ctrl.type == "adaptive",
            "the adaptive KL controller",
            f"algorithm.kl_ctrl.type='{a.kl_ctrl.type}'",
            "algorithm.kl_ctrl.type=adaptive",
            ["algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon"],
        ),
        _switch(cfg, "actor.use_kl_loss", "the KL loss", kl_loss),
        (
            a.adv_estimator in critic,
            "the critic",
            f"{estimator} trains none",
            f"algorithm.adv_estimator={critic[0]} (the estimators with a critic: "
            f"{', '.join(critic)})",
            "critic",
        ),
        (
            a.adv_estimator == "group_ppo",
            "GROUP-PPO",
            estimator,
            "algorithm.adv_estimator=group_ppo",
            "algorithm.group_params",
        ),
    )


def _off_sections(cfg: ml_collections.ConfigDict) -> list[tuple[str, str, str, list[str]]]:
    """(feature, how its switch is off, the flag that turns it on, its dotted fields) of each
    on/off section that is off in cfg, outer switches first."""
    off = []
    for on, feature, state, fix, fields in _sections(cfg):
        if not on:
            if isinstance(fields, str):  # a whole section, less its switch (enable, lora.rank)
                fields = [
                    f"{fields}.{k}"
                    for k in flat_keys(_field(cfg, fields))
                    if k not in ("enable", "rank")
                ]
            off.append((feature, state, fix, fields))
    return off


def _check_switched_off(cfg: ml_collections.ConfigDict) -> None:
    """Raises SwitchedOffError for fields of a switched-off section that differ from their
    default."""
    base = base_config()
    for feature, state, fix, fields in _off_sections(cfg):
        # a list read back from config.json is the tuple it was written from
        same = lambda a, b: (list(a) if isinstance(a, tuple) else a) == (
            list(b) if isinstance(b, tuple) else b
        )
        changed = [f for f in fields if not same(_field(cfg, f), _field(base, f))]
        if changed:
            settings = ", ".join(f"{f}={_field(cfg, f)!r}" for f in changed)
            defaults = ", ".join(repr(_field(base, f)) for f in changed)
            one = len(changed) == 1
            raise SwitchedOffError(
                f"{settings} {'has' if one else 'have'} no effect while {feature} is off "
                f"({state}): turn it on with --config.{fix}, or leave {'it' if one else 'them'} "
                f"at the default{'' if one else 's'} ({defaults})."
            )


def unused_override(cfg: ml_collections.ConfigDict, argv) -> str | None:
    """The one-line error for the first `--config.a.b=v` of argv that sets a field of a section
    switched off in cfg (the config after the overrides), even to its default value; else None."""
    given = override_keys(argv)
    for feature, state, fix, fields in _off_sections(cfg):
        named = [f for f in given if f in fields]
        if named:
            return (
                f"--config.{named[0]}={_field(cfg, named[0])} has no effect while {feature} is "
                f"off ({state}): turn it on with --config.{fix}, or leave it out."
            )
    return None


def reset_switched_off(cfg, file_cfg, argv) -> None:
    """Puts back to their defaults, in cfg, the fields that the config file (file_cfg: its config
    without the overrides) set for a feature it turned on and the command line (argv) turned off,
    unless argv sets them too: with the feature off they have no effect, and left as the file set
    them `validate` would refuse them (so `--config=configs/dapo_math.py
    --config.reward.overlong_buffer.enable=False` runs DAPO without the overlong buffer)."""
    base, given = base_config(), override_keys(argv)
    file_off = {feature for feature, *_ in _off_sections(file_cfg)}
    for feature, _, _, fields in _off_sections(cfg):
        if feature in file_off:
            continue
        for path in fields:
            if path not in given:
                parent, _, leaf = path.rpartition(".")
                _field(cfg, parent)[leaf] = _field(base, path)
