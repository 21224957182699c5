"""Checks a LoRA run's exports against the libraries that read them: PEFT and transformers.

  python scripts/check_peft_export.py --peft_python=/tmp/peftenv/bin/python [--out=/tmp/peftcheck]

`--peft_python` is an interpreter with torch, transformers, peft and safetensors, e.g. a
virtualenv made with `pip install torch peft transformers safetensors` (jrl's own environment
needs none of them). Stage 1 (this interpreter): a tiny Qwen2 checkpoint in Hugging Face's
format, two LoRA RL steps of the tiny GRPO preset on it, `jrl.export` of the merged weights and
(`--adapter_only`) of the PEFT adapter, plus a second adapter with large random weights written
the same way (so that a wrong name, layout or scale cannot hide in small deltas); jrl's logits of
each adapted model on fixed ids. Stage 2 (`--peft_python`): the base through
`transformers.AutoModelForCausalLM`, each adapter through `peft.PeftModel.from_pretrained`, the
merged export through transformers; the largest logit differences from jrl's are printed, and it
fails above 1e-4.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

TOLERANCE = 1e-4
IDS = [[5, 17, 33, 2, 9, 41, 60, 7, 12, 3], [44, 8, 19, 71, 23, 5, 30, 90, 11, 6]]


def jrl_stage(out: str) -> None:
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from configs import grpo_math
    from jrl import models
    from jrl import tokenizer as tokenizer_lib
    from jrl.models import lora
    from jrl.models import transformer as tfm
    from jrl.run import checkpoint as checkpoint_lib
    from jrl.run import exporter as export_lib
    from jrl.run import trainer

    base_dir = os.path.join(out, "base")
    model_cfg = tfm.ModelConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2
    )
    model_cfg = dataclasses.replace(model_cfg, qkv_bias=True, tie_word_embeddings=False)
    params = tfm.init_params(model_cfg, jax.random.key(0))
    models.save_pretrained(model_cfg, params, base_dir, tokenizer=tokenizer_lib.char_tokenizer())

    cfg = grpo_math.get_config("tiny")
    cfg.model.hf_path, cfg.tokenizer, cfg.warmup.sft_steps, cfg.total_steps = base_dir, "", 0, 2
    cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout = 4, 8.0, 0.1
    cfg.actor.lr, cfg.actor.use_kl_loss, cfg.actor.entropy_coeff = 1e-2, True, 0.01
    cfg.checkpoint.async_save = False
    run_dir = os.path.join(out, "run")
    trainer.run(cfg, run_dir)
    export_lib.export(run_dir, os.path.join(out, "merged"))
    export_lib.export(run_dir, os.path.join(out, "adapter"), adapter_only=True)
    _, policy_cfg = trainer.policy_model(cfg)
    base, trained, _ = checkpoint_lib.restore_lora(run_dir, cfg, policy_cfg)
    # Large random adapters (B is no longer near zero) in the same format.
    leaves, tree = jax.tree.flatten(trained["lora"])
    keys = jax.random.split(jax.random.key(1), len(leaves))
    big = {
        "lora": jax.tree.unflatten(
            tree, [0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
        )
    }
    lora.save_peft(os.path.join(out, "adapter_random"), big, cfg.lora, base_dir)

    ids = jnp.asarray(IDS, jnp.int32)
    logits = lambda p: np.asarray(tfm.apply_full(policy_cfg, p, ids, jnp.ones_like(ids))[0])
    s = lora.scale(cfg.lora)
    np.savez(
        os.path.join(out, "jrl_logits.npz"),
        ids=np.asarray(IDS),
        base=logits(base),
        adapter=logits(lora.combine(base, trained, s)),
        adapter_random=logits(lora.combine(base, big, s)),
    )


def peft_stage(out: str) -> None:
    import numpy as np
    import peft
    import torch
    import transformers

    want = np.load(os.path.join(out, "jrl_logits.npz"))
    ids = torch.tensor(want["ids"])

    def hf_logits(model):
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().numpy()

    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(out, d), torch_dtype=torch.float32
    ).eval()
    report, worst = {}, 0.0
    report["base (transformers)"] = np.abs(hf_logits(load("base")) - want["base"]).max()
    report["merged export (transformers)"] = np.abs(
        hf_logits(load("merged")) - want["adapter"]
    ).max()
    for name in ("adapter", "adapter_random"):
        model = peft.PeftModel.from_pretrained(load("base"), os.path.join(out, name)).eval()
        loaded_b = [p for n, p in model.named_parameters() if "lora_B" in n]
        assert len(loaded_b) == 2 * 7, f"{name}: PEFT made {len(loaded_b)} lora_B matrices, not 14"
        report[f"{name} (peft {peft.__version__})"] = np.abs(hf_logits(model) - want[name]).max()
        report[f"{name}: max |adapted - base| (jrl)"] = np.abs(want[name] - want["base"]).max()
    for k, v in report.items():
        print(f"{k}: {float(v):.3g}")
        if "adapted - base" not in k:
            worst = max(worst, float(v))
    print(json.dumps({"max_abs_logit_diff": worst, "tolerance": TOLERANCE}))
    if worst > TOLERANCE:
        sys.exit(f"logits differ from jrl's by {worst:.3g} > {TOLERANCE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/jrl_peft_check", help="working directory")
    parser.add_argument("--peft_python", help="interpreter with torch, transformers and peft")
    parser.add_argument("--stage", choices=("all", "jrl", "peft"), default="all")
    args = parser.parse_args()
    if args.stage in ("all", "jrl"):
        os.makedirs(args.out, exist_ok=True)
        jrl_stage(args.out)
    if args.stage == "peft":
        peft_stage(args.out)
    elif args.stage == "all":
        if not args.peft_python:
            sys.exit("--peft_python is needed: an interpreter with torch, transformers and peft.")
        cmd = [args.peft_python, os.path.abspath(__file__), "--stage=peft", f"--out={args.out}"]
        sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
