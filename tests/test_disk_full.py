"""Disk full while saving a checkpoint or exporting weights: the write fails with an error, nothing half-written is
ever restored or loaded, and the previous checkpoint and weight version stay usable.

The fault is real, not mocked: a child process runs under RLIMIT_FSIZE (with SIGXFSZ ignored), so every write past
the limit fails inside orbax / tensorstore / safetensors with EFBIG, as on a full disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from _launch import xla_flags

from jaxrl_vlm.checkpoint import CheckpointStore, abstract_like
from jaxrl_vlm.models.hf_io import from_hf

ROOT = Path(__file__).resolve().parents[1]

_CHILD = textwrap.dedent("""
    import resource, signal, sys
    import jax
    import jax.numpy as jnp
    from jaxrl_vlm.checkpoint import CheckpointStore
    from pathlib import Path
    from jaxrl_vlm.models.hf_io import from_hf
    from jaxrl_vlm.tiny import make_tiny
    from jaxrl_vlm.weight_sync import export_version

    ckpt, weights = sys.argv[1], Path(sys.argv[2])
    store = CheckpointStore(ckpt, keep=5)
    store.save(1, {"w": jnp.arange(4.0)}, {"note": "fits"})
    tiny = make_tiny(weights.parent / "tiny", seed=0)
    model = from_hf(tiny)
    export_version(model, weights, 1, copy_from=str(tiny))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))  # from here on: a nearly full disk
    try:
        store.save(2, {"w": jax.random.normal(jax.random.key(0), (1 << 20,))}, {"note": "too big"})  # incompressible
        print("checkpoint: saved")
    except Exception as e:
        print("checkpoint: failed", type(e).__name__, str(e)[:300].replace(chr(10), " "))
    try:
        export_version(model, weights, 2, copy_from=str(tiny))
        print("export: written")
    except OSError as e:
        print("export: failed", type(e).__name__, e.errno)
    sys.stdout.flush()
""")


@pytest.mark.slow
def test_a_full_disk_fails_the_save_and_the_export_and_keeps_the_previous_ones(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt), str(tmp_path / "weights")], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint: failed" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "export: failed OSError 27" in proc.stdout, proc.stdout  # EFBIG, as ENOSPC on a full disk
    # The previous weight version is whole (an engine may load it); the failed one was never renamed into place.
    versions = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert versions[0] == "weights_v000001" and "weights_v000002" not in versions, versions
    assert from_hf(tmp_path / "weights" / "weights_v000001") is not None
    store = CheckpointStore(ckpt, keep=5, read_only=True)
    assert store.steps() == [1]  # the failed step is never listed
    step, state, meta = store.restore(abstract_like({"w": jax.numpy.zeros(4)}))
    assert step == 1 and meta == {"note": "fits"} and np.array_equal(state["w"], np.arange(4.0))
