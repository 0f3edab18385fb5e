"""Fault matrix: every fault class of issue 17, each judged by the tests that inject it, plus a sample audit.

Why: a fault is "survived" only while a test injects it and asserts the trusted behaviour, and tests get renamed,
deleted or broken by unrelated changes. This script keeps one table of fault classes (the 13 rows of issue 17
and the classes that were survived before it) with the pytest node ids that prove each one, runs pytest once
over all of them, and prints one verdict per class: `survived` when every backing test passed, `NOT SURVIVED`
naming the failing (or missing, or skipped) tests otherwise. A table entry whose test no longer exists is a
failure, never a silent pass.

One class needs no pytest: `rollout_accounting` drives a real rollout step (`rollout.driver.generate_rollout`,
the default multi-turn episode loop, the tiny tokenizer) against `rollout.fake_engine.FakeSGLangServer`, which
answers some `/generate` requests with HTTP 503, drops some connections and lets some requests run past the
client's timeout (once, so the client's retry recovers, or on every attempt), while the env raises or hangs for
some samples and every episode of one group fails. Every sample requested (prompts x n_samples_per_prompt) must
end up trained, FAILED with a cause in `result.failed`, or in a drop count of `result.dropped`; the ones that
do not are the "samples unaccounted".

    .venv/bin/python scripts/fault_matrix.py             # everything; exit status 0 only if all survived
    .venv/bin/python scripts/fault_matrix.py --list      # the table, without running anything
    .venv/bin/python scripts/fault_matrix.py --only json # the classes whose name contains "json"

The last line is `faults: N tried, M survived, U samples unaccounted`.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import types
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ACCOUNTING = "rollout_accounting"
PYTEST_TIMEOUT_S = 900.0


# ----------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class FaultClass:
    """One fault class: where it comes from, the injected fault -> the trusted behaviour, the tests that prove it."""

    name: str
    origin: str  # "row N" of issue 17's table, "issue N item M" for a later issue, or "survived" (before issue 17)
    fault: str
    tests: tuple[str, ...]


EF = "tests/test_engine_faults.py::"
CLIENT = "tests/test_client.py::"
MT = "tests/test_multiturn.py::"
DRV = "tests/test_driver.py::"
CFG = "tests/test_config.py::"
CV = "tests/test_config_validation.py::"
TP = "tests/test_training_parts.py::"
CI = "tests/test_checkpoint_integrity.py::"
EH = "tests/test_env_hook_faults.py::"
RF = "tests/test_rollout_filters.py::"
JUDGE = "tests/test_llm_judge.py::"
GRADE = "tests/test_grading.py::"
VERSIONS = "tests/test_engine_versions.py::"
DATASET = "tests/test_dataset_faults.py::"
LOSS = "tests/test_engine_loss.py::"
PREEMPT = "tests/test_preemption.py::"

FAULT_CLASSES: tuple[FaultClass, ...] = (
    # ---- issue 17, rows 1-13
    FaultClass("local_media_paths", "row 1",
               "image_data names /etc/shadow, a symlink out, a 1.5 GB file -> refused unless an image file under "
               "--allowed-local-media-path, byte cap checked before reading",
               (EF + "test_a_server_reader_never_opens_local_files",
                EF + "test_an_allowed_media_dir_admits_only_image_files_inside_it",
                EF + "test_image_byte_caps_refuse_before_reading",
                EF + "test_only_common_raster_formats_are_opened",
                EF + "test_the_server_reads_images_only_as_allowed")),
    FaultClass("corrupt_weight_files", "row 2",
               "/update_weights_from_disk with corrupt safetensors headers or index, or a MemoryError while loading "
               "-> success=false, old weights kept, scheduler alive",
               (EF + "test_corrupt_checkpoint_files_are_refused_before_any_tensor_is_read",
                EF + "test_corrupt_weights_and_memory_errors_keep_the_old_weights_and_the_scheduler")),
    FaultClass("stuck_engine_control_calls", "row 2",
               "a weight load that never returns -> every control call answers 503 within its deadline",
               (EF + "test_a_stuck_scheduler_answers_503_within_the_deadlines",)),
    FaultClass("huge_sampling_n", "row 3",
               "sampling_params.n = 1e9 (or a batch multiplying n) -> 400 before any work, the server keeps serving",
               (EF + "test_sampling_n_and_batch_totals_are_capped",
                EF + "test_request_limits_answer_4xx_and_the_server_keeps_serving",
                EF + "test_the_fake_engine_applies_the_same_limits")),
    FaultClass("engine_without_api_key", "row 3",
               "a client without (or with a wrong) API key -> 401 on every path but health; key never leaked; "
               "a non-loopback bind without a key warns",
               (EF + "test_api_key_rule_matches_sglang",
                EF + "test_api_key_guards_every_path_but_health",
                EF + "test_binding_a_non_loopback_host_without_a_key_warns",
                "tests/test_engine_api_key.py::test_the_key_is_a_redacted_credential_kept_from_env_args",
                "tests/test_engine_api_key.py::test_an_external_engine_with_a_key_is_reached_only_with_it",
                "tests/test_engine_api_key.py::test_the_embedded_engine_requires_the_configured_key")),
    FaultClass("huge_request_bodies", "row 4",
               "a body over the cap (announced or chunked) -> 413; large bodies parsed off the event loop",
               (EF + "test_engine_options_derive_the_body_cap_and_validate_limits",
                EF + "test_request_limits_answer_4xx_and_the_server_keeps_serving")),
    FaultClass("hanging_env_hooks", "row 5",
               "env verdict/reward_fn/reset/close/step hang or block -> that sample FAILED env_timeout, the rollout "
               "finishes in bounded time, the loop never stalls",
               (EH + "test_stuck_hooks_fail_their_own_samples_and_the_group_finishes_in_bounded_time",
                EH + "test_episode_timeout_covers_finalize",
                EH + "test_a_reset_that_raises_still_closes_the_env",
                EH + "test_close_of_suspended_episodes_is_bounded",
                EH + "test_call_env_hook_contract")),
    FaultClass("config_without_periodic_saves", "row 6",
               "a shipped config with save_interval 0 -> every shipped config saves periodically; long unsaved "
               "runs warn",
               (CV + "test_shipped_run_configs_are_valid_and_save_periodically",
                CV + "test_a_long_run_without_periodic_saves_is_warned_about")),
    FaultClass("external_engine_other_weights", "row 7",
               "an external engine holding other weights, samples with a wrong weight_version -> weights pushed and "
               "confirmed before the first rollout (fresh and resumed); off-policy samples stop the run",
               (VERSIONS + "test_check_sample_versions_names_off_policy_samples_and_counts_unreported_ones",
                VERSIONS + "test_fresh_start_pushes_and_confirms_before_the_first_rollout",
                VERSIONS + "test_an_engine_that_keeps_other_weights_stops_the_run_before_any_rollout",
                VERSIONS + "test_resume_pushes_the_resumed_version_to_the_external_engine")),
    FaultClass("shared_weight_sync_dir", "row 8",
               "two runs sharing one --weight-sync-dir -> each writes under its own run subdirectory and prunes "
               "only its own versions",
               (TP + "test_session_resumes_an_external_engine_left_paused_and_runs_use_their_own_sync_dir",
                TP + "test_two_runs_sharing_a_sync_dir_never_delete_each_others_versions")),
    FaultClass("engine_left_paused", "row 9",
               "the trainer dies (or is cancelled) between pause and continue -> continue is sent in a finally, "
               "and again on attach to an engine found paused",
               (TP + "test_session_resumes_an_external_engine_left_paused_and_runs_use_their_own_sync_dir",
                CLIENT + "test_cancelled_sync_still_resumes_the_engine",
                CLIENT + "test_sync_update_failure_raises_and_still_continues")),
    FaultClass("invalid_numeric_config", "row 10",
               "--lr nan/-1, --rollout-temperature nan, --episode-timeout -5, ... -> ConfigError naming the key",
               (CV + "test_meaningless_numbers_are_rejected_naming_the_key",
                EF + "test_engine_options_derive_the_body_cap_and_validate_limits")),
    FaultClass("flipped_checkpoint_byte", "row 11",
               "one flipped bit in a checkpoint's array data -> CheckpointError naming step and array, --load-step "
               "restores an earlier step",
               (CI + "test_fingerprint_sees_any_single_bit_and_ignores_nothing",
                CI + "test_flipped_byte_is_reported_and_an_earlier_step_restores")),
    FaultClass("resume_with_changed_config", "row 12",
               "resume with changed state-shaping settings -> error naming the arrays and the changed settings",
               (CI + "test_a_state_that_does_not_fit_names_the_arrays",
                CI + "test_resume_names_changed_settings_and_honours_load_step")),
    FaultClass("deep_json", "row 13",
               "JSON nested 100k deep or malformed, on every endpoint that reads a body -> 400, never 500",
               (EF + "test_deep_or_malformed_json_is_a_request_error",
                EF + "test_request_limits_answer_4xx_and_the_server_keeps_serving")),
    FaultClass("huge_pixel_png", "row 13",
               "a 144-megapixel PNG of a few KB -> refused from its header by the server and the data loader, "
               "never decoded",
               (EF + "test_a_144_megapixel_png_is_refused_from_its_header",
                EF + "test_the_data_loader_caps_image_bytes_and_pixels",
                EF + "test_the_data_loader_still_reads_normal_images_under_custom_caps",
                EF + "test_the_144_megapixel_png_is_not_decoded_by_the_server")),
    FaultClass("abort_all_not_a_bool", "row 13",
               'abort_all: "false" is false (SGLang 0.5.23 parses pydantic bools), nothing aborted; a non-bool -> 400',
               (EF + "test_abort_all_and_weight_flags_parse_as_sglangs_pydantic_bools",
                EF + "test_request_limits_answer_4xx_and_the_server_keeps_serving",
                EF + "test_the_fake_engine_applies_the_same_limits")),
    FaultClass("token_id_outside_vocab", "row 13",
               "the engine returns a token id >= vocab (or < 0) -> the client refuses it, the sample FAILs "
               "engine_error naming the id",
               (EF + "test_the_client_refuses_token_ids_outside_the_vocabulary",
                EF + "test_a_bad_token_id_fails_the_sample_with_a_named_cause")),
    FaultClass("grading_trailing_junk", "row 13",
               '"1+garbage()" and other answers with trailing junk -> graded wrong, math words still graded',
               (GRADE + "test_trailing_junk_is_not_graded_by_its_prefix",
                GRADE + "test_math_words_intervals_and_units_are_not_junk")),
    FaultClass("grading_dangling_operator", "issue 35 item 5",
               '"12+", "3\\cdot", "*12": an answer cut off at an operator -> graded wrong, not by the prefix math-verify '
               'keeps; signs, degrees and complete expressions still graded',
               (GRADE + "test_an_answer_that_ends_or_starts_with_a_dangling_operator_is_wrong",
                GRADE + "test_signs_degrees_and_complete_expressions_are_not_dangling")),
    FaultClass("sigterm_mid_step", "issue 35 item 2",
               "SIGTERM (or SIGINT) while a step runs -> the step finishes or is aborted by --preemption-policy "
               "within --preemption-grace-seconds (a second signal aborts at once), a checkpoint of the last "
               "completed step (with the stream's buffered groups in async mode), exit 0, and --load resumes exactly",
               (PREEMPT + "test_finish_policy_finishes_a_step_that_fits_in_the_grace_period",
                PREEMPT + "test_finish_policy_aborts_when_finishing_would_overrun_the_grace_period",
                PREEMPT + "test_the_deadline_aborts_a_wait_that_runs_longer_than_measured",
                PREEMPT + "test_abort_policy_a_second_signal_and_no_completed_step_abort_at_once",
                PREEMPT + "test_handler_records_the_signal_and_restores_the_previous_handlers",
                PREEMPT + "test_a_signal_cuts_the_wait_short_and_cancels_it_when_the_policy_aborts",
                "tests/test_async_training.py::test_sigterm_while_a_step_trains_checkpoints_the_groups_buffered_meanwhile",
                "tests/test_main_job.py::test_sigterm_either_policy_and_sigkill_resume_like_an_uninterrupted_run")),
    FaultClass("engine_lost_and_restarted", "issue 35 item 1",
               "external engine kill -9 mid-rollout, restarted on the same port -> no /generate while it is down, the "
               "trainer's weights pushed and confirmed before any request, cut requests re-sent, every step trains its "
               "full batch",
               (LOSS + "test_a_run_survives_kill_9_of_its_engine_and_a_restart_on_the_same_port",
                LOSS + "test_no_generate_is_sent_while_the_engine_is_down_and_cut_requests_are_resent",
                LOSS + "test_an_engine_restarted_on_the_same_port_serves_the_cut_request_again",
                LOSS + "test_the_restore_pushes_the_trainers_weights_before_any_request_is_resent",
                LOSS + "test_a_weight_load_cut_by_the_loss_waits_for_the_engine_and_is_pushed_once_on_return",
                LOSS + "test_an_engine_that_restarted_unseen_between_steps_gets_the_weights_before_the_next_rollout")),
    FaultClass("engine_never_returns", "issue 35 item 1",
               "external engine gone past --engine-reconnect-timeout -> waiting episodes FAILED engine_lost, nothing "
               "submitted meanwhile, the run stops before training naming the URL and the wait, CLI exit 1",
               (LOSS + "test_an_engine_that_does_not_return_fails_the_waiting_requests_naming_url_and_wait",
                LOSS + "test_a_run_whose_engine_does_not_return_stops_naming_url_and_wait_and_sends_nothing_meanwhile",
                LOSS + "test_the_cli_reports_a_lost_engine_or_worker_as_an_error_and_exits_1")),
    FaultClass("router_worker_lost", "issue 35 item 4",
               "a router worker unreachable at a weight sync or version check -> dropped, logged and counted with "
               "--allow-worker-loss (never the last one), else a WorkerLost error naming it",
               (LOSS + "test_a_dead_router_worker_is_dropped_when_allowed_and_stops_the_run_otherwise",
                LOSS + "test_the_last_router_worker_is_never_dropped")),
    FaultClass("engine_soak_under_load", "issue 35 item 3",
               "N clients for T s against jaxrl-vlm serve (text, image, multi-turn prefixes, aborts by rid "
               "mid-generation, dropped connections, KV pressure with evictions and retractions) -> no failure but the "
               "injected ones, no KV page held by a request once idle and none leaked after /flush_cache, greedy "
               "answers equal to the quiet engine's, RSS flat after warm-up away from compilations",
               ("tests/test_soak.py::test_soak_of_the_served_engine_has_no_unexpected_failure_leak_or_drift",
                "tests/test_soak.py::test_injected_faults_never_count_as_unexpected_and_options_are_checked",
                "tests/test_soak.py::test_rss_drift_counts_growth_only_away_from_compilations",
                "tests/test_engine.py::test_info_health_and_client_helpers")),
    FaultClass("sft_bad_rows", "issue 35 item 6",
               "SFT transcripts that cannot be trained (malformed messages, missing or corrupt images, no assistant "
               "turn) -> an error naming the file, the row and the cause, or skipped and recorded under the skip "
               "policy",
               ("tests/test_sft_data.py::test_a_bad_row_is_an_error_naming_file_row_and_cause",
                "tests/test_sft_data.py::test_bad_rows_are_skipped_and_recorded_under_skip",
                "tests/test_sft_data.py::test_transcripts_that_cannot_be_trained_are_errors")),
    FaultClass("corrupt_parquet_page", "row 13",
               "a damaged data page in one row group -> DatasetError naming the file and the row group, under both "
               "bad-row policies",
               (DATASET + "test_a_corrupt_page_names_the_file_and_row_group",
                DATASET + "test_skip_policy_still_skips_bad_rows_but_never_an_unreadable_row_group")),
    # ---- classes survived before issue 17
    FaultClass("engine_5xx", "survived",
               "/generate and control calls answer 5xx -> bounded retries with backoff, then a named EngineUnavailable",
               (CLIENT + "test_503_twice_then_success_records_both_retries",
                CLIENT + "test_5xx_until_retries_run_out",
                CLIENT + "test_control_5xx_is_retried_and_4xx_is_not",
                MT + "test_server_503_then_success")),
    FaultClass("engine_4xx", "survived",
               "the engine rejects a request (4xx) -> raised at once with the server's error, never retried",
               (CLIENT + "test_400_raises_at_once_with_the_servers_error",
                CLIENT + "test_unknown_sampling_key_is_rejected_by_the_fake")),
    FaultClass("dropped_connection", "survived",
               "the engine closes the connection without answering -> retried, the episode completes",
               (CLIENT + "test_dropped_connection_is_retried",
                MT + "test_server_dropping_connection_is_retried")),
    FaultClass("engine_timeout", "survived",
               "/generate or a control call never answers -> client timeout, retried, then the episode FAILs "
               "engine_error",
               (CLIENT + "test_hang_times_out_retries_then_gives_up",
                CLIENT + "test_timeout_then_success",
                CLIENT + "test_delayed_control_answer_times_out",
                MT + "test_unreachable_engine_fails_episode_with_error")),
    FaultClass("unreachable_engine", "survived",
               "nothing listens at the engine URL -> fails fast naming the URL; health says false",
               (CLIENT + "test_unreachable_port_fails_fast_naming_the_url",)),
    FaultClass("malformed_engine_answer", "survived",
               "a 2xx answer that breaks the wire contract -> EngineResponseError naming the key, not retried",
               (CLIENT + "test_malformed_answers_name_the_problem",
                CLIENT + "test_ids_disagreeing_with_logprob_ids_is_an_error_not_retried")),
    FaultClass("banned_token_from_engine", "survived",
               "the engine emits a vision token the policy may not sample -> the episode FAILs banned_token",
               (MT + "test_banned_token_from_engine_fails_episode",)),
    FaultClass("engine_abort", "survived",
               "the engine aborts a request mid-generation -> ABORTED with its partial output, env closed",
               (MT + "test_engine_abort_marks_aborted",
                CLIENT + "test_abort_answer_keeps_partial_output")),
    FaultClass("straggling_groups", "survived",
               "groups hang after the batch is full -> aborted and counted, never waited for",
               (DRV + "test_stragglers_are_aborted_once_the_batch_is_full",)),
    FaultClass("env_raises", "survived",
               "env.step raises -> retried within the bound (reset if recoverable), then FAILED env_error; only "
               "that sample is dropped from its group",
               (MT + "test_env_raising_exhausts_retries_and_fails_without_crashing",
                MT + "test_recoverable_env_is_reset_and_retried",
                DRV + "test_failed_episodes_are_dropped_from_their_group_and_listed")),
    FaultClass("env_server_killed", "issue 53 item 2",
               "the env server (`jaxrl-vlm env-serve`) is killed with SIGKILL mid-run and restarted -> the cut "
               "episodes FAIL env_error naming the server, new resets retry a refused connection, the run trains "
               "every step",
               ("tests/test_openenv.py::test_an_env_server_killed_mid_episode_fails_it_as_env_error_not_lost",
                "tests/test_openenv.py::test_a_refused_connection_is_retried_until_the_restarted_server_takes_the_episode",
                "tests/test_env_server_kill.py::test_killing_env_serve_mid_step_fails_its_episodes_typed_and_the_run_goes_on")),
    FaultClass("env_step_hangs", "survived",
               "env.step hangs -> --env-step-timeout, then FAILED; --episode-timeout bounds the episode",
               (MT + "test_hanging_env_times_out_then_fails",
                MT + "test_episode_wall_clock_limit")),
    FaultClass("custom_generate_raises", "survived",
               "a custom generate function raises or cannot be loaded -> only its sample FAILs / a named load error",
               (DRV + "test_custom_generate_that_raises_fails_only_its_sample",
                DRV + "test_bad_generate_function_paths_say_what_failed")),
    FaultClass("unusable_reward", "survived",
               "a NaN reward or a mapping reward without --reward-key -> the episode FAILs reward_error with the cause",
               (MT + "test_nonfinite_reward_fails_the_episode",
                "tests/test_rewards.py::test_a_mapping_reward_without_its_key_fails_the_episode_with_the_cause",
                RF + "test_a_mapping_reward_from_a_custom_function_needs_its_key")),
    FaultClass("every_episode_fails", "survived",
               "every episode of consecutive steps FAILs -> warned with the top causes, the run stops after "
               "--max-all-failed-steps",
               (RF + "test_all_failed_streak_counts_consecutive_steps_and_stops_at_the_limit",
                RF + "test_a_step_where_most_episodes_fail_warns_with_the_causes",
                RF + "test_the_main_job_stops_after_consecutive_all_failed_steps")),
    FaultClass("equal_rewards_everywhere", "survived",
               "every group has equal rewards under the zero_std filter -> over-sampling is bounded, the shortfall "
               "reported",
               (DRV + "test_oversampling_is_bounded_when_every_group_has_equal_rewards",)),
    FaultClass("prompts_over_length_limit", "survived",
               "prompts longer than --rollout-max-prompt-len (all of them) -> skipped and counted / a clear error, "
               "never a hang",
               (RF + "test_long_prompts_are_skipped_counted_and_the_step_still_filled",
                RF + "test_a_limit_below_every_prompt_is_an_error_not_a_hang")),
    FaultClass("kill_9_during_checkpoint_save", "survived",
               "SIGKILL while a checkpoint is being written -> the partial step is never restored, the next writer "
               "cleans it up",
               (TP + "test_checkpoint_killed_mid_write_is_never_restored",)),
    FaultClass("disk_full", "survived",
               "writes fail past a file-size limit (EFBIG, as ENOSPC) while saving a checkpoint and exporting "
               "weights -> both raise, the failed step is never listed, the previous step and version stay whole",
               ("tests/test_disk_full.py::test_a_full_disk_fails_the_save_and_the_export_and_keeps_the_previous_ones",)),
    FaultClass("weight_sync_failure", "survived",
               "the engine fails to load pushed weights (one router worker, or a flush that stays busy) -> the old "
               "version stays, the run stops naming the worker, every engine is resumed",
               (TP + "test_weight_sync_keeps_old_version_until_success_and_stops_on_failure",
                CLIENT + "test_router_sync_reports_the_failing_worker_and_continues_all",
                CLIENT + "test_sync_flush_busy_past_deadline_fails_without_updating")),
    FaultClass("nonfinite_loss", "survived",
               "a NaN loss from diverged weights -> the update is skipped, nothing written, counted",
               (TP + "test_nonfinite_loss_skips_the_update",)),
    FaultClass("sglang_launch_dies", "survived",
               "--launch-sglang whose server exits at start -> SGLangLaunchError quoting its log",
               (TP + "test_launch_sglang_that_dies_reports_its_log",)),
    FaultClass("bad_images", "survived",
               "truncated, garbage, missing or remote images -> ImageDecodeError naming the cause",
               ("tests/test_processing.py::test_corrupt_and_missing_images_raise_image_decode_error_naming_the_cause",
                "tests/test_processing.py::test_process_images_rejects_non_images",
                JUDGE + "test_corrupt_question_image_fails_build_env_naming_the_sample")),
    FaultClass("bad_dataset_rows", "survived",
               "bad rows (missing fields, broken images, invalid JSON) and bad files -> an error naming file, row and "
               "cause, or skipped and counted under on_bad_row=skip",
               ("tests/test_data_geo3k.py::test_bad_row_raises_naming_file_row_and_cause",
                "tests/test_data_geo3k.py::test_bad_row_is_skipped_recorded_and_logged",
                "tests/test_data_geo3k.py::test_file_level_errors")),
    FaultClass("bad_model_files", "survived",
               "missing or malformed tokenizer/processor files, checkpoints with missing or extra keys -> one error "
               "naming them",
               ("tests/test_processing.py::test_loaders_name_the_missing_or_bad_file",
                "tests/test_hf_io.py::test_missing_and_unexpected_keys_give_one_error")),
    FaultClass("yaml_tags", "survived",
               "!!python/object tags in a config, custom config or list flag -> ConfigError, nothing constructed",
               ("tests/test_fault_matrix.py::test_yaml_python_tags_are_refused",)),
    FaultClass("unknown_config_keys", "survived",
               "unknown flags or YAML keys, keys in the wrong section, undeclared custom keys -> ConfigError naming "
               "the key and the closest valid one",
               (CFG + "test_unknown_cli_flag_names_it_and_the_closest_valid_one",
                CFG + "test_yaml_unknown_key_names_file_key_and_suggestion",
                CFG + "test_yaml_key_in_wrong_section_says_where_it_belongs",
                CFG + "test_custom_config_unknown_key_is_error_unless_declared_by_the_env")),
    FaultClass("malformed_config", "survived",
               "wrong types, unreadable or invalid YAML, inconsistent settings -> ConfigError naming the field; the "
               "CLI exits with an error code",
               (CFG + "test_wrong_type_names_the_field",
                CFG + "test_yaml_wrong_type_names_field",
                CFG + "test_unreadable_and_invalid_yaml_files",
                CFG + "test_cross_field_validation",
                CFG + "test_cli_config_dump_and_error_exit_code")),
    FaultClass("unimportable_env_module", "survived",
               "--rollout-interaction-env-path that does not import -> an error saying what failed",
               (CFG + "test_unimportable_env_module_error_says_what_failed",)),
    FaultClass("corrupt_driver_state", "survived",
               "a malformed or foreign rollout driver state in a checkpoint -> DriverStateError naming the entry, "
               "nothing half-restored",
               (DRV + "test_malformed_driver_state_is_refused_with_what_is_wrong",
                DRV + "test_driver_state_restore_refuses_a_foreign_counter_or_used_args",
                DRV + "test_unserializable_prompt_is_named_at_checkpoint_time")),
    FaultClass("llm_judge_failures", "survived",
               "the judge answers 503, is unreachable or unparseable -> retried; a clear error naming its URL; "
               "never graded correct",
               (JUDGE + "test_judge_503_then_success_is_retried_by_the_client",
                JUDGE + "test_unreachable_judge_raises_a_clear_error_and_changes_nothing",
                JUDGE + "test_unreachable_judge_in_an_episode_fails_it_with_the_judge_url",
                JUDGE + "test_unparseable_twice_gives_neutral_feedback_and_never_counts_as_correct")),
    FaultClass("grading_hangs", "survived",
               "a comparison that hangs, a hung or unstartable grading worker, non-string or huge input -> wrong "
               "within the timeout, worker replaced, a loud error; linear time",
               (GRADE + "test_slow_comparison_times_out_and_counts_as_wrong",
                GRADE + "test_hung_worker_is_killed_and_replaced",
                GRADE + "test_worker_that_cannot_start_is_a_loud_error",
                GRADE + "test_non_string_input_is_false_not_an_exception",
                GRADE + "test_extract_final_answer_is_linear_on_huge_input")),
    FaultClass(ACCOUNTING, "survived",
               "a rollout step where /generate answers 503, drops the connection or times out (once or always) and "
               "the env raises or hangs -> every requested sample trained, FAILED with a cause, or counted as dropped",
               ()),
)


def select(classes: Sequence[FaultClass], only: str | None) -> list[FaultClass]:
    """The classes whose name contains `only` (all of them without it)."""
    return [c for c in classes if only is None or only in c.name]


def node_ids(classes: Iterable[FaultClass]) -> list[str]:
    """Every backing node id once, in table order."""
    return list(dict.fromkeys(t for c in classes for t in c.tests))


# ----------------------------------------------------------------------------- node ids
def missing_reason(node_id: str, root: Path = REPO) -> str | None:
    """Why `node_id` (`path.py::test` or `path.py::Class::test`) names no test in the source, or None if it does.

    Read with `ast`, without importing the test module, so a renamed or deleted test is found in milliseconds.
    """
    path, _, rest = node_id.partition("::")
    parts = rest.split("::") if rest else []
    file = root / path
    if not file.is_file():
        return f"no file {path}"
    if not parts:
        return None
    body: list[ast.stmt] = ast.parse(file.read_text(), str(file)).body
    for k, part in enumerate(parts):
        wanted = (ast.FunctionDef, ast.AsyncFunctionDef) if k == len(parts) - 1 else (ast.ClassDef,)
        found = next((n for n in body if isinstance(n, wanted) and n.name == part), None)
        if found is None:
            return f"no test {'::'.join(parts[:k + 1])} in {path}"
        body = found.body if isinstance(found, ast.ClassDef) else []
    return None


# ----------------------------------------------------------------------------- pytest and its junit XML
@dataclass(frozen=True)
class CaseResult:
    """One test case from the junit XML: pytest's classname (`tests.test_x[.Class]`) and name (`test_y[param]`)."""

    classname: str
    name: str
    outcome: str  # passed | failed | error | skipped
    message: str
    seconds: float


