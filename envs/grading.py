"""Answer grading for geometry answers (Geometry3K style), safe in threads and asyncio.

`grade_answer(pred, gold)` decides whether a model's answer equals the reference:

1. Both strings are normalised (`normalize_answer`): `$`, `\\left`/`\\right`, `\\text{..}`,
   spacing, a trailing period, units (cm, m, in, ft, units, square units, ``^2``), degree marks,
   ``x =`` prefixes; `√3`, `\\sqrt3`, `sqrt(3)` become `\\sqrt{3}`, `π`/`pi` become `\\pi`.
2. Multiple-choice letters ("B", "(B)", "B.", `\\text{B}`) compare as strings (case-insensitive):
   math-verify parses a bare letter to a symbol, which is meaningless here.
3. Identical normalised strings, or two plain decimal literals, are decided in-process.
4. Everything else goes to math-verify (symbolic equality) and then to a numeric check of the
   evaluated values: relative tolerance `REL_TOL`, and a decimal literal with d (1 or 2 for the
   reference, 2 for the prediction) fractional digits matches an exact value that rounds to it,
   so "8.66" grades equal to `5\\sqrt{3}` and `4\\pi` to a reference "12.57".

Time-bound policy (why a subprocess): sympy can run for minutes on adversarial input
(`9^{9^{9}}` vs `2^{10^{8}}`), math-verify's own timeouts use `signal.alarm` (main thread only),
and a Python thread cannot be stopped. So step 4 runs in a small pool of worker *processes*
(`python -c`, not fork, so a JAX parent is safe). Each request carries `timeout_s`:

- the worker arms `setitimer` for `timeout_s` around parse + verify + evalf and answers
  "timed out" when it fires (math-verify swallows the exception, so a flag records it);
- the caller waits at most `timeout_s + kill_grace_s(timeout_s)` for the reply, and otherwise
  kills the worker (a C-level computation ignores signals) and starts a new one on next use.

A timed-out comparison counts as *wrong*, is logged (warning) and counted in `grading_stats()`.
Worker start-up (about 0.5 s, once per worker) and waiting for a free worker are not part of
`timeout_s`; both are bounded by `STARTUP_TIMEOUT_S`. Inputs longer than `MAX_ANSWER_CHARS`
after extraction are rejected (wrong) before any math.

Malformed input (empty, unbalanced braces, garbage, huge strings) grades False and never raises.
A broken grading *infrastructure* (worker cannot start) raises `GradingWorkerError`: silently
grading everything as wrong would train on zero rewards.

This module never imports jax, sympy or math-verify in the calling process.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import math
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

REL_TOL = 1e-4  # relative tolerance of numeric equality
ABS_TOL = 1e-9  # absolute floor of the tolerance (reference 0)
MAX_ANSWER_CHARS = 512  # longer (extracted) answers are rejected before any math
STARTUP_TIMEOUT_S = 60.0  # worker start-up, and waiting for a free worker
DEFAULT_MAX_WORKERS = max(1, min(4, os.cpu_count() or 1))
_WORKER_MEMORY_LIMIT_BYTES = 4 << 30  # RLIMIT_AS of a worker: a runaway bignum fails fast


def kill_grace_s(timeout_s: float) -> float:
    """Extra seconds the caller waits for a worker's own timeout reply before killing it."""
    return max(0.5, 0.25 * timeout_s)


class GradingWorkerError(RuntimeError):
    """The grading worker pool itself is broken (cannot start); not a property of the answer."""


# --------------------------------------------------------------------------- statistics
_STATS_LOCK = threading.Lock()
_STATS: dict[str, int] = {
    "calls": 0,  # grade_answer calls
    "letter": 0,  # decided as multiple-choice letters
    "fast_path": 0,  # decided in-process (identical strings, plain decimals)
    "worker_calls": 0,  # sent to a worker
    "timeouts": 0,  # comparisons that hit the deadline (graded wrong)
    "worker_kills": 0,  # workers killed because they did not answer within timeout + grace
    "worker_failures": 0,  # workers that died or answered garbage mid-request (graded wrong)
    "rejected": 0,  # malformed or over-long input (graded wrong)
}


def _count(key: str, n: int = 1) -> None:
    with _STATS_LOCK:
        _STATS[key] += n


def grading_stats() -> dict[str, int]:
    """A snapshot of the process-wide grading counters (see `_STATS` for their meaning)."""
    with _STATS_LOCK:
        return dict(_STATS)


