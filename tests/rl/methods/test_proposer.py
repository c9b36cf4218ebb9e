"""Agentic Proposing: the skill library, the symbolic verifier, the proposer environment's step rewards, the
trajectory reward and the curriculum sampler (rl/methods/agentic_proposing/README.md)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from rl.methods.agentic_proposing.core import (
    CurriculumSampler,
    compose,
    evaluate,
    load_skills,
    majority_valid,
    parse_block,
    parse_final,
    pass_rate,
    sympy_check,
)
from rl.methods.agentic_proposing.task import SKILLS_PATH


def test_the_skill_library_loads_and_composes_problems_with_their_worked_values():
    skills = load_skills(SKILLS_PATH)
    assert sorted(skills) == ["add", "mod", "mul", "sub"]
    rng = random.Random(0)
    for _ in range(50):
        chain = [skills[n] for n in rng.sample(sorted(skills), 3)]
        problem, values = compose(chain, rng)
        assert evaluate(problem) == values[-1] and len(values) == 3
        assert all(s.operator in problem for s in chain)
    # (3+4)*5%6: the value after each skill
    fixed = random.Random(1)
    problem, values = compose([skills["add"], skills["mul"], skills["mod"]], fixed)
    assert values == [eval(problem[:problem.index(")") + 1]), eval(problem[:problem.index("%")]), eval(problem)]


@pytest.mark.parametrize("line, message", [
    ('{"name": "a", "template": "{x}+{a}", "params": {"a": [1, 2]}}', r"skills.jsonl:2: skill without \['category'\]"),
    ('{"name": "a", "category": "c", "template": "{x}+{a}", "params": {"a": [3, 2]}, "operator": "+"}', r":2: params.a must be"),
    ('{"name": "a", "category": "c", "template": "{x}", "operater": "+"}', r":2: unknown skill keys \['operater'\]"),
    ('{"name": "a", "category": "c", "template": "{x}+{a}", "params": {"a": [1, 2]}, "operator": "+", "checker": "lean"}', r":2: checker 'lean'"),
    ('{"name": "add", "category": "c", "template": "{x}+{a}", "params": {"a": [1, 2]}, "operator": "+"}', r":2: skill 'add' is defined twice"),
    ("not json", r":2: not a JSON object"),
])
def test_a_bad_skill_names_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "skills.jsonl"
    first = '{"name": "add", "category": "c", "template": "({x}+{a})", "params": {"a": [1, 2]}, "operator": "+"}'
    path.write_text(first + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_skills(path)


def test_a_skill_in_words_loads_but_does_not_compose(tmp_path):
    path = tmp_path / "skills.jsonl"
    path.write_text('{"name": "pigeonhole", "category": "combinatorics", "template": "a pigeonhole argument"}\n')
    skill = load_skills(path)["pigeonhole"]
    with pytest.raises(ValueError, match="'pigeonhole': template .* has no \\{x\\}"):
        compose([skill], random.Random(0))


def test_the_symbolic_verifier():
    assert evaluate("((3+4)*5)%6") == 5 and evaluate("(2-9)%4") == 1  # sympy's Mod: the sign of the modulus
    assert evaluate("7%0") is None and evaluate("7/2") is None  # zero modulus; '/' is not an arithmetic skill
    assert evaluate("9**9**9") is None  # a power is refused before sympy sees it (no huge numbers)
    assert evaluate("__import__('os')") is None and evaluate("") is None
    assert evaluate("999*999*999") is None  # beyond max_abs
    assert sympy_check("((3+4)*5)%6", "5", ["+", "*", "%"])
    assert not sympy_check("((3+4)*5)%6", "6", ["+", "*", "%"])  # wrong answer
    assert not sympy_check("(3+4)*5", "35", ["+", "*", "%"])  # a seed skill is missing
    assert not sympy_check("(3+4)*5", "thirty-five")


def test_blocks_and_finalize_parse():
    assert parse_block("<python>1+2</python>") == ("python", "1+2")
    assert parse_block("  <think>answer 3</think>\n") == ("think", "answer 3")
    assert parse_block("<python>1+2</check>") is None and parse_block("1+2") is None
    assert parse_block("<python>1</python><python>2</python>") is None  # one block per turn
    assert parse_final("<final>Problem: (1+2)*3 Answer: 9</final>") == ("(1+2)*3", "9")
    text = "<final>Problem: 1+1 Answer: 3</final><out>x</out><final>Problem: 2+2 Answer: 4</final>"
    assert parse_final(text) == ("2+2", "4") and parse_final("Problem: 1 Answer: 1") is None


def test_the_ensemble_is_a_strict_majority():
    assert majority_valid([True, True, False]) and not majority_valid([True, False])
    assert not majority_valid([]) and majority_valid([True])


def _episode(actions):
    from rl.methods.agentic_proposing.env import AgenticProposerEnv
    env = AgenticProposerEnv(timeout_s=1.0)
    env.reset("Skills: add mul\n", {}, None)
    steps = [env.step(a) for a in actions]
    return env, steps, env.finish()


def test_the_expert_loop_earns_every_step_reward():
    env, steps, final = _episode(["<python>(3+4)*5</python>", "<check>(3+4)*5=35</check>", "<think>answer 35</think>",
                                  "<final>Problem: (3+4)*5 Answer: 35</final>"])
    assert [s.observation for s in steps[:2]] == ["<out>35</out>\n", "<out>ok</out>\n"]
    assert [s.step_type for s in steps] == ["tool", "tool", "reflection", "final"]
    assert [s.reward for s in steps] == [1.0, 1.0, 1.0, 0.0] and final == [1.0, 1.0, 1.0, 0.0]
    assert steps[-1].done and not any(s.done for s in steps[:-1])


def test_malformed_errored_hung_and_unused_tool_calls():
    env, steps, final = _episode(["<python>(3+4)*5</check>", "<check>(3+4)*5</check>", "<python>1/0</python>",
                                  "<python>\nwhile True:\n    pass\n</python>", "<python>(3+4)*5</python>",
                                  "<think>answer 30</think>", "<final>Problem: (3+4)*5 Answer: 30</final>"])
    assert [s.reward for s in steps[:4]] == [-1.0, -1.0, 0.0, 0.0]  # malformed, malformed check, errored, hung
    assert steps[0].observation == "<out>malformed</out>\n" and steps[2].failed and steps[3].failed
    assert "time" in steps[3].info["tool_error"].lower()  # the sandbox's time limit ended the loop
    assert steps[4].reward == 1.0 and final[4] == 0.0  # ran, but its output (35) was never used: 0 in the end
    assert steps[5].reward == 0.0  # the reflection contradicts the tool (30 vs 35)
    assert steps[6].done


def test_a_reflection_before_any_tool_output_is_not_coherent():
    _, steps, _ = _episode(["<think>answer 12</think>", "<final>Problem: 3*4 Answer: 12</final>"])
    assert steps[0].reward == 0.0 and steps[0].step_type == "reflection"


def test_the_trajectory_reward_without_judges():
    from rl.methods.agentic_proposing.reward import agentic_proposing_reward
    seed = {"skills": ["add", "mul"], "operators": ["+", "*"]}
    responses = ["<python>(3+4)*5</python><out>35</out>\n<final>Problem: (3+4)*5 Answer: 35</final>",
                 "<final>Problem: (3+4)*5 Answer: 36</final>",  # wrong answer: invalid
                 "<final>Problem: 3*5 Answer: 15</final>",  # drops the add skill: invalid
                 "<python>(3+4)*5</python><out>35</out>\n",  # no Finalize
                 "<final>Problem: (3+4)*5 Answer: x</final>"]  # badly formed answer
    out = agentic_proposing_reward([""] * 5, responses, ground_truth=[seed] * 5, judges={}, verifiers=["sympy"], prober=None)
    assert [o["valid"] for o in out] == [True, False, False, False, False]
    assert out[0]["score"] == pytest.approx(0.1 + 1.0)  # no prober: rho 0, no difficulty bonus
    assert [o["score"] for o in out[1:]] == [0.0, 0.0, 0.0, 0.0]
    assert out[3]["has_final"] == 0.0 and out[4]["format_ok"] == 0.0


def test_the_difficulty_bonus_from_the_probers_answers():
    from rl.answers import stated_answer
    from rl.methods.agentic_proposing.reward import mgpo_trajectory_reward
    answers = [stated_answer(t) for t in ["7 35 \\boxed{35}", "7 30 \\boxed{30}", "35", "7 36 \\boxed{36}"] * 2]
    rho = pass_rate(answers, "35")
    assert rho == 0.5 and pass_rate(["35", None, "1", "2"], "35") == 0.25
    assert mgpo_trajectory_reward(True, True, 0.25) == pytest.approx(0.1 + 1.0 + 0.75)  # rl/methods/agentic_proposing/README.md item 2
    assert mgpo_trajectory_reward(True, True, 0.0) == pytest.approx(1.1)  # unsolvable: no bonus


def test_an_invalid_proposal_with_two_working_tool_calls_gets_no_reward_at_all():
    """The README's hand-computed case 1 through the environment, the reward and the estimator."""
    from rl.methods.agentic_proposing.mgpo import compute_mgpo_advantages
    from rl.methods.agentic_proposing.reward import agentic_proposing_reward
    _, steps, rewards = _episode(["<python>3*5</python>", "<check>3*5=15</check>", "<think>answer 15</think>",
                                  "<final>Problem: 3*5 Answer: 15</final>"])
    assert rewards[:2] == [1.0, 1.0]  # both tool calls ran and their outputs were used
    good = _episode(["<python>(3+4)*5</python>", "<final>Problem: (3+4)*5 Answer: 35</final>"])[2]
    scored = agentic_proposing_reward(["", ""], ["<final>Problem: 3*5 Answer: 15</final>",
                                         "<final>Problem: (3+4)*5 Answer: 35</final>"],
                              ground_truth=[{"operators": ["+", "*"]}] * 2, judges={}, prober=None)
    assert scored[0]["score"] == 0.0 and scored[0]["valid"] is False
    step_rewards, types = [rewards, good], [[s.step_type for s in steps], ["tool", "final"]]
    token_step = torch.tensor([[0, 1, 2, 3], [0, 1, -1, -1]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    valid = torch.tensor([False, True])
    adv = compute_mgpo_advantages(torch.tensor([0.0, 1.1]), torch.tensor([0, 0]), mask, token_step=token_step,
                                  step_rewards=step_rewards, step_types=types, valid=valid, lambda_step=0.5)
    # the tool pool holds the invalid trajectory's zeroed steps (0, 0) and the valid one's (1): its tool
    # tokens rank below the valid trajectory's tool token, though their raw step rewards were 1
    assert adv[0, 0] < adv[1, 0] and adv[0, 0] == adv[0, 1]
    ungated = compute_mgpo_advantages(torch.tensor([0.0, 1.1]), torch.tensor([0, 0]), mask, token_step=token_step,
                                      step_rewards=step_rewards, step_types=types, valid=torch.tensor([True, True]),
                                      lambda_step=0.5)
    assert ungated[0, 0] > adv[0, 0]


def test_the_curriculum_draws_weak_categories_more_often():
    sampler = CurriculumSampler(["a", "a", "b", "b", "b"], seed=0, floor=0.1, ema=0.3)
    sampler.proficiency.update(a=0.9, b=0.1)
    probs = sampler.probabilities()
    assert probs["a"] == pytest.approx(1 / 6) and probs["b"] == pytest.approx(5 / 6)  # 1/(0.9+0.1) : 1/(0.1+0.1)
    drawn = [i for _ in range(200) for i in sampler.next(10)]
    share_b = sum(1 for i in drawn if i >= 2) / len(drawn)
    assert abs(share_b - 5 / 6) < 0.03
    metrics = sampler.update(["a", "a", "b", None], [True, False, True, True])
    assert sampler.proficiency["a"] == pytest.approx(0.7 * 0.9 + 0.3 * 0.5)
    assert sampler.proficiency["b"] == pytest.approx(0.7 * 0.1 + 0.3 * 1.0)
    assert metrics["curriculum/proficiency/a"] == sampler.proficiency["a"] and "curriculum/prob/b" in metrics


def test_the_curriculum_resumes_exactly():
    from rl.methods.agentic_proposing.core import curriculum_sampler
    rows = [{"category": c} for c in "aabbbc"]
    first = curriculum_sampler(rows, 3)
    first.update(["a", "b"], [True, False])
    state = json.loads(json.dumps(first.state()))  # what the checkpoint stores
    again = curriculum_sampler(rows, 3)
    again.load(state)
    assert [first.next(5) for _ in range(4)] == [again.next(5) for _ in range(4)]
    with pytest.raises(ValueError, match="2 training rows have no 'category' column"):
        curriculum_sampler([{"category": "a"}, {}, {"x": 1}], 0)


def test_the_task_writes_every_role_and_split(tmp_path):
    from rl.methods.agentic_proposing.task import write_proposer_task
    paths = write_proposer_task(tmp_path, num_sft=300, num_train=20, num_eval=5, num_solver_eval=10, seed=0)
    sft = [json.loads(x) for x in open(paths["sft"])]
    assert {r["role"] for r in sft} == {"proposer", "solver", "verifier"}
    experts = [r for r in sft if r.get("style") == "expert"]
    for r in experts:  # an expert trajectory is a valid proposal for its seed
        problem, answer = parse_final(r["target"])
        assert sympy_check(problem, answer)
    train = [json.loads(x) for x in open(paths["train"])]
    assert all(r["category"] and r["answer"]["operators"] for r in train)
    for r in (json.loads(x) for x in open(paths["solver_eval"])):
        assert evaluate(r["prompt"].removeprefix("Solve: ").strip()) == int(r["answer"])


# CI: the proposer's episodes, verifiers, prober and MGPO in this file's other tests, multi-turn RL through Ray in
# test_a_three_turn_calculator_env_trains_end_to_end
@pytest.mark.extended
@pytest.mark.slow
def test_the_tiny_agentic_proposer_recipe_trains_with_mgpo_end_to_end(ray_cluster, tmp_path):
    """Through Ray: SFT, proposer episodes with the sandbox tools, the verifier ensemble (SymPy + a frozen judge)
    and the frozen prober, MGPO on the step data, the curriculum; the judges' weights never change."""
    from cluster.pipeline import run
    from rl import config
    from tests.cluster.test_pipeline import ROOT
    out = tmp_path / "proposer"
    cfg = config.load(ROOT / "recipes/agentic_proposer_tiny.yaml", [
        f"output_dir={out}", "model.tiny.hidden_size=48", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=96", "data.synthetic.num_train=2000", "data.synthetic.num_eval=4",
        "sft.steps=120", "sft.batch_size=32", "learner.micro_batch_size=16", "trainer.steps=2",
        "trainer.prompts_per_step=4", "trainer.eval_every=0", "rollout.n=4", "rollout.threads=1",
        "learner.threads=1", "reward.judges.verifier.threads=1", "reward.judges.prober.threads=1",
        "reward.judges.verifier.num_cpus=0", "reward.judges.prober.num_cpus=0", "reward.functions=[{name: agentic_proposing, params: {verifiers: [sympy, verifier], prober: prober, k: 4, "
        "solver_template: 'Solve: {problem}\\n', verifier_template: 'Verify: {problem} = {answer}\\n'}}]",
        "stages=[{name: model}, {name: data}, {name: sft}, {name: rl}, {name: export}, {name: agentic_proposing, "
        "params: {proposals: 16, k: 4, steps: 4, batch_size: 8, eval_max: 8, max_new_tokens: 16}}]",
        "logging.progress_bar=false", "logging.tensorboard=false"])
    summary = run(cfg)
    assert summary["steps"] == 2
    for name in ("verifier", "prober"):  # frozen: the same weights at the start and the end
        judge = summary["judges"][name]
        assert judge["model"].endswith("sft_model") and judge["weights_sha256_start"] == judge["weights_sha256_end"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        assert m["env/turns_mean"] >= 1 and "reward/agentic_proposing/has_final" in m
        assert 0 < m["env/observation_token_frac"] < 1 or m["env/turns_mean"] == 1
        assert abs(sum(v for k, v in m.items() if k.startswith("curriculum/prob/")) - 1) < 1e-6
        assert {f"curriculum/proficiency/{c}" for c in ("addition", "subtraction", "multiplication", "modular")} <= set(m)
        # the validity gate: a step whose proposals are all invalid has no reward at all, so nothing trains
        assert (m["actor/grad_norm"] > 0) == (m["reward/agentic_proposing/verified"] > 0), m
    # the solver stage: the trained proposer's episodes, scored; the valid ones with a verified solution train
    # the solver, which is evaluated before and after on the task's held-out solver set
    report = summary["agentic_proposing"]
    episodes = [json.loads(x) for x in (out / "stages" / "agentic_proposing" / "proposals.jsonl").read_text().splitlines()]
    assert report["proposals"] == len(episodes) == 16
    assert report["valid_frac"] == sum(e["valid"] for e in episodes) / 16
    sft_set = [json.loads(x) for x in (out / "stages" / "agentic_proposing" / "solver_sft_set.jsonl").read_text().splitlines()]
    assert report["sft_rows"] == len(sft_set) and report["sft_rows"] + report["unsolved"] == report["distinct_valid"]
    for row in sft_set:  # a verified solution: the answer it ends with is the problem's value
        assert evaluate(row["prompt"].removeprefix("Solve: ").strip()) == int(row["answer"])
    assert 0 <= report["solver_accuracy_before"] <= 1 and 0 <= report["solver_accuracy_after"] <= 1


def test_verdicts_and_answer_forms_of_the_real_scale_verifiers():
    from rl.methods.agentic_proposing.reward import answer_parses, final_verdict
    assert final_verdict("4 35 yes") is True and final_verdict("The steps... **Verdict: No**") is False
    assert final_verdict("Yes, at first. Verdict: no") is False and final_verdict("I cannot tell") is None
    assert answer_parses("35") and answer_parses("\\frac{1}{2}") and answer_parses("\\sqrt{2}+1")
    assert not answer_parses("n/a") and not answer_parses("") and not answer_parses("it depends")


def test_the_sympy_check_tool_runs_in_the_sandbox():
    from rl.methods.agentic_proposing.env import AgenticProposerEnv
    env = AgenticProposerEnv(timeout_s=20.0, check="sympy")
    env.reset("", {}, None)
    assert env.step("<check>binomial(5, 2) + 1 = 11</check>").observation == "<out>ok</out>\n"
    assert env.step("<check>sqrt(8) = 3</check>").observation == "<out>no</out>\n"
    broken = env.step("<check>x + = 2</check>")
    assert broken.observation == "<out>error</out>\n" and broken.failed and broken.reward == 0.0


def test_seeds_for_a_skill_library(tmp_path):
    from rl.methods.agentic_proposing.core import write_seeds
    rows = [json.loads(x) for x in open(write_seeds(SKILLS_PATH, tmp_path / "seeds.jsonl", 20, seed=1))]
    assert len(rows) == 20 and all(2 <= len(r["answer"]["skills"]) <= 3 for r in rows)
    assert all(r["category"] in r["prompt"] and "<final>Problem: ... Answer: ...</final>" in r["prompt"] for r in rows)


def test_rejection_sampling_keeps_the_first_solution_that_reaches_the_verified_answer():
    from rl.methods.agentic_proposing.stage import verified_solutions
    problems = {"(3+4)*5": "35", "9%4": "1", "2*3": "6"}
    said = ["7 30 \\boxed{30}", "7 35 \\boxed{35}", "7 35 \\boxed{35} again",  # the second is kept
            "1", "3", "2",  # a bare integer counts: the first
            "5 \\boxed{5}", "7", "x"]  # none reaches 6
    rows, unsolved = verified_solutions(problems, said, 3, "Solve: {problem}\n")
    assert unsolved == 1 and [r["prompt"] for r in rows] == ["Solve: (3+4)*5\n", "Solve: 9%4\n"]
    assert [r["target"] for r in rows] == ["7 35 \\boxed{35}", "1"] and [r["answer"] for r in rows] == ["35", "1"]


# ---------------------------------------------------------------------------------------------- answers as values
def test_tool_outputs_reflections_and_finals_are_compared_as_values_not_strings():
    # a labelled print is used by the final answer it computed
    _, steps, final = _episode(['<python>print("answer:", 6*7)</python>', "<final>Problem: 6*7 Answer: 42</final>"])
    assert steps[0].reward == 1.0 and final[0] == 1.0
    # a decimal output agrees with a reflection that states it and is used by an equivalent fraction
    _, steps, final = _episode(["<python>3/4</python>", "<think>so the value is 0.75</think>",
                                "<final>Problem: 3/4 Answer: \\frac{3}{4}</final>"])
    assert steps[0].observation == "<out>0.75</out>\n"
    assert steps[1].reward == 1.0 and final[:2] == [1.0, 1.0]
    _, steps, final = _episode(["<python>3/4</python>", "<think>\\boxed{3/4}</think>",
                                "<final>Problem: 3/4 Answer: 0.7</final>"])
    assert steps[1].reward == 1.0 and final[0] == 1.0  # used by the reflection, though the final differs
    _, steps, final = _episode(["<python>3/4</python>", "<think>so 0.8</think>", "<final>Problem: 3/4 Answer: 0.8</final>"])
    assert steps[1].reward == 0.0 and final[0] == 0.0  # 0.8 is not 0.75


def test_a_check_earns_once_per_distinct_check_and_only_when_used():
    _, steps, final = _episode(["<check>(3+4)*5=35</check>", "<check>(3+4) * 5 = 35</check>",
                                "<check>(3+4)*5=35</check>", "<check>(3+4)*5=36</check>",
                                "<final>Problem: (3+4)*5 Answer: 35</final>"])
    assert [s.observation for s in steps[:4]] == ["<out>ok</out>\n"] * 3 + ["<out>no</out>\n"]
    assert [s.reward for s in steps[:4]] == [1.0, 0.0, 0.0, 1.0]  # repeats (spacing aside) earn nothing
    assert steps[1].info["repeated"] and not steps[3].info["repeated"]
    assert final[:4] == [1.0, 0.0, 0.0, 0.0]  # 36 is never used
    _, _, final = _episode(["<check>7*5=35</check>", "<final>Problem: (3+4)*5 Answer: 35.0</final>"])
    assert final[0] == 1.0  # used by an equivalent final answer


def test_the_arithmetic_check_and_the_symbolic_verifier_accept_an_equivalent_answer():
    _, steps, _ = _episode(["<check>(3+4)*5=35.0</check>"])
    assert steps[0].observation == "<out>ok</out>\n"
    assert sympy_check("(3+4)*5", "35.0", ["+", "*"]) and not sympy_check("(3+4)*5", "35.5", ["+", "*"])


def test_the_format_bonus_is_for_any_closed_form_answer():
    from rl.methods.agentic_proposing.reward import agentic_proposing_reward
    responses = ["<final>Problem: 1/2 Answer: \\frac{1}{2}</final>", "<final>Problem: 3+4 Answer: 7</final>",
                 "<final>Problem: 3/4 Answer: 0.75</final>", "<final>Problem: x Answer: x+1</final>"]
    out = agentic_proposing_reward([""] * 4, responses, ground_truth=[{}] * 4, judges={}, verifiers=["answer_form"],
                                   prober=None)
    assert [o["format_ok"] for o in out] == [1.0, 1.0, 1.0, 0.0]
    assert [o["score"] for o in out] == [pytest.approx(1.1)] * 3 + [0.0]


class _Prober:
    """A solver that answers from a fixed list (the prober the reward asks for k samples per problem)."""

    def __init__(self, answers):
        self.answers = answers

    def generate(self, prompts, seed=0):
        return self.answers[:len(prompts)]


def test_the_probers_answers_count_when_equivalent():
    from rl.methods.agentic_proposing.reward import agentic_proposing_reward
    assert pass_rate(["0.5", "\\frac{1}{2}", "1/3", None], "1/2") == 0.5
    prober = _Prober(["so \\boxed{0.5}", "it is 1/2", "\\boxed{\\frac{2}{4}}", "\\boxed{1/3}"])
    out = agentic_proposing_reward([""], ["<final>Problem: 1/2 Answer: \\frac{1}{2}</final>"], ground_truth=[{}],
                                   judges={"prober": prober}, verifiers=["answer_form"], k=4)
    assert out[0]["pass_rate"] == 0.75 and out[0]["score"] == pytest.approx(0.1 + 1.0 + 0.25)
    boxed_only = agentic_proposing_reward([""], ["<final>Problem: 1/2 Answer: \\frac{1}{2}</final>"],
                                          ground_truth=[{}], judges={"prober": prober}, verifiers=["answer_form"],
                                          k=4, match="math_verify")
    assert boxed_only[0]["pass_rate"] == 0.5  # "it is 1/2" has no \\boxed{}


def test_rejection_sampling_keeps_a_solution_with_an_equivalent_answer():
    from rl.methods.agentic_proposing.stage import verified_solutions
    rows, unsolved = verified_solutions({"1/2 + 1/4": "\\frac{3}{4}"}, ["0.7", "so 0.75", "3/4"], 3, "{problem}")
    assert unsolved == 0 and rows[0]["target"] == "so 0.75"


def test_evaluation_is_exact_integer_arithmetic_up_to_its_bound():
    # rational=True: a decimal is read exactly (0.1 * 30 is the integer 3), not as a float that is not one
    assert evaluate("0.1*30") is None  # decimals are refused by the grammar of the arithmetic skills
    assert evaluate("(7-2)*3") == 15
    assert evaluate("1000*1000") == 10**6 and evaluate("1000*1000+1") is None  # the bound itself is allowed
    assert sympy_check("1000*1000", "1000000", ["*"])
    assert not sympy_check("1000*1000", "1000000", ["*"], max_abs=999_999)  # the caller's bound is used


def test_a_library_that_loads_skips_blank_lines_and_accepts_a_one_value_range(tmp_path):
    path = tmp_path / "skills.jsonl"
    path.write_text('{"name": "add", "category": "c", "template": "({x}+{a})", "params": {"a": [2, 2]}, '
                    '"operator": "+"}\n\n{"name": "mul", "category": "d", "template": "{x}*{a}", '
                    '"params": {"a": [3, 3]}, "operator": "*"}\n')
    skills = load_skills(path)
    assert sorted(skills) == ["add", "mul"]
    problem, values = compose([skills["add"], skills["mul"]], random.Random(0), start=(5, 5))
    assert problem == "(5+2)*3" and values == [7, 21]
    with pytest.raises(FileNotFoundError, match="skill library .*nowhere.jsonl does not exist"):
        load_skills(tmp_path / "nowhere.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="skill library .*empty.jsonl has no skills"):
        load_skills(tmp_path / "empty.jsonl")


def test_a_skill_that_makes_a_non_integer_problem_is_named():
    from rl.methods.agentic_proposing.core import Skill
    halve = Skill(name="halve", category="c", template="{x}%{a}", params={"a": [0, 0]}, operator="%")
    with pytest.raises(ValueError, match=r"skill 'halve' made '5%0', which is not an integer problem"):
        compose([halve], random.Random(0), start=(5, 5))


def test_a_block_holding_another_opening_tag_is_malformed():
    assert parse_block("<think>plan <python> later</think>") is None
    assert parse_block("<think>plan <check> later</think>") is None
    assert parse_block("<think>a </b> c</think>") is None  # a closing tag of anything inside a block
    assert parse_block("<think>a < b and c > d</think>") == ("think", "a < b and c > d")


def test_difficulty_band_and_pass_rate_hand_values():
    from rl.methods.agentic_proposing.core import difficulty_band_share
    rates = [0.0, 0.2, 0.5, 0.8, 1.0, None]
    assert difficulty_band_share(rates, (0.2, 0.8)) == pytest.approx(3 / 6)  # both ends in the band; None outside
    assert difficulty_band_share([None, None], (0.0, 1.0)) == 0.0 and difficulty_band_share([], (0.0, 1.0)) == 0.0
    assert difficulty_band_share([0.1, 0.3], (0.25, 0.5)) == pytest.approx(0.5)
    assert pass_rate([], "3") == 0.0 and pass_rate(["3", "4", None, "3.0"], "3") == pytest.approx(0.5)


def test_the_curriculum_draws_k_rows_per_call_from_its_own_stream_and_counts_the_calls():
    sampler = CurriculumSampler(["a", "a", "b", "b", "b"], seed=4, floor=0.1, ema=0.3)
    probs = sampler.probabilities()
    expected = random.Random(4 * 1_000_003 + 0)
    cats = expected.choices(list(probs), weights=list(probs.values()), k=6)
    want = [expected.choice(sampler.rows_of[c]) for c in cats]
    assert sampler.next(6) == want and sampler.draws == 1
    expected = random.Random(4 * 1_000_003 + 1)
    cats = expected.choices(list(probs), weights=list(probs.values()), k=3)
    assert sampler.next(3) == [expected.choice(sampler.rows_of[c]) for c in cats] and sampler.draws == 2


def test_the_curriculum_reads_verdicts_or_positive_rewards_by_category():
    from rl.batch import Batch
    sampler = CurriculumSampler(["a", "b"], seed=0, floor=0.1, ema=0.5, initial=0.5)

    def batch(valid, rewards, cats):
        n = len(rewards)
        b = Batch(prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                  response_ids=torch.zeros(n, 1, dtype=torch.long), response_mask=torch.ones(n, 1),
                  group_id=torch.arange(n), rewards=torch.tensor(rewards), metadata=[{"category": c} for c in cats])
        b.valid = None if valid is None else torch.tensor(valid)
        return b
    # no verdict: a reward above 0 counts as valid (0 does not, 1.0 does)
    sampler.observe(batch(None, [1.0, 0.0, 0.5, 0.0], ["a", "a", "b", "b"]))
    assert sampler.proficiency == {"a": pytest.approx(0.5), "b": pytest.approx(0.5)}
    # a verdict wins over the reward; an unknown or missing category is not counted
    metrics = sampler.observe(batch([False, True, True], [1.0, 0.0, 1.0], ["a", "b", None]))
    assert sampler.proficiency == {"a": pytest.approx(0.25), "b": pytest.approx(0.75)}
    assert metrics["curriculum/prob/a"] == pytest.approx((1 / 0.35) / (1 / 0.35 + 1 / 0.85))
    sampler.update(["zzz"], [True])
    assert set(sampler.proficiency) == {"a", "b"}


def test_seeds_name_their_skills_operators_and_first_category(tmp_path):
    from rl.methods.agentic_proposing.core import PROPOSER_PROMPT, write_seeds
    path = tmp_path / "skills.jsonl"
    path.write_text('{"name": "add", "category": "sums", "template": "({x}+{a})", "params": {"a": [1, 2]}, '
                    '"operator": "+"}\n{"name": "mul", "category": "products", "template": "{x}*{a}", '
                    '"params": {"a": [2, 3]}, "operator": "*", "description": "multiply by a"}\n')
    out = write_seeds(path, tmp_path / "deep" / "er" / "seeds.jsonl", 6, seed=2, per_seed=(2, 2))
    rows = [json.loads(x) for x in open(out)]
    library, rng = load_skills(path), random.Random(2)  # the draws, replayed
    for r in rows:
        chosen = [library[n] for n in rng.sample(sorted(library), rng.randint(2, 2))]
        lines = "\n".join(f"- {s.name} ({s.category}): {s.description or s.template}" for s in chosen)
        assert r == {"prompt": PROPOSER_PROMPT.format(skills=lines), "category": chosen[0].category,
                     "answer": {"skills": [s.name for s in chosen], "operators": [s.operator for s in chosen]}}
    assert "- add (sums): ({x}+{a})\n- mul (products): multiply by a" in "".join(r["prompt"] for r in rows)
    assert {r["category"] for r in rows} == {"sums", "products"}
    default = open(write_seeds(path, tmp_path / "default.jsonl", 6, per_seed=(2, 2))).read()
    assert default == open(write_seeds(path, tmp_path / "zero.jsonl", 6, seed=0, per_seed=(2, 2))).read()
