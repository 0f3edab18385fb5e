"""The engine's multi-row prefill and its fixed set of programs (issue 48).

* Prompts admitted together run in one prefill program call (a loop over their rows on the device): the tokens,
  log-probs and K/V pages it gives equal those of one call per prompt, in the same order, including a row that
  reuses the pages an earlier row of the same call wrote (a prefix hit with its copied last page).
* Short text prompts may run side by side, several per forward (`prefill_batch_tokens`, on by default on GPU and
  TPU): the same tokens, log-probs and pages, a row that reads pages another row writes going to a later group,
  rows that wait for none filling the groups before it (results in admission order all the same).
* After one warm-up round at a concurrency, repeating that round compiles nothing: a cold prefill and the prefix
  hits of later rounds share one program, and decode steps while requests arrive one by one borrow the programs the
  warm-up compiled; with prompts side by side too.
* A decode bucket that keeps borrowing gets its own program compiled on a side thread, which the steps after it run
  without compiling on the scheduler's thread, with the same tokens and log-probs; a process that exits while the
  side thread compiles waits for it instead of aborting.
* A prefill whose buckets have no program borrows the cheapest compiled one that covers them (text with text, images
  with images) and, once in steady use, gets its own compiled on the side thread: the same token and log-prob.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import pytest

from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
from jaxrl_vlm.engine import runner as runner_module
from jaxrl_vlm.engine.background_compile import THREAD_NAME
from jaxrl_vlm.engine.runner import FloatRow, IntRow, ModelRunner, PrefillRow
from jaxrl_vlm.models import from_hf
from rollout.client import SGLangClient
from _launch import ROOT, xla_flags

PAGE = 16
MAX_SEQ = 128
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _columns(temperature: float = 0.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    ints = np.zeros((len(IntRow),), np.int32)
    ints[IntRow.TOP_K] = -1
    ints[IntRow.SEED] = seed
    floats = np.zeros((len(FloatRow),), np.float32)
    floats[FloatRow.TEMPERATURE] = temperature
    floats[FloatRow.TOP_P] = 1.0
    return ints, floats


def _rows(vocab: int) -> list[PrefillRow]:
    """A 40-token prompt, then four of 5 to 32 tokens (one prompt bucket of 32) in pages of their own, then a sixth
    that extends the 32-token one: its first 20 tokens reuse that prompt's page 0 and a copy of its page 1 (which
    holds 4 of them), and 9 more are computed."""
    rng = np.random.default_rng(0)
    rows, next_page = [], 0
    for slot, n in enumerate([40, 5, 17, 30, 32]):
        ids = rng.integers(0, vocab - 8, size=n).astype(np.int32)
        pages = list(range(next_page, next_page + -(-(n + 1) // PAGE)))
        next_page = pages[-1] + 1
        ints, floats = _columns(*((1.0, 7) if slot == 3 else (0.0, 0)))  # one sampled row, seeded
        bias = ((3, 2.5), (3, 0.5), (11, -1.0)) if slot == 2 else ()  # repeated ids add up
        rows.append(PrefillRow(slot, pages, ids, np.broadcast_to(np.arange(n, dtype=np.int32), (3, n)), None, None,
                               ints, floats, logit_bias=bias))
    base = rows[4]
    ids = np.concatenate([base.input_ids[:20], rng.integers(0, vocab - 8, size=9).astype(np.int32)])
    own = [next_page, next_page + 1]
    ints, floats = _columns()
    rows.append(PrefillRow(5, [base.pages[0], *own], ids, np.broadcast_to(np.arange(29, dtype=np.int32), (3, 29)),
                           None, None, ints, floats, start=20, copy=(base.pages[1], own[0])))
    return rows


def _kv(runner: ModelRunner, pages: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V [layers, n, kv_heads, head_dim] of positions [0, n) under page table `pages`."""
    k, v = (np.asarray(getattr(runner.cache, part)[:, np.asarray(pages)]) for part in ("k", "v"))
    flat = lambda a: a.reshape(a.shape[0], -1, *a.shape[3:])[:, :n]  # noqa: E731
    return flat(k), flat(v)


@pytest.fixture(scope="module")
def one_call_each(tiny_hf_checkpoint: Path):
    """(model, config, the runner that prefilled `_rows` one call each, its (token, log-prob) per row, the runners
    of the tests by `prefill_batch_tokens`): the reference of every way of prefilling them together."""
    config = EngineOptions(max_batch=8, max_seq_len=MAX_SEQ, min_prefill_bucket=32, min_kv_bucket=MAX_SEQ,
                           page_size=PAGE, prefill_batch_tokens=0)
    model = from_hf(str(tiny_hf_checkpoint))
    alone = ModelRunner(model, config, ())
    return model, config, alone, [alone.prefill_rows([alone.prepare_prefill(r)])[0] for r in _rows(alone.vocab_size)], {}


