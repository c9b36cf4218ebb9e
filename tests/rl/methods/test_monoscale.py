"""MonoScale's trust-region memory updates (rl/methods/monoscale/README.md, rules [RECONSTRUCTION]).

The router here is a test fixture that follows the memory the way the router model is taught to (a "use"
entry for the task's type wins; an "avoid" entry excludes; otherwise the newest card that claims the type, the
cold start; registered-but-not-preferred agents only when memory says so). It tests the update rules, which
hold for any router that follows its memory."""

from __future__ import annotations

import pytest

from rl.methods.monoscale.core import (
    NOT_PREFERRED,
    AgentCard,
    MemoryEntry,
    MemoryHistory,
    RouterMemory,
    SimulatedPool,
    Task,
    distill_evidence,
    grow_pool,
    make_growing_pool,
    routing_change_rate,
    trust_region_update,
)
from rl.methods.monoscale.task import teacher_route


def follow_memory(tasks, memory, cards):
    return [teacher_route(t, memory, cards) for t in tasks]


CARDS = [AgentCard("a", "a generalist agent"), AgentCard("b", "a specialist for x")]
POOL = SimulatedPool({"a": {"x": 0.5, "y": 0.5}, "b": {"x": 0.9, "y": 0.1}}, seed=0)


def test_routing_change_rate_and_memory_text():
    assert routing_change_rate(["a", "b", "c", "d"], ["a", "c", "c", "a"]) == 0.5
    with pytest.raises(ValueError):
        routing_change_rate(["a"], [])
    m = RouterMemory().extended([MemoryEntry("b", "x", reliability=0.9),
                                 MemoryEntry("b", "y", failure_modes="y tasks", prefer=False)])
    assert m.version == 1 and m.text() == "- use b for x; reliability 0.90\n- avoid b for y; fails when y tasks"
    again = m.extended([MemoryEntry("b", "x", reliability=0.7)])  # the same (agent, when) is replaced
    assert [e.reliability for e in again.entries if e.when == "x"] == [0.7] and len(again.entries) == 2


def test_a_rejected_update_leaves_the_memory_byte_identical():
    memory = RouterMemory((MemoryEntry("a", "x"),), version=3)
    before = memory.to_json()
    validation = [Task(f"v{i}", "y") for i in range(40)]
    # routing y tasks to b (10% success against a's 50%) lowers J at every size of the candidate set
    bad = [MemoryEntry("b", "y", evidence=9), MemoryEntry("b", "y", evidence=5)]
    after, record = trust_region_update(memory, bad, follow_memory, POOL.outcomes, CARDS, validation, validation)
    assert not record.accepted and after is memory and after.to_json() == before
    assert [len(t["entries"]) for t in record.tried] == [2, 1]  # halved, then gave up
    assert record.diff == {}


def test_an_accepted_update_stays_inside_the_trust_region():
    memory = RouterMemory((MemoryEntry("a", "x"),))
    validation = [Task(f"v{i}", "x") for i in range(40)]
    replay = [Task(f"r{i}", "x") for i in range(30)] + [Task(f"s{i}", "y") for i in range(70)]
    good = [MemoryEntry("b", "x", evidence=10)]
    # routing every x task to b changes 30% of the replay choices: too much for delta 0.2 ...
    kept, rejected = trust_region_update(memory, good, follow_memory, POOL.outcomes, CARDS, validation, replay, delta=0.2)
    assert not rejected.accepted and rejected.change_rate == pytest.approx(0.3) and kept is memory
    # ... and within delta 0.35, where J rises
    new, accepted = trust_region_update(memory, good, follow_memory, POOL.outcomes, CARDS, validation, replay, delta=0.35)
    assert accepted.accepted and accepted.change_rate <= 0.35 and accepted.j_after >= accepted.j_before
    assert accepted.diff["added"] == ["use b for x"] and new.version == memory.version + 1


def test_distillation_orders_candidates_by_evidence():
    tasks = [Task(f"t{i}", "x") for i in range(6)] + [Task(f"u{i}", "y") for i in range(4)]
    evidence = [(t, "b", 1.0) for t in tasks[:6]] + [(t, "a", 0.0) for t in tasks[:6]]
    evidence += [(t, "b", 0.0) for t in tasks[6:]] + [(t, "a", 1.0) for t in tasks[6:]]
    entries = distill_evidence(evidence, "b", {"x": "a", "y": "a"})
    assert [(e.when, e.prefer, e.evidence) for e in entries] == [("x", True, 12), ("y", False, 8)]
    assert entries[1].failure_modes == "y tasks (0% success)"


def _drops(curve, eps):
    return any(b < a - eps for a, b in zip(curve, curve[1:]))


def test_the_trust_region_guarantees_no_drop_where_naive_growth_and_accepting_every_update_drop(tmp_path):
    """100 seeds of a pool growing from 3 to 10 agents (rl/methods/monoscale/README.md's property test). What
    MonoScale guarantees is no drop from one round to the next: the same rounds without the trust region
    (`accept_all`) and naive growth both drop on many seeds. Ending highest is not guaranteed (accept_all and
    naive end above MonoScale on most seeds of this harness), so it is not asserted."""
    drops, finals = {m: 0 for m in ("monoscale", "accept_all", "naive")}, []
    eps = 0.05  # the held-out estimate's error at 300 test tasks (2 standard errors of a rate near 0.5 is 0.058)
    for seed in range(100):
        pool, cards, kinds = make_growing_pool(seed)
        history = MemoryHistory(tmp_path / str(seed) if seed == 0 else None)
        runs = {m: grow_pool(m, follow_memory, pool, cards, kinds, seed=seed, history=history if m == "monoscale"
                             else None) for m in ("monoscale", "accept_all", "naive", "fixed")}
        for mode in drops:
            drops[mode] += _drops(runs[mode]["j"], eps)
        for u in runs["monoscale"]["updates"]:  # every accepted update passed both tests of the trust region
            assert not u["accepted"] or (u["change_rate"] <= 0.2 and u["j_after"] >= u["j_before"])
        assert runs["monoscale"]["j"][-1] >= runs["fixed"]["j"][-1] - eps
        finals.append((runs["monoscale"]["j"][-1], runs["fixed"]["j"][-1]))
    assert drops["monoscale"] <= 2 and drops["accept_all"] >= 10 and drops["naive"] >= 30, drops
    assert sum(m for m, _ in finals) / 100 > sum(f for _, f in finals) / 100 + 0.05  # the grown pool helps
    logged = (tmp_path / "0" / "updates.jsonl").read_text().splitlines()
    assert len(logged) == 7  # one decision per joining agent, accepted or not


