"""The model-family registry, keyed by `config.json`'s `model_type`, and the interfaces a family implements.

A family is two halves:

* `Family` (here, jax-free): its `model_type`, its config class and the parser of an HF `config.json` dict. The
  configs live in `config.py`, which registers each family; host-side code (config validation, batching, a
  rollout host) reads configs without importing jax.
* `FamilyModel` (the family's own file, e.g. `qwen3_vl.py`, as its module attribute `FAMILY_MODEL`): the Flax
  module class, its HF tensor names (`weight_links`, for import and export) and its engine functions:
  `init_cache`, `prefill` and `decode` against the family's `DecodeCache`. `Family.model()` imports that file on
  first use (by its dotted name, as `jaxrl_vlm.registry` does), so the registry never imports jax itself.

Everything else looks a family up here: `config.from_hf_dict` (parser), `hf_io` (class, tensor names, export
names), the engine (`engine/forward.py`: cache, prefill, decode) and `tiny.py` (init rules). The train step and
the engine see the model only through `PolicyModel`, never a family's class.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

C = TypeVar("C", bound="DecodeCache")


@runtime_checkable
class DecodeCache(Protocol):
    """A family's engine memory for decoding: one pytree of device arrays, allocated once (`init_cache`).

    What the engine relies on: every request's tokens live in *pages* of `page_size` positions, named by its
    page table (pages may be shared by requests with a common prompt prefix), and a request has a *slot* in
    [0, max_slots) while it runs. Paged K/V (`paged_kv.KVCache`) is all of it for a full-attention decoder; a
    hybrid decoder adds per-slot recurrent state (e.g. conv and delta-rule state of linear-attention layers),
    indexed by the slots that `prefill` / `decode` receive.

    Recurrent state lives in *state rows*: the engine's running slots first, then rows that keep snapshots of a
    prefix's state for the prefix cache (`state_rows` in all; 0 for a cache without recurrent state). The
    engine copies a row into another with `copy_state` (a snapshot into the slot that continues from it, or a
    finished slot's state into a snapshot).
    """

    @property
    def state_rows(self) -> int:
        """Rows of per-request recurrent state (0: none, full attention)."""
        ...

    def copy_state(self: C, src: Any, dst: Any) -> C:
        """State row `src` copied into row `dst`; jit-able (a cache without state returns itself)."""
        ...

    def logical_axes(self) -> Any:
        """This cache's pytree with each array replaced by its logical axis names (a tuple of `sharding.rules`
        names or None per dimension): how the engine shards it over a replica's tensor-parallel devices."""
        ...

    @property
    def num_pages(self) -> int: ...

    @property
    def page_size(self) -> int: ...

    def copy_page(self: C, src: Any, dst: Any) -> C:
        """Page `src` copied into page `dst` (copy-on-write of a partly shared page); jit-able."""
        ...


