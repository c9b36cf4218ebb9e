"""`hf` generation engine: the project's decode loop (`rollout.decoding`) over a transformers model with a
KV cache, returning a `Batch`.

Works on CPU and GPU and for any causal LM transformers can load; decoding hooks (logits processors,
residual-stream hooks, KV policies) attach to its loop. With no hooks (`plain`) it samples exactly what
transformers' `generate` does (tested). Each sampled token's logprob is taken at its decode step, of the
*processed* distribution (after temperature, top-k, top-p) — no `[B, L, V]` score stack is kept — which for
temperature 1 and no truncation equals the raw model distribution.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import torch

from models.tokenizer import load_tokenizer
from rl.batch import Batch, pad_token_rows
from rl.registry import register
from rollout.base import DTYPES, SamplingParams, attach_prompt_fields, encode_prompts
from rollout.hardware import warn_slow_bf16


def length_buckets(lengths: list[int], factor: float, slack: int = 32) -> list[list[int]]:
    """Row indices in groups of similar length: sorted by length, a group holds the rows up to `factor` times (or
    `slack` more than) its shortest; each group in ascending row order, groups ordered by their first row.
    `factor` 0: one group of every row."""
    if not lengths:
        return []
    if factor <= 0:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        shortest = lengths[groups[-1][0]] if groups else None
        if shortest is not None and lengths[i] <= max(factor * shortest, shortest + slack):
            groups[-1].append(i)
        else:
            groups.append([i])
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


@register("engine", "hf")
class HFEngine:
    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu",
                 trust_remote_code: bool = False, batch_size: int = 256, attn_implementation: str | None = None,
                 adapter: dict[str, Any] | None = None, fused_decode_attention: bool = True,
                 packed_linear_weights: bool = True, reuse_kv_buffers: bool = True, compiled_decode: bool = False,
                 length_buckets: float = 0.0, fp32_packing: str = "auto"):
        """`attn_implementation`: transformers' attention kernel for generation (None: the model's own); on
        CPU `eager` decodes faster than `sdpa` (one query per step), at float rounding from the learner's.
        `fused_decode_attention`: on CPU, the plain loop's decode steps attend with one compiled kernel
        (`rollout.fused_attention`; Llama, Mistral, Qwen2/3 architectures; compiled on the first generate,
        seconds) instead of `attn_implementation`'s; the prompt's prefill keeps the model's kernel.
        `packed_linear_weights`: on CPU in fp32/bf16, the decode loop's linear layers multiply with their weights
        packed once per generate (`rollout.packed_linear`: oneDNN's layout in bf16; one more copy of the weights
        while it runs). `fp32_packing`: the fp32 weights' layout, `mkl` (MKL's sgemm, measured faster on an Intel
        Xeon), `onednn` (measured faster on an AMD EPYC) or `auto` (MKL's on Intel CPUs, oneDNN's elsewhere).
        `reuse_kv_buffers`: on CPU, the decode loop's KV cache reuses its storage from one generate to the next
        (`rollout.decoding.KVBuffers`: fresh buffers fault their pages in at every generate; the storage, twice the
        largest cache, stays allocated between generates, freed by `sleep`).
        `compiled_decode`: each decode step runs as one compiled graph over a static KV cache
        (`rollout.compiled_decode`; on CUDA with CUDA graphs): the same tokens, launched as one graph instead of
        a kernel per small op; each (rows, capacity) bucket compiles once per process (seconds). Methods that hook
        the forward or edit the cache, and models that cannot be captured, decode eagerly (one warning says why).
        `length_buckets`: `generate_ids` (continuations: partial rollouts, multi-turn episodes) decodes contexts
        of very different lengths in separate calls, each holding contexts within this factor (or 32 tokens) of its
        shortest, instead of left-padding every row to the longest; 0 (default): one call. Which is faster depends
        on the model and the rows (measured on 2 CPU cores): 128 new 10-token prompts beside 24 continuations of
        80-230 tokens on the long-tail recipe's model (hidden 128, 3 layers) took 1.26 s as one call and 0.29 s in
        buckets of factor 2, while the synthetic streaming harness's partial rounds (64 rows, hidden 64) trained
        141 samples/s with one call and 99 in buckets, whose extra calls cost more than the padding they save.
        `adapter`: the learner's adapter (`learner.adapter`): the base model is wrapped with it, unmerged, and
        `load_weights` then takes the adapter's tensors alone."""
        from rollout.packed_linear import resolve_fp32_packing
        self.fp32_packing = resolve_fp32_packing(fp32_packing)  # a bad value is refused before the model loads
        self.tokenizer = load_tokenizer(model_path)
        self.device = torch.device(device)
        warn_slow_bf16(dtype, self.device.type)
        self.model = self._load_model(model_path, dtype, trust_remote_code, attn_implementation, adapter)
        self.adapted = bool(adapter)
        self.fused_decode_attention = fused_decode_attention
        self.packed_linear_weights = packed_linear_weights
        self.compiled_decode = compiled_decode
        from rollout.decoding import KVBuffers
        # on a GPU the caching allocator reuses the eager cache's memory; the compiled step's static caches are kept
        # all the same, so that a CUDA graph replays over the addresses it was captured with
        self.kv_buffers = (KVBuffers() if reuse_kv_buffers and (self.device.type == "cpu" or compiled_decode)
                           else None)
        self.batch_size = batch_size
        self.length_buckets = length_buckets
        self._methods: dict[str, Any] = {}  # decoding methods built so far, by name and params
        self._commits: list | None = None  # the last diffusion chunk's per-row commit logs, for its Batch
        # in-flight weight updates (`rollout.in_flight_updates`): called between two decode steps of the plain loop
        self.between_steps: Any = None

    def _load_model(self, model_path: str, dtype: str, trust_remote_code: bool, attn_implementation: str | None,
                    adapter: dict[str, Any] | None) -> torch.nn.Module:
        """The model `model_path` holds, on this engine's device, in eval mode, as it is served: a decomper folder
        as its factors, a fake-quantized folder as such, wrapped with the learner's `adapter` if given."""
        import models  # noqa: F401  (registers model_types ouro and llada)
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        from models.lowrank import load_causal_lm  # a decomper folder is served as its factors
        model = load_causal_lm(model_path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
                               **kwargs).to(self.device).eval()
        from models.quant import load_fake_quant
        model = load_fake_quant(model, model_path)  # a fake-quantized folder (fair_calib) serves as such
        from models.adapters import load_unmerged, make_adapter
        if adapter:
            from rl.registry import lookup
            return make_adapter(model, adapter, lookup("adapter", adapter["name"])).eval()
        # a folder with an adapter that cannot be merged (U-LoRA) serves the base with it
        return load_unmerged(model, model_path).eval()

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
            torch.manual_seed((seed * 1_000_003 + start) % (1 << 63))
            chunks.append(self._generate_chunk(rows_prompt[start:start + self.batch_size], sampling))
        return attach_prompt_fields(Batch.concat(chunks), prompts, n, group_ids, ground_truth, metadata)

    def decoding_method(self, name: str, params: dict[str, Any] | None) -> Any:
        """The decoding method `name` built with `params` (kept for later calls with the same choice)."""
        import json

        from rl.registry import lookup
        key = json.dumps([name, params or {}], sort_keys=True, default=str)
        if key not in self._methods:
            self._methods[key] = lookup("decoding", name)(**(params or {}))
        return self._methods[key]

    def _generate_chunk(self, prompts: list[str], sp: SamplingParams) -> Batch:
        tok = self.tokenizer
        enc = encode_prompts(tok, prompts).to(self.device)
        return self._decode_chunk(enc, prompts, sp)

    @torch.no_grad()
    def generate_ids(self, prompt_ids: list[list[int]], sampling: SamplingParams, seeds: list[int]) -> list[Any]:
        """One continuation per prompt of token ids (`rollout.multiturn`, partial rollouts): new ids, their
        logprobs, whether each ended by EOS or a stop string. Contexts of similar length decode together
        (`length_buckets`); each such call is seeded with the seed of its first row in the given order (the hf loop
        samples a batch from one generator), so one call is seeded with `seeds[0]`."""
        from rollout.multiturn import Completion
        tok, out = self.tokenizer, [None] * len(prompt_ids)
        for rows in length_buckets([len(p) for p in prompt_ids], self.length_buckets):
            ids, mask = pad_token_rows([prompt_ids[i] for i in rows], tok.pad_token_id, "left")
            torch.manual_seed(seeds[rows[0]] % (1 << 63) if seeds else 0)
            resp, logp, lengths, _, ended = self._decode(ids.to(self.device), mask.to(self.device), sampling)
            for j, (i, n) in enumerate(zip(rows, lengths)):
                out[i] = Completion(resp[j, :int(n)].tolist(), logp[j, :int(n)].tolist(), bool(ended[j]))
        return out

    def _exit_kwargs(self, sp: SamplingParams) -> dict[str, int]:
        """Forward keywords for `exit_at_step` (looped models read out after that loop)."""
        if sp.exit_at_step is None:
            return {}
        if not hasattr(self.model, "loop_states"):
            raise ValueError("SamplingParams.exit_at_step needs a looped model (model_type ouro)")
        return {"exit_at_step": sp.exit_at_step}

    @property
    def is_diffusion(self) -> bool:
        return getattr(self.model.config, "model_type", "") == "llada"

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, sp: SamplingParams) -> tuple[torch.Tensor, ...]:
        """The project's decode loop (`rollout.decoding`) with the chosen method's hooks (`plain` for none); for a
        masked-diffusion model its sampler (decoding `diffusion`, the default there)."""
        from rollout.decoding import decode
        tok = self.tokenizer
        name = sp.decoding or ("diffusion" if self.is_diffusion else "plain")
        method = self.decoding_method(name, sp.decoding_params)
        if getattr(method, "diffusion", False) != self.is_diffusion:
            raise ValueError(f"decoding {name!r}: " + ("a masked-diffusion model (model_type llada) samples with "
                             "decoding 'diffusion'" if self.is_diffusion else "it samples masked-diffusion models "
                             "(model_type llada); this model is causal"))
        if self.is_diffusion:
            return self._diffuse(method, ids, mask, sp)
        # weights swapped in flight are read from the model's own tensors: no packed copy made for the whole loop
        in_flight = getattr(self, "between_steps", None)
        with self.kv_buffers.claim() if self.kv_buffers is not None else nullcontext() as buffers:
            return decode(self.model, ids, mask, max_new_tokens=sp.max_new_tokens, temperature=sp.temperature,
                          top_k=sp.top_k, top_p=sp.top_p, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          method=method, tokenizer=tok, stop=sp.stop, forward_kwargs=self._exit_kwargs(sp),
                          fused_attention=self.fused_decode_attention,
                          packed_weights=self.packed_linear_weights and in_flight is None,
                          kv_buffers=buffers, repetition_penalty=sp.repetition_penalty, between_steps=in_flight,
                          compiled=self.compiled_decode, fp32_packing=self.fp32_packing)

    def _diffuse(self, method: Any, ids: torch.Tensor, mask: torch.Tensor, sp: SamplingParams
                 ) -> tuple[torch.Tensor, ...]:
        """`_decode`'s outputs for a masked-diffusion model: the response ends after its first EOS (LLaDA fills
        the rest of the canvas with EOS); stop strings and top-k/top-p do not apply to parallel unmasking."""
        if sp.top_k > 0 or sp.top_p < 1.0 or sp.stop or sp.repetition_penalty != 1.0:
            raise ValueError("masked-diffusion sampling takes temperature only: set rollout top_k 0, top_p 1.0, "
                             "repetition_penalty 1.0 and no stop strings")
        out = method.sample(self.model, ids, mask, max_new_tokens=sp.max_new_tokens, temperature=sp.temperature,
                            mask_id=self.model.config.mask_token_id)
        resp = out.tokens.cpu()
        eos = resp == self.tokenizer.eos_token_id
        ended = eos.any(1)
        lengths = torch.where(ended, eos.float().argmax(1) + 1, torch.full_like(ended, resp.shape[1], dtype=torch.long))
        keep = torch.arange(resp.shape[1])[None] < lengths[:, None]
        resp = resp.masked_fill(~keep, self.tokenizer.pad_token_id)
        self._commits = ([[[e["step"], p, t, c] for e in out.log for r, p, t, c in e.get("committed", []) if r == row]
                          for row in range(len(resp))] if out.log else None)
        return resp, out.logp.cpu() * keep, lengths, torch.zeros_like(resp, dtype=torch.bool), ended

    def _decode_chunk(self, enc: dict[str, torch.Tensor], prompts: list[str], sp: SamplingParams) -> Batch:
        tok = self.tokenizer
        t0 = time.perf_counter()
        resp, logp, lengths, inserted, ended = self._decode(enc["input_ids"], enc["attention_mask"], sp)
        gen_s = time.perf_counter() - t0
        L = resp.shape[1]
        attn = (torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)).long()
        texts = tok.batch_decode([r[: int(n)] for r, n in zip(resp, lengths)], skip_special_tokens=True)
        batch = Batch(prompt_ids=enc["input_ids"].cpu(), prompt_mask=enc["attention_mask"].cpu(), response_ids=resp,
                      response_mask=attn.float(), response_attn=attn, group_id=torch.zeros(len(prompts), dtype=torch.long),
                      rollout_logp=logp, truncated=~ended, responses=texts,
                      observation_mask=inserted if bool(inserted.any()) else None,
                      metadata=[{"gen_s": gen_s / len(prompts)} for _ in prompts])
        commits, self._commits = getattr(self, "_commits", None), None  # (engines built around a model skip __init__)
        if commits is not None:  # the diffusion sampler's per-step commits, when its commit_log is on
            batch.set_extra("diffusion_commits", commits)
        return batch  # inserted tokens are context (observation_mask), never trained on

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Copy new weights in place (all parameters and buffers by name; unknown names are an error); an
        adapted engine takes the adapter's tensors (`models.adapters.adapter_state_dict` names)."""
        if self.adapted:
            from models.adapters import load_adapter_state
            load_adapter_state(self.model, named_tensors)
            return
        state = self.model.state_dict()
        unknown = [k for k in named_tensors if k not in state]
        if unknown:
            raise KeyError(f"load_weights: names not in the rollout model: {unknown[:5]}")
        with torch.no_grad():
            for k, v in named_tensors.items():
                state[k].copy_(v.to(state[k].dtype))

    def sleep(self) -> None:
        """Free the GPU while the colocated learner trains: the model waits in host memory (on CPU: the KV cache's
        kept storage is freed)."""
        if self.kv_buffers is not None:
            self.kv_buffers.clear()
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake(self, tags: list[str] | None = None) -> None:
        """Back on the GPU; `tags` as vLLM's (`weights`, `kv_cache`): the hf engine has only weights."""
        if self.device.type == "cuda" and (tags is None or "weights" in tags):
            self.model.to(self.device)
