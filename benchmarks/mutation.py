"""Mutation testing: do the tests catch a broken mechanism? mutmut mutates the defining functions of the RL core's
estimators and losses and of the methods, one change at a time (an operator, a constant, a dropped argument), and
runs the fast tests that cover each mutant; a mutant the tests do not fail on survived.

    python benchmarks/mutation.py [--only advantages losses zo_finetuner] [--out benchmarks/results/mutation.json]
    python benchmarks/mutation.py --only core --no-run   # the JSON from what mutmut recorded, no run
    make mutation

The modules and the tests mutmut may run are `[tool.mutmut]` in pyproject.toml; mutmut keeps its work in
`mutants/` and resumes where it stopped. Per target: mutants killed, survived (listed), timed out, and the
kill rate over the mutants that are not equivalent (`EQUIVALENT`: mutants that cannot change a result, each with
the reason). The tests assert on behaviour (values by hand, invariances, effects); none names a mutant.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# target -> mutmut's names of its functions' mutants (`module.x_function__mutmut_N`)
# Each target's mutant-name prefixes: a whole module, or a method's defining functions where its module holds
# more (U-LoRA's gates, context sums and EMA prior beside plain LoRA in models/adapters.py)
_ULORA = ("x_ema_prior", "xǁSequenceContextǁ", "x_context_sums", "x_finish_optimizer_step",
          "x_sequence_state", "x_restore_sequence_state", "x_has_sequence_state", "xǁ_UtilizationGatesǁ",
          "x__ulora_linear_class", "x_ulora", "x_share_sequence_context")
# CORE: the revision of committed tokens inside the diffusion sampler (its probes, candidates, score and remasking)
_CORE = ("xǁRemaskingǁ", "x__margin", "x__remask", "x__revise", "x__sample")
# DSR: its tree-guided repair (spans, the repair ladder, local then global calls), Sugeno grading and the splice of
# components; the Lean-lite checker and the synthetic statement generator are the harness it is tested against
_DSR = ("x_sugeno_score", "x_assemble", "x_spans", "x_node_at", "x_smallest_containing", "x_is_wrapper",
        "x_repair_ladder", "x_replace_node", "x_rename_hypotheses", "x_splice", "x_component_spans",
        "x_component_of_column", "x__declared", "x_drive", "x_tree_guided_repair", "x__component_text",
        "x__with_component", "x__local_request", "x_local_fix_holds", "x__global_call", "x_global_repair")
TARGETS: dict[str, tuple[str, ...]] = {
    "advantages": ("rl.advantages.",),
    "losses": ("rl.losses.",),
    "zo_finetuner": ("rl.methods.zo_finetuner.optimizer.",),
    "fair_calib": ("rl.methods.fair_calib.core.",),
    "decomper": ("rl.methods.decomper.core.",),
    "guidance": ("rl.methods.guidance.core.",),
    "ulora": tuple(f"models.adapters.{name}" for name in _ULORA),
    "monoscale": ("rl.methods.monoscale.core.",),
    "ep_order": ("rl.methods.ep_order.core.",),
    "bliss": ("rl.methods.bliss.core.",),
    "agentic_proposing": ("rl.methods.agentic_proposing.core.",),
    "memo": ("rl.methods.memo.core.",),
    "core": tuple(f"models.diffusion.{name}" for name in _CORE),
    "dsr": tuple(f"rl.methods.dsr.core.{name}" for name in _DSR),
}

# mutants that compute the same results as the code (checked by reading them: `mutmut show NAME`)
_DIM = "dim -1 -> +1 on a 2-D [N, L] tensor (or unsqueeze of a 1-D one): the same dimension"
_PRECISION = ("an intermediate's dtype (float64 -> the input's): the same values to float32 rounding; the float64 "
              "guards accumulation over long responses, beyond what a test can tell apart at its sizes")
_DEVICE = ("a tensor made on the default device instead of its input's: the same on the CPU the suite runs on; a "
           "CUDA run of the stage (tests/cluster/test_gpu.py) is what tells them apart")
_CAST = "a dtype the next operation casts to anyway (assignment into a float32 tensor, a bool or int mask times floats)"
# LeanScorer's measure, as specified (rl/methods/dsr/README.md): the α = 0.5 set has as many A's as the α = 1 set
# and a penalty of at most 1, so its term never exceeds the α = 1 term and the score is #A / n (tested on every grading
# of up to five conditions); what only the α = 0.5 term or the B penalty reads cannot change a score
_SUGENO_B = "the B penalty: it scales only the α = 0.5 term, which never exceeds the α = 1 term"
_SUGENO_HALF = "the α = 0.5 term: it never exceeds the α = 1 term (as many A's, times a penalty of at most 1)"
_SUGENO_ALL_A = "the all-A shortcut: #A / n is 1 on an all-A grading anyway (and min(1, 2) is 1)"
_TIE = "< for <= against a uniform draw: the two differ only on a draw exactly at the bound (probability 0)"
_FLAG = "None for False in a flag read only for its truth"
_POSITIONS = ("positions left to the model or shifted by a constant: LLaDA derives them from the attention mask as "
              "the sampler does, and rotary attention reads only their differences")
EQUIVALENT: dict[str, str] = {
    **{f"rl.advantages.x_discounted_outcome_returns__mutmut_{i}": _DIM for i in (8, 10, 12, 20)},
    "rl.advantages.x_outcome_token_rewards__mutmut_14": _DIM,
    **{f"rl.advantages.x_discounted_outcome_returns__mutmut_{i}": _PRECISION for i in (2, 19)},
    **{f"rl.advantages.x_gae_advantages_and_returns__mutmut_{i}": _PRECISION
       for i in (4, 7, 9, 14, 17, 20, 22, 25, 27)},
    **{f"rl.advantages.x_masked_whiten__mutmut_{i}": _PRECISION for i in (3, 5)},
    **{f"rl.advantages.x_outcome_token_rewards__mutmut_{i}": _CAST for i in (2, 5, 7, 20)},
    "rl.advantages.x_outcome_token_rewards__mutmut_13": "idx + 1 -> idx + 2: still positive at every counted "
                                                        "position, so the argmax (the last one) is the same",
    "rl.advantages.x_group_stats__mutmut_58": "count > 1 -> count >= 1: a group of one has a squared deviation of "
                                              "0, so both branches give a variance of 0",
    **{f"rl.losses.x_aggregate_loss__mutmut_{i}": _DIM for i in (7, 36, 53)},
    "rl.losses.x_kl_in_reward__mutmut_12": _DIM,
    **{f"rl.losses.x_sequence_log_ratio__mutmut_{i}": _DIM for i in (10, 18)},
    "rl.losses.x_rollout_importance_weights__mutmut_53": _DIM,
    "rl.losses.x_aggregate_loss__mutmut_4": _CAST,
    **{f"rl.losses.x_rollout_importance_weights__mutmut_{i}": _CAST for i in (14, 63, 65, 102)},
    "rl.losses.x_sequence_log_ratio__mutmut_2": _CAST,
    "rl.losses.x_soft_overlong_penalty__mutmut_7": _CAST + "; integer lengths minus an integer, clamped with a float "
                                                            "bound, are promoted to float32 anyway",
    "rl.losses.x_rollout_importance_weights__mutmut_31": "the estimator named explicitly (k3) is kl_penalty's default",
    **{f"rl.methods.zo_finetuner.optimizer.x_normalization__mutmut_{i}": _CAST + " (the default float32 is σ's)"
       for i in (3, 5)},
    "rl.methods.zo_finetuner.optimizer.x_pert_features__mutmut_8": _CAST + " (the five features are float32)",
    **{f"rl.methods.zo_finetuner.optimizer.xǁPertBundleǁload__mutmut_{i}": "the file holds tensors, strings, numbers "
       "and tuples: the safe loader (torch's default) and the full one read it alike" for i in (3, 5, 6)},
    **{f"rl.methods.zo_finetuner.optimizer.xǁZOFinetunerǁ__init____mutmut_{i}": "step() sets the scales from the "
       "bundle before it draws a direction: the initial value is never read by a step" for i in (46, 48)},
    "rl.methods.zo_finetuner.optimizer.xǁZOFinetunerǁ_directions__mutmut_6": "xi * 1.0 is xi",
    **{f"rl.methods.fair_calib.core.x_{fn}__mutmut_{i}": _DEVICE for fn, ids in
       (("lags_from_agreement", (18, 20)), ("position_weights", (12, 14, 15, 25, 35, 38))) for i in ids},
    **{f"rl.methods.fair_calib.core.x_{fn}__mutmut_{i}": "block_outputs without its stop runs the blocks after j "
       "too; block j's output is the same" for fn, ids in (("_block_loss", (4, 7)), ("calibrate_blocks", (22, 25)))
       for i in ids},
    **{f"rl.methods.fair_calib.core.x_accumulate_prior__mutmut_{i}": _PRECISION for i in (9, 11)},
    "rl.methods.fair_calib.core.x_calibrate_blocks__mutmut_65": "< -> <= on the best epoch's loss: a later epoch "
                                                                "with exactly the same float loss",
    "rl.methods.decomper.core.x_learn_biases__mutmut_55": "< -> <= on the best epoch's error: a later epoch with "
                                                          "exactly the same float error",
    **{f"rl.methods.decomper.core.x_{fn}__mutmut_{i}": "block_outputs without its stop runs the blocks after j too; "
       "block j's output is the same" for fn, ids in (("_block_mse", (7, 10)), ("learn_biases", (20, 23)))
       for i in ids},
    **{f"rl.methods.decomper.core.x_{fn}__mutmut_{i}": "full_matrices: the first k singular vectors are the same"
       for fn, ids in (("plain_factors", (5, 6)), ("whitened_factors", (23, 25))) for i in ids},
    **{f"rl.methods.decomper.core.x_whitened_factors__mutmut_{i}": _CAST + " (the identity's ones and zeros are "
       "exact in float32, and the sum is float64)" for i in (14, 17)},
    **{f"rl.methods.decomper.core.x_whitened_factors__mutmut_{i}": _DEVICE for i in (15, 18, 24)},
    "rl.methods.decomper.core.x_whitened_factors__mutmut_3": "XᵀX is square: shape[1] is shape[0]",
    "rl.methods.decomper.core.x__block_mse__mutmut_15": _DIM,
    "rl.methods.decomper.core.x_whitened_factors__mutmut_5": "+1e-12 -> -1e-12 in the ridge: it guards an all-zero "
                                                             "XᵀX; with any input energy it is below the ridge's "
                                                             "float64 resolution",
    "rl.methods.zo_finetuner.optimizer.x_learn_to_learn__mutmut_34": "the placeholder before step 0's restart makes "
                                                                      "the optimizer; it is never read",
    "rl.methods.zo_finetuner.optimizer.x_learn_to_learn__mutmut_54": "the rate is set from the decay schedule at every "
                                                                      "step before the optimizer steps",
    # U-LoRA (models/adapters.py)
    **{f"models.adapters.xǁSequenceContextǁ__init____mutmut_{i}": "the model's forward pre-hook sets it before any "
       "layer reads it" for i in range(1, 7)},
    "models.adapters.xǁSequenceContextǁafter__mutmut_1": "None is falsy, as False is",
    "models.adapters.xǁSequenceContextǁafter__mutmut_2": "recording left on after the forward: a gradient-checkpointing "
                                                        "recompute records the same gates again, so the step's mean "
                                                        "gate (the EMA's input) is unchanged",
    "models.adapters.xǁSequenceContextǁbefore__mutmut_21": "the ids are [B, T]: shape[1] is shape[-1]",
    "models.adapters.xǁSequenceContextǁbefore__mutmut_42": "past is None or a transformers Cache (which has "
                                                          "get_seq_length): `or` and `and` agree on both",
    **{f"models.adapters.x_context_sums__mutmut_{i}": _CAST for i in (4, 86)},
    "models.adapters.x_context_sums__mutmut_24": "a [T] index broadcasts over the rows in torch.where as the expanded "
                                                "[B, T] one does",
    **{f"models.adapters.x_context_sums__mutmut_{i}": _DEVICE for i in (27, 29)},
    **{f"models.adapters.x_context_sums__mutmut_{i}": _DIM for i in (39, 79)},
    "models.adapters.xǁ_UtilizationGatesǁgates__mutmut_12": "one adapter per model: the carried sums are written and "
                                                           "read under the same key",
    "models.adapters.xǁ_UtilizationGatesǁ_record__mutmut_5": _CAST,
    "models.adapters.xǁ_UtilizationGatesǁfinish_step__mutmut_6": _CAST,
    "models.adapters.xǁ_UtilizationGatesǁfinish_step__mutmut_13": "an empty step's record is zeros, read at its count "
                                                                 "(still 0) and skipped",
    "models.adapters.xǁ_UtilizationGatesǁfinish_step__mutmut_16": "an all-reduce over one rank is the identity",
    **{f"models.adapters.xǁ_UtilizationGatesǁfinish_step__mutmut_{i}": _DEVICE for i in (36, 39)},
    **{f"models.adapters.xǁ_UtilizationGatesǁfinish_step__mutmut_{i}": _CAST + " (the default float32 is m's)"
       for i in (37, 40)},
    **{f"models.adapters.x__ulora_linear_class__mutmut_{i}": "peft's dispatcher always passes r and lora_alpha"
       for i in (1, 2)},
    "models.adapters.x__ulora_linear_class__mutmut_13": "peft's LoRA layer takes its options from the config it is "
                                                       "given; the keywords repeat them (a test checks the dropout "
                                                       "arrives)",
    "models.adapters.x__ulora_linear_class__mutmut_43": "an analysis attribute that every forward writes before "
                                                       "anything reads it",
    "models.adapters.x__ulora_linear_class__mutmut_44": "`ulora` replaces it with the model's shared context before "
                                                       "any forward",
    **{f"models.adapters.x__ulora_linear_class__mutmut_{i}": "a Linear base layer is called with the input alone: no "
       "other argument reaches it" for i in (53, 54, 58, 59)},
    "models.adapters.x__ulora_linear_class__mutmut_61": "one adapter per model: no active adapter lacks its A",
    **{f"models.adapters.x__ulora_linear_class__mutmut_{i}": _CAST for i in (65, 75)},
    # Guidance (rl/methods/guidance/core.py)
    **{f"rl.methods.guidance.core.xǁLLMCitationJudgeǁ{fn}__mutmut_{i}": "an answer that names no rating scores 0, as "
       "the renamed rating does" for fn, ids in (("support", (15, 16)), ("needs_citation", (9, 10))) for i in ids},
    # EP-Order (rl/methods/ep_order/core.py)
    **{f"rl.methods.ep_order.core.x_cosine_distances__mutmut_{i}": "the upper clip 2 -> 3 or none: 1 - cos is at "
       "most 2 plus a rounding of 1e-16" for i in (5, 12)},
    "rl.methods.ep_order.core.x_zone_proportions__mutmut_32": "every count doubled: the same shares",
    "rl.methods.ep_order.core.x_zone_proportions__mutmut_38": "max(1, 0) -> max(2, 0) divides zero counts: zeros "
                                                            "either way",
    "rl.methods.ep_order.core.x_spherical_kmeans__mutmut_15": "init k-means++ named: it is scikit-learn's default",
    **{f"rl.methods.ep_order.core.x_{fn}__mutmut_{i}": _PRECISION.replace("long responses", "many rows") for fn, ids in
       (("spherical_kmeans", (5, 7)), ("choose_k", (7, 9))) for i in ids},
    "rl.methods.ep_order.core.x_two_opt__mutmut_12": "i up to len(path): for the added i the inner range is empty",
    "rl.methods.ep_order.core.x_two_opt__mutmut_33": "< -> <= against a bound 1e-12 below: a candidate that ties "
                                                    "the bound exactly is a 1e-12 improvement either way",
    "rl.losses.x_rollout_importance_weights__mutmut_58": "the exponent's guard 20 -> 21: e^20 is 4.9e8, so for any "
                                                         "cap below it both cap or mask every ratio that reaches the "
                                                         "guard",
    **{f"rl.methods.bliss.core.{name}": "use_cache False -> True, None or unset: a full forward's logits and hidden "
                                        "states do not depend on whether it also returns a cache"
       for name in ("x_sequence_stats__mutmut_8", "x_sequence_stats__mutmut_10", "x_sequence_stats__mutmut_11",
                    "xǁScoreModelǁforward__mutmut_5", "xǁScoreModelǁforward__mutmut_9",
                    "xǁScoreModelǁforward__mutmut_10")},
    **{f"rl.methods.bliss.core.xǁScoreModelǁforward__mutmut_{i}": "the score model's attention mask or positions "
       "left out: its rotary attention depends on position differences alone (positions counted from 0 on a "
       "left-padded row give the same scores), and without a mask transformers masks the padding from where the "
       "positions start again; a model with absolute positions would tell them apart" for i in (3, 4, 7, 8)},
    "rl.methods.bliss.core.x_solve_z__mutmut_21": "norm > clip -> >=: at norm == clip the step is scaled by 1",
    "rl.methods.bliss.core.xǁBilevelSelectorǁ_step__mutmut_12": "float('nan') -> float('NAN'): the same value",
    "rl.methods.bliss.core.xǁBilevelSelectorǁlower_level_loss__mutmut_10": "gamma and target -> gamma or target: "
        "the added term is gamma x 0 without a target (its KL is zeros) and 0 x KL with gamma 0",
    "rl.methods.bliss.core.xǁBilevelSelectorǁ__init____mutmut_11": "warmup_steps 0 -> 1: both give a factor of 1 "
                                                                      "from the first step (max(1, W))",
    "rl.methods.bliss.core.xǁCollectiveǁ__init____mutmut_8": "the world size without torch.distributed 1 -> 2: it is "
                                                              "read only when torch.distributed is initialised",
    "rl.methods.bliss.core.xǁScoreModelǁforward__mutmut_24": "squeeze(-1) -> squeeze(+1) on the head's [N, 1] output: "
                                                              "the same dimension",
    **{f"rl.methods.agentic_proposing.core.x_evaluate__mutmut_{i}": "sympify's rational reading only changes how "
       "decimals and divisions are read; the grammar of the arithmetic skills (EXPRESSION) admits neither"
       for i in (8, 10, 11)},
    "rl.methods.agentic_proposing.core.xǁCurriculumSamplerǁprobabilities__mutmut_3": "a constant numerator (2 "
        "instead of 1) cancels in the normalisation",
    **{f"rl.methods.monoscale.core.xǁLMDistillerǁ__call____mutmut_{i}": "the incumbent's name when the evidence "
       "names none ('' -> None or 'XXXX'): no agent has that name, so its evidence is empty either way"
       for i in (24, 26, 27)},
    "rl.methods.monoscale.core.xǁSimulatedPoolǁoutcome__mutmut_18": "int.from_bytes without a byte order: "
        "from Python 3.11 on (the suite's) big-endian is the default; on 3.10 the call would raise",
    "rl.methods.monoscale.core.xǁSimulatedPoolǁoutcome__mutmut_25": "< p -> <= p on a 64-bit uniform draw: equal "
        "only on a measure-zero event",
    "rl.methods.monoscale.core.x_make_growing_pool__mutmut_38": "< -> <= against a uniform float draw: equal only "
        "on a measure-zero event",
    "rl.methods.memo.core.x_apply_crud__mutmut_6": "the removals' count starts at 1 instead of 0: it is set to the "
                                                   "number of removals before it is read",
    "rl.methods.memo.core.x_apply_crud__mutmut_26": "ignored = instead of += for the removals: it is the first "
                                                    "change of the count, from 0",
    "rl.methods.memo.core.x_apply_crud__mutmut_62": "removed indices below or equal to an edited index: an edited "
                                                    "index is never a removed one (those edits are ignored first)",
    "rl.methods.memo.core.x_apply_crud__mutmut_91": "max_insights >= 0 instead of > 0: at 0 the slice [-0:] is the "
                                                    "whole list, as no cap is",
    "rl.methods.memo.core.xǁPrefixReplayBufferǁsample__mutmut_8": "choices(..., k=1) -> choices(...): k's default is 1",
    **{f"rl.methods.monoscale.core.x_distill_evidence__mutmut_{i}": "the key looked up for a type without an "
       "incumbent ('' -> None, 'XXXX' or left out): no agent has that name, so none has evidence" for i in (25, 27, 28)},
    **{f"rl.methods.monoscale.core.x_distill_evidence__mutmut_{i}": "an incumbent without evidence as None instead "
       "of []: both are falsy at the only place it is read before a type is skipped" for i in (21, 23)},
    "rl.methods.monoscale.core.x_distill_evidence__mutmut_77": "reliability `or 1` for `or 0`: every entry has a "
                                                              "reliability, and 0 and 1 are as far from 0.5",
    "rl.methods.monoscale.core.x_familiarization_tasks__mutmut_21": _TIE,
    "rl.methods.monoscale.core.x_claimed_kinds__mutmut_22": "the text put in place of a claimed type ('XX XX' for "
                                                            "' '): it only has to name no type",
    "rl.methods.dsr.core.x__global_call__mutmut_25": _TIE,
    "rl.methods.dsr.core.x_smallest_containing__mutmut_6": "> for >= between nodes of equal depth: siblings' spans "
                                                          "never overlap, so two nodes of one depth never both hold "
                                                          "a column",
    **{f"rl.methods.dsr.core.x_tree_guided_repair_steps__mutmut_{i}": _FLAG for i in (18, 129)},
    "models.diffusion.x__margin__mutmut_22": "the chosen token's stand-in -2 for -1: probabilities are >= 0, so the "
                                             "largest other one is the same at any negative value",
    **{f"models.diffusion.x__revise__mutmut_{i}": _DEVICE for i in (8, 11, 29, 32, 45, 48, 130, 132, 136, 139)},
    **{f"models.diffusion.x__sample__mutmut_{i}": _DEVICE for i in (17, 27, 31, 41, 45, 58, 61, 65, 68, 73, 77)},
    "models.diffusion.x__revise__mutmut_49": _TIE,
    **{f"models.diffusion.x__revise__mutmut_{i}": _DIM for i in (94, 96, 98)},
    "models.diffusion.x__sample__mutmut_51": _DIM,
    **{f"models.diffusion.x__revise__mutmut_{i}": _POSITIONS for i in (54, 57)},
    **{f"models.diffusion.x__sample__mutmut_{i}": _POSITIONS for i in (47, 49, 113, 183)},
    **{f"models.diffusion.x__sample__mutmut_{i}": _CAST + " (an integer fill is int64, the ids' dtype; a float "
       "all-ones mask is read as a bool; int(debt) reads the same counts)" for i in (26, 30, 40, 44, 72, 76, 82, 84)},
    **{f"models.diffusion.x__sample__mutmut_{i}": "a commit step's initial value: every position is committed by "
       "the end of sampling, so it is always overwritten" for i in (78, 79)},
    **{f"models.diffusion.x__sample__mutmut_{i}": "the block's-last-step rule (commit every open position): the "
       "schedule's remaining tokens plus the debt of remasked ones already equal the open positions there"
       for i in (137, 140)},
    "models.diffusion.x__sample__mutmut_153": "break for continue when a row commits nothing: every row has the same "
                                              "schedule and each probe sends back m tokens in every row, so when one "
                                              "row commits nothing at a step, none does",
    **{f"rl.methods.dsr.core.x_sugeno_score__mutmut_{i}": _SUGENO_B for i in (15, 16, 17, *range(19, 29), 35, 36, 37,
                                                                            54, 56, 57)},
    **{f"rl.methods.dsr.core.x_sugeno_score__mutmut_{i}": _SUGENO_HALF for i in (65, 66, 67, 68, 69, 87)},
    **{f"rl.methods.dsr.core.x_sugeno_score__mutmut_{i}": _SUGENO_ALL_A for i in (11, 12, 46, 47, 48)},
    **{f"rl.methods.dsr.core.x_sugeno_score__mutmut_{i}": "μ's C test: the thresholded sets hold only A's and B's "
       "(a C is graded 0 < 0.5), and a grading with a C has returned 0 before" for i in (38, 39, 41)},
    "rl.methods.dsr.core.x_sugeno_score__mutmut_78": "min(2, μ) for min(1, μ): μ is at most 1",
    "rl.methods.dsr.core.x_sugeno_score__mutmut_80": "μ of the empty α = 1 set is 0 either way",
}


def mutmut(*args: str) -> str:
    done = subprocess.run([str(Path(sys.executable).parent / "mutmut"), *args], cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"mutmut {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def statuses() -> dict[str, str]:
    """Every mutant's status from `mutmut results --all true` (lines `    name: status`)."""
    out = {}
    for line in mutmut("results", "--all", "true").splitlines():
        name, _, status = line.strip().partition(": ")
        if status:
            out[name] = status
    return out


