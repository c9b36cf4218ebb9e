"""Guidance (rl/methods/guidance/README.md): sentence-level citation enforcement by Prefix-Tail matching during
decoding, and the LongBench-Cite scoring it is measured with. Pure Python: the `guidance` decoding method
(`rl.methods.guidance.decoding`), the `guidance` stage and the benchmark share these.

Confirmed (the paper's abstract): a pool of Prefix-Tail facts from the documents; a lookahead predicts what the
model is about to write; when it matches a fact's prefix the output is replaced by the verified fact with its
citation. [RECONSTRUCTION] of the specifics, each a parameter: facts are the context's sentences with their chunk
ids; the prefix is the first p = min(8, ⌈n/3⌉) normalised words (lowercase, punctuation stripped) of an n-word
sentence, and every sliding p-gram start inside sentences longer than 2p is indexed too; lookahead of 12 tokens at
statement boundaries; the longest trie match is accepted at ≥ p words; the fact goes in verbatim as
`<statement>fact<cite>[j-j]</cite></statement>`; a fact is inserted at most once, at most `max_insertions` per answer.

LongBench-Cite (confirmed from THUDM/LongCite's `auto_scorer.py`): statements `<statement>S<cite>[a-b]…</cite>
</statement>`, chunk markers `<C{i}>` in the context; per statement, recall = the judge's support of the cited
chunks' text (1 / 0.5 / 0), or 1 − need-for-citation when nothing is cited; precision = per citation, whether
the judge finds it relevant; F1 = 2RP / (R + P) per response; at most 40 statements scored.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

CHUNK = re.compile(r"<C(\d+)>")
STATEMENT = re.compile(r"<statement>(.*?)</statement>", re.S)
CITE = re.compile(r"<cite>(.*?)</cite>", re.S)
RANGE = re.compile(r"\[(\d+)-(\d+)\]")
BOUNDARIES = (".", "\n", "</statement>")


def normalize_words(text: str) -> list[str]:
    """Lowercased words with punctuation removed (digits kept): the trie's alphabet."""
    return [w for w in re.sub(r"[^\w\s]", " ", text.lower()).split() if w]


def chunks_of(context: str) -> dict[int, str]:
    """The context's chunks by id: the text after each `<C{i}>` marker up to the next one."""
    parts = CHUNK.split(context)
    return {int(parts[i]): parts[i + 1].strip() for i in range(1, len(parts) - 1, 2)}


def split_sentences(text: str) -> list[str]:
    """Sentences of a chunk: split after `.`, `!` or `?` followed by whitespace (the chunks are sentences in the
    LongBench-Cite segmentation already; this splits the longer ones)."""
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


@dataclass
class Fact:
    text: str  # the verbatim sentence
    chunk: int  # its chunk id
    prefix_len: int  # p: words a match must cover


@dataclass
class _Node:
    children: dict[str, _Node] = field(default_factory=dict)
    facts: list[tuple[int, int]] = field(default_factory=list)  # (fact index, words of the fact before this path)


class FactPool:
    """The Prefix-Tail pool: each fact's first p normalised words (and, for sentences longer than 2p words, every
    later p-gram start) indexed in a word trie."""

    def __init__(self, facts: Sequence[Fact], max_prefix: int = 8, sliding: bool = True):
        self.facts = list(facts)
        self.root = _Node()
        for index, fact in enumerate(self.facts):
            words = normalize_words(fact.text)
            p = fact.prefix_len
            starts = [0] + (list(range(1, len(words) - p + 1)) if sliding and len(words) > 2 * p else [])
            for start in starts:
                node = self.root
                for w in words[start:]:
                    node = node.children.setdefault(w, _Node())
                    node.facts.append((index, start))

    @classmethod
    def from_context(cls, context: str, max_prefix: int = 8, sliding: bool = True) -> FactPool:
        facts = []
        for chunk, text in chunks_of(context).items():
            for sentence in split_sentences(text):
                n = len(normalize_words(sentence))
                if n:
                    facts.append(Fact(sentence, chunk, min(max_prefix, math.ceil(n / 3))))
        return cls(facts, max_prefix, sliding)

    def longest_match(self, words: Sequence[str], exclude: set[int] = frozenset()) -> tuple[Fact, int, int] | None:
        """The fact whose indexed word path matches the longest prefix of `words` (at least its p words, facts in
        `exclude` skipped; ties: the fact indexed first): `(fact, fact index, matched words)`, or None."""
        node, best = self.root, None
        for depth, w in enumerate(words, 1):
            node = node.children.get(w)
            if node is None:
                break
            for index, _start in node.facts:
                if index not in exclude and depth >= self.facts[index].prefix_len:
                    best = (self.facts[index], index, depth)
                    break
        return best


