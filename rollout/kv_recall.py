"""A long-range recall task for KV-cache policies on a taught model (a labelled synthetic harness, the measurement
behind BeaconKV's accuracy claim at CPU scale; rl/methods/beaconkv/README.md).

The prompt is a lookup table of `n_keys` distinct single-letter keys in random order, each with a random digit
value (`g4c7…a2;`). The answer walks the keys in alphabetical order and writes each one's value, with a fixed
run of filler characters after each entry (`a2......b5......`), so every value must be read back from a prompt
position written long before, while the cache also fills with the model's own filler. A tiny GQA Llama made in
code is taught the task in-process (`tiny_recall_lm`); `evaluate_recall` then decodes held-out tables on the `hf`
engine's decode loop with a KV-cache policy and scores each key's value (`score_recall`).
"""

from __future__ import annotations

import random
import re
import string
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

KEYS = string.ascii_lowercase


def recall_example(rng: random.Random, n_keys: int = 8, filler: int = 8) -> tuple[str, str, dict[str, str]]:
    """(prompt, answer, table): the table in a random order, the answer in alphabetical order of the keys."""
    if not 1 <= n_keys <= len(KEYS):
        raise ValueError(f"kv_recall: n_keys must be in 1..{len(KEYS)}, got {n_keys}")
    keys = rng.sample(KEYS[:n_keys], n_keys)
    table = {k: str(rng.randrange(10)) for k in keys}
    prompt = "".join(f"{k}{table[k]}" for k in keys) + ";"
    answer = "".join(f"{k}{table[k]}" + "." * filler for k in sorted(keys))
    return prompt, answer, table


def score_recall(text: str, table: dict[str, str]) -> float:
    """Share of the table's keys whose first `key digit` pair in `text` has the right value (a key never written
    counts as wrong)."""
    said: dict[str, str] = {}
    for key, value in re.findall(r"([a-z])(\d)", text):
        said.setdefault(key, value)
    return sum(said.get(k) == v for k, v in table.items()) / len(table)


def tiny_recall_lm(seed: int = 0, steps: int = 3000, *, n_keys: int = 8, filler: int = 8, batch_size: int = 64,
                   hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                   lr: float = 1.5e-3, log: Callable[[str], None] | None = None
                   ) -> tuple[nn.Module, Any, Callable[[int], list[tuple[str, str, dict[str, str]]]]]:
    """A tiny GQA Llama taught the recall task for `steps` AdamW steps (loss on the answer tokens only; with the
    defaults the values stay at chance for the first 400-1,000 steps, until the model finds the lookup). Returns
    (model in eval mode, tokenizer, held_out(n)): held_out draws tables from a stream seeded apart from the training
    stream."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.tiny import build_tiny_tokenizer
    from rl.batch import pad_token_rows
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = build_tiny_tokenizer()
    length = 2 * n_keys + n_keys * (2 + filler) + 2
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=max(256, 2 * length), rms_norm_eps=1e-5, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)

    def batch(n: int) -> dict[str, torch.Tensor]:
        rows = [recall_example(rng, n_keys, filler) for _ in range(n)]
        ids, labels = [], []
        for prompt, answer, _ in rows:
            p = tok(prompt, add_special_tokens=False)["input_ids"]
            a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids.append(p + a)
            labels.append([-100] * len(p) + a)
        input_ids, attention_mask = pad_token_rows(ids, tok.pad_token_id, "left")
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "labels": pad_token_rows(labels, -100, "left")[0]}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * max(0.1, 1 - s / steps))
    model.train()
    for step in range(steps):
        loss = model(**batch(batch_size)).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log is not None and (step + 1) % 100 == 0:
            log(f"kv_recall seed {seed}: step {step + 1}/{steps} loss {loss.item():.4f}")
    held_rng = random.Random(10_000 + seed)

    def held_out(n: int) -> list[tuple[str, str, dict[str, str]]]:
        return [recall_example(held_rng, n_keys, filler) for _ in range(n)]
    return model.eval(), tok, held_out


@torch.no_grad()
def evaluate_recall(model: nn.Module, tok: Any, examples: list[tuple[str, str, dict[str, str]]], method: Any = None,
                    *, batch_size: int = 50) -> dict[str, float]:
    """Greedy decoding of every example's answer with `method` (a decoding method, e.g. a KV-cache policy; None =
    full cache): mean recall accuracy, share of tables recalled entirely, tokens per second, and the peak bytes of
    the cache's keys and values (the policy's own figure; the full cache's computed from its shape)."""
    from rollout.decoding import decode
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    max_new = max(len(tok(a, add_special_tokens=False)["input_ids"]) for _, a, _ in examples) + 1
    scores, tokens, seconds, peak = [], 0, 0.0, 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        enc = tok([p for p, _, _ in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        resp, _, lengths, _, _ = decode(model, enc["input_ids"], enc["attention_mask"], method=method,
                                        max_new_tokens=max_new, temperature=0.0, top_k=0, top_p=1.0,
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        seconds += time.perf_counter() - t0
        tokens += int(lengths.sum())
        for row, n, (_, _, table) in zip(resp, lengths.tolist(), chunk):
            scores.append(score_recall(tok.decode(row[:n], skip_special_tokens=True), table))
        stats = getattr(method, "stats", None)
        if stats:
            peak = max(peak, stats["peak_bytes"])
        else:  # the full cache: every layer's keys and values for every prompt and answer position but the
            # last sampled one, which is never fed
            elem = next(model.parameters()).element_size()
            width = enc["input_ids"].shape[1] + resp.shape[1] - 1
            peak = max(peak, 2 * cfg.num_hidden_layers * len(chunk) * cfg.num_key_value_heads * width * head_dim
                       * elem)
    return {"accuracy": sum(scores) / len(scores), "all_correct": sum(s == 1.0 for s in scores) / len(scores),
            "tokens_per_s": tokens / seconds, "peak_kv_bytes": peak}
