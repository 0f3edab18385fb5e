"""HF checkpoint import/export: transformers reloads our exports bit-identically, round trips are
exact, bf16 and sharded layouts work, bad checkpoints fail with one error naming every bad key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from _hf_tiny import TINY_CONFIGS, TINY_QWEN25_CONFIGS, build_hf_model, hf_logits, is_qwen25, make_batch, random_image, save_hf_model
from jaxrl_vlm.models import (
    CheckpointError,
    ConfigError,
    Qwen3VL,
    from_hf,
    model_class,
    from_hf_dict,
    load_hf_config,
    param_count,
    qwen3_vl_2b_instruct,
    to_hf,
)
from jaxrl_vlm.models.hf_io import abstract_model, current_tensor_name

LOGICAL_AXES = {
    "vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm", "vision_patch", "vision_pos",
    "vision_embed", "vision_heads", "vision_head_dim", "vision_mlp", "vision_merge",
}


@pytest.fixture(scope="module", params=["A", "B", "Q25A", "Q25B"])
def saved(request, tmp_path_factory):
    """(config name, transformers model, its save_pretrained directory)."""
    hf = build_hf_model(request.param)
    return request.param, hf, save_hf_model(hf, tmp_path_factory.mktemp(f"hf_{request.param}"))


def _flat_params(model: Qwen3VL) -> dict:
    return {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _load_hf(path: Path, dtype=torch.float32):
    """transformers' model of the family its config.json names."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    cls = {"qwen3_vl": Qwen3VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}[model_type]
    return cls.from_pretrained(path, dtype=dtype).eval()


def test_export_reloads_in_transformers_bit_identically(saved, tmp_path):
    name, hf, path = saved
    out = to_hf(from_hf(path), tmp_path / "export", dtype=jnp.float32)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) == (not {**TINY_CONFIGS, **TINY_QWEN25_CONFIGS}[name]["tie_word_embeddings"])
    reloaded = _load_hf(out)
    want, got = hf.state_dict(), reloaded.state_dict()
    assert set(want) == set(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key
    batch = make_batch([[4, "img", 6, "img", 3]], [random_image(64, 96, 1), random_image(96, 32, 2)], seed=2,
                       qwen25=is_qwen25(name))
    np.testing.assert_array_equal(hf_logits(reloaded, batch), hf_logits(hf, batch))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["B", "Q25B"])
def test_import_of_export_is_identity(name, tmp_path):
    cfg = from_hf_dict(build_hf_model(name).config.to_dict())  # untied, GQA, 3 vision heads
    model = model_class(cfg)(cfg, rngs=nnx.Rngs(7))
    to_hf(model, tmp_path, dtype=jnp.float32)
    back = from_hf(tmp_path)
    a, b = _flat_params(model), _flat_params(back)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


def test_bf16_export_reloads(saved, tmp_path):
    _, hf, path = saved
    out = to_hf(from_hf(path), tmp_path, dtype=jnp.bfloat16)
    raw = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in raw.values())
    reloaded = _load_hf(out, dtype=torch.bfloat16)
    for key, want in hf.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], want.to(torch.bfloat16)), key
    # our reader parses bf16 bytes: importing gives the bf16-rounded fp32 values
    ours = _flat_params(from_hf(out, param_dtype=jnp.float32))
    ref = _flat_params(from_hf(path))
    for key in ref:
        np.testing.assert_array_equal(ours[key], ref[key].astype(ml_dtypes.bfloat16).astype(np.float32))


def test_sharded_export_with_index(saved, tmp_path):
    _, hf, path = saved
    out = to_hf(from_hf(path), tmp_path, dtype=jnp.float32, max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in hf.state_dict().values()) - (
        hf.lm_head.weight.numel() * 4 if hf.config.tie_word_embeddings else 0
    )
    for shard in shards:
        with safe_open(out / shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == shard}
    reloaded = _load_hf(out)
    for key, want in hf.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], want), key


def test_missing_and_unexpected_keys_give_one_error(saved, tmp_path):
    _, _, path = saved
    tensors = load_file(path / "model.safetensors")
    # transformers saves Qwen2.5-VL under the older names (model.layers.*, visual.*); errors use the current ones.
    on_disk = {current_tensor_name(k): k for k in tensors}
    del tensors[on_disk["model.language_model.layers.1.mlp.up_proj.weight"]]
    tensors["model.visual.blocks.0.attn.extra.weight"] = torch.zeros(2)
    tensors[on_disk["model.language_model.norm.weight"]] = torch.zeros(3)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copyfile(path / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError) as err:
        from_hf(tmp_path)
    msg = str(err.value)
    assert "model.language_model.layers.1.mlp.up_proj.weight" in msg
    assert "model.visual.blocks.0.attn.extra.weight" in msg
    assert "model.language_model.norm.weight: checkpoint (3,)" in msg
    assert str(tmp_path) in msg


