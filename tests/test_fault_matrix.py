"""scripts/fault_matrix.py (issue 17 item 11): its table names real tests, its verdicts count a missing or failed
test as not survived, its rollout audit finds every sample and really injects its faults, and `--only` runs end
to end. Also the one fault class the matrix needed a test for: YAML tags that would construct Python objects."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

from jaxrl_vlm.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "fault_matrix.py"
LAST_LINE = re.compile(r"^faults: (\d+) tried, (\d+) survived, (\d+) samples unaccounted$")


@pytest.fixture(scope="module")
def fm() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fault_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- the table
def test_every_node_id_of_the_table_names_an_existing_test(fm):
    ids = fm.node_ids(fm.FAULT_CLASSES)
    missing = {i: why for i in ids if (why := fm.missing_reason(i)) is not None}
    assert not missing, f"renamed or deleted tests in the fault matrix: {missing}"
    assert fm.missing_reason("tests/test_client.py::test_gone") == "no test test_gone in tests/test_client.py"
    assert fm.missing_reason("tests/no_such_file.py::test_x") == "no file tests/no_such_file.py"


def test_the_table_covers_every_row_of_issue_17_once_per_class_name(fm):
    """Every row of issue 17's table has a class; later classes name their issue and item."""
    names = [c.name for c in fm.FAULT_CLASSES]
    assert len(names) == len(set(names))
    rows = {c.origin for c in fm.FAULT_CLASSES if c.origin.startswith("row ")}
    assert rows == {f"row {k}" for k in range(1, 14)}
    later = {c.origin for c in fm.FAULT_CLASSES if c.origin != "survived" and not c.origin.startswith("row ")}
    assert all(re.fullmatch(r"issue \d+ item \d+", o) for o in later), later
    for c in fm.FAULT_CLASSES:
        assert (c.name == fm.ACCOUNTING) == (not c.tests), c.name
        assert all("[" not in t for t in c.tests), "name a test, not one of its parametrizations"


# ----------------------------------------------------------------------------- verdicts from junit XML
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_ok" time="0.5"/>
<testcase classname="tests.test_a" name="test_param[1]" time="0.1"/>
<testcase classname="tests.test_a" name="test_param[2]" time="0.1"><failure message="AssertionError: 2 != 3">trace</failure></testcase>
<testcase classname="tests.test_a" name="test_param_other" time="0.1"/>
<testcase classname="tests.test_b.TestThing" name="test_method" time="0.1"><skipped message="no GPU"/></testcase>
</testsuite></testsuites>"""


def test_verdicts_need_every_case_of_every_backing_test_to_pass(fm, tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    run = fm.PytestRun(fm.parse_junit(tmp_path / "junit.xml"), 1, 1.0, "1 failed, 3 passed, 1 skipped")
    params = fm.cases_for("tests/test_a.py::test_param", run.cases)
    assert [c.name for c in params] == ["test_param[1]", "test_param[2]"]  # not test_param_other
    assert len(fm.cases_for("tests/test_a.py", run.cases)) == 4

    def verdict(*tests: str, unrunnable: dict[str, str] | None = None):
        return fm.judge(fm.FaultClass("c", "survived", "fault", tests), run, unrunnable or {})

    ok = verdict("tests/test_a.py::test_ok", "tests/test_a.py::test_param_other")
    assert ok.survived and ok.detail == "2 tests, 0.6 s"
    failed = verdict("tests/test_a.py::test_ok", "tests/test_a.py::test_param")
    assert not failed.survived
    assert failed.detail == "tests/test_a.py::test_param[2] (failed: AssertionError: 2 != 3)"
    skipped = verdict("tests/test_b.py")
    assert not skipped.survived and skipped.detail == "tests/test_b.py::TestThing::test_method (skipped: no GPU)"
    gone = verdict("tests/test_a.py::test_ok", "tests/test_a.py::test_gone",
                   unrunnable={"tests/test_a.py::test_gone": "not found: no test test_gone in tests/test_a.py"})
    assert not gone.survived
    assert gone.detail == "tests/test_a.py::test_gone (not found: no test test_gone in tests/test_a.py)"
    not_run = verdict("tests/test_c.py::test_x")
    assert not not_run.survived and "did not run" in not_run.detail


BROKEN = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="" name="tests.test_broken" time="0.000"><error message="collection failure">ImportError while importing
E   ModuleNotFoundError: No module named 'gone'</error></testcase></testsuite></testsuites>"""


