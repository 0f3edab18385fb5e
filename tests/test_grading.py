"""Answer grading: human-checkable (pred, gold) pairs, extraction, malformed input, threads/asyncio, time bound."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from envs import grading
from envs.grading import (
    extract_final_answer,
    grade_answer,
    grade_answer_async,
    grading_stats,
    kill_grace_s,
    normalize_answer,
)

# A comparison sympy cannot finish in seconds: 9^(9^9) has ~370 million digits.
SLOW_PRED, SLOW_GOLD = "9^{9^{9}}", "2^{10^{8}}"
SLACK_S = 1.5  # scheduling slack on a loaded 2-core machine


@pytest.fixture(scope="module", autouse=True)
def worker_pool():
    grading.configure_grading(2)
    yield
    grading.shutdown_grading_workers()


# Every expected value is checkable by hand: 5*sqrt(3) = 8.660..., 4*pi = 12.566..., 2/3 = 0.666...
PAIRS = [
    # fractions vs decimals
    ("\\frac{1}{2}", "0.5", True),
    ("1/2", "0.5", True),
    ("\\dfrac{3}{4}", "0.75", True),
    ("0.75", "\\frac{3}{4}", True),
    ("\\frac{2}{3}", "0.67", True),
    ("0.67", "\\frac{2}{3}", True),
    ("\\frac{1}{3}", "0.5", False),
    ("\\frac{7}{2}", "3.5", True),
    ("\\tfrac{9}{3}", "3", True),
    # degrees
    ("30^\\circ", "30", True),
    ("30°", "30", True),
    ("30 degrees", "30", True),
    ("60^{\\circ}", "30", False),
    ("45", "45^\\circ", True),
    ("m\\angle ABC = 72", "72", True),
    # radicals
    ("5\\sqrt{3}", "8.66", True),
    ("8.66", "5\\sqrt{3}", True),
    ("8.6", "5\\sqrt{3}", False),
    ("\\sqrt{12}", "2\\sqrt{3}", True),
    ("2√3", "2\\sqrt{3}", True),
    ("sqrt(3)", "\\sqrt{3}", True),
    ("\\sqrt3", "\\sqrt{3}", True),
    ("2sqrt(3)", "2\\sqrt{3}", True),
    ("2*sqrt(3)", "\\sqrt{12}", True),
    ("3\\sqrt{2}", "2\\sqrt{3}", False),
    ("\\frac{\\sqrt{3}}{2}", "0.87", True),
    ("6", "6\\sqrt{2}", False),
    # units
    ("12 cm", "12", True),
    ("12\\text{ cm}", "12", True),
    ("24 square units", "24", True),
    ("24 \\text{units}^2", "24", True),
    ("5 in", "5", True),
    ("5 inches", "5", True),
    ("7 ft", "7", True),
    ("3.5 m", "3.5", True),
    ("16 cm^2", "16", True),
    ("12 cm", "13", False),
    # multiple-choice letters
    ("B", "B", True),
    ("(B)", "B", True),
    ("B.", "B", True),
    ("\\text{C}", "C", True),
    ("\\textbf{(D)}", "D", True),
    ("b", "B", True),
    ("A", "B", False),
    ("12", "B", False),
    ("B", "12", False),
    # pi
    ("4\\pi", "12.566", True),
    ("12.57", "4\\pi", True),
    ("2\\pi", "6.28", True),
    ("\\frac{\\pi}{2}", "1.5708", True),
    ("4π", "4\\pi", True),
    ("3\\pi", "4\\pi", False),
    ("12.6", "4\\pi", False),
    # plain numbers and formatting
    ("12", "12.0", True),
    ("5.", "5", True),
    ("$x = 5$", "5", True),
    ("\\left(3\\right)", "3", True),
    ("\\boxed{5}", "5", True),
    ("-5", "5", False),
    ("1000", "1001", False),
    # malformed
    ("", "5", False),
    ("5", "", False),
    ("\\frac{1}{", "0.5", False),
    ("}{", "5", False),
    ("\\boxed{5", "5", False),
    ("asdf qwerty", "5", False),
    ("x" * 100_000, "5", False),
    ("5" * 100_000, "5", False),
]


@pytest.mark.parametrize("pred,gold,expected", PAIRS)
def test_grade_answer_pairs(pred, gold, expected):
    assert grade_answer(pred, gold) is expected


def test_pair_table_covers_the_required_categories():
    assert len(PAIRS) >= 40
    assert sum(1 for _, _, e in PAIRS if not e) >= 15  # enough negatives that a grader saying True always fails


@pytest.mark.parametrize("bad", [None, 5, b"5", ["5"]])
def test_non_string_input_is_false_not_an_exception(bad):
    assert grade_answer(bad, "5") is False
    assert grade_answer("5", bad) is False


def test_rejected_input_is_counted():
    before = grading_stats()["rejected"]
    assert grade_answer("\\frac{1}{", "0.5") is False
    assert grading_stats()["rejected"] == before + 1


def test_bad_timeout_is_a_caller_error():
    with pytest.raises(ValueError, match="timeout_s"):
        grade_answer("1", "1", timeout_s=0)


# ------------------------------------------------------------------ extraction and normalisation
@pytest.mark.parametrize(
    "text,expected",
    [
        ("The answer is \\boxed{5}.", "5"),
        ("\\boxed{3} then I changed my mind: \\boxed{4}", "4"),
        ("nested \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("\\fbox{7}", "7"),
        ("\\boxed{1} and finally \\fbox{2}", "2"),
        ("first \\boxed{1} last \\boxed{2", None),  # truncated last box: the final answer is unknown
        ("no box here", None),
        ("", None),
        ("\\boxed", None),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_extract_final_answer_is_linear_on_huge_input():
    text = "{" * 200_000 + "\\boxed{42}" + "}" * 10
    t0 = time.monotonic()
    assert extract_final_answer(text) == "42"
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize(
    "raw,expected",
    [("12 cm", "12"), ("30^\\circ", "30"), ("2√3", "2\\sqrt{3}"), ("$x = 5$", "5"), ("4π", "4\\pi"), ("B.", "B")],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_feedback_box_is_not_the_models_answer():
    # What slime graded: the whole transcript, feedback included. Our reward path sees model text only.
    model_text = "The area is \\boxed{3}."
    feedback = "Your answer \\boxed{5} is wrong."
    assert grade_answer(extract_final_answer(model_text), "5") is False
    assert grade_answer(extract_final_answer(model_text + feedback), "5") is True  # the defect we avoid


# ------------------------------------------------------------------ threads, asyncio, time bound
CONCURRENT = [("5\\sqrt{3}", "8.66", True), ("\\frac{1}{3}", "0.5", False), ("4\\pi", "12.566", True), ("2\\sqrt{2}", "3", False)]


def test_grading_off_the_main_thread():
    # math-verify's own timeouts (signal.alarm) raise off the main thread; ours must not.
    results: dict[int, bool] = {}
    errors: list[BaseException] = []

    def work(i: int, pred: str, gold: str) -> None:
        try:
            results[i] = grade_answer(pred, gold)
        except BaseException as e:  # recorded and re-checked below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i, p, g)) for i, (p, g, _) in enumerate(CONCURRENT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert results == {i: e for i, (_, _, e) in enumerate(CONCURRENT)}


async def test_grading_inside_a_running_event_loop():
    assert grade_answer("5\\sqrt{3}", "8.66") is True  # direct, blocking call inside a coroutine
    assert await asyncio.to_thread(grade_answer, "\\frac{1}{3}", "0.5") is False
    got = await asyncio.gather(*(grade_answer_async(p, g) for p, g, _ in CONCURRENT))
    assert got == [e for _, _, e in CONCURRENT]


def test_slow_comparison_times_out_and_counts_as_wrong():
    assert grade_answer("\\frac{1}{2}", "0.5") is True  # worker started: start-up is not part of the bound
    before = grading_stats()["timeouts"]
    timeout_s = 0.5
    t0 = time.monotonic()
    assert grade_answer(SLOW_PRED, SLOW_GOLD, timeout_s=timeout_s) is False
    elapsed = time.monotonic() - t0
    assert elapsed < timeout_s + kill_grace_s(timeout_s) + SLACK_S
    assert grading_stats()["timeouts"] == before + 1
    assert grade_answer("2\\sqrt{3}", "\\sqrt{12}") is True  # the worker is usable afterwards


def test_slow_comparison_in_a_thread_does_not_block_others():
    grade_answer("\\frac{1}{2}", "0.5")
    slow_result: list[bool] = []
    slow = threading.Thread(target=lambda: slow_result.append(grade_answer(SLOW_PRED, SLOW_GOLD, timeout_s=2.0)))
    slow.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    assert grade_answer("\\frac{7}{2}", "3.5") is True  # served by the second worker meanwhile
    assert time.monotonic() - t0 < 1.9 + SLACK_S
    slow.join(timeout=2.0 + kill_grace_s(2.0) + SLACK_S + 5)
    assert slow_result == [False]


async def test_async_grading_keeps_the_event_loop_running():
    await grade_answer_async("\\frac{1}{2}", "0.5")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    task = asyncio.create_task(ticker())
    t0 = time.monotonic()
    assert await grade_answer_async(SLOW_PRED, SLOW_GOLD, timeout_s=0.8) is False
    elapsed = time.monotonic() - t0
    task.cancel()
    assert elapsed < 0.8 + kill_grace_s(0.8) + SLACK_S
    assert ticks >= 5  # the loop kept running while the worker computed


def test_worker_that_cannot_start_is_a_loud_error(monkeypatch):
    # Grading every answer as wrong because the grader is broken would silently train on zero reward.
    grading.configure_grading(1)
    try:
        monkeypatch.setattr(grading.sys, "executable", "/bin/false")
        with pytest.raises(grading.GradingWorkerError, match="start-up"):
            grade_answer("\\frac{1}{2}", "0.5")
        monkeypatch.setattr(grading.sys, "executable", "/nonexistent/python")
        with pytest.raises(grading.GradingWorkerError, match="/nonexistent/python"):
            grade_answer("\\frac{1}{2}", "0.5")
        monkeypatch.undo()
        assert grade_answer("\\frac{1}{2}", "0.5") is True  # the pool recovers once the cause is gone
    finally:
        grading.configure_grading(2)


def test_hung_worker_is_killed_and_replaced():
    grading.configure_grading(1)
    try:
        assert grade_answer("\\frac{1}{2}", "0.5") is True
        (pid,) = grading._get_pool().worker_pids()
        os.kill(pid, signal.SIGSTOP)  # a worker that ignores its own alarm (as in a long C call)
        before = grading_stats()
        timeout_s = 0.3
        t0 = time.monotonic()
        assert grade_answer("\\frac{1}{2}", "0.5", timeout_s=timeout_s) is False  # no verdict in time: wrong
        assert time.monotonic() - t0 < timeout_s + kill_grace_s(timeout_s) + SLACK_S
        after = grading_stats()
        assert after["worker_kills"] == before["worker_kills"] + 1
        assert after["timeouts"] == before["timeouts"] + 1
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped
        assert grade_answer("\\frac{1}{2}", "0.5") is True
        assert grading._get_pool().worker_pids() != [pid]
    finally:
        grading.configure_grading(2)


@pytest.mark.parametrize(
    ("pred", "gold"),
    [("1+garbage()", "1"), ("12 trailing words here", "12"), ("2)", "2"), ("(3", "3"), ("7 foo(2)", "7"),
     ("\\boxed{5 bananas}", "5")],
)
def test_trailing_junk_is_not_graded_by_its_prefix(pred, gold):
    """math-verify parses a valid prefix and drops the rest; such answers must not count (issue 17 row 13)."""
    assert not grade_answer(pred, gold)


@pytest.mark.parametrize(
    ("pred", "gold"),
    [("12+", "12"), ("12 +", "12"), ("12-", "12"), ("12*", "12"), ("12/", "12"), ("12^", "12"), ("12=", "12"),
     ("12,", "12"), ("3\\cdot", "3"), ("2\\times", "2"), ("\\frac{1}{2}+", "0.5"), ("*12", "12"), ("/4", "4"),
     ("\\boxed{12+}", "12"), ("x \\le", "x")],
)
def test_an_answer_that_ends_or_starts_with_a_dangling_operator_is_wrong(pred, gold):
    """math-verify keeps the longest valid prefix ("12+" parses as 12): an expression cut off at an operator is
    not graded by what precedes it (issue 35, item 5)."""
    assert not grade_answer(pred, gold)


@pytest.mark.parametrize(
    ("pred", "gold"),
    [("-12", "-12"), ("+12", "12"), ("\\pm 3", "\\pm 3"), ("30^\\circ", "30"), ("= 12", "12"), ("x^2+1", "1+x^2"),
     ("f \\circ g", "f \\circ g"), ("-\\frac{1}{2}", "-0.5")],
)
def test_signs_degrees_and_complete_expressions_are_not_dangling(pred, gold):
    assert grade_answer(pred, gold)


@pytest.mark.parametrize(
    ("pred", "gold"),
    [("(1,2]", "(1,2]"), ("[0,\\infty)", "[0,\\infty)"), ("sqrt(3)", "\\sqrt{3}"), ("AB", "AB"), ("5 cm", "5"),
     ("x = 5", "5"), ("2\\pi", "2\\pi")],
)
def test_math_words_intervals_and_units_are_not_junk(pred, gold):
    assert grade_answer(pred, gold)
