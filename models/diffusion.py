"""Masked-diffusion language models in the public LLaDA layout (`model_type: llada`), in transformers form.

A bidirectional Llama-style transformer (RoPE, SwiGLU, RMSNorm, no causal mask) that predicts, at every position,
the clean token behind a mask token. Config fields and parameter names follow the public LLaDA-8B checkpoints
(`GSAI-ML/LLaDA-8B-Base`, an OLMo-derived layout): `model.transformer.wte`, `model.transformer.blocks.{i}` with
`attn_norm`, `q_proj`, `k_proj`, `v_proj`, `attn_out`, `ff_norm`, `ff_proj` (the SiLU gate), `up_proj`, `ff_out`,
then `model.transformer.ln_f` and the untied output `model.transformer.ff_out`; so `from_pretrained` reads a LLaDA
checkpoint with this class and no remote code. Only the settings LLaDA ships are implemented (block_type llama,
RMS norms, SiLU, RoPE); others are refused with the config field named.

Training objective (MDLM / LLaDA): per sequence a mask rate t ~ U(0, 1) (p = (1 − ε)t + ε), each response token
masked with probability p, and the loss −Σ_masked log p_θ(x_i | x_t) / p, normalised by token count
(`masked_token_logp` gives the per-token terms; the `masked_diffusion` family in `models.families` feeds them to
the learner's token-mean loss). Sampling (`diffusion_generate`): LLaDA's semi-autoregressive blocks with
low-confidence (or random) remasking.

Importing this module registers the model with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM` (as the
public checkpoint's `auto_map` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput

from models.common import init_weights

MASK_TOKEN = "<|mdm_mask|>"  # the mask token's text in LLaDA's tokenizer (id 126336 there)


class LLaDAConfig(PretrainedConfig):
    """The public LLaDA config fields (OLMo names). `hidden_size`, `num_attention_heads`, `num_hidden_layers`
    and `max_position_embeddings` are aliases transformers' utilities read."""

    model_type = "llada"
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
                     "max_position_embeddings": "max_sequence_length"}

    def __init__(self, d_model: int = 4096, n_heads: int = 32, n_kv_heads: int | None = None, n_layers: int = 32,
                 mlp_ratio: int = 4, mlp_hidden_size: int | None = None, vocab_size: int = 126464,
                 embedding_size: int | None = None, max_sequence_length: int = 4096, rope: bool = True,
                 rope_theta: float = 10000.0, rms_norm_eps: float = 1e-5, mask_token_id: int = 126336,
                 weight_tying: bool = False, include_bias: bool = False, include_qkv_bias: bool = False,
                 block_type: str = "llama", layer_norm_type: str = "rms", activation_type: str = "silu",
                 alibi: bool = False, input_emb_norm: bool = False, scale_logits: bool = False,
                 block_group_size: int = 1, init_std: float = 0.02, pad_token_id: int | None = None,
                 eos_token_id: int | None = None, bos_token_id: int | None = None, **kwargs):
        self.d_model, self.n_heads, self.n_layers = d_model, n_heads, n_layers
        self.n_kv_heads = n_kv_heads or n_heads
        self.mlp_ratio, self.mlp_hidden_size = mlp_ratio, mlp_hidden_size
        self.vocab_size, self.embedding_size = vocab_size, embedding_size
        self.max_sequence_length = max_sequence_length
        self.rope, self.rope_theta, self.rms_norm_eps = rope, rope_theta, rms_norm_eps
        self.mask_token_id = mask_token_id
        self.weight_tying, self.include_bias, self.include_qkv_bias = weight_tying, include_bias, include_qkv_bias
        self.block_type, self.layer_norm_type, self.activation_type = block_type, layer_norm_type, activation_type
        self.alibi, self.input_emb_norm, self.scale_logits = alibi, input_emb_norm, scale_logits
        self.block_group_size, self.init_std = block_group_size, init_std
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=bos_token_id,
                         tie_word_embeddings=weight_tying, **kwargs)

    @property
    def ff_hidden_size(self) -> int:
        return self.mlp_hidden_size if self.mlp_hidden_size is not None else self.mlp_ratio * self.d_model

    def check_supported(self) -> None:
        """Refuse LLaDA/OLMo settings this implementation does not have, naming the field."""
        wanted = {"block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu", "rope": True,
                  "alibi": False, "input_emb_norm": False, "scale_logits": False, "block_group_size": 1}
        for key, value in wanted.items():
            if getattr(self, key) != value:
                raise ValueError(f"llada config {key}={getattr(self, key)!r}: only {value!r} is supported "
                                 f"(the setting LLaDA ships)")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"llada config: d_model {self.d_model} must split into n_heads {self.n_heads}, and "
                             f"n_heads into n_kv_heads {self.n_kv_heads}")


