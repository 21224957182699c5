"""GRPO with a calculator: the built-in character model on 3-digit multiplication, which it
cannot learn to do reliably in its head in a few minutes, with the `calc` tool in the compact
format (docs/multi_turn.md): the model writes `<123*456>`, decoding pauses at `>`, the host
appends `=56088;` (response_mask 0), and the model writes its final answer `56088<eos>`.

The supervised warm-up shows a tool call on a `task.tool_demos` share of its problems (in a
`task.tool_call_share` share of those the opening `<`, the choice to call, is trained) and the
bare answer on the others; RL then finds that the call pays (docs/demos.md "Tools (multi-turn)").
Without tools (`--config.rollout.multi_turn.enable=False`) the same run warms up on bare answers
only.

Run:
  python -m jrl.train --config=configs/tool_math.py --workdir=/tmp/jrl/tool_math --config.seed=0
  python -m jrl.train --config=configs/tool_math.py --workdir=/tmp/jrl/no_tools \
    --config.rollout.multi_turn.enable=False

Fields are documented in jrl/config/schema.py; the base and the presets are in configs/common.py.
"""

from jrl import config as config_lib

# The bases and presets the files here share, read by path (from any working directory).
common = config_lib.load_file("common.py", next_to=__file__)

PRESETS = common.PRESETS  # the presets after ':' (configs/common.py)


def get_config(arg: str | None = None):
    c = common.math_base(arg, config_file="configs/tool_math.py")
    # Presets were applied by math_base; the task and tools below are this demo's own.
    c.task.name = "tool_arith"  # arithmetic with tool-call demonstrations in the warm-up
    c.task.num_digits = 3  # 3-digit operands ...
    c.task.ops = "*"  # ... multiplied: up to 6-digit answers
    # Half the warm-up answers are a call, the tool's answer and the answer: practice at copying
    # the operands into the call and the tool's answer out of it ...
    c.task.tool_demos = 0.5
    # ... but only a fifth of those train the choice to call (the opening `<`): `<` is the first
    # token of a tenth of the rows that train the first token against half that answer bare, so
    # the greedy model still answers bare (and wrong) and a sampled one calls about one time in six
    c.task.tool_call_share = 0.2
    c.task.reward = "arithmetic_final_answer"  # the answer after the last tool block, exactly

    c.rollout.multi_turn.enable = True  # tool calls in the rollout
    c.rollout.multi_turn.format = "compact"  # <123*456> -> =56088; (the character tokenizer)
    c.rollout.multi_turn.tools = "calc"  # exact arithmetic (jrl/tools/calc.py)
    c.rollout.multi_turn.max_assistant_turns = 2  # a call, then the answer
    c.rollout.multi_turn.max_tool_response_length = 8  # a 6-digit product, or a short error

    c.total_steps = 60  # RL steps (with the warm-up, within 10 minutes on a 2-core CPU)
    c.eval_every = 20  # greedy accuracy on the 256 held-out problems every 20 steps
    c.warmup.sft_steps = 600  # a fixed supervised warm-up: the calls are well formed ...
    c.warmup.target_accuracy = 1.0  # ... whatever the accuracy (no early stop)
    c.warmup.check_every = 600  # one accuracy check, at the end
    return c
