"""TRL GRPOTrainer CPU baseline: the TRL side of `benchmarks/grpo_step.py`'s race. Fully offline.

Builds (if missing) a tiny random Qwen2 model + locally trained byte-level BPE tokenizer,
a toy arithmetic dataset (64 prompts), and runs 10 GRPO steps on CPU without vLLM.
Workload knobs: --prompts-per-step, --num-generations, --max-completion-length (default 2 x 4 x 32).

Run:
    python trl_grpo_baseline.py --model-dir DIR --out DIR   (in an environment with torch 2.13.0 and trl)
    python trl_grpo_baseline.py --steps 10 --model-dir ./tiny-qwen2-trl
Env used: none required (HF_HUB_OFFLINE=1 / TRANSFORMERS_OFFLINE=1 are set below for safety).
Tested with: torch 2.13.0+cpu, trl 1.16.0, transformers 5.24.0, accelerate 1.15.0, datasets 5.2.0.
"""
import argparse
import json
import os
import random
import re
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch
from datasets import Dataset
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    TrainerCallback,
)
from trl import GRPOConfig, GRPOTrainer


# ----------------------------------------------------------------------------- tiny model
def build_tiny(out, hidden=128, layers=2, vocab=1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    random.seed(0)
    torch.manual_seed(0)
    words = ("the a is what of and to in answer question number plus minus times "
             "equals think step result sum value compute please final").split()
    corpus = []
    for _ in range(4000):
        a, b = random.randint(0, 99), random.randint(0, 99)
        corpus.append(f"What is {a}+{b}? The answer is {a + b}.")
        corpus.append(" ".join(random.choices(words, k=12)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                     pad_token="<|endoftext|>")
    hf_tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf_tok.save_pretrained(out)
    v = ((len(hf_tok) + 63) // 64) * 64
    cfg = Qwen2Config(vocab_size=v, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 64), max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=hf_tok.eos_token_id,
                      pad_token_id=hf_tok.pad_token_id, bos_token_id=hf_tok.eos_token_id)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=hf_tok.eos_token_id,
                                               pad_token_id=hf_tok.pad_token_id)
    model.save_pretrained(out)


# ----------------------------------------------------------------------------- data + reward
def make_dataset(n=256, seed=0):
    rng = random.Random(seed)
    rows = {"prompt": [], "answer": []}
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows["prompt"].append(f"What is {a}+{b}?")
        rows["answer"].append(str(a + b))
    return Dataset.from_dict(rows)


def correctness_reward(completions, answer, **kwargs):
    """1.0 if the first number in the completion equals the answer, else 0.5/(1+|n-answer|); 0 if no number."""
    out = []
    for c, a in zip(completions, answer):
        nums = re.findall(r"\d+", c)
        if not nums:
            out.append(0.0)
        elif nums[0] == a:
            out.append(1.0)
        else:
            out.append(0.5 / (1 + abs(int(nums[0][:6]) - int(a))))
    return out


# ----------------------------------------------------------------------------- timing
class StepTimer(TrainerCallback):
    def __init__(self):
        self.t = None
        self.step_times = []
        self.logs = []

    def on_step_begin(self, args, state, control, **kw):
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.step_times.append(time.perf_counter() - self.t)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs:
            self.logs.append(dict(logs))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", default="tiny-qwen2-trl")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="trl_out")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=32)
    return p.parse_args()


def grpo_config(args: argparse.Namespace, completions: int) -> GRPOConfig:
    return GRPOConfig(
        output_dir=args.out,
        use_cpu=True,                      # CPU only
        bf16=args.bf16,                    # TRL defaults bf16=True; set False for an fp32 CPU baseline
        gradient_checkpointing=False,      # TRL defaults True; pointless for a 0.4M-param model
        per_device_train_batch_size=completions,   # default 8 completions/step = 2 prompts x 4
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        learning_rate=1e-4,
        beta=args.beta,                    # 0.0 (TRL default) -> no reference model
        temperature=1.0,
        use_vllm=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
    )


def time_generate(model) -> dict:
    """Generation's seconds, token positions and calls, counted by wrapping `model.generate` (TRL calls the
    unwrapped model's generate)."""
    gen = {"s": 0.0, "tok": 0, "calls": 0}
    orig_generate = model.generate

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        out = orig_generate(*a, **k)
        gen["s"] += time.perf_counter() - t0
        ids = k.get("input_ids", a[0] if a else None)
        seq = out.sequences if hasattr(out, "sequences") else out
        if ids is not None:
            gen["tok"] += seq.shape[0] * (seq.shape[1] - ids.shape[1])
        gen["calls"] += 1
        return out
    model.generate = timed_generate
    return gen


def baseline_result(timer: StepTimer, gen: dict, total: float, completions: int) -> dict:
    st = timer.step_times
    steady = st[1:] if len(st) > 1 else st
    step_logs = [entry for entry in timer.logs if "completions/mean_length" in entry]
    eff_tokens = sum(entry["completions/mean_length"] * completions for entry in step_logs)   # tokens up to EOS
    return {
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "steps": len(st), "train_wall_s": round(total, 2),
        "step_s_first": round(st[0], 3) if st else None,
        "step_s_mean_excl_first": round(sum(steady) / max(1, len(steady)), 3),
        "gen_s_total": round(gen["s"], 2), "gen_calls": gen["calls"],
        "gen_token_positions": gen["tok"],
        "gen_tok_per_s_during_generate": round(gen["tok"] / gen["s"], 1) if gen["s"] else None,
        "completion_tokens_effective": round(eff_tokens),
        "completion_tok_per_s_overall": round(eff_tokens / total, 1),
        "reward_mean_first_last": [step_logs[0].get("reward"), step_logs[-1].get("reward")] if step_logs else None,
    }


def main():
    args = parse_args()
    completions = args.prompts_per_step * args.num_generations
    if not os.path.exists(os.path.join(args.model_dir, "model.safetensors")):
        build_tiny(args.model_dir, hidden=args.hidden, layers=args.layers)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model_dir)
    timer = StepTimer()
    trainer = GRPOTrainer(model=args.model_dir, reward_funcs=correctness_reward, args=grpo_config(args, completions),
                          train_dataset=make_dataset(), processing_class=tokenizer, callbacks=[timer])
    gen = time_generate(trainer.model)
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    print("BASELINE_RESULT " + json.dumps(baseline_result(timer, gen, total, completions)))


if __name__ == "__main__":
    main()
