"""`models.blocks`: the compiled position-wise work of the learner (`compile_position_wise`, `compile_rotary`)."""

import torch

from models.blocks import compile_position_wise, compile_rotary
from models.tiny import build_tiny_model, build_tiny_tokenizer


def test_the_rotary_embedding_is_compiled_once_in_its_modeling_module_with_the_same_outputs(monkeypatch):
    import torch._dynamo.utils as dynamo_utils
    import transformers.models.llama.modeling_llama as llama
    original = llama.apply_rotary_pos_emb
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", original)  # the process-wide patch is undone after the test
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64).eval()
    ids = torch.randint(5, len(tok), (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    assert compile_rotary(model) == ["transformers.models.llama.modeling_llama"]
    patched = llama.apply_rotary_pos_emb
    assert patched is not original and patched.looprl_compiled
    assert compile_rotary(model) == ["transformers.models.llama.modeling_llama"] and llama.apply_rotary_pos_emb is patched
    frames = dynamo_utils.counters["frames"]["ok"]
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert dynamo_utils.counters["frames"]["ok"] > frames  # the forward ran the compiled function
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_position_wise_compilation_covers_every_layers_mlp_and_norms_and_the_rotary(monkeypatch):
    import transformers.models.llama.modeling_llama as llama
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", llama.apply_rotary_pos_emb)
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=3, num_heads=2, intermediate_size=64)
    # mlp, input_layernorm, post_attention_layernorm per layer, and the final norm
    assert compile_position_wise(model) == 3 * 3 + 1
    assert getattr(llama.apply_rotary_pos_emb, "looprl_compiled", False)
