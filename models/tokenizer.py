"""Loading the tokenizer saved with a model folder."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerFast


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer saved with a model folder, left-padded for generation."""
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError, KeyError):
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