def test_accept_all_takes_the_update_the_trust_region_refuses():
    memory = RouterMemory((MemoryEntry("a", "x"),), version=3)
    validation = [Task(f"v{i}", "y") for i in range(40)]
    bad = [MemoryEntry("b", "y", evidence=9)]  # b succeeds on 10% of y tasks, a on 50%
    from rl.methods.monoscale.core import accept_update
    kept, refused = trust_region_update(memory, bad, follow_memory, POOL.outcomes, CARDS, validation, validation)
    taken, record = accept_update(memory, bad, follow_memory, POOL.outcomes, CARDS, validation, validation)
    assert kept is memory and not refused.accepted
    assert record.accepted and taken.version == 4 and record.change_rate == 1.0 and record.j_after < record.j_before
    assert record.diff == {"added": ["use b for y"], "removed": []}
    assert accept_update(memory, [], follow_memory, POOL.outcomes, CARDS, validation, validation)[0] is memory


def test_the_lm_router_reads_the_first_agent_name_it_says():
    from rl.methods.monoscale.core import LMRouter, router_prompt
    cards = [AgentCard(f"agent{i}", "a generalist agent") for i in range(11)]
    said = iter([["agent10, then agent1", "I would pick agent3", "nobody"]])
    router = LMRouter(lambda prompts: next(said))
    tasks = [Task("t1", "type0"), Task("t2", "type1"), Task("t3", "type2")]
    assert router(tasks, RouterMemory(), cards) == ["agent10", "agent3", ""]
    memory = RouterMemory().extended([MemoryEntry("agent3", "type0"), MemoryEntry("agent1", "type1", prefer=False)])
    prompt = router_prompt(tasks[0], memory, cards[:2])
    assert prompt == ("Task (type0): \nMemory:\n- use agent3 for type0\nAgents:\n- agent0: a generalist agent\n"
                      "- agent1: a generalist agent\nAgent:")  # only the entries about the task's type
    assert "avoid agent1 for type1" in router_prompt(Task("t4", ""), memory, cards[:2])  # no type: all of them


def test_the_router_task_teaches_reading_the_context():
    from rl.methods.monoscale.task import random_context, router_rows
    rows = router_rows(300, 0)
    targets = {r["target"] for r in rows}
    assert len(targets) >= 8  # the answer depends on the context, not on a fixed favourite
    import random as _random
    rng = _random.Random(1)
    for _ in range(200):
        cards, memory = random_context(rng)
        task = Task("t", rng.choice([f"type{i}" for i in range(6)]))
        choice = teacher_route(task, memory, cards)
        uses = [e.agent for e in memory.entries if e.when == task.kind and e.prefer]
        if uses:
            assert choice == uses[-1]  # a use entry for the task's type wins, the newest one
        else:
            assert NOT_PREFERRED not in next(c.description for c in cards if c.name == choice) or choice == cards[0].name


@pytest.mark.extended  # CI: the stage through Ray with real agents (test_the_monoscale_stage_onboards_real_agents...)
@pytest.mark.slow
def test_the_monoscale_stage_grows_the_pool_with_a_router_model_served_by_ray(ray_cluster, tmp_path):
    """Through Ray: the tiny recipe's SFT (shortened) teaches the router, the stage serves it from a frozen engine
    actor and grows the simulated pool under every mode, logging one memory decision per joining agent."""
    import json

    from cluster.pipeline import run
    from rl import config
    from tests.cluster.test_pipeline import ROOT
    out = tmp_path / "ms"
    cfg = config.load(ROOT / "recipes/monoscale_tiny.yaml", [
        f"output_dir={out}", "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=64", "data.synthetic.num_train=300", "data.synthetic.num_eval=10",
        "sft.steps=20", "sft.batch_size=16", "learner.micro_batch_size=16", "learner.threads=1",
        # the distillation and the familiarization tasks written by a model too (the taught router's weights serve
        # as that model: its lines rarely parse, which the round must survive)
        "reward.judges={writer: {threads: 1, num_cpus: 0, max_new_tokens: 24}}",
        "stages=[{name: model}, {name: data}, {name: sft}, {name: monoscale, params: {final: 6, test_size: 40, "
        "replay_size: 16, n_familiarization: 8}}, {name: monoscale, label: written, params: {final: 5, test_size: 20, "
        "replay_size: 8, n_familiarization: 4, modes: [monoscale], distiller: writer, familiarizer: writer}}]",
        "logging.progress_bar=false", "logging.tensorboard=false"])
    summary = run(cfg)
    assert {m: len(js) for m, js in summary["monoscale"].items()} == {"monoscale": 4, "accept_all": 4, "naive": 4,
                                                                       "fixed": 4}
    stage = out / "stages" / "monoscale"
    report = json.loads((stage / "report.json").read_text())
    updates = [json.loads(x) for x in (stage / "memory" / "updates.jsonl").read_text().splitlines()]
    assert len(updates) == 3 == len(report["runs"]["monoscale"]["updates"])  # agents 4, 5 and 6 joined
    for u in updates:
        assert not u["accepted"] or u["change_rate"] <= 0.2
    accepted = [u for u in updates if u["accepted"]]
    assert len(list((stage / "memory").glob("memory_v*.json"))) == len(accepted)
    assert (stage / "router_memory.json").read_text() == report["runs"]["monoscale"]["memory"]
    assert len(summary["written"]["monoscale"]) == 3  # two rounds with model-written tasks and entries


def _pool(tmp_path):
    import json
    pool = tmp_path / "pool.json"
    pool.write_text(json.dumps([
        {"name": "agent1", "description": "a generalist agent", "kind": "python", "code": "print(-1)"},
        {"name": "agent10", "description": "a specialist for sums", "kind": "python", "code": "print(eval(TASK))"}]))
    return pool