# --------------------------------------------------------------------------- extraction
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _last_box_start(text: str, commands: tuple[str, ...] = _BOX_COMMANDS) -> tuple[int, int] | None:
    """(start of the command, index just after it) of the last of `commands` (`\\boxed`/`\\fbox`), or None."""
    best: tuple[int, int] | None = None
    for cmd in commands:
        i = text.rfind(cmd)
        # `\boxedfoo` is another command: require a non-letter after the name.
        while i >= 0 and i + len(cmd) < len(text) and text[i + len(cmd)].isalpha():
            i = text.rfind(cmd, 0, i)
        if i >= 0 and (best is None or i > best[0]):
            best = (i, i + len(cmd))
    return best


def _brace_depths(text: str, start: int = 0) -> Iterator[tuple[int, int]]:
    """(index, depth after it) of each structural brace of `text` from `start`, depth counted from 0.

    The one brace scanner of this module: a backslash escapes the next character, so `\\{`/`\\}` are
    not structural.
    """
    depth = 0
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
            yield i, depth
        elif c == "}":
            depth -= 1
            yield i, depth
        i += 1


def _matching_brace(text: str, open_idx: int) -> int | None:
    """Index of the `}` closing the `{` at `open_idx`, or None if it is never closed."""
    for i, depth in _brace_depths(text, open_idx):
        if depth == 0:
            return i
    return None


def last_boxed_span(text: str, commands: tuple[str, ...] = _BOX_COMMANDS) -> tuple[int, int, str] | None:
    """(start, end, content) of the last `\\boxed{..}`/`\\fbox{..}` in `text` (or of the last of `commands`),
    or None.

    If the last box is unbalanced (e.g. a truncated generation) the result is None rather than an
    earlier box: the model's final answer is then unknown, and an older one is not its answer.
    """
    found = _last_box_start(text, commands)
    if found is None:
        return None
    start, after = found
    j = after
    while j < len(text) and text[j] in " \t":
        j += 1
    if j >= len(text) or text[j] != "{":
        return None
    close = _matching_brace(text, j)
    if close is None:
        return None
    return start, close + 1, text[j + 1 : close]


