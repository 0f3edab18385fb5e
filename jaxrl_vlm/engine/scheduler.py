"""Continuous batching: one thread that admits, prefills, decodes and finishes requests.

Every loop iteration (1) applies the typed messages of its inbox (`inbox.py`: requests, aborts, control), (2) runs a
pending weight update once nothing is decoding, (3) admits waiting requests (their prefills
run together: the text-only prompts of the same buckets in one program call, each sampling its first token) and
(4) runs ONE decode step for every running request. Requests
therefore join and leave between decode steps. A decode batch holds only the running requests
(padded to a batch bucket).

KV memory is paged (`prefix_cache.PageCache`): a request holds the pages of its page table, taken
at admission for its prompt and one more whenever decoding crosses a page boundary. Admission is in
arrival order and needs a free slot (a row of the per-request arrays, at most `max_batch`) and the
prompt's pages, with one page of headroom per running request left over; a request that cannot get
its next page retracts the most recently admitted one (its K/V stays cached, so readmission recomputes
little), as SGLang does when decoding runs out of memory.

Prefix cache (`EngineOptions.prefix_cache`): a request's prompt pages enter the radix tree right
after its prefill (so the other samples of its group, admitted next, reuse them) and its prompt +
output pages when it finishes (so the next turn of the episode reuses them). Admission reuses the
pages of the longest cached prefix of the prompt (copying the partly shared last one) and prefills
only the rest; `cached_tokens` counts the reused tokens, as SGLang reports its radix-cache hits. The tree is dropped
whenever its K/V may no longer be what the serving weights compute: new weights, `/flush_cache`, a
failed device program; a request that was running across a weight update never enters the tree.

Stop rules follow SGLang's `Req.check_finished`, in its order: abort, then `max_new_tokens`
(length), then stop token ids / EOS ids (unless `ignore_eos`), then stop strings on the detokenized
tail of the output.

All methods except the `submit` / `abort` / `call` / `stop` entry points run on the scheduler
thread; results leave through each request's `on_finish(GenerateOutput)` callback. `timing` (`StepTiming`) keeps
the wall seconds of decode steps and admissions, for the host share that benchmarks report.
"""

from __future__ import annotations

import heapq
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from jaxrl_vlm.engine.inbox import (
    AbortMsg,
    ContinueMsg,
    ControlMsg,
    FlushMsg,
    GenerateMsg,
    LoadsMsg,
    MemoryMsg,
    Message,
    PauseMsg,
    StopMsg,
    UpdateWeightsMsg,
)
from jaxrl_vlm.engine.prefix_cache import (
    ImageSpan,
    PageCache,
    StateSnapshots,
    cut_before_images,
    page_keys,
    reusable_tokens,
    tail_key,
)
from jaxrl_vlm.engine.protocol import GenerateOutput, GenerateRequest, visual_spans
from jaxrl_vlm.device_lock import awaited
from jaxrl_vlm.engine.runner import DecodeStep, FloatRow, IntRow, ModelRunner, PrefillRow
from rollout.sglang_wire import (
    FinishReason,
    IN_MEMORY_LOAD_FORMAT,
    MEMORY_TAGS,
    QUEUED_ABORT_MESSAGE,
    FinishType,
    PauseMode,
    continued_answer,
    logprob_temperature,
    paused_answer,
    update_weights_answer,
)

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class ActiveRequest:
    """A request while the engine holds it."""

    request: GenerateRequest
    on_finish: Callable[[GenerateOutput], None]
    seed: int
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    slot: int | None = None  # its row in the per-request arrays while running
    pages: list[int] = field(default_factory=list)  # its page table while running (pages it holds)
    admitted: int = 0  # admission order (the most recent is retracted first)
    num_retractions: int = 0
    stop_ids: frozenset[int] = frozenset()
    max_new_tokens: int = 0
    stop_window: int = 0  # output tokens decoded to look for stop strings
    cached_tokens: int = 0  # tokens served from the prefix cache, summed over admissions (SGLang's count)
    cache_epoch: int = -1  # the scheduler's cache epoch when its K/V was computed
    state_row: int | None = None  # the recurrent-state snapshot its reused prefix continues from (hybrid family)

    @property
    def rid(self) -> str:
        return self.request.rid


@dataclass(eq=False)
class _Admission:
    """A request admitted this iteration whose prefill has not run yet (`Scheduler._run_admissions`)."""

    seq: ActiveRequest
    prepared: Any  # runner._PreparedPrefill
    reused: int  # prompt tokens served by the prefix cache
    computed: int  # prompt tokens prefilled
    resumed: bool  # a retracted request: its next token is its last output, not a sampled one


@dataclass
class _InFlight:
    """A decode step on the device whose results the host has not read yet: its rows' (slot, request) in order."""

    rows: list[tuple[int, ActiveRequest]]
    step: DecodeStep


@dataclass
class EngineStats:
    """Counters for tests and benchmarks (not timing): a batched engine has far fewer decode
    steps than generated tokens."""

    prefills: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sum over decode steps of the number of active requests
    max_decode_rows: int = 0
    generated_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    weight_updates: int = 0
    prefix_hits: int = 0  # admissions that reused cached pages
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prefilled_tokens: int = 0  # prompt tokens computed by prefill / extend (padding not counted)
    encoded_images: int = 0  # images run through the vision tower
    prefix_evictions: int = 0  # cached pages evicted to make room
    prefix_invalidations: int = 0  # times the prefix cache was dropped (weights, flush, failures)
    retractions: int = 0  # running requests sent back to the queue for lack of KV pages
    overlapped_steps: int = 0  # decode steps dispatched before the step they follow was read (overlap_schedule)
    discarded_decode_rows: int = 0  # rows an overlapped step decoded for requests that had finished meanwhile