def test_the_router_env_runs_the_named_agent_and_judges_its_answer(tmp_path):
    from rl.methods.monoscale.env import AgentRouterEnv
    memory = tmp_path / "memory.json"
    memory.write_text(RouterMemory().extended([MemoryEntry("agent10", "sum")]).to_json())
    env = AgentRouterEnv(str(_pool(tmp_path)), str(memory))
    row = {"subtasks": [{"text": "2+3", "kind": "sum", "answer": "5"}, {"text": "4+4", "kind": "sum", "answer": "8"},
                        {"text": "1+1", "kind": "sum", "answer": "2"}]}
    first = env.reset("ignored", row, None)
    assert first.startswith("Task (sum): 2+3\nMemory:\n- use agent10 for sum\nAgents:") and first.endswith("\nAgent:")
    right = env.step(" agent10")
    assert right.reward == 1.0 and right.info == {"agent": "agent10", "answer": "5"} and not right.done
    assert "Task (sum): 4+4\nMemory:" in right.observation and right.step_type == "route"
    wrong = env.step("agent1")  # the generalist answers -1
    assert wrong.reward == 0.0 and wrong.info["agent"] == "agent1"
    nobody = env.step("I do not know")
    assert nobody.reward == 0.0 and nobody.info["agent"] is None and nobody.done


@pytest.mark.parametrize("agents, message", [
    ([], "non-empty JSON list"),
    ([{"name": "a", "kind": "python", "code": "print(1)"}], r"agent 0 has no \['description'\]"),
    ([{"name": "a", "description": "d", "kind": "api"}], r"agent 0 \(a\): kind must be model or python"),
    ([{"name": "a", "description": "d", "kind": "python"}], r"agent 0 \(a\): a python agent needs 'code'"),
])
def test_a_bad_agent_pool_names_the_file_and_agent(tmp_path, agents, message):
    import json

    from rl.methods.monoscale.env import load_pool
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(agents))
    with pytest.raises(ValueError, match=message):
        load_pool(path)


def test_memory_lines_round_trip_and_the_lm_distiller_reads_a_models_entries():
    from rl.methods.monoscale.core import LMDistiller, parse_memory_lines
    entries = [MemoryEntry("agent4", "type2", reliability=0.85),
               MemoryEntry("agent4", "type5", failure_modes="type5 tasks (10% success)", reliability=0.1, prefer=False),
               MemoryEntry("agent0", "type1", interface="JSON in")]
    text = RouterMemory().extended(entries).text() + "\n- use agent99 for type0\nnot an entry"
    assert parse_memory_lines(text, {"agent0", "agent4"}) == entries  # unknown agents and prose are dropped
    asked = []

    def canned_reply(prompts):  # a fixed model answer: this checks the prompt and the parsing
        asked.extend(prompts)
        return ["- use agent4 for TYPE2; reliability 0.9\n- avoid agent4 for type5; fails when always"]
    tasks = [Task(f"t{i}", "type2") for i in range(3)] + [Task("u", "type5")]
    evidence = [(t, "agent4", 1.0) for t in tasks[:3]] + [(t, "agent0", 0.0) for t in tasks[:3]]
    evidence += [(tasks[3], "agent4", 0.0), (tasks[3], "agent0", 1.0)]
    out = LMDistiller(canned_reply)(evidence, "agent4", {"type2": "agent0", "type5": "agent0"})
    assert "type2: 3/3; agent0 0/3\ntype5: 0/1; agent0 1/1" in asked[0]
    assert [(e.when, e.prefer, e.evidence) for e in out] == [("type2", True, 6), ("type5", False, 2)]


def test_the_lm_familiarizer_reads_typed_task_lines():
    import random as _random

    from rl.methods.monoscale.core import LMFamiliarizer
    asked = []

    def canned_reply(prompts):  # a fixed model answer: this checks the prompt and the parsing
        asked.extend(prompts)
        return ["type2: sum the column\nnonsense line\ntype9: unknown type\ntype0: route this elsewhere\ntype2: more"]
    samples = [Task(f"s{i}", "type1", f"sample {i}") for i in range(3)]
    tasks = LMFamiliarizer(canned_reply, samples)(AgentCard("agent4", "a specialist for type2"),
                                                   ["type0", "type1", "type2"], 2, _random.Random(0))
    assert [(t.kind, t.text) for t in tasks] == [("type2", "sum the column"), ("type0", "route this elsewhere")]
    assert "agent4: a specialist for type2" in asked[0] and "type1: sample 0" in asked[0] and "Write 2 tasks" in asked[0]


def tool_agents():
    """The python agents of the tiny recipe's pool of real agents (rl/methods/monoscale/task.py's typed arithmetic
    tasks): agent0 answers right when the text has an odd length (a square's `^` is Python's xor), agent1 reads
    products as sums, agent2 always says 1; agent3 solves products, agent4 divides (a decimal answer to a
    fraction's reference), agent5 claims sums and is off by one, agent7 squares, agent8 solves differences and
    remainders, agent9 claims remainders and says 0."""
    import json

    from tests.cluster.test_pipeline import ROOT
    agents = json.loads((ROOT / "recipes/monoscale_tiny_agents.json").read_text())
    return [a for a in agents if a["kind"] == "python"]


def test_real_agents_are_run_once_per_task_and_judged_by_equivalence():
    from rl.methods.monoscale.core import AgentPool, answer_matches
    from rl.methods.monoscale.env import run_tool_agent
    calls = []

    def answering(agent):
        def run(texts):
            calls.extend((agent["name"], t) for t in texts)
            return [run_tool_agent(agent, t) for t in texts]
        return run
    pool = AgentPool({a["name"]: answering(a) for a in tool_agents()}, answer_matches)
    tasks = [Task("r", "ratio", "3/4", "\\frac{3}{4}"), Task("p", "product", "6*7", "42"),
             Task("s", "sum", "5+8", "13")]
    assert pool.outcomes(tasks, ["agent4", "agent3", "agent5"]) == [1.0, 1.0, 0.0]  # 0.75 is \frac{3}{4}
    assert pool.seen[("r", "agent4")] == ("0.75", 1.0) and pool.seen[("s", "agent5")] == ("14", 0.0)
    assert pool.outcomes(tasks, ["agent4", "agent1", ""]) == [1.0, 0.0, 0.0]  # 6+7; naming nobody scores 0
    assert calls == [("agent4", "3/4"), ("agent3", "6*7"), ("agent5", "5+8"), ("agent1", "6*7")]  # each pair once
    assert answer_matches("so it is \\boxed{0.5}", "\\frac{1}{2}") and not answer_matches("0.5", "\\frac{1}{3}")
    assert answer_matches("7 apples", "7", "contains") and not answer_matches("7.0", "7", "exact")
    assert not answer_matches("", "")  # an empty reference is never answered


