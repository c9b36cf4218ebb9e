"""Guidance (rl/methods/guidance/README.md): the fact trie, LongBench-Cite scoring with the deterministic judge, the
decode loop's lookahead, and the `guidance` method on a tiny model taught in code to state memorised facts
(half of them with stale numbers) in the citation format."""

import json
import random

import pytest
import torch

from models.tiny import build_tiny_model, build_tiny_tokenizer
from rl.methods.guidance.core import (
    ContainmentJudge,
    Fact,
    FactPool,
    cite_statement,
    normalize_words,
    parse_statements,
    post_hoc_cite,
    score_citations,
)
from rl.methods.guidance.task import number_accuracy, write_citations_task
from rollout.base import SamplingParams
from rollout.hf_engine import HFEngine


def test_the_trie_returns_the_longest_match_and_nothing_without_a_prefix():
    pool = FactPool([Fact("Kov owns 42 goats.", 0, 2), Fact("Kov owns 17 hens in the old barn by the mill.", 1, 3)])
    fact, index, words = pool.longest_match(normalize_words("Kov owns 17 hens, I think"))
    assert (fact.chunk, index, words) == (1, 1, 4)
    fact, _, words = pool.longest_match(normalize_words("kov owns 42 goats and more"))
    assert fact.chunk == 0 and words == 4
    assert pool.longest_match(normalize_words("Zed owns 42 goats")) is None  # no prefix: no replacement
    assert pool.longest_match(["kov", "owns", "17"], exclude={1}) is not None  # the other fact's 2-word prefix
    assert pool.longest_match(["kov"]) is None  # shorter than every p
    # a sliding p-gram start inside a long sentence matches mid-sentence
    assert pool.longest_match(normalize_words("in the old barn"))[0].chunk == 1


def test_prefix_length_is_min_8_and_a_third_of_the_words():
    pool = FactPool.from_context("<C0>One two three four five six seven. <C1>" + " ".join(["w"] * 30) + ".")
    assert [(f.chunk, f.prefix_len) for f in pool.facts] == [(0, 3), (1, 8)]


def test_citations_merge_consecutive_chunks_and_parse_back():
    assert cite_statement("A b.", [7, 3, 4]) == "<statement>A b.<cite>[3-4][7-7]</cite></statement>"
    parsed = parse_statements("Intro here. <statement>A b.<cite>[3-4][7-7]</cite></statement>Tail 5.")
    assert parsed == [{"text": "Intro here.", "cites": []}, {"text": "A b.", "cites": [3, 4, 7]},
                      {"text": "Tail 5.", "cites": []}]


def test_longbench_cite_scores_by_hand_with_the_containment_judge():
    context = "<C0>Kov owns 42 goats.<C1>Kov walks 6 miles a day.<C2>Rex has 9 cousins."
    answer = ("<statement>Kov owns 42 goats.<cite>[0-0]</cite></statement>"  # supported: recall 1, precision 1
              "<statement>Kov walks 7 miles a day.<cite>[1-1][2-2]</cite></statement>"  # a wrong number: 0; C1 1, C2 0
              "Kov has 3 cousins.")  # uncited, needs a citation: recall 0
    got = score_citations(answer, context, ContainmentJudge())
    assert got["recall"] == pytest.approx(1 / 3) and got["precision"] == pytest.approx(2 / 3)
    assert got["f1"] == pytest.approx(2 * (1 / 3) * (2 / 3) / (1 / 3 + 2 / 3))
    assert got["statements"] == 3 and got["citations"] == 3
    # post-hoc citation cites each sentence with its best-overlapping chunk
    assert post_hoc_cite("Kov owns 42 goats. Kov walks 7 miles.", context) == (
        "<statement>Kov owns 42 goats.<cite>[0-0]</cite></statement>"
        "<statement>Kov walks 7 miles.<cite>[1-1]</cite></statement>")


