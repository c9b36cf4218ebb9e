"""The `guidance` decoding method: Guidance's Prefix-Tail citation enforcement (rl/methods/guidance/README.md,
`rl.methods.guidance.core`) on the `hf` engine's decode loop.

Each row's prompt holds its context with chunk markers `<C0>`, `<C1>`, …; its sentences make the row's fact pool.
At every statement boundary (the start of the answer, and where the response ends with `.`, a newline or
`</statement>`, maybe followed by spaces; each boundary once) the method peeks `lookahead` greedy tokens ahead (`state.lookahead`, nothing committed). When the
peek's normalised words start with a fact's prefix (the longest match, at least p words), the peek is discarded
and the verbatim fact goes in, `<statement>fact<cite>[j-j]</cite></statement>`, fed to the model in one
re-prefill; inserted tokens are marked as such (never trained on, logprob 0). No match: the model's own tokens
stand. A fact goes in at most once; at most `max_insertions` per answer.

`stats` after a call, per row: boundaries checked, lookahead forward tokens (= lookahead × boundaries), and the
audit log of insertions (step, matched words, fact, chunk id).
"""

from __future__ import annotations

from typing import Any

from rl.methods.guidance.core import BOUNDARIES, FactPool, cite_statement, normalize_words, strip_citations
from rl.registry import register, register_alias


@register("decoding", "guidance")
class CitationGuidance:
    """Guidance: `lookahead` tokens peeked at statement boundaries; facts are the prompt's context sentences
    (prefix p = min(`max_prefix`, ⌈n/3⌉) words; `sliding`: also every p-gram start inside long sentences);
    `max_insertions` per answer."""

    def __init__(self, lookahead: int = 12, max_insertions: int = 8, max_prefix: int = 8, sliding: bool = True):
        if lookahead < 1 or max_insertions < 0 or max_prefix < 1:
            raise ValueError(f"guidance: need lookahead >= 1, max_insertions >= 0, max_prefix >= 1 (got "
                             f"{lookahead}, {max_insertions}, {max_prefix})")
        self.lookahead, self.max_insertions = lookahead, max_insertions
        self.max_prefix, self.sliding = max_prefix, sliding
        self.stats: dict[str, Any] = {}

    def _setup(self, state: Any) -> dict[str, Any]:
        tok = state.tokenizer
        if tok is None:
            raise ValueError("guidance needs the tokenizer in the decode loop")
        rows = []
        for ids, mask in zip(state.prompt_ids, state.attention_mask[:, :state.prompt_ids.shape[1]]):
            prompt = tok.decode(ids[mask.bool()], skip_special_tokens=False)
            rows.append({"pool": FactPool.from_context(prompt, self.max_prefix, self.sliding), "used": set(),
                         "boundaries": 0, "lookahead_tokens": 0, "log": [], "checked_at": -1})
        state.scratch["guidance"] = rows
        self.stats = {"rows": rows}
        return {"rows": rows}

    def insert(self, state: Any) -> list[list[int]] | None:
        rows = state.scratch.get("guidance") or self._setup(state)["rows"]
        tok = state.tokenizer
        at_boundary = []
        for i, row in enumerate(rows):
            if bool(state.finished[i]) or len(row["used"]) >= self.max_insertions or not row["pool"].facts:
                continue
            # a boundary, maybe followed by spaces, not checked before: after an inserted statement the model's
            # first token is often a space, and the peek should start where its next sentence does
            text = tok.decode(state.responses[i], skip_special_tokens=True).rstrip(" ") if state.responses[i] else ""
            if state.step == 0 or (text.endswith(BOUNDARIES) and row["checked_at"] != len(text)):
                row["checked_at"] = len(text)
                at_boundary.append(i)
        if not at_boundary:
            return None
        ahead = state.lookahead(self.lookahead)
        out: list[list[int]] = [[] for _ in rows]
        for i in at_boundary:
            row = rows[i]
            row["boundaries"] += 1
            row["lookahead_tokens"] += self.lookahead
            peek = strip_citations(tok.decode(ahead[i], skip_special_tokens=True))
            match = row["pool"].longest_match(normalize_words(peek), exclude=row["used"])
            if match is None:
                continue
            fact, index, matched = match
            row["used"].add(index)
            row["log"].append({"step": state.step, "matched_words": matched, "fact": fact.text, "chunk": fact.chunk,
                               "peek": peek})
            out[i] = tok(cite_statement(fact.text, [fact.chunk]), add_special_tokens=False)["input_ids"]
        return out

register_alias("decoding", "citation_guidance", "guidance")
