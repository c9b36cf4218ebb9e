"""Long-form factuality reward (Chen et al., "Learning to Reason for Factuality"; rl/methods/factuality/README.md).

    R = −1                                   invalid format: no `<think>…</think>`, empty answer, or truncated
    R = Pre + λ · log(1 + F) + μ · J         otherwise, Pre = F / T (0 when T = 0)

F is the number of supported claims and T the number of claims extracted from the answer (the text
after `</think>`); J = 1 when the answer is at least as relevant as the reference answer. Precision
alone is hackable (fewer, safer claims); λ rewards detail with diminishing returns; μ keeps answers on
topic. [RECONSTRUCTION] The combination is reconstructed from the paper's description; the released
configuration uses λ = 0, μ = 0.1.

Stages, each chosen by name (`judge` stages call the judge engine named by `judge`, `reward.judges`):
- claims: `sentences`, a rule-based splitter (one claim per sentence of at least `min_claim_words`
  content words), for tests and cheap runs; or `judge`, one claim per line of the judge's answer;
- retrieval: BM25 (`rank_bm25`) over a local evidence corpus (no web search is reachable), `top_k` passages;
- verification: `lexical`, a claim is supported when one retrieved passage holds at least
  `support_overlap` of its content words; or `judge`, the judge answers yes/no given the passages;
- relevance: `overlap`, J = 1 when the answer shares at least `relevance_overlap` of the reference
  answer's content words; or `judge`, which compares the answer with the reference (the reference comes
  as `ground_truth`; without one J is 0).
Verdicts are cached in the reward service's process under everything that decides them (corpus, verifier,
`top_k`, `support_overlap` or the judge's identity: model and sampling), so a claim repeated across a group
or across steps is checked once, and two reward configurations in one process never share verdicts. The
cache is bounded (`cache_size` verdicts, least recently used evicted). With a greedy judge every stage is
deterministic.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Any

from rl.registry import register
from rl.reward import uses_judges

THINK_END = "</think>"
CLAIMS_PROMPT = ("Break the answer below into short, self-contained factual claims, one per line, nothing else."
                 "\n\nAnswer:\n{answer}\n\nClaims:\n")
VERIFY_PROMPT = ("Evidence:\n{evidence}\n\nClaim: {claim}\nIs the claim supported by the evidence? "
                 "Answer yes or no.\nAnswer:")
RELEVANCE_PROMPT = ("Question:\n{question}\n\nReference answer:\n{reference}\n\nCandidate answer:\n{answer}\n\n"
                    "Is the candidate answer at least as relevant and helpful as the reference answer? "
                    "Answer yes or no.\nAnswer:")
_WORD = re.compile(r"[A-Za-z0-9]+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
STOPWORDS = frozenset(
    "a an the of in on at to for from by with and or but is are was were be been being it its this that these "
    "those as which who whom whose what when where why how not no do does did has have had can could will would "
    "shall should may might must than then there their they them he she his her we our you your i me my".split())


THINK_START = "<think>"


def answer_part(response: str, *, truncated: bool = False, prompt: str = "") -> str | None:
    """The answer after the last `</think>`, or None when the format is invalid: truncated, no `</think>`, no
    `<think>` opening the reasoning (in the response, or at the end of the prompt when the chat template opens
    it, as Qwen3's and DeepSeek-R1's do), or an empty answer."""
    if truncated or THINK_END not in response:
        return None
    reasoning, answer = response.rsplit(THINK_END, 1)
    if THINK_START not in reasoning and not prompt.rstrip().endswith(THINK_START):
        return None
    answer = answer.strip()
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
    """BM25 (Okapi, `rank_bm25`) over local passages: a `.jsonl` file with a `text` field per line, or a
    plain text file with one passage per non-empty line. Passages and claims are tokenised alike
    (lower-cased words without stopwords). `rank_bm25` rather than `bm25s`: bm25s imports numba, whose
    llvmlite objects break vLLM's kernel registration in any process that later starts a vLLM engine."""

    def __init__(self, path: str):
        from rank_bm25 import BM25Okapi
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"factuality corpus {path!r} does not exist")
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
        self.passages = [json.loads(ln)["text"] for ln in lines] if p.suffix == ".jsonl" else lines
        tokens = [_tokens(t) for t in self.passages]
        if not any(tokens):
            raise ValueError(f"factuality corpus {path!r} has no passages with indexable words")
        self.bm25 = BM25Okapi(tokens)

    def retrieve(self, claims: list[str], k: int) -> list[list[str]]:
        out = []
        for claim in claims:
            scores = self.bm25.get_scores(_tokens(claim))
            top = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]
            out.append([self.passages[i] for i in top])
        return out


def _tokens(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text) if w.lower() not in STOPWORDS]


@lru_cache(maxsize=8)
def load_corpus(path: str) -> EvidenceCorpus:
    """One index per corpus file and worker process."""
    return EvidenceCorpus(path)


def lexical_support(claim: str, passages: list[str], overlap: float) -> bool:
    words = content_words(claim)
    return bool(words) and any(len(words & content_words(p)) >= overlap * len(words) for p in passages)


# (corpus, verifier settings, claim) -> supported, per process; least recently used first
_VERDICTS: OrderedDict[tuple[str, str, str], bool] = OrderedDict()
_YES = re.compile(r"^[\W_]*yes\b", re.IGNORECASE)
_PREAMBLE = re.compile(r"^(here (are|is)\b|(sure|certainly|okay|ok)\b\W|(the )?(following|claims?) (are|is)\b)",
                       re.IGNORECASE)
_LIST_MARK = re.compile(r"^\s*(?:[-*•]+|\(?\d+[.)]|\(?[a-z][.)](?=\s))\s*")


