"""SFT on a user's own data: chat rows rendered with the chat template and trained on assistant tokens only,
prompt/response rows, bad rows named or dropped, packing without cross-contamination."""

import json

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from cluster.pipeline import split_held_out
from models.families import CausalFamily
from models.tiny import build_tiny_model, build_tiny_tokenizer
from rl.batch import batch_of_examples
from rl.config import ConfigError, DataConfig, SFTConfig
from rl.sft_data import (
    chat_example,
    load_sft_rows,
    make_sft_batch,
    prompt_response_example,
    sft_examples,
    tokenize_sft_rows,
)

TOK = build_tiny_tokenizer()
CHAT = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6."}]


def _kw(**over):
    kw = {"source": "data.sft_path 'f.jsonl'", "messages_column": "messages", "prompt_column": "prompt",
          "target_column": "target"}
    return {**kw, **over}


def test_multi_turn_loss_covers_exactly_the_assistant_turns():
    ex = chat_example(TOK, CHAT)
    # the tiny template: <|user|>content ... <|assistant|>content<eos>
    assert TOK.decode(ex.prompt_ids) == "<|user|>2+2?<|assistant|>"
    trained = [t for t, m in zip(ex.response_ids, ex.loss_mask) if m]
    read = [t for t, m in zip(ex.response_ids, ex.loss_mask) if not m]
    assert TOK.decode(trained) == "4<eos>6.<eos>"
    assert TOK.decode(read) == "<|user|>and 3+3?<|assistant|>"
    assert TOK.decode(ex.prompt_ids + ex.response_ids) == TOK.apply_chat_template(CHAT, tokenize=False)
    # a system turn is input: part of the prompt
    sys_ex = chat_example(TOK, [{"role": "system", "content": "be brief"}, *CHAT])
    assert TOK.decode(sys_ex.prompt_ids) == "<|user|>be brief<|user|>2+2?<|assistant|>"
    assert sys_ex.response_ids == ex.response_ids and sys_ex.loss_mask == ex.loss_mask
    # a trailing user turn carries no loss: it is left out
    assert chat_example(TOK, [*CHAT, {"role": "user", "content": "thanks"}]) == ex


def test_prompt_response_rows_keep_the_batch_layout_of_the_warm_up():
    ex = prompt_response_example(TOK, "12+3=", "15")
    assert TOK.decode(ex.prompt_ids) == "12+3=" and TOK.decode(ex.response_ids) == "15<eos>"
    assert ex.loss_mask == [1, 1, 1]
    b = make_sft_batch(TOK, ["12+3=", "7="], ["15", "7"])
    assert b.prompt_ids[1].tolist()[:3] == [TOK.pad_token_id] * 3 and b.prompt_mask[1].tolist() == [0, 0, 0, 1, 1]
    assert b.response_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    # a chat example's read-only tokens are attended but carry no loss
    c = batch_of_examples([chat_example(TOK, CHAT)], TOK.pad_token_id)
    assert c.response_attn.sum() > c.response_mask.sum() > 0


@pytest.mark.parametrize("row, expected", [
    ({"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}, "row 2: message 0 has no role"),
    ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "x"}]},
     r"row 2: message 0 \(user\) has empty content"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "row 2: message 0 has role 'bot'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "row 2: has no assistant message"),
    ({"messages": []}, "row 2: must be a non-empty list"),
])
def test_a_bad_chat_row_is_named_or_dropped_and_counted(row, expected):
    rows = [{"messages": CHAT}, row, {"messages": CHAT}]
    with pytest.raises(ConfigError, match=r"data.sft_path 'f.jsonl' " + expected):
        tokenize_sft_rows(TOK, rows, **_kw())
    examples, dropped = tokenize_sft_rows(TOK, rows, **_kw(bad_rows="drop"))
    assert len(examples) == 2 and sum(dropped.values()) == 1


def test_over_long_rows_and_empty_files_are_reported():
    n = len(chat_example(TOK, CHAT))
    with pytest.raises(ConfigError, match=f"row 1: is {n} tokens after templating, over sft.max_length {n - 1}"):
        tokenize_sft_rows(TOK, [{"messages": CHAT}], **_kw(max_length=n - 1))
    assert len(tokenize_sft_rows(TOK, [{"messages": CHAT}], **_kw(max_length=n))[0]) == 1
    with pytest.raises(ConfigError, match=r"no usable row \({'too_long': 1} dropped\)"):
        tokenize_sft_rows(TOK, [{"messages": CHAT}], **_kw(max_length=3, bad_rows="drop"))
    rows = [{"prompt": "q", "target": ""}]
    with pytest.raises(ConfigError, match="row 1: has an empty 'prompt' or 'target'"):
        tokenize_sft_rows(TOK, rows, **_kw(messages_column=None))


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_row():
    """Like templates that strip the reasoning of earlier assistant turns: the assistant tokens of an early turn
    are not where its own rendering put them."""
    tok = build_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
                         "{% elif loop.last %}<|assistant|>{{ m['content'] }}<eos>"
                         "{% else %}<|assistant|>{{ m['content'][:1] }}<eos>{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "long answer"},
                          {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]}]
    with pytest.raises(ConfigError, match="row 1: the chat template renders turn 1 differently"):
        tokenize_sft_rows(tok, rows, **_kw())


