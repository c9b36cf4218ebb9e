"""Recipe schema: typed dataclasses turned into an OmegaConf structured config.

Every field has a type, a default and a one-line doc (the comment after it, also shown by
`looprl config show`). `load(path, overrides)` rejects unknown or misspelled keys with the full
key path and the closest valid name, and wrong types with the file and key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rl.recipe import ConfigError, as_container
from rl.validation import check_values


@dataclass
class TinyModelConfig:
    hidden_size: int = 128  # width of the tiny Llama-style model built in code
    num_layers: int = 3  # decoder layers
    num_heads: int = 4  # attention heads
    intermediate_size: int = 512  # MLP width
    max_position_embeddings: int = 128  # longest prompt+response
    arch: str = "llama"  # llama (models/tiny.py) | ouro (a looped model, models/ouro.py) | llada (a masked-diffusion model, models/diffusion.py)
    loops: int = 4  # ouro: passes over the shared layer stack (total_ut_steps)
    norm_placement: str = "prenorm"  # arch llama: prenorm (Llama's pre-norms) | simplenorm (SimpleGPT: an RMSNorm right after every linear inside the blocks, no pre-norms; models/simplegpt.py)
    added_tokens: list[str] = field(default_factory=list)  # whole strings with a token id each in the character tokenizer (fixed phrases of a task read as one token)
    task_tokens: bool = False  # also add the synthetic task's phrases (its `added_tokens`, e.g. the memo task's hints and templates)


@dataclass
class ComponentConfig:
    name: str  # registered name, 'package.module:attr' or 'path/to/file.py:attr'
    params: dict[str, Any] = field(default_factory=dict)  # keyword parameters of the component


@dataclass
class ModelConfig:
    path: str | None = None  # HF model folder; null builds a tiny model and tokenizer in code (models/tiny.py)
    family: str = "auto"  # model family (registry kind "family"): how the learner loads the model and what its training forward returns; auto (looped for model_type ouro, masked_diffusion for llada, else causal) | causal | looped | masked_diffusion
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)  # used when path is null
    dtype: str = "float32"  # float32 | bfloat16 for learner and rollout weights
    trust_remote_code: bool = False  # passed to transformers' from_pretrained
    gradient_checkpointing: bool = False  # activation checkpointing in the learner


@dataclass
class SyntheticTaskConfig:
    task: str = "arithmetic"  # synthetic task (registry kind "task"): arithmetic (a+b*c=, rl/tasks/arithmetic.py) | facts (made-up people and facts with an evidence corpus, rl/methods/factuality/task.py) | plans (research goals with rubrics; SFT teaches plans and grading, rl/methods/rubric_self_grade/task.py) | addition (a+b= with a fixed-width sum, for masked-diffusion models) | styles (sums solved in a sparse or a dense style, DenseSteer's task, rl/methods/densesteer/task.py) | long_tail_arithmetic (a+b*c= where one problem in eight chains eight products: answers with a long tail of lengths; params long_fraction, long_products)
    num_train: int = 4000  # generated training problems (SFT warm-up and RL prompts draw from disjoint parts)
    num_eval: int = 200  # held-out problems, never trained on
    sft_fraction: float = 0.5  # share of training problems used by the SFT warm-up; RL uses the rest
    wrong_order_fraction: float = 0.5  # share of SFT targets that use the wrong order of operations
    digits: int = 3  # addition task: digits of each operand (the sum is written with one more)
    seed: int = 1234  # generator seed (independent of the run seed)
    params: dict[str, Any] = field(default_factory=dict)  # the task's own keyword arguments (e.g. styles: dense_fraction, num_pairs, min_terms, max_terms)


@dataclass
class DataConfig:
    train_path: str | None = None  # JSONL/Parquet file or load_from_disk folder; null: synthetic task
    eval_path: str | None = None  # held-out set, same columns; null: synthetic task's held-out split
    sft_path: str | None = None  # SFT warm-up data (prompt + target columns); null: synthetic task
    prompt_column: str = "prompt"  # column holding the problem text
    answer_column: str = "answer"  # column holding the ground truth passed to rewards
    target_column: str = "target"  # SFT target column
    metadata_columns: list[str] = field(default_factory=list)  # train/eval columns copied into each sample's metadata, where reward functions and the prompt sampler read them (e.g. the skill category of trainer.prompt_sampler curriculum)
    chat_template: bool = False  # wrap prompts with the tokenizer's chat template
    bad_rows: str = "error"  # train/eval rows that cannot be read (not UTF-8, not JSON, a column changing type, an empty prompt or answer): error (the first stops the run naming the file and the row, counted from 1) | drop (skipped and counted)
    prompt_prefix: str = ""  # text placed before every prompt; `artifact:NAME`: the text of an earlier stage's artifact file (e.g. artifact:memo_prompt, the prompt and memory MEMO found) and a blank line
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)  # the embedded task


@dataclass
class SFTConfig:
    enabled: bool = False  # run a supervised warm-up before RL
    steps: int = 1200  # optimizer steps
    batch_size: int = 64  # sequences per optimizer step (global)
    lr: float = 2e-3  # peak learning rate
    warmup_steps: int = 50  # linear warm-up steps before the scheduler's shape
    weight_decay: float = 0.0  # weight decay passed to learner.optimizer
    loop_readouts: str = "final"  # looped models: final (the NLL of the last loop's readout, what is served) | all (the NLL averaged over every loop's readout, so early exits are trained too)
    scheduler: ComponentConfig = field(default_factory=lambda: ComponentConfig("cosine"))  # SFT learning-rate schedule (registry kind "scheduler"): cosine (decay to params.min_lr_ratio, default 0.1, of lr) | constant
    epochs: float = 0.0  # > 0: train this many passes over the SFT rows (steps = ceil(epochs * rows / batch_size)), instead of `steps`
    format: str = "auto"  # row format of data.sft_path: auto (messages when the file has sft.messages_column) | prompt_response (data.prompt_column + data.target_column) | messages
    messages_column: str = "messages"  # chat rows: a list of {role, content} (system | user | assistant | tool) rendered with the tokenizer's chat template; the loss covers the assistant turns only
    max_length: int = 0  # > 0: a row longer than this many tokens after templating is a bad row
    bad_rows: str = "error"  # error: the first bad row (missing role, empty content, no assistant turn, too long) stops the stage with a message naming the row | drop: skip bad rows and count them by reason (summary sft_dropped_rows)
    eval_path: str | None = None  # held-out SFT rows (same format) whose loss is logged as sft/eval_loss; null: the synthetic task's sft_val split if it has one
    eval_fraction: float = 0.0  # without eval_path: hold out this share of the SFT rows (seeded) for sft/eval_loss
    eval_every: int = 0  # steps between held-out loss evaluations (0: only after the last step)
    save_every: int = 0  # steps between SFT checkpoints in output_dir/sft_checkpoints (resume: auto continues from the newest)
    keep_checkpoints: int = 1  # SFT checkpoints kept on disk
    sampler: str = "auto"  # order of the SFT rows: shuffle (seeded, every epoch) | sequential (the file's order) | auto (sequential when an ordering stage such as ep_order wrote the SFT data, else shuffle)

@dataclass
class RolloutConfig:
    engine: str = "hf"  # generation engine (registry kind "engine"): hf | vllm
    engine_params: dict[str, Any] = field(default_factory=dict)  # engine options, one section per engine: {hf: {attn_implementation: eager}, vllm: {max_model_len: 512}}; the configured engine takes its own section (switching rollout.engine switches the options with it)
    num_workers: int = 1  # rollout worker actors
    tensor_parallel_size: int = 1  # devices each rollout engine spans (vLLM's tensor parallelism; its worker processes start inside the rollout actor): with GPUs each rollout bundle reserves this many on one node (cluster.placement: split), on CPU the engine splits the actor's cores between its ranks. The weight sync hands every rank the full tensors and each loads its shard. vllm engine only (hf runs on one device)
    n: int = 8  # samples per prompt (group size)
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 32  # response length cap
    stop: list[str] = field(default_factory=list)  # stop strings: a response ends after the first one it produces
    eval_temperature: float = 0.0  # 0 = greedy decoding for held-out evaluation
    eval_top_p: float = 1.0  # nucleus sampling of held-out evaluation (the RLTT protocol: 0.95)
    eval_runs: int = 1  # independent sampled runs per held-out prompt (mean@k over runs; the RLTT protocol: 10 at temperature 0.2); > 1 needs eval_temperature > 0
    env: str | None = None  # environment of multi-turn episodes (registry kind "env"): null = single-turn generation | calculator | a plugin
    env_params: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the environment class
    max_turns: int = 4  # env: policy turns per episode
    max_episode_tokens: int = 256  # env: response tokens per episode, actions and observations together
    agent_loop: str = "lockstep"  # env: how episodes advance. lockstep: turn t of every unfinished episode in one generate call, then all of turn t's steps (reproducible for a seed) | per_episode: each episode joins the next generate call as soon as its step returns, so a slow tool holds only its own episode (which episodes share a call depends on timing)
    env_workers: int = 8  # env: environment steps (tool calls) running at once per rollout worker, on threads; model-written code still runs in rollout.sandbox, one sandbox per call
    agent: str | None = None  # an agent program written outside looprl (rollout.agent_programs): a .py file, module:function or a shell command, started per episode against the rollout worker's OpenAI-compatible endpoint (OPENAI_BASE_URL: /v1/chat/completions, /v1/completions); the tokens the endpoint served are trained on, the reward the program reports is the env_return reward. Exclusive with rollout.env
    agent_timeout_s: float = 300.0  # agent: wall time of one episode's program; past it its process group is killed and the episode fails
    openai_port: int = 0  # agent: port of each rollout worker's endpoint on 127.0.0.1 (0: a free one)
    env_step_timeout_s: float = 60.0  # env: wall time of one environment step; a step past it ends its episode as failed (0: none)
    sandbox: str = "bwrap"  # where model-written code (the Python tool of calculator, agentic_proposing, monoscale) runs: bwrap (bubblewrap: own namespaces, unprivileged, read-only interpreter, no network, limits for the whole process tree; refused when bubblewrap is missing) | process (a plain child process with per-process limits: NOT a boundary, trusted code only)
    env_opponent_path: str | None = None  # env: model folder of a frozen engine playing the environment's 'frozen' seat
    decoding: str | None = None  # decoding method of RL rollouts (registry kind "decoding"; hf engine): null = plain (looprl's decode loop without hooks, which samples what transformers generate samples) | a method with hooks
    decoding_params: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the decoding method
    eval_decoding: str | None = None  # decoding method of held-out evaluation (as rollout.decoding; null = plain)
    eval_decoding_params: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the evaluation decoding method
    generation_batch_size: int = 256  # prompts*n per generate call inside a worker
    num_cpus: float = 0.5  # CPUs reserved per worker in the placement group
    # NCCL cannot join two ranks on one GPU, hence cuda_ipc for colocated GPU roles
    weight_sync: str = "object_store"  # object_store (numpy buffers through Ray; any placement) | collective (rank 0 broadcasts in buckets: gloo on CPU, NCCL on GPU with split placement; with max_staleness > 0 received beside the generation and swapped in between two) | cuda_ipc (GPU, colocated: rollout worker i reads learner rank i's weights through CUDA IPC handles)
    partial_tokens: int = 0  # partial rollouts (rl.loop.partial): > 0: each step every unfinished response grows by at most this many tokens and the step trains on the first prompts_per_step groups whose responses have all finished; the longer ones carry over to later steps (their tokens keep the version that sampled them; trainer.max_staleness then bounds each token's age, nothing is submitted ahead). 0: every response is generated to its end within its step
    partial_groups: int = 0  # partial rollouts: groups kept open in the pool (new prompts fill it up each step); 0: twice trainer.prompts_per_step
    in_flight_updates: bool = False  # hf or vllm engine, plain decoding, weight_sync object_store or collective; takes effect with trainer.max_staleness >= 1 (at 0 no weights arrive during a generation and the run is the synchronous one): weights that arrive while an engine generates are swapped in between two decode steps (hf) or engine steps (vllm, which then steps its engine itself; requests keep running, none is aborted) (the KV cache of the tokens before stays the old weights'), so a long generation samples its later tokens from newer weights; every token records its policy version (batch extra token_version), tokens more than max_staleness versions old leave the loss; pair with algorithm.is_correction: token
    sync_bucket_mb: int = 256  # bucket size of the collective / cuda_ipc weight transfer
    max_restarts: int = 3  # Ray restarts of a dead rollout worker (its rollout is then generated again)
    sleep_between_phases: bool = False  # colocated GPU roles take turns: the engine frees GPU memory while the learner trains (vLLM sleep mode level 1, the hf engine moves its model to host memory; a no-op on CPU)
    threads: int = 1  # torch intra-op threads per worker (colocated roles take turns, so they may each use all cores)


@dataclass
class LearnerConfig:
    world_size: int = 1  # DeepSpeed data-parallel ranks (one Ray actor each)
    sequence_parallel_size: int = 1  # Ulysses sequence parallelism (DeepSpeed's ALST attention): groups of this many ranks share each micro-batch, every rank runs 1/s of each sequence's positions and the attention layers exchange heads for positions (attention heads divisible by it), so activations per rank shrink with s for long responses. Divides world_size (data-parallel size = world_size / s); causal and looped families, padded rows (not pack_sequences or share_prompts), attn_implementation sdpa or flash_attention_2 (sdpa for looped models, without sliding-window layers)
    zero_stage: int = 0  # ZeRO stage 0-3
    micro_batch_size: int = 64  # sequences per forward/backward per rank (when max_tokens_per_micro_batch is 0)
    max_tokens_per_micro_batch: int = 0  # > 0: micro-batches are formed by token count (prompt + response real tokens, at most this many each; a longer sequence goes alone), balanced across ranks, instead of micro_batch_size sequences; every rank runs the same number
    pack_sequences: bool = False  # run each micro-batch as one row of its real tokens (no padding): every linear layer, norm and MLP runs once over the micro-batch's tokens. Attention stays within each sequence: flash-attention's variable-length kernels (GPU, positions restart per sequence), or for Llama/Mistral/Qwen2/Qwen3 without a sliding window under eager/sdpa, looprl's bucketed variable-length attention (`models.varlen_attention`: sequences of similar length attend in buckets, no [T, T] mask); other models under eager/sdpa attend through a dense block mask, quadratic in the row's length. Causal family only
    share_prompts: bool = False  # the rows that repeat a prompt (GRPO's n samples) share its forward, so the prompt's tokens cost 1/n of their matmuls (forward and backward, also in logprob passes); equal to the padded forward up to float rounding. Padded micro-batches: each distinct prompt runs once into a KV cache, its rows are repeated (gradients of the repeats add up), then the responses run after it in buckets of similar length (not with model.gradient_checkpointing). With pack_sequences: the packed row holds each prompt once and its responses attend to it (looprl's variable-length attention: Llama/Mistral/Qwen2/Qwen3 without a sliding window, eager or sdpa). A token budget keeps a prompt's rows in one micro-batch. Causal family
    compile_position_wise: bool = False  # torch.compile (inductor) each decoder layer's MLP and norms, the final norm, and the rotary embedding its attention applies (`models.blocks.compile_rotary`), in the policy's learner: their elementwise work fuses, forward and backward (bf16 on CPU: the race's learner step 13.8 -> 11.8 s on a Zen 4 without the rotary; 6.2 -> 4.5 s on an AMX Xeon with it; fp32 packed 12.8 -> 12.1 s there; alternated in one process, `benchmarks/learner_step.py --compile`); the first step pays the compile (seconds). With pack_sequences and share_prompts (and no gradient checkpointing) each decoder layer compiles whole instead, its packed-row attention left eager between the graphs (`models.blocks.compile_decoder_layers`: residual adds, rotary and the reshapes around attention fuse too; the race's bf16 packed learner step 3.59 -> 3.33 s, alternated in one process, `benchmarks/learner_step.py --compile-layers`). ZeRO 0-2; the rest of attention stays eager
    attn_implementation: str | None = None  # transformers' attention kernel of the learner's models (policy, reference, critic): null = the model's own | eager | sdpa | flash_attention_2. On CPU at short lengths eager trains faster (sdpa's fused CPU kernel has a slow backward: 15% of the 85M model's step at 94 tokens); the looped family accepts null or sdpa only
    logprob_chunk_tokens: int = 512  # response tokens per vocabulary-projection chunk: logits exist for one chunk at a time (recomputed in backward), never [N, L, V]
    lr: float = 1e-4  # RL learning rate
    weight_decay: float = 0.0  # weight decay passed to the optimizer
    optimizer: ComponentConfig = field(default_factory=lambda: ComponentConfig("adamw"))  # optimizer for SFT and RL (registry kind "optimizer"): adamw {betas: [0.9, 0.999], eps: 1e-8, fused: true} | mezo (forward-only, zero_stage 0) {eps: 1e-3, seed: 0}
    scheduler: ComponentConfig = field(default_factory=lambda: ComponentConfig("constant"))  # RL learning-rate schedule (registry kind "scheduler"): constant | cosine {min_lr_ratio: 0.1}
    adapter: ComponentConfig | None = None  # parameter-efficient adapter (registry kind "adapter"; models/adapters.py): lora {r: 8, alpha: 16, dropout: 0.0, target_modules: all-linear | [q_proj, v_proj, ...]} (peft). Only its parameters train (ZeRO 0-3: under ZeRO-3 the frozen base is partitioned too); the reference policy is the base with the adapter disabled; only the adapter's tensors travel to the rollout engines (hf serves it unmerged); checkpoints hold the adapter alone; export writes the merged model and the peft folder in adapter/
    grad_clip: float = 1.0  # global gradient-norm clip (0 disables)
    warmup_steps: int = 0  # linear learning-rate warm-up steps before the scheduler's shape
    num_cpus: float = 0.5  # CPUs reserved per rank in the placement group
    threads: int = 1  # torch intra-op threads per rank
    backend: str = "auto"  # torch.distributed backend: auto (nccl on GPU, gloo on CPU) | gloo | nccl
    offload_between_phases: bool = False  # colocated roles take turns: optimizer states, master weights and gradients wait in host memory while the rollout engines generate (DeepSpeed offload_states; ZeRO 1-3, ZeRO-3 on CUDA only)


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"  # advantage estimator (registry kind "advantage"): grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | grpo_passk | mgpo | gae (PPO with a critic, see `critic`)
    advantage_params: dict[str, Any] = field(default_factory=dict)  # keyword parameters, e.g. {eps: 1e-6, norm_by_std: true}
    loss: str = "ppo_clip"  # policy loss (registry kind "loss")
    loss_params: dict[str, Any] = field(default_factory=dict)  # keyword parameters, e.g. {eps_low: 0.2, eps_high: 0.28, dual_clip: 3.0}
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm (global counts)
    kl_coef: float = 0.0  # KL-to-reference coefficient (0: no reference model is loaded)
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_in_reward: bool = False  # subtract kl_coef*sum(KL) from the reward instead of adding KL to the loss
    entropy_coef: float = 0.0  # entropy bonus coefficient
    teacher_path: str | None = None  # on-policy distillation: HF folder of a frozen teacher (the policy's tokenizer and vocabulary) whose log-probabilities of the student's own sampled tokens are the learning signal; each learner rank holds it like the reference (partitioned under ZeRO-3). null: no teacher
    distill_coef: float = 1.0  # teacher: weight of the per-token term log pi_teacher(y_t) - log pi_student(y_t) (minus the sampled token's reverse KL) added to each response token's advantage
    distill_reward_weight: float = 1.0  # teacher: weight of the reward's advantage beside the teacher's term (0: distillation alone, the rewards are still computed and logged)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal and sample more prompts
    max_sampling_rounds: int = 4  # cap on generation rounds per step with dynamic sampling
    mask_truncated: bool = False  # DAPO: completions that hit max_new_tokens leave the loss
    overlong_buffer: int = 0  # DAPO soft overlong penalty window (tokens before max_new_tokens); 0 disables
    overlong_penalty: float = 1.0  # reward penalty at max_new_tokens, ramping linearly over the buffer
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batches: int = 1  # optimizer steps per pass (split of the rollout batch)
    is_correction: str = "none"  # rollout/learner mismatch correction: none | token | sequence importance weights
    is_mode: str = "truncate"  # truncate: cap importance weights at is_cap; mask: zero those above it
    is_cap: float = 2.0  # importance-weight cap (truncated IS, as verl's TIS; TRL uses 3.0)


@dataclass
class CriticConfig:
    """PPO's value model, used when the advantage estimator reads `values` (algorithm.advantage: gae). It trains
    in its own DeepSpeed learner group (learner.world_size ranks, same ZeRO stage, dtype and token budget),
    colocated with the policy's ranks."""
    model_path: str | None = None  # HF folder of the value model; null: the policy's starting weights with a new one-output head (a separate model: any folder AutoModelForTokenClassification loads)
    lr: float = 1e-5  # critic learning rate
    value_clip: float = 0.2  # clip of the value update around the old values (0 disables)
    warmup_steps: int = 0  # first RL steps that train only the critic (the policy waits for usable values)
    grad_clip: float = 1.0  # global gradient-norm clip of the critic (0 disables)


