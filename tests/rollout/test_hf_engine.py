import pytest
import torch

from models.families import response_logprobs
from models.tiny import save_tiny
from rollout.base import SamplingParams
from rollout.hf_engine import HFEngine


def test_groups_masks_and_lengths(engine):
    b = engine.generate(["12+3*4=", "5+6*7="], SamplingParams(n=3, max_new_tokens=12, seed=0),
                        group_ids=[10, 11], ground_truth=["24", "47"])
    assert b.group_id.tolist() == [10, 10, 10, 11, 11, 11]
    assert b.ground_truth == ["24"] * 3 + ["47"] * 3
    lengths = b.response_attn.sum(-1)
    eos = engine.tokenizer.eos_token_id
    for i in range(len(b)):
        n = int(lengths[i])
        assert (b.response_ids[i, n:] == engine.tokenizer.pad_token_id).all()
        assert bool(b.truncated[i]) == (eos not in b.response_ids[i, :n].tolist())
        assert b.rollout_logp[i, n:].abs().sum() == 0


def test_rows_keep_their_prompts_metadata_and_the_engines_decode_time(engine):
    """`perf/decode_mfu` divides by the engine's own decode time (`gen_s`, each row its share of its chunk's), which
    must survive the prompt's metadata being attached (the step's generate phase also holds the remote call)."""
    import time
    batch_size, engine.batch_size = engine.batch_size, 4  # two chunks: 4 rows and 2
    try:
        t0 = time.perf_counter()
        b = engine.generate(["12+3*4=", "5+6*7="], SamplingParams(n=3, max_new_tokens=8, seed=0),
                            metadata=[{"row": 7}, {"row": 8}])
        call_s = time.perf_counter() - t0
    finally:
        engine.batch_size = batch_size
    assert [m["row"] for m in b.metadata] == [7, 7, 7, 8, 8, 8]
    assert all(m["gen_s"] > 0 for m in b.metadata)
    assert b.metadata[0]["gen_s"] == b.metadata[3]["gen_s"]  # rows of one chunk share its time equally
    assert b.metadata[4]["gen_s"] == b.metadata[5]["gen_s"]
    assert sum(m["gen_s"] for m in b.metadata) <= call_s


def test_stop_strings_end_responses_and_are_not_truncation(engine):
    stops = list("0123456789")
    b = engine.generate(["12+3*4=", "5+6*7="], SamplingParams(n=4, max_new_tokens=30, seed=3, stop=stops))
    lengths = b.response_attn.sum(-1)
    ended_by_stop = 0
    for i, text in enumerate(b.responses):
        ids = b.response_ids[i, : int(lengths[i])].tolist()
        digits = [j for j, c in enumerate(text) if c.isdigit()]
        if digits:  # the response ends right after its first digit
            assert text.endswith(text[digits[0]]) and len(digits) == 1
            assert not b.truncated[i]
            ended_by_stop += 1
        else:
            assert bool(b.truncated[i]) == (engine.tokenizer.eos_token_id not in ids)
        assert (b.response_ids[i, int(lengths[i]):] == engine.tokenizer.pad_token_id).all()
    assert ended_by_stop > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_match_learner_forward(engine, temperature):
    b = engine.generate(["12+3*4=", "5+6*7=", "1+2*3="], SamplingParams(n=2, temperature=temperature,
                                                                       max_new_tokens=16, seed=1))
    with torch.no_grad():
        logp, _ = response_logprobs(engine.model, b, temperature=temperature)
    diff = ((logp - b.rollout_logp).abs() * b.response_mask).max()
    assert diff < 1e-4


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(engine):
    sp = SamplingParams(n=2, max_new_tokens=10, seed=5)
    a = engine.generate(["1+2*3="], sp)
    b = engine.generate(["1+2*3="], sp)
    assert torch.equal(a.response_ids, b.response_ids)
    g1 = engine.generate(["1+2*3="], SamplingParams(n=2, temperature=0.0, max_new_tokens=10, seed=1))
    assert torch.equal(g1.response_ids[0], g1.response_ids[1])
    # a run's seed, step and worker make large seeds: any of them samples, reproducibly
    huge = SamplingParams(n=2, max_new_tokens=10, seed=(1 << 62) + 5)
    assert torch.equal(engine.generate(["1+2*3="], huge).response_ids, engine.generate(["1+2*3="], huge).response_ids)
    ids = engine.generate_ids([[5, 6, 7]], huge, seeds=[1 << 70])
    assert len(ids) == 1


