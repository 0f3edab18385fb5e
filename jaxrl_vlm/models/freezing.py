"""The parameters a run freezes: the vision tower and, as a separate choice, its patch mergers.

Found from the model's structure, by one rule for every family: the vision tower is the module each family keeps at
`visual` (`layers.VisionLanguageDecoder` and Qwen3.5's model, HF's `model.visual`); its mergers are the
`PatchMerger` modules inside it (the main merger and Qwen3-VL's deepstack mergers); the tower proper is the rest
(patch embedding, position table, blocks).

A frozen parameter lives outside the trained state (`split_params`): it gets no gradient and no optimizer state, the
forward sees it joined back (`join_params`, no copy), and a weight sync leaves its HF tensors (`FrozenParts.hf_keys`)
out once the engines hold them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flax import nnx

from jaxrl_vlm.models.hf_io import weight_links
from jaxrl_vlm.models.layers import PatchMerger

VISION_TOWER = "visual"  # the attribute of every family's vision tower (HF: model.visual)


@dataclass(frozen=True)
class FrozenParts:
    """What a run freezes: the parameters' state paths (as `nnx.to_flat_state` names them) and the HF tensors they
    are exported as."""

    paths: frozenset[tuple[Any, ...]] = frozenset()
    hf_keys: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.paths)


NOTHING_FROZEN = FrozenParts()


def vision_parts(model: Any) -> tuple[frozenset[tuple[Any, ...]], frozenset[tuple[Any, ...]]]:
    """(tower, mergers): the state paths of the vision tower's parameters outside its patch mergers, and of those
    inside them. ValueError for a model without a vision tower."""
    tower = getattr(model, VISION_TOWER, None)
    if not isinstance(tower, nnx.Module):
        raise ValueError(f"{type(model).__name__} has no vision tower (no `{VISION_TOWER}` module) to freeze")
    mergers = [path for path, node in nnx.iter_graph(tower) if isinstance(node, PatchMerger)]
    if not mergers:
        raise ValueError(f"{type(model).__name__}'s vision tower has no patch merger")
    in_tower, in_mergers = set(), set()
    for path, _ in nnx.to_flat_state(nnx.state(tower, nnx.Param)):
        merged = any(path[: len(m)] == tuple(m) for m in mergers)
        (in_mergers if merged else in_tower).add((VISION_TOWER, *path))
    return frozenset(in_tower), frozenset(in_mergers)


def frozen_parts(model: Any, *, vision_tower: bool = False, vision_merger: bool = False) -> FrozenParts:
    """The parameters of `model` (a policy model, real or abstract) that `--freeze-vision-tower` and
    `--freeze-vision-merger` freeze, with their HF tensors."""
    if not (vision_tower or vision_merger):
        return NOTHING_FROZEN
    tower, mergers = vision_parts(model)
    paths = (tower if vision_tower else frozenset()) | (mergers if vision_merger else frozenset())
    keys = set()
    for link in weight_links(model.cfg):
        inside = [tuple(p) in paths for p in link.ours]
        if any(inside) and not all(inside):  # a fused tensor across the boundary could not be left out of a sync
            raise ValueError(f"{link.hf_key} feeds frozen and trained parameters alike: {link.ours}")
        if all(inside):
            keys.add(link.hf_key)
    return FrozenParts(paths, frozenset(keys))


def split_params(params: nnx.State, paths: frozenset[tuple[Any, ...]]) -> tuple[nnx.State, nnx.State]:
    """(trained, frozen): `params` (or any state of the same paths, e.g. its shardings) cut by `paths`; the arrays
    are shared, not copied."""
    flat = list(nnx.to_flat_state(params))
    return (nnx.from_flat_state([(p, v) for p, v in flat if tuple(p) not in paths]),
            nnx.from_flat_state([(p, v) for p, v in flat if tuple(p) in paths]))


def join_params(trained: nnx.State, frozen: nnx.State) -> nnx.State:
    """The whole parameter state again (`split_params` undone, no copy); traceable, so a compiled step runs the
    model on it while only `trained` gets gradients."""
    return nnx.merge_state(trained, frozen)