@dataclass
class RewardFnConfig:
    name: str = "math"  # reward (registry kind "reward"): short name, module:attr, file.py:attr, entry point, or the URL of a `looprl serve-reward` server
    remote: str | None = None  # URL of a `looprl serve-reward` server (the same as name: URL)
    weight: float = 1.0  # weight in the summed reward
    params: dict[str, Any] = field(default_factory=dict)  # keyword arguments passed to the function
    label: str | None = None  # name of its score and components in the logs (default: name); needed when one function appears twice, e.g. a self-grader and a held-out judge
    eval_only: bool = False  # score held-out evaluations only (e.g. an expensive held-out judge): logged as eval/reward/<label>, never trained on


@dataclass
class JudgeConfig:
    model_path: str | None = None  # HF model folder; null: a frozen copy of the run's initial policy (after SFT); "artifact:NAME": the folder an earlier stage published (e.g. artifact:reward_model)
    engine: str = "hf"  # engine: hf | vllm (generation) | hf_classifier (a reward model that scores, for the reward_model reward)
    engine_params: dict[str, Any] = field(default_factory=dict)  # engine options, one section per engine (as rollout.engine_params)
    num_workers: int = 1  # engine actors; a batch of prompts is split across them
    num_cpus: float = 0.5  # CPUs per worker
    num_gpus: float = 0.0  # GPUs per worker (a fraction shares a device)
    dtype: str = "float32"  # float32 | bfloat16
    threads: int = 1  # torch intra-op threads per worker
    temperature: float = 0.0  # judge sampling (0: greedy)
    top_p: float = 1.0  # nucleus sampling
    top_k: int = 0  # sample among the k most likely tokens (0: all)
    repetition_penalty: float = 1.0  # > 1: tokens already in the prompt or completion are less likely (transformers' and vLLM's rule)
    max_new_tokens: int = 256  # completion cap
    chat_template: bool | None = None  # wrap judge prompts in the judge tokenizer's chat template (null: as data.chat_template)