def test_a_test_file_that_does_not_import_fails_only_its_own_node_ids(fm, tmp_path, monkeypatch):
    """pytest runs nothing when one named file does not import: the matrix runs the rest a second time."""
    (tmp_path / "broken.xml").write_text(BROKEN)
    calls: list[list[str]] = []

    def fake_run(ids, timeout_s=0.0):
        calls.append(list(ids))
        cases = fm.parse_junit(tmp_path / "broken.xml") if len(calls) == 1 else []
        return fm.PytestRun(cases, 4 if len(calls) == 1 else 0, 1.0, "ok")

    monkeypatch.setattr(fm, "run_pytest", fake_run)
    run, broken = fm.run_backing_tests(["tests/test_broken.py::test_x", "tests/test_ok.py::test_y"])
    assert broken == {"tests/test_broken.py": "collection failure: ModuleNotFoundError: No module named 'gone'"}
    assert calls == [["tests/test_broken.py::test_x", "tests/test_ok.py::test_y"], ["tests/test_ok.py::test_y"]]


# ----------------------------------------------------------------------------- the rollout audit
def test_the_faulty_rollout_accounts_for_every_sample_and_really_injects_its_faults(fm):
    report = fm.run_accounting_scenario()
    assert report.unaccounted == 0 and report.problems == [], report.describe()
    groups_submitted = fm.OVER_SAMPLING
    assert report.requested == groups_submitted * fm.N_PER_PROMPT
    assert report.requested == report.trained + report.failed + report.counted_drops
    assert report.counted_drops == fm.N_PER_PROMPT  # the straggler group
    persistent = Counter(fm.EXPECTED_FAILURE[k][0] for k, _ in fm.FAULT_PLAN.values() if k in fm.EXPECTED_FAILURE)
    assert report.causes == persistent and set(persistent) == {"engine_error", "env_error"}
    kinds = {k for k, _ in fm.FAULT_PLAN.values()}
    assert {k for k, n in report.injected.items() if n} == kinds
    assert report.injected["timeout"] >= 2 * 2  # two persistent timeouts, retried once each


def test_the_audit_finds_a_lost_sample_and_a_failure_without_a_cause(fm):
    from rollout.driver import RolloutResult
    from rollout.sample import Sample, Status

    prompts = [Sample(prompt=[{"role": "user", "content": "q"}], index=k) for k in range(2)]

    def episode(prompt: int, index: int) -> Sample:
        s = Sample(prompt=[{"role": "user", "content": "q"}], index=index)
        s.metadata["prompt_index"] = prompt
        return s

    silent = episode(1, 0)
    silent.status = Status.FAILED  # no termination, no error
    result = RolloutResult(groups=[[episode(0, 0), episode(0, 1)]], failed=[silent], dropped=Counter(failed_sample=1))
    report = fm.account(result, prompts, 2)
    # Requested 4: two trained, one FAILED without a cause, one missing.
    assert (report.requested, report.trained, report.failed, report.unaccounted) == (4, 2, 0, 2)
    assert report.problems and "without a cause" in report.problems[0]
    counted = RolloutResult(groups=[[episode(0, 0), episode(0, 1)]], dropped=Counter(straggler_group=1))
    assert fm.account(counted, prompts, 2).unaccounted == 0  # the other group is in a group-level drop count


# ----------------------------------------------------------------------------- the script end to end
@pytest.mark.slow
def test_only_runs_one_class_end_to_end_and_ends_with_the_summary_line():
    done = subprocess.run([sys.executable, str(SCRIPT), "--only", "unimportable_env_module"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines[-2].startswith("survived") and "unimportable_env_module" in lines[-2]
    assert LAST_LINE.match(lines[-1]) and lines[-1] == "faults: 1 tried, 1 survived, 0 samples unaccounted"
    listed = subprocess.run([sys.executable, str(SCRIPT), "--list", "--only", "yaml"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "tests/test_fault_matrix.py::test_yaml_python_tags_are_refused" in listed.stdout


# ----------------------------------------------------------------------------- YAML tags (a class without a test)
def test_yaml_python_tags_are_refused(tmp_path):
    """Config files, custom config files and YAML-valued flags are read with yaml.safe_load: a tag that would
    construct a Python object (and run code) is a ConfigError, and nothing runs."""
    marker = tmp_path / "constructed"
    tag = f'!!python/object/apply:os.system ["touch {marker}"]'
    config = tmp_path / "run.yaml"
    config.write_text(f"rollout:\n  num_rollout: {tag}\n")
    with pytest.raises(ConfigError, match=r"run\.yaml is not valid YAML.*python/object/apply"):
        load_config(str(config))
    custom = tmp_path / "custom.yaml"
    custom.write_text(textwrap.dedent(f"""\
        max_turns: {tag}
        """))
    with pytest.raises(ConfigError, match=r"custom\.yaml is not valid YAML"):
        load_config(None, ["--custom-config-path", str(custom)])
    with pytest.raises(ConfigError, match="--rollout-stop-token-ids: cannot parse"):
        load_config(None, ["--rollout-stop-token-ids", f"[{tag}]"])
    assert not marker.exists()
