"""MonoScale (Shao et al., arXiv 2601.23219): router memory updates when agents join a pool, with a trust region
so that the router's success J does not fall from one onboarding round to the next.

The paper states the parts (agent-conditioned familiarization tasks, evidence from successes and failures,
distillation into auditable natural-language memory, trust-region updates with a monotonic guarantee under
non-interfering expansion); the concrete rules here are the spec's [RECONSTRUCTION] (README.md in this folder):

* the router (any callable `route(tasks, memory, cards) -> agent names`, e.g. `LMRouter` around a language
  model) reads the agent cards and the memory, entries of (agent, when to use it, failure modes, interface
  constraints, reliability);
* an onboarding round for a new agent (`onboard`): familiarization tasks, forced exploration (each routed to
  the new agent once and to the incumbent once), distillation of the evidence into candidate entries, then
  `trust_region_update`: the candidate memory M' = M + dM is accepted only if J(M') >= J(M) - tolerance on the
  validation tasks and the routing-change rate on the replay tasks (old tasks whose chosen agent changed) is at
  most delta; otherwise the candidate set is halved, strongest evidence first, and tried again; if nothing
  passes, M stays byte-identical and the agent is registered but not preferred.

`accept_update` is the ablation without the trust region (every distilled update taken), `grow_pool`'s
`accept_all` mode: it isolates what the acceptance test does. Outcomes are judged in batches
(`outcomes(tasks, agents)`): by the labelled `SimulatedPool`, or by `AgentPool`, real agents (models served by
engines, tools run in the sandbox) whose answers are compared with each task's reference (`answer_matches`).
Memory versions, their diffs and every accept/reject decision are kept (`MemoryHistory`), for audit.
This module is Ray-free; models and agents enter through the callables.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class AgentCard:
    name: str
    description: str  # what the agent does, as its author wrote it
    interface: str = ""  # input format it expects


@dataclass(frozen=True)
class Task:
    id: str
    kind: str  # the task type (a subtask's category)
    text: str = ""
    answer: str = ""  # the reference answer a real agent's output is judged against (empty in the simulated pool)


@dataclass(frozen=True)
class MemoryEntry:
    agent: str
    when: str  # when to use it (here: a task type)
    failure_modes: str = ""
    interface: str = ""
    reliability: float | None = None  # observed success rate
    evidence: int = 0  # interactions behind the entry (orders the candidates: strongest first)
    prefer: bool = True  # False: "avoid `agent` for `when`"

    def line(self) -> str:
        verb = "use" if self.prefer else "avoid"
        parts = [f"{verb} {self.agent} for {self.when}"]
        if self.failure_modes:
            parts.append(f"fails when {self.failure_modes}")
        if self.interface:
            parts.append(f"format: {self.interface}")
        if self.reliability is not None:
            parts.append(f"reliability {self.reliability:.2f}")
        return "; ".join(parts)


@dataclass(frozen=True)
class RouterMemory:
    entries: tuple[MemoryEntry, ...] = ()
    version: int = 0

    def text(self) -> str:
        return "\n".join(f"- {e.line()}" for e in self.entries)

    def to_json(self) -> str:
        """A byte-stable serialization (what "unchanged" means for a rejected update)."""
        return json.dumps({"version": self.version, "entries": [asdict(e) for e in self.entries]}, sort_keys=True)

    def extended(self, delta: list[MemoryEntry]) -> RouterMemory:
        """The candidate M + dM: an entry for the same (agent, when) replaces the old one."""
        keys = {(e.agent, e.when) for e in delta}
        kept = tuple(e for e in self.entries if (e.agent, e.when) not in keys)
        return RouterMemory(kept + tuple(delta), self.version + 1)


def memory_diff(old: RouterMemory, new: RouterMemory) -> dict[str, list[str]]:
    before, after = {e.line() for e in old.entries}, {e.line() for e in new.entries}
    return {"added": sorted(after - before), "removed": sorted(before - after)}


def routing_change_rate(before: list[str], after: list[str]) -> float:
    """The share of tasks whose chosen agent changed."""
    if len(before) != len(after):
        raise ValueError(f"routing_change_rate: {len(before)} choices against {len(after)}")
    return sum(a != b for a, b in zip(before, after)) / max(1, len(before))


Route = Callable[[list[Task], RouterMemory, list[AgentCard]], list[str]]
# the judge's scores, in [0, 1], of the outcomes of tasks[i] routed to agents[i] (batched: real agents answer many
# tasks in one engine call)
Outcomes = Callable[[list[Task], list[str]], list[float]]


def success(route: Route, outcomes: Outcomes, tasks: list[Task], memory: RouterMemory,
            cards: list[AgentCard]) -> tuple[float, list[str]]:
    """J: the mean judged outcome of the router's choices on `tasks`, and the choices."""
    choices = route(tasks, memory, cards)
    return sum(outcomes(tasks, choices)) / max(1, len(tasks)), choices


