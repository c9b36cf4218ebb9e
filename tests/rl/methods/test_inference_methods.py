"""Inference-time methods through a recipe on Ray: DenseSteer's vectors extracted by the `densesteer` stage and
used to steer RL rollouts (the gap to the learner's unsteered logprobs is logged), and BeaconKV compressing the KV
cache of the held-out evaluation."""

import json

import pytest
import torch


# CI: steering in test_steering.py, the KV policies on the engine in test_kv_policies.py, a decoding stage through the
# recipe below (guidance)
@pytest.mark.extended
def test_steered_rollouts_and_a_compressed_cache_evaluation_through_the_recipe(ray_cluster, tmp_path):
    from cluster.pipeline import run
    from rl import config
    from tests.cluster.test_pipeline import ROOT, TINY
    out = tmp_path / "run"
    vectors = f"{out}/stages/densesteer/steering_vectors.pt"
    summary = run(config.load(ROOT / "recipes/densesteer_tiny.yaml", [
        f"output_dir={out}", *TINY, "model.tiny.num_layers=2", "sft.steps=5", "sft.batch_size=16",
        "data.synthetic.params.num_pairs=12", "trainer.steps=1",
        "rollout.decoding=densesteer", f"rollout.decoding_params={{vectors: {vectors}, layer: 1, strength: 200.0}}",
        "rollout.eval_decoding=beaconkv",
        "rollout.eval_decoding_params={budget: 4, sink: 1, recent: 2, n_recent_queries: 2, n_beacon: 2}",
        "stages=[{name: model}, {name: data}, {name: sft}, {name: densesteer, params: {select: {layers: [1], "
        "strengths: [200.0], num_problems: 4}}}, {name: rl}, {name: evaluate}]"]))
    saved = torch.load(vectors, weights_only=True)
    assert sorted(saved) == [0, 1] and saved[1].shape == (32,)
    report = json.loads((out / "stages" / "densesteer" / "steering_report.json").read_text())
    assert report["pairs"] == 12 and report["pair_file"].endswith("steer_pairs.jsonl")
    # the held-out choice: the unsteered arm and the candidate, scored on 4 training prompts; the pick follows the rule
    from rl.methods.densesteer.core import select_steering
    cands = report["selection"]["candidates"]
    assert [(c["layer"], c["strength"]) for c in cands] == [(1, 0.0), (1, 200.0)] and report["selection"]["problems"] == 4
    assert report["selected"] == {k: select_steering(cands)[k] for k in ("layer", "strength")}
    # λ = 200 on a 32-wide model changes what it writes: the densities differ
    assert cands[0]["rho"] != cands[1]["rho"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # the engine sampled from the steered model, the learner scored with the unsteered one: the gap is logged
    assert metrics[0]["actor/mismatch_kl"] > 1e-3
    assert summary["steps"] == 1 and summary["eval_examples_after_rl"]


def test_a_steering_pair_file_with_a_bad_row_is_named(tmp_path):
    import pytest

    from rl.methods.densesteer.stage import read_pairs
    from rl.stages import StageError
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "dense": "a", "sparse": "b"}) + "\n"
                    + json.dumps({"prompt": "2+2=", "dense": "", "sparse": "b"}) + "\n")
    assert len(read_pairs(str(path), 1)) == 1
    with pytest.raises(StageError, match=r"pairs.jsonl:2: .*\['dense'\]"):
        read_pairs(str(path), 50)


def test_guidance_stage_scores_plain_post_hoc_and_guided_answers_through_the_recipe(ray_cluster, tmp_path):
    """recipes/guidance_tiny.yaml at test size, without its SFT warm-up (an untrained model: the plumbing;
    tests/rl/methods/test_citation.py measures the insertions on a model that states facts)."""
    from cluster.pipeline import run
    from rl import config
    from rl.methods.guidance.core import post_hoc_cite, strip_citations
    from tests.cluster.test_pipeline import ROOT, TINY
    out = tmp_path / "run"
    summary = run(config.load(ROOT / "recipes/guidance_tiny.yaml", [
        f"output_dir={out}", *TINY, "trainer.eval_max_prompts=4",
        "rollout.max_new_tokens=40", "stages=[{name: model}, {name: data}, {name: guidance, params: "
        "{judge: containment, no_citation_column: prompt, guidance_params: {lookahead: 40, max_insertions: 8, "
        "max_prefix: 8, sliding: true}}}]"]))
    report = json.loads((out / "stages" / "guidance" / "guidance.json").read_text())
    # the no-citation answers here are the plain ones (the same prompts, greedy): the plain arm's ratio is 1 and
    # every other arm's is its correctness over the plain arm's
    base = report["no_citation_correctness"]
    assert base == report["arms"]["plain"]["correctness"]
    for arm in report["arms"].values():
        assert arm["correctness_ratio"] == (pytest.approx(arm["correctness"] / base) if base else None)
    assert report["prompts"] == 4 and set(report["arms"]) == {"plain", "post_hoc", "guidance"}
    for arm in report["arms"].values():
        assert 0 <= arm["f1"] <= 1 and 0 <= arm["recall"] <= 1 and 0 <= arm["precision"] <= 1
    rows = [json.loads(x) for x in (out / "data" / "eval.jsonl").read_text().splitlines()]
    plain, post_hoc = report["arms"]["plain"]["examples"], report["arms"]["post_hoc"]["examples"]
    assert post_hoc == [post_hoc_cite(strip_citations(a), r["prompt"]) for a, r in zip(plain, rows)]
    assert set(summary["guidance"]) == {"plain", "post_hoc", "guidance"}


