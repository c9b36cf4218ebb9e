"""Answers as mathematical values: reading a stated answer (the last `\\boxed{}`, else the last number written) and
comparing two answers by equivalence under math-verify (fractions, decimals, LaTeX, expressions), not as strings.

Timeouts are off (`parsing_timeout=None`, `timeout_seconds=None`): math-verify's own timeouts use `signal.alarm`,
which works only in a main thread; the callers bound their time themselves (the reward service's per-sample
timeout, the environment's turn budget)."""

from __future__ import annotations

import logging
import re
from functools import lru_cache
from typing import Any

logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" notices

# a number as written: an integer, a decimal, a fraction a/b, or LaTeX's \frac{a}{b} (optional sign)
NUMBER = re.compile(r"-?\\frac\{[^{}]+\}\{[^{}]+\}|-?\d+(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?")


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` in `text` (nested braces matched), or None when there is none or it is unclosed."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[start:j + 1]
    return None


def numbers_in(text: str) -> list[str]:
    """The numbers `text` writes, in order (integers, decimals, fractions, `\\frac`)."""
    return [m.group(0).replace(" ", "") for m in NUMBER.finditer(text)]


def stated_answer(text: str) -> str | None:
    """The answer a text states: the content of its last `\\boxed{}`, else the last number it writes."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed[boxed.index("{") + 1:-1].strip()
    found = numbers_in(text)
    return found[-1] if found else None


@lru_cache(maxsize=4096)
def parse_value(answer: str) -> tuple[Any, ...]:
    """math-verify's reading of `answer` as a value (LaTeX or a plain expression); empty when it reads none."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
    answer = answer.strip()
    if not answer or len(answer) > 200:
        return ()
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    parsed = parse(f"${answer}$", extraction_config=configs, parsing_timeout=None)
    return tuple(parsed or parse(answer, extraction_config=configs, parsing_timeout=None) or ())


def equivalent(a: str | None, b: str | None) -> bool:
    """Whether two answers are the same value under math-verify (`1/2`, `0.5` and `\\frac{1}{2}` are); equal
    strings always are."""
    from math_verify import verify
    if a is None or b is None:
        return False
    if a.strip() == b.strip():
        return True
    pa, pb = parse_value(a), parse_value(b)
    return bool(pa) and bool(pb) and bool(verify(list(pa), list(pb), timeout_seconds=None))