@dataclass
class RewardConfig:
    functions: list[RewardFnConfig] = field(default_factory=lambda: [RewardFnConfig()])  # summed with weights
    judges: dict[str, JudgeConfig] = field(default_factory=dict)  # named frozen judge/grader models that rewards call
    num_workers: int = 2  # worker processes of the reward service
    timeout_s: float = 10.0  # per-sample timeout; a timed-out sample is a recorded failure
    failure_reward: float = 0.0  # reward given to a failed sample (it is also flagged and counted)
    failed_samples: str = "exclude"  # exclude: a failed sample leaves the loss and every estimator's group statistics (mean, std, leave-one-out baselines are those of the scored samples; its advantage is 0) | train: it is scored failure_reward and trains like any sample (the rubric protocol's "unparseable grader output scores 0" with failure_reward 0)


@dataclass
class DeadlinesConfig:
    """How long the trainer waits on remote actors before it treats one as stuck (0 disables a deadline)."""
    generate_s: float = 1800.0  # a rollout (every worker's share of one step's generation): a stuck rollout worker is killed, restarted by Ray (rollout.max_restarts) and its rollout generated again
    reward_s: float = 0.0  # the reward service's answer for one batch; 0: derived from reward.timeout_s x samples per reward worker + 300 s (the service kills and restarts a stuck reward process itself)
    learner_s: float = 3600.0  # one learner call (a logprob pass, a training step, a checkpoint): a stuck learner stops the run with a message naming the phase and the checkpoint to resume from
    sync_s: float = 600.0  # one weight sync to the rollout engines: a stuck rollout worker is killed and restarted with the current weights


