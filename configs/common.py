"""What the config files next to this one share: the GRPO- and PPO-on-math bases (`math_base`,
`ppo_math_base`) and the presets after ':' (`PRESETS`: tiny, drgrpo, model=, lora, data=, mesh=).

The files in configs/ read this one by its path (`config_lib.load_file`), so a config works from
any working directory and when given by an absolute path. Every field and its default is in
jrl/config/schema.py (`base_config`); here only what the math configs change, a comment per field.
"""

from __future__ import annotations

from jrl import config as config_lib
from jrl.registry import Registry, suggest


def math_base(arg: str | None = None, config_file: str = "configs/grpo_math.py"):
    """GRPO on math (configs/grpo_math.py), the base every configs/*_math.py file starts from:
    the built-in character-level model on built-in arithmetic, with the presets named in `arg`
    (comma-separated PRESETS names) applied; `config_file` names the file in errors."""
    c = config_lib.base_config()
    c.total_steps = 250  # RL steps of the default demo (about a minute on a 2-core CPU)
    c.eval_every = 50  # greedy accuracy on the held-out split every 50 steps

    # A small decoder that learns 2-digit addition: supervised warm-up to a partial policy, then RL.
    c.model.hidden_size = 128  # residual width
    c.model.num_layers = 2  # decoder blocks
    c.model.num_heads = 4  # query heads
    c.model.num_kv_heads = 2  # grouped-query attention
    c.model.intermediate_size = 256  # MLP width

    c.warmup.sft_steps = 3000  # supervised warm-up, at most this many steps ...
    c.warmup.target_accuracy = 0.3  # ... until greedy train accuracy reaches 30%: RL has work left
    c.warmup.check_every = (
        10  # accuracy checks during the warm-up: fine enough to stop near the target
    )
    c.warmup.sft_lr = 1e-3  # warm-up learning rate

    c.data.train_batch_size = 32  # prompts per step
    c.rollout.n = 8  # samples per prompt (group size)
    c.actor.ppo_mini_batch_size = 16  # 2 updates per step
    c.actor.lr = 2e-4  # RL learning rate
    c.algorithm.adv_estimator = "grpo"  # group-relative advantages
    c.algorithm.norm_adv_by_std_in_grpo = True  # divide by the group std (False: Dr.GRPO)

    presets = [p for p in (arg or "").split(",") if p]
    # mesh= presets go last whatever their place: their batch sizes, fitted to the devices, win
    # over a model= preset's; lora goes after model= (its learning rate and batch win).
    for preset in sorted(presets, key=lambda p: (p.startswith("mesh="), p == "lora")):
        if preset not in PRESETS:
            raise config_lib.ConfigError(
                f"unknown preset '{preset}'{suggest(preset, PRESETS)} in "
                f"--config={config_file}:{arg}; valid presets: {', '.join(PRESETS)}."
            )
        PRESETS[preset](c)
    return c


def _tiny(c):  # a few-second run for tests and smoke checks
    c.total_steps = 3
    c.eval_every = 0
    c.model.hidden_size = 32
    c.model.intermediate_size = 64
    c.warmup.sft_steps = 2
    c.task.eval_size = 16
    c.data.train_batch_size = 4
    c.rollout.n = 4
    c.actor.ppo_mini_batch_size = 2


def _drgrpo(c):  # Dr.GRPO: advantages not divided by the group std
    c.algorithm.norm_adv_by_std_in_grpo = False


def _hf_model(c, batch_size: int, mini_batch_size: int):
    """A Qwen2.5 policy from a local HF directory (--config.model.hf_path=DIR) with its own
    tokenizer, or without one randomly initialised in the preset's shape (--config.tokenizer=...):
    bfloat16 compute over float32 master weights, no warm-up, a KL loss to the reference as in
    verl's GSM8K GRPO example, a learning rate for a pretrained model."""
    c.tokenizer = ""  # the checkpoint's own tokenizer
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "float32"  # master weights
    c.warmup.sft_steps = 0  # a pretrained model needs no warm-up
    c.total_steps = 500  # RL steps
    c.eval_every = 50  # greedy eval every 50 steps
    c.data.train_batch_size = batch_size  # prompts per step
    c.actor.ppo_mini_batch_size = mini_batch_size  # prompts per optimizer update
    c.rollout.n = 8  # samples per prompt
    c.rollout.temperature = 1.0  # sampling temperature
    c.actor.lr = 1e-6  # verl's GSM8K GRPO learning rate
    c.actor.lr_warmup_steps = 10  # short warm-up of the learning rate
    c.actor.weight_decay = 0.01  # AdamW weight decay
    c.actor.use_kl_loss = True  # KL loss to the frozen reference ...
    c.actor.kl_loss_coef = 0.001  # ... with verl's coefficient ...
    c.actor.kl_loss_type = "low_var_kl"  # ... and estimator
    # Memory (python -m jrl.bench --memory gives the figures for a config; README "Will it fit?"):
    c.model.remat = "block"  # keep only each decoder block's input for the backward
    c.model.logits_chunk_size = 128  # log-probs 128 positions at a time: no [rows, L, 152k] logits
    c.model.attention = "auto"  # cuDNN flash attention on GPUs, blockwise past 512 tokens on CPU
    c.actor.ppo_micro_batch_size_per_device = 8  # rows per device per forward / backward
    c.rollout.log_prob_micro_batch_size_per_device = 16  # rows per device per scoring forward


