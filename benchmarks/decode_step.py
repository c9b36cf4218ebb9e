"""The `hf` engine's decode loop at the race's rollout shapes, its variants alternated in one process so that all
see the same machine, each adding one step towards what the loop runs: every row prefilled on its own with
attention over strided views of the KV cache (what a decoding method that hooks the forward runs); the prompt
prefill shared by the rows that repeat a prompt, same strided views; in bf16, attention over the cache's whole
buffers (the plain loop in half precision on CPU without the fused kernel), also with the fused kernel; then the
one-query attention steps fused into one compiled kernel (`rollout.fused_attention`; compiled in the warm-up round)
over strided views of the filled part (what the loop runs with it); and last the linear
layers' weights packed once per generate (`rollout.packed_linear`), then the KV cache's storage reused from one
generate to the next (`rollout.decoding.KVBuffers`), and the prompt's cache positions read once per group of rows
that share it (`rollout.fused_attention.share_prompt_reads`; the earlier variants read every row's own copy): the
`hf` engine's defaults on CPU. With
`--eos`, rows end at the tokenizer's EOS (a random model samples it about once in 100 tokens, as the race's
rollouts end: about half run the whole length) and the packed-weights variant runs twice, keeping the ended rows
in the batch (as before) or dropping them once they are an eighth of it (`rollout.decoding.COMPACT_SHARE`, the
loop's default, which the KV-storage variant keeps).

    python benchmarks/decode_step.py [--prompts 16] [--n 8] [--new-tokens 64] [--reps 3] [--threads 2]
                                     [--dtype bfloat16] [--eos] [--prompt-tokens 30] [--last N]

Workload: the ~85M model of `benchmarks/grpo_step.py` (random weights, eager attention as the race's rollout
runs it), `--prompts` distinct prompts of 60-100% of `--prompt-tokens` tokens (18-30 by default; left-padded), each
sampled `--n` times at temperature 1 for
`--new-tokens` tokens (no EOS unless `--eos`, so every row runs the whole length). Reports the median seconds per generate of
each variant, the prefill's seconds (the first forward), and the speed-up over the first. The variants sample the
same tokens (tests/rollout/test_decoding.py, tests/rollout/test_compiled_decode.py). The last variant is the decode
step compiled as one graph over a static KV cache (`rollout.compiled_decode`, compiled in the warm-up round; its
prefill is not timed apart; it reads the prompt once per group too). Results: benchmarks/results/decode_step.json
(per `--dtype`, `_eos`, and `_prompt<N>` when `--prompt-tokens` is not 30).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.weight_sync import cpu_kind  # noqa: E402

SHAPE = {"hidden_size": 768, "num_layers": 14, "num_heads": 12, "intermediate_size": 1536}


class PrefillEveryRow:
    """A decoding method with a (empty) forward hook: the loop then prefills every row as given."""

    def forward_hooks(self, model, state):
        return []


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--eos", action="store_true", help="rows end at EOS (results under '<dtype>_eos')")
    p.add_argument("--prompt-tokens", type=int, default=30, help="the longest prompt; the shortest is 60%% of it")
    p.add_argument("--last", type=int, default=0,
                   help="run only the last N variants (0: all); the speed-ups are then over the first of those")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/decode_step.json"))
    return p.parse_args()


def workload(args: argparse.Namespace, tok):
    """The model (random weights, eager attention, `--dtype`) and the rows: `--prompts` left-padded prompts of
    60-100% of `--prompt-tokens` tokens, each repeated `--n` times."""
    import torch

    from models.tiny import build_tiny_model
    positions = max(256, 2 * (args.prompt_tokens + args.new_tokens))
    model = build_tiny_model(tok, max_position_embeddings=positions, **SHAPE)
    model.config._attn_implementation = "eager"
    model = model.to(getattr(torch, args.dtype)).eval()
    g = torch.Generator().manual_seed(0)
    P = args.prompt_tokens
    plen = torch.randint(int(0.6 * P), P + 1, (args.prompts,), generator=g)
    mask = (torch.arange(P)[None] >= (P - plen)[:, None]).long()
    ids = torch.randint(5, len(tok), (args.prompts, P), generator=g) * mask + tok.pad_token_id * (1 - mask)
    return model, ids.repeat_interleave(args.n, 0), mask.repeat_interleave(args.n, 0)


def decode_variants(args: argparse.Namespace) -> tuple[dict, set, str]:
    """Each variant's (method, cache factory, fused attention, packed weights, COMPACT_SHARE[, KV buffers]), in the
    order each adds one step towards the engine's defaults; the variants that read a group's prompt once; the name
    of the compiled one."""
    import rollout.decoding as decoding
    from rollout.decoding import KVBuffers
    made = decoding.reserved_cache
    strided = lambda capacity, full_view=False, buffers=None: made(capacity, False, buffers)  # noqa: E731
    whole = lambda capacity, full_view=False, buffers=None: made(capacity, True, buffers)  # noqa: E731
    # the loop's own choice: bf16 without the fused kernel reads whole buffers, the fused kernel (and fp32) strided
    # views (`rollout.decoding.ReservedLayer`)
    never = 2.0  # a COMPACT_SHARE that never drops a row
    variants = {"every row prefilled, strided cache views": (PrefillEveryRow(), strided, False, False, never),
                "shared prefill, strided cache views": (None, strided, False, False, never)}
    if args.dtype == "bfloat16":
        variants["shared prefill, whole cache buffers"] = (None, whole, False, False, never)
        variants["shared prefill, whole cache buffers, fused attention"] = (None, whole, True, False, never)
    variants["shared prefill, strided cache views, fused attention"] = (None, strided, True, False, never)
    last = "shared prefill, strided cache views, fused attention, packed weights"
    variants[last] = (None, strided, True, True, never)
    if args.eos:
        last += ", ended rows dropped"
        variants[last] = (None, strided, True, True, decoding.COMPACT_SHARE)
    kept = KVBuffers()  # the engine's: one for the process, reused by every generate of the variant
    variants[last + ", KV storage reused"] = (None, strided, True, True, variants[last][4], kept)
    once = last + ", KV storage reused, prompt read once per group"
    variants[once] = variants[last + ", KV storage reused"]
    # the whole one-token step as one compiled graph over a static cache (`rollout.compiled_decode`): the fused
    # attention over the filled positions and the packed weights as opaque calls in it, every row kept (the graph's
    # shapes are fixed), the static cache kept between generates in the engine's buffers, as the engine keeps it
    compiled = "shared prefill, compiled step over a static cache, fused attention and packed weights in the graph"
    variants[compiled] = (None, strided, True, True, never, kept)
    if args.last:
        variants = dict(list(variants.items())[-args.last:])
    return variants, {once, compiled}, compiled


class PrefillTimer:
    """The model's first forward of a generate (its prefill), timed by forward hooks; removed while the compiled
    variant runs (the hooks would break its graph: its prefill is not timed apart)."""

    def __init__(self, model) -> None:
        self.model, self.started, self.took = model, [], []
        self.hooks: list = []

    def attach(self) -> None:
        self.hooks = [self.model.register_forward_pre_hook(lambda *_: self.started.append(time.perf_counter())),
                      self.model.register_forward_hook(self._post)]

    def _post(self, *_) -> None:
        if len(self.started) == 1:
            self.took.append(time.perf_counter() - self.started[-1])

    def detach(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def first(self) -> float:
        return self.took[0] if self.took else float("nan")


def time_variants(args: argparse.Namespace, model, tok, ids, mask, variants: dict, reads_prompt_once: set,
                  compiled: str) -> tuple[dict, dict, dict]:
    """Seconds per generate, prefill seconds and mean response length of each variant, alternated in rounds (the
    first round warms up); the loop's settings are restored after."""
    import torch

    import rollout.decoding as decoding
    import rollout.fused_attention as fused_attention
    from rollout.decoding import decode
    made, share, shortest_shared = (decoding.reserved_cache, decoding.COMPACT_SHARE,
                                    fused_attention.MIN_SHARED_PROMPT_BYTES)
    times, prefills, lengths = ({k: [] for k in variants} for _ in range(3))
    timer = PrefillTimer(model)
    try:
        for rep in range(args.reps + 1):
            for name, (method, cache_factory, fused, packed, compact_share, *buffers) in variants.items():
                decoding.reserved_cache, decoding.COMPACT_SHARE = cache_factory, compact_share
                fused_attention.MIN_SHARED_PROMPT_BYTES = (shortest_shared if name in reads_prompt_once
                                                           else dict.fromkeys(shortest_shared, 1 << 62))
                timer.started.clear()
                timer.took.clear()
                if name != compiled:
                    timer.attach()
                torch.manual_seed(rep)
                t0 = time.perf_counter()
                out = decode(model, ids, mask, max_new_tokens=args.new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                             eos_token_id=tok.eos_token_id if args.eos else -1, pad_token_id=tok.pad_token_id,
                             method=method, fused_attention=fused, packed_weights=packed,
                             kv_buffers=buffers[0] if buffers else None, compiled=name == compiled)
                took = time.perf_counter() - t0
                timer.detach()
                if rep:
                    times[name].append(took)
                    prefills[name].append(timer.first())
                    lengths[name].append(float(out[2].float().mean()))
                print(json.dumps({"rep": rep, "variant": name, "s": round(took, 2),
                                  "prefill_s": round(timer.first(), 3)}), flush=True)
    finally:
        decoding.reserved_cache, decoding.COMPACT_SHARE = made, share
        fused_attention.MIN_SHARED_PROMPT_BYTES = shortest_shared
        timer.detach()
    return times, prefills, lengths


