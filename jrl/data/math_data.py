"""GSM8K- and MATH-style tasks, and a user's own ("custom"): question / answer records read from
local parquet, jsonl, json or csv files with the `datasets` library (never from the Hub; its
progress bars are off while it reads).

Each record gives a prompt (its question field through a template, or the tokenizer's chat
template) and a ground truth (its answer field, scored on the host by jrl/rewards/math.py). All
prompts are tokenized once, at construction. A prompt longer than `max_prompt_length` tokens is
dropped or left-truncated (`overlong_prompts`); `num_dropped` / `num_truncated` count them per
split. P = `prompt_length` is the longest kept prompt (at most `max_prompt_length`), so every
batch has the same static shape.

Order: train batches walk through epoch-wise permutations of the train examples, drawn from
`np.random.default_rng(SeedSequence(seed, spawn_key=(2, stream, epoch)))`; the example at global
position k = step * batch_size + j is `perm(stream, k // N)[k % N]`, so a batch is a pure function
of (seed, stream, step, batch_size), every example is seen once per epoch, and the step alone is
the checkpointable iterator position (resuming at step s with the same batch size reproduces
the rest of the run).

Batches are dicts of numpy arrays (Bp rows, P = prompt_length):
  input_ids       [Bp, P] int32  prompt tokens, LEFT-padded with the pad id
  attention_mask  [Bp, P] int32  1 on real tokens, 0 on padding
  row_id          [Bp]    int32  the example's index in its split's files (before any dropping)
  split           [Bp]    int32  0: the train files, 1: the eval files
`task.ground_truths_for(split, row_id)` gives the ground-truth strings of rows.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os
import string
from typing import Optional, Sequence, Union

import numpy as np

from jrl.data.arithmetic import left_pad

SPLITS = ("train", "eval")  # split ids 0, 1
OVERLONG_POLICIES = ("drop", "truncate", "error")
PROMPT_FORMATS = ("plain", "chat")
DEFAULT_MAX_PROMPT_LENGTH, DEFAULT_MAX_RESPONSE_LENGTH = 512, 1024
_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}

Files = Union[str, Sequence[str]]


def _file_list(files: Files) -> list[str]:
    """A path, a comma-separated string of paths, or a sequence of paths -> list of paths."""
    if isinstance(files, str):
        files = files.split(",")
    return [os.fspath(f).strip() for f in files if os.fspath(f).strip()]


def load_records(files: Files, fields: Sequence[str], split: str) -> dict[str, list]:
    """Reads `fields` of every record of `files` (in order) -> {field: [N] values}.

    A field may name a nested value with dots ("reward_model.ground_truth"). Raises a one-line
    ValueError naming the file or field and the fix for: no files, a missing file, a directory, a
    glob that matches nothing, an unreadable file (permissions), an unsupported extension, mixed
    formats, a file the reader cannot parse, no records, a missing field (the fields present are
    listed) and a record whose field is null or absent.
    """
    import datasets

    paths = _file_list(files)
    if not paths:
        raise ValueError(f"no {split} files given: pass {split}_files='path/to/{split}.parquet'.")
    builders, matched = set(), []
    for path in paths:
        if glob.has_magic(path):
            found = sorted(glob.glob(path))
            if not found:
                raise ValueError(
                    f"{split} files {path!r} match no file: check the pattern in {split}_files."
                )
        elif os.path.isdir(path):
            raise ValueError(
                f"{split} file {path!r} is a directory: give its files in {split}_files, "
                f"comma-separated or as a pattern such as '{os.path.join(path, '*.parquet')}'."
            )
        elif not os.path.isfile(path):
            raise ValueError(
                f"{split} file {path!r} does not exist: check the path given in {split}_files."
            )
        else:
            found = [path]
        ext = os.path.splitext(path)[1].lower()
        if ext not in _BUILDERS:
            raise ValueError(
                f"{split} file {path!r} has extension {ext!r}: use one of "
                f"{', '.join(sorted(_BUILDERS))}."
            )
        builders.add(_BUILDERS[ext])
        matched += found
    for f in matched:
        if not os.access(f, os.R_OK):
            raise ValueError(
                f"{split} file {f!r} is not readable (permission denied): make it readable "
                f"(chmod a+r) or copy it somewhere this user can read."
            )
    if all(os.path.getsize(f) == 0 for f in matched):
        raise ValueError(f"{split} file(s) {paths} hold no records (the files are empty).")
    if len(builders) > 1:
        raise ValueError(f"{split} files {paths} mix formats: give files of one format.")
    builder = builders.pop()
    try:
        with quiet_datasets():
            ds = datasets.load_dataset(builder, data_files=paths, split="train")
    except Exception as e:
        root = _root_cause(e)
        detail = (str(root).strip().splitlines() or [""])[0][:200].rstrip(".")
        raise ValueError(
            f"could not read {split} file(s) {paths} as {builder}: {type(root).__name__}: "
            f"{detail}; check that each file is {_FORMAT_HINTS[builder]}."
        ) from e
    if len(ds) == 0:
        raise ValueError(f"{split} file(s) {paths} hold no records.")
    out = {}
    for field in fields:
        top, *rest = field.split(".")
        if top not in ds.column_names:
            raise ValueError(
                f"field {field!r} not in {split} file(s) {paths}: the fields present are "
                f"{', '.join(ds.column_names)}; set the task's question_field / answer_field (or "
                "template) to match."
            )
        values = ds[top]
        for depth, key in enumerate(rest):
            present = values[0] if values and isinstance(values[0], dict) else {}
            if not all(isinstance(v, dict) and key in v for v in values):
                prefix = ".".join([top, *rest[:depth]])
                raise ValueError(
                    f"field {field!r} not in {split} file(s) {paths}: {prefix!r} has fields "
                    f"{', '.join(present) or '(none)'}; set the task's field names to match."
                )
            values = [v[key] for v in values]
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            raise ValueError(
                f"{split} record {missing[0]} (counting from 0) of {paths} has no {field!r} "
                f"(null or absent in {len(missing)} of {len(values)} records): fix or remove "
                "those records."
            )
        out[field] = list(values)
    return out


@contextlib.contextmanager
def quiet_datasets():
    """`datasets` without its progress bars ("Generating train split: ...") for the loads inside;
    the caller's setting is restored after."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