@dataclass
class TrainerConfig:
    steps: int = 30  # RL steps (rollout + update)
    prompts_per_step: int = 16  # prompts sampled per step (x rollout.n samples)
    prompt_sampler: ComponentConfig = field(default_factory=lambda: ComponentConfig("shuffle"))  # which training prompts each step draws (registry kind "sampler"): shuffle (every row once per epoch, seeded) | curriculum (skill categories by inverse validated proficiency, Agentic Proposing; params category_column, floor, ema, initial) | a plugin
    eval_every: int = 0  # evaluate on held-out prompts every N steps (0: only before and after)
    eval_max_prompts: int = 200  # held-out prompts used per evaluation
    checkpoint_every: int = 0  # save a checkpoint every N steps (0: only at the end)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    save_hf: bool = True  # export the final policy with save_pretrained
    select_by: str | None = None  # a held-out metric (e.g. eval/accuracy, eval/reward/heldout_grade) that picks the checkpoint the later stages (export, evaluate) use: every evaluation (trainer.eval_every, and the last step) that improves it saves a checkpoint kept apart from pruning; null: the last step's
    select_mode: str = "max"  # max | min: whether a larger or a smaller select_by is better
    log_every: int = 1  # print/log every N steps
    max_staleness: int = 0  # asynchronous rollout: the rollout of step t+k is generated while step t trains (0: synchronous, 1: one-step-off)
    deadlines: DeadlinesConfig = field(default_factory=DeadlinesConfig)  # waits on remote actors that mean one is stuck


