"""Does the suite catch realistic bugs? Run by hand (pytest does not collect it: its name does not start with test_):

    .venv/bin/python tests/support/mutations.py                    # every mutation, one at a time
    .venv/bin/python tests/support/mutations.py fp16-gnorm-scaled  # some of them, by name
    .venv/bin/python tests/support/mutations.py --baseline         # their tests on the code as it is: every one must pass
    .venv/bin/python tests/support/mutations.py --list             # names, files and tests

Each mutation is one bug put into one library file: an exact snippet replaced by another (the snippet must occur once,
else the mutation is reported stale: the code moved on and the table needs the new text). With it in place the
mutation's tests run once, in one pytest process ($NANOCHAT_TEST_WORKERS=0, no bytecode written, so no compiled
mutant outlives the run); any failing test catches it. The file is restored in a `finally`, also on Ctrl-C: from the
copy taken before, or, where someone else changed the file meanwhile, by putting the original snippet back into their
version. A table at the end says, for each mutation, whether it was caught and by which assertion.

The first eight are issue 59's: bugs a reviewer put into features whose own tests did not notice; then bugs of the
same kinds in the RL objective, the rollouts, the optimizers, the checkpoints, the engine's rows and the FlexAttention
variant of the shared-prompt attention; issue 67's (what got through the suite III, and bugs of the same kinds in the
compile rule, the rollout corrections and rejected tokens, the eval tasks, the calculator, the plan's --keep-last,
pruning, the checkpointer, the scheduler, pass@k, the run's progress); issue 66's Triton kernels; issue 75's
on-policy distillation.
"""

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEST_TIMEOUT_S = 600


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str        # relative to the repo
    original: str    # exact text, occurring once in the file
    mutated: str
    tests: tuple     # pytest node ids, any of which failing catches the mutation
    why: str = ""    # the bug, in words


