"""Checkpoints are verified on restore (issue 17 row 11-12): a flipped byte in the array data is an error naming
the step and the array, with --load-step to resume from an earlier one; a state that no longer fits the run
(changed model or optimizer) is an error naming the differing arrays and settings."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_vlm.checkpoint import CheckpointError, CheckpointStore, abstract_like, fingerprint
from jaxrl_vlm.config import load_config
from jaxrl_vlm.job.checkpointing import config_changes, restore

PATTERN = np.arange(1, 257, dtype=np.float32) * np.float32(1.0009765625)  # distinctive bytes to find on disk


def _state(step: int) -> dict[str, jnp.ndarray]:
    return {"w": jnp.asarray(PATTERN + step), "b": jnp.full((3,), step, jnp.int32)}


def _flip_a_byte_in_the_data(step_dir: Path) -> None:
    """Flip one bit in the middle of the largest array-data file that a restore reads (the merged OCDBT store's
    `state/d/`; the per-process `ocdbt.process_*` copies are not read back)."""
    data_files = [p for p in (step_dir / "state" / "d").iterdir() if p.is_file()]
    path = max(data_files, key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _rewrite_integrity(step_dir: Path, leaf: str) -> None:
    """Change the recorded fingerprint of one leaf: the arrays now differ from what was written."""
    meta_path = step_dir / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["_integrity"]["fingerprint"][leaf] += 1
    meta_path.write_text(json.dumps(meta))


def test_fingerprint_sees_any_single_bit_and_ignores_nothing():
    x = jnp.asarray(PATTERN)
    base = fingerprint({"x": x})["['x']"]
    flipped = np.array(PATTERN)
    flipped.view(np.uint32)[17] ^= 1 << 3
    assert fingerprint({"x": jnp.asarray(flipped)})["['x']"] != base
    assert fingerprint({"x": x.astype(jnp.bfloat16)})["['x']"] != fingerprint({"x": x})["['x']"]


def test_flipped_byte_is_reported_and_an_earlier_step_restores(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=3)
    for step in (1, 2):
        store.save(step, _state(step), {"note": step})
    store.close()
    _flip_a_byte_in_the_data(tmp_path / "ckpt" / "2")
    reader = CheckpointStore(tmp_path / "ckpt", read_only=True)
    # Depending on where the bit lands, the compressed chunk no longer decodes or decodes to other values.
    with pytest.raises(CheckpointError, match=r"step 2 .* is (corrupt|unreadable).*--load-step.*\[1\]"):
        reader.restore(abstract_like(_state(0)))
    step, state, meta = reader.restore(abstract_like(_state(0)), step=1)
    assert step == 1 and meta == {"note": 1} and np.array_equal(np.asarray(state["w"]), PATTERN + 1)
    # Arrays that decode but differ from what was written are named.
    _rewrite_integrity(tmp_path / "ckpt" / "1", "['w']")
    with pytest.raises(CheckpointError, match=r"step 1 .* is corrupt: the data of 1 array\(s\) changed .*\['w'\]"):
        reader.restore(abstract_like(_state(0)), step=1)
    reader.close()


def test_a_state_that_does_not_fit_names_the_arrays(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=3)
    store.save(1, _state(1), {})
    with pytest.raises(CheckpointError, match=r"\['w'\]: checkpoint float32\[256\], this run float32\[300\]"):
        store.restore({"w": jnp.zeros(300, jnp.float32), "b": jnp.zeros(3, jnp.int32)})
    with pytest.raises(CheckpointError, match=r"\['extra'\]: checkpoint missing"):
        store.restore(abstract_like({**_state(0), "extra": jnp.zeros(2)}))
    store.close()


def test_resume_names_changed_settings_and_honours_load_step(tmp_path):
    before = load_config(None, ["--param-dtype", "float32", "--optimizer", "adamw", "--lr", "1e-5"]).to_dict()
    after = load_config(None, ["--param-dtype", "bfloat16", "--optimizer", "adam", "--lr", "3e-5"]).to_dict()
    assert config_changes(before, after) == ["model.param_dtype: 'float32' -> 'bfloat16'",
                                             "optim.optimizer: 'adamw' -> 'adam'"]  # lr does not shape the state
    store = CheckpointStore(tmp_path / "ckpt", keep=3)
    for step in (1, 2):
        store.save(step, _state(step), {"weight_version": step, "prompt_iterator": {}, "config": before})
    store.close()
    cfg = load_config(None, ["--load", str(tmp_path / "ckpt"), "--load-step", "1"])
    point = restore(cfg, _state(0))
    assert point.step == 1 and point.weight_version == 1
    cfg = load_config(None, ["--load", str(tmp_path / "ckpt"), "--param-dtype", "bfloat16"])
    with pytest.raises(CheckpointError, match=r"does not fit.*settings changed since the checkpoint: model\.param_dtype"):
        restore(cfg, {**_state(0), "w": jnp.zeros(256, jnp.bfloat16)})