@dataclass
class ClusterConfig:
    address: str | None = None  # Ray address; local: a private instance of this run's own (it ends with the driver, even a killed one); null: RAY_ADDRESS, else the cluster `ray start --head` runs on this machine, else a private instance
    join_running: bool = False  # with no address: join another run's private Ray instance running on this machine instead of starting one (the runs then share its resources)
    wait_for_resources_s: float = 600.0  # how long the run waits, saying so every 30 s, while resources it needs are held by other jobs of the cluster it joined
    num_cpus: int | None = None  # CPUs for a locally started Ray (null: all)
    placement: str = "colocated"  # colocated (learner rank i shares a bundle with rollout worker i) | split
    placement_strategy: str = "PACK"  # Ray placement-group strategy: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    learner_resources: dict[str, float] = field(default_factory=dict)  # extra Ray resources per learner bundle, e.g. {trainer_node: 1} to pin learners to nodes started with that resource
    rollout_resources: dict[str, float] = field(default_factory=dict)  # extra Ray resources per rollout bundle (split placement pins rollout workers the same way)
    gpu_memory_gib: float = 0.0  # memory of one GPU for the memory plan `looprl run` checks before any actor starts (`looprl plan` prints it); 0: the driver's first CUDA device, and no check on a machine without one
    plan_prompt_tokens: int = 1024  # the prompt length that plan assumes (a recipe does not state one)