MUTATIONS = [
    # ------------------------------------------------------------------ issue 59's
    Mutation("fp16-gnorm-scaled", "nanochat/optim/optimizers.py",
             "    if loss_scale is not None:\n        loss_scale.unscale_(model)\n    gnorm = grad_norm(model)\n",
             "    gnorm = grad_norm(model)\n    if loss_scale is not None:\n        loss_scale.unscale_(model)\n",
             ("tests/optim/test_fp16.py::test_the_returned_grad_norm_is_the_unscaled_gradients",),
             "the grad norm taken before the unscale: S times too large"),
    Mutation("fp16-nan-loss-is-overflow", "nanochat/optim/optimizers.py",
             "        if loss_finite:\n            loss_scale.update(found_inf=not grad_finite)\n",
             "        if True:\n            loss_scale.update(found_inf=not stepped)\n",
             ("tests/optim/test_fp16.py::test_a_non_finite_loss_skips_the_step_and_holds_the_scale",),
             "a non-finite loss backs the scale off as if the gradient overflowed"),
    Mutation("fp16-kl-hook-on-reference", "nanochat/optim/loss_scale.py",
             "        if logp.requires_grad:", "        if True:",
             ("tests/optim/test_fp16.py::test_fp16_with_a_kl_penalty_scales_the_policy_and_not_the_reference",),
             "the scaling hook registered on the frozen reference's log-probabilities too"),
    Mutation("dynamic-sampling-draw-seed", "nanochat/rl/run.py",
             "[question_seed(step, i, draw) for i in indices]", "[question_seed(step, i) for i in indices]",
             ("tests/rl/test_dynamic_sampling.py::test_a_question_drawn_again_in_a_step_samples_anew",),
             "every draw of a step seeds a question alike"),
    Mutation("dynamic-sampling-seed-key", "nanochat/rl/rollout.py",
             "    key = (step, example_index) if draw == 0 else (step, example_index, draw)\n",
             "    key = (step, example_index)\n",
             ("tests/rl/test_dynamic_sampling.py::test_seeds_differ_across_draws",
              "tests/rl/test_dynamic_sampling.py::test_a_question_drawn_again_in_a_step_samples_anew"),
             "question_seed ignores the draw"),
    Mutation("loss-clips-not-passed", "nanochat/rl/run.py",
             "mask_truncated=config.mask_truncated, clip_low=config.clip_low, clip_high=config.clip_high,",
             "mask_truncated=config.mask_truncated,",
             ("tests/rl/test_rl_losses.py::test_the_run_s_policy_loss_clips_at_the_documented_band_or_the_user_s",),
             "policy_loss_of leaves PolicyLoss at its 0.2/0.2 whatever the loss and flags"),
    Mutation("cispo-default-clip", "nanochat/rl/objective.py",
             '"cispo": (1.0, 0.28)}', '"cispo": (0.2, 0.28)}',
             ("tests/rl/test_rl_losses.py::test_the_run_s_policy_loss_clips_at_the_documented_band_or_the_user_s",),
             "CISPO given a floor of 0.8"),
    Mutation("saved-rollout-length", "nanochat/rl/progress.py",
             '"length": len(c.tokens),', '"length": len(c.tokens) - 1,',
             ("tests/rl/test_saved_rollouts.py::test_each_saved_record_is_what_its_sample_was",),
             "--save-rollouts' length one short"),
    Mutation("lag-default-false", "nanochat/engine/spec.py",
             'lag=device.type == "cuda" if lag is None else lag',
             "lag=False if lag is None else lag",
             ("tests/engine/test_decode_lag.py::test_an_engine_lags_by_default_on_cuda_and_not_on_a_cpu",),
             "the engine never lags unless told to, on CUDA too"),
    Mutation("background-copy-before-finish", "nanochat/checkpoints/background.py",
             "        self.finish()\n        (model_copy, optimizer_copy), self._host_tensors = host_copy("
             "(model_data, optimizer_data), self._host_tensors)\n",
             "        (model_copy, optimizer_copy), self._host_tensors = host_copy("
             "(model_data, optimizer_data), self._host_tensors)\n        self.finish()\n",
             ("tests/checkpoints/test_background_save.py::"
              "test_a_save_started_while_the_last_one_is_written_leaves_both_steps_as_they_were",),
             "the next snapshot copied into the buffers the last save's thread is still writing"),
    # ------------------------------------------------------------------ the RL objective and rollouts
    Mutation("advantage-sample-std", "nanochat/rl/advantages.py",
             "rewards.std(unbiased=False)", "rewards.std()",
             ("tests/rl/test_rl_options.py::test_advantages_scaled_by_std_and_a_zero_std_question_stays_zero",),
             "GRPO's std taken with Bessel's correction (nan for one sample)"),
    Mutation("sampler-logprobs-shifted", "nanochat/rl/advantages.py",
             "sampler[r, len(prompt) - 1:len(prompt) - 1 + len(logprobs)]",
             "sampler[r, len(prompt):len(prompt) + len(logprobs)]",
             ("tests/rl/test_sampler_gap.py::test_gap_is_zero_through_calculator_calls_and_early_ends",),
             "the sampler's log-probabilities placed one position late"),
    Mutation("ppo-clip-max", "nanochat/rl/objective.py",
             "return torch.minimum(unclipped, clipped_term), clipped_term < unclipped",
             "return torch.maximum(unclipped, clipped_term), clipped_term < unclipped",
             ("tests/rl/test_rl_options.py::test_clipped_surrogate_for_both_signs_of_the_advantage",),
             "PPO's pessimistic min turned into a max"),
    Mutation("k3-sign", "nanochat/rl/objective.py",
             "    log_ratio = ref_logp - logp\n    return torch.exp(log_ratio) - log_ratio - 1",
             "    log_ratio = logp - ref_logp\n    return torch.exp(log_ratio) - log_ratio - 1",
             ("tests/rl/test_rl_options.py::test_kl_penalty_hand_computed_and_row_skipping_off",),
             "k3 of KL(reference || policy) instead of KL(policy || reference)"),
    Mutation("sequence-norm-by-tokens", "nanochat/rl/objective.py",
             "(targets >= 0).sum(1).clamp(min=1).double() * per_rank(counts.sequences)",
             "(targets >= 0).sum(1).clamp(min=1).double() * per_rank(counts.tokens)",
             ("tests/rl/test_rl_reference.py::test_first_epoch_objective_and_gradient_equal_the_reference",),
             "--loss-norm=sequence divided by the step's tokens instead of its sequences"),
    Mutation("mask-truncated-inverted", "nanochat/rl/objective.py",
             "batch.targets.masked_fill(batch.truncated[:, None], -1)",
             "batch.targets.masked_fill(~batch.truncated[:, None], -1)",
             ("tests/rl/test_rl_options.py::test_truncated_rows_are_masked_and_count_in_no_denominator",),
             "--mask-truncated masks the rows that ended instead of those cut"),
    Mutation("truncated-flag-inverted", "nanochat/rl/rollout.py",
             "truncated=[not c.ended for c in completions]", "truncated=[c.ended for c in completions]",
             ("tests/rl/test_rollout.py::test_records_hold_what_the_engine_sampled_and_the_task_rewarded",),
             "rows that ended marked truncated"),
    Mutation("dynamic-sampling-prefers-no-signal", "nanochat/rl/rollout.py",
             "key=lambda i: not has_signal(drawn[i])", "key=lambda i: has_signal(drawn[i])",
             ("tests/rl/test_dynamic_sampling.py::test_a_step_keeps_the_first_questions_with_signal_in_draw_order",),
             "--dynamic-sampling keeps the questions without signal first"),
    Mutation("rank-blocks-not-strides", "nanochat/rl/rollout.py",
             "(position + rank + world_size * i) % num_examples",
             "(position + rank * examples_per_rank + i) % num_examples",
             ("tests/rl/test_rollout.py::test_rank_strided_data_covers_each_question_once_per_epoch",
              "tests/rl/test_dynamic_sampling.py::test_draws_walk_on_through_the_split_and_sample_anew"),
             "ranks take blocks of questions instead of nanochat's strides"),
    Mutation("pass-denominator-without-passes", "nanochat/rl/objective.py",
             "return valid_per_pass.repeat_interleave(device_batch_size) * (num_passes * examples_per_rank)",
             "return valid_per_pass.repeat_interleave(device_batch_size) * examples_per_rank",
             ("tests/rl/test_rl_objective.py::test_train_step_gradient_equals_hand_assembled_objective",),
             "nanochat's pass denominator without its number of passes"),
    Mutation("cispo-weight-differentiated", "nanochat/rl/objective.py",
             "weight = torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach()",
             "weight = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)",
             ("tests/rl/test_rl_losses.py::test_later_epoch_equals_the_reference",),
             "CISPO's clipped ratio differentiated (it must only weigh)"),
    Mutation("sampler-logprobs-of-the-tempered-distribution", "nanochat/rl/rollout.py",
             "sampler_logprobs=[c.logprobs for c in completions]",
             "sampler_logprobs=[c.sampling_logprobs for c in completions]",
             ("tests/rl/test_sampler_gap.py::test_rollouts_record_the_models_logprobs_not_the_tempered_samplers",),
             "the gap measured against the top-k/temperature distribution, not the model's"),
    Mutation("saved-rollout-successes-are-calls", "nanochat/rl/progress.py",
             '"tool_successes": c.tool_successes}', '"tool_successes": c.tool_calls}',
             ("tests/rl/test_saved_rollouts.py::test_each_field_comes_from_its_own_source",),
             "--save-rollouts' tool_successes read from the calls"),
    # ------------------------------------------------------------------ the optimizers and the schedule
    Mutation("warmup-off-by-one", "nanochat/optim/optimizers.py",
             "        return (step + 1) / warmup_steps\n", "        return step / warmup_steps\n",
             ("tests/optim/test_optim.py::test_lr_schedules_against_their_formulas",),
             "the warm-up's first step at lr 0"),
    Mutation("cosine-ignores-final-frac", "nanochat/optim/optimizers.py",
             "return final_lr_frac + (1 - final_lr_frac) * (1 + math.cos(math.pi * t)) / 2",
             "return (1 + math.cos(math.pi * t)) / 2",
             ("tests/optim/test_optim.py::test_lr_schedules_against_their_formulas",),
             "the cosine schedule decays to 0 whatever --final-lr-frac"),
    Mutation("init-lr-frac-not-recorded", "nanochat/optim/optimizers.py",
             '            group["lr"] = group["lr"] * init_lr_frac\n            group["initial_lr"] = group["lr"]\n',
             '            group["initial_lr"] = group["lr"]\n            group["lr"] = group["lr"] * init_lr_frac\n',
             ("tests/optim/test_optim.py::test_scale_initial_lr_starts_every_group_at_the_fraction",),
             "--init-lr-frac applied to the first step only: the schedule multiplies the full lr"),
    Mutation("lrm-not-applied", "nanochat/optim/optimizers.py",
             'group["lr"] = group["initial_lr"] * lrm', 'group["lr"] = group["initial_lr"]',
             ("tests/optim/test_optim.py::test_guarded_step_sets_every_groups_lr_to_its_initial_lr_times_lrm",
              "tests/rl/test_golden_trace.py::test_chat_rl_matches_the_golden_trace"),
             "the schedule's multiplier never reaches the optimizers"),
    Mutation("adamw-decay-without-lr", "nanochat/optim/adamw.py",
             "p.mul_(1 - lr * weight_decay)", "p.mul_(1 - weight_decay)",
             ("tests/optim/test_optim.py::test_recipe_takes_nanochats_steps",),
             "AdamW's decoupled decay not scaled by the lr"),
    Mutation("muon-shape-scale-inverted", "nanochat/optim/muon.py",
             "return max(1.0, rows / cols) ** 0.5", "return max(1.0, cols / rows) ** 0.5",
             ("tests/optim/test_optim.py::test_muon_matches_reference",),
             "Muon's shape-scaled lr boosting wide matrices instead of tall ones"),
    Mutation("loss-scale-grows-late", "nanochat/optim/loss_scale.py",
             "if successful == self.growth_interval:", "if successful > self.growth_interval:",
             ("tests/optim/test_fp16.py::test_the_scale_follows_grad_scalers_update_kernel",),
             "the fp16 scale doubles one good step late"),
    # ------------------------------------------------------------------ checkpoints
    Mutation("keep-last-one-more-above-one", "nanochat/checkpoints/pruning.py",
             "keep = [steps[-(keep_last - 1):] if keep_last > 1 else []]",
             "keep = [steps[-keep_last:] if keep_last > 1 else []]",
             ("tests/checkpoints/test_checkpoint.py::test_prune_keeps_the_last_steps_and_removes_only_this_ranks_files",),
             "--keep-last=N keeps N + 1 steps"),
    Mutation("shard-of-another-run-accepted", "nanochat/checkpoints/optimizer_shards.py",
             'if run_id is not None and data.get("run_id") != run_id:',
             'if run_id is None and data.get("run_id") != run_id:',
             ("tests/checkpoints/test_checkpoint.py::test_a_shard_that_is_not_the_steps_is_named",),
             "--resume loads another run's optimizer shard without a word"),
    Mutation("host-copy-ignores-dtype", "nanochat/checkpoints/background.py",
             "fits = old is not None and old.shape == value.shape and old.dtype == value.dtype",
             "fits = old is not None and old.shape == value.shape",
             ("tests/checkpoints/test_background_save.py::test_host_copy_keeps_each_tensors_dtype_when_a_buffer_has_another",),
             "a reused host buffer of another dtype casts the saved tensor"),
    # ------------------------------------------------------------------ the engine's rows
    Mutation("row-cap-off-by-one", "nanochat/engine/rows.py",
             "return self.out.ended or self.emitted >= self.max_tokens",
             "return self.out.ended or self.emitted > self.max_tokens",
             ("tests/engine/test_engine.py::test_shapes_masks_and_max_tokens",),
             "a row runs one token past max_tokens"),
    Mutation("failed-tool-call-counted-ok", "nanochat/engine/rows.py",
             "        if text is not None:\n            self.out.tool_successes += 1\n",
             "        self.out.tool_successes += 1\n        if text is not None:\n",
             ("tests/engine/test_engine.py::test_failed_tool_call_forces_nothing",
              "tests/engine/test_engine.py::test_row_runs_the_tool_state_machine"),
             "a call the calculator refused counted as a success"),
    Mutation("tool-call-state-kept", "nanochat/engine/rows.py",
             "        self.python_tokens = None\n        if text is not None:", "        if text is not None:",
             ("tests/engine/test_engine.py::test_a_row_leaves_its_tool_call_at_python_end",),
             "a row stays in its tool call after <|python_end|>: later tokens join the expression"),
    Mutation("forced-token-trained", "nanochat/engine/rows.py",
             "token, mask = (self.forced.popleft(), 0) if self.forced else (sampled_token, 1)",
             "token, mask = (self.forced.popleft(), 1) if self.forced else (sampled_token, 1)",
             ("tests/engine/test_engine.py::test_tool_call_forces_calculator_output",),
             "the calculator's forced output carries mask 1: the policy is trained on it"),
    # ------------------------------------------------------------------ issue 61's
    Mutation("geo-mask-sum-not-mean", "nanochat/rl/objective.py",
             "            row_log_ratio = row_log_ratio / known_tokens.clamp(min=1)\n",
             "            row_log_ratio = row_log_ratio\n",
             ("tests/rl/test_rl_reference.py::test_the_geometric_mask_keeps_a_long_row_the_product_mask_drops_and_the_token_mask_drops_tokens",),
             "the geometric mask compounds the gap like the product mask"),
    Mutation("sequence-masks-one-side", "nanochat/rl/objective.py",
             "        kept = (row_log_ratio.abs() <= band)[row_index]",
             "        kept = (row_log_ratio <= band)[row_index]",
             ("tests/rl/test_rl_reference.py::test_the_geometric_mask_keeps_a_long_row_the_product_mask_drops_and_the_token_mask_drops_tokens",),
             "a row whose ratio is below 1/cap is kept"),
    Mutation("token-mask-one-side", "nanochat/rl/objective.py",
             "        kept = gap.abs() <= band",
             "        kept = gap <= band",
             ("tests/rl/test_rl_reference.py::test_the_geometric_mask_keeps_a_long_row_the_product_mask_drops_and_the_token_mask_drops_tokens",),
             "a token whose ratio is below 1/cap is kept"),
    # ------------------------------------------------------------------ issue 57's FlexAttention variant
    Mutation("flex-prompt-padding-seen", "nanochat/engine/variants/flex_prompt_attention.py",
             "(kv_idx < pool_len[b]) & (kv_idx >= lowest[b, q_idx])",
             "(kv_idx <= pool_len[b]) & (kv_idx >= lowest[b, q_idx])",
             ("tests/engine/test_flex_prompt_attention.py",),
             "a prompt's first padding slot is attended to"),
    Mutation("flex-own-window-ignored", "nanochat/engine/variants/flex_prompt_attention.py",
             "(kv_idx <= pos[b]) & (kv_idx >= lowest_own[b])", "(kv_idx <= pos[b])",
             ("tests/engine/test_flex_prompt_attention.py",),
             "a sliding window does not reach the row's own completion keys"),
    Mutation("flex-merge-unweighted", "nanochat/engine/variants/flex_prompt_attention.py",
             "    top = torch.maximum(prompt_lse, own_lse)\n", "    top = torch.maximum(prompt_lse, own_lse) * 0 + prompt_lse\n",
             ("tests/engine/test_flex_prompt_attention.py",),
             "the merge shifted by the prompt part's log-sum-exp alone: -inf where no prompt key is seen"),
    # ------------------------------------------------------------------ issue 73's one choice of the decode step
    Mutation("auto-decode-kernels-triton-on-cuda", "nanochat/engine/decode_steps.py",
             '    if name == AUTO:\n        return "torch"',
             '    if name == AUTO:\n        return "triton" if device.type == "cuda" else "torch"',
             ("tests/engine/test_decode_steps.py::test_auto_is_the_torch_step_on_every_device",),
             "auto picks the Triton step on CUDA before a GPU has timed it"),
    Mutation("cache-step-not-the-tables", "nanochat/engine/engine.py",
             "step_class=decode_step_of(decode_kernels).cache_step)", "step_class=None)",
             ("tests/engine/test_decode_steps.py::test_the_engine_its_caches_and_the_meta_counter_build_the_tables_step",),
             "make_batch's shared-prompt cache makes the torch step's object whatever the decode step"),
    Mutation("op-count-step-not-the-tables", "nanochat/diagnostics/op_count.py",
             "RolloutStats(), step=step.static_step)", "RolloutStats())",
             ("tests/engine/test_decode_steps.py::test_the_engine_its_caches_and_the_meta_counter_build_the_tables_step",),
             "the meta counter runs the torch step's function whatever the decode step"),
    Mutation("compile-auto-times-a-step-that-never-compiles", "nanochat/rl/plan.py",
             "decodes = step_compiles and (", "decodes = (",
             ("tests/engine/test_decode_steps.py::test_compile_auto_never_measures_a_step_that_does_not_compile",),
             "--compile=auto times the Triton step for a compiled switch the engine refuses"),
    Mutation("decode-kernels-device-unchecked", "nanochat/engine/decode_steps.py",
             "    step.check_device(device)\n    return step.name", "    return step.name",
             ("tests/engine/test_decode_steps.py::test_the_triton_step_is_refused_before_anything_is_built",
              "tests/scripts/test_decode_kernels_flag.py::test_triton_on_a_cpu_without_the_interpreter_is_one_line_before_the_model_loads"),
             "the scripts' check before the load passes the Triton step on a CPU without the interpreter"),
    Mutation("chat-rl-triton-refused-after-the-load", "nanochat/rl/run.py",
             '    check_decode_kernels(config.decode_kernels, device, compiled=config.compile == "on")', "",
             ("tests/scripts/test_bad_input.py::test_bad_input_is_one_line_and_exit_2",),
             "chat_rl loads the model before it refuses a decode step that cannot run"),
    Mutation("chat-eval-decode-kernels-dropped", "scripts/chat_eval.py",
             "decode_kernels=args.decode_kernels))", "))",
             ("tests/scripts/test_decode_kernels_flag.py::test_the_flag_reaches_the_engine_the_script_builds",),
             "chat_eval's --decode-kernels never reaches its engine"),
    Mutation("decode-kernels-model-error-unwrapped", "nanochat/engine/decode_steps.py",
             'raise DecodeKernelsError(f"is {self.name}: {e}") from None', "raise",
             ("tests/engine/test_decode_steps.py::test_a_model_the_kernels_cannot_compute_is_refused_in_one_line",),
             "a model the kernels cannot compute is a bare ValueError: a traceback, not the flag's line"),
    Mutation("triton-step-smear-skipped", "nanochat/engine/variants/triton_step.py",
             "    if gen.smear:\n", "    if False:\n",
             ("tests/engine/test_decode_steps.py::test_the_triton_step_in_exact_shapes_samples_the_torch_steps_tokens",),
             "the Triton step leaves out smear's previous-token mix"),
    # ------------------------------------------------------------------ issue 67's: what got through the suite III
    Mutation("ledger-key-without-torch", "nanochat/compiling/rule.py",
             'f"|{dtype}|{model.get_device().type}|torch {torch.__version__}")', 'f"|{dtype}|{model.get_device().type}")',
             ("tests/compiling/test_compile_rule.py::test_the_ledger_key_changes_with_everything_a_compile_depends_on",
              "tests/compiling/test_compile_rule.py::test_after_a_torch_upgrade_the_ledger_expects_a_cold_compile"),
             "after a torch upgrade the old version's compile seconds are read as a warm cache"),
    Mutation("dynamic-sampling-enough-draws-again", "nanochat/rl/run.py",
             "sum(map(has_signal, drawn)) < run.examples_per_rank", "sum(map(has_signal, drawn)) <= run.examples_per_rank",
             ("tests/rl/test_dynamic_sampling.py::test_a_step_draws_again_exactly_while_its_share_lacks_signal",), "a step with exactly its share of questions with signal draws again"),
    Mutation("dynamic-sampling-one-draw-short", "nanochat/rl/run.py",
             "range(1, 1 + cfg.dynamic_sampling_rounds if", "range(1, cfg.dynamic_sampling_rounds if",
             ("tests/rl/test_dynamic_sampling.py::test_a_step_draws_again_exactly_while_its_share_lacks_signal",), "one draw fewer than --dynamic-sampling-rounds"),
    Mutation("background-meta-by-reference", "nanochat/checkpoints/background.py",
             "copy.deepcopy(meta_data))", "meta_data)",
             ("tests/checkpoints/test_background_save.py::test_the_snapshot_holds_nothing_the_run_changes_after_the_save_began",),
             "the save's meta is the live run's: later history in an earlier checkpoint"),
    # ------------------------------------------------------------------ issue 67's own: the last round's features
    Mutation("rule-steps-left-off-by-one", "nanochat/compiling/rule.py",
             "steps_left = self.num_steps - step - 1", "steps_left = self.num_steps - step",
             ("tests/compiling/test_compile_rule.py",), "the saving counted over one step more than is left"),
    Mutation("rule-warm-fraction-dropped", "nanochat/compiling/rule.py",
             'return PRIOR_WARM_FRACTION * entry["cold_s"], ', 'return entry["cold_s"], ',
             ("tests/compiling/test_compile_rule.py",), "a cached compile expected at its cold seconds"),
    Mutation("rule-warm-overwrites-cold", "nanochat/compiling/rule.py",
             'return "warm_s" if "cold_s" in (ledger.get(self.key) or {}) else "cold_s"', 'return "cold_s"',
             ("tests/compiling/test_compile_rule.py",), "a warm compile's seconds recorded as the cold one's"),
    Mutation("rule-measured-ratio-ignored", "nanochat/compiling/rule.py",
             'return entry.get("ratio", PRIOR_RATIO[self.part])', "return PRIOR_RATIO[self.part]",
             ("tests/compiling/test_compile_rule.py",), "the ledger's measured ratio never used"),
    Mutation("token-tis-floored", "nanochat/rl/objective.py",
             "torch.exp(gap).clamp(max=loss.correction_cap)", "torch.exp(gap).clamp(min=1 / loss.correction_cap, max=loss.correction_cap)",
             ("tests/rl/test_rl_reference.py", "tests/rl/test_practitioner_options.py"), "token-tis weights floored at 1/cap"),
    Mutation("geo-mask-longest-row-length", "nanochat/rl/objective.py",
             "row_log_ratio = row_log_ratio / known_tokens.clamp(min=1)",
             "row_log_ratio = row_log_ratio / known_tokens.clamp(min=1).max()",
             ("tests/rl/test_rl_reference.py", "tests/rl/test_practitioner_options.py"),
             "geo-mask's mean divided by the longest row's token count"),
    Mutation("token-mask-band-open", "nanochat/rl/objective.py",
             "kept = gap.abs() <= band  # an unknown", "kept = gap.abs() < band * 0.5  # an unknown",
             ("tests/rl/test_rl_reference.py", "tests/rl/test_practitioner_options.py"), "token-mask's band halved"),
    Mutation("calculator-int-bound", "nanochat/engine/calculator.py",
             "abs(value) < EXACT_INTEGER_FLOAT", "abs(value) <= EXACT_INTEGER_FLOAT",
             ("tests/engine/test_calculator.py::test_the_int_format_writes_integral_floats_below_two_to_the_53_as_ints",),
             "2**53 written as an int under --calculator-format=int"),
    Mutation("keep-last-one-more-even-at-one", "nanochat/checkpoints/pruning.py",
             "keep = [steps[-(keep_last - 1):] if keep_last > 1 else []]", "keep = [steps[-keep_last:]]",
             ("tests/checkpoints/test_checkpoint.py",), "--keep-last keeps one step more, --keep-last=1 too"),
    Mutation("prefill-budget-inclusive", "nanochat/engine/scheduler.py",
             "if longest * (len(requests) + 1) > self.prefill_tokens:", "if longest * (len(requests) + 1) >= self.prefill_tokens:",
             ("tests/engine/test_prefill.py::test_a_prefill_takes_prompts_up_to_exactly_its_token_budget",), "a prefill that exactly fills its token budget split in two"),
    Mutation("prefill-room-rounded-down", "nanochat/engine/scheduler.py",
             "-(-batch.free_rows // num_samples)", "batch.free_rows // num_samples",
             ("tests/engine/test_prefill.py::test_a_prefill_without_a_prompt_pool_takes_the_prompts_that_fill_the_free_rows",),
             "without a prompt pool, a prefill takes too few prompts to fill the free rows"),
    Mutation("kept-batch-room-strict", "nanochat/engine/scheduler.py",
             "if not self.batches or (rows <= room and 2 * rows >= whole):",
             "if not self.batches or (rows < room and 2 * rows >= whole):",
             ("tests/engine/test_prefill.py::test_a_new_batch_that_exactly_fits_beside_the_kept_one_keeps_it",),
             "a batch that exactly fits beside the kept ones evicts one"),
    Mutation("pass-at-k-biased", "nanochat/rl/evaluation.py",
             "return 1.0 - comb(n - c, k) / comb(n, k)", "return 1.0 - comb(n - c, k) / comb(n, k) if c < n else 0.0",
             ("tests/rl/test_pass_at_k.py",), "pass@k of a question whose samples are all correct is 0"),
    Mutation("progress-position-kept", "nanochat/rl/progress.py",
             "        self.data_position = position\n", "        self.data_position = self.data_position\n",
             ("tests/rl/test_dynamic_sampling.py", "tests/checkpoints/test_resume.py"),
             "the data position never moves: a resumed run redraws the first questions"),
    Mutation("rejected-tokens-always-dropped", "nanochat/rl/policy_gradient.py",
             "    if loss.rejected_in_denominator or loss.rollout_correction not in MASK_CORRECTIONS:\n",
             "    if loss.rollout_correction not in MASK_CORRECTIONS:\n",
             ("tests/rl/test_rl_reference.py", "tests/rl/test_practitioner_options.py", "tests/rl/test_rl_options.py"),
             "a masking correction's rejected tokens leave the denominators even where asked to stay in them"),
    Mutation("eval-task-beside-itself", "nanochat/rl/config.py",
             "== len(self.extra_eval_tasks) and self.task not in self.extra_eval_tasks,",
             "== len(self.extra_eval_tasks),",
             ("tests/rl/test_rl_config.py", "tests/rl/test_practitioner_options.py", "tests/scripts/test_bad_input.py"),
             "--eval-tasks naming --task's own task evaluates it twice under one name"),
    Mutation("keep-last-inherited-by-a-new-run", "nanochat/rl/plan.py",
             '.get("keep_last") if config.resume else None) or KEEP_ALL',
             '.get("keep_last")) or KEEP_ALL',
             ("tests/rl/test_rl_config.py", "tests/checkpoints/test_checkpoint.py", "tests/checkpoints/test_resume.py"),
             "a new run from an RL checkpoint prunes as the run that wrote it did"),
    Mutation("refresh-meta-of-an-unsaved-step", "nanochat/checkpoints/checkpointer.py",
             "if self.last_saved == step and self.rank == 0:", "if self.rank == 0:",
             ("tests/checkpoints/test_background_save.py::test_the_final_evals_meta_goes_to_the_step_saved_last_and_nowhere_else",),
             "the final eval's meta written for a step that was never saved"),
    Mutation("save-at-step-zero", "nanochat/rl/progress.py",
             "return (save_every > 0 and step > 0 and step % save_every == 0)",
             "return (save_every > 0 and step % save_every == 0)",
             ("tests/scripts/test_chat_rl.py", "tests/checkpoints/test_resume.py"),
             "a checkpoint of the untrained start saved at step 0"),
    # ------------------------------------------------------------------ issue 66's Triton kernels
    Mutation("kernel-prompt-padding-seen", "nanochat/kernels/prompt_attention.py",
             "        n_ok = n < prompt_len\n", "        n_ok = n <= prompt_len\n",
             ("tests/kernels/test_triton_kernels.py::test_prompt_attention_attends_as_the_hand_written_step",
              "tests/kernels/test_triton_kernels.py::test_prompt_attention_sees_only_its_rows_prompt_window_and_own_keys",
              "tests/kernels/test_triton_kernels.py::test_prompt_attention_over_several_tiles_of_prompt_and_own_keys"), "a prompt's first padding slot is attended to"),
    Mutation("kernel-prompt-window-dropped", "nanochat/kernels/prompt_attention.py",
             "seen = live[:, None] & n_ok[None, :] & (query_pos[:, None] - n[None, :] <= window)",
             "seen = live[:, None] & n_ok[None, :]",
             ("tests/kernels/test_triton_kernels.py::test_prompt_attention_attends_as_the_hand_written_step",
              "tests/kernels/test_triton_kernels.py::test_prompt_attention_sees_only_its_rows_prompt_window_and_own_keys",
              "tests/kernels/test_triton_kernels.py::test_prompt_attention_over_several_tiles_of_prompt_and_own_keys"), "the window's bound not applied to the prompt's keys"),
    Mutation("kernel-softmax-not-rescaled", "nanochat/kernels/prompt_attention.py",
             "        acc = acc * rescale[:, None] + update\n        total = total * rescale + tl.sum(p, axis=1)\n    return top, total, acc\n\n\n@kernel\ndef _attend_own",
             "        acc = acc + update\n        total = total + tl.sum(p, axis=1)\n    return top, total, acc\n\n\n@kernel\ndef _attend_own",
             ("tests/kernels/test_triton_kernels.py::test_prompt_attention_attends_as_the_hand_written_step",
              "tests/kernels/test_triton_kernels.py::test_prompt_attention_sees_only_its_rows_prompt_window_and_own_keys",
              "tests/kernels/test_triton_kernels.py::test_prompt_attention_over_several_tiles_of_prompt_and_own_keys"), "the online softmax's rescale skipped for the prompt's tiles"),
    Mutation("kernel-own-softmax-not-rescaled", "nanochat/kernels/prompt_attention.py",
             "        acc = acc * rescale[:, None] + update\n        total = total * rescale + tl.sum(p, axis=1)\n    return top, total, acc\n\n\ndef cell_rows",
             "        acc = acc + update\n        total = total + tl.sum(p, axis=1)\n    return top, total, acc\n\n\ndef cell_rows",
             ("tests/kernels/test_triton_kernels.py::test_prompt_attention_over_several_tiles_of_prompt_and_own_keys",),
             "the online softmax's rescale skipped for the own keys' tiles"),
    Mutation("kernel-own-key-off-by-one", "nanochat/kernels/prompt_attention.py",
             "(j <= own_pos)", "(j < own_pos)",
             ("tests/kernels/test_triton_kernels.py::test_prompt_attention_attends_as_the_hand_written_step",
              "tests/kernels/test_triton_kernels.py::test_prompt_attention_sees_only_its_rows_prompt_window_and_own_keys",
              "tests/kernels/test_triton_kernels.py::test_prompt_attention_over_several_tiles_of_prompt_and_own_keys"), "a row does not see its own newest key"),
    Mutation("kernel-own-parts-not-rescaled", "nanochat/kernels/prompt_attention.py",
             "acc = acc * rescale[:, None] + part_acc * part_scale[:, None]\n        total = total * rescale + part_total * part_scale",
             "acc = acc * rescale[:, None] + part_acc\n        total = total * rescale + part_total",
             ("tests/kernels/test_triton_kernels.py::test_prompt_attention_over_several_tiles_of_prompt_and_own_keys",),
             "an own-key part merged without its rescale to the running maximum"),
    Mutation("kernel-own-split-overlap", "nanochat/kernels/prompt_attention.py",
             "seen = (j < end) & (j <= own_pos)", "seen = (j <= own_pos)",
             ("tests/kernels/test_triton_kernels.py::test_prompt_attention_over_several_tiles_of_prompt_and_own_keys",),
             "a split's last tile reads the next split's keys too: those keys counted twice"),
    Mutation("kernel-own-window-dropped", "nanochat/kernels/prompt_attention.py",
             "seen = (j < end) & (j <= own_pos) & (own_pos - j <= window)", "seen = (j < end) & (j <= own_pos)",
             ("tests/kernels/test_triton_kernels.py::test_prompt_attention_attends_as_the_hand_written_step",),
             "the window's bound not applied to a row's own keys"),
    Mutation("kernel-rotary-sign", "nanochat/kernels/rotary_store.py",
             "sin = tl.where(d < half, sin, -sin)", "sin = tl.where(d < half, -sin, sin)",
             ("tests/kernels/test_triton_kernels.py::test_rotary_store_projects_as_the_model_and_writes_the_cache",),
             "rotary rotates the wrong way"),
    Mutation("kernel-cache-offset-32bit", "nanochat/kernels/rotary_store.py",
             "b_cache = b.to(tl.int64)", "b_cache = b",
             ("tests/kernels/test_kernel_binary.py::test_offsets_past_2_to_the_31_are_64_bit",),
             "a KV cache of more than 2^31 elements a layer written at a wrapped 32-bit offset"),
    Mutation("kernel-logits-offset-32bit", "nanochat/kernels/sampling.py",
             "logits_row = logits_ptr + row.to(tl.int64) * logits_sb", "logits_row = logits_ptr + row * logits_sb",
             ("tests/kernels/test_kernel_binary.py::test_offsets_past_2_to_the_31_are_64_bit",),
             "logits of more than 2^31 elements read at a wrapped 32-bit offset"),
    Mutation("kernel-own-keys-row-offset-32bit", "nanochat/kernels/prompt_attention.py",
             "    row = (pid // (splits * Hkv)).to(tl.int64)", "    row = pid // (splits * Hkv)",
             ("tests/kernels/test_kernel_binary.py::test_offsets_past_2_to_the_31_are_64_bit",),
             "a row's own keys (completion storage past 2^31 elements) read at a wrapped 32-bit offset"),
    Mutation("kernel-prompt-slot-offset-32bit", "nanochat/kernels/prompt_attention.py",
             "        slot64 = slot.to(tl.int64)", "        slot64 = slot",
             ("tests/kernels/test_kernel_binary.py::test_offsets_past_2_to_the_31_are_64_bit",),
             "a prompt slot's keys and values (a pool past 2^31 elements) read at a wrapped 32-bit offset"),
    Mutation("kernel-prompt-row-offset-32bit", "nanochat/kernels/prompt_attention.py",
             "        row = tl.where(live, row, 0).to(tl.int64)", "        row = tl.where(live, row, 0)",
             ("tests/kernels/test_kernel_binary.py::test_offsets_past_2_to_the_31_are_64_bit",),
             "the prompt kernel's queries and output rows at a wrapped 32-bit offset"),
    Mutation("kernel-jit-annotations-dropped", "nanochat/kernels/launch.py",
             "fn.__annotations__, fn.__kwdefaults__ = dict(self.fn.__annotations__), self.fn.__kwdefaults__",
             "fn.__kwdefaults__ = self.fn.__kwdefaults__",
             ("tests/kernels/test_kernel_binary.py::test_kernels_calling_helpers_keep_their_constexpr_annotations",),
             "a kernel calling helpers loses its constexprs under Triton's jit"),
    Mutation("occupancy-registers-unrounded", "nanochat/diagnostics/kernel_binary.py",
             "per_warp = -(-registers * 32 // unit) * unit", "per_warp = registers * 32",
             ("tests/kernels/test_kernel_binary.py::test_occupancy_on_sm90",),
             "registers counted per thread, not allocated per warp in units of 256"),
    Mutation("kernel-lambda-order", "nanochat/kernels/residual_norm.py",
             "x = x + sign * (b * tl.load(", "x = x - sign * (b * tl.load(",
             ("tests/kernels/test_triton_kernels.py::test_residual_norm_composes_the_models_residual_ops",), "backout/x0 term added with the wrong sign"),
    Mutation("kernel-sampler-stream", "nanochat/kernels/sampling.py",
             "base = _mix32((_mix32(seed & 0xFFFFFFFF) ^ step) & 0xFFFFFFFF)",
             "base = _mix32((_mix32(seed & 0xFFFFFFFF) ^ (step + 1)) & 0xFFFFFFFF)",
             ("tests/kernels/test_triton_kernels.py::test_sample_rows_draws_the_samplers_tokens",), "the sampler draws from the row's next step's uniforms"),
    # ------------------------------------------------------------------ issue 74's: runs that say what they do
    Mutation("finished-run-evaluated-again", "nanochat/rl/resume.py",
             "    if resume.step < num_steps - 1 or (is_eval_step(num_steps, num_steps, config.eval_every) and not final):",
             "    if resume.step < num_steps or (is_eval_step(num_steps, num_steps, config.eval_every) and not final):",
             ("tests/checkpoints/test_resume.py::test_a_finished_run_says_so_and_how_to_go_on_without_evaluating_it_again",),
             "a finished run taken for one with a step left: loaded, evaluated again, its report rewritten"),
    Mutation("resume-replaced-flag-unsaid", "nanochat/rl/resume.py",
             "    for k in (k for k in changed if k in given):", "    for k in (k for k in changed if k in ()):",
             ("tests/checkpoints/test_resume.py::test_resume_names_each_flag_it_replaced_and_refuses_a_longer_run",),
             "a flag given with --resume replaced by the run's saved setting without a word"),
    Mutation("further-command-without-given-flags", "nanochat/rl/resume.py",
             "    flags = [given_flag(k, given.get(k, getattr(config, k))) for k in names\n"
             "             if k in given or getattr(config, k) != getattr(defaults, k)]",
             "    flags = [given_flag(k, getattr(config, k)) for k in names if getattr(config, k) != getattr(defaults, k)]",
             ("tests/checkpoints/test_resume.py::test_the_command_that_trains_further_carries_the_runs_settings_and_the_"
              "flags_given",),
             "the command that trains a run further drops the flags given with --resume (--eval-examples, --train-rows)"),
    Mutation("further-command-without-run-settings", "nanochat/rl/resume.py",
             "             if k in given or getattr(config, k) != getattr(defaults, k)]",
             "             if k in given or k == \"task\" and getattr(config, k) != getattr(defaults, k)]",
             ("tests/checkpoints/test_resume.py::test_the_command_that_trains_further_carries_the_runs_settings_and_the_"
              "flags_given",),
             "the command that trains a run further takes the run's --task alone: copied, it runs on the defaults"),
    Mutation("resume-lengthened-silently", "nanochat/rl/resume.py",
             "        if asked > planned:", "        if asked < planned:",
             ("tests/checkpoints/test_resume.py::test_resume_names_each_flag_it_replaced_and_refuses_a_longer_run",),
             "--resume --num-steps beyond the run's length dropped without a word"),
    Mutation("failed-write-traceback", "scripts/chat_rl.py",
             "    with write_errors(saves.kept), saves.on_error():", "    with saves.on_error():",
             ("tests/checkpoints/test_resume.py::test_a_write_that_fails_mid_run_is_one_line_naming_the_step_kept",),
             "a file the run cannot write mid-run ends it with a traceback"),
    Mutation("checkpoint-write-kept-unsaid", "nanochat/checkpoints/checkpointer.py",
             "            raise e.with_kept(self.kept()) from e", "            raise",
             ("tests/scripts/test_bad_input.py::test_full_disk_during_save_leaves_earlier_checkpoints_intact",),
             "a checkpoint that could not be written, without the step the run kept"),
    # ------------------------------------------------------------------ issue 75's: on-policy distillation
    Mutation("distill-term-sign", "nanochat/rl/objective.py",
             "advantages + loss.distill_coef * (teacher_logp - student_logp.detach())",
             "advantages + loss.distill_coef * (student_logp.detach() - teacher_logp)",
             ("tests/rl/test_distillation.py::test_one_steps_gradient_is_the_hand_written_distillation_loss",),
             "the teacher's term with the wrong sign: the student pushed away from the teacher"),
    Mutation("distill-weight-not-divided", "nanochat/rl/objective.py",
             'return advantages if name == "advantages" else advantages / row_values("denominators")',
             'return advantages',
             ("tests/rl/test_distillation.py::test_one_steps_gradient_is_the_hand_written_distillation_loss",),
             "per-token weights left undivided by the rows' denominators"),
    Mutation("reward-coef-ignored", "nanochat/rl/objective.py",
             "advantages = row_advantages if loss.reward_coef == 1 else loss.reward_coef * row_advantages",
             "advantages = row_advantages",
             ("tests/rl/test_distillation.py::test_one_steps_gradient_is_the_hand_written_distillation_loss",), "--reward-coef has no effect"),
    Mutation("distill-zero-advantage-rows-skipped", "nanochat/rl/policy_gradient.py",
             "any_weight=use_kl or distill)", "any_weight=use_kl)",
             ("tests/rl/test_distillation.py::test_one_steps_gradient_is_the_hand_written_distillation_loss",),
             "rows of reward advantage 0 skipped though they carry the teacher's term"),
    Mutation("distill-later-epoch-student-now", "nanochat/rl/teacher.py",
             "return tokens.gather(tally.teacher_logprobs), tokens.gather(tally.old_logprobs)",
             "return tokens.gather(tally.teacher_logprobs), logp.detach()",
             ("tests/rl/test_distillation.py::test_a_later_ppo_epoch_keeps_the_first_epochs_per_token_advantages",),
             "a later PPO epoch's advantage taken from its own forward: it moves within the step"),
    Mutation("reverse-kl-sign", "nanochat/rl/objective.py",
             "torch.stack([(logp - teacher_logp).sum(), teacher_logp.sum()])",
             "torch.stack([(teacher_logp - logp).sum(), teacher_logp.sum()])",
             ("tests/rl/test_distillation.py::test_one_steps_gradient_is_the_hand_written_distillation_loss",),
             "the logged reverse KL is the forward difference's negative"),
    Mutation("teacher-reresolved-on-resume", "nanochat/rl/teacher.py",
             'source, tag, step = ((resumed["source"], resumed["model_tag"], resumed["step"]) if resumed\n'
             "                         else parse_teacher(config.teacher))",
             "source, tag, step = parse_teacher(config.teacher)",
             ("tests/rl/test_distillation.py::test_resume_with_a_teacher_is_the_uninterrupted_run",),
             "--resume loads the teacher's latest step, not the one the run was taught by"),
    Mutation("teacher-not-in-meta", "nanochat/rl/run.py",
             '"teacher": run.teacher.checkpoint if run.teacher else None,', '"teacher": None,',
             ("tests/rl/test_distillation.py::test_resume_with_a_teacher_is_the_uninterrupted_run",),
             "the meta does not record the teacher"),
    Mutation("teacher-tokenizer-unchecked", "nanochat/rl/teacher.py",
             "    if vocab != student.config.vocab_size:\n", "    if False:\n",
             ("tests/scripts/test_bad_input.py::test_bad_input_is_one_line_and_exit_2[--teacher trained with another "
              "tokenizer]",),
             "a teacher of another tokenizer meets the loader's error, which names neither model"),
    Mutation("teacher-forward-other-inputs", "nanochat/rl/teacher.py",
             "teacher_logp = self.logprobs(forward, tokens.forward_inputs).float()",
             "teacher_logp = self.logprobs(forward, tokens.forward_inputs).float().roll(1)",
             ("tests/rl/test_distillation.py::test_a_teacher_that_is_the_student_adds_nothing_and_the_sampler_would_add_its_gap",
              "tests/rl/test_distillation.py::test_one_steps_gradient_is_the_hand_written_distillation_loss"),
             "the teacher's log-probabilities matched with the wrong tokens"),
    Mutation("teacher-reserve-missing", "nanochat/rl/plan.py",
             "peak += teacher_forward_bytes(teacher.config, *shape)", "peak += 0",
             ("tests/engine/test_memory_budget.py::test_a_distillation_teachers_forward_is_reserved_beside_trainings",),
             "the teacher's forward left out of the memory plan: the KV cache takes what it needs"),
    Mutation("reward-coef-default", "nanochat/rl/config.py",
             "reward_coef=flag(ALGORITHM, 1.0,", "reward_coef=flag(ALGORITHM, 0.5,",
             ("tests/rl/test_distillation.py::test_the_new_flags_at_their_defaults_are_todays_run",),
             "the default run weighs nanochat's advantage by half: no longer today's run"),
    # issue 76: the engine's own out-of-memory back-off and the memory object that holds its state
    Mutation("rollout-halved-rows-forgotten", "nanochat/engine/memory.py",
             "            if cap != rows:  # halved\n                self.max_rows = cap\n", "",
             ("tests/engine/test_memory.py::test_a_rollout_within_memory_halves_its_rows_until_they_fit",),
             "a rollout that ran out of memory halves its rows for itself only: every later rollout runs out again"),
    Mutation("rollout-kept-batches-not-given-back", "nanochat/engine/memory.py",
             "free_memory=give_back_kept_batches,", "free_memory=None,",
             ("tests/engine/test_memory.py::test_a_rollout_first_gives_back_the_batches_kept_from_other_rollouts",),
             "out of memory, a rollout halves its rows while an eval's batch stays kept"),
    Mutation("rollout-retry-progress-counted-twice", "nanochat/engine/memory.py",
             "            if counted is not None:\n                counted.restart()\n", "",
             ("tests/engine/test_memory.py::test_a_retry_takes_back_what_the_progress_counted",),
             "a retried rollout's progress bar counts the failed attempt's rows too (past its total)"),
    Mutation("every-rollout-backs-off", "nanochat/engine/engine.py",
             "        if not within_memory:\n            return rollout(max_rows, progress)\n", "",
             ("tests/engine/test_memory.py::test_a_rollout_without_the_back_off_raises_and_changes_nothing",),
             "chat_eval's rollouts halve the engine's rows behind its back instead of reporting the out-of-memory"),
    Mutation("respec-keeps-halved-rows", "nanochat/engine/memory.py",
             "self.spec, self.max_rows = spec, spec.max_rows", "self.spec = spec",
             ("tests/engine/test_memory.py::test_a_new_spec_starts_the_memory_afresh_and_brings_its_rows",),
             "a new spec leaves the rows an out-of-memory halved, not its own"),
    Mutation("yield-memory-drops-the-steps-batch-first", "nanochat/engine/memory.py",
             "dropped = self.drop_kept_batches(keep_latest=True)", "dropped = self.drop_kept_batches()",
             ("tests/engine/test_memory.py::test_yield_memory_gives_back_the_evals_batch_then_all_it_keeps",),
             "training's out-of-memory takes the step's own batch with the eval's"),
    # ------------------------------------------------------------------ issue 76's: a run's state in one place
    Mutation("auto-switch-drops-the-loss-scale", "nanochat/rl/auto_switch.py",
             "forward=training_forward(on, training.loss_scale))", "forward=training_forward(on, None))",
             ("tests/rl/test_one_source.py::test_an_auto_switch_is_a_new_plan_and_training_state_the_old_ones_as_they_were",),
             "a training forward switched by --compile=auto loses fp16's loss scaling"),
    Mutation("auto-switch-decode-flag-ignored", "nanochat/rl/auto_switch.py",
             "plan.spec.with_step_compiled(on, decode_flag, device)", "plan.spec.with_step_compiled(on, \"static\", device)",
             ("tests/rl/test_one_source.py::test_an_auto_switch_is_a_new_plan_and_training_state_the_old_ones_as_they_were",),
             "a decode switch's spec made for --decode=static whatever the run's --decode"),
    Mutation("compile-marks-crossed", "nanochat/rl/auto_switch.py",
             "spent = {part: now[part] - self.at_rollouts[part] for part in now}",
             "spent = {part: now[part] - self.at_step_end[part] for part in now}",
             ("tests/rl/test_one_source.py::test_compile_marks_leave_a_steps_compiling_out_of_its_parts_seconds",),
             "an eval's compile, between two steps, taken out of the next step's seconds"),
    Mutation("written-behind-commits-nothing", "nanochat/checkpoints/checkpointer.py",
             "        yield\n        self.before_collective()\n", "        yield\n",
             ("tests/checkpoints/test_background_save.py::test_written_behind_commits_at_the_stretchs_end_and_not_on_its_error",
              "tests/rl/test_dynamic_sampling.py::test_the_last_checkpoint_is_committed_after_the_first_draw_before_any_collective"),
             "the save in flight left pending into the step's collectives: ranks out of step"),
    Mutation("written-behind-commits-on-error", "nanochat/checkpoints/checkpointer.py",
             "        yield\n        self.before_collective()\n",
             "        try:\n            yield\n        finally:\n            self.before_collective()\n",
             ("tests/checkpoints/test_background_save.py::test_written_behind_commits_at_the_stretchs_end_and_not_on_its_error",),
             "an error inside the draw commits there: the commit's own failure could hide the error"),
    Mutation("commit-only-with-dynamic-sampling", "nanochat/rl/run.py",
             "saves = run.checkpointer.written_behind() if run.checkpointer else",
             "saves = run.checkpointer.written_behind() if cfg.dynamic_sampling and run.checkpointer else",
             ("tests/rl/test_dynamic_sampling.py::test_the_last_checkpoint_is_committed_after_the_first_draw_before_any_collective",),
             "without --dynamic-sampling the save stays pending into training's collectives"),
    Mutation("take-leaves-the-engine-on-the-old-spec", "nanochat/rl/run.py",
             "respec = plan.spec is not self.plan.spec", "respec = False",
             ("tests/rl/test_one_source.py::test_the_engine_runs_the_plans_spec_after_an_auto_switch",),
             "a decode switch replaces the plan's spec and the engine keeps running the old one"),
    Mutation("before-eval-commits-nothing", "nanochat/checkpoints/checkpointer.py",
             'whose meta refresh_meta rewrites)."""\n        self.finish()\n',
             'whose meta refresh_meta rewrites)."""\n',
             ("tests/checkpoints/test_background_save.py::test_the_last_saved_step_is_named_once_committed_and_an_eval_follows_a_commit",),
             "an eval starts its collectives with the last save still in flight"),
    Mutation("settled-last-not-settled", "nanochat/checkpoints/checkpointer.py",
             "        self.finish()\n        return self.last_saved\n", "        return self.last_saved\n",
             ("tests/checkpoints/test_background_save.py::test_the_last_saved_step_is_named_once_committed_and_an_eval_follows_a_commit",),
             "a run stopped by non-finite steps names the step before the one it just saved"),
]