def says_yes(text: str) -> bool:
    """A judge's yes: the first word after any markdown or punctuation (`**Yes**`, `"yes."`, `- Yes, ...`)."""
    return bool(_YES.match(text.strip()))


def parse_claim_lines(text: str) -> list[str]:
    """One claim per line of a judge's answer, without list marks (`-`, `*`, `1.`, `(a)`), markdown emphasis,
    and without preamble lines ("Here are the claims:", any line ending in a colon) or lines with no content
    words."""
    claims = []
    for line in text.splitlines():
        line = _LIST_MARK.sub("", line.strip()).strip(" *_`\t")
        if not content_words(line) or line.endswith(":") or _PREAMBLE.match(line):
            continue
        claims.append(line)
    return claims


def verify_claims(claims: list[str], corpus_path: str, *, top_k: int = 3, support_overlap: float = 0.8,
                  judge: Any = None, cache_size: int = 100_000) -> tuple[list[bool], int]:
    """Verdict per claim (lexical, or by `judge` when given), and how many claims were actually checked
    (the rest came from the cache, keyed by everything that decides a verdict)."""
    if judge is not None:
        kind = f"judge|{getattr(judge, 'identity', None) or id(judge)}|top_k={top_k}|{VERIFY_PROMPT}"
    else:
        kind = f"lexical|top_k={top_k}|overlap={support_overlap}"
    todo = sorted({c for c in claims if (corpus_path, kind, c) not in _VERDICTS})
    if todo:
        evidence = load_corpus(corpus_path).retrieve(todo, top_k)
        if judge is None:
            verdicts = [lexical_support(c, ps, support_overlap) for c, ps in zip(todo, evidence)]
        else:
            answers = judge.generate([VERIFY_PROMPT.format(evidence="\n".join(ps), claim=c)
                                      for c, ps in zip(todo, evidence)])
            verdicts = [says_yes(a) for a in answers]
        for claim, verdict in zip(todo, verdicts):
            _VERDICTS[(corpus_path, kind, claim)] = verdict
    out = []
    for c in claims:
        _VERDICTS.move_to_end((corpus_path, kind, c))
        out.append(_VERDICTS[(corpus_path, kind, c)])
    while len(_VERDICTS) > max(cache_size, len(set(claims))):
        _VERDICTS.popitem(last=False)
    return out, len(todo)


def overlap_relevance(answer: str, reference: Any, threshold: float) -> float:
    ref = content_words(str(reference)) if reference else set()
    if not ref:
        return 0.0
    return float(len(ref & content_words(answer)) >= threshold * len(ref))


@register("reward", "factuality")
@uses_judges
def factuality_reward(prompts: list[str], responses: list[str], *, ground_truth: list[Any] | None = None,
                      truncated: list[bool] | None = None, judges: dict[str, Any] | None = None, corpus: str,
                      lam: float = 0.0, mu: float = 0.1, claims: str = "sentences", verifier: str = "lexical",
                      relevance: str = "overlap", judge: str = "judge", top_k: int = 3, support_overlap: float = 0.8,
                      relevance_overlap: float = 0.5, min_claim_words: int = 3, cache_size: int = 100_000,
                      **_: Any) -> list[dict[str, float]]:
    """Batched factuality reward with its components (`precision`, `supported`, `claims`, `relevance`,
    `format_ok`) logged per sample."""
    stages = {"claims": (claims, ("sentences", "judge")), "verifier": (verifier, ("lexical", "judge")),
              "relevance": (relevance, ("overlap", "judge"))}
    for key, (value, allowed) in stages.items():
        if value not in allowed:
            raise ValueError(f"factuality: {key}={value!r}; choose one of {allowed}")
    llm = None
    if "judge" in (claims, verifier, relevance):
        if not judges or judge not in judges:
            raise ValueError(f"factuality: a judge stage needs reward.judges.{judge} (have {sorted(judges or {})})")
        llm = judges[judge]
    n = len(responses)
    truncated = truncated or [False] * n
    ground_truth = ground_truth or [None] * n
    answers = [answer_part(r, truncated=bool(t), prompt=p) for p, r, t in zip(prompts, responses, truncated)]
    valid = [i for i, a in enumerate(answers) if a is not None]
    per_answer: list[list[str]] = [[] for _ in range(n)]
    if claims == "judge":
        listed = llm.generate([CLAIMS_PROMPT.format(answer=answers[i]) for i in valid])
        for i, text in zip(valid, listed):
            per_answer[i] = parse_claim_lines(text)
    else:
        for i in valid:
            per_answer[i] = sentence_claims(answers[i], min_claim_words)
    verdicts, _ = verify_claims([c for cs in per_answer for c in cs], corpus, top_k=top_k,
                                support_overlap=support_overlap, judge=llm if verifier == "judge" else None,
                                cache_size=cache_size)
    rel = {i: overlap_relevance(answers[i], ground_truth[i], relevance_overlap) for i in valid}
    if relevance == "judge":
        with_ref = [i for i in valid if ground_truth[i]]
        said = llm.generate([RELEVANCE_PROMPT.format(question=prompts[i], reference=ground_truth[i],
                                                     answer=answers[i]) for i in with_ref])
        rel = {i: 0.0 for i in valid} | {i: float(says_yes(a)) for i, a in zip(with_ref, said)}
    out, pos = [], 0
    for i in range(n):
        cs = per_answer[i]
        if answers[i] is None:
            out.append({"score": -1.0, "format_ok": 0.0})
            continue
        supported = sum(verdicts[pos:pos + len(cs)])
        pos += len(cs)
        out.append({"score": factuality_score(supported, len(cs), rel[i], lam, mu), "format_ok": 1.0,
                    "precision": supported / len(cs) if cs else 0.0, "supported": float(supported),
                    "claims": float(len(cs)), "relevance": rel[i]})
    return out
