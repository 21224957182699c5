"""Tokenizers: the built-in character tokenizer of the demo task, and local Hugging Face tokenizers.

Every tokenizer jrl uses is a `transformers.PreTrainedTokenizerFast` with a pad, bos (optional for
HF tokenizers) and eos token. Encoding never adds special tokens behind the caller's back for the
character tokenizer; callers add `<bos>` / `<eos>` explicitly.
"""

import os

import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

# The character tokenizer's vocabulary in id order: ids 0..3 are the special tokens, then one
# token per character. Checkpoints store embeddings by id, so this order is fixed forever:
# changing or reordering it breaks every saved character-level model. Only append at the end.
CHAR_VOCAB = SPECIAL_TOKENS + tuple(
    "0123456789+-*/=() .,:;?!'\"#%&<>_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

# Files any one of which makes a directory loadable by `AutoTokenizer`.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def char_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The built-in character-level tokenizer (len(CHAR_VOCAB) = 88 tokens).

    One token per character of `CHAR_VOCAB`; `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3. A
    character outside the vocabulary (e.g. a newline or "é") encodes to `<unk>` (id 3), so
    `decode(encode(s)) == s` holds exactly for strings made of vocabulary characters. The literal
    strings "<pad>", "<bos>", "<eos>", "<unk>" in a text encode to their special token.
    `encode` / `__call__` add no special tokens; decoding concatenates characters with nothing
    in between.
    """
    vocab = {tok: i for i, tok in enumerate(CHAR_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
        add_eos_token=False,
    )


def load_hf_tokenizer(path: str) -> transformers.PreTrainedTokenizerFast:
    """Loads a Hugging Face tokenizer from a local directory (never from the Hub).

    A tokenizer without a pad token gets its eos token as pad. Raises ValueError when the
    directory is missing, holds no tokenizer files, or the tokenizer has neither pad nor eos.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(
            f"tokenizer directory {path!r} does not exist: pass a local directory holding "
            "tokenizer.json / tokenizer_config.json (download it first), or 'char' for the "
            "built-in character tokenizer."
        )
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise ValueError(
            f"tokenizer directory {path!r} has no tokenizer files (none of "
            f"{', '.join(_TOKENIZER_FILES)}): save one there with "
            "tokenizer.save_pretrained(path), or pass 'char'."
        )
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise ValueError(
            f"could not load a tokenizer from {path!r} ({reason}): check that its tokenizer "
            "files are complete (re-save with tokenizer.save_pretrained(path)), or pass 'char'."
        ) from e
    if not isinstance(tokenizer, transformers.PreTrainedTokenizerFast):
        raise ValueError(
            f"tokenizer in {path!r} is a slow {type(tokenizer).__name__}; jrl needs a fast "
            "tokenizer: add a tokenizer.json to the directory."
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer in {path!r} has neither a pad nor an eos token: set them in its "
                "tokenizer_config.json."
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def get_tokenizer(name_or_path: str) -> transformers.PreTrainedTokenizerFast:
    """`"char"` -> the built-in `char_tokenizer()`; a `.gguf` file -> the tokenizer in its
    metadata (`jrl.models.gguf.load_tokenizer`); a Hub id (`org/name`, not a local path) -> its
    download (`jrl.models.hub`); anything else -> `load_hf_tokenizer(path)`."""
    if name_or_path == "char":
        return char_tokenizer()
    from jrl.models import hub  # a Hub id `org/name`: its snapshot in the Hugging Face cache

    name_or_path = hub.local_path(os.fspath(name_or_path))
    if name_or_path.lower().endswith(".gguf"):
        from jrl.models import gguf  # the optional `gguf` package, only for .gguf files

        return gguf.load_tokenizer(name_or_path)
    return load_hf_tokenizer(name_or_path)


def stop_token_ids(tok, stop) -> tuple[int, ...]:
    """The token ids of `rollout.stop` (its ints; its strings are stop strings, matched on the
    text: `stop_strings`). Raises ValueError, one line, for an id outside the tokenizer."""
    ids = []
    for s in stop:
        if isinstance(s, str):
            continue
        if not isinstance(s, int) or isinstance(s, bool):
            raise ValueError(f"rollout.stop entry {s!r} is neither a token id nor a string.")
        if not 0 <= s < len(tok):
            raise ValueError(
                f"rollout.stop token id {s} is outside the tokenizer's {len(tok)} ids."
            )
        ids.append(s)
    return tuple(ids)


def stop_strings(tok, stop, vocab_size: int | None = None):
    """The `jrl.stop_strings.StopStrings` of `rollout.stop`'s strings for `tok` (None without
    strings): a rollout row stops at the token that completes one in its text, however the
    tokens spell it. Raises ValueError (StopStringError), one line, for a string or a tokenizer
    that cannot be matched."""
    from jrl.stop_strings import StopStrings

    strings = [s for s in stop if isinstance(s, str)]
    return StopStrings.build(tok, strings, vocab_size) if strings else None