def test_load_weights_changes_outputs_and_rejects_unknown_names(engine):
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    before = engine.generate(["1+2*3="], SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    engine.load_weights({k: torch.zeros_like(v) if k == "lm_head.weight" else v for k, v in state.items()})
    assert engine.model.lm_head.weight.abs().sum() == 0
    engine.load_weights(state)
    after = engine.generate(["1+2*3="], SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    assert torch.equal(before.response_ids, after.response_ids)
    with pytest.raises(KeyError, match="not in the rollout model"):
        engine.load_weights({"no.such.weight": torch.zeros(1)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_sync_roundtrip_through_object_store(ray_cluster, dtype):
    from rollout.weight_sync import pack_state, unpack_state
    state = {"a": torch.randn(3, 4).to(dtype), "b": torch.arange(5, dtype=torch.float32)}
    back = unpack_state(ray_cluster.get(ray_cluster.put(pack_state(state))))
    for k, v in state.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


def test_bucket_plan_keeps_order_splits_by_dtype_and_size():
    from rollout.weight_sync import plan_buckets
    meta = [("a", (4, 4), "float32"), ("b", (8,), "float32"), ("c", (100,), "float32"),
            ("d", (2,), "bfloat16"), ("e", (2,), "float32")]
    # 64 + 32 bytes fit a 100-byte bucket; 400 bytes get one of their own; dtype changes start a new one
    assert plan_buckets(meta, 100) == [[0, 1], [2], [3], [4]]
    assert plan_buckets(meta, 1 << 20) == [[0, 1, 2], [3], [4]]


def test_a_masked_diffusion_model_samples_with_the_block_sampler_and_logs_its_commits(engine, tmp_path):
    from models.diffusion import diffusion_generate
    path = str(save_tiny(tmp_path / "llada", arch="llada", hidden_size=32, num_layers=2, num_heads=2,
                         intermediate_size=64))
    diffusion = HFEngine(path)
    params = {"block_length": 4, "steps": 8, "commit_log": True}
    b = diffusion.generate(["12+3=", "5+5="], SamplingParams(n=2, max_new_tokens=8, temperature=0.0, seed=0,
                                                               decoding="diffusion", decoding_params=params))
    assert len(b) == 4 and b.response_ids.shape[1] == 8
    tok = diffusion.tokenizer
    enc = tok(["12+3=", "5+5="], return_tensors="pt", padding=True)
    direct = diffusion_generate(diffusion.model, enc["input_ids"], enc["attention_mask"], gen_length=8,
                                block_length=4, steps=8, mask_id=tok.mask_token_id)
    eos = tok.eos_token_id
    for i, row in enumerate((0, 0, 1, 1)):  # greedy: both samples of a prompt are the sampler's tokens
        n = int(b.response_attn[i].sum())
        want = direct.tokens[row].tolist()
        assert b.response_ids[i, :n].tolist() == (want[:want.index(eos) + 1] if eos in want else want)
        commits = b.extras["diffusion_commits"].value[i]
        assert sorted(p for _, p, _, _ in commits) == list(range(8))  # every position committed once
        assert [s for s, _, _, _ in commits] == sorted(s for s, _, _, _ in commits)
    core = diffusion.generate(["12+3="], SamplingParams(max_new_tokens=8, temperature=0.0, decoding="remask_core",
                                                        decoding_params={"block_length": 8, "steps": 8, "probes": 2,
                                                                         "commit_log": True}))
    assert int(core.response_attn.sum()) >= 1  # CORE's remasking runs inside the engine's sampler
    # remasked positions are committed twice: 8 positions, 2 probes of m = 2
    assert len(core.extras["diffusion_commits"].value[0]) == 8 + 2 * 2
    # the model's own sampler is the default; a causal decoding method is refused, and the sampler on a causal model
    assert diffusion.generate(["1+1="], SamplingParams(max_new_tokens=4, temperature=0.0)).response_ids.shape[1] == 4
    with pytest.raises(ValueError, match="decoding 'diffusion'"):
        diffusion.generate(["1+1="], SamplingParams(max_new_tokens=4, decoding="plain"))
    with pytest.raises(ValueError, match="causal"):
        engine.generate(["1+1="], SamplingParams(max_new_tokens=4, decoding="diffusion"))


def test_length_buckets_group_rows_within_the_factor_or_the_slack_of_their_shortest():
    from rollout.hf_engine import length_buckets
    # sorted: 10, 12, 41 (<= max(2*10, 10+32)=42), then 43 starts a group, 90 > max(86, 75), 200, 230 <= 400
    assert length_buckets([10, 200, 12, 90, 230, 41, 43], 2.0) == [[0, 2, 5], [1, 4], [3], [6]]
    assert length_buckets([10, 200, 12], 0) == [[0, 1, 2]]
    assert length_buckets([], 2.0) == []


def test_continuations_of_very_different_lengths_decode_apart_and_sample_what_they_would_alone(engine, monkeypatch):
    """`generate_ids` on 10-token and 150-token contexts: no decode call pads a short context to the long ones
    (the waste that made partial-rollout rounds slower than synchronous steps), and greedy continuations equal
    those of each context decoded alone and those of one padded call (`length_buckets: 0`)."""
    import random
    rng = random.Random(0)
    contexts = [[rng.randrange(3, 20) for _ in range(n)] for n in (10, 150, 11, 149, 10)]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    widths, decode = [], engine._decode

    def spy(ids, mask, sp):
        widths.append(sorted(int(n) for n in mask.sum(1)))
        return decode(ids, mask, sp)

    monkeypatch.setattr(engine, "_decode", spy)
    monkeypatch.setattr(engine, "length_buckets", 2.0)
    together = engine.generate_ids(contexts, greedy, seeds=list(range(5)))
    assert sorted(widths) == [[10, 10, 11], [149, 150]]
    alone = [engine.generate_ids([c], greedy, seeds=[0])[0] for c in contexts]
    monkeypatch.setattr(engine, "length_buckets", 0)
    padded = engine.generate_ids(contexts, greedy, seeds=list(range(5)))
    for a, b, c in zip(together, alone, padded):
        assert a.ids == b.ids == c.ids and a.ended == b.ended == c.ended
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4) and a.logprobs == pytest.approx(c.logprobs, abs=1e-4)
