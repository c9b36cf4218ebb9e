"""Long-form factuality reward (Chen et al., "Learning to Reason for Factuality"; spec §4).

    R = −1                                   invalid format: no `</think>`, empty answer, or truncated
    R = Pre + λ · log(1 + F) + μ · J         otherwise, Pre = F / T (0 when T = 0)

F is the number of supported claims and T the number of claims extracted from the answer (the text
after `</think>`); J = 1 when the answer is at least as relevant as the reference answer. Precision
alone is hackable (fewer, safer claims); λ rewards detail with diminishing returns; μ keeps answers on
topic. [RECONSTRUCTION] The combination is reconstructed from the paper's description; the released
configuration uses λ = 0, μ = 0.1.

Stages, each swappable by name:
- claims: `sentences`, a rule-based splitter (one claim per sentence of at least `min_claim_words`
  words), for tests and cheap runs;
- retrieval: BM25 (`bm25s`) over a local evidence corpus (no web search is reachable), `top_k` passages;
- verification: `lexical`, a claim is supported when one retrieved passage holds at least
  `support_overlap` of its content words;
- relevance: `overlap`, J = 1 when the answer shares at least `relevance_overlap` of the reference
  answer's content words (the reference comes as `ground_truth`); without a reference J is 0.
Verdicts are cached per (corpus, claim) in each worker process, so a claim repeated across a group or
across steps is checked once. The rule-based stages are deterministic; LLM-judge stages plug in at the
same points.
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from rewards.base import batched
from rl.registry import register

THINK_END = "</think>"
_WORD = re.compile(r"[A-Za-z0-9]+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
STOPWORDS = frozenset(
    "a an the of in on at to for from by with and or but is are was were be been being it its this that these "
    "those as which who whom whose what when where why how not no do does did has have had can could will would "
    "shall should may might must than then there their they them he she his her we our you your i me my".split())


def answer_part(response: str, *, truncated: bool = False) -> str | None:
    """The answer after the last `</think>`, or None when the format is invalid."""
    if truncated or THINK_END not in response:
        return None
    answer = response.rsplit(THINK_END, 1)[1].strip()
    return answer or None


def factuality_score(supported: int, claims: int, relevant: float, lam: float, mu: float) -> float:
    """`Pre + λ·log(1+F) + μ·J` for a valid answer."""
    precision = supported / claims if claims else 0.0
    return precision + lam * math.log1p(supported) + mu * relevant


def content_words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text) if w.lower() not in STOPWORDS}


def sentence_claims(answer: str, min_claim_words: int = 3) -> list[str]:
    """Rule-based claim extraction: each sentence with at least `min_claim_words` content words."""
    sentences = (s.strip() for s in _SENTENCE_END.split(answer.replace("\n", " ")))
    return [s for s in sentences if len(content_words(s)) >= min_claim_words]


class EvidenceCorpus:
    """BM25 over local passages: a `.jsonl` file with a `text` field per line, or a plain text file with
    one passage per non-empty line."""

    def __init__(self, path: str):
        import bm25s
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"factuality corpus {path!r} does not exist")
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
        self.passages = [json.loads(ln)["text"] for ln in lines] if p.suffix == ".jsonl" else lines
        if not self.passages:
            raise ValueError(f"factuality corpus {path!r} has no passages")
        self.bm25 = bm25s.BM25()
        self.bm25.index(bm25s.tokenize(self.passages, stopwords="en", show_progress=False), show_progress=False)

    def retrieve(self, claims: list[str], k: int) -> list[list[str]]:
        import bm25s
        k = min(k, len(self.passages))
        docs, _ = self.bm25.retrieve(bm25s.tokenize(claims, stopwords="en", show_progress=False), k=k,
                                     show_progress=False)
        return [[self.passages[int(i)] for i in row] for row in docs]


@lru_cache(maxsize=8)
def load_corpus(path: str) -> EvidenceCorpus:
    """One index per corpus file and worker process."""
    return EvidenceCorpus(path)


def lexical_support(claim: str, passages: list[str], overlap: float) -> bool:
    words = content_words(claim)
    return bool(words) and any(len(words & content_words(p)) >= overlap * len(words) for p in passages)


_VERDICTS: dict[tuple[str, str], bool] = {}  # (corpus, claim) -> supported; per worker process


def verify_claims(claims: list[str], corpus_path: str, *, top_k: int = 3, support_overlap: float = 0.8
                  ) -> tuple[list[bool], int]:
    """Verdict per claim, and how many claims were actually checked (the rest came from the cache)."""
    todo = sorted({c for c in claims if (corpus_path, c) not in _VERDICTS})
    if todo:
        evidence = load_corpus(corpus_path).retrieve(todo, top_k)
        for claim, passages in zip(todo, evidence):
            _VERDICTS[(corpus_path, claim)] = lexical_support(claim, passages, support_overlap)
    return [_VERDICTS[(corpus_path, c)] for c in claims], len(todo)


def overlap_relevance(answer: str, reference: Any, threshold: float) -> float:
    ref = content_words(str(reference)) if reference else set()
    if not ref:
        return 0.0
    return float(len(ref & content_words(answer)) >= threshold * len(ref))


@register("reward", "factuality")
@batched
def factuality_reward(prompts: list[str], responses: list[str], *, ground_truth: list[Any] | None = None,
                      truncated: list[bool] | None = None, corpus: str, lam: float = 0.0, mu: float = 0.1,
                      claims: str = "sentences", verifier: str = "lexical", relevance: str = "overlap",
                      top_k: int = 3, support_overlap: float = 0.8, relevance_overlap: float = 0.5,
                      min_claim_words: int = 3, **_: Any) -> list[dict[str, float]]:
    """Batched factuality reward with its components (`precision`, `supported`, `claims`, `relevance`,
    `format_ok`) logged per sample."""
    if (claims, verifier, relevance) != ("sentences", "lexical", "overlap"):
        raise ValueError(f"factuality: unknown stage (claims={claims!r}, verifier={verifier!r}, "
                         f"relevance={relevance!r}); built in: sentences, lexical, overlap")
    n = len(responses)
    truncated = truncated or [False] * n
    ground_truth = ground_truth or [None] * n
    answers = [answer_part(r, truncated=bool(t)) for r, t in zip(responses, truncated)]
    per_answer = [sentence_claims(a, min_claim_words) if a is not None else [] for a in answers]
    verdicts, _ = verify_claims([c for cs in per_answer for c in cs], corpus, top_k=top_k,
                                      support_overlap=support_overlap)
    out, pos = [], 0
    for answer, cs, ref in zip(answers, per_answer, ground_truth):
        if answer is None:
            out.append({"score": -1.0, "format_ok": 0.0})
            continue
        supported = sum(verdicts[pos:pos + len(cs)])
        pos += len(cs)
        j = overlap_relevance(answer, ref, relevance_overlap)
        out.append({"score": factuality_score(supported, len(cs), j, lam, mu), "format_ok": 1.0,
                    "precision": supported / len(cs) if cs else 0.0, "supported": float(supported),
                    "claims": float(len(cs)), "relevance": j})
    return out