def test_released_style_config_loads(saved, tmp_path):
    """Released checkpoints carry rope_theta + rope_scaling instead of rope_parameters."""
    _, hf, path = saved
    conf = json.loads((path / "config.json").read_text())
    rope = conf["text_config"].pop("rope_parameters")
    conf["text_config"]["rope_theta"] = rope.pop("rope_theta")
    conf["text_config"]["rope_scaling"] = rope
    shutil.copyfile(path / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(conf))
    assert load_hf_config(tmp_path) == load_hf_config(path)


def test_shardings_for_receives_logical_names(saved):
    _, _, path = saved
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    seen: list[tuple] = []

    def shardings_for(names):
        seen.append(names)
        spec = jax.sharding.PartitionSpec(*["fsdp" if n in ("embed", "vision_embed") else None for n in names])
        return jax.sharding.NamedSharding(mesh, spec)

    model = from_hf(path, shardings_for=shardings_for)
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert len(seen) == len(list(params))
    assert ("vocab", "embed") in seen and ("embed", "heads", "head_dim") in seen
    emb = model.embed_vd.get_value()
    assert isinstance(emb.sharding, jax.sharding.NamedSharding) and emb.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    np.testing.assert_array_equal(np.asarray(emb), _flat_params(from_hf(path))[("embed_vd",)])


def test_copy_from_keeps_config_and_processor_files(saved, tmp_path):
    _, _, path = saved
    src = tmp_path / "src"
    shutil.copytree(path, src)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 77}')
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "generation_config.json").write_text('{"eos_token_id": 5, "temperature": 0.7}')
    out = to_hf(from_hf(src), tmp_path / "out", copy_from=src)
    for name in ("config.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_every_parameter_has_logical_axis_names(saved):
    _, _, path = saved
    state = nnx.state(abstract_model(load_hf_config(path)), nnx.Param)
    specs = nnx.get_partition_spec(state)
    flat = list(nnx.to_flat_state(state))
    assert flat
    for (p, var), (_, spec) in zip(flat, nnx.to_flat_state(specs)):
        names = var.get_metadata()["out_sharding"]
        assert len(names) == len(var.get_value().shape), p
        assert set(names) <= LOGICAL_AXES, (p, names)
        assert tuple(spec.get_value()) == tuple(names), p


def _independent_2b_count() -> int:
    """Sum of the tensor shapes listed in reference/sglang_api.md section 6 (tied: no lm_head)."""
    vis = 1024 * 3 * 2 * 16 * 16 + 1024 + 2304 * 1024
    block = 2 * 1024 * 2 + (3072 * 1024 + 3072) + (1024 * 1024 + 1024) + (4096 * 1024 + 4096) + (1024 * 4096 + 1024)
    vis += 24 * block
    vis += 2 * 1024 + (4096 * 4096 + 4096) + (2048 * 4096 + 2048)  # merger
    vis += 3 * (2 * 4096 + (4096 * 4096 + 4096) + (2048 * 4096 + 2048))  # deepstack mergers
    layer = 2048 * 2048 + 2 * 1024 * 2048 + 2048 * 2048 + 2 * 128 + 3 * 6144 * 2048 + 2 * 2048
    text = 151936 * 2048 + 28 * layer + 2048
    return vis + text


@pytest.mark.slow
def test_param_count_of_2b_preset():
    n = param_count(qwen3_vl_2b_instruct())
    assert n == _independent_2b_count()
    assert 2.10e9 < n < 2.15e9  # the published "2B" model has about 2.13 B parameters with tied embeddings


def test_config_round_trip_and_validation():
    from transformers import Qwen3VLConfig as HFConfig

    cfg = qwen3_vl_2b_instruct()
    d = cfg.to_hf_dict()
    assert from_hf_dict(d) == cfg
    hf = HFConfig(**d)  # transformers accepts what we write
    assert hf.text_config.rope_parameters["mrope_section"] == [24, 20, 20]
    assert from_hf_dict(hf.to_dict()) == cfg

    def broken(**changes):
        bad = json.loads(json.dumps(d))
        for dotted, value in changes.items():
            sub, key = dotted.split("__")
            bad[sub][key] = value
        return bad

    bad_rope = broken(text_config__rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 10]})
    with pytest.raises(ConfigError, match="mrope_section"):
        from_hf_dict(bad_rope)
    with pytest.raises(ConfigError, match="perfect square"):
        from_hf_dict(broken(vision_config__num_position_embeddings=2300))
    with pytest.raises(ConfigError, match="out_hidden_size"):
        from_hf_dict(broken(vision_config__out_hidden_size=1024))
    with pytest.raises(ConfigError, match="deepstack"):
        from_hf_dict(broken(text_config__num_hidden_layers=2))