# CI: real agents onboarded by the stage through Ray (test_the_monoscale_stage_onboards_real_agents_served_by_ray),
# each mode's growth on the simulated pool (test_the_trust_region_guarantees_no_drop_where_naive_growth_...)
@pytest.mark.extended
def test_a_real_pool_grows_with_tool_agents_under_every_mode():
    """The starting pool's J is the hand-computed share of test tasks its router choice (agent0: no generalist
    claims a type) answers; the product specialist earns a use entry once the evidence shows it; the agents whose
    claims do not hold never do, and lower naive growth's J when they join."""
    from rl.methods.monoscale.core import AgentPool, answer_matches
    from rl.methods.monoscale.env import run_tool_agent
    from rl.methods.monoscale.task import typed_arithmetic_rows

    def to_tasks(rows, split):
        return [Task(f"{split}-{i}", r["kind"], r["prompt"], r["answer"]) for i, r in enumerate(rows)]
    test, train = to_tasks(typed_arithmetic_rows(36, 1), "test"), to_tasks(typed_arithmetic_rows(120, 2), "train")
    replay, bank = train[:12], {}  # two tasks of each type: one type's routing changes 1/6 of the replay
    for t in train[12:]:
        bank.setdefault(t.kind, []).append(t)
    agents = tool_agents()
    def answering(agent):
        return lambda texts: [run_tool_agent(agent, t) for t in texts]
    pool = AgentPool({a["name"]: answering(a) for a in agents}, answer_matches)
    cards = [AgentCard(a["name"], a["description"]) for a in agents]
    runs = {m: grow_pool(m, follow_memory, pool, cards, [f"type{i}" for i in range(6)], test=test, replay=replay,
                         bank=bank, n_familiarization=8) for m in ("monoscale", "accept_all", "naive", "fixed")}
    by_hand = sum(len(t.text) % 2 == 1 and t.kind != "type4" for t in test) / len(test)
    assert runs["fixed"]["j"] == [by_hand] * 7
    for mode in ("monoscale", "accept_all"):
        assert runs[mode]["j"][0] == by_hand and len(runs[mode]["updates"]) == 6
        added = [line for u in runs[mode]["updates"] for line in u["diff"].get("added", [])]
        assert any(line.startswith("use agent3 for type1") for line in added), added
        assert not any(line.startswith(("use agent5", "use agent9")) for line in added), added
    assert runs["monoscale"]["j"][-1] > by_hand + 0.1  # specialists took their types
    assert all(b >= a for a, b in zip(runs["monoscale"]["j"], runs["monoscale"]["j"][1:])), runs["monoscale"]["j"]
    naive = runs["naive"]["j"]  # agent5 joins at index 3, agent9 at index 6: each takes its type and fails it
    assert naive[3] < naive[2] and naive[6] < naive[5], naive


def test_the_monoscale_stage_onboards_real_agents_served_by_ray(ray_cluster, tmp_path):
    """Through Ray: the tiny recipe's pool of real agents (python tools in the sandbox and a model agent served by
    the `solver` engine) grows under MonoScale and naive growth on the data's typed arithmetic tasks; every output
    is recorded with its judged outcome. The router is the untrained model (the recipe's SFT warm-up is left out:
    this is the plumbing; the extended test above serves an SFT-taught router)."""
    import json

    from cluster.pipeline import run
    from rl import config
    from rl.methods.monoscale.core import answer_matches
    from tests.cluster.test_pipeline import ROOT
    out = tmp_path / "msa"
    cfg = config.load(ROOT / "recipes/monoscale_tiny.yaml", [
        f"output_dir={out}", "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=64", "data.synthetic.num_train=64", "data.synthetic.num_eval=4",
        "stages=[{name: model}, {name: data}, {name: monoscale, params: {agents: "
        f"{ROOT}/recipes/monoscale_tiny_agents.json, modes: [monoscale, naive], test_size: 12, replay_size: 12, "
        "n_familiarization: 4}}]", "logging.progress_bar=false", "logging.tensorboard=false"])
    summary = run(cfg)
    assert {m: len(js) for m, js in summary["monoscale"].items()} == {"monoscale": 8, "naive": 8}  # 3 -> 10 agents
    report = json.loads((out / "stages" / "monoscale" / "report.json").read_text())
    assert len(report["runs"]["monoscale"]["updates"]) == 7 and report["kinds"] == [f"type{i}" for i in range(6)]
    rows = [json.loads(x) for x in (out / "data" / "monoscale_tasks_eval.jsonl").read_text().splitlines()]
    reference = {f"eval-{i}": r for i, r in enumerate(rows)} | {f"train-{i}": r for i, r in enumerate(
        json.loads(x) for x in (out / "data" / "monoscale_tasks_train.jsonl").read_text().splitlines())}
    by_agent = {}
    for a in report["answers"]:
        row = reference[a["task"]]
        assert a["outcome"] == float(answer_matches(a["output"], row["answer"])), a
        by_agent.setdefault(a["agent"], []).append((row, a["output"]))
    assert "agent6" in by_agent  # the model agent answered through its engine (in forced exploration at least)
    for row, said in by_agent.get("agent3", []):  # the product tool evaluates the task
        assert said == str(eval(row["prompt"]))


def test_the_history_logs_every_update_and_keeps_accepted_versions_on_disk(tmp_path):
    import hashlib
    import json

    from rl.methods.monoscale.core import UpdateRecord
    history = MemoryHistory(tmp_path / "deep" / "history")
    memory = RouterMemory().extended([MemoryEntry("b", "x", reliability=0.9)])
    accepted = UpdateRecord("b", True, 0.5, 0.7, 0.1, [{"entries": ["use b for x"], "j": 0.7, "change_rate": 0.1}])
    rejected = UpdateRecord("c", False, 0.7, 0.4, 0.5, [])
    history.record(1, memory, accepted)
    history.record(2, memory, rejected)
    sha = hashlib.sha256(memory.to_json().encode()).hexdigest()
    assert history.log[0] == {"round": 1, "agent": "b", "accepted": True, "j_before": 0.5, "j_after": 0.7,
                              "change_rate": 0.1, "tried": accepted.tried, "diff": {}, "version": 1,
                              "memory_sha256": sha}
    assert history.log[1]["round"] == 2 and history.log[1]["accepted"] is False
    assert history.versions == [memory.to_json()]  # only the accepted version
    lines = [json.loads(x) for x in (tmp_path / "deep" / "history" / "updates.jsonl").read_text().splitlines()]
    assert lines == history.log
    assert (tmp_path / "deep" / "history" / "memory_v1.json").read_text() == memory.to_json()


