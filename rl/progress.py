"""The run's progress lines. A module of its own with no imports beyond the standard library: `cluster.ray_utils`,
which every Ray worker of a looprl job imports at start-up (its set-up hook), prints through it."""

from __future__ import annotations

import sys


def say(msg: str) -> None:
    """A progress line of the run on stderr."""
    print(f"[looprl] {msg}", file=sys.stderr, flush=True)