def test_scores_are_averaged_per_dataset_and_the_excluded_datasets_are_left_out():
    """LongBench-Cite's averaging by hand: three answers of hotpotqa and one of govreport weigh as two datasets, and
    multifieldqa_en is left out of the headline (a mean over answers would give F1 (0.2 + 0.4 + 0.6 + 1.0 + 0) / 5)."""
    from rl.methods.guidance.core import dataset_means

    def s(f1):
        return {"recall": f1, "precision": f1, "f1": f1}
    got = dataset_means([s(0.2), s(0.4), s(0.6), s(1.0), s(0.0)],
                        ["hotpotqa", "hotpotqa", "hotpotqa", "gov_report", "multifieldqa_en"])
    assert got["f1"] == pytest.approx((0.4 + 1.0) / 2) and got["recall"] == pytest.approx(0.7)
    assert got["datasets"]["hotpotqa"] == pytest.approx({"recall": 0.4, "precision": 0.4, "f1": 0.4, "answers": 3})
    assert got["excluded"] == ["multifieldqa_en"] and got["datasets"]["multifieldqa_en"]["f1"] == 0.0
    assert dataset_means([s(0.3), s(0.5)], ["all", "all"])["f1"] == pytest.approx(0.4)  # one dataset: the mean
    with pytest.raises(ValueError, match="every dataset of the answers"):
        dataset_means([s(0.3)], ["multifieldqa_zh"])


class Peek:
    """Peeks `n` tokens at the start (before the first token) and after the second one; inserts nothing."""

    def __init__(self, n: int = 5):
        self.n, self.peeks = n, {}

    def insert(self, state):
        if state.step in (0, 2):
            self.peeks[state.step] = state.lookahead(self.n)
        return None


@pytest.fixture(scope="module")
def cite_engine(tmp_path_factory):
    """A tiny Llama taught in process (150 AdamW steps) to answer the citations task from its stale memory."""
    out = tmp_path_factory.mktemp("cite")
    paths = write_citations_task(out / "data", num_people=3, num_sft=300, num_train=10, num_eval=6, chunks=5, seed=0)
    rows = [json.loads(x) for x in open(paths["sft"])]
    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
                             max_position_embeddings=512)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # both cores for this in-process training (the suite keeps one thread per process for its actors); a fixed
    # count, so the taught model is the same on any machine
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    for step in range(150):
        seqs, masks = [], []
        for r in random.Random(step).sample(rows, 16):
            p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
            t = tok(r["target"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            seqs.append(p + t)
            masks.append([0] * len(p) + [1] * len(t))
        L = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (L - len(s)) for s in seqs])
        loss_mask = torch.tensor([m + [0] * (L - len(m)) for m in masks])[:, 1:]
        attn = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * loss_mask).sum() / loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    world = json.loads(open(paths["citation_world"]).read())
    evals = [json.loads(x) for x in open(paths["eval"])][:3]
    return HFEngine(str(out / "model")), evals, {p: {int(a): v for a, v in d.items()} for p, d in world["true"].items()}


def _gen(engine, prompts, decoding=None, params=None, max_new_tokens=500):  # room for every insertion
    return engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, seed=0,
                                                   decoding=decoding, decoding_params=params))


def test_the_lookahead_is_the_greedy_continuation_and_commits_nothing(cite_engine, monkeypatch):
    engine, evals, _ = cite_engine
    from rl import registry
    monkeypatch.setitem(registry._REGISTRY["decoding"], "peek", Peek)
    prompts = [r["prompt"] for r in evals[:2]]
    plain = _gen(engine, prompts, max_new_tokens=20)
    peeked = _gen(engine, prompts, "peek", {"n": 5}, max_new_tokens=20)
    assert torch.equal(peeked.response_ids, plain.response_ids)  # the cache was restored after every peek
    torch.testing.assert_close(peeked.rollout_logp, plain.rollout_logp, atol=1e-5, rtol=0)
    method = engine.decoding_method("peek", {"n": 5})
    assert method.peeks[0] == plain.response_ids[:, :5].tolist()
    assert method.peeks[2] == plain.response_ids[:, 2:7].tolist()