def test_simulated_outcomes_are_the_seeded_hash_draws_and_unknowns_never_succeed():
    import hashlib
    pool = SimulatedPool({"a": {"x": 0.5}}, seed=3)
    for i in range(20):
        task = Task(f"t{i}", "x")
        h = hashlib.sha256(f"3|t{i}|a".encode()).digest()
        assert pool.outcome(task, "a") == float(int.from_bytes(h[:8], "big") / 2**64 < 0.5)
        assert pool.outcome(task, "nobody") == 0.0 and pool.outcome(Task(f"t{i}", "y"), "a") == 0.0
    assert sum(pool.outcome(Task(f"t{i}", "x"), "a") for i in range(200)) not in (0.0, 200.0)


def test_a_growing_pool_hand_checked_from_its_seed():
    import random
    pool, cards, types = make_growing_pool(5, kinds=4, start=2, final=6, unreliable_share=0.5)
    assert types == ["type0", "type1", "type2", "type3"] and pool.seed == 5
    assert [c.description for c in cards[:2]] == ["a generalist agent"] * 2
    rng = random.Random(5)  # the draws, replayed
    for i in range(6):
        if i < 2:
            want = {t: rng.uniform(0.45, 0.65) for t in types}
            assert pool.probs[f"agent{i}"] == want
            continue
        strong = rng.sample(types, rng.choice([1, 2]))
        unreliable = rng.random() < 0.5
        want = {t: (rng.uniform(0.3, 0.55) if unreliable else rng.uniform(0.8, 0.95)) if t in strong
                else rng.uniform(0.05, 0.3) for t in types}
        assert pool.probs[f"agent{i}"] == want and cards[i].description == f"a specialist for {' and '.join(strong)}"
    assert make_growing_pool(5, kinds=4, start=2, final=6)[0].probs == make_growing_pool(5, kinds=4, start=2,
                                                                                           final=6)[0].probs
    # the defaults: six task types, three generalists, ten agents, a share of 0.3 unreliable specialists
    pool, cards, types = make_growing_pool(0)
    assert len(types) == 6 and len(cards) == 10
    assert [c.description for c in cards].count("a generalist agent") == 3 and cards[3].description != cards[2].description


def test_claimed_kinds_match_whole_words_in_any_case_longest_first():
    from rl.methods.monoscale.core import claimed_kinds
    kinds = ["Algebra", "Intermediate Algebra", "Geometry"]
    assert claimed_kinds(AgentCard("a", "solves intermediate algebra"), kinds) == ["Intermediate Algebra"]
    assert claimed_kinds(AgentCard("a", "ALGEBRA and geometry"), kinds) == ["Algebra", "Geometry"]
    assert claimed_kinds(AgentCard("a", "Intermediate Algebra, then Algebra"), kinds) == ["Algebra",
                                                                                         "Intermediate Algebra"]
    assert claimed_kinds(AgentCard("a", "geometryX"), kinds) == []


def test_an_answer_match_names_the_choices_and_a_pool_names_a_miscounting_agent():
    from rl.methods.monoscale.core import AgentPool, answer_matches
    with pytest.raises(ValueError, match=r"answer match must be one of math, exact, contains, got 'fuzzy'"):
        answer_matches("1", "1", "fuzzy")
    pool = AgentPool({"a": lambda texts: ["1"]}, lambda out, ref: out == ref)
    with pytest.raises(RuntimeError, match="agent a: 1 answers to 2 tasks"):
        pool.outcomes([Task("t0", "x", "q0", "1"), Task("t1", "x", "q1", "1")], ["a", "a"])


def test_the_router_prompt_and_the_first_named_agent():
    from rl.methods.monoscale.core import LMRouter, first_agent_named, router_prompt
    cards = [AgentCard("agent1", "sums"), AgentCard("agent10", "products")]
    memory = RouterMemory().extended([MemoryEntry("agent1", "x"), MemoryEntry("agent10", "y")])
    prompt = router_prompt(Task("t", "x", "2+2"), memory, cards)
    assert "- agent1: sums\n- agent10: products" in prompt and "- use agent1 for x" in prompt
    assert "agent10 for y" not in prompt and "(empty)" in router_prompt(Task("t", "z"), memory, cards)
    assert first_agent_named("agent10 then agent1", ["agent1", "agent10"]) == "agent10"
    assert first_agent_named("agent1, not agent10", ["agent1", "agent10"]) == "agent1"
    asked = []
    route = LMRouter(lambda prompts: asked.extend(prompts) or ["agent10"] * len(prompts))
    assert route([Task("t", "x", "2+2")], memory, cards) == ["agent10"] and asked == [prompt]


def test_memory_lines_after_a_foreign_line_still_parse():
    from rl.methods.monoscale.core import parse_memory_lines
    text = "- use nobody for x\n- use a for y; reliability 0.5\n- avoid b for z"
    assert parse_memory_lines(text, {"a", "b"}) == [MemoryEntry("a", "y", reliability=0.5),
                                                   MemoryEntry("b", "z", prefer=False)]


def test_the_lm_distiller_counts_missing_evidence_as_empty_and_keeps_an_unknown_type_as_written():
    from rl.methods.monoscale.core import LMDistiller
    asked = []

    def reply(prompts):
        asked.extend(prompts)
        return ["- use new for X; reliability 0.9\n- use new for elsewhere"]
    tasks = [Task("t0", "x"), Task("t1", "x"), Task("u0", "w")]
    evidence = [(tasks[0], "new", 1.0), (tasks[1], "new", 1.0), (tasks[2], "old", 1.0)]
    out = LMDistiller(reply)(evidence, "new", {"x": "old"})
    assert "Evidence about agent new " in asked[0]
    assert "w: 0/0; none 0/0\nx: 2/2; old 0/0" in asked[0]  # no evidence of the new agent, no incumbent named
    assert [(e.when, e.evidence) for e in out] == [("x", 2), ("elsewhere", 0)]  # a type the model made up: 0 tries