class VisionLanguageConfig(Protocol):
    """What host code (the engine's prompt preparer, batching, positions) reads of any family's config."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision: Any  # the vision tower's config: `spatial_merge_size`, `patch_size`, `temporal_patch_size`, ...


class PolicyModel(Protocol):
    """What the trainer and the engine use of a family's Flax model (`FamilyModel.model_class` instances).

    `model(tokens [B, T], positions [3, B, T], segment_ids [B, T], vision) -> hidden [B, T, D]` after the
    final norm; `lm_head_kernel() -> [D, V]`; `compute_dtype` is the matmul dtype; `cfg` the family's config.
    """

    cfg: Any
    compute_dtype: Any

    def __call__(self, tokens: Any, positions: Any, segment_ids: Any, vision: Any = None) -> Any: ...

    def lm_head_kernel(self) -> Any: ...


class InitCache(Protocol):
    def __call__(self, cfg: Any, num_pages: int, page_size: int, max_slots: int, dtype: Any) -> DecodeCache:
        """The engine's whole decode memory, zeroed: `num_pages` pages of `page_size` positions (plus per-slot
        state for `max_slots` running requests, where the family has any)."""
        ...


class Prefill(Protocol):
    def __call__(self, model: PolicyModel, cache: C, slot: Any, table_p: Any, start: Any, tokens_1t: Any,
                 positions_31t: Any, length: Any, vision: Any) -> tuple[C, Any]:
        """Prompt tokens [start, start + T) of the request in `slot` (page table `table_p` int32 [P]) into the
        cache; returns the cache and the fp32 logits [V] at the last real token (see `paged_kv.prefill`)."""
        ...


class PrefillRows(Protocol):
    def __call__(self, model: PolicyModel, cache: C, tables_rp: Any, starts_r: Any, tokens_rt: Any,
                 positions_3rt: Any, lengths_r: Any, vision: Any) -> tuple[C, Any]:
        """`Prefill` of R requests side by side (none reading what another writes); returns the cache and fp32
        logits [R, V] (see `paged_kv.prefill_rows`)."""
        ...


class Decode(Protocol):
    def __call__(self, model: PolicyModel, cache: C, slots_b: Any, tables_bp: Any, tokens_b: Any, lengths_b: Any,
                 rope_deltas_b: Any) -> tuple[C, Any]:
        """One decode step of the requests in `slots_b` [B]; returns the cache and fp32 logits [B, V] (see
        `paged_kv.decode`)."""
        ...


@dataclass(frozen=True)
class FamilyModel:
    """The jax half of a family, defined in its own file as `FAMILY_MODEL`.

    model_class: `cls(cfg, *, rngs, param_dtype, compute_dtype, remat, attention_impl, patch_attention_block)`
      builds a `PolicyModel`.
    weight_links: cfg -> every HF tensor of the checkpoint and where it lives in the model (`hf_links.Link`).
    stored_tensor_name: the name an exported tensor gets on disk (transformers 5's names by default; a family
      that transformers still saves under older names maps them, as Qwen2.5-VL does).
    init_cache / prefill / decode: the engine's functions (see the protocols above).
    prefill_rows: several prompts in one forward (the engine batches short ones, whose prefill reads the weights
      more than it computes); None for a family whose prefill moves per-request state (a recurrent layer's), which
      the engine prefills one request at a time.
    init_std: (path, shape, cfg) -> std of the tiny model's scaled init (`tiny.py`), or None to keep the
      constructor's value, for the family's parameters whose names the generic rule does not know (it covers
      norms, biases, embeddings and einsum-named `*_kernel_*` matrices).
    ignored_checkpoint_keys: regexes (`re.search`) of checkpoint tensors that import skips, exactly those the
      family's transformers class ignores (its `_keys_to_ignore_on_load_unexpected`); any other tensor the
      family does not read is an error.
    """

    model_class: Callable[..., PolicyModel]
    weight_links: Callable[[Any], list[Any]]
    init_cache: InitCache
    prefill: Prefill
    decode: Decode
    stored_tensor_name: Callable[[str], str] = lambda key: key
    init_std: Callable[[tuple[Any, ...], tuple[int, ...], Any], float | None] | None = None
    ignored_checkpoint_keys: tuple[str, ...] = ()
    prefill_rows: PrefillRows | None = None


@dataclass(frozen=True)
class Family:
    """One model family: `config.json`'s `model_type`, its config class and parser, and the dotted name of the
    module that defines its `FAMILY_MODEL`."""

    model_type: str
    config_class: type
    from_hf_dict: Callable[[dict[str, Any]], Any]
    model_module: str

    def model(self) -> FamilyModel:
        """The family's `FamilyModel` (imports its module, hence jax, on first use)."""
        found = getattr(importlib.import_module(self.model_module), "FAMILY_MODEL", None)
        if not isinstance(found, FamilyModel):
            raise TypeError(f"{self.model_module} must define FAMILY_MODEL = FamilyModel(...) for model_type "
                            f"{self.model_type!r}")
        return found


# Filled by `config.py` (where the configs are) when it is imported; `family` imports it first.
FAMILIES: dict[str, Family] = {}
_REGISTERED_BY = "jaxrl_vlm.models.config"


def register(family: Family) -> Family:
    """Add `family` under its `model_type` (once) and as the family of its config class."""
    if family.model_type in FAMILIES:
        raise ValueError(f"model family {family.model_type!r} is already registered")
    if getattr(family.config_class, "model_type", None) != family.model_type:
        raise ValueError(f"{family.config_class.__name__}.model_type must be {family.model_type!r}")
    FAMILIES[family.model_type] = family
    return family


def family(model_type: str) -> Family:
    """The family registered as `model_type`; an unknown one lists the registered ones."""
    importlib.import_module(_REGISTERED_BY)
    if model_type not in FAMILIES:
        raise KeyError(f"model_type={model_type!r} is not a registered model family; registered: {tuple(FAMILIES)}")
    return FAMILIES[model_type]


def family_of(cfg: Any) -> Family:
    """The family of a config object (by its class's `model_type`)."""
    model_type = getattr(type(cfg), "model_type", None)
    if model_type not in FAMILIES or not isinstance(cfg, FAMILIES[model_type].config_class):
        raise TypeError(f"no model family for config type {type(cfg).__name__}; registered: {tuple(FAMILIES)}")
    return FAMILIES[model_type]


def family_model(cfg: Any) -> FamilyModel:
    """The jax half (`FamilyModel`) of `cfg`'s family."""
    return family_of(cfg).model()
