"""DenseSteer's pieces (rl/methods/densesteer/README.md): the density metric, the mean-difference vectors, the `steer`
decoding method on the hf engine's decode loop, and the two-style task."""

import json

import pytest
import torch

from models.blocks import block_outputs
from models.tiny import save_tiny
from rl.methods.densesteer.core import density, extract_vectors
from rl.methods.densesteer.decoding import SteerDecoding
from rl.methods.densesteer.task import dense_solution, sparse_solution, write_styles_task
from rollout.base import SamplingParams
from rollout.decoding import DecodeState, install_residual_hooks
from rollout.hf_engine import HFEngine

PROMPTS = ["3+4+2=", "5+6+7+1=", "9+9+9="]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine(str(save_tiny(tmp_path_factory.mktemp("m"), hidden_size=64, num_layers=3, num_heads=2,
                                  intermediate_size=128)))


@pytest.fixture(scope="module")
def vectors_file(engine, tmp_path_factory):
    """Vectors of the untrained tiny model from three pairs (what the stage saves: {layer: vector})."""
    terms = [(3, 4, 2), (5, 6, 7, 1), (9, 9, 9)]
    vecs = extract_vectors(engine.model, engine.tokenizer, PROMPTS, [dense_solution(t) for t in terms],
                           [sparse_solution(t) for t in terms])
    path = tmp_path_factory.mktemp("v") / "steering_vectors.pt"
    torch.save(vecs, path)
    return path, vecs


def test_density_counts_blank_line_steps():
    sparse, dense = sparse_solution((3, 4, 2, 5)), dense_solution((3, 4, 2, 5))
    assert sparse == "3+4=7\n\n7+2=9\n\n9+5=14\n\n\\boxed{14}"
    assert dense == "3+4=7,7+2=9,9+5=14\n\n\\boxed{14}"
    assert density(sparse) == {"steps": 4.0, "tokens": float(len(sparse)), "rho": len(sparse) / 4}
    assert density(dense) == {"steps": 2.0, "tokens": float(len(dense)), "rho": len(dense) / 2}
    assert density("a\n\n\n\nb")["steps"] == 2.0  # empty segments are not steps


def test_the_vector_is_the_mean_of_last_token_differences(engine, vectors_file):
    """Recomputed independently: one unpadded text at a time, transformers' own hidden states (hidden_states[l + 1]
    is block l's output for every block but the last, which transformers reports after the final norm)."""
    _, vecs = vectors_file
    terms = [(3, 4, 2), (5, 6, 7, 1), (9, 9, 9)]
    model, tok = engine.model, engine.tokenizer
    for layer in (0, 1):
        diffs = []
        for prompt, t in zip(PROMPTS, terms):
            states = []
            for text in (prompt + dense_solution(t), prompt + sparse_solution(t)):
                ids = tok(text, return_tensors="pt")["input_ids"]
                with torch.no_grad():
                    states.append(model(ids, output_hidden_states=True).hidden_states[layer + 1][0, -1])
            diffs.append(states[0] - states[1])
        torch.testing.assert_close(vecs[layer], torch.stack(diffs).mean(0), atol=1e-5, rtol=1e-4)
    assert sorted(vecs) == [0, 1, 2] and vecs[1].norm() > 0


def test_the_hook_changes_only_the_chosen_layer(engine, vectors_file):
    path, vecs = vectors_file
    model, tok = engine.model, engine.tokenizer
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    plain = block_outputs(model, dict(enc))
    method = SteerDecoding(str(path), layer=1, strength=3.0)
    state = DecodeState(enc["input_ids"], enc["attention_mask"], [[]] * 3, [[]] * 3, torch.zeros(3, dtype=torch.bool))
    hooks = install_residual_hooks(model, method, state)
    try:
        steered = block_outputs(model, dict(enc))
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(steered[0], plain[0], atol=0, rtol=0)  # before the chosen block: untouched
    torch.testing.assert_close(steered[1], plain[1] + 3.0 * vecs[1], atol=1e-6, rtol=0)  # the chosen block: + λv
    assert not torch.allclose(steered[2], plain[2])  # after it: the change propagates