# What a file of each reader must hold (the hint of a read error).
_FORMAT_HINTS = {
    "parquet": "a valid parquet file",
    "json": "JSON Lines (one JSON object per line) or a JSON list of objects, in UTF-8",
    "csv": "UTF-8 CSV with a header row",
}


def _root_cause(error: BaseException) -> BaseException:
    """The innermost exception of a chain (the reader's own error, not its wrappers)."""
    seen = {id(error)}
    while True:
        inner = error.__cause__ or error.__context__
        if inner is None or id(inner) in seen:
            return error
        seen.add(id(inner))
        error = inner


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


class MathTask:
    """Prompts and ground truths of question / answer records in local files (GSM8K, MATH, ...).

    Args:
      tokenizer: a `transformers` tokenizer with eos and pad tokens.
      train_files: train split: a path, comma-separated paths, or a list of paths (`.parquet`,
        `.jsonl`, `.json`, `.csv`; glob patterns allowed).
      eval_files: eval split in the same form; empty: hold out `eval_size` train examples.
      question_field: the prompt field (dots for nested fields). A list of chat messages
        ({"role", "content"} dicts, as in verl's parquet files) is used as the conversation.
      answer_field: the ground-truth field (e.g. "answer", "solution",
        "reward_model.ground_truth").
      template: format string of the user text; `{question}` is the question field and
        `{name}` any other top-level field. Literal braces are doubled: "\\\\boxed{{}}".
      prompt_format: "plain": (bos +) the template's text; "chat": the tokenizer's chat
        template over [system_prompt,] user text, with the generation prompt added.
      system_prompt: a system message for "chat" (None: none).
      tools: "chat" only: function schemas given to the chat template as `tools=` (a multi-turn
        run's tools, listed in the prompt as the template renders them); None: none.
      max_prompt_length: most prompt tokens, special tokens included (None or 0: 512).
      max_response_length: R, new tokens per response (None or 0: 1024).
      overlong_prompts: "drop" | "truncate" (keep the last max_prompt_length tokens) | "error".
      eval_size: eval rows: the first `eval_size` kept eval examples (0: all); without eval
        files, that many train examples held out by `seed` (must be > 0).
      seed: data order (train permutations and the held-out choice).
      answer_format: "gsm8k" (`####` answers) | "boxed" (`\\boxed{}` answers) | None (neither),
        read by the "format" reward.
      add_bos: prepend the tokenizer's bos token (when it has one) to "plain" prompts.

    Attributes:
      prompt_length, max_response_length, eos_id, pad_id, bos_id: as for ArithmeticTask.
      num_train: train examples in the order (after dropping and holding out).
      eval_size: rows of `eval_batch()`.
      num_examples / num_dropped / num_truncated: {"train": n, "eval": n}: records read,
        prompts dropped, prompts left-truncated.
      questions / ground_truths: per split id (0, 1), the [N] question and ground-truth strings
        of every record read (indexed by `row_id`).
    """

    def __init__(
        self,
        tokenizer,
        *,
        train_files: Files = (),
        eval_files: Files = (),
        question_field: str = "question",
        answer_field: str = "answer",
        template: str = "{question}",
        prompt_format: str = "plain",
        system_prompt: Optional[str] = None,
        tools: Optional[Sequence[dict]] = None,
        max_prompt_length: Optional[int] = None,
        max_response_length: Optional[int] = None,
        overlong_prompts: str = "drop",
        eval_size: int = 0,
        seed: int = 0,
        answer_format: str = "boxed",
        add_bos: bool = True,
        name: str = "math",
    ):
        self.name = name
        max_prompt_length = max_prompt_length or DEFAULT_MAX_PROMPT_LENGTH
        max_response_length = max_response_length or DEFAULT_MAX_RESPONSE_LENGTH
        self._check_options(
            tokenizer,
            prompt_format,
            system_prompt,
            overlong_prompts,
            max_prompt_length,
            max_response_length,
            eval_size,
            template,
        )
        self.tokenizer, self.seed = tokenizer, seed
        self.bos_id, self.eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id
        self.question_field, self.answer_field = question_field, answer_field
        self.template, self.prompt_format = template, prompt_format
        self.system_prompt, self.add_bos = system_prompt, add_bos
        if tools and prompt_format != "chat":
            raise ValueError(
                "tools need prompt_format='chat' (the chat template lists them); set "
                "task.prompt_format=chat."
            )
        self.tools = list(tools) if tools else None
        self.answer_format, self.overlong_prompts = answer_format, overlong_prompts
        self.max_response_length = max_response_length
        self._max_prompt = max_prompt_length

        extra = [f for f in self._template_fields() if f != "question"]
        fields = list(dict.fromkeys([question_field, answer_field, *extra]))
        self.questions, self.ground_truths, self._tokens, self._kept = {}, {}, {}, {}
        self.num_examples, self.num_dropped, self.num_truncated = {}, {}, {}
        split_files = {0: train_files, 1: eval_files if _file_list(eval_files) else None}
        for split, files in split_files.items():
            if files is not None:
                self._load_split(split, files, fields)

        train_kept = self._kept[0]
        if 1 in self._kept:
            eval_index = self._kept[1][: eval_size or None]
            eval_split = 1
        else:
            if not 0 < eval_size < len(train_kept):
                raise ValueError(
                    f"eval_size={eval_size} with no eval_files: give eval_files, or an eval_size "
                    f"in [1, {len(train_kept) - 1}] to hold out that many of the "
                    f"{len(train_kept)} train examples."
                )
            rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1,)))
            held = np.sort(rng.choice(len(train_kept), eval_size, replace=False))
            eval_index = train_kept[held]
            train_kept = np.delete(train_kept, held)
            eval_split = 0
        self._train_index = train_kept
        self.num_train = len(train_kept)
        self._eval_split, self._eval_index = eval_split, eval_index
        self.eval_size = len(eval_index)

        kept = [self._tokens[s][i] for s in self._kept for i in self._kept[s]]
        self.prompt_length = max(map(len, kept))
        self._perms: collections.OrderedDict = collections.OrderedDict()
        self._eval_batch = None

    # ------------------------------------------------------------------------ construction

    @staticmethod
    def _check_options(
        tokenizer,
        prompt_format,
        system_prompt,
        overlong,
        max_prompt,
        max_response,
        eval_size,
        template,
    ):
        for token in ("eos", "pad"):
            if getattr(tokenizer, f"{token}_token_id") is None:
                raise ValueError(f"tokenizer has no {token} token: set tokenizer.{token}_token.")
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(
                f"prompt_format={prompt_format!r}: use one of {', '.join(PROMPT_FORMATS)}."
            )
        if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "prompt_format='chat' but the tokenizer has no chat template: use "
                "prompt_format='plain' with a template, or a tokenizer whose "
                "tokenizer_config.json has a chat_template."
            )
        if system_prompt is not None and prompt_format != "chat":
            raise ValueError("system_prompt needs prompt_format='chat'; put it in the template.")
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(
                f"overlong_prompts={overlong!r}: use one of {', '.join(OVERLONG_POLICIES)}."
            )
        if max_prompt < 1 or max_response < 1:
            raise ValueError(
                f"max_prompt_length={max_prompt} and max_response_length={max_response} must be "
                ">= 1."
            )
        if eval_size < 0:
            raise ValueError(f"eval_size={eval_size} must be >= 0 (0: the whole eval split).")
        if not isinstance(template, str):
            raise ValueError(f"template={template!r} must be a format string like '{{question}}'.")

    def _template_fields(self) -> list[str]:
        try:
            parsed = list(string.Formatter().parse(self.template))
        except ValueError as e:
            raise ValueError(
                f"template {self.template!r} is not a format string ({e}): write literal braces "
                "as {{ and }}, e.g. '\\\\boxed{{}}'."
            ) from e
        return [f.split(".")[0].split("[")[0] for _, f, _, _ in parsed if f]

    def _load_split(self, split: int, files: Files, fields: list[str]) -> None:
        name = SPLITS[split]
        records = load_records(files, fields, name)
        questions = records[self.question_field]
        n = len(questions)
        self.questions[split] = [q if _is_messages(q) else str(q) for q in questions]
        self.ground_truths[split] = [str(a) for a in records[self.answer_field]]
        tokens = self._tokenize(questions, records)
        lengths = np.array([len(t) for t in tokens])
        too_long = np.flatnonzero(lengths > self._max_prompt)
        if len(too_long) and self.overlong_prompts == "error":
            i = too_long[0]
            raise ValueError(
                f"{name} prompt {i} has {lengths[i]} tokens > max_prompt_length="
                f"{self._max_prompt} ({len(too_long)} of {n} are too long): raise "
                "max_prompt_length, or set overlong_prompts='drop' or 'truncate'."
            )
        if self.overlong_prompts == "truncate":
            for i in too_long:
                tokens[i] = tokens[i][-self._max_prompt :]
            kept = np.arange(n)
        else:
            kept = np.flatnonzero(lengths <= self._max_prompt)
        self.num_examples[name] = n
        self.num_dropped[name] = n - len(kept)
        self.num_truncated[name] = len(too_long) if self.overlong_prompts == "truncate" else 0
        if len(kept) == 0:
            raise ValueError(
                f"all {n} {name} prompts are longer than max_prompt_length={self._max_prompt} "
                f"(the shortest has {lengths.min()} tokens): raise max_prompt_length or set "
                "overlong_prompts='truncate'."
            )
        self._tokens[split], self._kept[split] = tokens, kept

    def _user_texts(self, questions, records) -> list:
        """Each record's user text (template filled in) or its own chat messages."""
        texts = []
        for i, q in enumerate(questions):
            if _is_messages(q):
                if self.prompt_format != "chat":
                    raise ValueError(
                        f"field {self.question_field!r} holds chat messages: set "
                        "prompt_format='chat'."
                    )
                texts.append(q)
                continue
            values = {k: v[i] for k, v in records.items() if "." not in k}
            values["question"] = q
            try:
                texts.append(self.template.format_map(values))
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(
                    f"template {self.template!r} failed on record {i}: {type(e).__name__}: {e}; "
                    "use {question} or fields of the records, and double literal braces."
                ) from e
        return texts

    def _tokenize(self, questions, records) -> list[list[int]]:
        texts = self._user_texts(questions, records)
        if self.prompt_format == "chat":
            system = (
                []
                if self.system_prompt is None
                else [{"role": "system", "content": self.system_prompt}]
            )
            chats = [
                t if isinstance(t, list) else system + [{"role": "user", "content": t}]
                for t in texts
            ]
            tools = {"tools": self.tools} if self.tools else {}
            rendered = self.tokenizer.apply_chat_template(
                chats, tokenize=False, add_generation_prompt=True, **tools
            )
            return self.tokenizer(list(rendered), add_special_tokens=False)["input_ids"]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        bos = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        return [bos + list(t) for t in ids]

    # ------------------------------------------------------------------------------ batches

    def _permutation(self, stream: int, epoch: int) -> np.ndarray:
        key = (stream, epoch)
        if key not in self._perms:
            seq = np.random.SeedSequence(self.seed, spawn_key=(2, stream, epoch))
            self._perms[key] = np.random.default_rng(seq).permutation(self.num_train)
            if len(self._perms) > 8:
                self._perms.popitem(last=False)
        return self._perms[key]

    def epoch(self, step: int, batch_size: int) -> int:
        """The epoch that the first example of train batch `step` belongs to."""
        return step * batch_size // self.num_train

    def train_indices(self, step: int, batch_size: int, stream: int = 0) -> np.ndarray:
        """Row ids [batch_size] (into the train files) of train batch `step`."""
        if step < 0 or batch_size < 0 or stream < 0:
            raise ValueError(f"step={step}, batch_size={batch_size}, stream={stream} must be >= 0.")
        k = step * batch_size + np.arange(batch_size, dtype=np.int64)
        epochs, offsets = np.divmod(k, self.num_train)
        order = np.empty(batch_size, np.int64)
        for e in np.unique(epochs):
            at = epochs == e
            order[at] = self._permutation(stream, int(e))[offsets[at]]
        return self._train_index[order]

    def encode(self, split: int, row_ids) -> dict:
        """Rows of `split` (their `row_id`s) -> the batch dict described in the module docstring."""
        row_ids = np.asarray(row_ids, np.int64).reshape(-1)
        tokens = [self._tokens[split][i] for i in row_ids]
        input_ids, attention_mask = left_pad(tokens, self.prompt_length, self.pad_id)
        return dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            row_id=row_ids.astype(np.int32),
            split=np.full(len(row_ids), split, np.int32),
        )

    def train_batch(
        self, step: int, batch_size: int, stream: int = 0, rows: slice = slice(None)
    ) -> dict:
        """The train batch of `step`: same (seed, stream, step, batch_size) -> same batch.
        Streams keep uses apart (0: RL steps, 1: a supervised warm-up, 2: probes). `rows`: only
        those rows of it (a host's share in a multi-host run)."""
        return self.encode(0, self.train_indices(step, batch_size, stream)[rows])

    def eval_batch(self) -> dict:
        """The eval rows (`eval_size`) in file order; computed once."""
        if self._eval_batch is None:
            self._eval_batch = self.encode(self._eval_split, self._eval_index)
        return {k: v.copy() for k, v in self._eval_batch.items()}

    def ground_truths_for(self, split, row_id) -> list[str]:
        """Ground-truth strings of rows: `split` [N] and `row_id` [N] ints (batch["split"],
        batch["row_id"])."""
        out = []
        for s, r in zip(
            np.asarray(split).reshape(-1).tolist(), np.asarray(row_id).reshape(-1).tolist()
        ):
            truths = self.ground_truths.get(s)
            if truths is None or not 0 <= r < len(truths):
                size = "no" if truths is None else len(truths)
                raise IndexError(
                    f"no ground truth for split {s}, row_id {r}: the {self.name} task has "
                    f"{size} records in that split; pass batches made by this task."
                )
            out.append(truths[r])
        return out

    def decode_responses(self, response_ids, response_mask, skip_special_tokens: bool = True):
        """Token ids [B, T] and mask [B, T] -> B strings of the masked tokens (for logging)."""
        ids, mask = np.asarray(response_ids), np.asarray(response_mask)
        rows = [row[m > 0].tolist() for row, m in zip(ids, mask)]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=skip_special_tokens)