def _hf(c):
    """Any local HF checkpoint (--config.model.hf_path=DIR): its own architecture (config.json)
    and tokenizer; verl's GSM8K GRPO example's settings for a pretrained model (lr 1e-6 constant,
    KL loss 0.001 low_var_kl), no weight decay (verl's AdamW default 0.01 would take 1e-8 of each
    weight per update at this lr) and one optimizer update per step. Compute stays float32
    (--config.model.dtype=bfloat16 halves activation memory on GPU / TPU); the memory settings of
    "Will it fit?" (README) stay off."""
    c.tokenizer = ""  # the checkpoint's own tokenizer
    c.warmup.sft_steps = 0  # a pretrained model needs no supervised warm-up
    c.data.train_batch_size = 8  # prompts per step (64 rows with 8 samples each)
    c.rollout.n = 8  # samples per prompt (group size)
    c.actor.ppo_mini_batch_size = 8  # = train_batch_size: one optimizer update per step
    c.actor.ppo_epochs = 1  # one pass over the step's rollouts
    c.actor.lr = 1e-6  # verl's GRPO learning rate for a pretrained model
    c.actor.lr_warmup_steps = 0  # constant learning rate from the first update
    c.actor.weight_decay = 0.0  # plain Adam moments, no pull of the weights towards 0
    c.actor.use_kl_loss = True  # KL loss to the frozen starting model, as verl's GRPO example
    c.actor.kl_loss_coef = 0.001  # verl's coefficient
    c.actor.kl_loss_type = "low_var_kl"  # verl's estimator (k3)
    c.actor.entropy_coeff = 0.0  # no entropy bonus


def _qwen25(c):
    """What every Qwen2.5 size shares (its config.json): with model.hf_path the checkpoint's own
    config.json is used instead; without it, a random model of the preset's exact shape."""
    c.model.head_dim = 0  # hidden_size / num_heads: 64 (0.5B) or 128 (1.5B, 7B)
    c.model.rope_theta = 1_000_000.0  # rope_theta: Qwen2.5's RoPE base for its 32k context
    c.model.rms_norm_eps = 1e-6  # rms_norm_eps
    c.model.qkv_bias = True  # Qwen2 family: biases on the q / k / v projections
    c.model.max_position_embeddings = 32768  # the Instruct checkpoints' context length


def _qwen05(c):  # Qwen2.5-0.5B(-Instruct): 0.49B parameters (0.36B without the embedding)
    _hf_model(c, batch_size=64, mini_batch_size=16)  # 64 prompts x 8 samples per step
    _qwen25(c)
    c.model.vocab_size = 151936  # config.json: the embedding has more rows than the tokenizer
    c.model.hidden_size = 896  # hidden_size
    c.model.num_layers = 24  # num_hidden_layers
    c.model.num_heads = 14  # num_attention_heads
    c.model.num_kv_heads = 2  # num_key_value_heads (grouped-query attention, 7 queries per kv)
    c.model.intermediate_size = 4864  # intermediate_size (SwiGLU)
    c.model.tie_word_embeddings = True  # the output head is the embedding (small models)


def _qwen15(c):  # Qwen2.5-1.5B(-Instruct): 1.54B parameters (1.31B without the embedding)
    _hf_model(c, batch_size=32, mini_batch_size=8)  # 32 prompts x 8 samples per step
    _qwen25(c)
    c.model.vocab_size = 151936  # config.json vocab_size
    c.model.hidden_size = 1536  # hidden_size
    c.model.num_layers = 28  # num_hidden_layers
    c.model.num_heads = 12  # num_attention_heads
    c.model.num_kv_heads = 2  # num_key_value_heads (6 queries per kv head)
    c.model.intermediate_size = 8960  # intermediate_size (SwiGLU)
    c.model.tie_word_embeddings = True  # tied, as in 0.5B