def test_the_lm_familiarizer_shows_eight_samples_a_line_each_and_gives_fresh_task_ids():
    import random

    from rl.methods.monoscale.core import LMFamiliarizer
    asked = []

    def reply(prompts):
        asked.extend(prompts)
        return ["type1: what is 2:3 as a ratio\ntype1: again"]
    samples = [Task(f"s{i}", "type1", f"sample {i}") for i in range(10)]
    tasks = LMFamiliarizer(reply, samples)(AgentCard("agent4", "ratios"), ["type1"], 5, random.Random(0))
    shown = random.Random(0).sample(samples, 8)
    assert "\n".join(f"{t.kind}: {t.text}" for t in shown) in asked[0] and asked[0].count("type1: sample") == 8
    assert [(t.kind, t.text) for t in tasks] == [("type1", "what is 2:3 as a ratio"), ("type1", "again")]
    rng = random.Random(0)
    rng.sample(samples, 8)
    assert [t.id for t in tasks] == [f"fam-agent4-{rng.randrange(10**9)}" for _ in range(2)]


def test_specialists_claim_one_or_two_types_named_with_and():
    counts = set()
    for seed in range(6):
        _, cards, _ = make_growing_pool(seed)
        for card in cards[3:]:
            named = card.description.removeprefix("a specialist for ").split(" and ")
            assert all(n.startswith("type") for n in named) and len(named) in (1, 2)
            counts.add(len(named))
    assert counts == {1, 2}


def test_familiarization_draws_claimed_types_and_interference_from_the_others():
    import random

    from rl.methods.monoscale.core import familiarization_tasks
    kinds = ["type0", "type1", "type2"]
    card = AgentCard("a", "a specialist for type1")
    tasks = familiarization_tasks(card, kinds, 12, random.Random(3), start_id=5, interference_share=0.5)
    rng = random.Random(3)  # the draws, replayed: claimed ["type1"], others ["type0", "type2"]
    want = [rng.choice(["type0", "type2"]) if rng.random() < 0.5 else rng.choice(["type1"]) for _ in range(12)]
    assert [t.kind for t in tasks] == want and [t.id for t in tasks] == [f"fam-a-{5 + i}" for i in range(12)]
    # a card that claims no known type draws from every type; one that claims every type interferes with every type
    none = familiarization_tasks(AgentCard("b", "a generalist agent"), kinds, 30, random.Random(0))
    assert {t.kind for t in none} == set(kinds)
    every = familiarization_tasks(AgentCard("c", "type0, type1 and type2"), kinds, 30, random.Random(0))
    assert {t.kind for t in every} == set(kinds)


def test_the_router_prompt_of_an_empty_memory():
    from rl.methods.monoscale.core import router_prompt
    prompt = router_prompt(Task("t", "x", "2+2"), RouterMemory(), [AgentCard("a", "sums")])
    assert prompt == "Task (x): 2+2\nMemory:\n(empty)\nAgents:\n- a: sums\nAgent:"


def test_onboarding_defaults_and_the_callers_distiller():
    import random

    from rl.methods.monoscale.core import onboard
    cards = [AgentCard("a", "a generalist agent")]
    new = AgentCard("b", "a specialist for x")
    replay = [Task(f"r{i}", "y") for i in range(6)]
    args = (RouterMemory(), new, cards, follow_memory, POOL.outcomes, replay, ["x", "y"])
    default = onboard(*args, random.Random(1))
    explicit = onboard(*args, random.Random(1), n_familiarization=16, delta=0.2, tolerance=0.0, margin=0.1,
                       trust_region=True)
    assert default.memory == explicit.memory and default.update == explicit.update
    assert default.evidence == explicit.evidence and len(default.evidence) == 2 * 16  # 16 explored, twice each
    rng = random.Random(1)
    from rl.methods.monoscale.core import familiarization_tasks
    first = familiarization_tasks(new, ["x", "y"], 32, rng, start_id=rng.randrange(10**9))  # as onboard draws them
    assert [e[0] for e in default.evidence[::2]] == [t.id for t in first[:16]]
    seen = []

    def distill(evidence, new_agent, incumbents):
        seen.append((len(evidence), new_agent, incumbents))
        return [MemoryEntry("b", "x", reliability=1.0)]
    out = onboard(*args, random.Random(1), distill=distill, tolerance=1.0, delta=1.0)
    assert seen == [(32, "b", {"x": "a", "y": "a"})] and out.memory.entries == (MemoryEntry("b", "x", reliability=1.0),)


def test_the_router_sees_agents_it_was_never_told_to_use_as_registered_but_not_preferred():
    from rl.methods.monoscale.core import shown_cards
    cards = [AgentCard("calc", "adds numbers", "a+b"), AgentCard("search", "finds facts", "query"),
             AgentCard("new", "solves puzzles", "grid"), AgentCard("avoided", "writes code", "spec")]
    memory = RouterMemory((MemoryEntry("search", "facts"), MemoryEntry("avoided", "code", prefer=False)))
    shown = shown_cards(cards, memory, trusted={"calc"})
    assert shown[:2] == cards[:2]  # trusted from the start, and told to use
    assert shown[2:] == [AgentCard("new", "solves puzzles" + NOT_PREFERRED, "grid"),
                         AgentCard("avoided", "writes code" + NOT_PREFERRED, "spec")]
    assert shown_cards(cards, RouterMemory(), trusted=set()) == [
        AgentCard(c.name, c.description + NOT_PREFERRED, c.interface) for c in cards]


def test_the_held_out_and_replay_sets_default_to_the_papers_300_and_48_tasks():
    pool, cards, kinds = make_growing_pool(0)
    seen: list[list] = []

    def route(tasks, memory, shown):
        seen.append([t.id for t in tasks])
        return follow_memory(tasks, memory, shown)
    grow_pool("fixed", route, pool, cards, kinds)
    assert {len(names) for names in seen} == {300} and seen[0] == [f"test-{i}" for i in range(300)]
    seen.clear()
    grow_pool("monoscale", route, pool, cards[:4], kinds)  # one onboarding round: 16 familiarization tasks
    ids = {i for names in seen for i in names}
    assert {i for i in ids if i.startswith("replay-")} == {f"replay-{i}" for i in range(48)}
    assert [len(names) for names in seen] == [300, 16, 16 + 48, 48, 16 + 48, 48, 300]
    with pytest.raises(ValueError, match=r"^mode must be one of monoscale, accept_all, naive, fixed, got 'grow'$"):
        grow_pool("grow", route, pool, cards, kinds)