def extract_final_answer(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` in `text` (brace matched), else None."""
    if not isinstance(text, str):
        return None
    span = last_boxed_span(text)
    return None if span is None else span[2].strip()


# --------------------------------------------------------------------------- normalisation
_UNICODE = {
    "\u2212": "-",  # minus sign
    "\u00d7": "\\times ",
    "\u22c5": "\\cdot ",
    "\u00b7": "\\cdot ",
    "\u03c0": "\\pi ",
    "\u00b0": "",  # degree sign
    "\u00b2": "^2",
    "\u00b3": "^3",
    "\u2248": "\\approx ",
}
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:!> ]|\\q?quad\b|~|\\displaystyle\b")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ\b|\\degree\b|\bdeg(?:ree)?s?\b\.?", re.IGNORECASE)
_UNIT_WORDS = (
    r"units?|cm|mm|km|m|in|inch(?:es)?|ft|feet|foot|yd|yards?|meters?|metres?|centimeters?|centimetres?|"
    r"millimeters?|millimetres?|kilometers?|kilometres?|miles?|mi"
)
_TRAILING_UNIT = re.compile(
    r"(?<=[0-9}).i\s])\s*(?:(?:square|sq\.?)\s*)?(?:" + _UNIT_WORDS + r")\b\s*(?:\^\s*\{?\s*[23]\s*\}?)?\s*\.?\s*$",
    re.IGNORECASE,
)
_SQRT_BARE = re.compile(r"\\sqrt\s*([0-9]+(?:\.[0-9]+)?|[a-zA-Z])")
_SQRT_CALL = re.compile(r"(?<![\\a-zA-Z])sqrt\s*\(([^()]*)\)")
_SQRT_WORD_BARE = re.compile(r"(?<![\\a-zA-Z])sqrt\s*([0-9]+(?:\.[0-9]+)?)")
_ROOT_SIGN_PAREN = re.compile("\u221a\\s*\\(([^()]*)\\)")
_ROOT_SIGN_BARE = re.compile("\u221a\\s*([0-9]+(?:\\.[0-9]+)?|[a-zA-Z])")
_PI_WORD = re.compile(r"(?<![\\a-zA-Z])pi(?![a-zA-Z])")
_LETTER = re.compile(r"^\(?([A-Da-d])\)?[.:)]?$")
_DECIMAL = re.compile(r"^[+-]?(?:[0-9]+(?:\.([0-9]*))?|\.([0-9]+))$")


def normalize_answer(answer: str) -> str:
    """Canonical text of one answer (not a whole response): see the module docstring, step 1.

    Pure string work with linear-time regexes; the result may still be LaTeX.
    """
    s = answer.strip()
    for src, dst in _UNICODE.items():
        s = s.replace(src, dst)
    s = s.replace("$", "").replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(8):  # unwrap nested \text{\textbf{..}} a bounded number of times
        unwrapped = _TEXT_WRAPPER.sub(r"\1", s)
        if unwrapped == s:
            break
        s = unwrapped
    s = _SPACING.sub(" ", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _ROOT_SIGN_PAREN.sub(r"\\sqrt{\1}", s)
    s = _ROOT_SIGN_BARE.sub(r"\\sqrt{\1}", s)
    s = s.replace("\u221a", "\\sqrt")
    s = _SQRT_CALL.sub(r"\\sqrt{\1}", s)
    s = _SQRT_WORD_BARE.sub(r"\\sqrt{\1}", s)
    s = s.strip().rstrip(".").strip()
    s = _TRAILING_UNIT.sub("", s).strip()
    if "=" in s:  # "x = 5", "m\angle ABC = 30": the value is the right-hand side
        rhs = s.rsplit("=", 1)[1]
        if rhs.strip():
            s = rhs
    if "\\approx" in s:  # "5\sqrt{3} \approx 8.66": keep the exact part
        lhs = s.split("\\approx", 1)[0]
        if lhs.strip():
            s = lhs
    s = _SQRT_BARE.sub(r"\\sqrt{\1}", s)
    s = _PI_WORD.sub(r"\\pi ", s)
    s = "".join(s.split())
    s = s.rstrip(".").lstrip("+")
    return s


def _letter(norm: str) -> str | None:
    m = _LETTER.match(norm)
    return m.group(1).upper() if m else None


def _braces_balanced(s: str) -> bool:
    depth = 0
    for _i, depth in _brace_depths(s):
        if depth < 0:
            return False
    return depth == 0


def _decimal_places(norm: str) -> int | None:
    """Number of fractional digits if `norm` is a plain decimal literal ("8.66" -> 2, "12" -> 0), else None."""
    m = _DECIMAL.match(norm)
    if not m:
        return None
    frac = m.group(1) if m.group(1) is not None else m.group(2)
    return len(frac) if frac else 0


def numbers_match(pred_value: float, pred_places: int | None, gold_value: float, gold_places: int | None) -> bool:
    """Numeric equality of two answers' values (pure; units already stripped).

    `*_places`: fractional digits when that side is a plain decimal literal, else None. A reference
    given to 1-2 decimals matches a prediction that rounds to it; a prediction given to exactly 2
    decimals matches a reference that rounds to it ("8.66" vs 5*sqrt(3)); otherwise relative
    tolerance `REL_TOL`.
    """
    if not (math.isfinite(pred_value) and math.isfinite(gold_value)):
        return False
    if math.isclose(pred_value, gold_value, rel_tol=REL_TOL, abs_tol=ABS_TOL):
        return True
    if gold_places in (1, 2) and abs(pred_value - gold_value) <= 0.5 * 10.0**-gold_places + 1e-12:
        return True
    if pred_places == 2 and abs(pred_value - gold_value) <= 0.5 * 10.0**-pred_places + 1e-12:
        return True
    return False


# Junk after a valid prefix ("1+garbage()", "12trailingwords", "2)"): math-verify parses the prefix and drops the
# rest, so such an answer would be graded by its prefix. Words of 4+ letters and calls of a non-LaTeX name are
# not math unless they are one of these (a backslash-prefixed LaTeX command is always fine).
_MATH_WORDS = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "sqrt", "pi", "arcsin",
                         "arccos", "arctan", "sinh", "cosh", "tanh", "inf", "infty", "deg", "frac", "cdot", "times"})
_BARE_WORD = re.compile(r"(?<![\\A-Za-z])([A-Za-z]{4,})")
_BARE_CALL = re.compile(r"(?<![\\A-Za-z])([A-Za-z]{2,})\(")


def _has_junk(norm: str) -> bool:
    """True when a normalised answer holds text that is not part of a math expression (see _MATH_WORDS)."""
    depth = 0
    for ch in norm:
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
        if depth < 0:
            return True
    if depth != 0 and not _is_interval(norm):
        return True
    words = [m.group(1) for m in _BARE_WORD.finditer(norm)] + [m.group(1) for m in _BARE_CALL.finditer(norm)]
    return any(w.lower() not in _MATH_WORDS for w in words)


# A binary operator, relation or separator with no operand on one side: math-verify parses "12+" as 12 (it keeps the
# longest valid prefix), so an answer that stops mid-expression would be graded by the part before the operator.
_DANGLING_TAIL = re.compile(r"(?:[-+*/^=<>,;:_&|]|\\(?:cdot|times|div|pm|mp|le|leq|ge|geq|ne|neq|lt|gt|approx|to|"
                            r"equiv|sim|cap|cup|wedge|vee|circ|ast|star|over))$")
_DANGLING_HEAD = re.compile(r"^(?:[*/^=<>,;:_&|]|\\(?:cdot|times|div|le|leq|ge|geq|ne|neq|lt|gt|approx|to|equiv|"
                            r"cap|cup|wedge|vee|circ|ast|star|over)(?![A-Za-z]))")


def _dangling_operator(norm: str) -> bool:
    """True when a normalised answer starts or ends with an operator that lacks its operand ("12+", "*3", "3\\cdot").

    A leading sign (+ or -) or \\pm is an operand's sign, not a dangling operator.
    """
    return bool(_DANGLING_TAIL.search(norm) or _DANGLING_HEAD.match(norm))


def _is_interval(norm: str) -> bool:
    """Half-open intervals such as "(1,2]" or "[0,\\infty)" legitimately pair different brackets."""
    return norm[:1] in "([" and norm[-1:] in ")]" and norm.count(",") == 1


def _prepare(answer: Any) -> str | None:
    """Normalised answer, or None when it is malformed (not a string, unbalanced, empty, too long, junk)."""
    if not isinstance(answer, str):
        return None
    if len(answer) > 64 * MAX_ANSWER_CHARS and "\\boxed" not in answer and "\\fbox" not in answer:
        return None
    if "\\boxed" in answer or "\\fbox" in answer:
        extracted = extract_final_answer(answer)
        if extracted is None:
            return None
        answer = extracted
    if len(answer) > MAX_ANSWER_CHARS:
        return None
    norm = normalize_answer(answer)
    if not norm or not _braces_balanced(norm) or _has_junk(norm) or _dangling_operator(norm):
        return None
    return norm


# --------------------------------------------------------------------------- public API
def grade_answer(pred: str, gold: str, *, timeout_s: float = 2.0) -> bool:
    """True iff answer `pred` equals reference `gold` (both single answers; a `\\boxed{}` is extracted).

    Blocking; safe from any thread and from inside a running event loop (no signals in the caller).
    Returns within `timeout_s + kill_grace_s(timeout_s)` plus worker start-up on first use; a
    timed-out comparison is False and counted in `grading_stats()["timeouts"]`.
    Raises ValueError for a non-positive `timeout_s`, GradingWorkerError if no worker can start.
    """
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"grade_answer: timeout_s must be a positive number of seconds, got {timeout_s!r}")
    _count("calls")
    p, g = _prepare(pred), _prepare(gold)
    if p is None or g is None:
        _count("rejected")
        return False
    p_letter, g_letter = _letter(p), _letter(g)
    if p_letter is not None or g_letter is not None:
        _count("letter")
        return p_letter is not None and p_letter == g_letter
    if p == g:
        _count("fast_path")
        return True
    p_places, g_places = _decimal_places(p), _decimal_places(g)
    if p_places is not None and g_places is not None:
        _count("fast_path")
        return numbers_match(float(p), p_places, float(g), g_places)
    _count("worker_calls")
    return _get_pool().compare(p, g, float(timeout_s))


async def grade_answer_async(pred: str, gold: str, *, timeout_s: float = 2.0) -> bool:
    """`grade_answer` on a worker thread, so the event loop keeps running while sympy works."""
    return await asyncio.to_thread(grade_answer, pred, gold, timeout_s=timeout_s)


def configure_grading(max_workers: int) -> None:
    """Replace the worker pool with one of `max_workers` processes (idle old workers are stopped)."""
    if not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"configure_grading: max_workers must be a positive int, got {max_workers!r}")
    global _POOL
    with _POOL_LOCK:
        old, _POOL = _POOL, _WorkerPool(max_workers)
    if old is not None:
        old.shutdown()


def shutdown_grading_workers() -> None:
    """Stop every grading worker (also registered with atexit). The next call starts new ones."""
    global _POOL
    with _POOL_LOCK:
        old, _POOL = _POOL, None
    if old is not None:
        old.shutdown()


# --------------------------------------------------------------------------- worker pool (caller side)
class _WorkerDied(Exception):
    pass


class _Worker:
    """One grading subprocess speaking JSON lines over stdin/stdout."""

    def __init__(self) -> None:
        # Put *this* package first on the worker's path: the caller's cwd may hold another `envs`.
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        boot = f"import sys; sys.path.insert(0, {package_root!r}); from envs.grading import _worker_main; _worker_main()"
        if not sys.executable:
            raise GradingWorkerError("cannot start a grading worker: sys.executable is empty")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", boot],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None,  # inherit: a worker's traceback is visible to the user
                close_fds=True,
            )
        except OSError as e:
            raise GradingWorkerError(f"cannot start a grading worker with {sys.executable}: {e}") from e
        self._buffer = b""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            ready = self._read_line(time.monotonic() + STARTUP_TIMEOUT_S)
        except _WorkerDied as e:
            self.kill()
            raise GradingWorkerError(
                f"grading worker exited during start-up (code {self.proc.returncode}); see its stderr above: {e}"
            ) from e
        if ready is None or ready.strip() != b'{"ready": true}':
            self.kill()
            what = "no reply" if ready is None else f"reply {ready[:200]!r}"
            raise GradingWorkerError(f"grading worker did not report ready within {STARTUP_TIMEOUT_S:.0f} s ({what})")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_line(self, deadline: float) -> bytes | None:
        """One line from the worker, None at the deadline; raises _WorkerDied on EOF."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if not self._selector.select(remaining):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise _WorkerDied("end of output")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def request(self, pred: str, gold: str, timeout_s: float) -> dict[str, Any] | None:
        """The worker's reply, or None if it did not answer in time (the caller must kill it)."""
        payload = json.dumps({"pred": pred, "gold": gold, "timeout_s": timeout_s}).encode() + b"\n"
        try:
            self.proc.stdin.write(payload)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise _WorkerDied(f"cannot write request: {e}") from e
        line = self._read_line(time.monotonic() + timeout_s + kill_grace_s(timeout_s))
        if line is None:
            return None
        try:
            reply = json.loads(line)
        except json.JSONDecodeError as e:
            raise _WorkerDied(f"unparseable reply {line[:200]!r}") from e
        if not isinstance(reply, dict) or not isinstance(reply.get("equal"), bool):
            raise _WorkerDied(f"malformed reply {line[:200]!r}")
        return reply

    def kill(self) -> None:
        self._selector.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError as e:  # a broken pipe on close is expected after a kill
                logger.debug("closing grading worker pipe: %s", e)

    def close(self) -> None:
        """Ask politely (EOF on stdin), then kill."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired) as e:
            logger.debug("grading worker %d did not exit on EOF: %s", self.proc.pid, e)
        self.kill()


def _clip(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[:n] + f"...(+{len(s) - n} chars)"


class _WorkerPool:
    """Up to `max_workers` workers, each lent to one caller at a time; started lazily."""

    def __init__(self, max_workers: int) -> None:
        self.max_workers = max_workers
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._live = 0
        self._all: set[_Worker] = set()
        self._closed = False

    def _acquire(self) -> _Worker:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with self._cond:
            while True:
                if self._closed:
                    raise GradingWorkerError("grading worker pool was shut down")
                if self._idle:
                    return self._idle.pop()
                if self._live < self.max_workers:
                    self._live += 1
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise GradingWorkerError(f"no grading worker became free within {STARTUP_TIMEOUT_S:.0f} s")
                self._cond.wait(remaining)
        try:
            worker = _Worker()
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise
        with self._cond:
            self._all.add(worker)
        return worker

    def _release(self, worker: _Worker, healthy: bool) -> None:
        with self._cond:
            if healthy and not self._closed:
                self._idle.append(worker)
            else:
                self._live -= 1
                self._all.discard(worker)
            self._cond.notify()
        if not healthy or self._closed:
            worker.kill()

    def compare(self, pred: str, gold: str, timeout_s: float) -> bool:
        worker = self._acquire()
        healthy = False
        try:
            reply = worker.request(pred, gold, timeout_s)
            if reply is None:
                _count("timeouts")
                _count("worker_kills")
                logger.warning(
                    "grading: worker %d gave no answer within %.2f s (+%.2f s grace), killed; "
                    "pred=%r gold=%r graded wrong",
                    worker.pid, timeout_s, kill_grace_s(timeout_s), _clip(pred), _clip(gold),
                )
                return False
            healthy = True
            if reply.get("timed_out"):
                _count("timeouts")
                logger.warning(
                    "grading: comparison timed out after %.2f s; pred=%r gold=%r graded wrong",
                    timeout_s, _clip(pred), _clip(gold),
                )
                return False
            if reply.get("error"):
                logger.debug("grading: worker error %s for pred=%r gold=%r", reply["error"], _clip(pred), _clip(gold))
            return reply["equal"]
        except _WorkerDied as e:
            _count("worker_failures")
            logger.warning("grading: worker %d failed (%s); pred=%r gold=%r graded wrong", worker.pid, e, _clip(pred), _clip(gold))
            return False
        finally:
            self._release(worker, healthy)

    def worker_pids(self) -> list[int]:
        with self._cond:
            return [w.pid for w in self._all]

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            for w in idle:
                self._all.discard(w)
                self._live -= 1
            self._cond.notify_all()
        for w in idle:
            w.close()


_POOL_LOCK = threading.Lock()
_POOL: _WorkerPool | None = None


def _get_pool() -> _WorkerPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _WorkerPool(DEFAULT_MAX_WORKERS)
        return _POOL


def _forget_pool_in_forked_child() -> None:
    # The workers and locks belong to the parent; a forked child starts its own pool lazily.
    global _POOL, _POOL_LOCK, _STATS_LOCK
    _POOL, _POOL_LOCK, _STATS_LOCK = None, threading.Lock(), threading.Lock()


atexit.register(shutdown_grading_workers)
os.register_at_fork(after_in_child=_forget_pool_in_forked_child)


# --------------------------------------------------------------------------- worker side
class _DeadlineExceeded(Exception):
    pass


def _to_float(expr: Any) -> float | None:
    """Finite real value of a closed sympy expression, else None."""
    from sympy import Basic  # worker side only: the calling process never imports sympy (module docstring)

    if not isinstance(expr, Basic) or not getattr(expr, "is_number", False):
        return None
    value = complex(expr.evalf(30))
    if abs(value.imag) > ABS_TOL:
        return None
    return value.real if math.isfinite(value.real) else None


def _first_expr(parsed: list[Any]) -> Any:
    from sympy import Basic  # worker side only

    return next((x for x in parsed if isinstance(x, Basic)), None)


def compare_normalized(pred: str, gold: str) -> bool:
    """math-verify equality, then numeric equality, of two normalised answers (worker side; slow, unbounded)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify  # worker side only (heavy)

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold_parsed = parse(f"${gold}$", extraction_config=configs, parsing_timeout=None)
    pred_parsed = parse(f"${pred}$", extraction_config=configs, parsing_timeout=None)
    if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None):
        return True
    gold_value = _to_float(_first_expr(gold_parsed))
    pred_value = _to_float(_first_expr(pred_parsed))
    if gold_value is None or pred_value is None:
        return False
    return numbers_match(pred_value, _decimal_places(pred), gold_value, _decimal_places(gold))


def _worker_main() -> None:
    """Serve JSON-line requests {pred, gold, timeout_s} -> {equal, timed_out, error} until stdin closes."""
    import resource
    import signal

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the protocol stream
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which closes us
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft > _WORKER_MEMORY_LIMIT_BYTES:
        limit = _WORKER_MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(_WORKER_MEMORY_LIMIT_BYTES, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" notice: we bound time here
    import math_verify  # noqa: F401  (import before "ready" so start-up is not charged to a request)

    fired = [False]

    def on_alarm(signum: int, frame: Any) -> None:
        fired[0] = True
        raise _DeadlineExceeded()

    signal.signal(signal.SIGALRM, on_alarm)
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        reply: dict[str, Any] = {"equal": False, "timed_out": False, "error": None}
        fired[0] = False
        try:
            req = json.loads(line)
            signal.setitimer(signal.ITIMER_REAL, float(req["timeout_s"]))
            try:
                reply["equal"] = bool(compare_normalized(str(req["pred"]), str(req["gold"])))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _DeadlineExceeded:
            pass
        except Exception as e:  # any failure on this input grades it wrong; the reason goes back
            reply["error"] = f"{type(e).__name__}: {e}"[:500]
        if fired[0]:  # math-verify swallows exceptions, so the flag is the truth
            reply["equal"] = False
            reply["timed_out"] = True
        protocol.write(json.dumps(reply) + "\n")