def summarise(prefixes: tuple[str, ...], status: dict[str, str]) -> dict:
    mine = {k: v for k, v in status.items() if k.startswith(prefixes)}
    equivalent = sorted(k for k in mine if k in EQUIVALENT)
    counted = {k: v for k, v in mine.items() if k not in EQUIVALENT}
    killed = sum(v in ("killed", "timeout") for v in counted.values())
    survived = sorted(k for k, v in counted.items() if v == "survived")
    untested = sorted(k for k, v in counted.items() if v in ("no tests", "not checked", "skipped"))
    return {"mutants": len(mine), "killed": killed, "survived": len(survived), "untested": len(untested),
            "equivalent": len(equivalent), "kill_rate": killed / len(counted) if counted else None,
            "survivors": survived, "untested_mutants": untested,
            "equivalent_mutants": {k: EQUIVALENT[k] for k in equivalent}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(TARGETS), default=sorted(TARGETS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/mutation.json"))
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument("--no-run", action="store_true",
                        help="only summarise what mutmut recorded (e.g. after rerunning survivors by name with "
                             "`mutmut run NAME ...`)")
    args = parser.parse_args(argv)
    for target in [] if args.no_run else args.only:
        print(f"mutation: {target} ({', '.join(p + '*' for p in TARGETS[target])})", flush=True)
        mutmut("run", "--max-children", str(args.max_children), *(p + "*" for p in TARGETS[target]))
    status = statuses()
    out = Path(args.out)
    recorded = json.loads(out.read_text())["targets"] if out.exists() else {}  # targets not rerun stay as recorded
    report = {"cpu": platform.processor() or platform.machine(),
              "targets": {**recorded, **{t: summarise(TARGETS[t], status) for t in args.only}}}
    out.write_text(json.dumps(report, indent=1))
    print("| target | mutants | killed | survived | untested | equivalent | kill rate |\n|---|---|---|---|---|---|---|")
    for t, r in report["targets"].items():
        rate = "-" if r["kill_rate"] is None else f"{r['kill_rate']:.1%}"
        print(f"| {t} | {r['mutants']} | {r['killed']} | {r['survived']} | {r['untested']} | {r['equivalent']} | "
              f"{rate} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
