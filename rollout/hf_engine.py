"""`hf` generation engine: transformers `generate` with a KV cache, returning a `Batch`.

Works on CPU and GPU and for any causal LM transformers can load; it is the engine that later
decoding hooks (logits processors, residual-stream hooks, KV policies) attach to.
Sampled-token logprobs are those of the *processed* distribution (after temperature, top-k,
top-p), which for temperature 1 and no truncation equals the raw model distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from rl.batch import Batch
from rl.registry import register

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    seed: int | None = None
    stop: list[str] | None = None  # stop strings: a response ends after the first one it produces
    exit_at_step: int | None = None  # looped models (Ouro): read out after this loop, 1-based (None: the model's default)


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer saved with a model folder, left-padded for generation."""
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError, KeyError):
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def encode_prompts(tok: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Left-padded prompt ids and mask. An empty prompt is given the BOS token (EOS without one): vLLM
    rejects empty prompts, and a judge may well be asked about an empty response; both engines do the
    same so that their batches agree."""
    start = tok.bos_token or tok.eos_token
    return tok([p if p else start for p in prompts], return_tensors="pt", padding=True, add_special_tokens=False)


def attach_prompt_fields(batch: Batch, prompts: list[str], n: int, group_ids: list[int] | None,
                        ground_truth: list[Any] | None, metadata: list[dict] | None) -> Batch:
    """Give each of the `n` rows per prompt (prompt-major) its prompt's text, group id, ground truth and
    metadata; shared by the engines so their batches carry the same fields."""
    group_ids = group_ids if group_ids is not None else list(range(len(prompts)))
    batch.group_id = torch.tensor([g for g in group_ids for _ in range(n)], dtype=torch.long)
    batch.prompts = [p for p in prompts for _ in range(n)]
    batch.ground_truth = [g for g in (ground_truth or [None] * len(prompts)) for _ in range(n)]
    batch.metadata = [dict(m) for m in (metadata or [{} for _ in prompts]) for _ in range(n)]
    return batch


@register("engine", "hf")
class HFEngine:
    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu",
                 trust_remote_code: bool = False, batch_size: int = 256):
        self.tokenizer = load_tokenizer(model_path)
        self.device = torch.device(device)
        import models.ouro  # noqa: F401  (registers model_type ouro)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code).to(self.device).eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def generate(self, prompts: list[str], sampling: SamplingParams, *, group_ids: list[int] | None = None,
                 ground_truth: list[Any] | None = None, metadata: list[dict] | None = None) -> Batch:
        """Sample `sampling.n` responses per prompt; row order is prompt-major (p0s0, p0s1, ...)."""
        n = sampling.n
        rows_prompt = [p for p in prompts for _ in range(n)]
        chunks = []
        seed = sampling.seed if sampling.seed is not None else 0
        for start in range(0, len(rows_prompt), self.batch_size):
            # Seeded per call and chunk, so a resumed run samples exactly what an uninterrupted one did.
            torch.manual_seed(seed * 1_000_003 + start)
            chunks.append(self._generate_chunk(rows_prompt[start:start + self.batch_size], sampling))
        return attach_prompt_fields(Batch.concat(chunks), prompts, n, group_ids, ground_truth, metadata)

    def _generate_chunk(self, prompts: list[str], sp: SamplingParams) -> Batch:
        tok = self.tokenizer
        enc = encode_prompts(tok, prompts).to(self.device)
        greedy = sp.temperature <= 0
        kwargs: dict[str, Any] = dict(max_new_tokens=sp.max_new_tokens, do_sample=not greedy,
                                      output_scores=True, return_dict_in_generate=True,
                                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        if not greedy:
            kwargs.update(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k or None)
        if sp.stop:
            kwargs.update(stop_strings=list(sp.stop), tokenizer=tok)
        if sp.exit_at_step is not None:
            if not hasattr(self.model, "loop_states"):
                raise ValueError("SamplingParams.exit_at_step needs a looped model (model_type ouro)")
            kwargs["exit_at_step"] = sp.exit_at_step  # generate() forwards it to every forward call
        t0 = time.perf_counter()
        out = self.model.generate(**enc, **kwargs)
        gen_s = time.perf_counter() - t0
        P = enc["input_ids"].shape[1]
        resp = out.sequences[:, P:].cpu()
        scores = torch.stack(out.scores, 1).float().cpu()  # [B, L, V] processed logits
        logp = torch.log_softmax(scores, -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        L = resp.shape[1]
        is_eos = resp == tok.eos_token_id
        has_eos = is_eos.any(1)
        lengths = torch.where(has_eos, is_eos.float().argmax(1) + 1, torch.full_like(has_eos, L, dtype=torch.long))
        stopped = has_eos.clone()
        if sp.stop:
            # generate() fills a row with pad tokens once it has produced a stop string: the row ends
            # where its trailing run of pads starts exactly when the text up to there ends with a stop
            # string (pads the model sampled itself do not end it). Also right for pad == eos tokenizers.
            content = (resp != tok.pad_token_id).long()
            fill_start = torch.where(content.any(1), L - content.flip(1).argmax(1), 0)
            for i in range(len(resp)):
                p = int(fill_start[i])
                if tok.decode(resp[i, :p], skip_special_tokens=True).endswith(tuple(sp.stop)):
                    lengths[i] = min(int(lengths[i]), p)
                    stopped[i] = True
        attn = (torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)).long()
        resp = torch.where(attn.bool(), resp, torch.full_like(resp, tok.pad_token_id))
        texts = tok.batch_decode([r[: int(n)] for r, n in zip(resp, lengths)], skip_special_tokens=True)
        return Batch(prompt_ids=enc["input_ids"].cpu(), prompt_mask=enc["attention_mask"].cpu(),
                     response_ids=resp, response_mask=attn.float(), response_attn=attn,
                     group_id=torch.zeros(len(prompts), dtype=torch.long),
                     rollout_logp=torch.where(attn.bool(), logp, torch.zeros_like(logp)),
                     truncated=~stopped, responses=texts,
                     metadata=[{"gen_s": gen_s / len(prompts)} for _ in prompts])

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Copy new weights in place (all parameters and buffers by name; unknown names are an error)."""
        state = self.model.state_dict()
        unknown = [k for k in named_tensors if k not in state]
        if unknown:
            raise KeyError(f"load_weights: names not in the rollout model: {unknown[:5]}")
        with torch.no_grad():
            for k, v in named_tensors.items():
                state[k].copy_(v.to(state[k].dtype))

    def sleep(self) -> None:
        """Free the GPU while the colocated learner trains: the model waits in host memory (no-op on CPU)."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake(self, tags: list[str] | None = None) -> None:
        """Back on the GPU; `tags` as vLLM's (`weights`, `kv_cache`): the hf engine has only weights."""
        if self.device.type == "cuda" and (tags is None or "weights" in tags):
            self.model.to(self.device)