@dataclass
class PytestRun:
    cases: list[CaseResult]
    returncode: int
    seconds: float
    summary: str  # pytest's last line, or why it did not finish
    log_tail: str = ""


def parse_junit(path: Path) -> list[CaseResult]:
    """The test cases of a pytest junit XML file."""
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = tc.find(tag)
            if child is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = _case_message(child)
                break
        cases.append(CaseResult(tc.get("classname", ""), tc.get("name", ""), outcome, message,
                                float(tc.get("time") or 0.0)))
    return cases


def _case_message(element: ET.Element) -> str:
    """pytest's message of a failure, error or skip; for a collection error, with the error line of its trace."""
    message = (element.get("message") or "").strip()
    errors = [ln[1:].strip() for ln in (element.text or "").splitlines() if ln.startswith("E ")]
    if errors and (not message or message == "collection failure"):
        return f"{message}: {errors[-1]}" if message else errors[-1]
    return message or (element.text or "").strip()


def collection_errors(cases: Sequence[CaseResult]) -> dict[str, str]:
    """Test files that did not import, {path: error}: pytest records each as an error case without a classname."""
    return {c.name.replace(".", "/") + ".py": c.message for c in cases if not c.classname and c.outcome == "error"}


def run_pytest(ids: Sequence[str], timeout_s: float = PYTEST_TIMEOUT_S) -> PytestRun:
    """pytest once over `ids` in a subprocess of this interpreter; the cases come from its junit XML."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fault_matrix_") as tmp:
        junit, log = Path(tmp) / "junit.xml", Path(tmp) / "pytest.log"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *ids]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                returncode = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # pytest and whatever its tests started
                proc.wait()
                returncode = -1
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        seconds = time.perf_counter() - t0
        tail = "\n".join(lines[-30:])
        if returncode == -1:
            return PytestRun([], returncode, seconds, f"pytest timed out after {timeout_s:.0f} s", tail)
        summary = lines[-1].strip("= ") if lines else f"pytest exited {returncode} without output"
        cases = parse_junit(junit) if junit.is_file() else []
        return PytestRun(cases, returncode, seconds, summary, "" if returncode in (0, 1) else tail)


def run_backing_tests(ids: Sequence[str], timeout_s: float = PYTEST_TIMEOUT_S) -> tuple[PytestRun, dict[str, str]]:
    """Run `ids` once; and the test files that did not import, {path: error}.

    pytest runs nothing at all when a node id it was given lies in a file that does not import, so only then it
    runs a second time without those files: one broken file fails its own classes, not the whole matrix.
    """
    run = run_pytest(ids, timeout_s)
    broken = collection_errors(run.cases)
    if broken:
        rest = [i for i in ids if i.partition("::")[0] not in broken]
        run = run_pytest(rest, timeout_s) if rest else PytestRun([], 0, 0.0, "nothing left to run")
    return run, broken


def cases_for(node_id: str, cases: Sequence[CaseResult]) -> list[CaseResult]:
    """The junit cases of one node id (every parametrization of a test; every test of a file)."""
    path, _, rest = node_id.partition("::")
    module = path.removesuffix(".py").replace("/", ".")
    parts = rest.split("::") if rest else []
    if not parts:
        return [c for c in cases if c.classname == module or c.classname.startswith(module + ".")]
    classname = ".".join([module, *parts[:-1]])
    test = parts[-1]
    return [c for c in cases if c.classname == classname and (c.name == test or c.name.startswith(test + "["))]


# ----------------------------------------------------------------------------- verdicts
@dataclass
class Verdict:
    name: str
    survived: bool
    detail: str  # "4 tests, 1.2 s", or what did not pass
    origin: str = ""
    unaccounted: int = 0


def judge(cls: FaultClass, run: PytestRun, unrunnable: dict[str, str]) -> Verdict:
    """Survived when every backing node id exists, ran, and all its cases passed.

    `unrunnable`: node ids that could not run, with why ("not found: ...", "collection error: ...").
    """
    problems: list[str] = []
    n_cases, seconds = 0, 0.0
    for node_id in cls.tests:
        if node_id in unrunnable:
            problems.append(f"{node_id} ({unrunnable[node_id]})")
            continue
        found = cases_for(node_id, run.cases)
        if not found:
            problems.append(f"{node_id} (did not run: {run.summary})")
            continue
        n_cases += len(found)
        seconds += sum(c.seconds for c in found)
        problems += [f"{_case_node_id(node_id, c)} ({c.outcome}: {_first_line(c.message)})"
                     for c in found if c.outcome != "passed"]
    if problems:
        return Verdict(cls.name, False, "; ".join(problems), cls.origin)
    return Verdict(cls.name, True, f"{n_cases} test{'s' if n_cases != 1 else ''}, {seconds:.1f} s", cls.origin)


def _case_node_id(node_id: str, case: CaseResult) -> str:
    """The pytest node id of one junit case found under `node_id` (with its class and parametrization)."""
    path = node_id.partition("::")[0]
    module = path.removesuffix(".py").replace("/", ".")
    classes = case.classname[len(module) + 1:].split(".") if case.classname != module else []
    return "::".join([path, *classes, case.name])


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


# ----------------------------------------------------------------------------- the accounting scenario
GROUPS = 6  # rollout_batch_size
N_PER_PROMPT = 4
TURNS = 2  # model turns per episode: the env answers one observation, then ends
CLIENT_TIMEOUT_S = 0.5
ENV_STEP_TIMEOUT_S = 0.5
RETRY_POLICY_KW = dict(max_retries=1, backoff_base_s=0.01, backoff_max_s=0.02)

# What each episode meets, by (group index, sample index): a fault of its /generate request at the given turn
# (`*_once`: the first attempt only, so the client's retry recovers; otherwise every attempt) or of its env.
# Group 4 fails entirely (dropped as an empty group). Over-sampling submits 8 groups for 6 kept: group 7's envs
# are still starting (their reset waits for the driver's abort) when the batch is full, so it is dropped as a
# straggler group, whose samples only a drop count accounts for.
FAULT_PLAN: dict[tuple[int, int], tuple[str, int]] = {
    (0, 1): ("5xx_once", 0), (0, 2): ("5xx", 1),
    (1, 0): ("drop_once", 1), (1, 3): ("drop", 0),
    (2, 1): ("timeout_once", 0), (2, 2): ("timeout", 1),
    (3, 0): ("env_raise", 0), (3, 3): ("env_hang", 0),
    (4, 0): ("5xx", 0), (4, 1): ("drop", 0), (4, 2): ("env_raise", 0), (4, 3): ("timeout", 0),
    (5, 2): ("drop_once", 0),
    **{(7, i): ("straggler", 0) for i in range(N_PER_PROMPT)},
}
OVER_SAMPLING = 8
ENV_FAULTS = ("env_raise", "env_hang", "straggler")
# The cause (termination) and an error fragment each persistent fault must leave on its FAILED sample.
EXPECTED_FAILURE: dict[str, tuple[str, str]] = {
    "5xx": ("engine_error", "HTTP 503"),
    "drop": ("engine_error", "ServerDisconnected"),
    "timeout": ("engine_error", f"timeout after {CLIENT_TIMEOUT_S:g} s"),
    "env_raise": ("env_error", "injected env failure"),
    "env_hang": ("env_error", f"timed out after {ENV_STEP_TIMEOUT_S:g} s"),
}
GROUP_DROPS = ("straggler_group", "surplus_group", "straggler_group_error", "partial_group_carried")
SAMPLE_DROPS = ("aborted_sample", "no_reward_sample")
_RID = re.compile(r"^g(\d+)-s(\d+)-t(\d+)-[0-9a-f]+(?:\.retry(\d+))?$")


@dataclass
class AccountingReport:
    """What the scenario requested, where every sample went, and what did not add up."""

    requested: int = 0
    trained: int = 0
    failed: int = 0
    counted_drops: int = 0
    unaccounted: int = 0
    causes: Counter = field(default_factory=Counter)  # termination of each FAILED sample
    injected: Counter = field(default_factory=Counter)  # faults the server and envs really applied
    dropped: dict[str, int] = field(default_factory=dict)  # the drop counts that account for samples
    problems: list[str] = field(default_factory=list)  # expectations of the fault plan that did not hold

    @property
    def survived(self) -> bool:
        return self.unaccounted == 0 and not self.problems

    def describe(self) -> str:
        causes = ", ".join(f"{k} x {v}" for k, v in sorted(self.causes.items())) or "none"
        drops = ", ".join(f"{k} x {v}" for k, v in sorted(self.dropped.items())) or "none"
        text = (f"{self.requested} requested = {self.trained} trained + {self.failed} FAILED ({causes}) + "
                f"{self.counted_drops} in drop counts ({drops}); {self.unaccounted} unaccounted; "
                f"{sum(self.injected.values())} faults injected")
        return text + ("; " + "; ".join(self.problems) if self.problems else "")


def fault_of(rid: str) -> str | None:
    """The planned /generate fault for a request, from its rid `g<group>-s<index>-t<turn>-<hex>[.retry<k>]`
    (None: answer normally)."""
    m = _RID.match(rid)
    if m is None:
        return None
    group, index, turn, retry = int(m[1]), int(m[2]), int(m[3]), int(m[4] or 0)
    kind, at_turn = FAULT_PLAN.get((group, index), (None, -1))
    if kind is None or kind in ENV_FAULTS or turn != at_turn or (kind.endswith("_once") and retry > 0):
        return None
    return kind


def _server_action(kind: str) -> Any:
    from rollout.fake_engine import Drop, Hang, Respond

    base = kind.removesuffix("_once")
    return {"5xx": Respond(503, "injected: engine overloaded"), "drop": Drop(), "timeout": Hang()}[base]


def _env_module(injected: Counter) -> types.ModuleType:
    """Envs of `TURNS` turns that raise, hang or start slowly where FAULT_PLAN says so."""
    from envs.base import BaseInteractionEnv

    class PlannedEnv(BaseInteractionEnv):
        def __init__(self, fault: str | None, ctx: Any):
            self.fault = fault
            self.ctx = ctx
            self.steps = 0

        async def reset(self) -> None:
            self.steps = 0
            if self.fault == "straggler":  # still starting when the batch is full (bounded by --env-hook-timeout)
                injected["straggler"] += 1
                while not self.ctx.aborting:
                    await asyncio.sleep(0.01)

        async def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
            self.steps += 1
            if self.fault == "env_raise":
                injected["env_raise"] += 1
                raise RuntimeError("injected env failure")
            if self.fault == "env_hang":
                injected["env_hang"] += 1
                await asyncio.sleep(3600)
            if self.steps >= TURNS:
                return {"obs_str": ""}, True, {}
            return {"obs_str": f"Observation {self.steps}: keep going."}, False, {}

        def verdict(self) -> float:
            return 1.0

    def build_env(sample: Any, args: Any) -> PlannedEnv:
        kind, _ = FAULT_PLAN.get((sample.group_index, sample.index), (None, 0))
        return PlannedEnv(kind if kind in ENV_FAULTS else None, args.rollout_context)

    module = types.ModuleType("fault_matrix_env")
    module.build_env = build_env
    return module


class NumberedPrompts:
    """Text prompts numbered 0, 1, 2, ... (`Sample.index` is the number); remembers every prompt it served."""

    def __init__(self, batch: int = OVER_SAMPLING):
        self.batch = batch
        self.served: list[Any] = []

    def next_batch(self) -> list[Any]:
        from rollout.sample import Sample

        out = [Sample(prompt=[{"role": "user", "content": f"Question number {k}: find x."}], label=str(k), index=k)
               for k in range(len(self.served), len(self.served) + self.batch)]
        self.served += out
        return out


def _rollout_args(ctx: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        rollout_batch_size=GROUPS, n_samples_per_prompt=N_PER_PROMPT, over_sampling_batch_size=OVER_SAMPLING,
        dynamic_filter=None, partial_rollout=False, mask_offpolicy_in_partial_rollout=False,
        custom_generate_function_path="rollout.multiturn.generate", rollout_max_response_len=400,
        rollout_max_context_len=None, max_turns=TURNS, max_env_retries_per_turn=0,
        env_step_timeout=ENV_STEP_TIMEOUT_S, env_hook_timeout=30.0, episode_timeout=60.0, delta_check="strict",
        rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1, rollout_stop_token_ids=[], rollout_context=ctx,
    )


def _tiny_encoder() -> Any:
    """The tiny Qwen3-VL tokenizer and image processor (built, never downloaded) as every component loads them."""
    from jaxrl_vlm.tiny_assets import save_tiny_processing
    from rollout.encoding import ChatEncoder
    from rollout.processing import load_image_processor, load_tokenizer

    with tempfile.TemporaryDirectory(prefix="fault_matrix_tiny_") as tmp:
        proc_dir = save_tiny_processing(Path(tmp) / "tiny")
        return ChatEncoder(load_tokenizer(proc_dir), load_image_processor(proc_dir))


async def _faulty_rollout(encoder: Any, injected: Counter) -> tuple[Any, NumberedPrompts, Any]:
    """One rollout step against the fake engine with FAULT_PLAN injected; (result, prompt source, args)."""
    from rollout.client import RetryPolicy, SGLangClient
    from rollout.driver import generate_rollout
    from rollout.fake_engine import FakeSGLangServer, RecordedRequest, Tokens
    from rollout.multiturn import RolloutContext

    reply = tuple(encoder.tokenize("the answer is 7") + [encoder.vision.im_end])

    def select(record: RecordedRequest) -> Any:
        body = record.body if isinstance(record.body, dict) else {}
        kind = fault_of(str(body.get("rid", "")))
        if kind is None:
            return None
        injected[kind] += 1
        return _server_action(kind)

    server = FakeSGLangServer(script=select, generate_fn=lambda body: Tokens(output_ids=reply),
                              eos_token_id=encoder.vision.im_end, image_token_id=encoder.vision.image_pad)
    prompts = NumberedPrompts()
    async with server:
        async with SGLangClient(server.url, timeout_s=CLIENT_TIMEOUT_S, retry=RetryPolicy(**RETRY_POLICY_KW),
                                vocab_size=len(encoder.tokenizer)) as client:
            ctx = RolloutContext(client=client, encoder=encoder, env_module=_env_module(injected),
                                 generate_slots=asyncio.Semaphore(64))
            args = _rollout_args(ctx)
            result = await asyncio.wait_for(generate_rollout(args, 0, prompts), 120.0)
    return result, prompts, args


def account(result: Any, requested_prompts: Sequence[Any], n: int) -> AccountingReport:
    """Where every requested sample (prompt x n) went: trained, FAILED with a cause, or in a drop count.

    Samples are identified by (prompt number, sample index), independently of the driver's group numbering.
    Group-level drops count n samples (their episodes are in neither list); per-sample drops count one.
    Unaccounted: requested samples not found anywhere beyond what the drop counts cover, plus any sample listed
    twice or not requested, plus any drop count larger than what is missing.
    """
    counted = {k: result.dropped[k] for k in SAMPLE_DROPS + GROUP_DROPS if result.dropped.get(k)}
    report = AccountingReport(dropped=counted)
    requested = {(p.index, i) for p in requested_prompts for i in range(n)}
    report.requested = len(requested)

    def key(s: Any) -> tuple[int, int]:
        return (s.metadata.get("prompt_index"), s.index)

    trained = [key(s) for s in result.samples]
    failed = []
    for s in result.failed:
        if s.termination is None or not s.metadata.get("error"):
            report.problems.append(f"{s.name} FAILED without a cause")
            continue
        failed.append(key(s))
        report.causes[str(s.termination)] += 1
    report.trained, report.failed = len(trained), len(failed)
    listed = Counter(trained + failed)
    twice = sum(c - 1 for c in listed.values() if c > 1)
    foreign = sum(1 for k in listed if k not in requested)
    missing = len(requested - set(listed))
    report.counted_drops = (sum(result.dropped.get(k, 0) for k in SAMPLE_DROPS)
                            + n * sum(result.dropped.get(k, 0) for k in GROUP_DROPS))
    report.unaccounted = abs(missing - report.counted_drops) + twice + foreign
    if twice or foreign:
        report.problems.append(f"{twice} sample(s) listed twice, {foreign} never requested")
    return report


def check_plan(result: Any, report: AccountingReport) -> None:
    """Every planned fault was really injected and left its expected trace on its sample."""
    by_key = {(s.group_index, s.index): s for s in [*result.samples, *result.failed]}
    for (group, index), (kind, _) in sorted(FAULT_PLAN.items()):
        sample = by_key.get((group, index))
        where = f"g{group}-s{index} ({kind})"
        if not report.injected[kind]:
            report.problems.append(f"{kind} was never injected")
        if kind == "straggler":
            if sample is not None:
                report.problems.append(f"{where}: {sample.status.value}, expected dropped with its straggler group")
            continue
        if sample is None:
            report.problems.append(f"{where}: neither trained nor FAILED")
        elif kind.endswith("_once"):
            if sample.status.value != "completed":
                report.problems.append(f"{where}: {sample.status.value} ({sample.metadata.get('error')}), expected "
                                       "completed after the client's retry")
        else:
            cause, fragment = EXPECTED_FAILURE[kind]
            error = str(sample.metadata.get("error") or "")
            if sample.status.value != "failed" or str(sample.termination) != cause or fragment not in error:
                report.problems.append(f"{where}: {sample.status.value} {sample.termination} {error[:120]!r}, "
                                       f"expected FAILED {cause} with {fragment!r}")
    for reason in ("empty_group", "straggler_group"):
        if result.dropped.get(reason, 0) != 1:
            report.problems.append(f"dropped[{reason!r}] is {result.dropped.get(reason, 0)}, expected 1")


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Only errors from the `name` logger tree while inside."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_accounting_scenario() -> AccountingReport:
    """The in-process scenario of the module docstring; never raises for a fault, reports it."""
    encoder = _tiny_encoder()
    injected: Counter = Counter()
    try:
        with _quiet("rollout"):  # the injected faults log a warning each: expected here, said in the report
            result, prompts, args = asyncio.run(_faulty_rollout(encoder, injected))
    except Exception as e:  # a rollout that raises is the worst outcome: nothing of the step is accounted
        requested = GROUPS * N_PER_PROMPT
        return AccountingReport(requested=requested, unaccounted=requested, injected=injected,
                                problems=[f"the rollout raised {type(e).__name__}: {e}"])
    buffered = {id(p) for p in args.driver_state.prompt_buffer}
    used = [p for p in prompts.served if id(p) not in buffered]
    report = account(result, used, N_PER_PROMPT)
    report.injected = injected
    check_plan(result, report)
    if result.groups_submitted != len(used):
        report.problems.append(f"the driver counts {result.groups_submitted} groups submitted, the prompt source "
                               f"handed out {len(used)} prompts it did not buffer")
    return report


# ----------------------------------------------------------------------------- main
def print_table(classes: Sequence[FaultClass]) -> None:
    for c in classes:
        print(f"{c.name}  [{c.origin}]  {c.fault}")
        for t in c.tests or ("(in-process rollout scenario, no pytest)",):
            print(f"    {t}")


def verdict_line(v: Verdict) -> str:
    status = "survived" if v.survived else "NOT SURVIVED"
    return f"{status:<13} {v.name:<32} [{v.origin}] {v.detail}"


def pytest_verdicts(classes: Sequence[FaultClass], timeout_s: float) -> list[Verdict]:
    """One pytest run over the backing tests of `classes`; a verdict per class."""
    ids = node_ids(classes)
    unrunnable = {i: f"not found: {why}" for i in ids if (why := missing_reason(i)) is not None}
    runnable = [i for i in ids if i not in unrunnable]
    run, broken = run_backing_tests(runnable, timeout_s) if runnable else (PytestRun([], 0, 0.0, "nothing to run"), {})
    unrunnable |= {i: f"collection error: {broken[f]}" for i in runnable if (f := i.partition("::")[0]) in broken}
    print(f"pytest: {len(runnable)} node ids, {run.summary} ({run.seconds:.0f} s)", flush=True)
    if run.log_tail:
        print(run.log_tail)
    return [judge(c, run, unrunnable) for c in classes]


def accounting_verdict(cls: FaultClass) -> Verdict:
    t0 = time.perf_counter()
    report = run_accounting_scenario()
    detail = f"{report.describe()} ({time.perf_counter() - t0:.1f} s)"
    return Verdict(cls.name, report.survived, detail, cls.origin, report.unaccounted)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print the table (classes and their tests) without running")
    p.add_argument("--only", metavar="SUBSTR", default=None, help="run the classes whose name contains SUBSTR")
    p.add_argument("--timeout", type=float, default=PYTEST_TIMEOUT_S, help="seconds the one pytest run may take")
    a = p.parse_args(argv)
    classes = select(FAULT_CLASSES, a.only)
    if not classes:
        p.error(f"no fault class name contains {a.only!r}")
    if a.list:
        print_table(classes)
        return 0

    with_tests = [c for c in classes if c.name != ACCOUNTING]
    verdicts = pytest_verdicts(with_tests, a.timeout) if with_tests else []
    verdicts += [accounting_verdict(c) for c in classes if c.name == ACCOUNTING]
    for v in verdicts:
        print(verdict_line(v))
    tried, survived = len(verdicts), sum(v.survived for v in verdicts)
    unaccounted = sum(v.unaccounted for v in verdicts)
    print(f"faults: {tried} tried, {survived} survived, {unaccounted} samples unaccounted")
    return 0 if survived == tried and unaccounted == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