def test_a_growth_run_is_fixed_by_its_seed_and_uses_the_task_sets_it_is_given():
    pool, cards, kinds = make_growing_pool(3)
    runs = [grow_pool("monoscale", follow_memory, pool, cards[:5], kinds, seed=s, test_size=60) for s in (4, 4, 5)]
    assert runs[0] == runs[1] and runs[0]["j"] != runs[2]["j"]
    seen: set[str] = set()

    def route(tasks, memory, shown):
        seen.update(t.id for t in tasks)
        return follow_memory(tasks, memory, shown)
    replay = [Task(f"mine-{i}", kinds[i % len(kinds)]) for i in range(10)]
    test = [Task(f"held-{i}", kinds[i % len(kinds)]) for i in range(20)]
    grow_pool("monoscale", route, pool, cards[:4], kinds, test=test, replay=replay)
    assert {i for i in seen if not i.startswith("fam-")} == {t.id for t in replay + test}


def test_each_onboarding_round_gets_the_runs_trust_region_hooks_and_pool():
    from rl.methods.monoscale.core import familiarization_tasks
    pool, cards, kinds = make_growing_pool(2)
    base = grow_pool("monoscale", follow_memory, pool, cards[:7], kinds, seed=2, test_size=60)
    wide = grow_pool("monoscale", follow_memory, pool, cards[:7], kinds, seed=2, test_size=60, delta=0.5)
    strict = grow_pool("monoscale", follow_memory, pool, cards[:7], kinds, seed=2, test_size=60, tolerance=-0.3)
    assert any(u["accepted"] for u in base["updates"]) and not any(u["accepted"] for u in strict["updates"])
    assert not any(u["accepted"] and u["change_rate"] > 0.2 for u in base["updates"])
    assert any(u["accepted"] and u["change_rate"] > 0.2 for u in wide["updates"])
    calls: dict[str, list] = {"familiarize": [], "distill": [], "explore_pool": []}

    def familiarize(card, ks, n, rng):
        calls["familiarize"].append((card.name, n))
        return familiarization_tasks(card, ks, n, rng)

    def distill(evidence, new_agent, incumbents):
        calls["distill"].append(new_agent)
        return distill_evidence(evidence, new_agent, incumbents)

    def route(tasks, memory, shown):
        if len(tasks) == 6:  # the explored half of a round's familiarization tasks
            calls["explore_pool"].append([c.name for c in shown])
        return follow_memory(tasks, memory, shown)
    history = MemoryHistory()
    run = grow_pool("monoscale", route, pool, cards[:6], kinds, seed=2, test_size=60, n_familiarization=6,
                    familiarize=familiarize, distill=distill, history=history)
    new = [c.name for c in cards[3:6]]
    assert calls["familiarize"] == [(name, 12) for name in new] and calls["distill"] == new
    assert calls["explore_pool"] == [[c.name for c in cards[:k]] for k in (3, 4, 5)]
    assert [e["round"] for e in history.log] == [1, 2, 3] and [e["agent"] for e in history.log] == new
    assert set(run) == {"mode", "j", "updates", "memory"} and run["mode"] == "monoscale"
    accepted = [e for e in history.log if e["accepted"]]
    assert run["memory"] == (history.versions[-1] if accepted else RouterMemory().to_json())


def test_accepting_every_update_records_what_it_took():
    from rl.methods.monoscale.core import UpdateRecord, accept_update, success
    pool, cards, kinds = make_growing_pool(0)
    memory = RouterMemory()
    validation = [Task(f"v{i}", kinds[i % len(kinds)]) for i in range(12)]
    replay = [Task(f"r{i}", kinds[(i * 5) % len(kinds)]) for i in range(8)]
    j_before, _ = success(follow_memory, pool.outcomes, validation, memory, cards)
    same, record = accept_update(memory, [], follow_memory, pool.outcomes, cards, validation, replay)
    assert same is memory and record == UpdateRecord("", False, j_before, None, None, [])
    entry = MemoryEntry(cards[3].name, kinds[0])
    taken, record = accept_update(memory, [entry], follow_memory, pool.outcomes, cards, validation, [], agent="a3")
    j_after, _ = success(follow_memory, pool.outcomes, validation, taken, cards)
    assert taken.entries == (entry,) and (record.agent, record.accepted, record.j_after) == ("a3", True, j_after)
    assert record.change_rate == 0.0 and record.tried == [{"entries": [entry.line()], "j": j_after, "change_rate": 0.0}]
    _, record = accept_update(memory, [entry], follow_memory, pool.outcomes, cards, validation, replay)
    assert record.change_rate == routing_change_rate(follow_memory(replay, memory, cards),
                                                     follow_memory(replay, taken, cards))


def test_each_onboarding_default_decides_a_round_where_it_binds():
    """A round (simulated pool of seed 20, the fourth agent joining) in which each default of `onboard` decides
    the outcome: the trust region (δ 0.2, tolerance 0, on) rejects the update, and a wider δ, a tolerance of 1,
    no trust region or a margin of 0.5 each end the round otherwise."""
    import random

    from rl.methods.monoscale.core import familiarization_tasks, onboard
    pool, cards, kinds = make_growing_pool(20)
    draw = random.Random(20)
    replay = [Task(f"r{i}", draw.choice(kinds)) for i in range(48)]
    asked = []

    def familiarize(card, ks, n, rng):
        asked.append(n)
        return familiarization_tasks(card, ks, n, rng, start_id=rng.randrange(10**9))
    args = (RouterMemory(), cards[3], cards[:3], follow_memory, pool.outcomes, replay, kinds)
    default = onboard(*args, random.Random(20), familiarize=familiarize)
    assert asked == [32] and default.update.agent == cards[3].name and not default.update.accepted
    assert default.memory == RouterMemory()
    for change in ({"delta": 1.2}, {"tolerance": 1.0}, {"trust_region": False}, {"margin": 0.5}):
        other = onboard(*args, random.Random(20), **change)
        assert (other.memory, other.update) != (default.memory, default.update), change
    ablation = onboard(*args, random.Random(20), trust_region=False)
    assert ablation.update.accepted and ablation.update.agent == cards[3].name and ablation.update.change_rate > 0
    assert ablation.update.change_rate == routing_change_rate(follow_memory(replay, RouterMemory(), cards[:4]),
                                                             follow_memory(replay, ablation.memory, cards[:4]))


def test_familiarization_tasks_are_numbered_from_zero_unless_told_otherwise():
    import random

    from rl.methods.monoscale.core import familiarization_tasks
    card = AgentCard("b", "a specialist for x")
    assert [t.id for t in familiarization_tasks(card, ["x", "y"], 3, random.Random(0))] == ["fam-b-0", "fam-b-1",
                                                                                          "fam-b-2"]
    assert [t.id for t in familiarization_tasks(card, ["x", "y"], 2, random.Random(0), start_id=7)] == ["fam-b-7",
                                                                                                      "fam-b-8"]