@dataclass
class LoggingConfig:
    tensorboard: bool = True  # write TensorBoard events to output_dir/tensorboard
    wandb_project: str | None = None  # W&B project (needs the wandb extra); null disables
    mlflow_tracking_uri: str | None = None  # MLflow tracking URI (needs the mlflow extra): a server (http://host:5000), a database (sqlite:///mlflow.db, full mlflow) or a local file store (file:./mlruns; MLflow 3 keeps that backend in maintenance, looprl opts in for it); null disables. Metrics per step, the resolved recipe as parameters; a resumed run continues its MLflow run
    mlflow_experiment: str = "looprl"  # the MLflow experiment the run is logged under
    progress_bar: bool = True  # tqdm progress bar on stderr


@dataclass
class StageConfig:
    name: str  # stage (registry kind "stage"): model | data | sft | rl | export | evaluate, 'package.module:Cls' or 'path/to/file.py:Cls'
    params: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the stage class
    label: str | None = None  # the stage's name in this run (records, --stage, summary); default: name


DEFAULT_STAGES = ("model", "data", "sft", "rl", "export", "evaluate")


@dataclass
class Config:
    output_dir: str = "runs/default"  # where metrics, checkpoints and exports go
    seed: int = 0  # global seed (data order, sampling, init)
    resume: str = "no"  # no | auto (latest checkpoint in output_dir) | path to a checkpoint folder
    model: ModelConfig = field(default_factory=ModelConfig)  # policy model
    data: DataConfig = field(default_factory=DataConfig)  # datasets and columns
    sft: SFTConfig = field(default_factory=SFTConfig)  # optional supervised warm-up stage
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation
    learner: LearnerConfig = field(default_factory=LearnerConfig)  # DeepSpeed training
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # advantage, loss, KL
    critic: CriticConfig = field(default_factory=CriticConfig)  # value model (PPO with algorithm.advantage gae)
    reward: RewardConfig = field(default_factory=RewardConfig)  # reward functions and service
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # loop length, eval, checkpoints
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # Ray and placement
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # logs and trackers
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig(n) for n in DEFAULT_STAGES])  # the steps of the run, in order; a stage reuses its artifacts while its params, recipe keys and inputs are unchanged


