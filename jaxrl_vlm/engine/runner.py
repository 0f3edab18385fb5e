"""Device side of the engine: parameters, KV cache, logit-bias rows and the compiled programs.

`ModelRunner` owns every device array and is driven by one thread (the scheduler's). It pads host
inputs to the buckets of `EngineConfig`, calls one jitted program per step (prefill+sample for one
prompt, or decode+sample for a batch of slots) and returns plain numpy results. Parameters are an
`nnx.State` passed as an argument, so new weights swap in without recompiling.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_vlm.engine import forward
from jaxrl_vlm.engine.config import EngineConfig, bucket_for
from jaxrl_vlm.engine.sampling import SamplingRows, sample_tokens
from jaxrl_vlm.engine.weights import load_params_state
from jaxrl_vlm.models.qwen3_vl import Qwen3VL
from jaxrl_vlm.models.vision import VisionInputs, build_vision_inputs

# Rows of the packed per-step arrays (one host->device transfer each for ints and floats).
INT_ROWS = ("token", "length", "rope_delta", "top_k", "step", "seed")
FLOAT_ROWS = ("temperature", "top_p", "min_p")


_I = {name: i for i, name in enumerate(INT_ROWS)}
_F = {name: i for i, name in enumerate(FLOAT_ROWS)}


def _rows(ints: jax.Array, floats: jax.Array) -> SamplingRows:
    """Sampling parameters from the packed arrays (seeds travel as int32 bit patterns)."""
    return SamplingRows(
        temperature=floats[_F["temperature"]],
        top_p=floats[_F["top_p"]],
        top_k=ints[_I["top_k"]],
        min_p=floats[_F["min_p"]],
        seed=jax.lax.bitcast_convert_type(ints[_I["seed"]], jnp.uint32),
        step=ints[_I["step"]],
    )


class ModelRunner:
    """Compiled prefill/decode over a slotted KV cache for one model on the default device.

    `banned_ids`: token ids that can never be sampled (Qwen-VL's vision special tokens).
    `program_calls` counts calls per compiled-program key, e.g. ("decode", batch, kv_len, filtered).
    """

    def __init__(self, model: Qwen3VL, config: EngineConfig, banned_ids: Sequence[int]):
        self.cfg = model.cfg
        self.config = config
        self.vocab_size = model.cfg.text.vocab_size
        self._graphdef, self.params = nnx.split(model)
        self.cache = forward.init_cache(model.cfg, config.max_batch, config.max_seq_len, config.jnp_compute_dtype)
        self.bias = jnp.zeros((config.max_batch, self.vocab_size), jnp.float32)
        banned = np.zeros((self.vocab_size,), bool)
        for t in banned_ids:
            if not 0 <= int(t) < self.vocab_size:
                raise ValueError(f"banned token id {t} is outside the vocabulary [0, {self.vocab_size})")
            banned[int(t)] = True
        self.banned_ids = tuple(int(t) for t in np.flatnonzero(banned))
        banned_v = jnp.asarray(banned)
        graphdef = self._graphdef

        def prefill_program(params, cache, bias, slot, tokens, positions, length, vision, bias_row, ints, floats):
            model = nnx.merge(graphdef, params)
            cache, logits = forward.prefill(model, cache, slot, tokens, positions, length, vision)
            bias = bias.at[slot].set(bias_row)
            # Always the filtered sampler: sorting one row is cheap next to a prefill, and it halves the programs.
            ids, lps = sample_tokens(logits[None], bias_row[None], banned_v, _rows(ints, floats), filtered=True)
            return cache, bias, ids[0], lps[0]

        def decode_program(params, cache, bias, ints, floats, *, kv_len, filtered):
            model = nnx.merge(graphdef, params)
            cache, logits = forward.decode(model, cache, ints[_I["token"]], ints[_I["length"]], ints[_I["rope_delta"]], kv_len)
            b = ints.shape[1]
            ids, lps = sample_tokens(logits, bias[:b], banned_v, _rows(ints, floats), filtered=filtered)
            return cache, ids, lps

        self._prefill = jax.jit(prefill_program, donate_argnames=("cache", "bias"))
        self._decode = jax.jit(decode_program, static_argnames=("kv_len", "filtered"), donate_argnames=("cache",))
        self.program_calls: collections.Counter[tuple[Any, ...]] = collections.Counter()

    # ------------------------------------------------------------------ programs

    @property
    def num_programs(self) -> int:
        """Distinct compiled programs so far (one per bucket key)."""
        return len(self.program_calls)

    def prefill(
        self,
        slot: int,
        input_ids: np.ndarray,
        positions: np.ndarray,
        pixel_values: np.ndarray | None,
        image_grid_thw: np.ndarray | None,
        bias_row: np.ndarray | None,
        ints: np.ndarray,
        floats: np.ndarray,
    ) -> tuple[int, float]:
        """Prefill `input_ids` [L] (positions [3, L]) into `slot` and sample its next token.

        ints int32 [6] / floats float32 [3]: the slot's row of INT_ROWS / FLOAT_ROWS (token,
        length and rope_delta are unused here). bias_row float32 [V] or None (no bias).
        Returns (token id, its log-prob).
        """
        length = int(input_ids.shape[0])
        t = bucket_for(length, self.config.prefill_buckets, "prompt tokens")
        tokens = np.zeros((1, t), np.int32)
        tokens[0, :length] = input_ids
        pos = np.zeros((3, 1, t), np.int32)
        pos[:, 0, :length] = positions
        vision: VisionInputs | None = None
        patch_bucket = None
        if pixel_values is not None and len(pixel_values):
            patch_bucket = self.config.patch_bucket(int(pixel_values.shape[0]))
            valid = np.zeros((1, t), bool)
            valid[0, :length] = True
            vision = build_vision_inputs(pixel_values, image_grid_thw, tokens, self.cfg, patch_bucket=patch_bucket, token_valid=valid)
            vision = VisionInputs(*(np.asarray(a) for a in vision))
        row = np.zeros((self.vocab_size,), np.float32) if bias_row is None else bias_row.astype(np.float32)
        self.program_calls[("prefill", t, patch_bucket)] += 1
        self.cache, self.bias, tok, lp = self._prefill(
            self.params, self.cache, self.bias, np.int32(slot), tokens, pos, np.int32(length), vision, row,
            ints[:, None], floats[:, None],
        )
        tok, lp = jax.device_get((tok, lp))
        return int(tok), float(lp)

    def decode(self, ints: np.ndarray, floats: np.ndarray, max_length: int, filtered: bool) -> tuple[np.ndarray, np.ndarray]:
        """One decode step for slots [0, B) where B = ints.shape[1] is a batch bucket.

        ints int32 [6, B], floats float32 [3, B] (INT_ROWS / FLOAT_ROWS); max_length: the largest
        cached length among active slots. Returns ids int32 [B] and log-probs float32 [B].
        """
        b = ints.shape[1]
        kv_len = bucket_for(max_length + 1, self.config.kv_buckets, "cached tokens")
        self.program_calls[("decode", b, kv_len, filtered)] += 1
        self.cache, ids, lps = self._decode(self.params, self.cache, self.bias, ints, floats, kv_len=kv_len, filtered=filtered)
        ids, lps = jax.device_get((ids, lps))
        return np.asarray(ids), np.asarray(lps)

    # ------------------------------------------------------------------ weights

    def load_weights(self, path: str | os.PathLike) -> None:
        """Swap in the safetensors weights at `path` (same architecture). On any error the serving
        weights stay as they were and the exception propagates."""
        self.params = load_params_state(path, self.cfg, self.params)

    def model(self) -> Qwen3VL:
        """The serving model (a view over the current parameters), for tests and tools."""
        return nnx.merge(self._graphdef, self.params)