def _qwen7(c):  # Qwen2.5-7B(-Instruct): 7.61B parameters (6.53B without the embeddings)
    _hf_model(c, batch_size=32, mini_batch_size=8)  # one device cannot hold it: add a mesh=
    _qwen25(c)
    c.model.vocab_size = 152064  # config.json: 7B and larger pad the vocabulary further
    c.model.hidden_size = 3584  # hidden_size
    c.model.num_layers = 28  # num_hidden_layers
    c.model.num_heads = 28  # num_attention_heads
    c.model.num_kv_heads = 4  # num_key_value_heads (7 queries per kv head)
    c.model.intermediate_size = 18944  # intermediate_size (SwiGLU)
    c.model.tie_word_embeddings = False  # a separate output head (0.55B more parameters)


def _qwen3_moe(c):
    """What Qwen3-MoE checkpoints share (config.json of Qwen/Qwen3-30B-A3B: checked against
    copies of it in other projects, not the Hub file itself): RMSNorm on queries and keys, no
    biases, head_dim 128, every layer sparse (decoder_sparse_step 1, no mlp_only_layers), the
    top-k weights renormalised. jrl/config/schema.py has no mixture-of-experts fields yet, so
    these presets add them to model.* (trainer.model_config passes model.* on to ModelConfig,
    whose defaults, 0 experts: dense, hold for every other config)."""
    c.model.head_dim = 128  # head_dim (32 heads x 128 > hidden 2048: Qwen3's wide projections)
    c.model.rope_theta = 1_000_000.0  # rope_theta
    c.model.rms_norm_eps = 1e-6  # rms_norm_eps
    c.model.qkv_bias = False  # attention_bias: false
    c.model.qk_norm = True  # Qwen3: RMSNorm over head_dim on every query / key head
    c.model.tie_word_embeddings = False  # tie_word_embeddings: false
    c.model.vocab_size = 151936  # vocab_size
    c.model.num_kv_heads = 4  # num_key_value_heads
    c.model.norm_topk_prob = True  # norm_topk_prob: the 8 weights divided by their sum
    c.model.router_aux_loss_coef = 0.001  # router_aux_loss_coef (written on export; see moe.py)
    c.model.max_position_embeddings = 40960  # max_position_embeddings


def _qwen3_30b_a3b(c):  # Qwen3-30B-A3B: 30.5B parameters, 3.35B active per token
    _hf_model(c, batch_size=32, mini_batch_size=8)  # 488 GB of state with the reference: add
    # an expert mesh (mesh=v5p-64-ep: 15.3 GB per chip)
    _qwen3_moe(c)
    c.model.hidden_size = 2048  # hidden_size
    c.model.num_layers = 48  # num_hidden_layers
    c.model.num_heads = 32  # num_attention_heads
    c.model.intermediate_size = 6144  # intermediate_size (a dense MLP's; no layer has one)
    c.model.num_experts = 128  # num_experts
    c.model.num_experts_per_tok = 8  # num_experts_per_tok
    c.model.moe_intermediate_size = 768  # moe_intermediate_size: each expert's SwiGLU width
    c.model.scan_cached_layers = True  # the rollout's 48 layers compiled once, not 48 times


def _qwen3_moe_small(c):  # a small Qwen3-MoE shape for benches (no such checkpoint): 1.0B
    # parameters, 0.47B active per token (0.16B without the embeddings)
    _hf_model(c, batch_size=64, mini_batch_size=16)
    _qwen3_moe(c)
    c.model.hidden_size = 1024  # half of 30B-A3B's
    c.model.num_layers = 16  # a third
    c.model.num_heads = 16  # half, of the same width (128)
    c.model.intermediate_size = 3072  # unused: every layer is sparse
    c.model.num_experts = 32  # a quarter
    c.model.num_experts_per_tok = 4  # half
    c.model.moe_intermediate_size = 384  # half