# Instructions of the built-in tasks' default templates.
GSM8K_TEMPLATE = (
    '{question}\nSolve it step by step, then write the final answer as a number after "####".'
)
MATH_TEMPLATE = "{question}\nSolve it step by step, then write the final answer in \\boxed{{}}."


# The built-in tasks' defaults of MathTask's options, one row each in the order of DEFAULT_FIELDS;
# CUSTOM_DEFAULTS, a user's own prompt / answer file: the question as it is, no instruction added.
DEFAULT_FIELDS = ("question_field", "answer_field", "template", "answer_format", "name")
GSM8K_DEFAULTS = dict(zip(DEFAULT_FIELDS, ("question", "answer", GSM8K_TEMPLATE, "gsm8k", "gsm8k")))
MATH_DEFAULTS = dict(zip(DEFAULT_FIELDS, ("problem", "solution", MATH_TEMPLATE, "boxed", "math")))
CUSTOM_DEFAULTS = dict(zip(DEFAULT_FIELDS, ("question", "answer", "{question}", None, "custom")))


def gsm8k_task(tokenizer, **kwargs) -> MathTask:
    """GSM8K-style records: `question` -> prompt, `answer` (worked solution ending in
    "#### <number>") -> ground truth, for the "gsm8k" reward. Takes `MathTask`'s keyword
    options; the defaults are GSM8K_DEFAULTS."""
    return MathTask(tokenizer, **{**GSM8K_DEFAULTS, **kwargs})


def math_task(tokenizer, **kwargs) -> MathTask:
    """MATH-style records: `problem` -> prompt, `solution` (with a final \\boxed{} answer; or a
    bare answer, e.g. answer_field="answer" for MATH-500) -> ground truth, for the "math" reward.
    Takes `MathTask`'s keyword options; the defaults are MATH_DEFAULTS."""
    return MathTask(tokenizer, **{**MATH_DEFAULTS, **kwargs})


def custom_task(tokenizer, **kwargs) -> MathTask:
    """A user's own records: `question` -> prompt exactly as written (template "{question}": no
    instruction added), `answer` -> ground truth, for a user reward function (or "gsm8k" /
    "math"). Takes `MathTask`'s keyword options; the defaults are CUSTOM_DEFAULTS."""
    return MathTask(tokenizer, **{**CUSTOM_DEFAULTS, **kwargs})
