"""Benchmark of the fused RL step: python -m jrl.bench --workload=NAME [--steps=10] [--json]
"Will it fit?": python -m jrl.bench --memory --config=configs/X.py[:presets] [--config.a.b=v ...]

Workloads are fixed so that other systems can run the same ones (random-initialised Qwen2-style
decoder, the built-in character vocabulary, arithmetic prompts; GRPO, one optimizer update per
step, no reference model):
  W1: hidden 64, 2 layers, 4 heads, 2 KV heads, MLP 128, tied embeddings; 8 prompts x 4 samples x
      16 new tokens.
  W2: hidden 256, 4 layers, 8 heads, 4 KV heads, MLP 1024, tied embeddings; 16 prompts x 8
      samples x 64 new tokens; the update in micro-batches of 16 rows (--micro_batch), gradients
      summed into the one optimizer update.
  W3: W2's model and rows with a 512-token response budget; every response ends at EOS at a
      length of its own, fixed per row (a log-normal draw of seed 0: mean 125, median 86, 2 of
      128 rows at 512; `jrl.run.benchmark.response_lengths`), forced in the rollout
      (`rollout.generate`'s `forced_length`); `--fixed_length`: every response at 512. Its
      config is what such lengths call for: response buckets (64, 128, 256) with the update's
      rows ordered by length (`model.shared_prompt_forward` off), the decode compacted
      (`rollout.compact_decode`, on by default); `--fixed_length` runs the same config.
  W2-MoE: W2 with a mixture of experts in every layer: 8 experts of width 512, top 2 (the
      same active parameters as W2's MLP of width 1024, plus a 256 x 8 router).
In W1, W2 and W2-MoE every response is exactly the stated number of new tokens (EOS does not stop
decoding); in W3 each row's length is fixed: the work per step does not depend on what the random
model samples.

Reported: compile time of the fused step (with its first step) and how many times it compiled
(`compiles`: 1, no retrace), steady-state seconds per step (median of `--steps` steps after
compile, the jitted step called as the trainer calls it), real tokens/s (response tokens up to EOS,
and prompt + response), and the split of a step into rollout + reward / log-probs + advantages /
update, timed by jitting the same three phase functions (`jrl.step.make_phases`) separately. W3
also reports the share of the positions each phase computes that hold real tokens
(`real_token_share`: decode, scoring, update; scoring is null when the step runs no scoring
forward, as in W3's on-policy GRPO).

`--memory` compiles (never runs) the fused step of a config on the current devices and its mesh
with abstract inputs (no parameter is allocated) and reports XLA's compile-time memory analysis per
device: temporaries, arguments (the train state and the prompt batch), outputs, what the donated
state aliases, and the peak. With forced host devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8 ... --config.mesh.shape="(1,8,1)"`) it gives
the per-device figure of a sharded run before any accelerator is paid for. `--target=v5p-64` (a
TPU slice, a topology such as v5p:2x4x4, or `tpu`: the slice of the config's mesh= preset)
compiles it with the TPU compiler for that slice's chips instead (libtpu installed; no TPU
needed): per-chip figures as the chips would hold them, the report naming the compiler
(jrl/run/targets.py).

`--decode` compiles (never runs) one decode step of a config's rollout at its shape and reports
XLA's bytes and flops per step against the bytes the step needs, its ops and roofline tokens/s
per chip (jrl/run/decode_report.py; docs/performance.md, "Decode"); with --target also the step
compiled with every buffer in HBM (`unstaged`: no on-chip copies counted), e.g.
  python -m jrl.bench --decode --config=configs/grpo_math.py:model=qwen2.5-0.5b \
    --config.tokenizer=char --config.rollout.n=8 --config.data.train_batch_size=16 \
    --config.data.max_prompt_length=512 --config.data.max_response_length=1024 [--target=v5p-8]
"""

from __future__ import annotations

import json

if __name__ == "__main__":
    from jrl.run import host

    host.use_huge_pages()  # before JAX loads, as `python -m jrl.train` does

from absl import app, flags

from jrl.run import benchmark, cli, decode_report, targets
from jrl import config as config_lib