class RMSLayerNorm(nn.Module):
    """RMS norm computed in float32, scaled by a learned weight (OLMo's `RMSLayerNorm` with affine, no bias)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, theta: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on `[B, H, S, D]` queries and keys at `position_ids [B, S]` (half-split rotation, computed in float32;
    the inverse frequencies are computed per call: `from_pretrained` builds on the meta device)."""
    dim = q.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=q.device, dtype=torch.float32) / dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, D]
    cos, sin = emb.cos(), emb.sin()
    rot = [(t.float() * cos + _rotate_half(t.float()) * sin).to(t.dtype) for t in (q, k)]
    return rot[0], rot[1]


class LLaDALlamaBlock(nn.Module):
    """`x + attn(attn_norm(x))`, then `+ ff_out(silu(ff_proj(h)) * up_proj(h))` with `h = ff_norm(x)`;
    attention is bidirectional (padding keys are masked out, nothing else)."""

    def __init__(self, config: LLaDAConfig):
        super().__init__()
        d, heads, kv = config.d_model, config.n_heads, config.n_kv_heads
        self.n_heads, self.n_kv, self.head_dim, self.theta = heads, kv, d // heads, config.rope_theta
        qkv_bias = config.include_bias or config.include_qkv_bias
        self.attn_norm = RMSLayerNorm(d, config.rms_norm_eps)
        self.ff_norm = RMSLayerNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv * self.head_dim, bias=qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=config.include_bias)
        self.ff_proj = nn.Linear(d, config.ff_hidden_size, bias=config.include_bias)
        self.up_proj = nn.Linear(d, config.ff_hidden_size, bias=config.include_bias)
        self.ff_out = nn.Linear(config.ff_hidden_size, d, bias=config.include_bias)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rotary(q, k, position_ids, self.theta)
        if self.n_kv != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=False)
        x = x + self.attn_out(att.transpose(1, 2).reshape(b, s, -1))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class LLaDAModel(nn.Module):
    """The decoder stack under the checkpoint's `model.transformer.*` names; returns the final-normed states."""

    def __init__(self, config: LLaDAConfig):
        super().__init__()
        vocab = config.embedding_size or config.vocab_size
        parts = {"wte": nn.Embedding(vocab, config.d_model),
                 "blocks": nn.ModuleList(LLaDALlamaBlock(config) for _ in range(config.n_layers)),
                 "ln_f": RMSLayerNorm(config.d_model, config.rms_norm_eps)}
        if not config.weight_tying:
            parts["ff_out"] = nn.Linear(config.d_model, vocab, bias=config.include_bias)
        self.transformer = nn.ModuleDict(parts)
        self.gradient_checkpointing = False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, output_hidden_states: bool = False) -> BaseModelOutput:
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = ((attention_mask.long().cumsum(-1) - 1).clamp(min=0) if attention_mask is not None
                            else torch.arange(s, device=input_ids.device)[None].expand(b, s))
        # padding keys masked out; a row of all-padding keys cannot occur (every row has its own tokens)
        key_mask = attention_mask.bool()[:, None, None, :] if attention_mask is not None else None
        x = self.transformer["wte"](input_ids)
        states = [x] if output_hidden_states else None
        for block in self.transformer["blocks"]:
            if self.gradient_checkpointing and self.training:
                x = self._gradient_checkpointing_func(block.__call__, x, position_ids, key_mask)
            else:
                x = block(x, position_ids, key_mask)
            if states is not None:
                states.append(x)
        x = self.transformer["ln_f"](x)
        return BaseModelOutput(last_hidden_state=x, hidden_states=tuple(states) if states is not None else None)


