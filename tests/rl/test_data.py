import json
from pathlib import Path

import pytest

from rl.config import ConfigError
from rl.data import format_prompt, load_rows
from rl.tasks.arithmetic import write_synthetic_task


def _rows():
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]


def test_jsonl_parquet_and_disk_folder(tmp_path):
    import datasets
    ds = datasets.Dataset.from_list(_rows())
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    for path in ("d.jsonl", "d.parquet", "folder"):
        rows = load_rows(str(tmp_path / path), ["prompt", "answer"], "data.train_path")
        assert rows == _rows()


def test_missing_file_column_empty_and_bad_row(tmp_path):
    with pytest.raises(ConfigError, match="data.train_path.*does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"), ["prompt"], "data.train_path")
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    with pytest.raises(ConfigError, match=r"no column\(s\) \['prompt'\].*question"):
        load_rows(str(tmp_path / "d.jsonl"), ["prompt", "answer"], "data.train_path")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"data.eval_path: dataset .*e.jsonl' is empty"):
        load_rows(str(tmp_path / "e.jsonl"), ["prompt"], "data.eval_path")
    (tmp_path / "n.jsonl").write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n"
                                      + json.dumps({"prompt": None, "answer": "2"}) + "\n")
    with pytest.raises(ConfigError, match="row 2: column 'prompt' is empty"):  # rows count from 1, as lines do
        load_rows(str(tmp_path / "n.jsonl"), ["prompt", "answer"], "data.train_path")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(ConfigError, match="unsupported extension"):
        load_rows(str(tmp_path / "x.txt"), ["prompt"], "data.train_path")


GOOD = json.dumps({"prompt": "1+1=", "answer": "2"})


@pytest.mark.parametrize("bad_line, expected", [
    (b'{"prompt": "caf\xe9", "answer": "3"}', r"row 3: not UTF-8: byte 16 is b'\\xe9'"),
    (b'{"prompt": "1+2=", "answer": }', r"row 3: not JSON: Expecting value at column 30"),
    (b'["1+2=", "3"]', r"row 3: not a JSON object: a list"),
    (b'{"prompt": "1+2=", "answer": 3}', r"row 3: wrong type: column 'answer' is a number, a string in row 1"),
])
def test_a_bad_jsonl_row_is_named_by_file_and_row_from_1_or_dropped(tmp_path, bad_line, expected):
    from collections import Counter
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join([GOOD.encode(), GOOD.encode(), bad_line, GOOD.encode()]) + b"\n")
    with pytest.raises(ConfigError, match=r"data.train_path: dataset '.*d.jsonl' " + expected):
        load_rows(str(path), ["prompt", "answer"], "data.train_path")
    dropped = Counter()
    rows = load_rows(str(path), ["prompt", "answer"], "data.train_path", bad_rows="drop", dropped=dropped)
    assert len(rows) == 3 and sum(dropped.values()) == 1


def test_rows_dropped_without_a_collector_are_reported(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([GOOD, "not json", GOOD]) + "\n")
    assert len(load_rows(str(path), ["prompt", "answer"], "data.train_path", bad_rows="drop")) == 2
    assert "data.train_path: 1 bad row(s) of" in capsys.readouterr().out


def test_csv_and_json_files_name_the_line_of_bad_text_or_syntax(tmp_path):
    (tmp_path / "d.csv").write_bytes(b"prompt,answer\n1+1=,2\ncaf\xe9,3\n")
    with pytest.raises(ConfigError, match=r"'.*d.csv' line 3: not UTF-8"):
        load_rows(str(tmp_path / "d.csv"), ["prompt", "answer"], "data.train_path")
    (tmp_path / "d.json").write_text('[\n  {"prompt": "1+1=", "answer": "2"},\n  {"prompt": "2+2=" "answer": "4"}\n]\n')
    with pytest.raises(ConfigError, match=r"'.*d.json' line 3: not JSON: Expecting ',' delimiter"):
        load_rows(str(tmp_path / "d.json"), ["prompt", "answer"], "data.train_path")


def test_synthetic_task_splits_are_disjoint_and_correct(tmp_path):
    paths = write_synthetic_task(tmp_path, num_train=300, num_eval=50, sft_fraction=0.5, wrong_order_fraction=0.5)
    load = {k: [json.loads(x) for x in open(v)] for k, v in paths.items()}
    assert len(load["eval"]) == 50 and len(load["sft"]) == 150 and len(load["train"]) == 150
    prompts = {k: {r["prompt"] for r in v} for k, v in load.items()}
    assert not (prompts["eval"] & prompts["train"]) and not (prompts["eval"] & prompts["sft"])
    for r in load["train"]:
        a, rest = r["prompt"].rstrip("=").split("+")
        b, c = rest.split("*")
        assert int(r["answer"]) == int(a) + int(b) * int(c)
    wrong = sum(not r["target"].endswith(f"\\boxed{{{r['answer']}}}") for r in load["sft"])
    assert 40 < wrong < 110  # about half of the warm-up targets use the wrong order


def test_format_prompt_chat_template():
    from models.tiny import build_tiny_tokenizer
    tok = build_tiny_tokenizer()
    assert format_prompt("1+2", tok, prefix="Q:") == "Q:1+2"
    assert format_prompt("1+2", tok, chat_template=True) == "<|user|>1+2<|assistant|>"


def test_synthetic_facts_task(tmp_path):
    from rl.methods.factuality.reward import factuality_reward
    from rl.methods.factuality.task import ATTRIBUTES, write_facts_task
    paths = write_facts_task(tmp_path, num_people=5, num_sft=200, num_train=20, num_eval=5, seed=3)
    corpus = (tmp_path / "corpus.txt").read_text().splitlines()
    assert len(corpus) == 5 * len(ATTRIBUTES)
    sft = [json.loads(x) for x in Path(paths["sft"]).read_text().splitlines()]
    counts = [r["target"].count(".") for r in sft]
    assert min(counts) == 1 and max(counts) == 6  # answers vary in detail
    out = factuality_reward([r["prompt"] for r in sft], [r["target"] for r in sft], ground_truth=[r["answer"] for r in sft],
                            corpus=paths["corpus"], lam=0.0, mu=0.0)
    by_count = {}
    for o in out:
        by_count.setdefault(int(o["claims"]), []).append(o["precision"])
    mean = {k: sum(v) / len(v) for k, v in by_count.items()}
    assert mean[1] > 0.8 and mean[6] < 0.8  # the k-th fact is wrong with probability 0.1 + 0.1 k
    refs = [json.loads(x)["answer"] for x in Path(paths["eval"]).read_text().splitlines()]
    assert all(o["score"] == 1.0 for o in factuality_reward(["q"] * 5, [f"<think>x</think> {r}" for r in refs],
                                                             corpus=paths["corpus"], lam=0.0, mu=0.0))
