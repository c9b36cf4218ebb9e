"""Tiny tokenizers and models built in code, so nothing is downloaded in tests or the quickstart.

`build_tiny_tokenizer()` is a character-level tokenizer (the `tokenizers` library's WordLevel
model over single characters) wrapped in `PreTrainedTokenizerFast`, with pad/eos/bos set, left
padding for generation and a chat template (assistant turns end with EOS; system, user and tool turns are
all input after `<|user|>`). `build_tiny_model()` is a small `LlamaForCausalLM`.
`save_tiny(dir)` writes both in HF format, loadable with `from_pretrained`.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|user|>", "<|assistant|>"]
CHARACTERS = string.digits + string.ascii_letters + " \n+-*/=,.:;!?()[]{}\\<>_^'\"#%&|$@~"
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] != 'assistant' %}<|user|>{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}<eos>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_tokenizer(added_tokens: list[str] | None = None, mask_token: bool = False) -> PreTrainedTokenizerFast:
    """Character-level fast tokenizer: one id per character, unknown characters map to <unk>. `added_tokens`
    are whole strings with an id each (matched in the text before it is split into characters), so a task
    whose texts repeat fixed phrases reads them as one token each. `mask_token`: also the masked-diffusion
    mask token (`models.diffusion.MASK_TOKEN`, the tokenizer's `mask_token`), after every other id."""
    from tokenizers import AddedToken
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Special tokens are matched first; everything else is split into single characters.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    phrases = [t for t in dict.fromkeys(added_tokens or []) if len(t) > 1]
    if phrases:
        tok.add_tokens([AddedToken(t, normalized=False, single_word=False) for t in phrases])
    extra = {}
    if mask_token:
        from models.diffusion import MASK_TOKEN
        tok.add_special_tokens([MASK_TOKEN])
        extra["mask_token"] = MASK_TOKEN
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", padding_side="left", **extra)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, hidden_size: int = 128, num_layers: int = 3,
                     num_heads: int = 4, intermediate_size: int = 256, max_position_embeddings: int = 128,
                     seed: int = 0, norm_placement: str = "prenorm") -> LlamaForCausalLM:
    """A small Llama-style causal LM (RoPE, SwiGLU, RMSNorm), seeded, untied embeddings. `norm_placement`:
    prenorm (Llama's) | simplenorm (SimpleGPT, `models/simplegpt.py`: a norm after every block linear, no pre-norms)."""
    from models.simplegpt import NORM_PLACEMENTS, SimpleGPTConfig, SimpleGPTForCausalLM
    if norm_placement not in NORM_PLACEMENTS:
        raise ValueError(f"model.tiny.norm_placement must be one of {NORM_PLACEMENTS}, got {norm_placement!r}")
    config = (LlamaConfig if norm_placement == "prenorm" else SimpleGPTConfig)(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = (LlamaForCausalLM if norm_placement == "prenorm" else SimpleGPTForCausalLM)(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=tokenizer.bos_token_id)
    return model


def save_tiny(out_dir: str | Path, seed: int = 0, arch: str = "llama", loops: int = 4,
              added_tokens: list[str] | None = None, norm_placement: str = "prenorm", **model_kwargs: int) -> Path:
    """Build the tiny tokenizer (with `added_tokens`) and model (`arch` llama; ouro: a looped model with `loops`
    passes; llada: a masked-diffusion model, its tokenizer with the mask token; `norm_placement` simplenorm:
    SimpleGPT's blocks on arch llama) and `save_pretrained` both into
    `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(added_tokens, mask_token=arch == "llada")
    if norm_placement != "prenorm" and arch != "llama":
        raise ValueError(f"model.tiny.norm_placement={norm_placement!r} applies to arch llama, not {arch!r}")
    if arch == "llada":
        from models.diffusion import build_tiny_llada
        model = build_tiny_llada(tok, seed=seed, **model_kwargs)
    elif arch == "ouro":
        from models.ouro import build_tiny_ouro
        model = build_tiny_ouro(tok, seed=seed, total_ut_steps=loops, **model_kwargs)
    elif arch == "llama":
        model = build_tiny_model(tok, seed=seed, norm_placement=norm_placement, **model_kwargs)
    else:
        raise ValueError(f"model.tiny.arch must be llama, ouro or llada, got {arch!r}")
    tok.save_pretrained(out)
    model.save_pretrained(out)
    return out
