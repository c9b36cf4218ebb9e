"""The memory plan (`models.memory`, `cluster.plan`): parameter counts from a config alone, the ZeRO accounting and
KV cache by hand, the activation figures against a measured training step, the refusal of a run that cannot fit."""

import json
import subprocess
import sys

import pytest

from cluster.plan import Devices, check_fits, make_plan, model_states, suggest_fix
from models.memory import ModelShape, formula_params, kv_bytes_per_token, lora_params, model_shape
from rl import config
from rl.recipe import ConfigError
from tests.cluster.test_pipeline import ROOT

# the published configurations (config.json of each model's release)
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}
LLAMA31_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
               "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False}
QWEN3_4B = {"model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936,
            "tie_word_embeddings": True}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False}


@pytest.mark.parametrize("cfg, published", [(QWEN25_7B, 7.61e9), (LLAMA31_70B, 70.6e9), (QWEN3_4B, 4.02e9),
                                            (QWEN3_30B_A3B, 30.5e9)])
def test_parameters_from_the_config_alone_match_the_published_counts(cfg, published, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = model_shape(tmp_path)  # a folder with nothing but config.json
    assert shape.counted == "meta" and abs(shape.params - published) / published < 0.005, shape.params
    assert formula_params(cfg) == shape.params  # the fallback formula agrees with the model built on meta


def test_the_count_is_the_models_own_and_the_formula_serves_an_architecture_transformers_lacks():
    from models.tiny import build_tiny_model, build_tiny_tokenizer
    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96)
    assert model_shape(model.config.to_dict()).params == sum(p.numel() for p in model.parameters())
    looped = {**QWEN3_4B, "model_type": "ouro-not-installed", "total_ut_steps": 4}
    shape = model_shape(looped)
    assert shape.counted == "formula" and shape.params == formula_params(QWEN3_4B) - 2 * 128 * 36  # no q/k norms
    assert shape.loops == 4 and kv_bytes_per_token(shape, 2) == 4 * kv_bytes_per_token(model_shape(QWEN3_4B), 2)


def test_kv_cache_and_lora_by_hand():
    shape = model_shape(QWEN25_7B)
    assert kv_bytes_per_token(shape, 2) == 2 * 28 * 4 * 128 * 2  # keys and values, 28 layers, 4 KV heads of 128
    h, kv, i = 3584, 512, 18944
    assert lora_params(shape, 8, ["q_proj", "v_proj"]) == 28 * 8 * ((h + h) + (h + kv))
    assert lora_params(shape, 8) == 28 * 8 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))


def _cfg(*overrides):
    return config.load(ROOT / "recipes/quickstart.yaml", list(overrides))


@pytest.mark.parametrize("zero, want", [
    (0, {"weights": 2000, "gradients": 2000, "master weights (fp32)": 4000, "optimizer moments (fp32)": 8000}),
    (1, {"weights": 2000, "gradients": 2000, "master weights (fp32)": 1000, "optimizer moments (fp32)": 2000}),
    (2, {"weights": 2000, "gradients": 500, "master weights (fp32)": 1000, "optimizer moments (fp32)": 2000}),
    (3, {"weights": 500, "gradients": 500, "master weights (fp32)": 1000, "optimizer moments (fp32)": 2000}),
])
def test_model_states_per_rank_follow_the_zero_stage(zero, want):
    shape = ModelShape("llama", 1000, 1, 8, 1, 1, 8, 8, 10)
    cfg = _cfg("model.dtype=bfloat16", "learner.world_size=4", f"learner.zero_stage={zero}")
    assert model_states(cfg, shape, 1000) == want
    fp32 = model_states(_cfg("learner.world_size=4", f"learner.zero_stage={zero}"), shape, 1000)
    assert "master weights (fp32)" not in fp32 and fp32["optimizer moments (fp32)"] == want["optimizer moments (fp32)"]
    assert model_states(_cfg("learner.optimizer.name=mezo"), shape, 1000) == {"weights": 4000}  # forward-only