# ---------------------------------------------------------------------------- validation
def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside `tp` (plain, Optional[...]) or None; not the values of a mapping."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) is dict:
        return None
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _mapping_value_dataclass(tp: Any) -> type | None:
    """`V` of `dict[str, V]` when V is a dataclass (named groups such as `reward.judges`)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return args[1]
    return None


def _list_item_dataclass(tp: Any) -> type | None:
    if typing.get_origin(tp) in (list, typing.List):  # noqa: UP006
        args = typing.get_args(tp)
        return args[0] if args and dataclasses.is_dataclass(args[0]) else None
    return None


# Keys that moved: a recipe that still sets one is told the new place.
MOVED_KEYS = {"learner.betas": "learner.optimizer.params.betas", "learner.adam_eps": "learner.optimizer.params.eps",
              "learner.fused_adam": "learner.optimizer.params.fused"}


def _check_keys(data: Any, schema: type, path: str, source: str) -> None:
    """Recursively reject keys that the schema does not declare, naming the closest valid one."""
    if not isinstance(data, dict):
        return
    hints = typing.get_type_hints(schema)
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if full in MOVED_KEYS:
            raise ConfigError(f"{source}: {full!r} is now {MOVED_KEYS[full]!r} (with learner.optimizer.name: adamw)")
        if key not in hints:
            close = difflib.get_close_matches(str(key), list(hints), n=1, cutoff=0.5)
            hint = f"; did you mean {(path + '.' if path else '') + close[0]!r}?" if close else \
                f"; valid keys here: {sorted(hints)}"
            raise ConfigError(f"{source}: unknown key {full!r}{hint}")
        sub = _dataclass_of(hints[key])
        if sub is not None and isinstance(value, dict):
            _check_keys(value, sub, full, source)
        item = _list_item_dataclass(hints[key])
        if item is not None and isinstance(value, list):
            for i, v in enumerate(value):
                _check_keys(v, item, f"{full}[{i}]", source)
        entry = _mapping_value_dataclass(hints[key])
        if entry is not None and isinstance(value, dict):
            for name, v in value.items():
                _check_keys(v, entry, f"{full}.{name}", source)


def _overrides_to_dict(overrides: list[str]) -> dict:
    """`a.b=1` dotted overrides to a nested dict, values parsed as YAML scalars."""
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def _replaced_mappings(data: Any, schema: type, path: str = "") -> list[str]:
    """Dotted keys in `data` that set a whole free-form mapping (`dict[str, Any]` fields such as
    `algorithm.loss_params`). Such a mapping replaces the one it overrides instead of merging into it:
    switching `algorithm.loss` must not keep the previous loss's parameters. A nested key
    (`algorithm.loss_params.eps_low=0.1`) still updates one entry."""
    if not isinstance(data, dict):
        return []
    hints, out = typing.get_type_hints(schema), []
    for key, value in data.items():
        if key not in hints:  # reported by _check_keys
            continue
        full = f"{path}.{key}" if path else str(key)
        sub = _dataclass_of(hints[key])
        if sub is not None:
            out += _replaced_mappings(value, sub, full)
        elif typing.get_origin(hints[key]) is dict and isinstance(value, dict):
            out.append(full)
    return out


def _merge(base: DictConfig, data: dict, source: str, replace: list[str] | None = None) -> DictConfig:
    """Merge `data` into `base`; the whole mappings named in `replace` (default: every free-form mapping
    that `data` sets, as a recipe does) are emptied first."""
    _check_keys(data, Config, "", source)
    for key in _replaced_mappings(data, Config) if replace is None else replace:
        parent = key.rpartition(".")[0]
        if parent and OmegaConf.select(base, parent) is None:
            continue  # an optional section set for the first time (e.g. learner.adapter): nothing to empty
        OmegaConf.update(base, key, {}, merge=False)
    try:
        return OmegaConf.merge(base, OmegaConf.create(data))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"{source}: invalid value for {key!r}: {msg}") from None


def _read_recipe(p: Path) -> dict:
    if not p.is_file():
        raise ConfigError(f"recipe {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: malformed YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: a recipe must be a mapping of keys, got {type(data).__name__}")
    return data


def _recipe_chain(p: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict]]:
    """A recipe and the recipes it builds on: `base: other.yaml` (relative to the recipe) is loaded
    first and this recipe's keys override it."""
    if p.resolve() in seen:
        raise ConfigError(f"{p}: recipe 'base' chain loops back on itself")
    data = _read_recipe(p)
    base = data.pop("base", None)
    if base is None:
        return [(p, data)]
    if not isinstance(base, str):
        raise ConfigError(f"{p}: 'base' must be a path to another recipe, got {base!r}")
    return _recipe_chain(p.parent / base, (*seen, p.resolve())) + [(p, data)]


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> DictConfig:
    """Recipe YAML + dotted overrides → typed, validated config (an OmegaConf DictConfig over `Config`)."""
    cfg: DictConfig = OmegaConf.structured(Config)
    if path is not None:
        for p, data in _recipe_chain(Path(path)):
            cfg = _merge(cfg, data, str(p))
    if overrides:
        data = _overrides_to_dict(overrides)
        # `algorithm.loss_params={...}` replaces the mapping; `algorithm.loss_params.eps_low=0.1` updates it
        given_whole = {i.split("=", 1)[0].strip() for i in overrides if i.split("=", 1)[1].lstrip().startswith("{")}
        cfg = _merge(cfg, data, "command-line override",
                     replace=[k for k in _replaced_mappings(data, Config) if k in given_whole])
    check_values(cfg)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)