def test_guidance_inserts_the_verbatim_fact_with_its_chunk_once_and_fixes_the_numbers(cite_engine):
    engine, evals, world = cite_engine
    tok = engine.tokenizer
    prompts = [r["prompt"] for r in evals]
    params = {"lookahead": 40}
    plain = _gen(engine, prompts)
    guided = _gen(engine, prompts, "guidance", params)
    method = engine.decoding_method("guidance", params)
    judge = ContainmentJudge()
    plain_acc, guided_acc, plain_f1, guided_f1 = [], [], [], []
    for i, r in enumerate(evals):
        stats = method.stats["rows"][i]
        assert stats["log"], f"row {i}: no fact inserted"
        assert stats["lookahead_tokens"] == 40 * stats["boundaries"]  # the cost: lookahead x boundaries
        L = int(guided.response_attn[i].sum())
        text = tok.decode(guided.response_ids[i, :L], skip_special_tokens=True)
        chunks = {int(j): s for j, s in (x.split(">", 1) for x in r["prompt"].split("\nQuestion")[0].split("<C")[1:])}
        facts = [e["fact"] for e in stats["log"]]
        assert len(facts) == len(set(facts))  # each fact at most once
        for e in stats["log"]:
            statement = cite_statement(e["fact"], [e["chunk"]])
            assert statement in text  # byte for byte
            assert chunks[e["chunk"]] == e["fact"]  # the cited chunk is the one that holds the fact
        # the inserted tokens are marked (never trained on) and carry logprob 0
        inserted = guided.observation_mask[i, :L].bool()
        assert inserted.sum() >= sum(len(tok(cite_statement(e["fact"], [e["chunk"]]),
                                             add_special_tokens=False)["input_ids"]) for e in stats["log"])
        assert guided.rollout_logp[i, :L][inserted].abs().sum() == 0
        # numbers of the inserted statements are the documents'
        for e in stats["log"]:
            assert number_accuracy(e["fact"], r["person"], world)["accuracy"] == 1.0
        p_text = tok.decode(plain.response_ids[i, :int(plain.response_attn[i].sum())], skip_special_tokens=True)
        plain_acc.append(number_accuracy(p_text, r["person"], world)["accuracy"])
        guided_acc.append(number_accuracy(text, r["person"], world)["accuracy"])
        plain_f1.append(score_citations(p_text, r["prompt"], judge)["f1"])
        guided_f1.append(score_citations(text, r["prompt"], judge)["f1"])
    assert sum(guided_acc) > sum(plain_acc) and sum(guided_f1) > sum(plain_f1)


def test_no_fact_of_the_person_in_the_context_means_no_insertion(cite_engine):
    engine, evals, _ = cite_engine
    r = evals[0]
    # the context keeps only other people's sentences: nothing the model writes about this person can match
    person = r["person"]
    context, question = r["prompt"].split("\nQuestion")
    kept = [x for x in context.split("<C")[1:] if person not in x]
    prompt = "".join(f"<C{j}>{x.split('>', 1)[1]}" for j, x in enumerate(kept)) + "\nQuestion" + question
    plain = _gen(engine, [prompt])
    guided = _gen(engine, [prompt], "guidance", {"lookahead": 40})
    assert torch.equal(guided.response_ids, plain.response_ids)
    assert engine.decoding_method("guidance", {"lookahead": 40}).stats["rows"][0]["log"] == []


