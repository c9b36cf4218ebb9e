"""Per-rank memory of a learner step with Ulysses sequence parallelism (`learner.sequence_parallel_size`).

    python benchmarks/sequence_parallel.py [--lengths 2048 4096] [--sizes 1 2]

One training step (the causal family's forward over a right-padded row, logprobs of the response tokens, backward)
of a small Llama-style model made in code (hidden 512, 6 layers, 8 heads, sdpa attention) on one sequence of
each `--lengths` tokens, run by `s` processes over gloo for each `--sizes` entry (s = 1: no sequence
parallelism). Each rank records its peak resident memory above what it held after a warm-up step on a short
sequence (model, optimizer-free gradients and the runtime): the step's activations and working memory. With
sequence parallelism each rank runs 1/s of the positions, so that figure should fall by about s. The loss of
every size is recorded too (it must not change). Results: `benchmarks/results/sequence_parallel.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss() -> int:
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS")) * 1024


def _step(model, family, tok, length: int) -> float:

    from rl.batch import batch_of_examples
    from rl.sft_data import prompt_response_example
    prompt, response = "12+34=" * 10, "0123456789" * ((length - 60) // 10 + 1)
    batch = batch_of_examples([prompt_response_example(tok, prompt, response[:length - 61])], tok.pad_token_id)
    logp = family.forward(model, batch)["logp"]
    loss = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
    loss.backward()
    model.zero_grad(set_to_none=False)
    return float(loss.detach())


def worker(rank: int, size: int, port: int, length: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed
    import torch
    torch.set_num_threads(1)
    from models.families import CausalFamily
    from models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny
    tok = build_tiny_tokenizer()
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_tiny_model(tok, hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1536,
                             max_position_embeddings=length + 64).train()
    family = CausalFamily()
    if size > 1:
        from models.sequence_parallel import register
        path = Path(out).parent / "sp_model"
        if rank == 0:
            save_tiny(path, hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1536,
                      max_position_embeddings=length + 64)
        torch.distributed.barrier()
        family.sequence_parallel = register(str(path), "sdpa", size, 1)
    _step(model, family, tok, 64 * size)  # warm-up: lazily loaded code, gradient buffers
    base = _rss()
    loss = _step(model, family, tok, length)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(f"{out}.{rank}").write_text(json.dumps({"rank": rank, "step_bytes": peak - base, "loss": loss}))


def measure(size: int, length: int, tmp: Path) -> dict:
    import subprocess
    out = tmp / f"s{size}_l{length}"
    from cluster.ray_utils import free_port
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(size), str(port), str(length),
                               str(out)], env=env, cwd=ROOT) for r in range(size)]
    if any(p.wait() for p in procs):
        raise SystemExit(f"sequence parallelism {size} at {length} tokens: a rank failed")
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(size)]
    row = {"size": size, "length": length, "step_mib_per_rank": [r["step_bytes"] / 2**20 for r in ranks],
           "loss": ranks[0]["loss"]}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, size, port, length = map(int, sys.argv[2:6])
        worker(rank, size, port, length, sys.argv[6])
        return
    import tempfile
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/sequence_parallel.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(s, n, Path(tmp)) for n in args.lengths for s in args.sizes]
    for row in rows:
        one = next(r for r in rows if r["length"] == row["length"] and r["size"] == 1)
        row["ratio_to_one_rank"] = max(row["step_mib_per_rank"]) / one["step_mib_per_rank"][0]
        row["loss_diff_to_one_rank"] = abs(row["loss"] - one["loss"])
    Path(args.out).write_text(json.dumps({"model": "llama hidden 512, 6 layers, 8 heads, sdpa", "rows": rows},
                                         indent=2))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