_MEASURE = """
import json, resource, sys, random
import torch
from models.tiny import build_tiny_model, build_tiny_tokenizer
from models.families import CausalFamily
from rl.batch import batch_of_examples
from rl.sft_data import prompt_response_example
h, layers, heads, width, seqs, prompt, response, ckpt = map(int, sys.argv[1:9])
tok = build_tiny_tokenizer()
def rss():
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS")) * 1024
rng = random.Random(0)
text = lambda n: "".join(rng.choice("0123456789+=") for _ in range(n))
def train(h, layers, heads, width, seqs, prompt, response, ckpt):
    model = build_tiny_model(tok, hidden_size=h, num_layers=layers, num_heads=heads, intermediate_size=width,
                             max_position_embeddings=prompt + response + 8)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = batch_of_examples([prompt_response_example(tok, text(prompt), text(response - 1)) for _ in range(seqs)],
                              tok.pad_token_id)
    assert batch.prompt_ids.shape[1] + batch.response_ids.shape[1] == prompt + response
    opt = torch.optim.AdamW(model.train().parameters(), lr=1e-4, foreach=False)
    for _ in range(2):
        logp = CausalFamily().forward(model, batch)["logp"]
        (-(logp * batch.response_mask).sum() / batch.response_mask.sum()).backward()
        opt.step()
# a step of a model of width 8 first: what the code loads on its first call (lazily imported modules) is the
# runtime's, not the model's, and varied from run to run (+170 MB in one full suite)
train(8, 1, 1, 8, 2, 4, 4, ckpt)
base = rss()
train(h, layers, heads, width, seqs, prompt, response, ckpt)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"learner_bytes": peak - base}))
"""


# every large allocation its own mapping, returned when freed: the peak resident size is then the peak of live
# tensors (glibc otherwise keeps freed memory, and the same step's peak varied by 40% from run to run). Two threads:
# the 85M step took 39 s instead of 62 on an AMD EPYC core pair, its peak 0.3% above one thread's (torch takes its
# thread count from OMP_NUM_THREADS in the measuring scripts)
MEASURE_ENV = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE",  # a memory figure: no spinning (tests/conftest.py)
               "MALLOC_MMAP_THRESHOLD_": "65536", "PATH": "/usr/bin:/bin"}


# the tiny model's step (about 110 MB) measured 260-311 MB inside the full suite and 108 alone: a constant of about
# 150 MB not yet explained, within the bound for the 85M steps; `make test-all` runs it. CI measures the 85M step
# with gradient checkpointing (the real-scale recipes' setting); without it in the extended suite
@pytest.mark.parametrize("model, ckpt", [pytest.param("tiny", 0, marks=pytest.mark.extended),
                                         pytest.param("85m", 0, marks=pytest.mark.extended), ("85m", 1)])
def test_the_learner_figure_is_within_20_percent_of_a_measured_training_step(model, ckpt):
    """A training step of the policy's forward (the learner's chunked log-probabilities) with AdamW, two steps, in a
    fresh process: its peak resident memory above the process before the model, against the plan's learner rank
    (weights, gradients, Adam's moments, activations, the vocabulary chunk) for the same shape and micro-batch."""
    dims = {"tiny": (128, 3, 4, 512), "85m": (768, 7, 12, 1536)}[model]
    seqs, prompt, response = 8, 64, 193
    measured = _measure(_MEASURE, (*dims, seqs, prompt, response, ckpt), "learner_bytes")
    cfg = _cfg(*_shape_overrides(dims), f"learner.micro_batch_size={seqs}", f"rollout.max_new_tokens={response}",
               f"model.gradient_checkpointing={bool(ckpt)}")
    planned = make_plan(cfg, Devices(gpus_per_node=0), prompt_tokens=prompt).roles[0].total
    assert abs(planned - measured) / measured < 0.2, (planned, measured)


def _measure(script: str, args: tuple, key: str) -> int:
    """Run a measuring script in a fresh process (`MEASURE_ENV`) and read its figure."""
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=MEASURE_ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])[key]


def _shape_overrides(dims: tuple[int, int, int, int]) -> list[str]:
    h, layers, heads, width = dims
    return [f"model.tiny.hidden_size={h}", f"model.tiny.num_layers={layers}", f"model.tiny.num_heads={heads}",
            f"model.tiny.intermediate_size={width}"]