def main() -> None:
    from cluster.ray_utils import exec_with_actor_malloc
    exec_with_actor_malloc()  # timed as an actor runs: with its malloc settings
    args = parse_args()
    import torch

    from models.tiny import build_tiny_tokenizer
    torch.set_num_threads(args.threads)
    tok = build_tiny_tokenizer()
    model, ids, mask = workload(args, tok)
    variants, reads_prompt_once, compiled = decode_variants(args)
    times, prefills, lengths = time_variants(args, model, tok, ids, mask, variants, reads_prompt_once, compiled)
    base = statistics.median(next(iter(times.values())))
    report = {"args": vars(args), "cpu": cpu_kind(), "rows": len(ids),
              "variants": {k: {"s_per_generate": statistics.median(v), "prefill_s": statistics.median(prefills[k]),
                               "mean_response_tokens": statistics.mean(lengths[k]),
                               "speedup": base / statistics.median(v)} for k, v in times.items()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text()) if out.exists() else {}
    runs = previous.get("runs", {}) if "runs" in previous else {}
    P = args.prompt_tokens
    runs[args.dtype + ("_eos" if args.eos else "") + (f"_prompt{P}" if P != 30 else "")] = report
    out.write_text(json.dumps({"runs": runs}, indent=2))
    print(json.dumps(report["variants"], indent=1))


if __name__ == "__main__":
    main()
