"""Peak memory of the learner's logprob pass and of the hf engine's sampling at a long-response,
large-vocabulary setting, before and after chunking.

    python benchmarks/logprob_memory.py [--vocab 151936] [--new-tokens 1024] [--rows 4]

Setting: a tiny Llama (hidden 64, 2 layers) with a Qwen-sized vocabulary (151,936), `--rows` sequences of a
32-token prompt and `--new-tokens` response tokens, fp32, one thread. Each variant runs in a fresh process
and reports its peak resident memory (ru_maxrss) minus the memory it held before the measured call (model
and inputs loaded):

* learner, full logits (the previous implementation, kept here as the baseline): the model's forward gives
  `[N, S, V]` logits, sliced to the response, log-softmaxed; then backward.
* learner, chunked (`models.families.response_logprobs`): the decoder's hidden states, the vocabulary
  projection at response positions in chunks of 512 tokens, recomputed in backward.
* engine, stacked scores (the previous implementation): transformers `generate` with `output_scores`, the
  per-step processed scores stacked to `[N, L, V]` for the sampled tokens' logprobs.
* engine, per-step logprob (`rollout.decoding.decode`, what the hf engine runs now).

Results: benchmarks/results/logprob_memory.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, resource, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
from transformers import AutoModelForCausalLM
from models.tokenizer import load_tokenizer
variant, path, rows, new_tokens = {variant!r}, {path!r}, {rows}, {new_tokens}
model = AutoModelForCausalLM.from_pretrained(path)
tok = load_tokenizer(path)
g = torch.Generator().manual_seed(0)
prompt = torch.randint(10, 100, (rows, 32), generator=g)
def rss_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
if variant.startswith("learner"):
    from rl.batch import Batch
    resp = torch.randint(10, 100, (rows, new_tokens), generator=g)
    b = Batch(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), response_ids=resp,
              response_mask=torch.ones(rows, new_tokens), group_id=torch.zeros(rows, dtype=torch.long))
    base = rss_gib()
    t0 = time.perf_counter()
    if variant == "learner_full":
        logits = model(**b.model_inputs(), use_cache=False).logits[:, 31:31 + new_tokens].float()
        logp = torch.log_softmax(logits, -1).gather(-1, resp[..., None]).squeeze(-1)
    else:
        from models.families import response_logprobs
        logp, _ = response_logprobs(model, b, chunk_tokens=512)
    logp.sum().backward()
else:
    base = rss_gib()
    t0 = time.perf_counter()
    mask = torch.ones_like(prompt)
    if variant == "engine_stacked":
        torch.manual_seed(0)
        out = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=True, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        ids = out.sequences[:, 32:]
        logp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    else:
        from rollout.decoding import decode
        torch.manual_seed(0)
        ids, logp, *_ = decode(model, prompt, mask, max_new_tokens=new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                               eos_token_id=-1, pad_token_id=tok.pad_token_id)
    assert ids.shape[1] == new_tokens
print(json.dumps({{"variant": variant, "peak_gib": rss_gib(), "before_gib": base,
                   "seconds": time.perf_counter() - t0}}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/logprob_memory.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from models.tiny import build_tiny_tokenizer
    path = tempfile.mkdtemp()
    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=32 + args.new_tokens + 8, tie_word_embeddings=False,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    results = []
    for variant in ("learner_full", "learner_chunked", "engine_stacked", "engine_per_step"):
        code = CHILD.format(root=str(ROOT), variant=variant, path=path, rows=args.rows, new_tokens=args.new_tokens)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        if proc.returncode != 0:
            raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["added_gib"] = r["peak_gib"] - r["before_gib"]
        print(f"{variant:16s} peak {r['peak_gib']:.2f} GiB (+{r['added_gib']:.2f} over the loaded model), "
              f"{r['seconds']:.1f} s", flush=True)
        results.append(r)
    by = {r["variant"]: r for r in results}
    summary = {"setting": {"vocab": args.vocab, "new_tokens": args.new_tokens, "rows": args.rows, "prompt_tokens": 32,
                           "hidden": 64, "layers": 2, "dtype": "float32", "threads": 1},
               "results": results,
               "learner_added_ratio": by["learner_full"]["added_gib"] / max(by["learner_chunked"]["added_gib"], 1e-3),
               "engine_added_ratio": by["engine_stacked"]["added_gib"] / max(by["engine_per_step"]["added_gib"], 1e-3)}
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k.endswith("ratio")}))


if __name__ == "__main__":
    main()