def field_docs(schema: type = Config, prefix: str = "") -> dict[str, str]:
    """`dotted.key -> one-line doc`, read from the comment after each field in this file."""
    import inspect
    docs: dict[str, str] = {}
    src_lines = inspect.getsource(schema).splitlines()
    for line in src_lines:
        stripped = line.strip()
        if ":" in stripped and "#" in stripped and not stripped.startswith(("#", "class", "def", "@")):
            name = stripped.split(":", 1)[0].strip()
            docs[prefix + name] = stripped.split("#", 1)[1].strip()
    for f in dataclasses.fields(schema):
        tp = f.type if not isinstance(f.type, str) else typing.get_type_hints(schema)[f.name]
        sub = _dataclass_of(tp) or _mapping_value_dataclass(tp)
        if sub is not None:
            docs.update(field_docs(sub, prefix + f.name + (".<name>." if sub is _mapping_value_dataclass(tp) else ".")))
    return docs


def engine_actor_config(cfg: DictConfig, **overrides: Any) -> dict[str, Any]:
    """A judge-group config (`reward.judges` entry) that serves a model the way the rollout engines do (engine,
    its params, dtype, threads), for stages that run a frozen model of their own."""
    return {**asdict(JudgeConfig()), "engine": cfg.rollout.engine, "engine_params": as_container(cfg.rollout.engine_params),
            "dtype": cfg.model.dtype, "threads": cfg.rollout.threads, "num_cpus": 0, **overrides}