def cite_statement(text: str, chunks: Sequence[int]) -> str:
    """`<statement>text<cite>[a-b]…</cite></statement>`, consecutive chunk ids merged into one range."""
    ids = sorted(set(chunks))
    ranges: list[list[int]] = []
    for j in ids:
        if ranges and j == ranges[-1][1] + 1:
            ranges[-1][1] = j
        else:
            ranges.append([j, j])
    return f"<statement>{text}<cite>{''.join(f'[{a}-{b}]' for a, b in ranges)}</cite></statement>"


def parse_statements(answer: str, max_statements: int = 40) -> list[dict[str, Any]]:
    """LongBench-Cite's parse: each `<statement>` with its text (citations removed) and cited chunk ids; text
    outside statements counts as uncited statements, sentence by sentence."""
    out: list[dict[str, Any]] = []
    pos = 0
    for m in STATEMENT.finditer(answer):
        for loose in split_sentences(answer[pos:m.start()]):
            if normalize_words(loose):
                out.append({"text": loose, "cites": []})
        body = m.group(1)
        cites = []
        for c in CITE.findall(body):
            for a, b in RANGE.findall(c):
                cites.extend(range(int(a), int(b) + 1))
        out.append({"text": CITE.sub("", body).strip(), "cites": cites})
        pos = m.end()
    for loose in split_sentences(answer[pos:]):
        if normalize_words(loose):
            out.append({"text": loose, "cites": []})
    return out[:max_statements]


class CitationJudge(Protocol):
    """What LongBench-Cite asks GPT-4o: support of a statement by cited text (1, 0.5, 0), relevance of one cited
    chunk (1, 0), whether a statement needs a citation (1, 0)."""

    def support(self, statement: str, evidence: str) -> float: ...

    def relevant(self, statement: str, evidence: str) -> float: ...

    def needs_citation(self, statement: str) -> float: ...


class ContainmentJudge:
    """The deterministic judge of the CPU tests and the synthetic benchmark (labelled as such): support 1 when the
    statement's normalised words appear contiguously in the evidence, 0.5 when at least `partial` of them are in
    it and so is every number it states, else 0; a cited chunk is relevant when it shares at least `partial` of the statement's words; a statement
    needs a citation when it holds a number (a factual claim in the synthetic task)."""

    def __init__(self, partial: float = 0.5):
        self.partial = partial

    def support(self, statement: str, evidence: str) -> float:
        s, e = normalize_words(statement), normalize_words(evidence)
        if not s:
            return 0.0
        if " ".join(s) in " ".join(e):
            return 1.0
        numbers_hold = all(w in e for w in s if w.isdigit())
        return 0.5 if numbers_hold and sum(w in set(e) for w in s) / len(s) >= self.partial else 0.0

    def relevant(self, statement: str, evidence: str) -> float:
        s, e = normalize_words(statement), set(normalize_words(evidence))
        return float(bool(s) and sum(w in e for w in s) / len(s) >= self.partial)

    def needs_citation(self, statement: str) -> float:
        return float(any(w.isdigit() for w in normalize_words(statement)))


def score_citations(answer: str, context: str, judge: CitationJudge, max_statements: int = 40) -> dict[str, float]:
    """LongBench-Cite's citation recall, precision and F1 of one answer."""
    chunks = chunks_of(context)
    statements = parse_statements(answer, max_statements)
    if not statements:
        return {"recall": 0.0, "precision": 0.0, "f1": 0.0, "statements": 0, "citations": 0}
    recalls, precisions = [], []
    for st in statements:
        cited = [j for j in st["cites"] if j in chunks]
        if cited:
            recalls.append(judge.support(st["text"], " ".join(chunks[j] for j in cited)))
            precisions.extend(judge.relevant(st["text"], chunks[j]) for j in cited)
        else:
            recalls.append(1.0 - judge.needs_citation(st["text"]))
        precisions.extend(0.0 for j in st["cites"] if j not in chunks)  # a citation of no chunk is irrelevant
    recall = sum(recalls) / len(recalls)
    precision = sum(precisions) / len(precisions) if precisions else 0.0
    f1 = 2 * recall * precision / (recall + precision) if recall + precision > 0 else 0.0
    return {"recall": recall, "precision": precision, "f1": f1, "statements": len(statements),
            "citations": len(precisions)}


