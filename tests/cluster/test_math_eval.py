"""Math evaluation stage: mean@k, the paired t-test (hand values), per-loop readout, the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cluster.math_eval import MathEvalConfig, MathEvaluator, mean_at_k, paired_comparison
from models.tiny import save_tiny

ROOT = Path(__file__).resolve().parents[2]


def test_mean_at_k():
    r = mean_at_k(np.array([[1, 0, 1, 1], [1, 0, 0, 0], [0, 0, 0, 1.0]]))
    assert r["per_run"] == [0.75, 0.25, 0.25]
    assert r["mean"] == pytest.approx(5 / 12)
    assert r["std_over_runs"] == pytest.approx(np.sqrt(((0.75 - 5 / 12) ** 2 + 2 * (0.25 - 5 / 12) ** 2) / 2))


def test_paired_t_test_hand_values():
    a = np.array([[1, 0, 1, 1], [1, 0, 0, 0.0]])  # per-problem accuracy 1, 0, 0.5, 0.5
    b = np.zeros((2, 4))
    r = paired_comparison(a, b)
    # differences d = (1, 0, .5, .5): mean .5, sd sqrt(1/6), t = .5 / (sd / 2) = sqrt(6); with 3 degrees of
    # freedom the t CDF is 1/2 + (x/(1+x^2) + atan x)/pi at x = t/sqrt(3) = sqrt(2): p = 2(1 - F) = 0.0917211
    assert r["mean_diff"] == pytest.approx(0.5)
    assert r["t"] == pytest.approx(np.sqrt(6))
    assert r["p_value"] == pytest.approx(0.0917211, abs=1e-7)
    # 95% interval: mean ± t(0.975, 3) sd / sqrt(4) = 0.5 ± 3.182446 × 0.4082483 / 2 = 0.5 ± 0.6496141
    assert r["ci95"] == pytest.approx([0.5 - 0.6496141, 0.5 + 0.6496141], abs=1e-6)
    assert paired_comparison(a, a) == {"mean_diff": 0.0, "ci95": [0.0, 0.0], "t": 0.0, "p_value": 1.0, "problems": 4}
    with pytest.raises(ValueError, match="same problems"):
        paired_comparison(a, np.zeros((2, 3)))


@pytest.fixture(scope="module")
def looped_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("ouro")
    save_tiny(d / "model", arch="ouro", loops=3, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    rows = [{"problem": f"{a}+{b}*{c}=", "answer": str(a + b * c)} for a, b, c in [(1, 2, 3), (4, 5, 6), (7, 8, 9)]]
    (d / "probs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "digits.py").write_text("def digits(prompt, response, **kw):\n"
                                 "    return sum(c.isdigit() for c in response) / max(1, len(response))\n")
    return d


def test_per_loop_readout_is_the_models_exit_at_step(looped_model):
    from transformers import AutoModelForCausalLM

    from models.tokenizer import load_tokenizer
    cfg = MathEvalConfig(max_new_tokens=8, reward=f"{looped_model / 'digits.py'}:digits", device="cpu")
    ev = MathEvaluator(str(looped_model / "model"), cfg, str(looped_model / "probs.jsonl"))
    tok = load_tokenizer(str(looped_model / "model"))
    model = AutoModelForCausalLM.from_pretrained(looped_model / "model").eval()
    try:
        by_loop = {}
        for t in (1, 3):
            scores = ev.run(temperature=0.0, top_p=1.0, seed=0, exit_at_step=t)
            enc = tok(ev.prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=8, do_sample=False, exit_at_step=t,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            direct = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            assert ev.last_responses == direct
            assert scores.tolist() == [sum(c.isdigit() for c in r) / max(1, len(r)) for r in direct]
            by_loop[t] = direct
        assert by_loop[1] != by_loop[3]  # reading out after another loop changes the answers
        assert set(ev.per_loop([1, 2, 3])) == {"1", "2", "3"}
    finally:
        ev.close()


def test_cli_reports_mean_at_k_and_paired_comparison(looped_model, tmp_path, capsys):
    """`looprl eval` as a process, and its error exit through the CLI's entry point in process (the process exits
    with what `main` returns)."""
    from cluster.cli import main
    model = str(looped_model / "model")
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "eval", model, "--data", str(looped_model / "probs.jsonl"),
         "--compare", model, "--runs", "2", "--temperature", "1.0", "--max-new-tokens", "6", "--loops", "1", "3",
         "--reward", f"{looped_model / 'digits.py'}:digits", "--device", "cpu", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["model_mean_at_k"]["runs"] == 2 and report["model_mean_at_k"]["problems"] == 3
    # the same checkpoint with the same seeds: identical runs, no difference
    assert report["model_mean_at_k"] == report["compare_mean_at_k"]
    assert report["paired"]["mean_diff"] == 0.0 and report["paired"]["p_value"] == 1.0
    assert set(report["model_per_loop_accuracy"]) == {"1", "3"}
    capsys.readouterr()
    assert main(["eval", model, "--data", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "missing.jsonl" in err and "--data" in err