# CI: DSR's formalize-repair-judge loop in test_dsr.py, a stage through the recipe above (guidance)
@pytest.mark.extended
def test_dsr_stage_formalizes_repairs_and_judges_through_the_recipe(ray_cluster, tmp_path):
    """DSR's stage on Ray with its four roles served by one barely taught model (the pipeline, not its quality):
    every statement's repair stays within the budget, SC is the checker's verdict on the final statement, and the
    reference comparison (kept, exact) is recorded for the broken inputs."""
    from cluster.pipeline import run
    from rl import config
    from rl.methods.dsr import core as dsr
    from tests.cluster.test_pipeline import ROOT
    out = tmp_path / "run"
    summary = run(config.load(ROOT / "recipes/dsr_tiny.yaml", [
        f"output_dir={out}", "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=64", "sft.steps=3", "sft.batch_size=8", "data.synthetic.num_train=40",
        "data.synthetic.num_eval=4", "reward.judges.dsr.max_new_tokens=24", "learner.micro_batch_size=8"]))
    report = json.loads((out / "stages" / "dsr" / "dsr.json").read_text())
    assert report["statements"] == 4 and report["compiler"] == "leanlite"
    assert set(report["inputs"]) == {"from_nl", "from_broken"}
    for arms in report["inputs"].values():
        assert set(arms) == {"tree", "global"}
        for r in arms.values():
            assert 0 <= r["calls"] <= 4 and all(len(it["calls"]) <= 4 for it in r["items"])
            for it in r["items"]:
                assert it["compiles"] == (dsr.check(it["statement"]) == [])
            assert r["kept"] is not None and r["exact"] is not None  # the synthetic rows carry references
    # the control rewrites whole statements only; DSR starts below the statement (subtree or component)
    assert report["inputs"]["from_broken"]["global"]["items"][0]["calls"][0]["kind"] == "statement"
    tree = report["inputs"]["from_broken"]["tree"]
    assert tree["items"][0]["calls"][0]["kind"] in ("subtree", "component")
    assert summary["dsr"]["from_broken"]["tree"]["calls"] == tree["calls"]


def test_prime_files_load_and_bad_items_are_named(tmp_path):
    import pytest

    from rl.methods.dsr.stage import LeanCompiler, load_prime
    from rl.stages import StageError
    items = [{"textbook": "Rudin", "domain": "Real Analysis", "theorem_index": "1.1",
              "informal_statement": "Prove that 1 + 1 = 2.", "formal_statement": "theorem test : 1 + 1 = 2 := by sorry",
              "informal_proof": "Compute."},
             {"textbook": "Rudin", "domain": "Real Analysis", "theorem_index": "1.2",
              "informal_statement": "Let x > 0. Show x ^ 2 > 0.",
              "formal_statement": "theorem test (x : ℝ) (h : x > 0) : x ^ 2 > 0 := by sorry", "informal_proof": "."}]
    path = tmp_path / "prime.json"
    path.write_text(json.dumps(items))
    rows = load_prime(path)
    assert [r["answer"] for r in rows] == [i["formal_statement"] for i in items]
    assert rows[1]["prompt"] == items[1]["informal_statement"] and rows[0]["metadata"]["theorem_index"] == "1.1"
    path.write_text(json.dumps([items[0], {**items[1], "formal_statement": "example : True := trivial"}]))
    with pytest.raises(StageError, match=r"item 1's formal_statement"):
        load_prime(path)
    path.write_text(json.dumps([{"informal_statement": "x"}]))
    with pytest.raises(StageError, match=r"item 0 lacks \['formal_statement'\]"):
        load_prime(path)
    with pytest.raises(StageError, match="lean` and `lake` on PATH"):
        LeanCompiler(str(tmp_path))
