"""What several test modules share beyond tests/conftest.py (no test module imports another):

- `cli`: the trainer's CLI in subprocesses (`run`, `start`, `cache_env`, the tiny config's flags)
  and metrics.jsonl readers.
- `write_fault`: `python tests/helpers/write_fault.py TARGET:N ...`, the CLI with a write failing
  as on a full disk.
- `multihost_agree`: one process of the two-process jax.distributed test.
- `faulty_tools`: a user tool that answers, raises and sleeps in turn
  (`helpers.faulty_tools:flaky`).
- `scale_rewards`: a user reward for the scale-out runs
  (`tests.helpers.scale_rewards:vowel_share`).
- `algos_fixtures`: complete config sections and thin callers of the bound RL maths.
- `text_tokenizers`: tiny real byte-level and SentencePiece-style BPE tokenizers.
- `tools_fixtures`: the tiny Qwen-style tokenizer, its tool message, a multi-turn config and one
  tool-host call read back.
- `hermes_script`: the scripted tool-calling decoder of the `hermes` multi-turn step tests.
- `steps`: a config's step phases, and two update phases compared on one scored batch.
- `tiny_decoders`: the Llama-like and Gemma-like decoders of the model tests, random parameters.
- `reward_batches`: a GSM8K task of the character tokenizer, hand-written responses to its eval
  prompts, a reward jitted over them.
- `scripted_host`: a tool host answering a tiny model's calls from a script (multi-turn rollouts).

tests/ is on sys.path in every test (pytest puts the conftest's folder there), so a test imports
these as `from helpers.cli import run`; a subprocess started with the repository as its current
directory names them `tests.helpers.<module>`."""