# ---------------------------------------------------------------------- issue 73's: every comparison of the kernels
# (bounds, masks, ties, the streams' counters) both ways; the bounds harness (tests/support/bounds_harness.py) catches
# what reads or writes outside its tensor, the references and the per-element store counts the rest
KERNEL_TESTS = "tests/kernels/test_triton_kernels.py::test_"
ATTENTION = (KERNEL_TESTS + "prompt_attention_attends_as_the_hand_written_step",
             KERNEL_TESTS + "prompt_attention_at_the_layouts_of_d20",
             KERNEL_TESTS + "prompt_attention_over_several_tiles_of_prompt_and_own_keys")
ROTARY = (KERNEL_TESTS + "rotary_store_projects_as_the_model_and_writes_the_cache",)
RESIDUAL = (KERNEL_TESTS + "residual_norm_composes_the_models_residual_ops",)
RELU = (KERNEL_TESTS + "relu_square_is_the_mlps_activation",)
SAMPLER = (KERNEL_TESTS + "sample_rows_draws_the_samplers_tokens", KERNEL_TESTS + "sample_rows_breaks_ties_as_torch_argmax")


def kernel_mutations(file, tests, rows):
    """Mutations of one kernel file, all caught by `tests`: rows of (name, original, mutated, why)."""
    return [Mutation(name, f"nanochat/kernels/{file}", original, mutated, tests, why)
            for name, original, mutated, why in rows]