@pytest.mark.parametrize("batch_tokens, order, want_calls", [
    # One row at a time (a CPU's default): the 40-token prompt runs alone; the next rows, one prompt bucket (32
    # tokens; the extension computes 9), share a call that loops over its 5 rows.
    (0, range(6), [(1, 1), (5, 1)]),
    # Side by side, 96 // 32 = 3 rows per forward, 6 rows per call: the four 32-bucket prompts fill a group of 3 and
    # start a second; the extension reads pages the fourth writes, so it goes to a third group (the next call).
    (96, range(6), [(1, 1), (2, 3), (1, 3)]),
    # The same, the extension admitted right after the prompt it extends: the next two prompts join that one's
    # group, so rows run out of their order ([4, 1, 2] [5, 3, -]: two forwards, where rows kept in order, a new
    # group at each row that waits, take three) and come back in it.
    (96, [0, 4, 5, 1, 2, 3], [(1, 1), (2, 3)]),
])
def test_prompts_prefilled_in_one_call_equal_one_call_each(one_call_each, batch_tokens: int, order: list[int],
                                                           want_calls: list[tuple[int, int]]):
    model, config, alone, single, runners = one_call_each
    if batch_tokens not in runners:  # one runner (one compilation) per setting; a prefill rewrites the same pages
        runners[batch_tokens] = ModelRunner(model, dataclasses.replace(config, prefill_batch_tokens=batch_tokens), ())
    together = runners[batch_tokens]
    rows = [_rows(together.vocab_size)[i] for i in order]
    single = [single[i] for i in order]
    calls: list[tuple[int, int]] = []
    program = together._prefill

    def counted(*args, group):  # args[3]: the loop count (rows, or groups of rows)
        calls.append((int(args[3]), group))
        return program(*args, group=group)

    together._prefill = counted
    batched = together.prefill_rows([together.prepare_prefill(r) for r in rows])

    assert calls == want_calls
    assert [t for t, _ in batched] == [t for t, _ in single]
    np.testing.assert_allclose([lp for _, lp in batched], [lp for _, lp in single], atol=1e-5)
    for r in rows:
        n = len(r.input_ids)
        for got, want in zip(_kv(together, list(r.pages), n), _kv(alone, list(r.pages), n)):
            np.testing.assert_allclose(got, want, atol=1e-5)
    # The extension attends to the prefix another row of its call wrote: its K/V there is that prompt's.
    base, ext = (next(r for r in rows if r.slot == slot) for slot in (4, 5))
    for got, want in zip(_kv(together, list(ext.pages), 20), _kv(alone, list(base.pages), 20)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    # The logit bias entered the bias row of its slot (the decode steps read it from there).
    bias = np.asarray(together.bias[2])
    assert bias[3] == pytest.approx(3.0) and bias[11] == pytest.approx(-1.0) and np.count_nonzero(bias) == 2


def test_side_by_side_puts_each_row_in_the_first_group_after_the_rows_it_waits_for(one_call_each):
    """Three GRPO groups of three admitted together, four rows per forward: each prompt's first sample prefills its
    20 tokens into pages of its own, the other two read its first page and a copy of its second and compute the
    last token. Rows in admission order, a row that reads another's pages starting a new forward, would take four
    forwards ([A0] [A1 A2 B0] [B1 B2 C0] [C1 C2]); the first samples share one, their followers fill the next."""
    _, config, alone, _, _ = one_call_each
    none = config.num_pages

    def row(start: int, table: list[int], copy: tuple[int, int] | None = None) -> Any:
        return SimpleNamespace(row=SimpleNamespace(start=start, copy=copy), key=(32, MAX_SEQ, None),
                               table=np.array([*table, *[none] * (4 - len(table))], np.int32))

    rows = []
    for g, first in enumerate((0, 2, 4)):
        rows.append(row(0, [first, first + 1]))
        rows += [row(19, [first, 10 + 2 * g + s], copy=(first + 1, 10 + 2 * g + s)) for s in range(2)]
    layout = alone._side_by_side(rows, 4)
    assert layout == [0, 3, 6, None, 1, 2, 4, 5, 7, 8, None, None]
    # A row writing a page an earlier row reads goes after it: the page is read as in admission order.
    reader, writer = row(19, [0, 12], copy=(1, 12)), row(0, [1, 13])
    assert alone._side_by_side([reader, writer], 4) == [0, None, None, None, 1, None, None, None]
    assert alone._side_by_side(rows, 1) == list(range(9))


async def _round(url: str, prompt: list[int], concurrency: int, new_tokens: int) -> list[Any]:
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    async with SGLangClient(url, timeout_s=120) as client:
        return await asyncio.gather(*(client.generate(prompt, sampling_params=params) for _ in range(concurrency)))


@pytest.mark.parametrize("batch_tokens", [0, 128])  # one prompt per forward, and two side by side (64-token bucket)
def test_repeated_rounds_after_a_warm_up_round_compile_nothing(tiny_hf_checkpoint: Path, batch_tokens: int):
    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _s, **_k: compiles.append(event) if event == BACKEND_COMPILE else None)
    config = EngineOptions(max_batch=32, max_seq_len=MAX_SEQ, min_kv_bucket=MAX_SEQ, prefill_batch_tokens=batch_tokens)
    prompt = list(range(40, 67))  # 27 tokens: one whole page, and a partly filled one a prefix hit copies
    with EmbeddedEngine(str(tiny_hf_checkpoint), config=config) as engine:
        runner = engine.engine.runner
        for c in (1, 8, 32):
            first = asyncio.run(_round(engine.url, prompt, c, 6))  # warm-up: compiles what this concurrency needs
            programs, compiled = set(runner.programs), len(compiles)
            for _ in range(2):
                again = asyncio.run(_round(engine.url, prompt, c, 6))
                assert [r.output_ids for r in again] == [r.output_ids for r in first]
                assert all(r.cached_tokens > 0 for r in again)  # every repeat is a prefix hit
            assert runner.programs == programs, f"concurrency {c}: compiled {runner.programs - programs} after warm-up"
            assert len(compiles) == compiled, f"concurrency {c}: {len(compiles) - compiled} compilations after warm-up"
        groups = {key[-1] for key in runner.programs if key[0] == "prefill"}
        assert groups == ({2} if batch_tokens else {1})  # 128 // the 64-token bucket: two prompts per forward