_MEASURE_ENGINE = """
import json, resource, sys, tempfile
import torch
from models.tiny import save_tiny
from rollout.base import SamplingParams
from rollout.hf_engine import HFEngine
h, layers, heads, width, prompts, n, prompt, response = map(int, sys.argv[1:9])
def rss():
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS")) * 1024
def generate(path, prompts, n, prompt, response):
    engine = HFEngine(path, batch_size=prompts * n)
    texts = [("12+34=" * 40)[:prompt] for _ in range(prompts)]
    engine.generate(texts, SamplingParams(n=n, max_new_tokens=response, seed=0))
    return engine
with tempfile.TemporaryDirectory() as tmp:
    small = save_tiny(f"{tmp}/s", hidden_size=8, num_layers=1, num_heads=1, intermediate_size=8)
    generate(str(small), 1, 1, 4, 4)  # what the code loads on its first call (compiled kernels) is the runtime's
    path = save_tiny(f"{tmp}/m", hidden_size=h, num_layers=layers, num_heads=heads, intermediate_size=width,
                     max_position_embeddings=prompt + response + 8)
    base = rss()
    engine = generate(str(path), prompts, n, prompt, response)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"engine_bytes": peak - base}))
"""


@pytest.mark.extended  # CI: the plan against a measured step with the learner's figure above
@pytest.mark.slow
def test_the_hf_engines_figure_is_within_20_percent_of_a_measured_generation():
    """The 85M model generating 4 prompts x 8 samples of 64 + 192 tokens on the `hf` engine in a fresh process: its
    peak resident memory above the process before the model, against the plan's engine on CPU (weights, their
    packed copy, the KV cache and its reused storage, the sampling logits)."""
    dims, prompts, n, prompt, response = (768, 7, 12, 1536), 4, 8, 64, 192
    measured = _measure(_MEASURE_ENGINE, (*dims, prompts, n, prompt, response), "engine_bytes")
    cfg = _cfg(*_shape_overrides(dims), f"rollout.generation_batch_size={prompts * n}",
               f"rollout.max_new_tokens={response}")
    planned = make_plan(cfg, Devices(gpus_per_node=0, cpu=True), prompt_tokens=prompt).roles[1].total
    assert abs(planned - measured) / measured < 0.2, (planned, measured)