_CONFIG = cli.define_config(" With --memory: the config whose step is compiled.")
_WORKLOAD = flags.DEFINE_enum(
    "workload", "W1", sorted(benchmark.WORKLOADS), "Which fixed workload to run."
)
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps after compilation (median reported).")
_MICRO_BATCH = flags.DEFINE_integer(
    "micro_batch",
    None,
    "Rows per forward / backward of the update instead of the workload's (0: all at once).",
)
_FIXED_LENGTH = flags.DEFINE_bool(
    "fixed_length", False, "W3: every response at the 512-token budget instead of its own length."
)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")
_MEMORY = flags.DEFINE_bool(
    "memory",
    False,
    "Compile (never run) the fused step of --config on the current devices and report XLA's "
    "memory analysis per device instead of timing a workload.",
)
_TARGET = flags.DEFINE_string(
    "target",
    None,
    "With --memory or --decode: compile for this TPU slice with the TPU compiler instead of the "
    "current devices (v5p-64, v4-8, v5e-16, a topology such as v5p:2x4x4, or 'tpu': the slice "
    "of the config's mesh= preset; --decode compiles for one of its chips). Needs libtpu, no "
    "TPU.",
)


def _target() -> targets.Target | None:
    """The --target of --memory / --decode, checked before anything compiles (one-line
    errors)."""
    if _TARGET.value is None:
        return None
    try:
        presets = flags.FLAGS["config"].config_filename.partition(":")[2]
        target = targets.parse(_TARGET.value, presets)
        targets.require_libtpu()
    except targets.TargetError as e:
        cli.fail(str(e))
    targets.host_only()  # before any device use: the attached chips, if any, are not needed
    return target


_DECODE = flags.DEFINE_bool(
    "decode",
    False,
    "Compile (never run) one decode step of --config's rollout and report XLA's bytes and flops "
    "per step against the bytes it needs, its ops and its roofline tokens/s "
    "(jrl/run/decode_report.py); on a GPU or TPU also time the rollout.",
)
_FILL = flags.DEFINE_integer(
    "fill",
    None,
    "--decode: the cache slots the step's token sees, its own included (default P + R/2).",
)
_DECODE_ATTENTION = flags.DEFINE_enum(
    "decode_attention",
    None,
    ["blockwise", "xla"],
    "--decode: the decode attention compiled instead of the model's own (blockwise): xla, the "
    "materialised reference over the whole cache.",
)
_GREEDY = flags.DEFINE_bool(
    "greedy",
    False,
    "--decode: compile the step with greedy (argmax) sampling instead of the config's sampler.",
)


def _print(result: dict):
    if _JSON.value:
        print(json.dumps(result))
        return
    for k, v in result.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                print(f"{k}.{kk:<24} {vv}")
        else:
            print(f"{k:<28} {v}")


def main(argv):
    del argv
    targets.use_gpu_flags()  # before any device use (XLA reads XLA_FLAGS when it starts)
    if _TARGET.value is not None and not (_MEMORY.value or _DECODE.value):
        cli.fail("--target applies to --memory and --decode: add one of them and --config=...")
    if _DECODE.value:
        cfg = _CONFIG.value
        if cfg is None:
            raise app.UsageError("--decode needs --config=configs/X.py[:presets]")
        target = _target()
        compile_fn = unstaged = None
        if target is not None:
            compile_fn = lambda fn, args: targets.compile(fn, args, target)
            unstaged = lambda fn, args: targets.compile(fn, args, target, None, targets.HBM_ONLY)
        try:
            result = decode_report.decode_report(
                cfg,
                fill=_FILL.value,
                greedy=_GREEDY.value,
                decode_attention=_DECODE_ATTENTION.value,
                compile_fn=compile_fn,
                device=None if target is None else f"one chip of {target.describe()}",
                unstaged_compile_fn=unstaged,
            )
        except (config_lib.ConfigError, targets.TargetError) as e:
            cli.fail(str(e))
        _print(result)
        return
    if _MEMORY.value:
        cfg = _CONFIG.value
        if cfg is None:
            raise app.UsageError("--memory needs --config=configs/X.py[:presets]")
        target = _target()
        try:
            result = benchmark.memory_report(cfg, target)
        except (config_lib.ConfigError, targets.TargetError) as e:
            cli.fail(str(e))
        print(
            json.dumps(result)
            if _JSON.value
            else "\n".join(f"{k:<28} {v}" for k, v in result.items())
        )
        return
    if _FIXED_LENGTH.value and benchmark.response_lengths(_WORKLOAD.value) is None:
        cli.fail(f"--fixed_length applies to W3 only (--workload={_WORKLOAD.value}): drop it.")
    result = benchmark.run(
        _WORKLOAD.value, _STEPS.value, _MICRO_BATCH.value, fixed_length=_FIXED_LENGTH.value
    )
    _print(result)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
