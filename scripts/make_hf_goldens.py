"""Writes the Hugging Face parity goldens of tests/models/hf_test.py (needs torch and transformers).

    python scripts/make_hf_goldens.py [--out tests/golden] [--only qwen3_moe,mixtral]

For every entry of FAMILIES (or those --only names): a tiny randomly initialised transformers
causal LM (weights rounded to bfloat16, kept small on disk by saving in bfloat16; the float32
path is covered by the tests' round trips), saved with `save_pretrained` under <out>/<name>/,
plus its float32 logits on <out>/input_ids.npy with <out>/attention_mask.npy (row 1 left-padded)
as <out>/<name>/logits.npy. An entry is named by its family (`model_type`), or by a name of its
own for a second checkpoint of a family (MOE_VARIANTS). Position ids skip the left padding, as
jrl numbers them. Eager attention; every weight is drawn with a scale large enough that norms,
soft-caps, sliding windows and the routers' choices change the logits. A mixture of experts also
gets <out>/<name>/aux_loss.npy: transformers' load-balancing loss (`output_router_logits`) on
the same batch, its padding masked.
"""

import argparse
import os

import numpy as np
import torch
import transformers

VOCAB, SEQ, PAD = 64, 12, 3
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
GEMMA = {
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 4,
    "num_hidden_layers": 2,
}

# family -> (config fields, save dtype)
FAMILIES = {
    "llama": (
        {
            "num_hidden_layers": 2,
            "tie_word_embeddings": False,
            "max_position_embeddings": 512,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,  # wavelengths 6, 63, 628, 6283:
                # one kept, one interpolated, two slowed down
            },
        },
        torch.bfloat16,
    ),
    "mistral": (
        {"num_hidden_layers": 2, "sliding_window": 4, "tie_word_embeddings": False, "head_dim": 8},
        torch.bfloat16,
    ),
    "qwen2": (
        {
            "num_hidden_layers": 2,
            "tie_word_embeddings": True,
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
        },
        torch.bfloat16,
    ),
    "qwen3": (
        {"num_hidden_layers": 2, "tie_word_embeddings": False, "head_dim": 16},
        torch.bfloat16,
    ),
    "gemma2": (
        dict(**GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=8.0),
        torch.bfloat16,
    ),
    "gemma3_text": (
        dict(
            **GEMMA,
            sliding_window_pattern=2,
            final_logit_softcapping=5.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
        torch.bfloat16,
    ),
    # layer 0 sparse (8 experts of width 16, top 2, weights not renormalised), layer 1 dense
    "qwen3_moe": (
        {
            "num_hidden_layers": 2,
            "tie_word_embeddings": False,
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
        },
        torch.bfloat16,
    ),
    # every layer sparse (4 experts of width intermediate_size, top 2), sliding window 4
    "mixtral": (
        {
            "num_hidden_layers": 2,
            "tie_word_embeddings": False,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
        },
        torch.bfloat16,
    ),
}
# name -> (family, config fields, save dtype): a second checkpoint of a family.
MOE_VARIANTS = {
    # layer 0 dense, layer 1 sparse by decoder_sparse_step, top-2 weights renormalised
    "qwen3_moe_topk_norm": (
        "qwen3_moe",
        {
            **FAMILIES["qwen3_moe"][0],
            "norm_topk_prob": True,
            "mlp_only_layers": [],
            "decoder_sparse_step": 2,
        },
        torch.bfloat16,
    ),
}
GOLDENS = {**{f: (f, *entry) for f, entry in FAMILIES.items()}, **MOE_VARIANTS}


def inputs():
    rng = np.random.default_rng(0)
    ids = rng.integers(3, VOCAB, size=(2, SEQ)).astype(np.int64)
    mask = np.ones_like(ids)
    ids[1, :PAD] = 0
    mask[1, :PAD] = 0
    return ids, mask


def randomize(model, seed: int, gemma: bool):
    """Every weight ~ N(0, 0.3^2); norm weights around 1 (around 0 for Gemma's 1 + w),
    bf16-exact."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = 0.3 * torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight") and not gemma:
                x = x + 1.0
            p.copy_(x.to(torch.bfloat16).float())


def make(name: str, out: str, ids, mask):
    family, fields, save_dtype = GOLDENS[name]
    config = transformers.AutoConfig.for_model(family, **{**COMMON, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    randomize(model, seed=len(name), gemma=family.startswith("gemma"))
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    experts = hasattr(config, "num_experts_per_tok")
    with torch.no_grad():
        result = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
            **({"output_router_logits": True} if experts else {}),
        )
    logits = result.logits.numpy()
    path = os.path.join(out, name)
    model.to(save_dtype).save_pretrained(path)
    np.save(os.path.join(path, "logits.npy"), logits.astype(np.float32))
    if experts:
        np.save(os.path.join(path, "aux_loss.npy"), result.aux_loss.numpy().astype(np.float32))
    print(f"{name}: {path}, logits {logits.shape}, |logits| max {np.abs(logits).max():.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("tests", "golden"))
    parser.add_argument("--only", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(GOLDENS)
    unknown = sorted(set(names) - set(GOLDENS))
    if unknown:
        parser.error(f"unknown names {unknown}; valid: {', '.join(GOLDENS)}")
    os.makedirs(args.out, exist_ok=True)
    ids, mask = inputs()
    np.save(os.path.join(args.out, "input_ids.npy"), ids.astype(np.int32))
    np.save(os.path.join(args.out, "attention_mask.npy"), mask.astype(np.int32))
    for name in names:
        make(name, args.out, ids, mask)


if __name__ == "__main__":
    main()