def test_a_run_that_cannot_fit_is_refused_naming_the_change_that_fits(tmp_path):
    """Qwen2.5-7B, full fine-tuning on 8 colocated ranks with vLLM at 40% of each 80 GiB device."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    base = [f"model.path={tmp_path}", "model.dtype=bfloat16", "learner.world_size=8", "rollout.num_workers=8",
            "rollout.engine=vllm", "rollout.max_new_tokens=2048", "learner.micro_batch_size=4",
            "rollout.engine_params={vllm: {gpu_memory_utilization: 0.4}}"]
    devices = Devices(1, 8, 80.0)
    unsharded = _cfg(*base, "model.gradient_checkpointing=true")  # ZeRO 0: 16 bytes a parameter on every rank
    with pytest.raises(ConfigError, match=r"memory plan does not fit: learner \+ rollout device \(colocated\): needs "
                                          r"[0-9.]+ GiB at its peak, a device has 80. It would fit with "
                                          r"learner.zero_stage=(\d)") as refused:
        check_fits(unsharded, devices)
    stage = refused.value.args[0].split("learner.zero_stage=")[1][0]
    check_fits(_cfg(*base, "model.gradient_checkpointing=true", f"learner.zero_stage={stage}"), devices)
    no_checkpointing = _cfg(*base, "learner.zero_stage=3")
    assert suggest_fix(no_checkpointing, devices, 1024, model_shape(tmp_path)) == "model.gradient_checkpointing=true"
    fits = [*base, "model.gradient_checkpointing=true", "learner.zero_stage=3"]
    assert make_plan(_cfg(*fits), Devices(1, 4, 80.0)).problems == ["the placement needs 8 GPUs, the cluster has 4"]
    starved = make_plan(_cfg(*fits, "rollout.engine_params={vllm: {gpu_memory_utilization: 0.2}}"), devices)
    assert any("KV cache" in p and "cannot hold one sequence" in p for p in starved.problems), starved.problems


def test_looprl_run_checks_the_plan_before_start_up_and_plan_prints_it(tmp_path, capsys):
    from cluster.cli import main
    from cluster.pipeline import check_recipe
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_70B))
    cfg = _cfg(f"model.path={tmp_path}", "model.dtype=bfloat16", "cluster.gpu_memory_gib=80")
    with pytest.raises(ConfigError, match="memory plan does not fit"):
        check_recipe(cfg, str(tmp_path))
    check_recipe(_cfg("cluster.gpu_memory_gib=80"), None)  # the tiny model fits
    assert main(["plan", str(ROOT / "recipes/quickstart.yaml"), f"model.path={tmp_path}", "model.dtype=bfloat16"]) == 1
    out = capsys.readouterr().out
    assert "70.55B parameters (meta), 80 layers" in out and "does not fit" in out


def test_sequence_parallelism_divides_the_learners_activations_over_its_group():
    from cluster.plan import learner_use
    shape = ModelShape("llama", 10**9, 2048, 24, 16, 16, 5504, 32000, 24)
    one = learner_use(_cfg("learner.world_size=4", "learner.micro_batch_size=1", "rollout.max_new_tokens=16384"),
                      shape, 1024)
    two = learner_use(_cfg("learner.world_size=4", "learner.micro_batch_size=1", "rollout.max_new_tokens=16384",
                           "learner.sequence_parallel_size=2", "learner.attn_implementation=sdpa"), shape, 1024)
    for item in ("activations", "backward working memory"):
        assert two.items[item] == pytest.approx(one.items[item] / 2, rel=1e-3), item
    assert two.items["weights"] == one.items["weights"]  # the model states do not change
    assert "8704 tokens a micro-batch per rank (sequence parallelism over 2)" in two.notes[0]


def test_a_tensor_parallel_engine_holds_a_share_of_the_weights_on_each_of_its_devices():
    from cluster.plan import Devices, make_plan
    shape = ModelShape("llama", 7 * 10**9, 4096, 32, 32, 8, 11008, 32000, 32)
    base = ["model.dtype=bfloat16", "rollout.engine=vllm", "cluster.placement=split", "learner.world_size=4",
            "rollout.num_workers=2"]
    one = make_plan(_cfg(*base), Devices(1, 8, 80.0), shape=shape)
    two = make_plan(_cfg(*base, "rollout.tensor_parallel_size=2"), Devices(1, 8, 80.0), shape=shape)
    engine_one, engine_two = one.roles[1], two.roles[1]
    assert engine_two.items["weights"] == engine_one.items["weights"] // 2 == 7 * 10**9
    # the same device share for the KV cache holds twice the tokens: each device keeps half of every token's K/V
    assert engine_two.items["KV cache"] > engine_one.items["KV cache"]
    assert (one.gpus_needed, two.gpus_needed) == (6, 8)
    assert "the placement needs 12 GPUs, the cluster has 8" in make_plan(
        _cfg(*base, "rollout.tensor_parallel_size=4"), Devices(1, 8, 80.0), shape=shape).problems


# released config.json values of the models the real-scale recipes name (nothing is downloaded in tests)
RECIPE_MODELS = {
    "models/Qwen2.5-32B-Instruct": {"model_type": "qwen2", "hidden_size": 5120, "num_hidden_layers": 64,
                                    "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 27648,
                                    "vocab_size": 152064, "tie_word_embeddings": False},
    "models/Qwen2.5-7B-Instruct": {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
                                   "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                                   "vocab_size": 152064, "tie_word_embeddings": False},
    **{f"models/Ouro-{size}B-Thinking": {"model_type": "ouro", "hidden_size": 2048, "num_hidden_layers": layers,
                                          "num_attention_heads": 16, "num_key_value_heads": 16,
                                          "intermediate_size": 5632, "vocab_size": 49152, "total_ut_steps": 4,
                                          "tie_word_embeddings": False}
       for size, layers in (("1.4", 24), ("2.6", 48))},
}


@pytest.mark.parametrize("recipe", sorted(p for p in (ROOT / "recipes").glob("*.yaml")
                                          if "looprl plan" in p.read_text().split("\noutput_dir")[0]),
                         ids=lambda p: p.name)
def test_a_real_scale_recipe_fits_the_cluster_its_header_names(recipe, tmp_path, capsys):
    """The `looprl plan ... --nodes N --gpus-per-node G --gpu-memory-gib M` line of a recipe's header is what it was
    sized for: the plan of its model's released config on that cluster fits."""
    import re

    from cluster.cli import main
    from rl import config as rl_config
    line = next(x for x in recipe.read_text().splitlines() if "looprl plan" in x)
    cluster = re.search(r"--nodes (\d+) --gpus-per-node (\d+) --gpu-memory-gib (\d+)", line).groups()
    path = rl_config.load(recipe).model.path
    (tmp_path / "config.json").write_text(json.dumps(RECIPE_MODELS[path]))
    assert main(["plan", str(recipe), f"model.path={tmp_path}", "--nodes", cluster[0], "--gpus-per-node", cluster[1],
                 "--gpu-memory-gib", cluster[2]]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("fits") and f"GPUs: {int(cluster[0]) * int(cluster[1])} of" in out
