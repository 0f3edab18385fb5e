"""Model families as plug-ins: the registry keyed by model_type, what each family must provide, and the rules
that keep a family one self-contained file (numerics are checked against transformers elsewhere:
`test_model_parity.py`, `test_qwen2_5_vl.py`, `test_engine.py`)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_vlm.engine import forward
from jaxrl_vlm.models.config import FAMILY_PARSERS, ConfigError, from_hf_dict
from jaxrl_vlm.models.families import FAMILIES, DecodeCache, FamilyModel, family, family_model, family_of
from jaxrl_vlm.models.hf_io import model_class, weight_links
from jaxrl_vlm.tiny import init_tiny_model, tiny_model_config

ROOT = Path(__file__).resolve().parents[1]
MODEL_TYPES = sorted(FAMILIES)


def test_the_registry_holds_both_families_and_is_what_the_config_offers():
    assert {"qwen3_vl", "qwen2_5_vl"} <= set(MODEL_TYPES)
    assert FAMILY_PARSERS == {name: f.from_hf_dict for name, f in FAMILIES.items()}
    with pytest.raises(KeyError, match="registered"):
        family("no_such_family")
    with pytest.raises(ConfigError, match="not supported"):
        from_hf_dict({"model_type": "no_such_family"})


def test_the_registry_and_the_configs_import_without_jax():
    code = ("import sys; from jaxrl_vlm.models import families; from jaxrl_vlm.models.config import preset_config; "
            "f = families.family('qwen2_5_vl'); assert families.family_of(preset_config('qwen2_5_vl_3b')) is f; "
            "assert 'jax' not in sys.modules and 'flax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_each_family_builds_its_model_and_names_every_parameter_once(model_type: str):
    cfg = tiny_model_config(arch=model_type)
    fam = family_of(cfg)
    assert fam.model_type == model_type and isinstance(cfg, fam.config_class)
    impl = family_model(cfg)
    assert isinstance(impl, FamilyModel) and model_class(cfg) is impl.model_class
    model = init_tiny_model(cfg, seed=0)
    params = {path for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    linked = [path for link in weight_links(cfg) for path in link.ours]
    assert sorted(map(str, linked)) == sorted(map(str, params))  # every parameter has exactly one HF source
    keys = [link.hf_key for link in weight_links(cfg)]
    assert len(set(keys)) == len(keys)
    assert len({impl.stored_tensor_name(k) for k in keys}) == len(keys)  # export names stay distinct


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_engine_reaches_the_model_only_through_its_family(model_type: str):
    """forward.* are the family's own functions on a cache that honours the DecodeCache protocol."""
    cfg = tiny_model_config(arch=model_type)
    model = init_tiny_model(cfg, seed=0)
    cache = forward.init_cache(cfg, 4, 8, 2, jnp.float32)
    assert isinstance(cache, DecodeCache) and (cache.num_pages, cache.page_size) == (4, 8)
    tokens = jnp.asarray([[5, 6, 7, 0]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (3, 1, 4))
    table = jnp.asarray([0, 4], jnp.int32)
    args = (jnp.int32(0), table, jnp.int32(0), tokens, positions, jnp.int32(3), None)
    cache_a, logits_a = forward.prefill(model, cache, *args)
    cache_b, logits_b = family_model(cfg).prefill(model, cache, *args)
    np.testing.assert_array_equal(np.asarray(logits_a), np.asarray(logits_b))
    step = (jnp.asarray([0], jnp.int32), table[None], jnp.asarray([8], jnp.int32), jnp.asarray([3], jnp.int32),
            jnp.asarray([0], jnp.int32))
    _, dec_a = forward.decode(model, cache_a, *step)
    _, dec_b = family_model(cfg).decode(model, cache_b, *step)
    np.testing.assert_array_equal(np.asarray(dec_a), np.asarray(dec_b))
    copied = forward.copy_page(cache_a, jnp.int32(0), jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(copied.k[:, 1]), np.asarray(cache_a.k[:, 0]))
    # Recurrent state (a hybrid family) moves between rows with copy_state; a full-attention cache has none.
    moved = forward.copy_state(cache_a, jnp.int32(0), jnp.int32(1))
    if cache.state_rows:
        for before, after in zip(jax.tree.leaves(cache_a), jax.tree.leaves(moved)):
            if after.shape[0] == cache.state_rows:  # a per-row state array: row 1 is now row 0's
                np.testing.assert_array_equal(np.asarray(after[1]), np.asarray(before[0]))
    else:
        assert moved is cache_a


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


# A family may build on the one family it extends, as transformers' modular files derive it: Qwen3.5-MoE is Qwen3.5's
# hybrid stack (layers, tower, engine functions) with MoE MLPs. Any other import across families is an error.
EXTENDS = {"jaxrl_vlm.models.qwen3_5_moe": {"jaxrl_vlm.models.qwen3_5"}}


def test_no_family_file_imports_another_family_and_no_shared_module_imports_a_family():
    family_modules = {f.model_module for f in FAMILIES.values()}
    for name in family_modules:
        others = family_modules - {name} - EXTENDS.get(name, set())
        assert not _imports(ROOT / (name.replace(".", "/") + ".py")) & others, f"{name} imports another family"
    shared = ["jaxrl_vlm/models/layers.py", "jaxrl_vlm/models/paged_kv.py", "jaxrl_vlm/models/hf_links.py",
              "jaxrl_vlm/models/hf_io.py", "jaxrl_vlm/engine/forward.py", "jaxrl_vlm/engine/runner.py",
              "jaxrl_vlm/rl/train_step.py", "jaxrl_vlm/tiny.py"]
    for rel in shared:
        assert not _imports(ROOT / rel) & family_modules, f"{rel} names a family's module"