@dataclass
class StepTiming:
    """Wall seconds of the scheduler's work, for benchmarks: decode steps (page growth, padding, the program call,
    output handling) and admissions (page matching, preparing and running prefills). With the runner's
    `decode_program_s` (inside decode program calls, dispatch to results on the host) it gives the host's share
    of a decode step."""

    decode_steps: int = 0
    decode_s: float = 0.0
    admit_s: float = 0.0


class Scheduler:
    """Owns the request queues, the slots and the KV pages; drives a `ModelRunner` from its own thread."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        eos_ids: Sequence[int],
        *,
        weight_version: str = "default",
        staged_weights: Callable[[str], Any] | None = None,
    ):
        """`staged_weights(name)`: the weights an in-process trainer staged for this replica under `name`
        (`Engine.stage_weights`), for `update_weights_from_disk` with `load_format` IN_MEMORY_LOAD_FORMAT."""
        self.runner = runner
        self._staged_weights = staged_weights
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.weight_version = weight_version
        self.max_batch = runner.config.max_batch
        self.max_seq_len = runner.config.max_seq_len
        self.stats = EngineStats()
        self.timing = StepTiming()
        self._rng = np.random.default_rng(runner.config.seed)
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._waiting: deque[ActiveRequest] = deque()
        self._held: deque[ActiveRequest] = deque()  # arrived while paused; not yet the scheduler's
        self._running: dict[int, ActiveRequest] = {}
        self._free: list[int] = list(range(self.max_batch))  # free slots (a heap)
        heapq.heapify(self._free)
        self.page_size = runner.config.page_size
        self._pages = PageCache(runner.config.num_pages, self.page_size)
        # Page tables of the running requests by slot (mirrors `ActiveRequest.pages`, padded with num_pages)
        # and their lengths, so that a decode step gathers them without a Python loop.
        self._tables = np.full((self.max_batch, runner.config.pages_per_request), runner.config.num_pages, np.int32)
        self._table_len = np.zeros((self.max_batch,), np.int64)
        # A family with recurrent state (linear attention) reuses a prefix only where a snapshot of that state
        # exists: without snapshot rows, its pages alone cannot serve a prefix.
        self._snapshots = StateSnapshots(runner.snapshot_rows, self.max_batch) if runner.snapshot_rows else None
        self._prefix_on = runner.config.prefix_cache and (not runner.stateful or self._snapshots is not None)
        self._admissions = 0
        self._cache_epoch = 0  # bumped whenever cached K/V stops matching the serving weights
        self._paused: PauseMode | None = None
        self._updates: deque[UpdateWeightsMsg] = deque()
        self._ints = np.zeros((len(IntRow), self.max_batch), np.int32)
        self._floats = np.zeros((len(FloatRow), self.max_batch), np.float32)
        self._filtered = np.zeros((self.max_batch,), bool)
        self._overlap = runner.config.overlap_schedule and not runner.stateful
        self._inflight: _InFlight | None = None  # the overlapped decode step not collected yet
        self._stop = False
        self._closed = False
        self.last_progress = time.monotonic()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="jaxrl-vlm-engine-scheduler", daemon=True)

    # ------------------------------------------------------------------ thread-safe entry points

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Answer everything still held with `abort`, then end the thread (idempotent)."""
        self._closed = True
        if not self._thread.is_alive():
            return
        self._inbox.put(StopMsg())
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"engine scheduler did not stop within {timeout_s} s")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, request: GenerateRequest, on_finish: Callable[[GenerateOutput], None]) -> None:
        """Queue a request; `on_finish` is called once, from the scheduler thread."""
        if self._closed or not self.alive:
            reason = FinishReason.aborted("The server is shutting down" if self._closed else "engine scheduler is not running")
            on_finish(GenerateOutput(request.rid, [], [], reason, request.prompt.num_tokens, self.weight_version, 0.0))
            return
        self._inbox.put(GenerateMsg(request, on_finish))

    def abort(self, rid: str | None, message: str = "Abort by /abort_request") -> None:
        """Abort the request(s) with this rid, or every request when rid is None."""
        self._inbox.put(AbortMsg(rid, message))

    def call(self, msg: ControlMsg) -> None:
        """Apply a control message on the scheduler thread between two steps; `msg.reply` receives its answer."""
        self._inbox.put(msg)

    # ------------------------------------------------------------------ loop

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox(block=not self._has_work())
                if self._stop:
                    break
                self._run_weight_updates()
                started = time.perf_counter()
                self._admit()
                admitted = time.perf_counter()
                self.timing.admit_s += admitted - started
                if self._running and self._paused is not PauseMode.IN_PLACE:
                    self._decode_step()
                    self.timing.decode_steps += 1
                    self.timing.decode_s += time.perf_counter() - admitted
                elif self._inflight is not None:
                    self._settle()
        except BaseException as exc:  # the thread must not die silently: record it and fail everyone
            logger.exception("engine scheduler crashed")
            self.error = exc
            self._fail_all(f"engine scheduler crashed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._closed = True
            self._drop_inflight()
            for seq in [*self._running.values(), *self._waiting, *self._held]:
                self._finish(seq, FinishReason.aborted("The server is shutting down"))
            self._waiting.clear()
            self._held.clear()
            self._drain_after_close()

    def _drain_after_close(self) -> None:
        """Answer what raced into the inbox during shutdown, so no caller waits forever."""
        shutting_down = update_weights_answer(False, "The server is shutting down", 0)
        for upd in self._updates:
            upd.reply(shutting_down)
        self._updates.clear()
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            match msg:
                case GenerateMsg(request, on_finish):
                    self._finish(ActiveRequest(request, on_finish, seed=0), FinishReason.aborted("The server is shutting down"))
                case UpdateWeightsMsg():
                    msg.reply(shutting_down)
                case StopMsg() | AbortMsg():
                    pass
                case _:
                    self._handle(msg)

    def _has_work(self) -> bool:
        if self._inflight is not None:
            return True
        if self._running and self._paused is not PauseMode.IN_PLACE:
            return True
        if self._updates and (self._paused or not self._running):
            return True
        return (bool(self._waiting) and not self._paused and not self._updates and self.runner.resident
                and self._has_free_slot())

    def _has_free_slot(self) -> bool:
        return bool(self._free)

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: Message) -> None:
        if not isinstance(msg, (GenerateMsg, LoadsMsg)):
            self._settle()  # control acts on every request as the host last saw it: read the step in flight first
        match msg:
            case StopMsg():
                self._stop = True
            case GenerateMsg(request, on_finish):
                self._enqueue(request, on_finish)
            case AbortMsg(rid, message):
                self._abort_matching(rid, message)
            case UpdateWeightsMsg():
                self._updates.append(msg)  # runs once nothing decodes (`_run_weight_updates`)
            case PauseMsg(mode, reply):
                reply(self._pause(mode))
            case ContinueMsg(reply):
                reply(self._continue())
            case FlushMsg(reply):
                reply(self._flush())
            case LoadsMsg(reply):
                reply(self._loads())
            case MemoryMsg(release, tags, reply):
                reply(self._memory(release, tags))
            case _:
                raise TypeError(f"unknown scheduler message {msg!r}")

    # ------------------------------------------------------------------ requests

    def _enqueue(self, request: GenerateRequest, on_finish: Callable[[GenerateOutput], None]) -> None:
        params = request.params
        seed = params.sampling_seed if params.sampling_seed is not None else int(self._rng.integers(0, 2**32))
        seq = ActiveRequest(request, on_finish, seed=seed & 0xFFFFFFFF)
        prompt_len = request.prompt.num_tokens
        if prompt_len >= self.max_seq_len:
            self._finish(seq, FinishReason.aborted(
                f"The input ({prompt_len} tokens) is longer than the model's context length "
                f"({self.max_seq_len} tokens).", status_code=400, err_type="BadRequestError"))
            return
        # SGLang caps max_new_tokens to the context left.
        seq.max_new_tokens = min(params.max_new_tokens, self.max_seq_len - prompt_len)
        seq.stop_ids = frozenset() if params.ignore_eos else frozenset(params.stop_token_ids) | self.eos_ids
        if params.stop:
            # Byte-level BPE can spend up to 4 tokens on one character; 2 more cover a straddling token.
            seq.stop_window = 4 * max(len(s) for s in params.stop) + 2
        if seq.max_new_tokens == 0 and not request.scores_prompt:  # SGLang answers at once with length 0
            self._finish(seq, FinishReason.at_length(0))
            return
        (self._held if self._paused else self._waiting).append(seq)

    def _admit(self) -> None:
        if self._paused or self._updates or not self.runner.resident:
            return
        admitted = 0
        batch: list[_Admission] = []
        while self._waiting and self._has_free_slot() and admitted < self.runner.config.max_prefills_per_step:
            seq = self._waiting[0]
            if seq.request.scores_prompt:  # one forward, no pages: it waits (pause, weight update) like a prefill
                self._waiting.popleft()
                self._score(seq)
                admitted += 1
                continue
            slot = None
            try:
                taken = self._take_pages(seq)
                if taken is None:
                    break  # in arrival order: wait until running requests free pages
                self._waiting.popleft()
                slot = heapq.heappop(self._free)
                batch.append(self._start_prefill(seq, slot, *taken))
                if self._snapshots is not None:  # recurrent state moves between rows: each prefill runs at once
                    self._run_admissions(batch)
                    batch = []
            except Exception as exc:  # a failed prefill fails that request, not the server
                logger.exception("prefill of %s failed", seq.rid)
                if self._waiting and self._waiting[0] is seq:
                    self._waiting.popleft()
                if slot is not None and slot not in self._free:  # not released by a finish already
                    self._running.pop(slot, None)
                    self._release(slot, seq, cache=False)
                else:
                    self._drop_pages(seq)
                seq.slot = None
                # The cache was donated to the failed program: no cached page can be trusted any more.
                self._invalidate_prefix_cache()
                self._finish(seq, None, error=f"prefill failed: {type(exc).__name__}: {exc}")
            admitted += 1
        self._run_admissions(batch)
        self.stats.prefix_evictions = self._pages.evictions

    def _run_admissions(self, batch: list[_Admission]) -> None:
        """Run the prefills of `batch` (admission order; `ModelRunner.prefill_rows` calls one program per run of
        text prompts) and give each request its first token; a failed program fails every request of `batch`."""
        if not batch:
            return
        try:
            results = self.runner.prefill_rows([a.prepared for a in batch])
        except Exception as exc:
            logger.exception("prefill of %s failed", ", ".join(a.seq.rid for a in batch))
            self._invalidate_prefix_cache()  # the cache was donated to the failed program
            for a in batch:
                seq = a.seq
                if seq.slot is not None and self._running.get(seq.slot) is seq:
                    del self._running[seq.slot]
                    self._release(seq.slot, seq, cache=False)
                seq.slot = None
                self._finish(seq, None, error=f"prefill failed: {type(exc).__name__}: {exc}")
            return
        self.stats.encoded_images = self.runner.encoded_images
        for a, (token, logprob) in zip(batch, results):
            self.stats.prefills += 1
            self.stats.prefix_hits += int(a.reused > 0)
            self.stats.cached_tokens += a.reused
            self.stats.prefilled_tokens += a.computed
            if a.resumed:
                self._set_next(a.seq, a.seq.output_ids[-1])
            else:
                self._append(a.seq, token, logprob)

    def _score(self, seq: ActiveRequest) -> None:
        """Answer a prompt-scoring request (logprob_start_len >= 0, max_new_tokens 0): the log-prob of every prompt
        token from position `logprob_start_len` on under the served weights, None at position 0 as SGLang has it."""
        prompt, params = seq.request.prompt, seq.request.params
        temperature = logprob_temperature(params.temperature)  # SGLang's: greedy (0) reports untempered log-probs
        try:
            lps = self.runner.score(prompt.input_ids, prompt.positions, prompt.pixel_values, prompt.image_grid_thw,
                                    temperature, clips=prompt.clips)
        except Exception as exc:  # a failed forward fails that request, not the server
            logger.exception("prompt scoring of %s failed", seq.rid)
            self._finish(seq, None, error=f"prompt scoring failed: {type(exc).__name__}: {exc}")
            return
        self.stats.prefilled_tokens += prompt.num_tokens
        values: list[float | None] = [None, *(float(x) for x in lps)]
        ids = prompt.input_ids.tolist()
        start = seq.request.logprob_start_len
        self._finish(seq, FinishReason.at_length(0), input_logprobs=list(zip(values[start:], ids[start:])))

    def _take_pages(self, seq: ActiveRequest) -> tuple[int, tuple[int, int] | None] | None:
        """Give `seq` the pages of its longest cached prefix and fresh pages for the rest of its prompt
        and its first decoded token; returns the cached prefix's length in tokens and the page copy its
        prefill starts with ((src, dst): the partly shared last page of that prefix, or None), or None (nothing
        changed) when that would leave less than one free page per running request that may still
        need one (without that headroom a new request would be retracted at the next page boundary).
        The copy's source may be evicted once this returns: a later admission that takes it over writes it in a
        later prefill row, after this one's copy has run."""
        ids = self._cached_sequence(seq)
        total = ids.shape[0]
        ps = self.page_size
        reuse, reused, source = 0, [], []
        if self._prefix_on:
            images = self._images(seq)
            matched, tail = self._pages.match(page_keys(ids, images, ps, total // ps),
                                              lambda j, n: tail_key(ids, images, ps, j, n))
            reuse = reusable_tokens(len(matched) * ps + (tail[1] if tail else 0), total, images)
            if self._snapshots is not None:  # recurrent state: only where a snapshot of it was kept
                hit = self._snapshots.match(ids, images, reuse)
                reuse, seq.state_row = hit[1] if hit else 0, hit[0] if hit else None
            reused = matched[: reuse // ps]
            if reuse % ps:  # the page holding the rest of the prefix is copied: this request writes into it
                source = [matched[reuse // ps] if reuse // ps < len(matched) else tail[0]]
        need = (total + ps) // ps - len(reused)  # positions [0, total]: the first decode writes at `total`
        self._pages.hold(reused + source)  # before allocating, so eviction cannot take them
        try:
            if self._pages.available() - need < sum(self._may_grow(r) for r in self._running.values()):
                self._pages.release(reused)
                return None
            fresh = self._pages.allocate(need)
            assert fresh is not None, "available() promised these pages"
            seq.pages = reused + fresh
        finally:
            self._pages.release(source)
        return reuse, ((source[0], fresh[0]) if source else None)

    def _may_grow(self, seq: ActiveRequest) -> bool:
        """Whether a running request may still write past its pages (before its token budget ends)."""
        last_fed = seq.request.prompt.num_tokens + seq.max_new_tokens - 2  # the last sampled token is never fed
        return last_fed // self.page_size >= len(seq.pages)

    def _drop_pages(self, seq: ActiveRequest) -> None:
        self._pages.release(seq.pages)
        seq.pages = []

    def _cache_pages(self, seq: ActiveRequest, ids: np.ndarray) -> None:
        """Offer the request's full pages holding `ids` to the radix tree (if its K/V is current)."""
        if self._prefix_on and seq.cache_epoch == self._cache_epoch:
            ps, images = self.page_size, self._images(seq)
            full = min(ids.shape[0] // ps, len(seq.pages))
            rest = ids.shape[0] - full * ps
            tail = None
            if 0 < rest < ps and full < len(seq.pages):
                tail = (tail_key(ids, images, ps, full, rest), seq.pages[full], rest)
            self._pages.insert(page_keys(ids, images, ps, full), seq.pages[:full], tail)

    def _cached_sequence(self, seq: ActiveRequest) -> np.ndarray:
        """Token ids whose K/V the request's slot holds while it runs or once it stops: prompt +
        outputs but the last (sampled, never fed). A retracted request is readmitted with exactly
        these as its prompt, so they are also what its admission must put in the cache."""
        prompt = seq.request.prompt.input_ids
        done = seq.output_ids[:-1]
        if not done:
            return prompt
        return np.concatenate([prompt, np.asarray(done, np.int32)])

    def _images(self, seq: ActiveRequest) -> tuple[ImageSpan, ...]:
        prompt = seq.request.prompt
        if prompt.images is None:  # prepared without identities (PromptPreparer computes them off-thread)
            prompt.images = visual_spans(prompt, self.runner.cfg)
        return prompt.images

    def _start_prefill(self, seq: ActiveRequest, slot: int, start: int, copy: tuple[int, int] | None) -> _Admission:
        """Put `seq` in `slot` with the pages `_take_pages` gave it, its prefill prepared (the K/V of its cached
        prefix reused, the rest to compute) and its full prompt pages offered to the tree, so that the group's
        other samples, admitted next, reuse them (their prefill rows run after this one's)."""
        req, params = seq.request, seq.request.params
        prompt = req.prompt
        ids, positions = prompt.input_ids, prompt.positions
        resumed = bool(seq.output_ids)
        if resumed:  # a retracted request: rebuild the cache of prompt + outputs but the last (not cached yet)
            ids = self._cached_sequence(seq)
            first = prompt.num_tokens
            extra_pos = np.arange(first, ids.shape[0], dtype=np.int32) + prompt.rope_delta
            positions = np.concatenate([positions, np.broadcast_to(extra_pos, (3, extra_pos.size))], axis=1)
        self._ints[:, slot] = 0
        self._ints[IntRow.TOP_K, slot] = params.top_k
        self._ints[IntRow.STEP, slot] = len(seq.output_ids)
        self._ints[IntRow.SEED, slot] = np.array(seq.seed, np.uint32).view(np.int32)
        self._ints[IntRow.ROPE_DELTA, slot] = prompt.rope_delta
        self._floats[FloatRow.TEMPERATURE, slot] = params.temperature
        self._floats[FloatRow.TOP_P, slot] = params.top_p
        self._floats[FloatRow.MIN_P, slot] = params.min_p
        self._filtered[slot] = params.needs_filter
        bias = tuple(params.logit_bias)
        reused = start  # served by the prefix cache (the rest is computed, in one or two parts)
        if self._snapshots is not None:
            start, copy = self._prefill_to_snapshot(seq, slot, ids, positions, bias, start, copy)
        prepared = self.runner.prepare_prefill(PrefillRow(
            slot, seq.pages, ids, positions, prompt.pixel_values, prompt.image_grid_thw, self._ints[:, slot].copy(),
            self._floats[:, slot].copy(), start=start, copy=copy, logit_bias=bias, clips=prompt.clips))
        seq.cached_tokens += reused
        seq.cache_epoch = self._cache_epoch
        seq.slot = slot
        self._admissions += 1
        seq.admitted = self._admissions
        self._running[slot] = seq
        self._tables[slot, : len(seq.pages)] = seq.pages
        self._table_len[slot] = len(seq.pages)
        self._cache_pages(seq, ids)  # the group's other samples, admitted next, reuse the prompt
        return _Admission(seq, prepared, reused, ids.shape[0] - reused, resumed)

    def _grow_pages(self) -> None:
        """Give every running request the page its next decoded token is written to, retracting the
        most recently admitted requests while pages run out (the oldest always progresses)."""
        slots = np.fromiter(self._running, np.int64, len(self._running))
        short = slots[self._ints[IntRow.LENGTH, slots] // self.page_size >= self._table_len[slots]]
        for seq in sorted((self._running[int(s)] for s in short), key=lambda r: r.admitted):
            if self._running.get(seq.slot) is not seq:
                continue  # retracted below for an older request
            while int(self._ints[IntRow.LENGTH, seq.slot]) // self.page_size >= len(seq.pages):
                page = self._pages.allocate(1)
                if page is not None:
                    self._tables[seq.slot, len(seq.pages)] = page[0]
                    seq.pages += page
                    self._table_len[seq.slot] = len(seq.pages)
                    continue
                victim = max(self._running.values(), key=lambda r: r.admitted)
                self._retract(victim)
                self.stats.retractions += 1
                if victim is seq:
                    break

    def _retract(self, seq: ActiveRequest) -> None:
        """Send a running request back to the front of the queue; its K/V stays cached for its readmission."""
        del self._running[seq.slot]
        self._release(seq.slot, seq)
        seq.slot = None
        seq.num_retractions += 1
        self._waiting.appendleft(seq)

    def _decode_step(self) -> None:
        """One decode step for every running request. Overlapped (`overlap_schedule`): the step is dispatched and
        left on the device; the next call dispatches the one after it on the same rows (fed with its sampled ids
        where they lie) and only then reads it, so the host's reading, finishing and admitting run while the device
        computes. When the rows changed, or cannot go on together, the step in flight is read first."""
        prev = self._inflight
        if prev is not None:
            self._inflight = self._follow(prev)
            self._collect(prev)
            if self._inflight is not None or not self._running:
                return
        self._grow_pages()
        self.stats.prefix_evictions = self._pages.evictions
        slots = sorted(self._running)
        if not slots:
            return
        rows = [(slot, self._running[slot]) for slot in slots]
        try:
            step = self.runner.dispatch_decode(
                np.asarray(slots, np.int32), self._tables[slots], self._ints[:, slots],
                self._floats[:, slots], bool(self._filtered[slots].any()),
            )
        except Exception as exc:
            self._decode_failed(rows, exc)
            return
        if self._overlap:
            self._inflight = _InFlight(rows, step)
        else:
            self._collect(_InFlight(rows, step))

    def _follow(self, prev: _InFlight) -> _InFlight | None:
        """The step after `prev`, dispatched before `prev` is read; None where it cannot go on the same rows: a row
        finished, was aborted or a request was admitted since; every row ends with `prev` (max_new_tokens); a row
        would pass max_seq_len; no page is free for a row's next position; another thread waits for the devices
        (the trainer in this process: it gets them once `prev` is read); or the batch bucket changes."""
        if (not self._overlap or len(self._running) != len(prev.rows)
                or any(self._running.get(slot) is not seq for slot, seq in prev.rows)):
            return None
        lengths = prev.step.ints[IntRow.LENGTH]
        if int(lengths.max()) + 2 > self.max_seq_len:
            return None
        if all(len(seq.output_ids) + 1 >= seq.max_new_tokens for _, seq in prev.rows):
            return None
        if awaited(self.runner.placement.devices):
            return None
        for (slot, seq), length in zip(prev.rows, lengths):
            while (int(length) + 1) // self.page_size >= len(seq.pages):  # the page the next position goes to
                page = self._pages.allocate(1)
                if page is None:
                    return None  # read `prev` first: the step after it may need to retract a request
                self._tables[slot, len(seq.pages)] = page[0]
                seq.pages += page
                self._table_len[slot] = len(seq.pages)
        slots = [slot for slot, _ in prev.rows]
        try:
            step = self.runner.dispatch_following(
                prev.step, np.asarray(slots, np.int32), self._tables[slots], self._floats[:, slots],
                bool(self._filtered[slots].any()),
            )
        except Exception:
            logger.exception("overlapped decode step failed to dispatch; reading the step before it first")
            return None
        if step is None:
            return None
        self.stats.overlapped_steps += 1
        return _InFlight(prev.rows, step)

    def _collect(self, inflight: _InFlight) -> None:
        """Read a dispatched step and hand each row's token to its request; rows whose request finished or was
        aborted since the step was dispatched are dropped."""
        try:
            ids, lps = self.runner.collect_decode(inflight.step)
        except Exception as exc:
            self._decode_failed(inflight.rows, exc)
            return
        live = 0
        for row, (slot, seq) in enumerate(inflight.rows):
            if self._running.get(slot) is seq:
                live += 1
                self._append(seq, int(ids[row]), float(lps[row]))
        self.stats.discarded_decode_rows += len(inflight.rows) - live
        if live:
            self.stats.decode_steps += 1
            self.stats.decode_rows += live
            self.stats.max_decode_rows = max(self.stats.max_decode_rows, live)

    def _decode_failed(self, rows: list[tuple[int, ActiveRequest]], exc: Exception) -> None:
        logger.error("decode step failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        self._drop_inflight()
        self._invalidate_prefix_cache()  # the donated cache cannot be trusted
        for slot, seq in rows:
            if self._running.get(slot) is seq:
                del self._running[slot]
                self._release(slot, seq, cache=False)
                self._finish(seq, None, error=f"decode failed: {type(exc).__name__}: {exc}")

    def _settle(self) -> None:
        """Read the step in flight, so the host's view of every request is current."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._collect(inflight)

    def _drop_inflight(self) -> None:
        """Wait for the step in flight and let go of its devices without reading it (a failure or shutdown)."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            try:
                self.runner.collect_decode(inflight.step)
            except Exception:
                logger.exception("the decode step in flight failed too")

    def _append(self, seq: ActiveRequest, token: int, logprob: float) -> None:
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        self.stats.generated_tokens += 1
        self.last_progress = time.monotonic()
        reason = self._check_finished(seq)
        if reason is not None:
            self._finish(seq, reason)
        else:
            self._set_next(seq, token)

    def _set_next(self, seq: ActiveRequest, token: int) -> None:
        slot = seq.slot
        self._ints[IntRow.TOKEN, slot] = token
        self._ints[IntRow.LENGTH, slot] = seq.request.prompt.num_tokens + len(seq.output_ids) - 1
        self._ints[IntRow.STEP, slot] = len(seq.output_ids)

    def _check_finished(self, seq: ActiveRequest) -> FinishReason | None:
        if len(seq.output_ids) >= seq.max_new_tokens:
            return FinishReason.at_length(seq.max_new_tokens)
        last = seq.output_ids[-1]
        if last in seq.stop_ids:
            return FinishReason.stopped(last)
        if seq.stop_window:
            tail = self.tokenizer.decode(seq.output_ids[-seq.stop_window :])
            for stop in seq.request.params.stop:
                if stop in tail:
                    return FinishReason.stopped(stop)
        return None

    def _prefill_to_snapshot(self, seq: ActiveRequest, slot: int, ids: np.ndarray, positions: np.ndarray,
                             bias: tuple[tuple[int, float], ...], start: int,
                             copy: tuple[int, int] | None) -> tuple[int, tuple[int, int] | None]:
        """A family with recurrent state: the slot continues from its reused prefix's snapshot, and the prompt but
        its last token is prefilled first, its state kept as a snapshot (so the group's other samples, whose
        prompt is the same, prefill only that last token). Returns where the rest of the prefill starts and the
        page copy it still has to make (None once this part made it)."""
        if start > 0:
            self.runner.copy_state(seq.state_row, slot)
        cut = ids.shape[0] - 1
        if start >= cut or cut_before_images(cut, self._images(seq)) != cut:
            return start, copy
        row = self._snapshots.reserve(ids, self._images(seq), cut)
        if row is None:
            return start, copy
        prompt = seq.request.prompt
        # The token this part samples is not used: the last prompt token's logits come from the second part.
        self.runner.prefill_rows([self.runner.prepare_prefill(PrefillRow(
            slot, seq.pages, ids[:cut], positions[:, :cut], prompt.pixel_values, prompt.image_grid_thw,
            self._ints[:, slot].copy(), self._floats[:, slot].copy(), start=start, copy=copy, logit_bias=bias,
            clips=prompt.clips))])
        self.runner.copy_state(slot, row)
        return cut, None

    def _snapshot_state(self, slot: int, seq: ActiveRequest) -> None:
        """Keep the recurrent state of a request that stops with its state intact: a later turn of the same
        conversation continues from it."""
        ids = self._cached_sequence(seq)
        n = ids.shape[0]
        if cut_before_images(n, self._images(seq)) != n:
            return
        row = self._snapshots.reserve(ids, self._images(seq), n)
        if row is not None:
            self.runner.copy_state(slot, row)

    # ------------------------------------------------------------------ finishing

    def _release(self, slot: int, seq: ActiveRequest, cache: bool = True) -> None:
        """Free `slot` and the pages of `seq`, the request that ran there. With `cache` (its K/V
        intact), its full pages enter the prefix cache first, unless the weights changed since its
        K/V was computed."""
        self._ints[:, slot] = 0
        self._floats[:, slot] = 0.0
        self._filtered[slot] = False
        self._tables[slot] = self._pages.num_pages
        self._table_len[slot] = 0
        if cache:
            self._cache_pages(seq, self._cached_sequence(seq))
            if self._snapshots is not None and self._prefix_on and seq.cache_epoch == self._cache_epoch:
                self._snapshot_state(slot, seq)
        self._drop_pages(seq)
        heapq.heappush(self._free, slot)

    def _invalidate_prefix_cache(self) -> None:
        """Forget every cached prefix, and make running requests' K/V non-reusable (e.g. new weights)."""
        self._cache_epoch += 1
        if self._snapshots is not None:
            self._snapshots.clear()
        if self._pages.clear():
            self.stats.prefix_invalidations += 1

    def _finish(self, seq: ActiveRequest, reason: FinishReason | None, error: str | None = None,
                queued: bool = False, input_logprobs: list[tuple[float | None, int]] | None = None) -> None:
        routed = None
        if seq.request.return_routed_experts and seq.pages and error is None:
            # Every forwarded position, read before the pages go: the prompt and all output tokens but the last.
            n = seq.request.prompt.num_tokens + len(seq.output_ids) - 1
            routed = self.runner.routed_experts(seq.pages, n)
        if seq.slot is not None:
            if self._running.get(seq.slot) is seq:
                del self._running[seq.slot]
                self._release(seq.slot, seq, cache=error is None)
            seq.slot = None
        if reason is not None and reason.type is FinishType.ABORT:
            self.stats.aborted += 1
        self.stats.finished += 1
        out = GenerateOutput(
            rid=seq.rid,
            output_ids=list(seq.output_ids),
            output_logprobs=list(seq.output_logprobs),
            finish_reason=reason or FinishReason.aborted(error or "engine error"),
            prompt_tokens=seq.request.prompt.num_tokens,
            weight_version=self.weight_version,
            e2e_latency=time.monotonic() - seq.arrival,
            num_retractions=seq.num_retractions,
            cached_tokens=seq.cached_tokens,
            error=error,
            queued=queued,
            routed_experts=routed,
            input_logprobs=input_logprobs or [],
        )
        try:
            seq.on_finish(out)
        except Exception:  # a broken callback must not take the scheduler down
            logger.exception("on_finish callback of %s failed", seq.rid)

    def _abort_matching(self, rid: str | None, message: str) -> None:
        """Abort `rid` and every rid it prefixes (SGLang matches with startswith), or all (None). A request in a
        queue gets SGLang's queued-abort answer (no prompt_tokens); a running one the scheduler's FINISH_ABORT."""
        def matches(seq: ActiveRequest) -> bool:
            return rid is None or seq.rid.startswith(rid)

        for queue_ in (self._waiting, self._held):
            keep = deque()
            for seq in queue_:
                if matches(seq):
                    self._finish(seq, FinishReason.aborted(QUEUED_ABORT_MESSAGE), queued=True)
                else:
                    keep.append(seq)
            queue_.clear()
            queue_.extend(keep)
        for seq in list(self._running.values()):
            if matches(seq):
                self._finish(seq, FinishReason.aborted(message))

    def _fail_all(self, message: str) -> None:
        self._invalidate_prefix_cache()
        for seq in [*self._running.values(), *self._waiting, *self._held]:
            self._finish(seq, None, error=message)
        self._waiting.clear()
        self._held.clear()

    # ------------------------------------------------------------------ control

    def _pause(self, mode: PauseMode) -> dict[str, Any]:
        if mode is PauseMode.ABORT:
            self._abort_matching(None, "Abort by pause_generation")
        elif mode is PauseMode.RETRACT:
            for seq in sorted(self._running.values(), key=lambda r: r.slot, reverse=True):
                self._retract(seq)
        self._paused = mode
        return paused_answer()

    def _continue(self) -> dict[str, Any]:
        self._paused = None
        self._waiting.extend(self._held)
        self._held.clear()
        return continued_answer()

    def _flush(self) -> bool:
        """Drop the prefix cache and answer True when nothing is running or waiting (SGLang's rule:
        requests held by a pause are not the scheduler's yet); otherwise change nothing, False."""
        busy = len(self._running) + (0 if self._paused else len(self._waiting))
        if busy == 0:
            self._invalidate_prefix_cache()
        return busy == 0

    def _memory(self, release: bool, tags: tuple[str, ...] | None) -> str | None:
        """Release or resume the device memory of `tags` (SGLang's memory saver, for an engine colocated with the
        trainer). Releasing needs an idle engine (pause and flush first); requests that arrive meanwhile wait
        until both weights and KV cache are back. Answers None, or why nothing was released."""
        tags = frozenset(tags or MEMORY_TAGS)
        if not release:
            if "weights" in tags:
                self.runner.restore_params()
            if "kv_cache" in tags and self.runner.cache is None:
                self.runner.allocate_cache()
            return None
        busy = len(self._running) + len(self._waiting)
        if busy:
            return f"cannot release memory while {busy} requests run or wait (pause_generation and flush_cache first)"
        if "kv_cache" in tags:
            self._invalidate_prefix_cache()  # cached pages live in the memory being freed
            self.runner.release_cache()
        if "weights" in tags:
            self.runner.release_params()
        return None

    def _loads(self) -> dict[str, Any]:
        return {
            "paused": self._paused,
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": len(self._waiting) + len(self._held),
            "num_used_tokens": int(sum(s.request.prompt.num_tokens + len(s.output_ids) for s in self._running.values())),
            "max_total_num_tokens": self._pages.num_pages * self.page_size,
            # Page accounting (flat ints, so replicas add up): idle means no request holds a page, and after a
            # flush every page is free.
            "kv_pages_total": self._pages.num_pages,
            "kv_pages_free": self._pages.free_pages,
            "kv_pages_cached": self._pages.cached_pages,
            "kv_pages_held_by_requests": self._pages.request_held_pages(),
        }

    def _run_weight_updates(self) -> None:
        while self._updates:
            upd = self._updates[0]
            if not upd.update.abort_all_requests and self._running and not self._paused:
                return  # SGLang's writer lock: wait for in-flight generations to finish
            self._settle()
            if upd.update.abort_all_requests:
                self._abort_matching(None, "Abort by update_weights_from_disk(abort_all_requests=true)")
            self._updates.popleft()
            if upd.deadline is not None and time.monotonic() > upd.deadline:
                # The HTTP handler has answered 503 already: loading now would change weights behind its back.
                logger.warning("update_weights_from_disk(%s) dropped: its caller timed out before it could run",
                               upd.update.model_path)
                upd.reply(update_weights_answer(
                    False, f"Timed out before the update from {upd.update.model_path} could start; nothing was loaded", 0))
                continue
            upd.reply(self._load_weights(upd))

    def _load_weights(self, upd: UpdateWeightsMsg) -> dict[str, Any]:
        """Load new weights; any failure (a corrupt file, a MemoryError, a bug) is answered `success: false`
        with the old weights still serving and this thread alive."""
        paused = len(self._running) + len(self._waiting) + len(self._held)
        path = upd.update.model_path
        started = time.monotonic()
        try:
            if upd.update.load_format == IN_MEMORY_LOAD_FORMAT:
                if self._staged_weights is None:
                    raise ValueError("this engine takes in-memory weights only from a trainer in its own process")
                self.runner.set_params(self._staged_weights(path))
            else:
                self.runner.load_weights(path)
        except Exception as exc:  # noqa: BLE001 - the parameters are built off to the side: nothing changed
            logger.warning("update_weights_from_disk(%s) failed: %s: %s", path, type(exc).__name__, exc)
            return update_weights_answer(False, f"Failed to update weights from {path}: {type(exc).__name__}: {exc}", paused)
        # Cached K/V was computed by the old weights (a failed load above changed nothing).
        self._invalidate_prefix_cache()
        if upd.update.weight_version is not None:
            self.weight_version = upd.update.weight_version
        self.stats.weight_updates += 1
        return update_weights_answer(
            True, f"Succeeded to update model weights ({os.fspath(path)}, {time.monotonic() - started:.2f} s).", paused
        )