class LLaDAModelLM(PreTrainedModel):
    """The public checkpoint's `LLaDAModelLM`: `model` (an `LLaDAModel`) and its logits at every position.
    No KV cache: every denoising step attends to the whole sequence."""

    config_class = LLaDAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDALlamaBlock"]
    _supports_sdpa = True

    def __init__(self, config: LLaDAConfig):
        config.check_supported()
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.config.init_std, (RMSLayerNorm,))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.transformer["wte"]

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.transformer["wte"] = value

    def get_output_embeddings(self) -> nn.Module:
        return self.model.transformer["ff_out"] if "ff_out" in self.model.transformer else self.model.transformer["wte"]

    def get_decoder(self) -> LLaDAModel:
        return self.model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                logits_to_keep: int | torch.Tensor = 0, output_hidden_states: bool | None = None,
                **_unused) -> MaskedLMOutput:
        """Logits at every position (`logits_to_keep`: the last k positions, or those an index tensor names).
        With `labels` (-100 where not scored), the loss is the mean cross entropy at the scored positions (a
        plain masked-LM loss; the MDLM weighting is the family's, `masked_token_logp`)."""
        out = self.model(input_ids, attention_mask, position_ids, bool(output_hidden_states))
        h = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        head = self.get_output_embeddings()
        logits = F.linear(h[:, keep], head.weight) if isinstance(head, nn.Embedding) else head(h[:, keep])
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels[:, keep].flatten(), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