MUTATIONS += kernel_mutations("prompt_attention.py", ATTENTION, [
    ("attention-free-part-from-gt", "    if pid >= slots * Hkv * chunks:", "    if pid > slots * Hkv * chunks:",
     "the first free-row program runs as an attention program past the last slot"),
    ("attention-free-part-from-early", "    if pid >= slots * Hkv * chunks:", "    if pid >= slots * Hkv * chunks - 1:",
     "the last attention program zeroes free rows instead"),
    ("attention-free-rows-le", "        in_rows = r < rows\n", "        in_rows = r <= rows\n",
     "the free-row part reads one row past the step's"),
    ("attention-free-rows-short", "        in_rows = r < rows\n", "        in_rows = r < rows - 1\n",
     "the step's last row never zeroed when free"),
    ("attention-free-column-gt", ">= used_columns) & in_rows", "> used_columns) & in_rows",
     "free rows (in the spare column, sample == used_columns) not zeroed"),
    ("attention-free-column-early", ">= used_columns) & in_rows", ">= used_columns - 1) & in_rows",
     "the last sample's rows zeroed as if free"),
    ("attention-cells-le", "mask=cell < used_columns, other=-1)", "mask=cell <= used_columns, other=-1)",
     "a chunk reads the spare column (a free row attended and written twice) or past the cells"),
    ("attention-cells-short", "mask=cell < used_columns, other=-1)", "mask=cell < used_columns - 1, other=-1)",
     "the last sample's rows not attended"),
    ("attention-row-gt", "live = (row >= 0) & (rep < REP)", "live = (row > 0) & (rep < REP)", "row 0 never attended"),
    ("attention-row-empty", "live = (row >= 0) & (rep < REP)", "live = (row >= -1) & (rep < REP)",
     "an empty cell (row -1) attended: reads before the queries"),
    ("attention-rep-le", "live = (row >= 0) & (rep < REP)", "live = (row >= 0) & (rep <= REP)",
     "a padded group lane attends as the next kv head's first query head"),
    ("attention-rep-short", "live = (row >= 0) & (rep < REP)", "live = (row >= 0) & (rep < REP - 1)",
     "each group's last query head not attended"),
    ("attention-head-dim-le", "    d_ok = d < D\n    if pid", "    d_ok = d <= D\n    if pid",
     "a tile wider than the head reads and writes one channel past it"),
    ("attention-head-dim-short", "    d_ok = d < D\n    if pid", "    d_ok = d < D - 1\n    if pid",
     "the head's last channel dropped"),
    ("attention-own-head-dim-le", "    d_ok = d < D\n    head =", "    d_ok = d <= D\n    head =",
     "the own-key kernel's tile wider than the head: reads and writes one channel past it"),
    ("attention-own-head-dim-short", "    d_ok = d < D\n    head =", "    d_ok = d < D - 1\n    head =",
     "the own-key kernel drops the head's last channel"),
    ("attention-prompt-keys-short", "        n_ok = n < prompt_len\n", "        n_ok = n < prompt_len - 1\n",
     "a prompt's last key not attended (kernel-prompt-padding-seen: the other way)"),
    ("attention-prompt-window-lt", "(query_pos[:, None] - n[None, :] <= window)",
     "(query_pos[:, None] - n[None, :] < window)",
     "the prompt key at the window's edge hidden"),
    ("attention-prompt-window-wide", "(query_pos[:, None] - n[None, :] <= window)",
     "(query_pos[:, None] - n[None, :] <= window + 1)", "a prompt key past the window's edge seen"),
    ("attention-own-key-ahead", "(j <= own_pos) & (own_pos", "(j <= own_pos + 1) & (own_pos",
     "a row sees the key after its newest (kernel-own-key-off-by-one: the other way)"),
    ("attention-own-window-lt", "(own_pos - j <= window)", "(own_pos - j < window)",
     "the own key at the window's edge hidden"),
    ("attention-own-window-wide", "(own_pos - j <= window)", "(own_pos - j <= window + 1)", "an own key past the window's edge seen"),
    ("attention-softmax-empty-base", 'base = tl.where(new_top == float("-inf"), 0.0, new_top)  # exp',
     'base = tl.where(new_top != float("-inf"), 0.0, new_top)  # exp', "the softmax's base inverted: exp of unshifted scores"),
    ("attention-merge-empty-base", 'base = tl.where(new_top == float("-inf"), 0.0, new_top)\n        rescale,',
     'base = tl.where(new_top != float("-inf"), 0.0, new_top)\n        rescale,',
     "the merge's base inverted: the parts' exps unshifted"),
    ("attention-chunks-floor", "chunks = -(-used_columns // block_cells)", "chunks = used_columns // block_cells",
     "a slot's last partial chunk of cells never attended"),
    ("attention-free-programs-floor", "-(-B // FREE_ROWS_BLOCK),)", "B // FREE_ROWS_BLOCK,)",
     "the last partial block of free rows never zeroed"),
    ("attention-fp32-as-tf32", "    ieee = q.dtype == torch.float32", "    ieee = False",
     "fp32 attention's tl.dot at tf32 (a GPU's default)"),
])
MUTATIONS += kernel_mutations("rotary_store.py", ROTARY, [
    ("rotary-lanes-le", "    ok = (h < H + 2 * Hkv) & (d < D)", "    ok = (h <= H + 2 * Hkv) & (d < D)",
     "the first padded lane reads one head past the projections"),
    ("rotary-lanes-short", "    ok = (h < H + 2 * Hkv) & (d < D)", "    ok = (h < H + 2 * Hkv - 1) & (d < D)",
     "the last value head never written"),
    ("rotary-head-dim-le", "    ok = (h < H + 2 * Hkv) & (d < D)", "    ok = (h < H + 2 * Hkv) & (d <= D)",
     "a tile wider than the head reads and writes one channel past it"),
    ("rotary-head-dim-short", "    ok = (h < H + 2 * Hkv) & (d < D)", "    ok = (h < H + 2 * Hkv) & (d < D - 1)",
     "the head's last channel dropped"),
    ("rotary-queries-le", "    is_q = h < H\n", "    is_q = h <= H\n", "the first key head stored as a query head"),
    ("rotary-queries-short", "    is_q = h < H\n", "    is_q = h < H - 1\n", "the last query head never stored"),
    ("rotary-keys-from-gt", "    is_k = (h >= H) & (h < H + Hkv)", "    is_k = (h > H) & (h < H + Hkv)",
     "the first key head never written"),
    ("rotary-keys-to-le", "    is_k = (h >= H) & (h < H + Hkv)", "    is_k = (h >= H) & (h <= H + Hkv)",
     "the first value head written into the keys too"),
    ("rotary-values-from-gt", "    is_v = (h >= H + Hkv) & (h < H + 2 * Hkv)",
     "    is_v = (h > H + Hkv) & (h < H + 2 * Hkv)",
     "the first value head never written"),
    ("rotary-padded-gate-read", "    is_v = (h >= H + Hkv) & (h < H + 2 * Hkv)", "    is_v = h >= H + Hkv",
     "issue 73's bug: the padded lanes past the last kv head read the gate's rows Hkv.. (d20: 10-11 of 10)"),
    ("rotary-partner-le", "tl.where(d < half, d + half, d - half)", "tl.where(d <= half, d + half, d - half)",
     "the second half's first channel rotated with the wrong partner"),
    ("rotary-table-index-le", "i = tl.where(d < half, d, d - half)", "i = tl.where(d <= half, d, d - half)",
     "the second half's first channel reads the table past its row"),
    ("rotary-sin-sign-le", "sin = tl.where(d < half, sin, -sin)", "sin = tl.where(d <= half, sin, -sin)",
     "the second half's first channel rotated with the first half's sign"),
    ("rotary-table-le", "cos = tl.load(cos_ptr + position * cos_sp + i, mask=d < D",
     "cos = tl.load(cos_ptr + position * cos_sp + i, mask=d <= D",
     "the cos table read one past its row (past its end at the last position)"),
    ("rotary-gate-input-le", "h_sb + ch, mask=ch < ve_channels", "h_sb + ch, mask=ch <= ve_channels",
     "the gate reads one channel of h past its own"),
    ("rotary-gate-input-short", "h_sb + ch, mask=ch < ve_channels", "h_sb + ch, mask=ch < ve_channels - 1",
     "the gate's last channel dropped"),
    ("rotary-gate-weight-le", "mask=is_v & (ch < ve_channels)", "mask=is_v & (ch <= ve_channels)",
     "the gate's weight read one column past its row"),
    ("rotary-embedding-unbounded", "kvh * D + d, mask=ok & is_v", "kvh * D + d, mask=is_v",
     "the value embedding read past its head (past the table at the last token)"),
    ("rotary-value-store-unbounded", "mask=ok & is_v)", "mask=is_v)", "values written past their head"),
    ("rotary-key-store-unbounded", "mask=ok & is_k)", "mask=is_k)", "keys written past their head"),
    ("rotary-query-store-unbounded", "mask=ok & is_q)", "mask=is_q)", "queries written past their head"),
])
MUTATIONS += kernel_mutations("residual_norm.py", RESIDUAL, [
    ("residual-rows-le", "    ok = (row < B) & (c < C)", "    ok = (row <= B) & (c < C)",
     "a row past the batch read and written"),
    ("residual-rows-short", "    ok = (row < B) & (c < C)", "    ok = (row < B - 1) & (c < C)",
     "the last row never written"),
    ("residual-channels-le", "    ok = (row < B) & (c < C)", "    ok = (row < B) & (c <= C)",
     "a channel past the row read and written"),
    ("residual-channels-short", "    ok = (row < B) & (c < C)", "    ok = (row < B) & (c < C - 1)",
     "the last channel dropped"),
    ("residual-grid-floor", "[(-(-B // ROWS_PER_PROGRAM),)]", "[(B // ROWS_PER_PROGRAM,)]",
     "the last partial program of rows never launched"),
])
MUTATIONS += kernel_mutations("residual_norm.py", RELU, [
    ("relu-square-le", "    ok = i < n\n", "    ok = i <= n\n", "one element past the tensor read and written"),
    ("relu-square-short", "    ok = i < n\n", "    ok = i < n - 1\n", "the last element never written"),
    ("relu-square-grid-floor", "[(-(-u.numel() // RELU_SQUARE_BLOCK),)]", "[(u.numel() // RELU_SQUARE_BLOCK,)]",
     "the last partial block never launched"),
])
MUTATIONS += kernel_mutations("sampling.py", SAMPLER, [
    ("sampler-vocab-le", "mask=i < V, other", "mask=i <= V, other", "the log-sum-exp reads one logit past the row"),
    ("sampler-vocab-short", "mask=i < V, other", "mask=i < V - 1, other", "the last logit left out of the log-sum-exp"),
    ("sampler-candidates-le", "        ok = i < C\n", "        ok = i <= C\n", "one candidate past the top-k read"),
    ("sampler-candidates-short", "        ok = i < C\n", "        ok = i < C - 1\n", "the last candidate never drawn"),
    ("sampler-tie-across-blocks", "tl.where(block_best > best, block_index, best_index)",
     "tl.where(block_best >= best, block_index, best_index)", "a later block's equal maximum wins a tie"),
    ("sampler-tie-within-block", "tie_break_left=True", "tie_break_left=False", "a block's later equal maximum wins"),
    ("sampler-draws-ignore-active", "step + tl.load(active_ptr + row))", "step + 1)",
     "a free row's stream advanced too"),
    ("sampler-draws-not-advanced", "step + tl.load(active_ptr + row))", "step)", "no row's stream advanced"),
    ("sampler-stream-behind", "^ step) & 0xFFFFFFFF)", "^ (step - 1)) & 0xFFFFFFFF)",
     "the sampler draws from the row's previous step's uniforms (kernel-sampler-stream: the other way)"),
    ("sampler-candidate-counter-ahead", "_mix32(i.to(tl.int64) + 0x632BE5AB)",
     "_mix32(i.to(tl.int64) + 1 + 0x632BE5AB)",
     "candidate c drawn with candidate c+1's uniform"),
    ("sampler-candidate-counter-behind", "_mix32(i.to(tl.int64) + 0x632BE5AB)",
     "_mix32(i.to(tl.int64) - 1 + 0x632BE5AB)", "candidate c drawn with candidate c-1's uniform"),
])