def test_strength_zero_decodes_as_plain_and_min_token_index_spares_earlier_positions(engine, vectors_file):
    path, _ = vectors_file

    def gen(decoding=None, params=None):
        sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=12, seed=0, decoding=decoding, decoding_params=params)
        return engine.generate(PROMPTS, sp)
    plain = gen()
    zero = gen("densesteer", {"vectors": str(path), "layer": 1, "strength": 0.0})
    assert torch.equal(zero.response_ids, plain.response_ids)
    torch.testing.assert_close(zero.rollout_logp, plain.rollout_logp, atol=1e-6, rtol=0)
    strong = gen("densesteer", {"vectors": str(path), "layer": 1, "strength": 40.0})
    assert not torch.equal(strong.rollout_logp, plain.rollout_logp)
    # steering only from a position beyond the whole sequence changes nothing
    late = gen("densesteer", {"vectors": str(path), "layer": 1, "strength": 40.0, "min_token_index": 1000})
    assert torch.equal(late.response_ids, plain.response_ids)
    torch.testing.assert_close(late.rollout_logp, plain.rollout_logp, atol=1e-6, rtol=0)


def test_steer_names_a_bad_vectors_file_or_layer(tmp_path, engine, vectors_file):
    path, _ = vectors_file
    with pytest.raises(FileNotFoundError, match="steering_vectors"):
        SteerDecoding(str(tmp_path / "nothing.pt"), layer=0)
    with pytest.raises(KeyError, match="not layer 7"):
        SteerDecoding(str(path), layer=7)


def test_a_selection_report_sets_layer_and_strength(tmp_path, vectors_file):
    path, _ = vectors_file
    report = tmp_path / "steering_report.json"
    report.write_text(json.dumps({"selected": {"layer": 1, "strength": -4.0}}))
    method = SteerDecoding(str(path), layer=0, strength=9.0, selection=str(report))
    assert (method.layer, method.strength) == (1, -4.0)
    report.write_text(json.dumps({"pairs": 3}))
    with pytest.raises(ValueError, match="no `selected`"):
        SteerDecoding(str(path), selection=str(report))
    with pytest.raises(ValueError, match="give `layer`"):
        SteerDecoding(str(path))


def test_held_out_selection_takes_the_densest_arm_that_keeps_accuracy():
    from rl.methods.densesteer.core import select_steering
    cands = [{"layer": 2, "strength": 0.0, "rho": 10.0, "accuracy": 0.8},
             {"layer": 2, "strength": 8.0, "rho": 14.0, "accuracy": 0.7},    # denser, but loses accuracy
             {"layer": 2, "strength": 4.0, "rho": 12.0, "accuracy": 0.8},
             {"layer": 1, "strength": -4.0, "rho": 12.0, "accuracy": 0.85},  # the same ρ and |λ| as the one above
             {"layer": 1, "strength": -8.0, "rho": 11.0, "accuracy": 0.9}]
    assert select_steering(cands) in (cands[2], cands[3]) and select_steering(cands)["rho"] == 12.0
    assert select_steering(cands, tolerance=0.1) is cands[1]  # 0.7 ≥ 0.8 − 0.1
    cands[3]["strength"] = -6.0  # same ρ, larger |λ|: the smaller one wins
    assert select_steering(cands) is cands[2]
    # a reversed vector: only negative λ densifies, and the rule finds the sign
    rev = [{"layer": 2, "strength": s, "rho": 10.0 - s / 4, "accuracy": 0.8} for s in (0.0, -8.0, -4.0, 4.0, 8.0)]
    assert select_steering(rev)["strength"] == -8.0


def test_the_styles_task_mixes_styles_and_keeps_pairs_apart(tmp_path):
    paths = write_styles_task(tmp_path, num_train=400, num_eval=20, num_pairs=10, seed=3)
    rows = {k: [json.loads(x) for x in open(v)] for k, v in paths.items()}
    assert len(rows["sft"]) == 200 and len(rows["eval"]) == 20 and len(rows["steer_pairs"]) == 10
    styles = [r["style"] for r in rows["sft"]]
    assert 0.35 < styles.count("dense") / len(styles) < 0.65
    prompts = {k: {r["prompt"] for r in v} for k, v in rows.items()}
    assert not prompts["steer_pairs"] & (prompts["sft"] | prompts["train"] | prompts["eval"])
    for r in rows["steer_pairs"]:
        assert r["dense"].endswith(f"\\boxed{{{r['answer']}}}") and r["sparse"].endswith(f"\\boxed{{{r['answer']}}}")
        assert density(r["dense"])["rho"] > density(r["sparse"])["rho"]
    with pytest.raises(ValueError, match="distinct problems"):
        write_styles_task(tmp_path, num_train=10**6, num_eval=0, min_terms=2, max_terms=2)
