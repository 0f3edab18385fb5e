"""Device side of the engine: parameters, decode cache (paged KV), logit-bias rows and the compiled programs.

`ModelRunner` owns every device array and is driven by one thread (the scheduler's). It pads host
inputs (tokens, page tables) to the buckets of `EngineOptions`, calls one jitted program per step
(prefill+sample for a run of prompts, or decode+sample for a batch of requests) and returns plain numpy
results; a decode step may also be dispatched and read later (`dispatch_decode`, `dispatch_following`,
`collect_decode`), so the scheduler overlaps its host work with the device's step. Which pages a request uses is the scheduler's business (`prefix_cache.PageCache`).
Parameters are an `nnx.State` passed as an argument, so new weights swap in without recompiling; the programs take
its leaves as a flat list, flattened once per weight swap (flattening the state on every call cost more host time
than the tiny programs themselves).

Prefill and extend (a prefill after a reused prefix) are one program per (prompt bucket, kv-length bucket): a cold
prefill attends to the kv-length bucket of its prompt, as an extend does, so the warm-up's cold prefill compiles the
program that every later prefix hit of the same prompt runs (two programs there made the first repeat of a request
compile, issue 48). The copy of a partly shared last page runs inside that program, and the text-only prompts
admitted together run in one call (a loop over their rows on the device, so padding rows cost nothing).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_vlm.device_lock import exclusive
from jaxrl_vlm.engine import forward
from jaxrl_vlm.engine.background_compile import BackgroundCompiler
from jaxrl_vlm.engine.clips import ClipInputs, clips_after
from jaxrl_vlm.engine.options import EngineOptions, bucket_for
from jaxrl_vlm.engine.prefix_cache import items_wholly_before
from jaxrl_vlm.engine.placement import ReplicaPlacement
from jaxrl_vlm.engine.sampling import SamplingRows, sample_tokens
from jaxrl_vlm.engine.weights import leaf_paths, load_params_state, param_arrays, place_weights
from jaxrl_vlm.models.activation_sharding import activation_sharding
from jaxrl_vlm.models.config import ModelConfig
from jaxrl_vlm.models.families import DecodeCache, PolicyModel
from jaxrl_vlm.models.layers import token_logprobs
from jaxrl_vlm.models.vision import VisionInputs, build_vision_inputs

class IntRow(enum.IntEnum):
    """Rows of the packed int32 per-slot array (one host->device transfer per step); seeds travel as int32
    bit patterns."""

    TOKEN = 0
    LENGTH = 1
    ROPE_DELTA = 2
    TOP_K = 3
    STEP = 4
    SEED = 5


class FloatRow(enum.IntEnum):
    """Rows of the packed float32 per-slot array."""

    TEMPERATURE = 0
    TOP_P = 1
    MIN_P = 2


@dataclass
class DecodeStep:
    """A decode step dispatched and not yet collected (`ModelRunner.dispatch_decode`): `ints` are its rows' columns
    as it ran them, `ids` / `lps` its sampled tokens and log-probs [batch] still on the device; `hold` keeps its
    devices (`exclusive`) until `collect_decode`."""

    n: int
    batch: int
    ints: np.ndarray
    ids: jax.Array
    lps: jax.Array
    hold: contextlib.ExitStack


def _rows(ints: jax.Array, floats: jax.Array) -> SamplingRows:
    """Sampling parameters from the packed arrays."""
    return SamplingRows(
        temperature=floats[FloatRow.TEMPERATURE],
        top_p=floats[FloatRow.TOP_P],
        top_k=ints[IntRow.TOP_K],
        min_p=floats[FloatRow.MIN_P],
        seed=jax.lax.bitcast_convert_type(ints[IntRow.SEED], jnp.uint32),
        step=ints[IntRow.STEP],
    )


def images_after(
    input_ids: np.ndarray, start: int, pixel_values: np.ndarray | None, image_grid_thw: np.ndarray | None, cfg: ModelConfig
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """pixel_values / image_grid_thw of the images whose pad tokens lie in input_ids[start:], or
    (None, None). An image cut by `start` is an error: its merged tokens cannot be split."""
    if pixel_values is None or image_grid_thw is None or len(image_grid_thw) == 0:
        return None, None
    grid = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
    if start == 0:
        return pixel_values, grid
    done = items_wholly_before(input_ids, start, grid, cfg.image_token_id, cfg.vision.merge_unit, "image")
    if done == len(grid):
        return None, None
    first_patch = int(grid[:done].prod(-1).sum())
    return pixel_values[first_patch:], grid[done:]


@dataclass(frozen=True)
class PrefillRow:
    """One request's prompt for `ModelRunner.prefill_rows`.

    input_ids [L] (image pads expanded), positions int32 [3, L]; the request's page table `pages` (at least
    ceil(L / page_size) pages) and `slot` (its bias and state row). `start` > 0: positions [0, start) of the pages
    hold a reused prefix (whose images lie wholly inside it) and only [start, L) is computed. `copy` (src, dst):
    page src is copied into page dst first (the partly shared last page of that prefix). `logit_bias`: (token id,
    value) pairs, added up per id. ints int32 [6] / floats float32 [3]: the slot's column of `IntRow` / `FloatRow`.
    `clips`: the prompt's clips (None without), whose pads, like the images', lie wholly inside or after the prefix.
    """

    slot: int
    pages: Sequence[int]
    input_ids: np.ndarray
    positions: np.ndarray
    pixel_values: np.ndarray | None
    image_grid_thw: np.ndarray | None
    ints: np.ndarray
    floats: np.ndarray
    start: int = 0
    copy: tuple[int, int] | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    clips: ClipInputs | None = None


# Most prompt tokens (padded) of one multi-row prefill call: its rows are a function of the prompt bucket alone, so
# the number of requests admitted together never picks a new program.
PREFILL_CALL_TOKENS = 8192
MIN_BIAS_ENTRIES = 8  # smallest bucket of logit_bias entries per row (then doubling)
# A decode bucket that borrowed a larger compiled program in FALLBACK_STEPS of the last FALLBACK_WINDOW decode steps
# gets its own, compiled in the background (`_decode_buckets`): a bucket needed that often is part of the workload,
# not a passing ramp; one needed more rarely costs the larger program's time on a few steps only.
FALLBACK_STEPS = 32
FALLBACK_WINDOW = 1024
# The same for a prefill's buckets (`_prefill_buckets`), counted in prefills: a prompt shape that came 4 times in the
# last 256 prefills (a conversation's kv bucket that the rollout's episodes keep reaching) gets its own program.
PREFILL_FALLBACK_CALLS = 4
PREFILL_FALLBACK_WINDOW = 256


def in_steady_use(borrowed: collections.deque[int], now: int, calls: int, window: int) -> bool:
    """Record a call at clock `now` in `borrowed` (the clocks of a key's borrowing calls, oldest first, pruned here
    to the last `window`); true once `calls` of them lie in it."""
    borrowed.append(now)
    while borrowed[0] <= now - window:
        borrowed.popleft()
    return len(borrowed) >= calls


@dataclass
class _PreparedPrefill:
    """A `PrefillRow` padded on the host: tokens [T], positions [3, T], table [W], vision (None for text)."""

    row: PrefillRow
    key: tuple[int, int, int | None]  # (prompt bucket T, kv-length bucket, patch bucket or None)
    length: int
    tokens: np.ndarray
    positions: np.ndarray
    table: np.ndarray
    vision: VisionInputs | None
    images: int  # images and clips the vision tower encodes for it


SCORE_CHUNK = 512  # sequence chunk of the scoring forward's fp32 logits (the trainer's default --logprob-chunk-size)


class ModelRunner:
    """Compiled prefill/decode over a paged KV cache for one model on one replica's devices.

    `placement`: the replica's mesh (tensor parallel over its devices; default: the first local device).
    Parameters and the KV cache (pages split by kv heads) are sharded on it, and every program's outputs keep
    those shardings.

    A running request has a *slot*: its row in the per-request arrays (logit bias here, sampling
    parameters in the scheduler), in [0, max_batch). Its K/V lives in the pages of its page table.
    `banned_ids`: token ids that can never be sampled (Qwen-VL's vision special tokens).
    `program_calls` counts calls per compiled-program key: ("prefill", bucket, patch_bucket),
    ("extend", bucket, kv_len, patch_bucket), ("copy_page",), ("copy_state",), ("decode", batch, kv_len, filtered).
    """

    def __init__(self, model: PolicyModel, config: EngineOptions, banned_ids: Sequence[int],
                 placement: ReplicaPlacement | None = None):
        self.cfg = model.cfg
        self.config = config
        self.vocab_size = model.cfg.text.vocab_size
        self.placement = placement or ReplicaPlacement(jax.local_devices()[:1])
        self._graphdef, params = nnx.split(model)
        self._param_def: Any = None
        self._param_leaves: list[Any] = []
        self.params = self.placement.put_params(params)
        self._params_backup: Any = None  # host copy of released weights
        self.cache: DecodeCache | None = None
        # State rows (a family with recurrent state): the running slots, then the prefix cache's snapshots.
        new_cache = functools.partial(forward.init_cache, model.cfg, config.num_pages, config.page_size,
                                      config.max_batch + config.state_snapshots, config.jnp_compute_dtype)
        abstract_cache = jax.eval_shape(new_cache)
        # Rows of recurrent state past the slots: the snapshots the prefix cache keeps (none without such state).
        self.stateful = abstract_cache.state_rows > 0
        # A mixture-of-experts family's cache keeps each position's routed experts by page (return_routed_experts).
        self.records_experts = hasattr(abstract_cache, "routed_experts")
        self.snapshot_rows = max(0, abstract_cache.state_rows - config.max_batch)
        # Each array of the family's cache in the sharding its logical axes say (pages split by kv heads).
        self._cache_sharding = self.placement.cache(abstract_cache)
        # Compiled once: a colocated engine re-creates its cache after every train step.
        self._new_cache = jax.jit(new_cache, out_shardings=self._cache_sharding)
        self.allocate_cache()
        replicated = self.placement.replicated
        self.bias = jax.device_put(jnp.zeros((config.max_batch, self.vocab_size), jnp.float32), replicated)
        cache_sh = self._cache_sharding
        banned = np.zeros((self.vocab_size,), bool)
        for t in banned_ids:
            if not 0 <= int(t) < self.vocab_size:
                raise ValueError(f"banned token id {t} is outside the vocabulary [0, {self.vocab_size})")
            banned[int(t)] = True
        self.banned_ids = tuple(int(t) for t in np.flatnonzero(banned))
        banned_v = jnp.asarray(banned)
        graphdef = self._graphdef
        layout = self.placement.activations  # None but with expert parallelism (--ep-size)

        vocab = self.vocab_size

        def prefill_program(leaves, cache, bias, n, slots, tables, starts, tokens, positions, lengths, copies,
                            bias_ids, bias_vals, ints, floats, vision, *, group):
            # Groups [0, n) of `group` rows of R, in order (a later group may reuse pages an earlier one wrote): each
            # row copies its shared page (src == dst: none), then the group's rows prefill side by side (one row:
            # `forward.prefill`; several: `forward.prefill_rows`, text only); groups past n are never run.
            model = nnx.merge(graphdef, jax.tree.unflatten(self._param_def, leaves))
            rows = slots.shape[0]

            def one(i, carry):
                cache, logits = carry
                cache = cache.copy_page(copies[0, i], copies[1, i])
                with activation_sharding(layout):
                    cache, row_logits = forward.prefill(model, cache, slots[i], tables[i], starts[i], tokens[i],
                                                        positions[i], lengths[i], vision)
                return cache, logits.at[i].set(row_logits.astype(jnp.float32))

            def side_by_side(g, carry):
                cache, logits = carry
                lo = g * group
                for j in range(group):
                    cache = cache.copy_page(copies[0, lo + j], copies[1, lo + j])
                part = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=lo, slice_size=group)
                with activation_sharding(layout):
                    cache, rows_logits = forward.prefill_rows(
                        model, cache, part(tables), part(starts), part(tokens)[:, 0],
                        jnp.moveaxis(part(positions)[:, :, 0], 0, 1), part(lengths))
                return cache, jax.lax.dynamic_update_slice_in_dim(logits, rows_logits.astype(jnp.float32), lo, 0)

            carry = (cache, jnp.zeros((rows, vocab), jnp.float32))
            if vision is not None:
                cache, logits = one(0, carry)
            else:
                cache, logits = jax.lax.fori_loop(0, n, one if group == 1 else side_by_side, carry)
            bias_rows = jnp.zeros((rows, vocab), jnp.float32).at[jnp.arange(rows)[:, None], bias_ids].add(
                bias_vals, mode="drop")
            bias = bias.at[slots].set(bias_rows, mode="drop")  # padding rows name slot max_batch: dropped
            # Always the filtered sampler: sorting a few rows is cheap next to a prefill, and it halves the programs.
            ids, lps = sample_tokens(logits, bias_rows, banned_v, _rows(ints, floats), filtered=True)
            return cache, bias, ids, lps

        def decode_program(leaves, cache, bias, slots, tables, ints, floats, tokens, *, filtered):
            # `tokens` [b] apart from `ints`: an overlapped step takes the previous step's ids where they lie.
            model = nnx.merge(graphdef, jax.tree.unflatten(self._param_def, leaves))
            with activation_sharding(layout):
                cache, logits = forward.decode(model, cache, slots, tables, tokens, ints[IntRow.LENGTH],
                                               ints[IntRow.ROPE_DELTA])
            ids, lps = sample_tokens(logits, bias[slots], banned_v, _rows(ints, floats), filtered=filtered)
            return cache, ids, lps

        def score_program(leaves, tokens, positions, segment_ids, vision, targets, *, temperature):
            # The trainer's forward (`rl/train_step.policy_logprobs`): no cache, every position's log-prob.
            model = nnx.merge(graphdef, jax.tree.unflatten(self._param_def, leaves))
            with activation_sharding(layout):
                hidden = model(tokens, positions, segment_ids, vision)
                lp, _ = token_logprobs(model, hidden, targets, chunk_size=SCORE_CHUNK,
                                       temperature=temperature)
            return lp[0]

        self._score = jax.jit(score_program, static_argnames=("temperature",), out_shardings=replicated)
        # Explicit output shardings: the cache and bias stay where they live, step after step (no resharding).
        self._prefill = jax.jit(prefill_program, donate_argnames=("cache", "bias"), static_argnames=("group",),
                                out_shardings=(cache_sh, replicated, replicated, replicated))
        # Tokens of text prompts a prefill runs side by side (`prefill_batch_tokens`; None: by the devices' kind).
        batch_tokens = config.prefill_batch_tokens
        if batch_tokens is None:
            batch_tokens = 256 if self.placement.devices[0].platform in ("gpu", "tpu") else 0
        self.prefill_batch_tokens = batch_tokens if forward.prefills_rows(model.cfg) and not self.stateful else 0
        self._decode = jax.jit(decode_program, static_argnames=("filtered",), donate_argnames=("cache",),
                               out_shardings=(cache_sh, replicated, replicated))
        self._replicated = replicated
        self._copy_page = jax.jit(forward.copy_page, donate_argnames=("cache",), out_shardings=cache_sh)
        self._copy_state = jax.jit(forward.copy_state, donate_argnames=("cache",), out_shardings=cache_sh)
        self.program_calls: collections.Counter[tuple[Any, ...]] = collections.Counter()
        self.programs: set[tuple[Any, ...]] = set()  # the compiled programs' keys (several call kinds share one)
        self.side_programs: set[tuple[Any, ...]] = set()  # those of `programs` compiled on the side thread
        self._decode_steps = 0  # decode steps dispatched (`_decode_buckets`' clock)
        self._prefills = 0  # prefills prepared (`_prefill_buckets`' clock)
        # A program key of buckets that borrow -> the clocks it borrowed at, within the last window (`in_steady_use`)
        self._borrowed: dict[tuple[Any, ...], collections.deque[int]] = {}
        self.background = BackgroundCompiler()  # buckets in steady use, compiled while others serve
        # Seconds inside program calls (dispatch until the results are on the host), for the host share of a step.
        self.decode_program_s = 0.0
        self.prefill_program_s = 0.0
        self.encoded_images = 0  # images run through the vision tower (a reused prefix skips its images)

    # ------------------------------------------------------------------ parameters

    @property
    def params(self) -> Any:
        """The served parameters (an `nnx.State`; shapes only while released)."""
        return self._params

    @params.setter
    def params(self, state: Any) -> None:
        # Flattened once here, not by every program call (nnx flattens each Variable in Python).
        self._params = state
        self._param_leaves, self._param_def = jax.tree.flatten(state)

    # ------------------------------------------------------------------ memory

    def allocate_cache(self) -> None:
        """(Re)create the KV cache, zeroed, in its shardings (created on the devices, never on the host)."""
        self.cache = self._new_cache()

    def release_cache(self) -> None:
        """Drop the KV cache (`/release_memory_occupation` kv_cache): its device memory is freed with its last
        reference (never deleted explicitly: a buffer XLA shares with another array must outlive this one);
        `allocate_cache` makes a new one."""
        self.cache = None

    def release_params(self) -> None:
        """Drop the weights' device arrays (`/release_memory_occupation` weights), keeping a host copy; `params`
        holds their shapes, dtypes and shardings meanwhile, so a weight update can still load into them."""
        if self._params_backup is None:
            self._params_backup = jax.device_get(self.params)
            self.params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.params)

    def restore_params(self) -> None:
        """Weights back on their devices: the host copy, unless new weights were loaded since the release."""
        if self._params_backup is not None:
            self.params = jax.device_put(self._params_backup, self.placement.params(self.params))
            self._params_backup = None

    @property
    def weights_released(self) -> bool:
        """The weights are a host copy (`release_params`), not on the devices."""
        return self._params_backup is not None

    @property
    def held_params(self) -> Any:
        """The weights this replica holds: its device arrays, or their host copy while released."""
        return self.params if self._params_backup is None else self._params_backup

    @property
    def resident(self) -> bool:
        """Weights and KV cache are on the devices (nothing released): programs may run."""
        return self.cache is not None and self._params_backup is None

    # ------------------------------------------------------------------ programs

    @property
    def num_programs(self) -> int:
        """Distinct compiled programs so far (one per bucket key; a prefill and an extend of the same buckets share
        one)."""
        return len(self.programs)

    def _call(self, kind: tuple[Any, ...], program: tuple[Any, ...]) -> None:
        """Count a call of kind `kind` (`program_calls`) running compiled program `program`."""
        self.program_calls[kind] += 1
        self.programs.add(program)

    def _table_width(self, kv_len: int) -> int:
        """Page-table entries covering a kv-length bucket."""
        return -(-kv_len // self.config.page_size)

    def _padded_tables(self, tables: np.ndarray, rows: int, width: int) -> np.ndarray:
        """int32 [rows, width]: page tables [n, >= width] cut to `width` entries, then rows of `num_pages`
        only (no page: writes dropped, reads masked)."""
        out = np.full((rows, width), self.config.num_pages, np.int32)
        n, w = tables.shape[0], min(tables.shape[1], width)
        out[:n, :w] = tables[:, :w]
        return out

    def prefill_rows_per_call(self, prompt_bucket: int) -> int:
        """Rows R of the text-only prefill program of `prompt_bucket` tokens: R x bucket <= PREFILL_CALL_TOKENS, at
        most max_batch and max_prefills_per_step (a function of the bucket alone: no program per admission count)."""
        return max(1, min(self.config.max_batch, self.config.max_prefills_per_step, PREFILL_CALL_TOKENS // prompt_bucket))

    def prefill_group(self, prompt_bucket: int) -> int:
        """Rows of a text prefill of `prompt_bucket` tokens that run side by side in one forward: prefill_batch_tokens
        // bucket, at most a call's rows (`prefill_rows_per_call`), at least 1."""
        return max(1, min(self.prefill_rows_per_call(prompt_bucket), self.prefill_batch_tokens // prompt_bucket))

    def prefill(
        self,
        slot: int,
        pages: Sequence[int],
        input_ids: np.ndarray,
        positions: np.ndarray,
        pixel_values: np.ndarray | None,
        image_grid_thw: np.ndarray | None,
        bias_row: np.ndarray | None,
        ints: np.ndarray,
        floats: np.ndarray,
        *,
        start: int = 0,
        copy: tuple[int, int] | None = None,
        clips: ClipInputs | None = None,
    ) -> tuple[int, float]:
        """Prefill `input_ids` [L] (positions [3, L]) into the request's `pages` and sample its next token; one
        `PrefillRow` (see there and `prefill_rows`). bias_row float32 [V] or None (no bias).
        Returns (token id, its log-prob)."""
        bias: tuple[tuple[int, float], ...] = ()
        if bias_row is not None:
            nonzero = np.flatnonzero(bias_row)
            bias = tuple(zip(nonzero.tolist(), np.asarray(bias_row, np.float32)[nonzero].tolist()))
        row = PrefillRow(slot, pages, input_ids, positions, pixel_values, image_grid_thw, ints, floats, start=start,
                         copy=copy, logit_bias=bias, clips=clips)
        return self.prefill_rows([self.prepare_prefill(row)])[0]

    def prepare_prefill(self, row: PrefillRow) -> _PreparedPrefill:
        """Pad one request's prompt to its buckets on the host (and build its vision inputs); a ValueError names
        what does not fit. Nothing runs on the device. Buckets with no compiled program borrow a larger one's
        (`_prefill_buckets`)."""
        total = int(row.input_ids.shape[0])
        start = row.start
        if not 0 <= start < total:
            raise ValueError(f"prefill start={start} must lie in [0, {total}) (the last prompt token is always computed)")
        if len(row.pages) * self.config.page_size < total:
            raise ValueError(f"{len(row.pages)} pages of {self.config.page_size} tokens cannot hold a prompt of {total} tokens")
        for token, _ in row.logit_bias:
            if not 0 <= int(token) < self.vocab_size:
                raise ValueError(f"logit_bias token id {token} is outside the vocabulary [0, {self.vocab_size})")
        self._prefills += 1
        t = bucket_for(total - start, self.config.prefill_buckets, "prompt tokens")
        # A cold prefill attends to its prompt's kv bucket too: it then shares the extend's program (see the module).
        kv_len = bucket_for(total, self.config.kv_buckets, "cached tokens")
        pixel_values, image_grid_thw = images_after(row.input_ids, start, row.pixel_values, row.image_grid_thw,
                                                    self.cfg)
        clips = clips_after(row.input_ids, start, row.clips, self.cfg)
        own = (t, kv_len, self._patch_bucket(pixel_values, clips))
        buckets = self._prefill_buckets(own)
        if buckets != own and self._prefill_in_steady_use(own) and self.background.can_start(self._prefill_key(own)):
            # The program of these buckets without a logit bias (the key `_prefill_buckets` looks for): a row with
            # more bias entries than MIN_BIAS_ENTRIES runs a program of its own anyway.
            plain = dataclasses.replace(row, logit_bias=())
            prepared = self._pad_prefill(plain, own, pixel_values, image_grid_thw, clips)
            self.background.start(self._prefill_key(own), self._prefill_compiler(prepared))
        return self._pad_prefill(row, buckets, pixel_values, image_grid_thw, clips)

    def _pad_prefill(self, row: PrefillRow, buckets: tuple[int, int, int | None], pixel_values: np.ndarray | None,
                     image_grid_thw: np.ndarray | None, clips: ClipInputs | None) -> _PreparedPrefill:
        """`row` padded to `buckets` (prompt, kv length, patches): its tokens [T], positions [3, T], table [W] and
        vision inputs; `pixel_values`, `image_grid_thw` and `clips` are those of its tokens after `row.start`."""
        t, kv_len, patch_bucket = buckets
        start, length = row.start, int(row.input_ids.shape[0]) - row.start
        table = self._padded_tables(np.asarray(row.pages, np.int32)[None], 1, self._table_width(kv_len))[0]
        tokens = np.zeros((t,), np.int32)
        tokens[:length] = row.input_ids[start:]
        pos = np.zeros((3, t), np.int32)
        pos[:, :length] = row.positions[:, start:]
        valid = np.zeros((1, t), bool)
        valid[0, :length] = True
        vision = self._vision(pixel_values, image_grid_thw, clips, tokens[None], valid, patch_bucket)
        images = (0 if image_grid_thw is None else len(image_grid_thw)) + (0 if clips is None else len(clips))
        return _PreparedPrefill(row, buckets, length, tokens, pos, table, vision, images)

    def _prefill_shape(self, t: int, images: bool) -> tuple[int, int]:
        """(rows, rows side by side) of the prefill program of prompt bucket `t`: a prompt with images runs alone."""
        if images:
            return 1, 1
        cap, group = self.prefill_rows_per_call(t), self.prefill_group(t)
        return cap - cap % group, group

    def _prefill_key(self, buckets: tuple[int, int, int | None],
                     bias_entries: int = MIN_BIAS_ENTRIES) -> tuple[Any, ...]:
        """The program key of a prefill call of these buckets (`_prefill_call`)."""
        t, kv_len, patch_bucket = buckets
        width, group = self._prefill_shape(t, patch_bucket is not None)
        return ("prefill", width, t, kv_len, patch_bucket, bias_entries, group)

    def _prefill_buckets(self, own: tuple[int, int, int | None]) -> tuple[int, int, int | None]:
        """The buckets a prefill of buckets `own` (prompt, kv length, patches or None) runs in: its own when their
        program is compiled or none covers them; else the cheapest compiled program's that does (a longer prompt,
        kv span or patch bucket, text with text and images with images: padding tokens write nowhere a request
        reads, keys past each row's length are masked, padding patches feed no token). A compilation on the
        scheduler's thread stalls every running request, so a shape first needed mid-run (a long conversation's
        kv bucket, a larger picture) borrows; once it is in steady use (`_prefill_in_steady_use`) its own program
        compiles on the side thread (`prepare_prefill`)."""
        self._adopt_ready()
        programs = [key for key in self.programs if key[0] == "prefill" and key[5] == MIN_BIAS_ENTRIES]
        if self._prefill_key(own) in programs:
            return own
        t, kv_len, patch_bucket = own
        covering = [key[2:5] for key in programs
                    if (key[4] is None) == (patch_bucket is None) and key[2] >= t and key[3] >= kv_len
                    and (patch_bucket is None or key[4] >= patch_bucket) and key == self._prefill_key(key[2:5])]
        return min(covering, key=lambda b: (b[0], b[2] or 0, b[1]), default=own)

    def _prefill_in_steady_use(self, own: tuple[int, int, int | None]) -> bool:
        """Count one prefill that borrows for buckets `own`; true once they borrowed in PREFILL_FALLBACK_CALLS of the
        last PREFILL_FALLBACK_WINDOW prefills."""
        return in_steady_use(self._borrowed.setdefault(("prefill", *own), collections.deque()), self._prefills,
                             PREFILL_FALLBACK_CALLS, PREFILL_FALLBACK_WINDOW)

    def _adopt_ready(self) -> None:
        """Programs the side thread compiled since the last call join `programs` (the next call of their shapes runs
        them: jax's jit cache holds them)."""
        ready = self.background.take_ready()
        self.side_programs.update(ready)  # first: `server.compiled_programs` reads `programs` first
        self.programs.update(ready)

    def _patch_bucket(self, pixel_values: np.ndarray | None, clips: ClipInputs | None) -> int | None:
        """The patch bucket of these pictures' and clips' patches together, None for text."""
        if pixel_values is None and clips is None:
            return None
        patches = (0 if pixel_values is None else int(pixel_values.shape[0])) + (0 if clips is None else clips.patches)
        return self.config.patch_bucket(patches)

    def _vision(self, pixel_values: np.ndarray | None, image_grid_thw: np.ndarray | None, clips: ClipInputs | None,
                tokens: np.ndarray, valid: np.ndarray, patch_bucket: int | None) -> VisionInputs | None:
        """The vision inputs of [1, T] `tokens`, their pictures' and clips' patches padded to `patch_bucket`, or None
        for text."""
        if pixel_values is None and clips is None:
            return None
        if pixel_values is None:
            pixel_values = np.zeros((0, self.cfg.vision.patch_dim), np.float32)
            image_grid_thw = np.zeros((0, 3), np.int64)
        vision = build_vision_inputs(
            pixel_values, image_grid_thw, tokens, self.cfg, patch_bucket=patch_bucket, token_valid=valid,
            pixel_values_videos=None if clips is None else clips.pixel_values_videos,
            video_grid_thw=None if clips is None else clips.video_grid_thw)
        return type(vision)(*(None if a is None else np.asarray(a) for a in vision))

    def prefill_rows(self, prepared: Sequence[_PreparedPrefill]) -> list[tuple[int, float]]:
        """Run prepared prompts (`prepare_prefill`) in order and sample each one's next token; returns (token id,
        log-prob) per row. Consecutive text-only rows of the same buckets share one program call (up to
        `prefill_rows_per_call` rows); a prompt with images runs alone. One device->host transfer per call."""
        out: list[tuple[int, float]] = []
        i = 0
        while i < len(prepared):
            key = prepared[i].key
            if key[2] is not None:  # a prompt with images runs alone
                out.extend(self._prefill_call([prepared[i]], 1, 1))
                i += 1
                continue
            width, group = self._prefill_shape(key[0], images=False)
            j = i + 1
            while j < len(prepared) and prepared[j].key == key:
                j += 1
            run = prepared[i:j]
            layout = self._side_by_side(run, group)
            results: list[tuple[int, float]] = [(0, 0.0)] * len(run)
            for lo in range(0, len(layout), width):
                piece = layout[lo: lo + width]
                done = self._prefill_call([None if k is None else run[k] for k in piece], width, group)
                for k, result in zip((k for k in piece if k is not None), done):
                    results[k] = result
            out.extend(results)
            i = j
        return out

    def _side_by_side(self, rows: Sequence[_PreparedPrefill], group: int) -> list[int | None]:
        """The order in which `rows` run: indices into `rows` in groups of `group` that run side by side, one group
        after another, None for a padding row. Each row goes to the first group with room that comes after every
        group holding an earlier row that writes a page it reads (a GRPO group's samples read the prompt its first
        sample prefills) or that reads or writes a page it writes, so every page is read as in `rows`' order; the
        first samples of several GRPO groups admitted together thus share a forward, and their other samples fill
        the next ones. One row per group: `rows` in order."""
        if group == 1:
            return list(range(len(rows)))
        ps, none = self.config.page_size, self.config.num_pages
        groups: list[list[int]] = []
        last_write: dict[int, int] = {}  # page -> the last group with a row that writes it
        last_read: dict[int, int] = {}  # page -> the last group with a row that reads it
        for k, p in enumerate(rows):
            start, end = p.row.start, p.row.start + p.key[0]  # padding tokens write too, into the row's own pages
            reads = set(p.table[: -(-start // ps)].tolist()) | ({p.row.copy[0]} if p.row.copy is not None else set())
            writes = set(p.table[start // ps: -(-end // ps)].tolist()) - {none}
            after = [last_write.get(page, -1) for page in reads | writes] + [last_read.get(page, -1) for page in writes]
            g = 1 + max(after, default=-1)
            while g < len(groups) and len(groups[g]) == group:
                g += 1
            if g == len(groups):
                groups.append([])
            groups[g].append(k)
            for page in writes:
                last_write[page] = max(g, last_write.get(page, -1))
            for page in reads:
                last_read[page] = max(g, last_read.get(page, -1))
        return [k for members in groups for k in [*members, *[None] * (group - len(members))]]

    def _prefill_call(self, layout: Sequence[_PreparedPrefill | None], width: int,
                      group: int) -> list[tuple[int, float]]:
        """One call of the prefill program of the rows' buckets (`layout`: rows and padding, None, in groups of
        `group`), padded to `width` rows; the (token, log-prob) of each row, in order."""
        rows = [p for p in layout if p is not None]
        where = [r for r, p in enumerate(layout) if p is not None]
        t, kv_len, patch_bucket = rows[0].key
        program, args = self._prefill_args(layout, width, group)
        self.encoded_images += sum(p.images for p in rows)
        for p in rows:
            kind = ("prefill", t, patch_bucket) if p.row.start == 0 else ("extend", t, kv_len, patch_bucket)
            self.program_calls[kind] += 1
        self.programs.add(program)
        started = time.perf_counter()
        with exclusive(self.placement.devices):  # device_lock: a trainer sharing these devices waits meanwhile
            self.cache, self.bias, ids, lps = self._prefill(self._param_leaves, self.cache, self.bias, *args,
                                                            group=group)
            ids, lps = jax.device_get((ids, lps))
        self.prefill_program_s += time.perf_counter() - started
        return [(int(ids[r]), float(lps[r])) for r in where]

    def _prefill_args(self, layout: Sequence[_PreparedPrefill | None], width: int,
                      group: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """(program key, the host arguments of the prefill program after params, cache and bias) of a call of
        `layout` (see `_prefill_call`)."""
        rows = [p for p in layout if p is not None]
        where = [r for r, p in enumerate(layout) if p is not None]
        t, kv_len, patch_bucket = rows[0].key
        n = len(rows) if group == 1 else -(-len(layout) // group)  # the program's loop: rows, or groups of rows
        slots = np.full((width,), self.config.max_batch, np.int32)  # padding rows: bias writes dropped
        tables = np.full((width, self._table_width(kv_len)), self.config.num_pages, np.int32)
        starts = np.zeros((width,), np.int32)
        lengths = np.ones((width,), np.int32)
        tokens = np.zeros((width, 1, t), np.int32)
        positions = np.zeros((width, 3, 1, t), np.int32)
        copies = np.zeros((2, width), np.int32)  # src == dst: no copy
        entries = max((len(p.row.logit_bias) for p in rows), default=0)
        k = MIN_BIAS_ENTRIES
        while k < entries:
            k *= 2
        bias_ids = np.full((width, k), self.vocab_size, np.int32)  # padding entries: dropped
        bias_vals = np.zeros((width, k), np.float32)
        ints = np.zeros((len(IntRow), width), np.int32)
        floats = np.zeros((len(FloatRow), width), np.float32)
        for r, p in zip(where, rows):
            slots[r] = p.row.slot
            tables[r] = p.table
            starts[r] = p.row.start
            lengths[r] = p.length
            tokens[r, 0] = p.tokens
            positions[r, :, 0] = p.positions
            if p.row.copy is not None:
                copies[:, r] = p.row.copy
            for e, (token, value) in enumerate(p.row.logit_bias):
                bias_ids[r, e], bias_vals[r, e] = token, value
            ints[:, r] = p.row.ints
            floats[:, r] = p.row.floats
        vision = rows[0].vision  # only ever in a one-row call
        return (("prefill", width, t, kv_len, patch_bucket, k, group),
                (np.int32(n), slots, tables, starts, tokens, positions, lengths, copies, bias_ids, bias_vals, ints,
                 floats, vision))

    def _prefill_compiler(self, prepared: _PreparedPrefill) -> Callable[[], Any]:
        """Compiles the prefill program of `prepared`'s buckets (a call of it alone), on any thread: the arguments'
        shapes, dtypes and shardings are taken here as `_prefill_call` passes them, so the program jit caches is
        the one a later call of those buckets runs (as `_decode_compiler`)."""
        width, group = self._prefill_shape(prepared.key[0], prepared.key[2] is not None)
        key, args = self._prefill_args([prepared, *[None] * (width - 1)], width, group)
        assert key == self._prefill_key(prepared.key, key[5]), (key, prepared.key)
        specs = (*self._device_specs(), *jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args))
        return lambda: self._prefill.lower(*specs, group=group).compile()

    def _device_specs(self) -> tuple[Any, Any, Any]:
        """Shapes, dtypes and shardings of the parameters, cache and bias rows every program takes first."""
        def like(x: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

        return [like(x) for x in self._param_leaves], jax.tree.map(like, self.cache), jax.tree.map(like, self.bias)

    def score(self, input_ids: np.ndarray, positions: np.ndarray, pixel_values: np.ndarray | None,
              image_grid_thw: np.ndarray | None, temperature: float, *, clips: ClipInputs | None = None) -> np.ndarray:
        """float32 [L - 1]: log p(input_ids[i] | input_ids[:i]) of `softmax(logits / temperature)` for i in [1, L),
        from one full forward of the prompt (positions [3, L]; image pads expanded) padded to a prefill bucket,
        without the KV cache: SGLang's input-token log-probs (`logprob_start_len`), for a teacher that scores
        a student's trajectory. Program key ("score", bucket, patch_bucket)."""
        total = int(input_ids.shape[0])
        t = bucket_for(total, self.config.prefill_buckets, "prompt tokens")
        tokens = np.zeros((1, t), np.int32)
        tokens[0, :total] = input_ids
        pos = np.zeros((3, 1, t), np.int32)
        pos[:, 0, :total] = positions
        segment_ids = np.zeros((1, t), np.int32)
        segment_ids[0, :total] = 1
        targets = np.zeros((1, t), np.int32)
        targets[0, : total - 1] = input_ids[1:]
        patch_bucket = self._patch_bucket(pixel_values, clips)
        vision = self._vision(pixel_values, image_grid_thw, clips, tokens, segment_ids > 0, patch_bucket)
        self.encoded_images += (0 if image_grid_thw is None else len(image_grid_thw)) + (0 if clips is None else len(clips))
        self._call(("score", t, patch_bucket), ("score", t, patch_bucket, float(temperature)))
        with exclusive(self.placement.devices):  # device_lock
            lp = self._score(self._param_leaves, tokens, pos, segment_ids, vision, targets, temperature=float(temperature))
            lp = jax.device_get(lp)
        return np.asarray(lp, np.float32)[: total - 1]

    def routed_experts(self, pages: Sequence[int], n: int) -> np.ndarray:
        """int32 [n, num_hidden_layers, top_k]: the experts positions [0, n) of the request with page table
        `pages` were routed to (SGLang's `routed_experts`; -1 in dense layers). Only for `records_experts`."""
        if not self.records_experts:
            raise ValueError(f"{type(self.cfg).__name__} has no routed experts to return")
        if n <= 0:
            return np.zeros((0, self.cfg.text.num_hidden_layers, self.cfg.text.num_experts_per_tok), np.int32)
        pages = np.asarray(pages[: -(-n // self.config.page_size)], np.int32)
        return np.asarray(jax.device_get(self.cache.routed_experts(pages, n)))

    def copy_page(self, src: int, dst: int) -> None:
        """Copy the K/V of page `src` into page `dst` (a reused, partly shared last page)."""
        self._call(("copy_page",), ("copy_page",))
        self.cache = self._copy_page(self.cache, np.int32(src), np.int32(dst))

    def copy_state(self, src: int, dst: int) -> None:
        """Copy recurrent-state row `src` into row `dst` (rows: slots, then snapshots at `max_batch + i`)."""
        self._call(("copy_state",), ("copy_state",))
        self.cache = self._copy_state(self.cache, np.int32(src), np.int32(dst))

    def decode(
        self, slots: np.ndarray, tables: np.ndarray, ints: np.ndarray, floats: np.ndarray, filtered: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """One decode step for the running requests in `slots` [n] (their bias rows), padded to a batch bucket.

        tables int32 [n, W]: their page tables, padded with num_pages (covering position LENGTH, where
        this step writes; entries past the kv-length bucket are not read);
        ints int32 [6, n], floats float32 [3, n]: their columns of `IntRow` / `FloatRow`. Returns ids
        int32 [n] and log-probs float32 [n].
        """
        return self.collect_decode(self.dispatch_decode(slots, tables, ints, floats, filtered))

    def dispatch_decode(self, slots: np.ndarray, tables: np.ndarray, ints: np.ndarray, floats: np.ndarray,
                        filtered: bool) -> DecodeStep:
        """`decode`, dispatched but not waited for: its ids stay on the device until `collect_decode`, and its
        devices stay held (`exclusive`) until then."""
        n = int(slots.shape[0])
        b, kv_len = self._decode_buckets(n, int(ints[IntRow.LENGTH].max()) + 1, filtered)
        return self._dispatch(slots, tables, ints, floats, filtered, b, kv_len, tokens=None)

    def dispatch_following(self, after: DecodeStep, slots: np.ndarray, tables: np.ndarray, floats: np.ndarray,
                           filtered: bool) -> DecodeStep | None:
        """The decode step after `after` (dispatched, not collected) on the same rows, before `after` is read: its
        input tokens are `after`'s sampled ids where they lie, its LENGTH and STEP one further, so the host prepares
        step n + 1 while the device runs step n. `tables` must cover the next position. None when the step would
        need another batch bucket (`after`'s ids have its shape): read `after` and dispatch afresh."""
        ints = after.ints.copy()
        ints[IntRow.LENGTH] += 1
        ints[IntRow.STEP] += 1
        b, kv_len = self._decode_buckets(after.n, int(ints[IntRow.LENGTH].max()) + 1, filtered)
        if b != after.batch:
            return None
        return self._dispatch(slots, tables, ints, floats, filtered, b, kv_len, tokens=after.ids)

    def _dispatch(self, slots: np.ndarray, tables: np.ndarray, ints: np.ndarray, floats: np.ndarray, filtered: bool,
                  b: int, kv_len: int, tokens: jax.Array | None) -> DecodeStep:
        n = int(slots.shape[0])
        batch_slots = np.zeros((b,), np.int32)
        batch_slots[:n] = slots
        batch_tables = self._padded_tables(tables, b, self._table_width(kv_len))  # padding rows: no page, writes dropped
        batch_ints = np.zeros((ints.shape[0], b), np.int32)
        batch_ints[:, :n] = ints
        batch_floats = np.zeros((floats.shape[0], b), np.float32)
        batch_floats[:, :n] = floats
        if tokens is None:  # a device array in the sharding of the ids a step returns: one program either way
            tokens = jax.device_put(batch_ints[IntRow.TOKEN], self._replicated)
        self._call(("decode", b, kv_len, filtered), ("decode", b, kv_len, filtered))
        started = time.perf_counter()
        hold = contextlib.ExitStack()
        hold.enter_context(exclusive(self.placement.devices))  # device_lock, until collected
        try:
            self.cache, ids, lps = self._decode(self._param_leaves, self.cache, self.bias, batch_slots, batch_tables,
                                                batch_ints, batch_floats, tokens, filtered=filtered)
        except BaseException:
            hold.close()
            raise
        finally:
            self.decode_program_s += time.perf_counter() - started
        return DecodeStep(n=n, batch=b, ints=np.array(ints, np.int32), ids=ids, lps=lps, hold=hold)

    def collect_decode(self, step: DecodeStep) -> tuple[np.ndarray, np.ndarray]:
        """The ids int32 [n] and log-probs float32 [n] of a dispatched step, once the device has them."""
        started = time.perf_counter()
        try:
            ids, lps = jax.device_get((step.ids, step.lps))
        finally:
            step.hold.close()
            self.decode_program_s += time.perf_counter() - started
        return np.asarray(ids)[: step.n], np.asarray(lps)[: step.n]

    def _decode_buckets(self, n: int, kv_needed: int, filtered: bool) -> tuple[int, int]:
        """(batch bucket, kv-length bucket) of a decode step of `n` rows attending to `kv_needed` positions: the
        buckets' own program when it is compiled; else the cheapest compiled program that covers them (more rows, a
        longer kv span: padding rows are dropped and the keys past each row's length masked), and once the buckets
        have borrowed in FALLBACK_STEPS of the last FALLBACK_WINDOW steps, their own program is compiled on a side
        thread (`background`) and run from the first step after it is ready; with no covering program, the
        buckets' own, compiled now. A ramp of requests arriving one by one thus runs on the programs the warm-up
        compiled instead of compiling the bucket of every size it passes through, a bucket the workload keeps
        needing is compiled without stalling the running requests (a compilation on this thread stalls them all: a
        second or more on a CPU), and a bucket needed now and then (the last rows of a round) never costs a
        compilation, in a long run either."""
        self._adopt_ready()
        self._decode_steps += 1
        b = bucket_for(n, self.config.batch_buckets, "running requests")
        kv_len = bucket_for(kv_needed, self.config.kv_buckets, "cached tokens")
        own = ("decode", b, kv_len, filtered)
        if own in self.programs:
            return b, kv_len
        covering = [(key[1], key[2]) for key in self.programs
                    if key[0] == "decode" and key[3] == filtered and key[1] >= n and key[2] >= kv_needed]
        if not covering:
            return b, kv_len
        borrowed = self._borrowed.setdefault(own, collections.deque())
        steady = in_steady_use(borrowed, self._decode_steps, FALLBACK_STEPS, FALLBACK_WINDOW)
        if steady and self.background.can_start(own):
            self.background.start(own, self._decode_compiler(b, kv_len, filtered))
        return min(covering, key=lambda key: key[0] * key[1])

    def _decode_compiler(self, b: int, kv_len: int, filtered: bool) -> Callable[[], Any]:
        """Compiles the decode program of these buckets, on any thread: its arguments' shapes, dtypes and shardings
        are taken here, on the scheduler's thread, as `_dispatch` passes them (numpy host arrays, and tokens on the
        devices, replicated), so the program jit caches is the one the step after it calls."""
        specs = (*self._device_specs(), jax.ShapeDtypeStruct((b,), np.int32),
                 jax.ShapeDtypeStruct((b, self._table_width(kv_len)), np.int32),
                 jax.ShapeDtypeStruct((len(IntRow), b), np.int32), jax.ShapeDtypeStruct((len(FloatRow), b), np.float32),
                 jax.ShapeDtypeStruct((b,), np.int32, sharding=self._replicated))
        return lambda: self._decode.lower(*specs, filtered=filtered).compile()

    # ------------------------------------------------------------------ weights

    def load_weights(self, path: str | os.PathLike) -> None:
        """Swap in the safetensors weights at `path` (same architecture). On any error the serving
        weights stay as they were and the exception propagates."""
        self.params = load_params_state(path, self.cfg, self.params)
        self._params_backup = None

    def stage_params(self, params: Any, via_dtype: Any = None, partial: bool = False,
                     may_alias: bool = False) -> nnx.State:
        """The parameters of `params` (a model or a parameter state, e.g. the trainer's, on other devices and
        shardings) rounded through `via_dtype` (if any), cast to the serving dtypes and placed in this replica's
        shardings, without touching the serving weights: `set_params` swaps them in. Fresh buffers throughout
        (`weights.place_weights`); the serving state's other variables are kept.

        The parameters must be the serving model's (same family and config); anything else is a ValueError
        naming the first difference. With `partial`, `params` may hold some of the parameters only (a sync that
        leaves a frozen vision tower out): the others stay the serving arrays, shared, not copied. `may_alias`: the
        caller's arrays are served as they are where they already fit (`weights.place_weights`).
        """
        given = param_arrays(params)
        targets, structure, paths = leaf_paths(self.params)
        wanted = {p for p in paths if p is not None}
        if given.keys() != wanted and not (partial and given.keys() <= wanted):
            extra, missing = sorted(map(str, given.keys() - wanted)), sorted(map(str, wanted - given.keys()))
            raise ValueError(f"weights do not fit the serving model: missing {missing[:3]}, unexpected {extra[:3]}")
        moved = [i for i, p in enumerate(paths) if p in given]
        for i in moved:
            new, old = given[paths[i]], targets[i]
            if tuple(new.shape) != tuple(old.shape):
                raise ValueError(f"weights do not fit the serving model: {paths[i]} has shape {tuple(new.shape)}, "
                                 f"the serving model {tuple(old.shape)}")
        placed = place_weights([given[paths[i]] for i in moved], [targets[i] for i in moved], via_dtype, may_alias)
        leaves = list(targets)
        for i, array in zip(moved, placed):
            leaves[i] = array
        return jax.tree.unflatten(structure, leaves)

    def set_params(self, staged: nnx.State) -> None:
        """Serve `staged` (from `stage_params`) from the next program on."""
        self.params = staged
        self._params_backup = None

    def model(self) -> PolicyModel:
        """The serving model (a view over the current parameters), for tests and tools."""
        return nnx.merge(self._graphdef, self.params)