LONGBENCH_CITE_EXCLUDED = ("multifieldqa_en", "multifieldqa_zh")  # left out of LongBench-Cite's headline average


def dataset_means(scores: Sequence[dict[str, float]], datasets: Sequence[str],
                  exclude: Sequence[str] = LONGBENCH_CITE_EXCLUDED) -> dict[str, Any]:
    """LongBench-Cite's averaging: recall, precision and F1 are averaged over the answers of each dataset, and the
    headline is the mean over the datasets not in `exclude` (each dataset weighs the same, whatever its size)."""
    keys = ("recall", "precision", "f1")
    per: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(datasets):
        rows = [s for s, d in zip(scores, datasets) if d == name]
        per[name] = {k: sum(s[k] for s in rows) / len(rows) for k in keys} | {"answers": len(rows)}
    kept = [d for d in per if d not in exclude]
    if not kept:
        raise ValueError(f"every dataset of the answers ({sorted(per)}) is excluded from the average ({list(exclude)})")
    return {**{k: sum(per[d][k] for d in kept) / len(kept) for k in keys}, "datasets": per,
            "excluded": sorted(d for d in per if d in exclude)}


def post_hoc_cite(answer: str, context: str) -> str:
    """The post-hoc baseline: each sentence of a plain answer cited with its best-overlapping chunk (most shared
    normalised words; uncited when it shares none)."""
    chunks = {j: set(normalize_words(t)) for j, t in chunks_of(context).items()}
    out = []
    for sentence in split_sentences(answer.replace("\n", " ")):
        words = set(normalize_words(sentence))
        if not words:
            continue
        j, overlap = max(((j, len(words & c)) for j, c in chunks.items()), key=lambda x: x[1], default=(None, 0))
        out.append(cite_statement(sentence, [j]) if overlap else sentence)
    return "".join(out)


def strip_citations(answer: str) -> str:
    """The answer's text without statement and citation markup (what correctness is judged on)."""
    return re.sub(r"</?statement>", " ", CITE.sub("", answer)).strip()




class LLMCitationJudge:
    """LongBench-Cite's judge questions put to a language model (`generate(prompts) -> texts`, e.g. a frozen judge
    engine of `reward.judges`; LongBench-Cite uses GPT-4o at temperature 0). The prompts follow the structure of
    LongCite's auto_scorer (a rating word in double brackets); their wording is looprl's."""

    SUPPORT = ("You check citations. Evidence:\n{evidence}\n\nStatement: {statement}\n\nIs the statement supported "
               "by the evidence? Answer with one of [[Fully supported]], [[Partially supported]], [[No support]].")
    RELEVANT = ("You check citations. Cited text:\n{evidence}\n\nStatement: {statement}\n\nIs the cited text "
                "relevant to the statement? Answer with [[Relevant]] or [[Unrelevant]].")
    NEEDS = ("Statement from an answer: {statement}\n\nDoes this statement make a factual claim that needs a "
             "citation? Answer with [[Yes]] or [[No]].")

    def __init__(self, generate: Any):
        self.generate = generate

    def _ask(self, prompt: str, scores: dict[str, float]) -> float:
        text = self.generate([prompt])[0].lower()
        for label, value in scores.items():  # the first label the answer names, in the order given
            if f"[[{label}]]" in text:
                return value
        return 0.0

    def support(self, statement: str, evidence: str) -> float:
        return self._ask(self.SUPPORT.format(evidence=evidence, statement=statement),
                         {"fully supported": 1.0, "partially supported": 0.5, "no support": 0.0})

    def relevant(self, statement: str, evidence: str) -> float:
        return self._ask(self.RELEVANT.format(evidence=evidence, statement=statement),
                         {"unrelevant": 0.0, "relevant": 1.0})

    def needs_citation(self, statement: str) -> float:
        return self._ask(self.NEEDS.format(statement=statement), {"yes": 1.0, "no": 0.0})