def apply(mutation):
    """Put the mutation into its file; returns the file's text before."""
    path = REPO / mutation.file
    text = path.read_text()
    count = text.count(mutation.original)
    if count != 1:
        raise LookupError(f"{mutation.file}: the original snippet occurs {count} times (stale mutation?)")
    path.write_text(text.replace(mutation.original, mutation.mutated))
    return text


def restore(mutation, before):
    """The file as it was; where someone else changed it meanwhile, their version with the snippet put back."""
    path = REPO / mutation.file
    now = path.read_text()
    if now == before.replace(mutation.original, mutation.mutated):
        path.write_text(before)
    elif now.count(mutation.mutated) == 1:
        print(f"  note: {mutation.file} changed while mutated: restoring the snippet into the new version")
        path.write_text(now.replace(mutation.mutated, mutation.original))
    elif now != before:
        raise RuntimeError(f"{mutation.file} changed while mutated and the mutant text is gone: check it by hand")


def git(*args):
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def commit_warning(mutation, head_before):
    """A warning where a commit was made while the mutation was in place (someone else committing the working tree),
    louder where that commit holds the mutated file: the mutant may be in it."""
    head = git("rev-parse", "HEAD")
    if head == head_before:
        return None
    if git("diff", "--name-only", head_before, head, "--", mutation.file):
        return (f"WARNING: commit {head[:9]} was made while {mutation.file} was mutated and changes that file: the "
                f"mutant may be committed (see `git diff HEAD -- {mutation.file}`)")
    return f"note: commit {head[:9]} was made while {mutation.file} was mutated (it does not touch that file)"


