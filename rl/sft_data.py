"""SFT data from a user's files: prompt/response rows or chat `messages` rows, tokenized into loss-masked examples.

Two row formats, both read from JSONL/JSON/Parquet/CSV or a `load_from_disk` folder (`rl.data.load_rows`):
  * prompt/response: `data.prompt_column` and `data.target_column`. The prompt is formatted as for RL
    (`data.prompt_prefix`, `data.chat_template`); the loss covers the response and EOS.
  * messages: `sft.messages_column`, a list of `{role, content}` per row, rendered with the tokenizer's chat
    template. The loss covers the assistant turns only: each assistant span is the text the template adds for
    that message after the generation prompt of the turns before it, located in the tokenized conversation by
    character offsets (so a merge across the boundary cannot shift it).

A bad row (a missing or unknown role, empty content, no assistant turn, too long after templating) stops the
stage with one error naming the file, the row and the reason, or, with `sft.bad_rows: drop`, is dropped and
counted by reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from rl.batch import Batch, batch_of_examples
from rl.config import ConfigError
from rl.data import format_prompt, load_rows, open_dataset

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class SFTExample:
    """One tokenized training sequence: `prompt_ids` carry no loss; `loss_mask[i]` says whether
    `response_ids[i]` is trained (an assistant token) or only read (a later user or tool turn)."""
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    row: int = -1  # its row in the source file (bad rows dropped before it do not shift it)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


class BadRow(ValueError):
    """A row that cannot be trained on; `reason` is its short category (the drop counter's key)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def prompt_response_example(tokenizer: Any, prompt: str, response: str) -> SFTExample:
    """The prompt's tokens, then the response's and EOS, all trained."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(str(response), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return SFTExample(prompt_ids, response_ids, [1] * len(response_ids))


def check_messages(messages: Any) -> list[dict[str, str]]:
    """The conversation as a list of `{role, content}` dicts, or `BadRow` saying what is wrong with it."""
    if not isinstance(messages, list) or not messages:
        raise BadRow("not_a_conversation", f"must be a non-empty list of {{role, content}} messages, got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not m.get("role"):
            raise BadRow("missing_role", f"message {i} has no role")
        if m["role"] not in ROLES:
            raise BadRow("unknown_role", f"message {i} has role {m['role']!r}; roles are {list(ROLES)}")
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            raise BadRow("empty_content", f"message {i} ({m['role']}) has empty content")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow("no_assistant_turn", "has no assistant message to train on")
    return out


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of every assistant turn in it (what the template adds
    for that message after the generation prompt, e.g. the content and the end-of-turn token)."""
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = _render(tokenizer, messages[:i], True)
        end_text = _render(tokenizer, messages[:i + 1], False)
        if not (end_text.startswith(start_text) and full.startswith(end_text)):
            raise BadRow("template_not_prefix_stable",
                         f"the chat template renders turn {i} differently once later turns follow (it rewrites "
                         f"earlier turns), so its assistant tokens cannot be located; use prompt/response rows")
        spans.append((len(start_text), len(end_text)))
    return full, spans


def chat_example(tokenizer: Any, messages: list[dict[str, str]]) -> SFTExample:
    """The conversation's tokens: everything before the first assistant token is the prompt; the loss covers
    the assistant spans; tokens after the last assistant span are left out (they carry no loss)."""
    full, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
    if not any(mask):
        raise BadRow("no_assistant_token", "its assistant turns render to no token")
    # the first token has nothing before it to predict it from: it is always read, never trained
    first, last = max(1, mask.index(1)), len(mask) - mask[::-1].index(1)
    if first >= last:
        raise BadRow("no_assistant_token", "its assistant turns render to no trainable token")
    return SFTExample(ids[:first], ids[first:last], mask[first:last])


def tokenize_sft_rows(tokenizer: Any, rows: list[dict], *, source: str, messages_column: str | None,
                      prompt_column: str, target_column: str, prompt_prefix: str = "", chat_template: bool = False,
                      max_length: int = 0, bad_rows: str = "error") -> tuple[list[SFTExample], dict[str, int]]:
    """Examples of `rows` (the messages format when `messages_column` is set) and the count of dropped rows by
    reason. `bad_rows: error` raises one `ConfigError` naming `source`, the row and the reason at the first bad
    row; `drop` skips it. `max_length > 0` bounds the tokens of an example."""
    examples, dropped = [], Counter()
    for i, row in enumerate(rows):
        try:
            if messages_column is not None:
                ex = chat_example(tokenizer, check_messages(row[messages_column]))
            else:
                if not str(row[prompt_column]).strip() or not str(row[target_column]).strip():
                    raise BadRow("empty_content", f"has an empty {prompt_column!r} or {target_column!r}")
                ex = prompt_response_example(tokenizer, format_prompt(row[prompt_column], tokenizer, prompt_prefix,
                                                                      chat_template), row[target_column])
            if max_length and len(ex) > max_length:
                raise BadRow("too_long", f"is {len(ex)} tokens after templating, over sft.max_length {max_length}")
        except BadRow as bad:
            if bad_rows != "drop":
                raise ConfigError(f"{source} row {i + 1}: {bad} (sft.bad_rows: drop skips such rows)") from None
            dropped[bad.reason] += 1
            continue
        ex.row = i
        examples.append(ex)
    if not examples:
        raise ConfigError(f"{source}: no usable row ({dict(dropped)} dropped)")
    return examples, dict(dropped)


def load_sft_rows(path: str, key: str, sft: Any, data: Any, dropped: Counter | None = None
                  ) -> tuple[list[dict], str | None]:
    """The rows of an SFT file and the messages column when they are chat rows (`sft.format`; auto: chat rows
    when the file has `sft.messages_column`), else None (prompt/response rows: `data.prompt_column`,
    `data.target_column`). Unreadable rows raise, or are counted in `dropped` under `sft.bad_rows: drop`."""
    ds = open_dataset(path, key, sft.bad_rows, dropped)
    chat = sft.format == "messages" or (sft.format == "auto" and sft.messages_column in ds.column_names)
    columns = [sft.messages_column] if chat else [data.prompt_column, data.target_column]
    rows = load_rows(path, columns, key, dataset=ds, bad_rows=sft.bad_rows, dropped=dropped)
    return rows, sft.messages_column if chat else None


def sft_rows_and_examples(tokenizer: Any, path: str, key: str, sft: Any, data: Any
                          ) -> tuple[list[dict], list[SFTExample], dict[str, int]]:
    """The rows of an SFT file (`load_sft_rows`), read once, and their examples and dropped-row counts
    (`tokenize_sft_rows`) under the recipe's `sft` and `data` settings; `SFTExample.row` indexes `rows`."""
    unreadable: Counter = Counter()
    rows, messages_column = load_sft_rows(path, key, sft, data, unreadable)
    examples, dropped = tokenize_sft_rows(tokenizer, rows, source=f"{key} {path!r}", messages_column=messages_column,
                                          prompt_column=data.prompt_column, target_column=data.target_column,
                                          prompt_prefix=data.prompt_prefix, chat_template=data.chat_template,
                                          max_length=sft.max_length, bad_rows=sft.bad_rows)
    return rows, examples, {**unreadable, **dropped}


def sft_examples(tokenizer: Any, path: str, key: str, sft: Any, data: Any) -> tuple[list[SFTExample], dict[str, int]]:
    """`sft_rows_and_examples` without the rows."""
    _, examples, dropped = sft_rows_and_examples(tokenizer, path, key, sft, data)
    return examples, dropped


def make_sft_batch(tokenizer: Any, prompts: list[str], targets: list[str]) -> Batch:
    """Prompt (left-padded) + target + EOS (right-padded); the loss covers target and EOS."""
    return batch_of_examples([prompt_response_example(tokenizer, p, t) for p, t in zip(prompts, targets)],
                             tokenizer.pad_token_id)
