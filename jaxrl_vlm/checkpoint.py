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
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint directory cannot be used (missing, empty, or incompatible with the current run)."""


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
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        if not saved:
            raise CheckpointError(f"orbax declined to save step {step} in {self.directory}")
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
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
        )
        return step, restored["state"], dict(restored["meta"])

    def close(self) -> None:
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays, for `CheckpointStore.restore`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