def run_tests(tests):
    """(pytest's return code, its first failure line, seconds)."""
    env = {**os.environ, "NANOCHAT_TEST_WORKERS": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.time()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {TEST_TIMEOUT_S} s", time.time() - start
    lines = done.stdout.splitlines()
    first = next((line for line in lines if line.startswith("E ")), None) or next(
        (line for line in lines if line.startswith(("FAILED", "ERROR"))), lines[-1] if lines else "")
    return done.returncode, first.strip()[:160], time.time() - start


def verdict(returncode, baseline):
    if baseline:
        return {0: "passes"}.get(returncode, "FAILS" if returncode == 1 else f"error ({returncode})")
    return {0: "NOT CAUGHT", 1: "caught"}.get(returncode, f"error ({returncode})")


def main(argv):
    baseline = "--baseline" in argv
    names = [a for a in argv if not a.startswith("--")]
    unknown = set(names) - {m.name for m in MUTATIONS}
    if unknown:
        sys.exit(f"unknown mutation(s): {', '.join(sorted(unknown))}; see --list")
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    if "--list" in argv:
        for m in chosen:
            print(f"{m.name:38} {m.file:38} {' '.join(m.tests)}")
        return
    rows = []
    for m in chosen:
        print(f"{m.name}: {m.why}", flush=True)
        before, head = None, git("rev-parse", "HEAD")
        try:
            if not baseline:
                before = apply(m)
            returncode, first, seconds = run_tests(m.tests)
        except LookupError as e:
            returncode, first, seconds = -1, str(e), 0.0
        finally:
            if before is not None:
                restore(m, before)
                warning = commit_warning(m, head)
                if warning:
                    print("  " + warning, flush=True)
        result = "stale" if returncode == -1 else verdict(returncode, baseline)
        print(f"  {result} in {seconds:.0f} s: {first}", flush=True)
        rows.append((m.name, result, first))
    width = max(len(name) for name, _, _ in rows)
    print("\n" + ("baseline (no mutation)" if baseline else "mutation") + " results:")
    for name, result, first in rows:
        print(f"{name:{width}}  {result:12}  {first}")
    missed = [name for name, result, _ in rows if result not in (("passes",) if baseline else ("caught",))]
    if missed:
        print(f"\n{len(missed)} of {len(rows)} not as expected: {', '.join(missed)}")
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