def test_the_correctness_judge_reads_its_last_rating_and_fails_a_sample_it_cannot_rate(cite_engine):
    """`judge_correctness`: `[[N]]` read as N / 10 (the last one; out-of-scale ones ignored); a judge that writes
    no rating (here the taught citation model, a real engine asked a question it was never taught) fails the
    sample with the reason, after its retries."""
    from rewards.judged import TEMPLATE, judge_correctness, parse_rating
    from rl.reward import RewardFailure
    assert parse_rating("The answer misses a fact. Rating: [[7]]") == 0.7
    assert parse_rating("[[2]] at first, then Rating: [[10]]") == 1.0
    assert parse_rating("Rating: [[11]]") is None and parse_rating("Rating: 7") is None
    assert "{question}" in TEMPLATE and "[[rating]]" in TEMPLATE

    from tests.rewards.test_judged import EngineJudge
    judge = EngineJudge(cite_engine[0])
    out = judge_correctness(["What is 2+2?"], ["4"], ground_truth=["4"], judges={"correctness_judge": judge},
                            retries=1)
    assert isinstance(out[0], RewardFailure) and "no [[rating]] in 2 tries" in out[0].reason
    assert judge.seeds == [0, 1]  # two calls: the first try and one retry, each with its own seed


def test_the_llm_judge_asks_each_question_with_its_text_and_reads_the_first_rating_it_names():
    """The model judge's protocol (prompts in, bracketed ratings out), with a text function standing in for the
    judge engine: each question carries its statement and evidence, and the ratings are read in the order that
    keeps [[Unrelevant]] from being read as [[Relevant]] and [[Partially supported]] from [[No support]]."""
    from rl.methods.guidance.core import LLMCitationJudge
    asked: list[str] = []

    def answers(*replies):
        it = iter(replies)

        def generate(prompts):
            asked.extend(prompts)
            return [next(it) for _ in prompts]
        return generate

    judge = LLMCitationJudge(answers("Rating: [[Fully supported]]", "[[partially supported]] mostly",
                                     "[[No support]]", "no rating at all"))
    assert [judge.support("Kov owns 42 goats.", "Kov owns 42 goats and 3 cats.") for _ in range(4)] == [
        1.0, 0.5, 0.0, 0.0]
    assert "Kov owns 42 goats and 3 cats." in asked[0] and "Statement: Kov owns 42 goats." in asked[0]
    judge = LLMCitationJudge(answers("[[Unrelevant]]", "It is [[Relevant]].", "[[relevant]] though [[unrelevant]]"))
    assert [judge.relevant("Rex has 9 cousins.", "Rex lives by the mill.") for _ in range(3)] == [0.0, 1.0, 0.0]
    assert "Rex lives by the mill." in asked[-1] and "Statement: Rex has 9 cousins." in asked[-1]
    judge = LLMCitationJudge(answers("[[Yes]]", "[[No]]", "maybe"))
    assert [judge.needs_citation("Kov has 3 cousins.") for _ in range(3)] == [1.0, 0.0, 0.0]
    assert "Kov has 3 cousins." in asked[-1] and "citation" in asked[-1]


def test_post_hoc_citation_picks_the_chunk_with_the_most_shared_words_and_leaves_unmatched_sentences_uncited():
    from rl.methods.guidance.core import chunks_of
    context = "<C0>Kov owns 42 goats near the river.<C1>Kov owns 42 goats and walks 7 miles by the river daily."
    assert len(chunks_of(context)) == 2
    # 7 shared words with C1 against 3 with C0; none; 3 with each (a tie goes to the first chunk)
    # a sentence of punctuation alone is dropped, and a line break inside a sentence becomes a space
    got = post_hoc_cite("Kov walks 7 miles\nby the river.\nZed sings loudly! ?! Kov owns goats?", context)
    assert got == ("<statement>Kov walks 7 miles by the river.<cite>[1-1]</cite></statement>"
                   "Zed sings loudly!"
                   "<statement>Kov owns goats?<cite>[0-0]</cite></statement>")
    assert post_hoc_cite("Kov owns goats. Rex sings.", "no chunk markers here") == "Kov owns goats.Rex sings."
