"""Shared fixtures: the real data in ../shared/data (skipped with a reason where absent)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
GSM8K_FIELDS = (("question", "user"), ("answer", "assistant"))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# -- Hypothesis: reproducible in CI, exploring locally ---------------------------------------------------------
# "ci" (chosen where the CI variable is set, as .ci/run sets it) derandomizes: every run draws the same examples,
# so a failure in CI fails again on the same commit. "dev" (everywhere else) draws new examples each run; a
# failure prints the blob that reproduces it, and `--hypothesis-seed=N` replays a whole run
# (tools/seeds.py runs the fast tier over many seeds). HYPOTHESIS_PROFILE=ci|dev picks one by name.
settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


def shared_data() -> Path:
    if not (SHARED_DATA / "gsm8k" / "train.jsonl").exists():
        pytest.skip(f"real data not found at {SHARED_DATA} (the ../shared/data folder beside the checkout)")
    return SHARED_DATA


# -- signals: a suite started under nohup or as a background job ----------------------------------------------------
# `nohup pytest &` (or `pytest &` from a script) starts the suite with SIGINT and SIGHUP ignored, and every process
# it spawns inherits that: packstream rightly leaves an ignored signal ignored (pipeline._workers.signals), so the
# tests that interrupt a run would see nothing happen. Those tests take `default_signals`: for their duration the
# handled signals that are ignored get their default disposition back (SIGINT: KeyboardInterrupt), in this process
# and so in the children it starts; the header of the run says when that happens.

HANDLED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def ignored_signals() -> list[str]:
    import signal

    return [name for name in HANDLED_SIGNALS if signal.getsignal(getattr(signal, name)) is signal.SIG_IGN]


def pytest_report_header(config):
    ignored = ignored_signals()
    if ignored:
        return (f"signals: {', '.join(ignored)} ignored by whoever started the suite (nohup, a background job); the "
                "interruption tests give them their default disposition for their own duration (tests/conftest.py)")
    return None


@pytest.fixture
def default_signals():
    """The handled signals that are ignored get their default disposition for this test (see above)."""
    import signal

    saved = {}
    for name in ignored_signals():
        signum = getattr(signal, name)
        saved[signum] = signal.getsignal(signum)
        signal.signal(signum, signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    return shared_data()


def _project_files() -> list[str]:
    """What a fresh clone holds: tracked and untracked-but-not-ignored files."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout.decode()
        files = [f for f in out.split("\0") if f and (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: everything but the usual caches
        skip = ("__pycache__", ".egg-info", ".pytest_cache", ".hypothesis", ".git/", "build/", "dist/", "out/")
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                 and not any(s in str(p.relative_to(ROOT)) + "/" for s in skip)]
    return files


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A copy of the project as a fresh clone would have it (no build outputs, no egg-info); one per test module
    (tests/test_packaging.py builds in its own), to be copied before a test writes into it."""
    dst = tmp_path_factory.mktemp("clone") / "packstream"
    for f in _project_files():
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dst / f)
    return dst


@pytest.fixture(scope="session")
def small_run(tmp_path_factory) -> Path:
    """One real ``pack`` output, packed once per session for the tests that edit or abuse a folder
    (tests/test_folder_trust.py, tests/test_manifest_fuzz.py; copy it before changing it): the bundled
    sample plus three bad records (a record with no assistant turn, a broken line, one too long), budget 512,
    two train and two validation shards, three dead letters."""
    import json
    import shutil

    from pipeline import PackOptions, run
    from pipeline.cli import bundled_sample

    root = tmp_path_factory.mktemp("small-run")
    data, out = root / "in", root / "out"
    shutil.copytree(bundled_sample(), data)
    (data / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{broken\n'
                                    + json.dumps({"text": " ".join(f"w{i}" for i in range(900))}) + "\n")
    run(PackOptions(inputs=(str(data),), output=str(out), max_tokens=512, num_shards=2, group_size=8,
                    validation_fraction=0.25))
    return out


# -- the fast tier ---------------------------------------------------------------------------------------------
# `pytest -m "not slow"` runs in under 2 minutes on 2 cores, for the edit-test loop; CI runs everything. The tier
# is declared here, in one place. Modules whose tests run whole jobs, models, processes or signals are slow, except
# the worked end-to-end cases in FAST_CASES (about one per area, so the loop still packs, trains, verifies and
# interrupts something); single heavy tests of the other modules are in SLOW_CASES. Entries are node id prefixes.

SLOW_MODULES = {
    "tests/test_bad_input.py", "tests/test_cli.py", "tests/test_convergence.py", "tests/test_crash.py",
    "tests/test_dask.py", "tests/test_dpo.py", "tests/test_faults.py", "tests/test_fast_path.py", "tests/test_estimate.py", "tests/test_exactness.py",
    "tests/test_fuzz_formats.py", "tests/test_guard.py", "tests/test_guard_lengths.py", "tests/test_inspect.py",
    "tests/test_interrupt.py", "tests/test_loss.py", "tests/test_pack_real.py", "tests/test_packaging.py",
    "tests/test_pipeline.py", "tests/test_preference_ddp.py", "tests/test_preference_resume.py",
    "tests/test_preference_trainers.py", "tests/test_preference_trainers_models.py", "tests/test_safety.py",
    "tests/test_scale.py", "tests/test_verify.py", "tests/test_trl_formats.py",
}
FAST_CASES = (
    "tests/test_trl_formats.py::test_tokens_and_masks_equal_trls[think-pc-conv]",  # TRL's own tokenization, one case
    "tests/test_trl_formats.py::test_a_prompt_assistant_turn_is_context_only_the_completion_trains",
    "tests/test_pipeline.py::test_bundled_sample_round_trip",
    "tests/test_cli.py::test_output_folder_is_owned_and_overwrite_replaces_only_its_files",
    "tests/test_verify.py::test_clean_output_verifies",
    "tests/test_verify.py::test_flipped_token_is_found_by_retokenizing",
    "tests/test_inspect.py::test_numbers_are_computed_from_the_shards",
    "tests/test_bad_input.py::test_every_record_is_packed_or_dead_lettered",
    "tests/test_exactness.py::test_packed_equals_alone[train-sdpa-mistral-window4]",
    "tests/test_exactness.py::test_guard_refuses_attention_mask_and_cache",
    "tests/test_dpo.py::test_packed_pair_logps_equal_alone[train-sdpa-llama]",
    "tests/test_guard.py::test_a_model_made_to_leak_is_refused[train-sdpa-drop_position_ids]",
    "tests/test_loss.py::test_one_rank_packed_loss_and_gradients_equal_unpacked[4-token]",
    "tests/test_loss.py::test_example_losses_fixed_shape_worked_example",  # milliseconds: synthetic logits
    "tests/test_dpo.py::test_long_completion_logps_are_exact_sums",
    "tests/test_safety.py::test_overwrite_removes_only_what_the_manifest_lists",
    "tests/test_interrupt.py::test_a_signal_ends_with_one_line_and_a_folder_overwrite_cleans[commit-TERM-1]",
    "tests/test_faults.py::test_bundle_retried_after_a_fault_gives_identical_output[mid_group]",
    "tests/test_fast_path.py::test_the_fast_path_equals_the_general_path[default]",
    "tests/test_preference_trainers.py::test_packed_dpo_equals_trl_per_step[sigmoid-ref_model]",
    "tests/test_preference_trainers.py::test_packed_kto_equals_trl_per_step[kto-precomputed]",
    "tests/test_preference_trainers.py::test_refusals",
    "tests/test_preference_resume.py::test_resume_mid_epoch_gives_the_uninterrupted_steps[dpo-precomputed",
)
SLOW_CASES = (
    "tests/test_loader_trust.py::test_random_byte_damage_never_ends_in_a_stray_exception",
    "tests/test_tree.py::test_generated_trees_keep_every_path_or_count_it",
    "tests/test_suggestions.py::test_generated_refusals_print_only_fixes_that_work",
    "tests/test_inputs.py::test_fuzz_",
    "tests/test_inputs.py::test_deep_json_costs_that_item_alone",
    "tests/test_docs_commands.py::test_documented_commands_run_as_written",  # minutes: every doc's commands
    "tests/test_docs_commands.py::test_a_new_user_follows_the_readme",  # minutes: the README, then the docs test
    "tests/test_guards.py::test_importing_any_module_changes_no_environment_logger_or_signal",
    "tests/test_signals.py::test_the_signal_tests_pass_when_the_suite_starts_with_sigint_and_sighup_ignored",
    "packers/_attention/",
    "tests/test_bench_dpo_trl.py::test_bench_dpo_trl_runs_both_paths",  # ~18 s: packs, then trains with TRL
    "tests/test_preference_trainers.py::test_example_trains",  # ~11 s each: 10 Trainer steps on CPU
    # One end-to-end case per vision family stays fast; the rest of each family's cases run in CI.
    "tests/test_vision.py::test_llava_tokens_equal_the_processors",  # ~8 s: CLIP's processor on many images
    "tests/test_vision_video.py::test_packed_videos_equal_each_example_alone[qwen2.5-vl-eager]",
    "tests/test_vision_end_to_end.py::test_llava_records_packed_by_the_job_equal_each_record_alone",
    "tests/test_vision_qwen3.py::test_packed_records_equal_each_record_prepared_by_transformers[eager-True-3]",
    "tests/test_vision_qwen3.py::test_packed_records_equal_each_record_prepared_by_transformers[sdpa-True-2]",
    "tests/test_vision_qwen3_video.py::test_packed_videos_equal_each_example_prepared_by_transformers[eager-6]",
    "tests/test_loader_trust.py::test_flipped_token_is_caught_by_verify",  # ~5 s; verify's clean case stays fast
    "tests/test_preference.py::test_named_fields_of_any_json_pack_or_are_rejected_with_a_reason",  # ~4 s property
    "tests/test_broken_streams.py::test_truncated_csv_packs_the_rows_before_the_break_and_one_corrupt_input[csv.xz]",
    "tests/test_broken_streams.py::test_truncated_csv_packs_the_rows_before_the_break_and_one_corrupt_input[tsv.bz2]",
    "tests/test_arrow.py::test_a_local_pack_imports_no_pandas",  # ~2 s: a pack in a fresh interpreter
)


FAST_TIMEOUT = 120
"""Seconds a fast-tier test may take before pytest-timeout fails it (the slowest takes about 10 s)."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        slow = (path in SLOW_MODULES and not item.nodeid.startswith(FAST_CASES)) or item.nodeid.startswith(SLOW_CASES)
        if slow:
            item.add_marker(pytest.mark.slow)
        elif item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FAST_TIMEOUT))