def test_distilled_entries_by_hand():
    """Per task type: "use b" when b beat the incumbent by the margin (boundary included), "avoid b" when it did
    worse by it, nothing in between, nothing for a type with too little evidence of b or none of the incumbent;
    strongest evidence first (|reliability - 0.5| x interactions)."""
    def ev(kind, agent, *scores):
        return [(Task(f"{kind}{agent}{i}", kind), agent, s) for i, s in enumerate(scores)]
    evidence = (ev("t", "a", 1, 1) + ev("x", "b", 1, 1, 0, 1) + ev("x", "a", 0, 1, 0, 0) + ev("y", "b", 0, 0)
                + ev("y", "a", 1, 1, 1) + ev("v", "b", 1) + ev("v", "a", 0) + ev("u", "b", 1, 1)
                + ev("s", "b", 0.3, 0.3) + ev("s", "a", 0.35))
    entries = distill_evidence(evidence, "b", {"t": "a", "x": "a", "y": "a", "v": "a", "s": "a"})
    assert entries == [MemoryEntry("b", "y", failure_modes="y tasks (0% success)", reliability=0.0, evidence=5,
                                   prefer=False),
                       MemoryEntry("b", "x", reliability=0.75, evidence=8)]
    at_margin = ev("z", "b", 0.5, 0.5) + ev("z", "a", 0.25) + ev("w", "b", 0.5, 0.5) + ev("w", "a", 0.75)
    assert distill_evidence(at_margin, "b", {"z": "a", "w": "a"}, margin=0.25) == [
        MemoryEntry("b", "w", failure_modes="w tasks (50% success)", reliability=0.5, evidence=3, prefer=False),
        MemoryEntry("b", "z", reliability=0.5, evidence=3)]


def test_a_type_named_inside_a_longer_one_is_not_claimed_by_that_mention():
    from rl.methods.monoscale.core import claimed_kinds
    card = AgentCard("nt", "solves Number Theory problems")
    assert claimed_kinds(card, ["Theory", "Number Theory"]) == ["Number Theory"]
    assert claimed_kinds(AgentCard("t", "theory and number theory"), ["Theory", "Number Theory"]) == [
        "Theory", "Number Theory"]


def _table_route(tasks, memory, cards):
    """A router that follows "use A for T" entries and sends everything else to agent a."""
    use = {e.when: e.agent for e in memory.entries if e.prefer}
    return [use.get(t.kind, "a") for t in tasks]


def _table_outcomes(tasks, choices):
    """Agent b solves x tasks and half-solves z tasks; a solves y tasks (a synthetic harness of the test)."""
    table = {("x", "b"): 1.0, ("y", "a"): 1.0, ("z", "b"): 0.5, ("z", "a"): 0.75}
    return [table.get((t.kind, c), 0.0) for t, c in zip(tasks, choices)]


def test_the_trust_region_accepts_at_its_bounds_by_hand():
    """J on validation (x, y, y, z) and the routing change on replay (x, y, y, y) by hand: "use b for x" raises J
    from 2/4 (a gets both y's) to 3/4 and reroutes 1 of 4 replay tasks (0.25); "use b for z" lowers J by 0.25/4
    and reroutes none; "use b for w" changes nothing at all."""
    validation = [Task("v0", "x"), Task("v1", "y"), Task("v2", "y"), Task("v3", "z")]
    replay = [Task("r0", "x"), Task("r1", "y"), Task("r2", "y"), Task("r3", "y")]
    memory, x, z, w = RouterMemory(), MemoryEntry("b", "x"), MemoryEntry("b", "z"), MemoryEntry("b", "w")
    args = (_table_route, _table_outcomes, [], validation, replay)
    new, record = trust_region_update(memory, [x], *args, delta=0.25)  # the change exactly at δ
    assert new.entries == (x,) and record.accepted and (record.j_before, record.j_after) == (2.75 / 4, 3.75 / 4)
    assert record.agent == "" and record.change_rate == 0.25
    assert record.tried == [{"entries": [x.line()], "j": 3.75 / 4, "change_rate": 0.25}]
    same, record = trust_region_update(memory, [x], *args, agent="b")  # δ 0.2 by default: refused
    assert same is memory and record.accepted is False and record.agent == "b" and record.change_rate == 0.25
    assert record.j_before == 2.75 / 4 and record.j_after == 3.75 / 4
    new, record = trust_region_update(memory, [w], *args)  # J exactly as before, nothing rerouted: taken
    assert new.entries == (w,) and record.accepted and record.j_after == record.j_before
    same, record = trust_region_update(memory, [z], *args)  # J lower by 0.0625: tolerance 0 by default refuses
    assert same is memory and not record.accepted and record.j_after == 2.5 / 4
    new, record = trust_region_update(memory, [z], *args, tolerance=0.0625)
    assert new.entries == (z,) and record.accepted
    new, record = trust_region_update(memory, [x], _table_route, _table_outcomes, [], validation, [], agent="b")
    assert record.accepted and record.change_rate == 0.0  # no replay tasks: no routing change to bound


def test_success_is_the_mean_outcome_of_the_routers_choices():
    from rl.methods.monoscale.core import success
    memory = RouterMemory((MemoryEntry("b", "x"),))
    assert success(_table_route, _table_outcomes, [Task("one", "x")], memory, []) == (1.0, ["b"])
    assert success(_table_route, _table_outcomes, [Task("p", "z"), Task("q", "y")], memory, []) == (0.875, ["a", "a"])
    assert success(_table_route, _table_outcomes, [], memory, []) == (0.0, [])


def test_memory_serializes_byte_stably_and_routing_changes_are_shares():
    memory = RouterMemory((MemoryEntry("b", "x", reliability=0.5, evidence=3),), version=2)
    assert memory.to_json() == ('{"entries": [{"agent": "b", "evidence": 3, "failure_modes": "", "interface": "", '
                                '"prefer": true, "reliability": 0.5, "when": "x"}], "version": 2}')
    assert routing_change_rate(["a"], ["b"]) == 1.0 and routing_change_rate(["a", "b"], ["a", "c"]) == 0.5
    assert routing_change_rate([], []) == 0.0
    with pytest.raises(ValueError, match=r"^routing_change_rate: 2 choices against 1$"):
        routing_change_rate(["a", "b"], ["a"])