def test_a_decode_bucket_in_steady_use_compiles_on_a_side_thread(one_call_each, monkeypatch):
    """One row borrows the 4-row decode program; borrowing in fewer than FALLBACK_STEPS of the last FALLBACK_WINDOW
    steps compiles nothing; once it reaches that, the 1-row program compiles on the side thread, and the step after
    it runs that program without compiling on the scheduler's thread: the same token and log-prob as the borrowed
    program and as the row's in the 4-row step."""
    _, config, alone, _, _ = one_call_each
    monkeypatch.setattr(runner_module, "FALLBACK_STEPS", 2)
    monkeypatch.setattr(runner_module, "FALLBACK_WINDOW", 3)
    rows = _rows(alone.vocab_size)

    def step(slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
        tables = np.full((len(slots), MAX_SEQ // PAGE), config.num_pages, np.int32)
        ints, floats = (np.stack([c] * len(slots), axis=1) for c in _columns())
        for i, slot in enumerate(slots):
            tables[i, : len(rows[slot].pages)] = rows[slot].pages
            ints[IntRow.TOKEN, i], ints[IntRow.LENGTH, i] = 7, len(rows[slot].input_ids)  # writes past the prompt
        return alone.decode(np.asarray(slots, np.int32), tables, ints, floats, False)

    threads: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _s, **_k: threads.append(threading.current_thread().name) if event == BACKEND_COMPILE else None)
    alone.background.wait(timeout_s=300)  # the fixture's prefills may have started one
    before = alone.background.compiled
    together = step([0, 1, 2])  # compiles the 4-row program, on this thread
    own = ("decode", 1, MAX_SEQ, False)
    compiled_here = threads.count(threading.current_thread().name)
    borrowed = [step([1])]
    step([0, 1, 2])
    step([0, 1, 2])
    borrowed.append(step([1]))  # the borrowing three steps before is out of the window: one in it, nothing compiles
    assert not alone.background.busy and alone.background.compiled == before
    borrowed.append(step([1]))  # two in the window: the 1-row program starts compiling
    assert own not in alone.programs and (alone.background.busy or alone.background.compiled == before + 1)
    alone.background.wait(timeout_s=300)
    ready = step([1])
    assert own in alone.programs and alone.program_calls[own] == 1, "the step after the compilation runs its program"
    assert threads.count(threading.current_thread().name) == compiled_here, "compiled on the scheduler's thread"
    assert threads.count(THREAD_NAME) == 1 and alone.background.compiled == before + 1 and not alone.background.failed
    for ids, lps in [*borrowed, ready]:
        assert ids.tolist() == together[0][1:2].tolist()
        np.testing.assert_allclose(lps, together[1][1:2], atol=1e-5)


def test_a_prefill_borrows_a_larger_program_and_its_own_compiles_on_the_side_thread(one_call_each, monkeypatch):
    """The fixture prefilled a 64-token bucket first (compiled on its thread), then four prompts of the 32-token
    bucket, one call each: they borrowed the 64-token program, the fourth (PREFILL_FALLBACK_CALLS in the window)
    started the 32-token program's compilation on the side thread. A later prompt of that bucket runs it, compiling
    nothing on this thread, with the token and log-prob the borrowed program gave."""
    _, _, alone, single, _ = one_call_each
    assert runner_module.PREFILL_FALLBACK_CALLS == 4
    alone.background.wait(timeout_s=300)
    rows = _rows(alone.vocab_size)
    own = alone._prefill_key((32, MAX_SEQ, None))
    prepared = alone.prepare_prefill(rows[1])  # adopts the side thread's program
    assert prepared.key == (32, MAX_SEQ, None) and own in alone.side_programs and not alone.background.failed
    threads: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _s, **_k: threads.append(threading.current_thread().name) if event == BACKEND_COMPILE else None)
    calls = alone.program_calls[("prefill", 32, None)]
    (token, logprob), = alone.prefill_rows([prepared])
    assert alone.program_calls[("prefill", 32, None)] == calls + 1 and threading.current_thread().name not in threads
    assert token == single[1][0] and logprob == pytest.approx(single[1][1], abs=1e-5)

    # Which compiled program covers which buckets: text with text, pictures with pictures, the cheapest that covers.
    keys = {alone._prefill_key(b) for b in [(64, 128, None), (128, 64, None), (128, 128, None), (64, 128, 1024),
                                            (32, 128, 4096), (128, 128, 256)]}
    monkeypatch.setattr(alone, "programs", keys)
    assert alone._prefill_buckets((32, 64, None)) == (64, 128, None)
    assert alone._prefill_buckets((128, 64, None)) == (128, 64, None)  # its own
    assert alone._prefill_buckets((32, 256, None)) == (32, 256, None)  # nothing covers it: compiled where it stands
    assert alone._prefill_buckets((32, 64, 256)) == (32, 128, 4096)  # the shortest prompt first
    assert alone._prefill_buckets((64, 128, 2048)) == (64, 128, 2048)


def test_a_borrowing_prefill_with_many_logit_bias_entries_starts_the_plain_program_of_its_buckets(one_call_each,
                                                                                                   monkeypatch):
    """A row with more logit-bias entries than the smallest bias bucket runs a program of its own bias size where it
    stands; the program its buckets start on the side thread is still the plain one (no bias entries beyond the
    smallest bucket), the key that `_prefill_buckets` looks for once it is adopted. Nothing compiles here."""
    _, _, alone, _, _ = one_call_each
    alone.background.wait(timeout_s=300)
    alone._adopt_ready()  # into the runner's own set, before the test swaps it
    many = tuple((token, 0.5) for token in range(runner_module.MIN_BIAS_ENTRIES + 1))
    row = dataclasses.replace(_rows(alone.vocab_size)[1], logit_bias=many)
    own, covering = (32, MAX_SEQ, None), (64, MAX_SEQ, None)
    monkeypatch.setattr(alone, "programs", {alone._prefill_key(covering)})  # only a larger prompt bucket compiled
    monkeypatch.setattr(runner_module, "PREFILL_FALLBACK_CALLS", 1)  # this borrowing starts the side compilation
    started, compiled = [], []
    monkeypatch.setattr(alone.background, "can_start", lambda key: True)
    monkeypatch.setattr(alone.background, "start", lambda key, compile_fn: started.append(key))
    monkeypatch.setattr(alone, "_prefill_compiler", lambda prepared: compiled.append(prepared))
    assert alone.prepare_prefill(row).key == covering  # it borrows, with its nine entries
    assert started == [alone._prefill_key(own)]
    assert [(p.key, p.row.logit_bias) for p in compiled] == [(own, ())]


# Exits right after starting a compilation long enough to be in XLA's compiler at exit; says whether it was.
_EXIT_WHILE_COMPILING = """
import atexit, jax, jax.numpy as jnp
from jaxrl_vlm.engine.background_compile import BackgroundCompiler
def chain(x):
    for i in range(25):
        x = jnp.sin(x @ x.T + i)
    return x
side = BackgroundCompiler()
side.start("chain", lambda: jax.jit(chain).lower(jax.ShapeDtypeStruct((64, 64), jnp.float32)).compile())
atexit.register(lambda: print("compiled at exit:", side.compiled, flush=True))
print("busy when exiting:", side.busy, flush=True)
"""


def test_a_process_exiting_while_the_side_thread_compiles_waits_for_it_and_exits_cleanly():
    # A daemon compile thread still inside XLA when the interpreter finalizes aborted the process (SIGABRT,
    # "terminate called ... exception not rethrown"): a served engine stopped by SIGTERM then died that way.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _EXIT_WHILE_COMPILING], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "busy when exiting: True" in proc.stdout and "compiled at exit: 1" in proc.stdout, proc.stdout