# Mesh presets. The axes are (data, fsdp, tensor) (jrl/sharding.py), and with expert parallelism
# (the -ep presets) (data, fsdp, expert, tensor); -1 takes the devices the others leave. Why the
# shapes: FSDP over the chips of one host (their fast links carry the per-layer all-gathers;
# each chip holds 1/fsdp of the parameters, Adam moments and reference), data parallelism over
# hosts for the rest (only gradients cross hosts), tensor parallelism never: with FSDP alone
# every Qwen2.5 preset up to 7B fits where it is meant to run, and splitting heads would add two
# all-reduces per layer. A mixture of experts splits its experts over the expert axis, which is
# one more FSDP axis for everything else. State per device with the KL-loss reference (float32
# params + Adam mu, nu + reference = 16 bytes/parameter) is checked in tests/cli/presets_test.py.
# Batch sizes are in prompts (x rollout.n = 8 rows): a step's prompts and a mini-batch's rows
# are multiples of data x fsdp (x expert), so they split evenly. Activations no longer bound them
# (chunked log-probs, block remat, micro-batches of the _hf_model settings): the figures in the
# comments are `python -m jrl.bench --memory` peaks per device at GSM8K / MATH lengths (256 + 512 /
# 512 + 1024 tokens), compiled for CPU host devices standing in for the chips. XLA:CPU computes
# bfloat16 matmuls in float32 and keeps float32 copies of the weights it converts, so for these
# bfloat16 models they are upper bounds.


def _gpu8(c):  # one host with 8 GPUs (e.g. 8x H100 80 GB over NVLink)
    c.mesh.shape = (-1, 8, 1)  # FSDP over the 8 GPUs; data: 1 per host (more hosts, more data)
    c.data.train_batch_size = 128  # 1024 rows, 128 per GPU in the rollout and when scoring
    c.actor.ppo_mini_batch_size = 32  # 256 rows, 32 per GPU per update: 4 updates per step
    # peak per GPU: 0.5B 7.8 / 13.4 GB, 1.5B 19.7 / 25.4 GB (GSM8K / MATH lengths) of 80 GB


def _v4_8(c):  # one TPU v4 host: 4 chips (v4-8 counts TensorCores), 32 GiB HBM each
    c.mesh.shape = (-1, 4, 1)  # FSDP over the 4 chips; for 0.5B / 1.5B (7B's 122 GB of state
    # with a reference would leave no room on 4 x 32 GiB: take mesh=v5p-64)
    c.data.train_batch_size = 64  # 512 rows, 128 per chip in the rollout and when scoring
    c.actor.ppo_mini_batch_size = 16  # 128 rows, 32 per chip per update
    # peak per chip: 0.5B 8.7 / 14.4 GB, 1.5B 22.9 / 28.5 GB (GSM8K / MATH lengths) of 34.4 GB


def _v5p_64(c):  # a v5p-64 slice: 32 chips (64 TensorCores) on 8 hosts of 4, 95 GB HBM each
    c.mesh.shape = (-1, 4, 1)  # FSDP over a host's 4 chips (7B: 30 GB of state per chip),
    # data parallelism over the 8 hosts
    c.data.train_batch_size = 64  # 512 rows, 16 per chip in the rollout and when scoring
    c.actor.ppo_mini_batch_size = 16  # 128 rows, 4 per chip per update: 4 updates per step
    c.actor.ppo_micro_batch_size_per_device = 4  # the 4 rows of a chip at once
    # peak per chip, 7B, GSM8K lengths: 44.8 GB from the TPU compiler (--target=tpu) of 95.7 GB;
    # XLA:CPU, an upper bound (float32 copies of gathered weights), says 99.5 GB
    # (docs/memory.md). Not yet run on a v5p.


def _v5p_64_ep(c):  # a v5p-64 slice (32 chips, 95 GB HBM each) for a mixture of experts
    c.mesh.axes = ("data", "fsdp", "expert", "tensor")  # jrl.sharding.EXPERT_MESH_AXES
    c.mesh.shape = (-1, 4, 8, 1)  # experts split 8 ways (30B-A3B: 16 of its 128 per chip), the
    # experts' hidden dim and everything else's over fsdp 4 x expert 8 (FSDP over all 32 chips:
    # 15.3 GB of state per chip for 30B-A3B with the reference); rows over the 32 chips, each
    # layer's tokens gathered over the 8 chips of an expert group and summed back
    c.data.train_batch_size = 64  # 512 rows, 16 per chip in the rollout and when scoring
    c.actor.ppo_mini_batch_size = 16  # 128 rows, 4 per chip per update: 4 updates per step
    c.actor.ppo_micro_batch_size_per_device = 4  # the 4 rows of a chip at once
    # peak per chip: see docs/memory.md ("Mixtures of experts"). Not yet run on a v5p.