@dataclass
class UpdateRecord:
    agent: str
    accepted: bool
    j_before: float
    j_after: float | None  # of the accepted candidate (or of the last one tried)
    change_rate: float | None
    tried: list[dict[str, Any]]  # every candidate size tried: entries, J, change rate
    diff: dict[str, list[str]] = field(default_factory=dict)


def trust_region_update(memory: RouterMemory, candidates: list[MemoryEntry], route: Route, outcomes: Outcomes,
                        cards: list[AgentCard], validation: list[Task], replay: list[Task], *, delta: float = 0.2,
                        tolerance: float = 0.0, agent: str = "") -> tuple[RouterMemory, UpdateRecord]:
    """Accept M + dM only if J on `validation` does not drop by more than `tolerance` and the routing-change rate
    on `replay` is at most `delta`; otherwise halve dM (candidates are ordered strongest evidence first) and
    retry. A rejection returns `memory` itself."""
    j_before, _ = success(route, outcomes, validation, memory, cards)
    replay_before = route(replay, memory, cards)
    tried: list[dict[str, Any]] = []
    delta_m = list(candidates)
    while delta_m:
        candidate = memory.extended(delta_m)
        j_after, _ = success(route, outcomes, validation, candidate, cards)
        change = routing_change_rate(replay_before, route(replay, candidate, cards))  # 0 without replay tasks
        tried.append({"entries": [e.line() for e in delta_m], "j": j_after, "change_rate": change})
        if j_after >= j_before - tolerance and change <= delta:
            return candidate, UpdateRecord(agent, True, j_before, j_after, change, tried, memory_diff(memory, candidate))
        delta_m = delta_m[:len(delta_m) // 2]
    last = tried[-1] if tried else {"j": None, "change_rate": None}
    return memory, UpdateRecord(agent, False, j_before, last["j"], last["change_rate"], tried)


def distill_evidence(evidence: list[tuple[Task, str, float]], new_agent: str, incumbents: dict[str, str], *,
                     margin: float = 0.1, min_count: int = 2) -> list[MemoryEntry]:
    """Candidate entries from forced-exploration evidence (task, agent, outcome), strongest evidence first: per
    task type, "use NEW" when the new agent beat the incumbent by `margin`, "avoid NEW" (failure mode: its
    success rate there) when it did worse. The statistical form of the paper's distillation step, which an LLM
    does at real scale from the same evidence [RECONSTRUCTION]."""
    stats: dict[str, dict[str, list[float]]] = {}
    for task, agent, score in evidence:
        stats.setdefault(task.kind, {}).setdefault(agent, []).append(score)
    out = []
    for kind, by_agent in stats.items():
        new = by_agent.get(new_agent, [])
        old = by_agent.get(incumbents.get(kind, ""), [])
        if len(new) < min_count or not old:
            continue
        rate_new, rate_old = sum(new) / len(new), sum(old) / len(old)
        n = len(new) + len(old)
        if rate_new >= rate_old + margin:
            out.append(MemoryEntry(new_agent, kind, reliability=rate_new, evidence=n))
        elif rate_new <= rate_old - margin:
            out.append(MemoryEntry(new_agent, kind, failure_modes=f"{kind} tasks ({rate_new:.0%} success)",
                                   reliability=rate_new, evidence=n, prefer=False))
    return sorted(out, key=lambda e: (-abs((e.reliability or 0) - 0.5) * e.evidence, e.when))


@dataclass
class MemoryHistory:
    """Every memory version with its diff, and the accept/reject log (written to `folder` when given)."""
    folder: Path | None = None
    versions: list[str] = field(default_factory=list)
    log: list[dict[str, Any]] = field(default_factory=list)

    def record(self, round_: int, memory: RouterMemory, update: UpdateRecord) -> None:
        entry = {"round": round_, **asdict(update), "version": memory.version,
                 "memory_sha256": hashlib.sha256(memory.to_json().encode()).hexdigest()}
        self.log.append(entry)
        if update.accepted:
            self.versions.append(memory.to_json())
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            with (self.folder / "updates.jsonl").open("a") as f:
                f.write(json.dumps(entry) + "\n")
            if update.accepted:
                (self.folder / f"memory_v{memory.version}.json").write_text(memory.to_json())


@dataclass
class SimulatedPool:
    """A labelled synthetic pool for tests and benchmarks: agents with a success probability per task type (an
    unreliable agent's outcomes are noisier), outcomes drawn deterministically per (seed, task, agent)."""
    probs: dict[str, dict[str, float]]  # agent -> task type -> success probability
    seed: int = 0

    def outcome(self, task: Task, agent: str) -> float:
        p = self.probs.get(agent, {}).get(task.kind, 0.0)
        h = hashlib.sha256(f"{self.seed}|{task.id}|{agent}".encode()).digest()
        return float(int.from_bytes(h[:8], "big") / 2**64 < p)

    def outcomes(self, tasks: list[Task], agents: list[str]) -> list[float]:
        return [self.outcome(t, a) for t, a in zip(tasks, agents)]


AnswerJudge = Callable[[str, str], bool]  # (an agent's output, the task's reference answer) -> correct
ANSWER_MATCHES = ("math", "exact", "contains")


def answer_matches(output: str, reference: str, match: str = "math") -> bool:
    """Whether an agent's output answers a task whose reference answer is `reference`: `math` (the value the
    output states, its last `\\boxed{}` or else its last number, equivalent under math-verify: 0.5 answers
    \\frac{1}{2}), `exact` (the stripped strings equal) or `contains` (the reference appears in the output). An
    empty reference is never answered."""
    from rl.answers import equivalent, stated_answer
    output, reference = output.strip(), str(reference).strip()
    if not reference:
        return False
    if match == "exact":
        return output == reference
    if match == "contains":
        return reference in output
    if match == "math":
        return output == reference or equivalent(stated_answer(output), reference)
    raise ValueError(f"answer match must be one of {', '.join(ANSWER_MATCHES)}, got {match!r}")


class AgentPool:
    """Real agents: `answer[name](texts) -> outputs` runs one agent (a language model served by an engine, a tool
    run in the sandbox) on a batch of task texts, and `judge(output, reference)` scores each output against the
    task's answer. Each (task, agent) runs once; later requests read the recorded outcome, so every mode and round
    of a run judges the same answer (as the simulated pool's deterministic draws do). A name outside the pool (a
    router answer that names nobody) scores 0."""

    def __init__(self, answer: dict[str, Callable[[list[str]], list[str]]], judge: AnswerJudge):
        self.answer, self.judge = answer, judge
        self.seen: dict[tuple[str, str], tuple[str, float]] = {}  # (task id, agent) -> (output, outcome)

    def outcomes(self, tasks: list[Task], agents: list[str]) -> list[float]:
        todo: dict[str, dict[str, Task]] = {}
        for task, agent in zip(tasks, agents):
            if agent in self.answer and (task.id, agent) not in self.seen:
                todo.setdefault(agent, {})[task.id] = task
        for agent, batch in todo.items():
            said = self.answer[agent]([t.text for t in batch.values()])
            if len(said) != len(batch):
                raise RuntimeError(f"agent {agent}: {len(said)} answers to {len(batch)} tasks")
            for task, out in zip(batch.values(), said):
                self.seen[(task.id, agent)] = (out, float(self.judge(out, task.answer)))
        return [self.seen[(t.id, a)][1] if (t.id, a) in self.seen else 0.0 for t, a in zip(tasks, agents)]


def make_growing_pool(seed: int, kinds: int = 6, start: int = 3, final: int = 10,
                      unreliable_share: float = 0.3) -> tuple[SimulatedPool, list[AgentCard], list[str]]:
    """A pool that grows from `start` to `final` agents: the first ones are generalists, each later one is strong
    on one or two task types and weak elsewhere, and some are unreliable (a claimed strength that does not hold).
    Returns the pool, the cards in joining order and the task types."""
    rng = random.Random(seed)
    types = [f"type{i}" for i in range(kinds)]
    probs: dict[str, dict[str, float]] = {}
    cards = []
    for i in range(final):
        name = f"agent{i}"
        if i < start:
            probs[name] = {t: rng.uniform(0.45, 0.65) for t in types}
            cards.append(AgentCard(name, "a generalist agent"))
            continue
        strong = rng.sample(types, rng.choice([1, 2]))
        unreliable = rng.random() < unreliable_share
        probs[name] = {t: (rng.uniform(0.3, 0.55) if unreliable else rng.uniform(0.8, 0.95)) if t in strong
                       else rng.uniform(0.05, 0.3) for t in types}
        cards.append(AgentCard(name, f"a specialist for {' and '.join(strong)}"))
    return SimulatedPool(probs, seed), cards, types


def claimed_kinds(card: AgentCard, kinds: list[str]) -> list[str]:
    """The task types a card's description names, as whole words in any case; a type inside a longer one it names
    (Algebra in Intermediate Algebra) is not claimed by that mention."""
    text, found = card.description, set()
    for kind in sorted(kinds, key=len, reverse=True):
        pattern = re.compile(rf"(?<!\w){re.escape(kind)}(?!\w)", re.IGNORECASE)
        if pattern.search(text):
            found.add(kind)
            text = pattern.sub(" ", text)
    return [k for k in kinds if k in found]


def familiarization_tasks(card: AgentCard, kinds: list[str], n: int, rng: random.Random, *, start_id: int = 0,
                          interference_share: float = 0.3, bank: dict[str, list[Task]] | None = None) -> list[Task]:
    """Agent-conditioned familiarization tasks: tasks of the types the card claims, and `interference_share` of
    tasks of other types (owned by the agents already in the pool). Without `bank` they are types only (the
    simulated pool); with it (type -> tasks of the benchmark's distribution, with texts and answers: a real pool)
    each is drawn from the bank, at most once per round (a type with none left is skipped, so the round may have
    fewer). At real scale a model may write them from the card instead (`LMFamiliarizer`)."""
    claimed = claimed_kinds(card, kinds) or kinds
    others = [k for k in kinds if k not in claimed] or kinds
    left = {k: list(v) for k, v in (bank or {}).items()}
    out = []
    for i in range(n):
        kind = rng.choice(others) if rng.random() < interference_share else rng.choice(claimed)
        if bank is None:
            out.append(Task(f"fam-{card.name}-{start_id + i}", kind))
        elif left.get(kind):
            out.append(left[kind].pop(rng.randrange(len(left[kind]))))
    return out


@dataclass
class OnboardingResult:
    memory: RouterMemory
    update: UpdateRecord
    evidence: list[tuple[str, str, str, float]]  # (task id, kind, agent, outcome)


def accept_update(memory: RouterMemory, candidates: list[MemoryEntry], route: Route, outcomes: Outcomes,
                  cards: list[AgentCard], validation: list[Task], replay: list[Task], *,
                  agent: str = "") -> tuple[RouterMemory, UpdateRecord]:
    """The ablation without a trust region: M + dM is taken whatever it does to J or to the routing of old tasks
    (M stays when dM is empty); J before and after and the routing-change rate are recorded as
    `trust_region_update` records them."""
    j_before, _ = success(route, outcomes, validation, memory, cards)
    if not candidates:
        return memory, UpdateRecord(agent, False, j_before, None, None, [])
    candidate = memory.extended(list(candidates))
    j_after, _ = success(route, outcomes, validation, candidate, cards)
    change = routing_change_rate(route(replay, memory, cards), route(replay, candidate, cards))  # 0 without replay
    tried = [{"entries": [e.line() for e in candidates], "j": j_after, "change_rate": change}]
    return candidate, UpdateRecord(agent, True, j_before, j_after, change, tried, memory_diff(memory, candidate))


def onboard(memory: RouterMemory, new: AgentCard, pool_cards: list[AgentCard], route: Route, outcomes: Outcomes,
            replay: list[Task], kinds: list[str], rng: random.Random, *, n_familiarization: int = 16,
            delta: float = 0.2, tolerance: float = 0.0, margin: float = 0.1, familiarize: Callable | None = None,
            distill: Callable | None = None, trust_region: bool = True) -> OnboardingResult:
    """One onboarding round for `new` joining `pool_cards` (see the module docstring). Half the familiarization
    tasks are explored (each routed to the new agent once and to the incumbent, the router's choice without the
    new agent, once); the other half with the replay tasks is the validation set of the trust-region test.
    `familiarize(card, kinds, n, rng)` writes the tasks (default `familiarization_tasks`) and
    `distill(evidence, new_agent, incumbents)` the candidate entries (default `distill_evidence`; `LMDistiller`
    asks a model). `trust_region=False` is the ablation that accepts every distilled update (`accept_update`)."""
    familiarize = familiarize or (lambda card, ks, n, r: familiarization_tasks(card, ks, n, r,
                                                                               start_id=r.randrange(10**9)))
    tasks = familiarize(new, kinds, 2 * n_familiarization, rng)
    explore, held = tasks[:n_familiarization], tasks[n_familiarization:]
    incumbents_choice = route(explore, memory, pool_cards)
    scores_new = outcomes(explore, [new.name] * len(explore))
    scores_incumbent = outcomes(explore, incumbents_choice)
    evidence = []
    for task, incumbent, s_new, s_old in zip(explore, incumbents_choice, scores_new, scores_incumbent):
        evidence += [(task, new.name, s_new), (task, incumbent, s_old)]
    incumbent_of = {}
    for task, incumbent in zip(explore, incumbents_choice):
        incumbent_of.setdefault(task.kind, incumbent)
    candidates = (distill(evidence, new.name, incumbent_of) if distill is not None else
                  distill_evidence(evidence, new.name, incumbent_of, margin=margin))
    cards, validation = [*pool_cards, new], held + replay
    if trust_region:
        updated, record = trust_region_update(memory, candidates, route, outcomes, cards, validation, replay,
                                              delta=delta, tolerance=tolerance, agent=new.name)
    else:
        updated, record = accept_update(memory, candidates, route, outcomes, cards, validation, replay, agent=new.name)
    return OnboardingResult(updated, record, [(t.id, t.kind, a, s) for t, a, s in evidence])


# The task comes first, so that a causal router reads the memory and the cards knowing what they are for.
ROUTER_PROMPT = "Task ({kind}): {text}\nMemory:\n{memory}\nAgents:\n{cards}\nAgent:"


def router_prompt(task: Task, memory: RouterMemory, cards: list[AgentCard]) -> str:
    """The router's prompt: the task, the memory entries about its type (retrieved by `when`; all of them for a
    task of no type) and the agent cards."""
    lines = "\n".join(f"- {c.name}: {c.description}" for c in cards)
    relevant = RouterMemory(tuple(e for e in memory.entries if not task.kind or e.when == task.kind))
    return ROUTER_PROMPT.format(cards=lines, memory=relevant.text() or "(empty)", kind=task.kind, text=task.text)


class LMRouter:
    """The router as a language model: `generate(prompts) -> texts` (an engine, a judge group); the chosen agent
    is the first card name in its answer (an answer naming no agent routes to nobody: outcome 0)."""

    def __init__(self, generate: Callable[[list[str]], list[str]]):
        self.generate = generate

    def __call__(self, tasks: list[Task], memory: RouterMemory, cards: list[AgentCard]) -> list[str]:
        said = self.generate([router_prompt(t, memory, cards) for t in tasks])
        return [first_agent_named(text, [c.name for c in cards]) or "" for text in said]


def first_agent_named(text: str, names: list[str]) -> str | None:
    """The agent a router's answer names: the earliest name in it; at one position the longest (agent10, not
    agent1); None when it names none."""
    found = [(text.find(n), -len(n), n) for n in names if n in text]
    return min(found)[2] if found else None


NOT_PREFERRED = " (registered, not preferred)"


def shown_cards(cards: list[AgentCard], memory: RouterMemory, trusted: set[str]) -> list[AgentCard]:
    """The cards the MonoScale router reads: an agent outside the starting pool with no accepted "use" entry is
    marked registered-but-not-preferred."""
    used = {e.agent for e in memory.entries if e.prefer} | trusted
    return [c if c.name in used else AgentCard(c.name, c.description + NOT_PREFERRED, c.interface) for c in cards]


MODES = ("monoscale", "accept_all", "naive", "fixed")


def grow_pool(mode: str, route: Route, pool: Any, cards: list[AgentCard], kinds: list[str], *, start: int = 3,
              seed: int = 0, test_size: int = 300, replay_size: int = 48, n_familiarization: int = 16,
              delta: float = 0.2, tolerance: float = 0.0, history: MemoryHistory | None = None,
              distill: Callable | None = None, familiarize: Callable | None = None, test: list[Task] | None = None,
              replay: list[Task] | None = None, bank: dict[str, list[Task]] | None = None) -> dict[str, Any]:
    """J on a held-out task set after each onboarding round as the pool grows from `start` agents to all of
    `cards`: `monoscale` (memory updates in the trust region, new agents not preferred until accepted),
    `accept_all` (the same rounds with every distilled update accepted: what the trust region adds), `naive`
    (every new card shown as written, no memory: the router's cold start) or `fixed` (the starting pool only).
    `pool.outcomes(tasks, agents)` judges (`SimulatedPool`, `AgentPool`). Without `test` and `replay` they are
    drawn as task types (the simulated pool); `bank` (type -> tasks with texts and answers) feeds the default
    familiarization of a real pool."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    rng = random.Random(seed)
    test = test if test is not None else [Task(f"test-{i}", rng.choice(kinds)) for i in range(test_size)]
    replay = replay if replay is not None else [Task(f"replay-{i}", rng.choice(kinds)) for i in range(replay_size)]
    if familiarize is None and bank is not None:
        def familiarize(card, ks, n, r):
            return familiarization_tasks(card, ks, n, r, bank=bank)
    memory, trusted = RouterMemory(), {c.name for c in cards[:start]}
    history = history if history is not None else MemoryHistory()
    learns, js, records = mode in ("monoscale", "accept_all"), [], []
    for k in range(start, len(cards) + 1):
        pool_cards = cards[:k] if mode != "fixed" else cards[:start]
        if learns and k > start:
            result = onboard(memory, cards[k - 1], cards[:k - 1],
                             lambda t, m, c: route(t, m, shown_cards(c, m, trusted)), pool.outcomes, replay, kinds,
                             rng, n_familiarization=n_familiarization, delta=delta, tolerance=tolerance,
                             distill=distill, familiarize=familiarize, trust_region=mode == "monoscale")
            memory = result.memory
            history.record(k - start, memory, result.update)
            records.append(asdict(result.update))
        shown = shown_cards(pool_cards, memory, trusted) if learns else pool_cards
        j, _ = success(route, pool.outcomes, test, memory, shown)
        js.append(j)
    return {"mode": mode, "j": js, "updates": records, "memory": memory.to_json()}


_ENTRY = re.compile(r"^-?\s*(?P<verb>use|avoid) (?P<agent>\S+) for (?P<when>[^;]+?)\s*(?:;|$)(?P<rest>.*)$")


def parse_memory_lines(text: str, agents: set[str]) -> list[MemoryEntry]:
    """Memory entries from a model's lines in `MemoryEntry.line()` form (`use A for T; fails when ...; format: ...;
    reliability R`, or `avoid ...`); a line that does not parse, or names an agent outside `agents`, is dropped."""
    out = []
    for line in text.splitlines():
        m = _ENTRY.match(line.strip())
        if not m or m.group("agent") not in agents:
            continue
        fields = {"failure_modes": "", "interface": "", "reliability": None}
        for part in (p.strip() for p in m.group("rest").split(";")):
            if part.startswith("fails when "):
                fields["failure_modes"] = part[len("fails when "):]
            elif part.startswith("format: "):
                fields["interface"] = part[len("format: "):]
            elif part.startswith("reliability "):
                try:
                    fields["reliability"] = float(part.split()[1])
                except (IndexError, ValueError):
                    pass
        out.append(MemoryEntry(m.group("agent"), m.group("when").strip(), prefer=m.group("verb") == "use", **fields))
    return out


DISTILL_PROMPT = ("Evidence about agent {agent} (task type: its successes / tries; the incumbent's):\n{evidence}\n"
                  "Write router memory entries, one per line, as '- use AGENT for TYPE; reliability R' or "
                  "'- avoid AGENT for TYPE; fails when ...'.\nEntries:\n")


class LMDistiller:
    """The distillation step by a language model (`generate(prompts) -> texts`, e.g. a judge group): it reads the
    forced-exploration evidence, summarised per task type, and writes entries that `parse_memory_lines` reads;
    they are ordered by the evidence behind their type, strongest first."""

    def __init__(self, generate: Callable[[list[str]], list[str]]):
        self.generate = generate

    def __call__(self, evidence: list[tuple[Task, str, float]], new_agent: str,
                 incumbents: dict[str, str]) -> list[MemoryEntry]:
        counts: dict[str, dict[str, list[float]]] = {}
        for task, agent, score in evidence:
            counts.setdefault(task.kind, {}).setdefault(agent, []).append(score)
        lines = []
        for kind, by_agent in sorted(counts.items()):
            new = by_agent.get(new_agent, [])
            old = by_agent.get(incumbents.get(kind, ""), [])
            lines.append(f"{kind}: {int(sum(new))}/{len(new)}; {incumbents.get(kind, 'none')} "
                         f"{int(sum(old))}/{len(old)}")
        (text,) = self.generate([DISTILL_PROMPT.format(agent=new_agent, evidence="\n".join(lines))])
        known = {kind.lower(): kind for kind in counts}  # a model may write a type in another case
        entries = [MemoryEntry(**{**asdict(e), "when": known.get(e.when.lower(), e.when)})
                   for e in parse_memory_lines(text, {new_agent, *incumbents.values()})]
        tries = {kind: sum(len(v) for v in by_agent.values()) for kind, by_agent in counts.items()}
        return sorted((MemoryEntry(**{**asdict(e), "evidence": tries.get(e.when, 0)}) for e in entries),
                      key=lambda e: -e.evidence)


FAMILIARIZE_PROMPT = ("A new agent joins the pool: {name}: {description}\nTasks the pool sees:\n{samples}\n"
                      "Write {n} tasks to learn when to use it, some it should handle and some the other agents own, "
                      "one per line as 'TYPE: task'.\nTasks:\n")


class LMFamiliarizer:
    """Agent-conditioned familiarization tasks written by a language model (`generate(prompts) -> texts`) from the
    new agent's card and `samples` of the task distribution; a line `TYPE: task` with a known type is a task, other
    lines are dropped (when the model writes fewer than asked, the round has fewer tasks)."""

    def __init__(self, generate: Callable[[list[str]], list[str]], samples: list[Task]):
        self.generate, self.samples = generate, samples

    def __call__(self, card: AgentCard, kinds: list[str], n: int, rng: random.Random) -> list[Task]:
        shown = rng.sample(self.samples, min(len(self.samples), 8))
        (text,) = self.generate([FAMILIARIZE_PROMPT.format(
            name=card.name, description=card.description, n=n,
            samples="\n".join(f"{t.kind}: {t.text}" for t in shown))])
        out = []
        for line in text.splitlines():
            kind, sep, body = line.partition(":")
            if sep and kind.strip() in kinds and body.strip():
                out.append(Task(f"fam-{card.name}-{rng.randrange(10**9)}", kind.strip(), body.strip()))
        return out[:n]
