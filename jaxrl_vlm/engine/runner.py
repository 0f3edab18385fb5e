"""Device side of the engine: parameters, decode cache (paged KV), logit-bias rows and the compiled programs.

`ModelRunner` owns every device array and is driven by one thread (the scheduler's). It pads host
inputs (tokens, page tables) to the buckets of `EngineOptions`, calls one jitted program per step
(prefill+sample for one prompt, or decode+sample for a batch of requests) and returns plain numpy
results. Which pages a request uses is the scheduler's business (`prefix_cache.PageCache`).
Parameters are an `nnx.State` passed as an argument, so new weights swap in without recompiling.
"""

from __future__ import annotations

import collections
import enum
import functools
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_vlm.engine import forward
from jaxrl_vlm.engine.options import EngineOptions, bucket_for
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
    merged = np.cumsum(grid.prod(-1) // cfg.vision.merge_unit)
    before = int(np.count_nonzero(input_ids[:start] == cfg.image_token_id))
    done = int(np.searchsorted(merged, before, side="right"))  # images wholly before `start`
    if before != (merged[done - 1] if done else 0):
        raise ValueError(f"prefix of {start} tokens ends inside image {done} (its pads are split)")
    if done == len(grid):
        return None, None
    first_patch = int(grid[:done].prod(-1).sum())
    return pixel_values[first_patch:], grid[done:]


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

        def prefill_program(params, cache, bias, slot, table, start, tokens, positions, length, vision, bias_row, ints, floats):
            model = nnx.merge(graphdef, params)
            with activation_sharding(layout):
                cache, logits = forward.prefill(model, cache, slot, table, start, tokens, positions, length, vision)
            bias = bias.at[slot].set(bias_row)
            # Always the filtered sampler: sorting one row is cheap next to a prefill, and it halves the programs.
            ids, lps = sample_tokens(logits[None], bias_row[None], banned_v, _rows(ints, floats), filtered=True)
            return cache, bias, ids[0], lps[0]

        def decode_program(params, cache, bias, slots, tables, ints, floats, *, filtered):
            model = nnx.merge(graphdef, params)
            with activation_sharding(layout):
                cache, logits = forward.decode(model, cache, slots, tables, ints[IntRow.TOKEN], ints[IntRow.LENGTH],
                                               ints[IntRow.ROPE_DELTA])
            ids, lps = sample_tokens(logits, bias[slots], banned_v, _rows(ints, floats), filtered=filtered)
            return cache, ids, lps

        def score_program(params, tokens, positions, segment_ids, vision, targets, *, temperature):
            # The trainer's forward (`rl/train_step.policy_logprobs`): no cache, every position's log-prob.
            model = nnx.merge(graphdef, params)
            with activation_sharding(layout):
                hidden = model(tokens, positions, segment_ids, vision)
                lp, _ = token_logprobs(model, hidden, targets, chunk_size=SCORE_CHUNK,
                                       temperature=temperature)
            return lp[0]

        self._score = jax.jit(score_program, static_argnames=("temperature",), out_shardings=replicated)
        # Explicit output shardings: the cache and bias stay where they live, step after step (no resharding).
        self._prefill = jax.jit(prefill_program, donate_argnames=("cache", "bias"),
                                out_shardings=(cache_sh, replicated, replicated, replicated))
        self._decode = jax.jit(decode_program, static_argnames=("filtered",), donate_argnames=("cache",),
                               out_shardings=(cache_sh, replicated, replicated))
        self._copy_page = jax.jit(forward.copy_page, donate_argnames=("cache",), out_shardings=cache_sh)
        self._copy_state = jax.jit(forward.copy_state, donate_argnames=("cache",), out_shardings=cache_sh)
        self.program_calls: collections.Counter[tuple[Any, ...]] = collections.Counter()
        self.encoded_images = 0  # images run through the vision tower (a reused prefix skips its images)

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
        """Distinct compiled programs so far (one per bucket key)."""
        return len(self.program_calls)

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
    ) -> tuple[int, float]:
        """Prefill `input_ids` [L] (positions [3, L]) into the request's `pages` (its page table, at
        least ceil(L / page_size) pages) and sample its next token; `slot` is its bias row.

        start > 0 ("extend"): positions [0, start) of the pages already hold the K/V of
        input_ids[:start] (a reused prefix, whose images must lie wholly inside it); only [start, L)
        is computed, into pages the request owns alone, and the vision tower runs only on the images
        there.
        ints int32 [6] / floats float32 [3]: the slot's column of `IntRow` / `FloatRow` (token,
        length and rope_delta are unused here). bias_row float32 [V] or None (no bias).
        Returns (token id, its log-prob).
        """
        total = int(input_ids.shape[0])
        if not 0 <= start < total:
            raise ValueError(f"prefill start={start} must lie in [0, {total}) (the last prompt token is always computed)")
        length = total - start
        t = bucket_for(length, self.config.prefill_buckets, "prompt tokens")
        kv_len = t if start == 0 else bucket_for(total, self.config.kv_buckets, "cached tokens")
        if len(pages) * self.config.page_size < total:
            raise ValueError(f"{len(pages)} pages of {self.config.page_size} tokens cannot hold a prompt of {total} tokens")
        table = self._padded_tables(np.asarray(pages, np.int32)[None], 1, self._table_width(kv_len))[0]
        tokens = np.zeros((1, t), np.int32)
        tokens[0, :length] = input_ids[start:]
        pos = np.zeros((3, 1, t), np.int32)
        pos[:, 0, :length] = positions[:, start:]
        pixel_values, image_grid_thw = images_after(input_ids, start, pixel_values, image_grid_thw, self.cfg)
        vision: VisionInputs | None = None
        patch_bucket = None
        if pixel_values is not None:
            patch_bucket = self.config.patch_bucket(int(pixel_values.shape[0]))
            valid = np.zeros((1, t), bool)
            valid[0, :length] = True
            vision = build_vision_inputs(pixel_values, image_grid_thw, tokens, self.cfg, patch_bucket=patch_bucket, token_valid=valid)
            vision = type(vision)(*(None if a is None else np.asarray(a) for a in vision))
            self.encoded_images += len(image_grid_thw)
        row = np.zeros((self.vocab_size,), np.float32) if bias_row is None else bias_row.astype(np.float32)
        key = ("prefill", t, patch_bucket) if start == 0 else ("extend", t, kv_len, patch_bucket)
        self.program_calls[key] += 1
        self.cache, self.bias, tok, lp = self._prefill(
            self.params, self.cache, self.bias, np.int32(slot), table, np.int32(start), tokens, pos, np.int32(length), vision,
            row, ints[:, None], floats[:, None],
        )
        tok, lp = jax.device_get((tok, lp))
        return int(tok), float(lp)

    def score(self, input_ids: np.ndarray, positions: np.ndarray, pixel_values: np.ndarray | None,
              image_grid_thw: np.ndarray | None, temperature: float) -> np.ndarray:
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
        vision = None
        patch_bucket = None
        if pixel_values is not None:
            patch_bucket = self.config.patch_bucket(int(pixel_values.shape[0]))
            vision = build_vision_inputs(pixel_values, image_grid_thw, tokens, self.cfg, patch_bucket=patch_bucket,
                                         token_valid=segment_ids > 0)
            vision = type(vision)(*(None if a is None else np.asarray(a) for a in vision))
            self.encoded_images += len(image_grid_thw)
        self.program_calls[("score", t, patch_bucket)] += 1
        lp = self._score(self.params, tokens, pos, segment_ids, vision, targets, temperature=float(temperature))
        return np.asarray(jax.device_get(lp), np.float32)[: total - 1]

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
        self.program_calls[("copy_page",)] += 1
        self.cache = self._copy_page(self.cache, np.int32(src), np.int32(dst))

    def copy_state(self, src: int, dst: int) -> None:
        """Copy recurrent-state row `src` into row `dst` (rows: slots, then snapshots at `max_batch + i`)."""
        self.program_calls[("copy_state",)] += 1
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
        n = int(slots.shape[0])
        b = bucket_for(n, self.config.batch_buckets, "running requests")
        kv_len = bucket_for(int(ints[IntRow.LENGTH].max()) + 1, self.config.kv_buckets, "cached tokens")
        batch_slots = np.zeros((b,), np.int32)
        batch_slots[:n] = slots
        batch_tables = self._padded_tables(tables, b, self._table_width(kv_len))  # padding rows: no page, writes dropped
        batch_ints = np.zeros((ints.shape[0], b), np.int32)
        batch_ints[:, :n] = ints
        batch_floats = np.zeros((floats.shape[0], b), np.float32)
        batch_floats[:, :n] = floats
        self.program_calls[("decode", b, kv_len, filtered)] += 1
        self.cache, ids, lps = self._decode(self.params, self.cache, self.bias, batch_slots, batch_tables, batch_ints,
                                            batch_floats, filtered=filtered)
        ids, lps = jax.device_get((ids, lps))
        return np.asarray(ids)[:n], np.asarray(lps)[:n]

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
