"""Sandboxed tools for environments: Python code run in a separate, isolated interpreter.

`run_python(code)` runs `code` with `python -I` (no user site, no environment variables read) in a fresh
process group with limits: wall time (the group is killed at the deadline), CPU seconds and address space
(`setrlimit`), no network (a new network namespace where the kernel allows one, and in any case Python's
socket module refuses to connect), and output truncated to `max_output_chars`. A tool that hangs, crashes
or is killed returns a `ToolResult` with `ok=False` and the reason: it never hangs the rollout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

# Prepended to the user's code: Python-level network access fails even without a network namespace.
_NO_NETWORK = (
    "import socket as _s\n"
    "def _refuse(*a, **k):\n"
    "    raise OSError('network access is disabled in the looprl sandbox')\n"
    "_s.socket.connect = _refuse\n_s.socket.connect_ex = _refuse\n_s.create_connection = _refuse\n"
    "_s.getaddrinfo = _refuse\ndel _s, _refuse\n"
)
_CLONE_NEWNET = 0x40000000


@dataclass
class ToolResult:
    ok: bool  # ran to completion with exit code 0
    output: str  # stdout (and stderr when it failed), truncated
    error: str | None = None  # why it failed: timeout, killed by a signal, exit code, memory


def _limit(cpu_s: int, memory_mb: int):
    def apply() -> None:
        import resource
        os.setsid()  # its own process group, so the deadline kills everything it started
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        try:  # an empty network namespace (needs privileges; the socket guard covers the rest)
            import ctypes
            ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWNET)
        except OSError:
            pass
    return apply


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} characters cut]"


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000,
               stdin: str = "") -> ToolResult:
    """Run `code` in an isolated Python process under the limits above."""
    proc = subprocess.Popen([sys.executable, "-I", "-c", _NO_NETWORK + code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_limit(max(1, int(timeout_s) + 1), memory_mb), env={})
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return ToolResult(False, _truncate(out, max_output_chars), f"timed out after {timeout_s:g} s")
    if proc.returncode == 0:
        return ToolResult(True, _truncate(out, max_output_chars))
    if proc.returncode < 0:
        reason = f"killed by signal {signal.Signals(-proc.returncode).name}"
    elif "MemoryError" in err:
        reason = f"out of memory (limit {memory_mb} MiB)"
    else:
        reason = f"exit code {proc.returncode}"
    return ToolResult(False, _truncate(out + err, max_output_chars), reason)