def _gpu8_ep(c):  # one host with 8 GPUs (80 GB) for a mixture of experts
    c.mesh.axes = ("data", "fsdp", "expert", "tensor")  # jrl.sharding.EXPERT_MESH_AXES
    c.mesh.shape = (-1, 1, 8, 1)  # experts split 8 ways, everything else FSDP over the 8 GPUs
    # (the expert axis is an FSDP axis for the dense weights); data: 1 per host. 30B-A3B's
    # state with the reference is 61 GB per GPU here: for it, prefer more GPUs
    c.data.train_batch_size = 128  # 1024 rows, 128 per GPU in the rollout and when scoring
    c.actor.ppo_mini_batch_size = 32  # 256 rows, 32 per GPU per update: 4 updates per step


def _lora(c):  # LoRA: adapters on a frozen bfloat16 base, the KL reference at no extra cost
    c.lora.rank = 16  # adapter rank
    c.lora.alpha = 32.0  # adapters scale by alpha / rank = 2
    c.actor.lr = 1e-5  # adapters take a larger rate than full fine-tuning's 1e-6
    # One 80 GB GPU for qwen2.5-7b (mesh as is): the base (15.2 GB) + adapters and Adam (0.5 GB)
    # leave the rest to activations. The memory report's peak is the rollout's, so it follows
    # the rows per step, not the micro-batches (XLA:CPU, GSM8K lengths: 82.8 GB at 8 prompts).
    c.data.train_batch_size = 4  # prompts per step (32 rows)
    c.actor.ppo_mini_batch_size = 2  # prompts per update: 2 updates per step
    c.actor.ppo_micro_batch_size_per_device = 4  # rows per forward / backward
    c.rollout.log_prob_micro_batch_size_per_device = 16  # rows per scoring forward


def _file_task(c, name: str, reward: str, prompt_length: int, response_length: int):
    """A task read from local files (--config.task.train_files=..., eval_files=...)."""
    c.task.name = name
    c.warmup.sft_steps = 0  # the supervised warm-up needs the arithmetic task's answers
    c.task.reward = reward
    c.task.eval_size = 256  # eval rows (of the eval file)
    c.data.max_prompt_length = prompt_length  # P
    c.data.max_response_length = response_length  # R


def _gsm8k(c):  # GSM8K: questions fit in P = 256 tokens, R = 512 leaves room for the reasoning;
    # reward: the number after "####" (else the last number), compared exactly
    _file_task(c, "gsm8k", reward="gsm8k", prompt_length=256, response_length=512)


def _math(c):  # MATH; reward: the last \boxed{...}, checked by math-verify or sympy
    _file_task(c, "math", reward="math", prompt_length=512, response_length=1024)


def _custom(c):  # your own question / answer files (--config.task.train_files=..., eval_files=...)
    c.task.name = "custom"  # prompt = the question field as written (task.template="{question}")
    c.warmup.sft_steps = 0  # the supervised warm-up needs the arithmetic task's answers
    # task.reward: set it to your function (path/to/reward.py:function or package.module:function)


PRESETS = Registry(  # name -> fn(cfg) changing it in place; listed in this order
    "preset",
    {
        "tiny": _tiny,
        "drgrpo": _drgrpo,
        "model=qwen2.5-0.5b": _qwen05,
        "model=qwen2.5-1.5b": _qwen15,
        "model=qwen2.5-7b": _qwen7,
        "model=qwen3-30b-a3b": _qwen3_30b_a3b,
        "model=qwen3-moe-small": _qwen3_moe_small,
        "model=hf": _hf,
        "lora": _lora,
        "data=gsm8k": _gsm8k,
        "data=math": _math,
        "data=custom": _custom,
        "mesh=gpu8": _gpu8,
        "mesh=v4-8": _v4_8,
        "mesh=v5p-64": _v5p_64,
        "mesh=gpu8-ep": _gpu8_ep,
        "mesh=v5p-64-ep": _v5p_64_ep,
    },
)


def ppo_math_base(arg: str | None = None, config_file: str = "configs/ppo_math.py"):
    """PPO on math (configs/ppo_math.py): `math_base` with GAE advantages and a learned critic;
    the `shared` preset puts the value head on the policy's backbone."""
    presets = [p for p in (arg or "").split(",") if p]
    shared = "shared" in presets
    c = math_base(",".join(p for p in presets if p != "shared"), config_file)
    c.algorithm.adv_estimator = "gae"  # per-token advantages from the critic's values
    c.algorithm.gamma = 1.0  # no discount (verl's default)
    c.algorithm.lam = 1.0  # GAE lambda (verl's default)
    c.critic.share_backbone = shared  # separate critic network unless the `shared` preset
    c.critic.lr = 1e-3  # critic learning rate: it learns from scratch on a value head
    c.critic.cliprange_value = 0.5  # value clipping around the rollout-time values
    c.critic.critic_warmup = 0  # steps of critic-only training before the policy moves
    return c
