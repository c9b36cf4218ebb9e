"""Scoring with reward functions, Ray-free: the spec of a configured function and the worker-process entry
that scores a chunk of samples under a per-sample timeout. Used by the reward service actor
(`rewards.service`) and by the reward server (`rewards.remote`).

Why a timer signal: math-verify (and many graders) use `signal.alarm`, which fails off the main thread,
so scoring runs in the main thread of worker processes, where an interval timer bounds every sample.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import traceback
from dataclasses import dataclass, field
from typing import Any

from rl.reward import is_batched


@dataclass
class RewardSpec:
    name: str  # registry spec of the function
    weight: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)
    label: str | None = None  # name of its results and logged components (default: `name`)
    eval_only: bool = False  # scored on held-out evaluation only, never summed into the score

    @property
    def key(self) -> str:
        return self.label or self.name


class _SampleTimeout(Exception):
    pass


def _on_alarm(signum, frame):  # noqa: ARG001
    raise _SampleTimeout()


_FN_CACHE: dict[str, Any] = {}


def _resolve(spec: str) -> Any:
    if spec not in _FN_CACHE:
        from rl.registry import lookup
        _FN_CACHE[spec] = lookup("reward", spec)
    return _FN_CACHE[spec]


def _call(fn, args, kwargs):
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    return out


async def _await(aw):
    return await aw


def _with_timeout(timeout_s: float, fn, *args, **kwargs):
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def load_rewards(names: list[str]) -> int:
    """Import the reward functions `names` in a worker process ahead of the first chunk (a warm-up)."""
    from rl.registry import lookup
    for name in names:
        lookup("reward", name)
    return len(names)


def score_chunk(spec: str, params: dict, items: list[dict], timeout_s: float) -> list[tuple[Any, str | None]]:
    """Worker-process entry: score `items` with reward `spec`. Returns (raw value, error) per item."""
    try:
        fn = _resolve(spec)
    except Exception as exc:
        return [(None, f"reward {spec!r} could not be loaded: {exc}")] * len(items)
    results: list[tuple[Any, str | None]] = []
    if is_batched(fn):
        cols = {k: [it.get(k) for it in items] for k in items[0]}
        try:
            out = _with_timeout(timeout_s * len(items), _call, fn,
                                (cols.pop("prompt"), cols.pop("response")), {**cols, **params})
            if not isinstance(out, (list, tuple)) or len(out) != len(items):
                err = f"batched reward {spec!r} returned {type(out).__name__} of length " \
                      f"{len(out) if hasattr(out, '__len__') else '?'}, expected a list of {len(items)}"
                return [(None, err)] * len(items)
            return [(v, None) for v in out]
        except _SampleTimeout:
            return [(None, f"reward {spec!r} timed out after {timeout_s * len(items):.1f}s (batch)")] * len(items)
        except Exception as exc:
            return [(None, f"reward {spec!r} raised {type(exc).__name__}: {exc}")] * len(items)
    for it in items:
        kwargs = {k: v for k, v in it.items() if k not in ("prompt", "response")}
        try:
            results.append((_with_timeout(timeout_s, _call, fn, (it["prompt"], it["response"]),
                                          {**kwargs, **params}), None))
        except _SampleTimeout:
            results.append((None, f"reward {spec!r} timed out after {timeout_s:.1f}s"))
        except Exception as exc:
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            results.append((None, f"reward {spec!r} raised {tb}"))
    return results
