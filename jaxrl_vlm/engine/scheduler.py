"""Continuous batching: one thread that admits, prefills, decodes and finishes requests.

Every loop iteration (1) applies the typed messages of its inbox (`inbox.py`: requests, aborts, control), (2) runs a
pending weight update once nothing is decoding, (3) admits waiting requests into free KV slots
(one prefill each, which samples their first token) and (4) runs ONE decode step for every active
slot. Requests therefore join and leave between decode steps. A decode batch holds only the running
slots (padded to a batch bucket), wherever they sit in the cache.

Prefix cache (`EngineOptions.prefix_cache`): a finished request leaves its slot *warm* (free, its K/V
kept, see `prefix_cache.py`). Admission finds the warm slot holding the longest reusable prefix of
the prompt (if at least `prefix_cache_min_tokens`) and prefills only the rest: in that slot when the
request continues its whole content, else after copying the prefix into an empty slot. Without a
match a request gets an empty slot, else the least recently used warm slot. Warm slots are dropped whenever their K/V may no
longer be what the serving weights compute: new weights, `/flush_cache`, a failed device program; a
request that was running across a weight update never leaves its slot warm.

Stop rules follow SGLang's `Req.check_finished`, in its order: abort, then `max_new_tokens`
(length), then stop token ids / EOS ids (unless `ignore_eos`), then stop strings on the detokenized
tail of the output.

All methods except the `submit` / `abort` / `call` / `stop` entry points run on the scheduler
thread; results leave through each request's `on_finish(GenerateOutput)` callback.
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
from jaxrl_vlm.engine.prefix_cache import ImageSpan, Match, PrefixCache, fit_start, image_spans
from jaxrl_vlm.engine.protocol import GenerateOutput, GenerateRequest
from jaxrl_vlm.engine.runner import FloatRow, IntRow, ModelRunner
from rollout.sglang_wire import (
    FinishReason,
    IN_MEMORY_LOAD_FORMAT,
    MEMORY_TAGS,
    FinishType,
    PauseMode,
    continued_answer,
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
    slot: int | None = None
    num_retractions: int = 0
    stop_ids: frozenset[int] = frozenset()
    max_new_tokens: int = 0
    stop_window: int = 0  # output tokens decoded to look for stop strings
    cached_tokens: int = 0  # tokens served from the prefix cache, summed over admissions (SGLang's count)
    cache_epoch: int = -1  # the scheduler's cache epoch when its K/V was computed

    @property
    def rid(self) -> str:
        return self.request.rid


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
    prefix_hits: int = 0  # admissions that reused a warm slot's prefix
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prefilled_tokens: int = 0  # prompt tokens computed by prefill / extend (padding not counted)
    encoded_images: int = 0  # images run through the vision tower
    prefix_copies: int = 0  # hits on a prefix shared with a warm slot that was copied, not taken
    prefix_evictions: int = 0  # warm slots given to a request that could not reuse them
    prefix_invalidations: int = 0  # times every warm slot was dropped (weights, flush, failures)


class Scheduler:
    """Owns the request queues and the slot table; drives a `ModelRunner` from its own thread."""

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
        self._rng = np.random.default_rng(runner.config.seed)
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._waiting: deque[ActiveRequest] = deque()
        self._held: deque[ActiveRequest] = deque()  # arrived while paused; not yet the scheduler's
        self._running: dict[int, ActiveRequest] = {}
        self._free: list[int] = list(range(self.max_batch))  # empty slots (a heap)
        heapq.heapify(self._free)
        self._prefix = PrefixCache()  # warm slots: free, with reusable K/V
        self._prefix_on = runner.config.prefix_cache
        self._cache_epoch = 0  # bumped whenever cached K/V stops matching the serving weights
        self._paused: PauseMode | None = None
        self._updates: deque[UpdateWeightsMsg] = deque()
        self._ints = np.zeros((len(IntRow), self.max_batch), np.int32)
        self._floats = np.zeros((len(FloatRow), self.max_batch), np.float32)
        self._filtered = np.zeros((self.max_batch,), bool)
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
                self._admit()
                if self._running and self._paused is not PauseMode.IN_PLACE:
                    self._decode_step()
        except BaseException as exc:  # the thread must not die silently: record it and fail everyone
            logger.exception("engine scheduler crashed")
            self.error = exc
            self._fail_all(f"engine scheduler crashed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._closed = True
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
        if self._running and self._paused is not PauseMode.IN_PLACE:
            return True
        if self._updates and (self._paused or not self._running):
            return True
        return (bool(self._waiting) and not self._paused and not self._updates and self.runner.resident
                and self._has_free_slot())

    def _has_free_slot(self) -> bool:
        return bool(self._free) or len(self._prefix) > 0

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
        if seq.max_new_tokens == 0:  # prefill only: SGLang answers at once with length 0
            self._finish(seq, FinishReason.at_length(0))
            return
        (self._held if self._paused else self._waiting).append(seq)

    def _admit(self) -> None:
        if self._paused or self._updates or not self.runner.resident:
            return
        admitted = 0
        while self._waiting and self._has_free_slot() and admitted < self.runner.config.max_prefills_per_step:
            seq = self._waiting.popleft()
            slot = None
            try:
                slot, start, source = self._take_slot(seq)
                self._prefill(seq, slot, start, source)
            except Exception as exc:  # a failed prefill fails that request, not the server
                logger.exception("prefill of %s failed", seq.rid)
                if slot is not None:
                    self._release(slot)
                # The cache was donated to the failed program: no warm slot can be trusted any more.
                self._invalidate_prefix_cache()
                self._finish(seq, None, error=f"prefill failed: {type(exc).__name__}: {exc}")
            admitted += 1

    def _take_slot(self, seq: ActiveRequest) -> tuple[int, int, int | None]:
        """(slot, tokens of cached K/V to reuse, slot to copy them from or None) for `seq`.

        The warm slot with the longest reusable prefix (at least `prefix_cache_min_tokens`) is taken
        when the request continues its whole content; when they only share a prefix, that prefix is
        copied into an empty slot (else into the least recently used warm one), so the warm slot keeps
        serving its own conversation. Without a match: an empty slot, else the least recently used
        warm slot. Needs `_has_free_slot()`; changes nothing if it raises.
        """
        match: Match | None = None
        if len(self._prefix):
            ids = self._cached_sequence(seq)
            images = self._images(seq)
            found = self._prefix.best(ids, images)
            if found is not None:
                cfg = self.runner.config
                reuse = fit_start(found.reuse, ids.shape[0], images, cfg.prefill_buckets, cfg.max_seq_len)
                if reuse >= cfg.prefix_cache_min_tokens:
                    match = found._replace(reuse=reuse)
        if match is not None and match.lost <= 1:  # the next turn of the slot's own conversation
            self._prefix.take(match.slot)
            return match.slot, match.reuse, None
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot = self._prefix.lru()
            assert slot is not None, "_take_slot needs a free slot"
            self._prefix.take(slot)
            if match is None or slot != match.slot:
                self.stats.prefix_evictions += 1
        if match is None:
            return slot, 0, None
        if slot == match.slot:  # the shared prefix sits in the slot about to be reused anyway
            return slot, match.reuse, None
        self._prefix.touch(match.slot)
        return slot, match.reuse, match.slot

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
            cfg = self.runner.cfg
            prompt.images = image_spans(prompt.input_ids, prompt.pixel_values, prompt.image_grid_thw,
                                        cfg.image_token_id, cfg.vision.spatial_merge_size)
        return prompt.images

    def _prefill(self, seq: ActiveRequest, slot: int, start: int = 0, source: int | None = None) -> None:
        """Admit `seq` into `slot`: reuse the K/V of its first `start` tokens (copied from warm slot
        `source` first, or already in `slot`), prefill the rest and sample its first token."""
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
        bias_row = None
        if params.logit_bias:
            bias_row = np.zeros((self.runner.vocab_size,), np.float32)
            for token, value in params.logit_bias:
                bias_row[token] += value
        if source is not None:
            self.runner.copy_prefix(source, slot, start)
            self.stats.prefix_copies += 1
        token, logprob = self.runner.prefill(
            slot, ids, positions, prompt.pixel_values, prompt.image_grid_thw, bias_row,
            self._ints[:, slot], self._floats[:, slot], start=start,
        )
        self.stats.prefills += 1
        self.stats.prefix_hits += int(start > 0)
        self.stats.cached_tokens += start
        self.stats.prefilled_tokens += ids.shape[0] - start
        self.stats.encoded_images = self.runner.encoded_images
        seq.cached_tokens += start
        seq.cache_epoch = self._cache_epoch
        seq.slot = slot
        self._running[slot] = seq
        if resumed:
            self._set_next(seq, seq.output_ids[-1])
        else:
            self._append(seq, token, logprob)

    def _decode_step(self) -> None:
        slots = sorted(self._running)
        try:
            ids, lps = self.runner.decode(
                np.asarray(slots, np.int32), self._ints[:, slots], self._floats[:, slots], bool(self._filtered[slots].any())
            )
        except Exception as exc:
            logger.exception("decode step failed")
            self._invalidate_prefix_cache()  # the donated cache cannot be trusted
            for slot in slots:
                seq = self._running.pop(slot)
                self._release(slot)
                self._finish(seq, None, error=f"decode failed: {type(exc).__name__}: {exc}")
            return
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(slots)
        self.stats.max_decode_rows = max(self.stats.max_decode_rows, len(slots))
        for row, slot in enumerate(slots):
            self._append(self._running[slot], int(ids[row]), float(lps[row]))

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

    # ------------------------------------------------------------------ finishing

    def _release(self, slot: int, seq: ActiveRequest | None = None) -> None:
        """Free `slot`. With `seq` (the request that ran there, its K/V intact) and the prefix cache
        on, the slot stays warm, unless the weights changed since its K/V was computed."""
        self._ints[:, slot] = 0
        self._floats[:, slot] = 0.0
        self._filtered[slot] = False
        ids = None
        if seq is not None and self._prefix_on and seq.cache_epoch == self._cache_epoch:
            ids = self._cached_sequence(seq)
        if ids is not None and ids.shape[0] >= self.runner.config.prefix_cache_min_tokens:  # else never reusable
            self._prefix.put(slot, ids, self._images(seq))
        else:
            heapq.heappush(self._free, slot)

    def _invalidate_prefix_cache(self) -> None:
        """Forget every warm slot, and make running requests' K/V non-reusable (e.g. new weights)."""
        self._cache_epoch += 1
        dropped = self._prefix.clear()
        if dropped:
            self.stats.prefix_invalidations += 1
        for slot in dropped:
            heapq.heappush(self._free, slot)

    def _finish(self, seq: ActiveRequest, reason: FinishReason | None, error: str | None = None) -> None:
        if seq.slot is not None:
            if self._running.get(seq.slot) is seq:
                del self._running[seq.slot]
                self._release(seq.slot, seq if error is None else None)
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
        )
        try:
            seq.on_finish(out)
        except Exception:  # a broken callback must not take the scheduler down
            logger.exception("on_finish callback of %s failed", seq.rid)

    def _abort_matching(self, rid: str | None, message: str) -> None:
        for queue_ in (self._waiting, self._held):
            keep = deque()
            for seq in queue_:
                if rid is None or seq.rid == rid:
                    self._finish(seq, FinishReason.aborted(message))
                else:
                    keep.append(seq)
            queue_.clear()
            queue_.extend(keep)
        for seq in list(self._running.values()):
            if rid is None or seq.rid == rid:
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
            for slot in sorted(self._running, reverse=True):
                seq = self._running.pop(slot)
                self._release(slot, seq)  # warm: its own readmission usually gets the slot back
                seq.slot = None
                seq.num_retractions += 1
                self._waiting.appendleft(seq)
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
            self._invalidate_prefix_cache()  # warm slots live in the cache being freed
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
            "max_total_num_tokens": self.max_batch * self.max_seq_len,
        }

    def _run_weight_updates(self) -> None:
        while self._updates:
            upd = self._updates[0]
            if upd.update.abort_all_requests:
                self._abort_matching(None, "Abort by update_weights_from_disk(abort_all_requests=true)")
            elif self._running and not self._paused:
                return  # SGLang's writer lock: wait for in-flight generations to finish
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