def test_row_formats_are_read_from_jsonl_parquet_and_csv(tmp_path):
    sft, data = OmegaConf.structured(SFTConfig), OmegaConf.structured(DataConfig)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": CHAT, "id": i}) + "\n" for i in range(3)))
    pd.DataFrame({"messages": [CHAT] * 2}).to_parquet(tmp_path / "chat.parquet")
    pd.DataFrame({"prompt": ["1+1=", "2+2="], "target": ["2", "4"]}).to_csv(tmp_path / "pr.csv", index=False)
    for name, n in (("chat.jsonl", 3), ("chat.parquet", 2)):
        rows, column = load_sft_rows(str(tmp_path / name), "data.sft_path", sft, data)
        assert column == "messages" and len(rows) == n and rows[0]["messages"] == CHAT
    examples, dropped = sft_examples(TOK, str(tmp_path / "pr.csv"), "data.sft_path", sft, data)
    assert not dropped and [TOK.decode(e.response_ids) for e in examples] == ["2<eos>", "4<eos>"]
    forced = OmegaConf.merge(sft, {"format": "messages"})
    with pytest.raises(ConfigError, match=r"data.sft_path: dataset .*pr.csv' has no column\(s\) \['messages'\]"):
        load_sft_rows(str(tmp_path / "pr.csv"), "data.sft_path", forced, data)


def test_held_out_split_is_seeded_and_disjoint():
    items = list(range(10))
    train, held = split_held_out(items, 0.2, seed=3)
    assert len(held) == 2 and sorted(train + held) == items
    assert split_held_out(items, 0.2, seed=3) == (train, held) and split_held_out(items, 0.0, 3) == (items, [])
    assert len(split_held_out([1, 2], 0.9, 0)[0]) == 1  # at least one row stays for training


def test_packed_chat_examples_give_the_padded_loss_and_gradients():
    """Sequences packed into one row (positions restart per sequence) see nothing of each other: the NLL over
    assistant tokens and every parameter's gradient equal those of the padded batch."""
    model = build_tiny_model(TOK, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    model.config._attn_implementation = "sdpa"
    convs = [CHAT, CHAT[:2], CHAT[2:]]
    batch = batch_of_examples([chat_example(TOK, c) for c in convs], TOK.pad_token_id)
    fam = CausalFamily()

    def loss_and_grads(pack):
        model.zero_grad()
        logp = fam.forward(model, batch, pack=pack)["logp"]
        loss = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    padded, g_padded = loss_and_grads(False)
    packed, g_packed = loss_and_grads(True)
    assert torch.allclose(packed, padded, atol=1e-6)
    for name, g in g_padded.items():
        assert torch.allclose(g_packed[name], g, atol=1e-6, rtol=1e-4), name


@pytest.mark.slow
def test_chat_sft_stage_on_a_user_file_logs_held_out_loss_and_resumes_exactly(ray_cluster, tmp_path):
    """Through Ray and the DeepSpeed learner: a user's chat JSONL (one bad row, dropped and counted), a held-out
    share, token-budget micro-batches, a checkpoint at step 2; a run stopped after that checkpoint and resumed
    with `resume=auto` logs exactly the losses of the uninterrupted run."""
    import random

    from cluster.pipeline import run
    from rl import config
    from rl.tasks.arithmetic import chat_rows, make_problem
    from tests.cluster.test_pipeline import ROOT, TINY
    rng = random.Random(0)
    rows = chat_rows([make_problem(rng) for _ in range(40)], rng, wrong_order_fraction=0.0)
    rows.insert(3, {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": ""}]})
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = [f"output_dir={out}", *TINY, "model.tiny.max_position_embeddings=256", f"data.sft_path={data}",
            "sft.epochs=0", "sft.steps=4", "sft.batch_size=8", "sft.warmup_steps=1", "sft.save_every=2",
            "sft.eval_fraction=0.2", "sft.eval_every=2", "learner.max_tokens_per_micro_batch=300",
            "stages=[{name: model}, {name: data}, {name: sft}]"]
    summary = run(config.load(ROOT / "recipes/sft_chat_tiny.yaml", args))
    assert summary["sft_dropped_rows"] == {"empty_content": 1}
    assert summary["sft_rows"] + summary["sft_eval_rows"] == len(rows) - 1 and summary["sft_eval_rows"] >= 4
    full = [json.loads(x) for x in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in full] == [1, 2, 3, 4] and "sft/eval_loss" in full[1] and "sft/eval_loss" in full[3]
    assert full[3]["sft/eval_loss"] < full[1]["sft/eval_loss"] and summary["sft_eval_loss"] == full[3]["sft/eval_loss"]
    assert (out / "sft_checkpoints" / "step_2" / "COMPLETE").exists() and (out / "sft_model").is_dir()
    # stopped after the step-2 checkpoint: the stage never completed
    (out / "stages" / "sft.json").unlink()
    resumed = run(config.load(ROOT / "recipes/sft_chat_tiny.yaml", [*args, "resume=auto"]))
    again = [json.loads(x) for x in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in again] == [1, 2, 3, 4] and resumed["stages"]["data"]["reused"]
    for a, b in zip(full, again):
        assert a.keys() == b.keys()
        for key in {"sft/loss", "sft/grad_norm", "sft/lr", "sft/eval_loss"} & a.keys():
            assert a[key] == pytest.approx(b[key], rel=1e-6), (a["step"], key)
    # a changed recipe does not continue another stage's checkpoint
    changed = run(config.load(ROOT / "recipes/sft_chat_tiny.yaml", [*args, "resume=auto", "sft.lr=1e-3"]))
    assert not changed["stages"]["sft"]["reused"] and changed["sft_final_loss"] != summary["sft_final_loss"]
