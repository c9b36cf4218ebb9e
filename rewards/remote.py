"""Remote rewards: serve any reward plugin over HTTP, and call such a server from a recipe.

    looprl serve-reward path/to/plugin.py:fn --port 8400 [--host 0.0.0.0] [--params '{"k": 1}']

The server (aiohttp) answers `GET /health` and `POST /score` with `{"items": [{prompt, response,
ground_truth, metadata, truncated}, ...]}`; it scores a request in worker processes with the same
per-sample timeout and error capture as the local reward service, and returns one
`{"value": ..., "error": ...}` per item. A malformed request gets 400 with the reason. A plugin call that kills its
scoring process does not kill the server: the pool is replaced and the batch scored again (a batch that kills it
twice comes back as failed samples), and `/health` answers 503 when the pool cannot score. With
`LOOPRL_REWARD_TOKEN` set, the server requires `Authorization: Bearer <token>` and the client sends it; serving
beyond loopback without one prints a warning.

A recipe names a server by its URL, as a reward function (`{name: "http://host:8400", weight: 1.0,
params: {batch_size: 64, timeout_s: 60, retries: 2}}`; `remote: URL` is the same). The client sends
batches, retries a failed request with backoff, and when the server stays unreachable records the
samples as failed (they leave the loss) so the run goes on; a restarted server is picked up by the
next request.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from rl.registry import register_resolver
from rl.reward import RewardFailure, batched

SCORE_PATH, HEALTH_PATH = "/score", "/health"


# --------------------------------------------------------------------------- server
TOKEN_ENV = "LOOPRL_REWARD_TOKEN"  # the bearer token `serve-reward` requires and the client sends, when set


def bad_items(payload: Any) -> str | None:
    """Why a `/score` body is malformed (None when it is well formed): `{"items": [{prompt, response, ...}]}`."""
    if not isinstance(payload, dict) or "items" not in payload:
        return 'the body must be a JSON object with "items"'
    items = payload["items"]
    if not isinstance(items, list):
        return f'"items" must be a list, got {type(items).__name__}'
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            return f"item {i} must be an object, got {type(item).__name__}"
        missing = [k for k in ("prompt", "response") if not isinstance(item.get(k), str)]
        if missing:
            return f"item {i} needs string {' and '.join(missing)}"
    return None


class ScoringPool:
    """The server's scoring processes. A plugin that kills its process breaks the pool: the pool is replaced and
    the batch scored once more; a batch that breaks the new pool too comes back as failed samples, and the
    server goes on with a fresh pool."""

    def __init__(self, num_workers: int):
        self.num_workers, self.restarts = num_workers, 0
        self.pool = self._new()

    def _new(self) -> Any:
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context
        return ProcessPoolExecutor(self.num_workers, mp_context=get_context("spawn"))

    def replace(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = self._new()
        self.restarts += 1

    async def run(self, fn: Any, *args: Any) -> Any:
        from concurrent.futures.process import BrokenProcessPool
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            try:
                return await loop.run_in_executor(self.pool, fn, *args)
            except BrokenProcessPool:
                self.replace()
                if attempt == 1:
                    raise

    async def alive(self) -> bool:
        """A no-op through the pool (replacing it when broken): whether scoring works now."""
        try:
            return await self.run(os.getpid) > 0
        except Exception:  # noqa: BLE001 - a pool that cannot even start a process is dead
            return False


def make_app(spec: str, params: dict[str, Any] | None = None, timeout_s: float = 10.0, num_workers: int = 2,
             token: str | None = None):
    """The aiohttp application serving reward `spec` (loaded now, so a bad plugin fails at start-up). With `token`,
    every request needs `Authorization: Bearer <token>`."""
    from concurrent.futures.process import BrokenProcessPool

    from aiohttp import web

    from rewards.scoring import score_chunk
    from rl.registry import lookup
    lookup("reward", spec)
    params = dict(params or {})
    pool = ScoringPool(num_workers)

    @web.middleware
    async def authenticate(request: web.Request, handler: Any) -> web.Response:
        if token and request.headers.get("Authorization") != f"Bearer {token}":
            return web.json_response({"error": "unauthorized: send Authorization: Bearer <token>"}, status=401)
        return await handler(request)

    async def health(_: web.Request) -> web.Response:
        if not await pool.alive():
            return web.json_response({"status": "dead", "reward": spec, "restarts": pool.restarts}, status=503)
        return web.json_response({"status": "ok", "reward": spec, "restarts": pool.restarts})

    async def score(request: web.Request) -> web.Response:
        try:
            payload = await request.json()
        except ValueError as exc:
            return web.json_response({"error": f"bad request: the body is not JSON ({exc})"}, status=400)
        if (why := bad_items(payload)) is not None:
            return web.json_response({"error": f"bad request: {why}"}, status=400)
        items = payload["items"]
        if not items:
            return web.json_response({"results": []})
        try:
            raw = await pool.run(score_chunk, spec, params, items, timeout_s)
        except BrokenProcessPool:
            raw = [(None, f"reward {spec!r}: its scoring process died on this batch twice")] * len(items)
        results = []
        for value, error in raw:
            if isinstance(value, RewardFailure):
                value, error = None, value.reason
            results.append({"value": value, "error": error})
        return web.json_response({"results": results})

    async def shutdown(_: web.Application) -> None:
        pool.pool.shutdown(cancel_futures=True)

    app = web.Application(client_max_size=256 << 20, middlewares=[authenticate])
    app.router.add_get(HEALTH_PATH, health)
    app.router.add_post(SCORE_PATH, score)
    app.on_shutdown.append(shutdown)
    return app


def exposure_warning(host: str, token: str | None) -> str | None:
    """The warning for a server reachable beyond this machine without a token (None on loopback or with one)."""
    if host in ("127.0.0.1", "localhost", "::1") or token:
        return None
    return (f"looprl: WARNING: serving on {host} without authentication: anyone who reaches this port can run the "
            f"reward plugin; set {TOKEN_ENV} to require a token")


def serve(spec: str, host: str = "127.0.0.1", port: int = 8400, params: dict[str, Any] | None = None,
          timeout_s: float = 10.0, num_workers: int = 2) -> None:
    """Serve `spec`; the token is read from `LOOPRL_REWARD_TOKEN` (an argument would show in `ps`)."""
    from aiohttp import web
    token = os.environ.get(TOKEN_ENV) or None
    if (warning := exposure_warning(host, token)) is not None:
        print(warning, file=sys.stderr, flush=True)
    print(f"looprl: serving reward {spec!r} on http://{host}:{port}" + (" (token required)" if token else ""),
          flush=True)
    web.run_app(make_app(spec, params, timeout_s, num_workers, token), host=host, port=port, print=None)


# --------------------------------------------------------------------------- client
def is_remote(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def check_health(url: str, timeout_s: float = 10.0) -> None:
    """Raise a clear error when no reward server answers at `url`."""
    import requests
    try:
        resp = requests.get(url.rstrip("/") + HEALTH_PATH, timeout=timeout_s, headers=auth_headers())
        resp.raise_for_status()
    except requests.RequestException as exc:
        raise ConnectionError(f"reward server {url} is not reachable ({type(exc).__name__}: {exc}); "
                              f"start it with `looprl serve-reward PLUGIN --port PORT`") from None


def auth_headers() -> dict[str, str]:
    """The bearer token of `LOOPRL_REWARD_TOKEN`, when set."""
    token = os.environ.get(TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


def remote_reward(url: str):
    """A batched reward function that scores through the server at `url`."""

    @batched
    def call(prompts: list[str], responses: list[str], *, batch_size: int = 64, timeout_s: float = 60.0,
             retries: int = 2, backoff_s: float = 1.0, **columns: Any) -> list[Any]:
        import requests
        rows = [{"prompt": p, "response": r, **{k: v[i] for k, v in columns.items()}}
                for i, (p, r) in enumerate(zip(prompts, responses))]
        out: list[Any] = []
        for start in range(0, len(rows), batch_size):
            chunk, last_error = rows[start:start + batch_size], None
            for attempt in range(retries + 1):
                try:
                    resp = requests.post(url.rstrip("/") + SCORE_PATH, data=json.dumps({"items": chunk}, default=str),
                                         headers={"Content-Type": "application/json", **auth_headers()}, timeout=timeout_s)
                    resp.raise_for_status()
                    results = resp.json()["results"]
                    if len(results) != len(chunk):
                        raise ValueError(f"server returned {len(results)} results for {len(chunk)} items")
                    out.extend(RewardFailure(f"remote {url}: {r['error']}") if r["error"] else r["value"]
                               for r in results)
                    break
                except (requests.RequestException, ValueError, KeyError) as exc:
                    last_error = f"{type(exc).__name__}: {exc}"
                    if attempt < retries:
                        time.sleep(backoff_s * 2 ** attempt)
            else:
                out.extend([RewardFailure(f"remote reward {url} failed after {retries + 1} tries: "
                                          f"{last_error}")] * len(chunk))
        return out

    call.__name__ = f"remote({url})"
    return call


register_resolver("reward", is_remote, remote_reward)  # reward functions named by URL (rl.registry.get)
