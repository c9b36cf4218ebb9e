"""Remote rewards: serve any reward plugin over HTTP, and call such a server from a recipe.

    looprl serve-reward path/to/plugin.py:fn --port 8400 [--host 0.0.0.0] [--params '{"k": 1}']

The server (aiohttp) answers `GET /health` and `POST /score` with `{"items": [{prompt, response,
ground_truth, metadata, truncated}, ...]}`; it scores a request in worker processes with the same
per-sample timeout and error capture as the local reward service, and returns one
`{"value": ..., "error": ...}` per item.

A recipe names a server by its URL, as a reward function (`{name: "http://host:8400", weight: 1.0,
params: {batch_size: 64, timeout_s: 60, retries: 2}}`; `remote: URL` is the same). The client sends
batches, retries a failed request with backoff, and when the server stays unreachable records the
samples as failed (they leave the loss) so the run goes on; a restarted server is picked up by the
next request.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from rl.registry import register_resolver
from rl.reward import RewardFailure, batched

SCORE_PATH, HEALTH_PATH = "/score", "/health"


# --------------------------------------------------------------------------- server
def make_app(spec: str, params: dict[str, Any] | None = None, timeout_s: float = 10.0, num_workers: int = 2):
    """The aiohttp application serving reward `spec` (loaded now, so a bad plugin fails at start-up)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from aiohttp import web

    from rewards.scoring import score_chunk
    from rl.registry import lookup
    lookup("reward", spec)
    params = dict(params or {})
    pool = ProcessPoolExecutor(num_workers, mp_context=get_context("spawn"))

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "reward": spec})

    async def score(request: web.Request) -> web.Response:
        try:
            items = (await request.json())["items"]
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"bad request: {exc}"}, status=400)
        if not items:
            return web.json_response({"results": []})
        loop = asyncio.get_running_loop()
        raw = await loop.run_in_executor(pool, score_chunk, spec, params, items, timeout_s)
        results = []
        for value, error in raw:
            if isinstance(value, RewardFailure):
                value, error = None, value.reason
            results.append({"value": value, "error": error})
        return web.json_response({"results": results})

    async def shutdown(_: web.Application) -> None:
        pool.shutdown(cancel_futures=True)

    app = web.Application(client_max_size=256 << 20)
    app.router.add_get(HEALTH_PATH, health)
    app.router.add_post(SCORE_PATH, score)
    app.on_shutdown.append(shutdown)
    return app


def serve(spec: str, host: str = "127.0.0.1", port: int = 8400, params: dict[str, Any] | None = None,
          timeout_s: float = 10.0, num_workers: int = 2) -> None:
    from aiohttp import web
    print(f"looprl: serving reward {spec!r} on http://{host}:{port}", flush=True)
    web.run_app(make_app(spec, params, timeout_s, num_workers), host=host, port=port, print=None)


# --------------------------------------------------------------------------- client
def is_remote(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def check_health(url: str, timeout_s: float = 10.0) -> None:
    """Raise a clear error when no reward server answers at `url`."""
    import requests
    try:
        resp = requests.get(url.rstrip("/") + HEALTH_PATH, timeout=timeout_s)
        resp.raise_for_status()
    except requests.RequestException as exc:
        raise ConnectionError(f"reward server {url} is not reachable ({type(exc).__name__}: {exc}); "
                              f"start it with `looprl serve-reward PLUGIN --port PORT`") from None


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
                                         headers={"Content-Type": "application/json"}, timeout=timeout_s)
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
