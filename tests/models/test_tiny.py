import torch
from transformers import AutoModelForCausalLM

from models.tiny import build_tiny_tokenizer, save_tiny
from models.tokenizer import load_tokenizer


def test_tokenizer_is_character_level_and_roundtrips():
    tok = build_tiny_tokenizer()
    text = "12+34*5=170,12+170=182\\boxed{182}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.padding_side == "left" and tok.pad_token_id != tok.eos_token_id


def test_save_and_reload_offline(tmp_path):
    path = save_tiny(tmp_path / "m", seed=3, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = load_tokenizer(str(path))
    assert tok("7+8=", add_special_tokens=False)["input_ids"] == build_tiny_tokenizer()("7+8=")["input_ids"]
    again = save_tiny(tmp_path / "m2", seed=3, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    other = AutoModelForCausalLM.from_pretrained(again)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)  # seeded: the same tiny model every time


def test_added_tokens_are_whole_phrases_and_decode_back():
    from models.tiny import build_tiny_tokenizer
    phrases = ["Take the center first, then the corners.", "Observation: "]
    tok = build_tiny_tokenizer(phrases)
    text = "Observation: x | Take the center first, then the corners. \\boxed{4}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[0] == "Observation: " and "Take the center first, then the corners." in pieces
    assert len(ids) == len(text) - sum(len(p) - 1 for p in phrases) and tok.decode(ids) == text
    assert len(tok) == len(build_tiny_tokenizer()) + 2


def test_the_model_stage_adds_the_synthetic_tasks_phrases(tmp_path):
    from pathlib import Path

    from cluster.pipeline import prepare_model
    from models.tokenizer import load_tokenizer
    from rl import config
    from rl.methods.memo.task import harness_tokens
    root = Path(__file__).resolve().parents[2]
    cfg = config.load(root / "recipes/memo_tiny.yaml", [f"output_dir={tmp_path}"])
    tok = load_tokenizer(prepare_model(cfg, tmp_path))
    assert len(tok) == 101 + len(harness_tokens())
    hint = "Play the edges first, then the rest."
    assert tok.convert_ids_to_tokens(tok(hint, add_special_tokens=False)["input_ids"]) == [hint]


def test_kv_bytes_per_token_by_hand():
    from transformers import LlamaConfig

    from models.common import kv_bytes_per_token
    from models.ouro import build_tiny_ouro
    # 2 layers x (keys + values) x 2 key/value heads x head_dim 64/4 = 16, in bf16: 2 * 2 * 2 * 16 * 2 = 256 bytes
    gqa = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    assert kv_bytes_per_token(gqa, 2) == 256
    # a looped model caches every loop: 1 layer x 3 loops x 2 x 2 heads x 16 in fp32 = 768 bytes
    ouro = build_tiny_ouro(build_tiny_tokenizer(), hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                           total_ut_steps=3)
    assert kv_bytes_per_token(ouro.config, 4) == 1 * 3 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(object(), 4) == 0.0