def mask_for_training(response_attn: torch.Tensor, seeds: torch.Tensor, eps: float = 1e-3
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """MDLM forward noise for each row of a `[N, L]` response: t ~ U(0, 1) and p = (1 − eps)·t + eps, then each real
    response token (`response_attn`) masked with probability p. Every row draws from its own generator seeded by
    `seeds[i]`, so a row is noised the same whichever rank or micro-batch it lands in. Returns the `[N, L]` bool
    mask and the `[N]` rates p."""
    masks, rates = [], []
    for i in range(response_attn.shape[0]):
        g = torch.Generator().manual_seed(int(seeds[i]))
        p = (1 - eps) * float(torch.rand(1, generator=g)) + eps
        masks.append(torch.rand(response_attn.shape[1], generator=g) < p)
        rates.append(p)
    mask = torch.stack(masks).to(response_attn.device) & response_attn.bool()
    return mask, torch.tensor(rates, dtype=torch.float32, device=response_attn.device)


def num_transfer_tokens(masked: torch.Tensor, steps: int) -> torch.Tensor:
    """How many tokens each of `steps` steps commits, per row, for `masked [B]` masked tokens in a block: an even
    split with the remainder going to the first steps (LLaDA's schedule for its linear noise)."""
    base, rest = masked // steps, masked % steps
    out = base[:, None].repeat(1, steps)
    out += (torch.arange(steps, device=masked.device)[None] < rest[:, None]).long()
    return out


@dataclass
class DiffusionOutput:
    """`tokens [B, G]` the generated tokens; `logp [B, G]` each token's log-probability under the (tempered)
    distribution it was committed from; `commit_step [B, G]` the step that last committed it; `forwards` the model
    calls made (denoising steps plus remasking probes); `log` per step `{step, block, committed: [[row, position,
    token, confidence], ...]}` and per probe `{step, probe: policy, remasked: [[row, position, token, score], ...]}`
    when asked; `remasked` the number of tokens sent back to the mask."""
    tokens: torch.Tensor
    logp: torch.Tensor
    commit_step: torch.Tensor
    forwards: int
    log: list[dict] = field(default_factory=list)
    remasked: int = 0


@dataclass
class Remasking:
    """Revision of committed tokens during sampling (CORE and its controls, rl/methods/core/README.md).

    `policy`: none | core | random | low_margin. At `probes` steps spread evenly over the run (step ⌊(i + 1)·T /
    (probes + 1)⌋ − 1, after its commits), the candidates are the committed tokens of the current and the previous
    block, prefiltered to the `candidates` of lowest margin at commit time (p(x) − max_{v≠x} p(v)); `m` of them go
    back to the mask and are committed again by the schedule (the next step commits `m` more, so the step count stays
    T). `core`: one extra forward with all candidates jointly masked (and a random `perturb_frac` of the other
    committed response tokens); the instability u_i = log p(x_i | S) − log p(x_i | S, candidates masked); the top-m
    by u are remasked. `score` says what log p(x_i | S) is: `state` (the spec) reads it in the current state S, from
    the step's own forward (no extra forward: x_i is visible there unless this step committed it); `commit` (a
    reconstruction kept as an option) takes the log-probability x_i was committed with, when it was masked and
    predicted (a masked-diffusion model is trained on masked positions only, so its output at a visible one is
    untrained). `random`: m random candidates; `low_margin`: the m of lowest margin; neither spends a forward.
    [RECONSTRUCTION]: the probe schedule, the candidate prefilter, the budget rule, and `commit`."""
    policy: str = "none"
    probes: int = 0
    candidates: int = 16
    m: int = 2
    perturb_frac: float = 0.0
    score: str = "state"

    def __post_init__(self):
        if self.policy not in ("none", "core", "random", "low_margin"):
            raise ValueError(f"remasking policy must be none, core, random or low_margin, got {self.policy!r}")
        if self.score not in ("state", "commit"):
            raise ValueError(f"remasking score must be state or commit, got {self.score!r}")
        if self.probes < 0 or self.m < 1 or self.candidates < 1 or not 0 <= self.perturb_frac < 1:
            raise ValueError(f"remasking: probes >= 0, m >= 1, candidates >= 1, 0 <= perturb_frac < 1 "
                             f"(got {self.probes}, {self.m}, {self.candidates}, {self.perturb_frac})")

    def probe_steps(self, steps: int, per_block: int | None = None) -> set[int]:
        """The steps after which a probe runs: `probes` evenly spaced over `steps`. A probe needs steps left in its
        block to refill what it remasks, so one that would fall on a block's last step (blocks of `per_block`
        steps) runs a step earlier; with one step per block no probe can run, and that is refused."""
        if self.policy == "none" or self.probes == 0:
            return set()
        per_block = per_block or steps
        if per_block < 2:
            raise ValueError(f"remasking: {self.probes} probes need at least 2 denoising steps per block to refill "
                             f"what they remask; this schedule has {per_block}")
        at = set()
        for i in range(self.probes):
            t = (i + 1) * steps // (self.probes + 1) - 1
            at.add(t - 1 if t % per_block == per_block - 1 else t)
        if len(at) < self.probes:
            raise ValueError(f"remasking: {self.probes} probes do not fit on distinct steps of {steps} that leave "
                             f"room in their blocks of {per_block}: use fewer probes or more steps")
        return at


def _margin(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """p(token) − the largest other probability, per position."""
    chosen = probs.gather(-1, tokens[..., None]).squeeze(-1)
    other = probs.scatter(-1, tokens[..., None], -1.0).max(-1).values
    return chosen - other


def _check_schedule(gen_length: int, block_length: int, steps: int, remasking: str) -> int:
    """The number of blocks; a schedule that does not divide evenly, or an unknown remasking, is refused."""
    if gen_length % block_length:
        raise ValueError(f"diffusion sampling: gen_length {gen_length} must be a multiple of block_length {block_length}")
    blocks = gen_length // block_length
    if steps % blocks:
        raise ValueError(f"diffusion sampling: steps {steps} must be a multiple of the number of blocks {blocks}")
    if remasking not in ("low_confidence", "random"):
        raise ValueError(f"diffusion sampling: remasking must be low_confidence or random, got {remasking!r}")
    return blocks


def _predict(model: nn.Module, x: torch.Tensor, attn: torch.Tensor, position_ids: torch.Tensor, masked: torch.Tensor,
             hi: int, temperature: float, remasking: str, generator: torch.Generator | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One denoising forward: every position's prediction (greedy at temperature 0, else Gumbel-max of the tempered
    distribution), its log-probability and margin, the confidence that ranks the masked positions up to the
    current block's end `hi` for commitment (-inf elsewhere), and the logits (what a CORE probe reads as the
    current state's support)."""
    logits = model(input_ids=x, attention_mask=attn, position_ids=position_ids).logits.float()
    tempered = logits / temperature if temperature > 0 else logits
    if temperature > 0:
        u = torch.rand(tempered.shape, generator=generator, device=x.device).clamp_(1e-20, 1.0)
        x0 = (tempered - torch.log(-torch.log(u))).argmax(-1)
    else:
        x0 = tempered.argmax(-1)
    logp_all = torch.log_softmax(tempered, -1).gather(-1, x0[..., None]).squeeze(-1)
    probs = torch.softmax(logits, -1)
    if remasking == "low_confidence":
        confidence = probs.gather(-1, x0[..., None]).squeeze(-1)
    else:
        confidence = torch.rand(x0.shape, generator=generator, device=x.device)
    confidence[:, hi:] = -torch.inf  # nothing past the current block
    confidence = torch.where(masked, confidence, torch.full_like(confidence, -torch.inf))
    return x0, logp_all, _margin(probs, x0), confidence, logits


def _remask(events: list, x: torch.Tensor, logp: torch.Tensor, margin: torch.Tensor, commit_step: torch.Tensor,
            debt: torch.Tensor, P: int, mask_id: int) -> None:
    """Send the revised tokens back to the mask; each row's next step commits as many on top of its schedule."""
    for row, pos, *_ in events:
        x[row, pos + P] = mask_id
        logp[row, pos], margin[row, pos], commit_step[row, pos] = 0.0, 0.0, -1
        debt[row] += 1


def diffusion_generate(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, gen_length: int,
                       block_length: int, steps: int, mask_id: int, temperature: float = 0.0,
                       remasking: str = "low_confidence", generator: torch.Generator | None = None,
                       commit_log: bool = False, revise: Remasking | None = None) -> DiffusionOutput:
    """LLaDA's sampler: the response starts as `gen_length` mask tokens after the (left-padded) prompt and is
    decoded in blocks of `block_length`, left to right, with `steps` denoising steps shared equally by the blocks.
    At each step the model predicts every position (greedy at `temperature` 0, else a sample of the tempered
    distribution, Gumbel-max); of the masked positions up to the current block's end the most confident predictions
    are committed (`low_confidence` remasking keeps the rest masked) — or random ones (`random`) — as many as the
    schedule says, and every one left at a block's last step. `revise` sends committed tokens back to the mask at
    its probe steps (`Remasking`: CORE and its controls)."""
    with torch.no_grad():
        return _sample(model, prompt_ids, prompt_mask, gen_length, block_length, steps, mask_id, temperature,
                       remasking, generator, commit_log, revise or Remasking())


def _sample(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen_length: int, block_length: int,
            steps: int, mask_id: int, temperature: float, remasking: str, generator: torch.Generator | None,
            commit_log: bool, revise: Remasking) -> DiffusionOutput:
    """`diffusion_generate`'s loop (a plain function, no decorator, so that mutation testing reaches its lines)."""
    blocks = _check_schedule(gen_length, block_length, steps, remasking)
    per_block = steps // blocks
    probe_at = revise.probe_steps(steps, per_block)
    device = prompt_ids.device
    B, P = prompt_ids.shape
    x = torch.cat([prompt_ids, torch.full((B, gen_length), mask_id, dtype=prompt_ids.dtype, device=device)], 1)
    attn = torch.cat([prompt_mask.long(), torch.ones(B, gen_length, dtype=torch.long, device=device)], 1)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    logp = torch.zeros(B, gen_length, device=device)
    margin = torch.zeros(B, gen_length, device=device)
    commit_step = torch.full((B, gen_length), -1, dtype=torch.long, device=device)
    debt = torch.zeros(B, dtype=torch.long)  # remasked tokens the next step commits on top of the schedule
    log: list[dict] = []
    forwards, step, remasked = 0, 0, 0
    for blk in range(blocks):
        lo, hi = P + blk * block_length, P + (blk + 1) * block_length
        schedule = num_transfer_tokens((x[:, lo:hi] == mask_id).sum(1), per_block)
        for s in range(per_block):
            masked = x == mask_id
            x0, logp_all, margin_all, confidence, logits = _predict(model, x, attn, position_ids, masked, hi,
                                                                    temperature, remasking, generator)
            forwards += 1
            committed = []
            for row in range(B):
                open_ = int(torch.isfinite(confidence[row]).sum())
                k = open_ if s == per_block - 1 else min(open_, int(schedule[row, s]) + int(debt[row]))
                debt[row] = 0
                if k == 0:
                    continue
                pos = torch.topk(confidence[row], k).indices
                x[row, pos] = x0[row, pos]
                logp[row, pos - P], margin[row, pos - P] = logp_all[row, pos], margin_all[row, pos]
                commit_step[row, pos - P] = step
                if commit_log:
                    committed += [[row, int(p) - P, int(x0[row, p]), float(confidence[row, p])] for p in pos]
            if commit_log:
                log.append({"step": step, "block": blk, "committed": committed})
            if step in probe_at:  # never a block's last step (`probe_steps`): steps are left to refill
                events, used = _revise(model, x, attn, position_ids, P, (max(P, lo - block_length), hi), logp,
                                       margin, mask_id, revise, generator, state_logits=logits)
                forwards += used
                _remask(events, x, logp, margin, commit_step, debt, P, mask_id)
                remasked += len(events)
                if commit_log:
                    log.append({"step": step, "probe": revise.policy, "remasked": events})
            step += 1
    return DiffusionOutput(tokens=x[:, P:], logp=logp, commit_step=commit_step, forwards=forwards, log=log,
                           remasked=remasked)


def _revise(model: nn.Module, x: torch.Tensor, attn: torch.Tensor, position_ids: torch.Tensor, P: int,
            window: tuple[int, int], logp: torch.Tensor, margin: torch.Tensor, mask_id: int, revise: Remasking,
            generator: torch.Generator | None, state_logits: torch.Tensor | None = None) -> tuple[list[list], int]:
    """One probe of `revise.policy`: the `[row, position, token, score]` to remask and the forwards spent.
    `state_logits`: the current state's forward (`revise.score: state`)."""
    lo, hi = window
    cands = []
    for row in range(x.shape[0]):
        pos = torch.arange(lo, hi, device=x.device)
        pos = pos[x[row, lo:hi] != mask_id]
        order = torch.argsort(margin[row, pos - P])  # lowest margin first
        cands.append(pos[order[:revise.candidates]])
    if revise.policy == "core":
        perturbed = x.clone()
        for row, pos in enumerate(cands):
            perturbed[row, pos] = mask_id
            if revise.perturb_frac > 0:  # also some other committed response tokens, at random
                others = torch.arange(P, x.shape[1], device=x.device)
                others = others[(x[row, P:] != mask_id) & ~torch.isin(others, pos)]
                pick = torch.rand(len(others), generator=generator, device=x.device) < revise.perturb_frac
                perturbed[row, others[pick]] = mask_id
        with torch.no_grad():
            logits = model(input_ids=perturbed, attention_mask=attn, position_ids=position_ids).logits
        lp = torch.log_softmax(logits.float(), -1)
        used = 1
    else:
        used = 0
    events = []
    for row, pos in enumerate(cands):
        if len(pos) == 0:
            continue
        if revise.policy == "core":
            if revise.score == "state":
                if state_logits is None:
                    raise ValueError("remasking score 'state' needs the current state's logits")
                support = torch.log_softmax(state_logits[row, pos].float(), -1).gather(
                    -1, x[row, pos][:, None]).squeeze(-1)
            else:
                support = logp[row, pos - P]
            score = support - lp[row, pos, x[row, pos]]  # the drop in support without the candidates
            top = torch.topk(score, min(revise.m, len(pos))).indices
        elif revise.policy == "low_margin":
            score = -margin[row, pos - P]
            top = torch.topk(score, min(revise.m, len(pos))).indices
        else:
            score = torch.zeros(len(pos), device=x.device)
            top = torch.randperm(len(pos), generator=generator, device=x.device)[:revise.m]
        events += [[row, int(pos[i]) - P, int(x[row, pos[i]]), float(score[i])] for i in top]
    return events, used


def build_tiny_llada(tokenizer, hidden_size: int = 128, num_layers: int = 3, num_heads: int = 4,
                     intermediate_size: int = 256, max_position_embeddings: int = 128, seed: int = 0) -> LLaDAModelLM:
    """A small seeded masked-diffusion model with the LLaDA field names; `tokenizer` must have the mask token
    (`MASK_TOKEN`, added by `models.tiny.build_tiny_tokenizer(mask_token=True)`)."""
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    if mask_id is None or mask_id == tokenizer.unk_token_id:
        raise ValueError(f"a masked-diffusion model needs the tokenizer's mask token {MASK_TOKEN!r}")
    config = LLaDAConfig(d_model=hidden_size, n_heads=num_heads, n_kv_heads=num_heads, n_layers=num_layers,
                         mlp_hidden_size=intermediate_size, vocab_size=len(tokenizer), embedding_size=len(tokenizer),
                         max_sequence_length=max_position_embeddings, mask_token_id=mask_id,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, architectures=["LLaDAModelLM"])
    torch.manual_seed(seed)
    return LLaDAModelLM(config)


AutoConfig.register("llada", LLaDAConfig, exist_ok=True)
AutoModel.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)
AutoModelForCausalLM.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)
