"""GRPO on GSM8K with a calculator: a Hugging Face chat model (Qwen2.5-0.5B-Instruct's shape and
settings, `model=qwen2.5-0.5b`) whose chat template supports tools calls `calc` in the `hermes`
format (docs/multi_turn.md): the prompt lists the tool (the template's `tools=`), the model writes
`<tool_call>{"name": "calc", "arguments": {"expression": "48/2"}}</tool_call>` and ends its turn,
the answer comes back as a `tool` message rendered by the same template, and the model goes on;
the GSM8K reward reads the model's final turn, after the last tool answer, strictly: the number
after "####" (a tool's answer is never read as the model's; docs/multi_turn.md).

Run (local files; nothing is downloaded):
  python -m jrl.train --config=configs/gsm8k_tools.py \
    --config.model.hf_path=/models/Qwen2.5-0.5B-Instruct \
    --config.task.train_files=/data/gsm8k/train.parquet \
    --config.task.eval_files=/data/gsm8k/test.parquet --workdir=/tmp/jrl/gsm8k_tools
Presets after ':' apply after this file's own (configs/common.py: model=qwen2.5-1.5b or model=hf
instead of model=qwen2.5-0.5b, lora, mesh=...; tiny: the small random model, with a chat
tokenizer given as --config.tokenizer=DIR); `--config.rollout.multi_turn.enable=False` runs the
same without tools.

Fields are documented in jrl/config/schema.py; the base and the presets are in configs/common.py.
"""

from jrl import config as config_lib

# The bases and presets the files here share, read by path (from any working directory).
common = config_lib.load_file("common.py", next_to=__file__)

PRESETS = common.PRESETS  # the presets after ':' (configs/common.py)


def get_config(arg: str | None = None):
    # GSM8K from local files with Qwen2.5-0.5B-Instruct's settings (unless the presets given
    # name another model, or tiny: the small random model), then the presets given
    given = [p for p in (arg or "").split(",") if p]
    own = any(p.startswith("model=") or p == "tiny" for p in given)
    presets = ["data=gsm8k", *([] if own else ["model=qwen2.5-0.5b"]), *given]
    c = common.math_base(",".join(presets), config_file="configs/gsm8k_tools.py")
    c.tokenizer = ""  # the chat model's own (model.hf_path), or --config.tokenizer=DIR
    c.warmup.sft_steps = 0  # a pretrained model, no warm-up (after the presets: tiny sets one)
    c.task.prompt_format = "chat"  # the chat template renders the prompt and lists the tools
    c.data.max_prompt_length = 512  # P: the question and the template's tool list (~250 tokens)
    c.data.max_response_length = 768  # R: the reasoning plus a few tool turns of ~30 tokens

    c.rollout.multi_turn.enable = True  # tool calls in the rollout
    c.rollout.multi_turn.format = "hermes"  # <tool_call>{...}</tool_call>; answers as tool messages
    c.rollout.multi_turn.tools = "calc"  # exact arithmetic (jrl/tools/calc.py)
    c.rollout.multi_turn.max_assistant_turns = 5  # up to four calls, then the answer
    c.rollout.multi_turn.max_tool_response_length = 64  # a number, or a one-line error
    c.task.gsm8k_fallback = "none"  # strict: only a "####" answer counts (verl's gsm8k default)
    return c
