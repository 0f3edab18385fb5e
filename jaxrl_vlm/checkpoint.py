"""Training checkpoints with orbax: train state (params + optimizer + step + RNG) and JSON run metadata.

What is saved at a step:

* ``state``: any pytree of arrays (the trainer's params, optax state, step counter, RNG key), written with
  orbax's standard handler, each process writing its own shards (multi-host safe);
* ``meta``: a JSON dict (data-iterator cursor, the group counter, the weight version, the config that
  produced the run), so ``--load`` resumes exactly where the run stopped.

Atomicity: orbax writes a step to a temporary directory and renames it only once every item is
committed, so a checkpoint interrupted mid-write (``kill -9``) is never listed as a step and never
restored. Saving is synchronous on purpose: the next training step mutates nothing that is being
written, and a crash right after ``save`` returns must leave a complete checkpoint.

Integrity: beside the state, the meta records every leaf's shape and dtype and a fingerprint of its bits (the
wrapping uint32 sum of the raw bit patterns, computed on device: exact, and the same under any sharding). A
restore first compares the shapes with the current run's (naming every difference: a changed model or
optimizer), then checks the restored bits against the fingerprint, so a flipped byte is an error naming the
step and the leaf instead of silently wrong weights.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxrl_vlm.errors import CheckpointError  # a checkpoint directory that cannot be used: bad input, exit 2

logger = logging.getLogger(__name__)


_INTEGRITY = "_integrity"  # meta key of the shapes and fingerprints (stripped from what `restore` returns)


def _leaf_names(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def leaf_shapes(tree: Any) -> dict[str, str]:
    """`{leaf path: "dtype[shape]"}` of a pytree of arrays (or ShapeDtypeStructs)."""
    return {name: f"{jnp.dtype(x.dtype).name}{list(x.shape)}" for name, x in zip(_leaf_names(tree), jax.tree.leaves(tree))}


@jax.jit
def _bit_sums(leaves: list[jax.Array]) -> list[jax.Array]:
    out = []
    for x in leaves:
        width = jnp.dtype(x.dtype).itemsize
        bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[width])
        if width == 8:  # fold 64-bit patterns into 32 so every sum is uint32
            bits = (bits >> 32).astype(jnp.uint32) ^ bits.astype(jnp.uint32)
        out.append(jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32))
    return out


def fingerprint(tree: Any) -> dict[str, int]:
    """`{leaf path: wrapping uint32 sum of its bit patterns}`; any single flipped bit changes its leaf's value."""
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    sums = jax.device_get(_bit_sums(leaves))
    return {name: int(v) for name, v in zip(_leaf_names(tree), sums)}


class CheckpointStore:
    """Keeps the last `keep` checkpoints of a run under `directory` (one sub-directory per step)."""

    def __init__(self, directory: str | Path, *, keep: int = 3, read_only: bool = False):
        self.directory = Path(directory).resolve()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=not read_only,
            read_only=read_only,
            enable_async_checkpointing=False,
            cleanup_tmp_directories=not read_only,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Write `state` (pytree of arrays) and `meta` (JSON-serialisable) as step `step`."""
        meta = {**meta, _INTEGRITY: {"shapes": leaf_shapes(state), "fingerprint": fingerprint(state)}}
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        if not saved:  # a failure of the run, not of its input
            raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")
        self._manager.wait_until_finished()
        logger.info("saved checkpoint step %d to %s", step, self.directory)

    def steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any, dict[str, Any]]:
        """Restore (step, state, meta). `abstract_state` gives structure, dtypes and target shardings
        (e.g. `jax.eval_shape` output with `.sharding` set), so arrays load straight into their shards."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        if step not in self.steps():
            raise CheckpointError(f"step {step} is not a complete checkpoint in {self.directory} (have {self.steps()})")
        meta = dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        integrity = meta.pop(_INTEGRITY, None)
        if integrity is None:
            logger.warning("checkpoint step %d in %s has no integrity record (an older checkpoint): not verified",
                           step, self.directory)
        else:
            self._check_shapes(step, integrity["shapes"], leaf_shapes(abstract_state))
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
        except Exception as e:  # tensorstore/orbax decode errors of damaged files: name the step and the way out
            raise CheckpointError(f"step {step} in {self.directory} is unreadable ({type(e).__name__}: {e}); resume "
                                  f"from another step with --load-step {self._other_steps(step)}") from e
        state = restored["state"]
        if integrity is not None:
            self._check_bits(step, integrity["fingerprint"], fingerprint(state))
        return step, state, meta

    def meta(self, step: int) -> dict[str, Any]:
        """The run metadata saved at `step` (without the integrity record), without reading the arrays."""
        meta = dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        meta.pop(_INTEGRITY, None)
        return meta

    def _check_shapes(self, step: int, saved: dict[str, str], wanted: dict[str, str]) -> None:
        diffs = [f"{k}: checkpoint {saved.get(k, 'missing')}, this run {wanted.get(k, 'missing')}"
                 for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k)]
        if diffs:
            shown = "; ".join(diffs[:8]) + (f"; ... ({len(diffs)} in all)" if len(diffs) > 8 else "")
            raise CheckpointError(f"step {step} in {self.directory} does not fit this run's model or optimizer "
                                  f"(a changed config?): {shown}")

    def _check_bits(self, step: int, saved: dict[str, int], restored: dict[str, int]) -> None:
        bad = sorted(k for k in saved if saved[k] != restored.get(k))
        if bad:
            raise CheckpointError(
                f"step {step} in {self.directory} is corrupt: the data of {len(bad)} array(s) changed after they "
                f"were written ({', '.join(bad[:5])}); resume from another step with --load-step "
                f"{self._other_steps(step)}"
            )

    def _other_steps(self, step: int) -> str:
        others = [s for s in self.steps() if s != step]
        return f"(complete steps: {others})" if others else "(no other complete step)"

    def close(self) -> None:
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays, for `CheckpointStore.restore`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
