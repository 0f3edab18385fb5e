"""The vLLM worker extension's side of delta weight sync (issue 52, item 2's vLLM bullet), without vLLM.

- Its reader of the delta format (`jaxrl_vlm_worker.decode_delta`, numpy only: it cannot import the project) gives
  exactly the bytes `jaxrl_vlm.weight_delta.apply_delta` gives, on directories `weight_delta.save_delta` wrote:
  sparse chunks with 16-, 32- and 64-bit gaps, dense chunks, tensors split over buckets, a full sync, unchanged
  tensors; and it refuses what the project's reader refuses, with the same error names.
- The extension's state machine (version, checksums, what it asks the model to load), with the model load stubbed.
- It is named the same on both sides (rollout/vllm_wire.py), and the launcher passes it with its PYTHONPATH.
- The attach probe's decision on log-probs at two temperatures (`vllm_wire.logprobs_mode_of`).

The real server runs the same extension in tests/vllm_real/test_vllm_delta.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import sys

import ml_dtypes
import numpy as np
import pytest

from jaxrl_vlm import weight_delta as wd
from jaxrl_vlm.vllm_ext import EXTENSION_DIR
from jaxrl_vlm.vllm_ext import jaxrl_vlm_worker as ext
from jaxrl_vlm.vllm_launcher import VLLMProcess
from rollout import vllm_wire

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(f"<u{array.dtype.itemsize}").copy()


def _held(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, tuple[str, tuple[int, ...]]]]:
    """The extension's view of tensors: flat raw bits, and (safetensors dtype, shape)."""
    return ({k: _bits(v) for k, v in tensors.items()},
            {k: (wd.dtype_name(v.dtype), tuple(v.shape)) for k, v in tensors.items()})


def _moved(array: np.ndarray, positions: list[int] | np.ndarray) -> np.ndarray:
    out = array.copy().reshape(-1)
    out[positions] = (out[positions].astype(np.float32) + 0.5).astype(array.dtype)
    return out.reshape(array.shape)


def _versions(tmp_path):
    rng = np.random.default_rng(0)
    v3 = {"wide": np.zeros((300_000,), BF16), "f32": rng.normal(size=(40, 9)).astype(np.float32),
          "f16": rng.normal(size=(7, 11)).astype(np.float16), "dense": rng.normal(size=(64, 33)).astype(BF16),
          "same": rng.normal(size=(5,)).astype(BF16)}
    v4 = dict(v3)
    v4["wide"] = _moved(v3["wide"], [3, 5, 70_005, 70_010, 250_000, 250_001])  # a gap > 65,535: 32-bit gaps
    v4["f32"] = _moved(v3["f32"], rng.choice(360, 20, replace=False))
    v4["f16"] = _moved(v3["f16"], [0, 76])
    v4["dense"] = _moved(v3["dense"], np.arange(0, 64 * 33, 2))  # half of it: dense beats positions + values
    return v3, v4


def _same_as_project(directory, held_tensors: dict[str, np.ndarray], version: str | None) -> dict[str, np.ndarray]:
    """Both readers on one directory: the extension's new bits equal weight_delta's new bytes."""
    held, meta = _held(held_tensors)
    manifest, new = ext.decode_delta(str(directory), held, meta, version)
    want = wd.apply_delta(held_tensors, wd.load_delta(directory), version)
    assert sorted(new) == sorted(want)
    for name, array in want.items():
        assert new[name].tobytes() == array.tobytes(), name
        assert ext.checksum(new[name]) == wd.tensor_checksum(array)
    assert manifest["target_version"] == wd.load_delta(directory).manifest.target_version
    return new


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_the_extension_reads_a_delta_exactly_as_weight_delta_applies_it(tmp_path, bucket_bytes):
    v3, v4 = _versions(tmp_path)
    delta, _ = wd.encode_delta(wd.WeightSnapshot("3", v3), v4, "4", bucket_bytes=bucket_bytes)
    encodings = {t.name: t.encoding for t in delta.manifest.tensors}
    assert encodings == {"wide": wd.Encoding.SPARSE, "f32": wd.Encoding.SPARSE, "f16": wd.Encoding.SPARSE,
                         "dense": wd.Encoding.DENSE, "same": wd.Encoding.UNCHANGED}
    index = {c.record.index_dtype for b in delta.buckets for c in b}
    assert {"U16", "U32", None} <= index
    new = _same_as_project(wd.save_delta(delta, tmp_path / "d"), v3, "3")
    assert "same" not in new
    if bucket_bytes == 64:
        assert len(delta.buckets) > 5


def test_sixty_four_bit_gaps_and_a_full_sync_read_the_same(tmp_path):
    v3, v4 = _versions(tmp_path)
    delta, _ = wd.encode_delta(wd.WeightSnapshot("3", v3), v4, "4")
    # No tensor here is big enough for a gap past 2**32: widen one chunk's gaps to 64 bits, as the format allows.
    (bucket,) = delta.buckets
    k = next(i for i, c in enumerate(bucket) if c.record.index_dtype == "U32")
    wide = dataclasses.replace(bucket[k], record=dataclasses.replace(bucket[k].record, index_dtype="U64"),
                               gaps=bucket[k].gaps.astype(np.uint64))
    chunks = (*bucket[:k], wide, *bucket[k + 1:])
    manifest = delta.manifest
    record = dataclasses.replace(manifest.buckets[0], chunks=tuple(c.record for c in chunks),
                                 nbytes=sum(c.nbytes for c in chunks))
    widened = wd.WeightDelta(dataclasses.replace(manifest, buckets=(record,)), (chunks,))
    _same_as_project(wd.save_delta(widened, tmp_path / "u64"), v3, "3")
    full, _ = wd.encode_delta(None, v4, "4", bucket_bytes=1000)
    new = _same_as_project(wd.save_delta(full, tmp_path / "full"), {}, None)
    assert sorted(new) == sorted(v4)


@pytest.mark.parametrize("bucket_bytes", [256, 1 << 20])
def test_the_extension_reads_compact_deltas_exactly_as_weight_delta_applies_them(tmp_path, bucket_bytes):
    """Byte planes and 8-bit gaps (with fillers and wide one-element chunks): what an RL step's bf16 change, mostly
    an ulp in the low byte, is encoded as; the extension writes the same bytes as the project's reader."""
    v3, v4 = _versions(tmp_path)
    rng = np.random.default_rng(1)
    ulp = np.zeros((120_000,), BF16) + np.asarray(rng.normal(size=120_000), BF16)
    bits = _bits(ulp)
    moved = np.sort(rng.choice(bits.size, 1500, replace=False))  # gaps of ~80 on average, some past 255
    bits[moved] += 1  # one ulp: only the low byte changes (bar a carry)
    v3["ulp"], v4["ulp"] = ulp, bits.view(BF16)
    v4["wide"] = _moved(v3["wide"], [3, 5, 70_005, 70_010, 250_000, 250_001, 299_999])  # a gap too wide to bridge
    delta, _ = wd.encode_delta(wd.WeightSnapshot("3", v3), v4, "4", bucket_bytes=bucket_bytes, compact=True)
    assert set(delta.manifest.features) == {"byte-planes", "u8-gaps"}
    assert {t.name: t.encoding for t in delta.manifest.tensors}["ulp"] == wd.Encoding.PLANES
    assert "U8" in {c.record.index_dtype for b in delta.buckets for c in b}
    new = _same_as_project(wd.save_delta(delta, tmp_path / "compact"), v3, "3")
    assert new["ulp"].tobytes() == bits.tobytes()


def test_the_extension_refuses_what_weight_delta_refuses(tmp_path):
    v3, v4 = _versions(tmp_path)
    compact = wd.save_delta(wd.encode_delta(wd.WeightSnapshot("3", v3), v4, "4", compact=True)[0], tmp_path / "c")
    manifest = json.loads((compact / "manifest.json").read_text())
    (compact / "manifest.json").write_text(json.dumps({**manifest, "features": [*manifest["features"], "zstd"]}))
    with pytest.raises(ext.MalformedDelta, match=r"needs the features \['zstd'\]"):  # so the trainer goes full
        ext.decode_delta(str(compact), *_held(v3), "3")
    path = wd.save_delta(wd.encode_delta(wd.WeightSnapshot("3", v3), v4, "4")[0], tmp_path / "d")
    held, meta = _held(v3)
    with pytest.raises(ext.BaseMismatch, match="applies to version 3; this worker holds version 2"):
        ext.decode_delta(str(path), held, meta, "2")
    with pytest.raises(ext.BaseMismatch):  # a restarted worker holds nothing
        ext.decode_delta(str(path), {}, {}, None)
    corrupt = dict(held, f32=held["f32"].copy())
    corrupt["f32"][7] ^= 1  # one bit of the base differs: the result cannot be the trainer's
    with pytest.raises(ext.ChecksumMismatch, match="differ from the trainer's bytes"):
        ext.decode_delta(str(path), corrupt, meta, "3")
    with pytest.raises(wd.ChecksumMismatch):
        wd.apply_delta({**v3, "f32": corrupt["f32"].view(np.float32).reshape(40, 9)}, wd.load_delta(path), "3")
    (path / "bucket-00000.safetensors").unlink()
    with pytest.raises(ext.MalformedDelta, match="not a readable safetensors file"):
        ext.decode_delta(str(path), held, meta, "3")
    assert {e.kind for e in (ext.BaseMismatch(), ext.MalformedDelta(), ext.ChecksumMismatch())} == {
        c.__name__ for c in (wd.BaseMismatch, wd.MalformedDelta, wd.ChecksumMismatch)}


class _Runner:
    def __init__(self):
        self.model = type("Model", (), {"packed_modules_mapping": {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}})()

    def get_model(self):
        return self.model


class _Worker(ext.WeightDeltaExtension):
    """The extension with vLLM's model load stubbed: records what it would load."""

    def __init__(self):
        self.model_runner = _Runner()
        self.loads: list[tuple[list[str], list[str]]] = []

    def _jaxrl_vlm_load(self, model, tensors, meta, load, rest):
        self.loads.append((list(load), list(rest)))
        return 0


def test_the_extension_loads_whole_layers_and_tracks_its_version(tmp_path):
    rng = np.random.default_rng(3)
    names = [f"layers.0.attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + ["layers.0.norm.weight"]
    v1 = {n: rng.normal(size=(4, 4)).astype(BF16) for n in names}
    v2 = dict(v1, **{"layers.0.attn.k_proj.weight": _moved(v1["layers.0.attn.k_proj.weight"], [5])})
    worker = _Worker()
    assert worker.jaxrl_vlm_delta_state() == {"format": wd.FORMAT, "version": None, "tensors": 0}
    full = wd.save_delta(wd.encode_delta(None, v1, "1")[0], tmp_path / "v1")
    answer = worker.jaxrl_vlm_apply_delta(str(full))
    assert answer["ok"] and answer["version"] == "1" and worker.loads[-1] == (names, [])
    delta = wd.save_delta(wd.encode_delta(wd.WeightSnapshot("1", v1), v2, "2")[0], tmp_path / "v2")
    answer = worker.jaxrl_vlm_apply_delta(str(delta))
    assert answer["ok"] and answer["version"] == "2" and answer["changed"] == 1
    # k changed: q, k and v go together (vLLM loads them into one fused layer); o_proj and the norm stay.
    assert worker.loads[-1] == (names[:3], names[3:])
    want = wd.tensor_checksums(v2)
    assert worker.jaxrl_vlm_checksums()["checksums"] == want
    assert worker.jaxrl_vlm_checksums(recompute=True) == {"version": "2", "checksums": want}
    again = worker.jaxrl_vlm_apply_delta(str(delta))  # its base is gone: refused, nothing changed
    assert again == {"ok": False, "error": "BaseMismatch", "message": again["message"]}
    assert worker.jaxrl_vlm_delta_state()["version"] == "2" and len(worker.loads) == 2
    applied = vllm_wire.delta_applied_of(again)
    assert applied.refusal is vllm_wire.DeltaRefusal.BASE_MISMATCH


def test_layer_groups_follow_vllms_fused_layers():
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    names = ["m.l.0.self_attn.q_proj.weight", "m.l.0.self_attn.q_proj.bias", "m.l.0.self_attn.v_proj.weight",
             "m.l.0.mlp.gate_proj.weight", "m.l.0.mlp.up_proj.weight", "m.l.0.mlp.down_proj.weight",
             "m.l.1.mlp.experts.0.down_proj.weight", "m.l.1.mlp.experts.7.gate_proj.weight",
             "m.l.1.mlp.experts.gate_up_proj", "v.blocks.0.attn.qkv.weight", "v.blocks.0.attn.qkv.bias"]
    assert ext.layer_groups(names, packed) == {
        "m.l.0.self_attn.qkv_proj": names[:3], "m.l.0.mlp.gate_up_proj": names[3:5], "m.l.0.mlp.down_proj": names[5:6],
        "m.l.1.mlp.experts": names[6:9], "v.blocks.0.attn.qkv": names[9:]}


def test_both_sides_name_the_extension_alike_and_the_launcher_passes_it(monkeypatch, tmp_path):
    assert (ext.STATE_METHOD, ext.APPLY_METHOD, ext.CHECKSUMS_METHOD) == (
        vllm_wire.DELTA_STATE_METHOD, vllm_wire.DELTA_APPLY_METHOD, vllm_wire.DELTA_CHECKSUMS_METHOD)
    assert (ext.FORMAT, ext.CHECKSUM, ext.MANIFEST_NAME) == (wd.FORMAT, wd.CHECKSUM, wd.MANIFEST_NAME)
    assert set(ext.ITEMSIZE) == set(wd.DTYPES) and all(wd.DTYPES[k].itemsize == v for k, v in ext.ITEMSIZE.items())
    for method in (vllm_wire.DELTA_STATE_METHOD, vllm_wire.DELTA_APPLY_METHOD, vllm_wire.DELTA_CHECKSUMS_METHOD):
        assert callable(getattr(ext.WeightDeltaExtension, method))
    # vLLM resolves the class by its dotted name from the directory the launcher puts on PYTHONPATH.
    module, cls = vllm_wire.WORKER_EXTENSION_CLS.rsplit(".", 1)
    monkeypatch.syspath_prepend(str(EXTENSION_DIR))
    monkeypatch.delitem(sys.modules, module, raising=False)
    assert getattr(importlib.import_module(module), cls).__name__ == ext.WeightDeltaExtension.__name__
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    server = VLLMProcess("python", str(tmp_path), extra_args=["--dtype", "float32"], log_path=tmp_path / "log")
    assert server.extra_args[-2:] == [vllm_wire.WORKER_EXTENSION_FLAG, vllm_wire.WORKER_EXTENSION_CLS]
    assert server.extra_env["PYTHONPATH"].split(":") == [str(EXTENSION_DIR), "/elsewhere"]
    assert server.extra_env["VLLM_SERVER_DEV_MODE"] == "1"
    own = VLLMProcess("python", str(tmp_path), extra_args=["--worker-extension-cls=my.Ext"], log_path=tmp_path / "log")
    assert [a for a in own.extra_args if "worker-extension" in a] == ["--worker-extension-cls=my.Ext"]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    return z - (z.max() + np.log(np.exp(z - z.max()).sum()))


def _answers(values_at) -> dict[float, dict[int, float]]:
    """T -> the top-5 candidates of values_at(T) (a full-vocabulary array), as vLLM's probe answer gives them."""
    out = {}
    for t in vllm_wire.PROBE_TEMPERATURES:
        values = values_at(t)
        top = np.argsort(-values)[:vllm_wire.PROBE_TOP_LOGPROBS]
        out[t] = {int(i): float(values[i]) for i in top}
    return out


@pytest.mark.parametrize("spread", [0.05, 3.0, 40.0])
def test_the_probe_tells_tempered_log_probs_from_raw_ones(spread):
    z = np.random.default_rng(4).normal(0, spread, 1024)
    z[17] += 2 * spread  # a clear favourite, as a trained model has
    mode = vllm_wire.logprobs_mode_of
    assert mode(_answers(lambda t: _log_softmax(z / t))) is vllm_wire.LogprobsMode.TEMPERED
    assert mode(_answers(lambda t: _log_softmax(z))) is vllm_wire.LogprobsMode.UNTEMPERED  # raw_logprobs
    assert mode(_answers(lambda t: z)) is vllm_wire.LogprobsMode.UNTEMPERED  # raw_logits
    assert mode(_answers(lambda t: z / t + 1.0)) is vllm_wire.LogprobsMode.NOT_LOGPROBS  # processed_logits
    problem = vllm_wire.logprobs_mode_problem(vllm_wire.LogprobsMode.UNTEMPERED)
    assert "\n" not in problem and problem.endswith("start vLLM with --logprobs-mode processed_logprobs")
    assert vllm_wire.logprobs_mode_problem(vllm_wire.LogprobsMode.TEMPERED) is None


def test_the_probe_does_not_guess_when_the_candidates_are_tied():
    flat = {t: {1: -math.log(1024), 2: -math.log(1024)} for t in vllm_wire.PROBE_TEMPERATURES}
    assert vllm_wire.logprobs_mode_of(flat) is vllm_wire.LogprobsMode.UNKNOWN
    answer = {"choices": [{"logprobs": {"content": [{"token_id": 9, "logprob": -1.5, "top_logprobs": [
        {"token_id": 3, "logprob": -0.5, "rank": 1}, {"token_id": 9, "logprob": -1.5, "rank": 2}]}]}}]}
    assert vllm_wire.probe_logprobs_of(answer) == {3: -0.5, 9: -1.5}
    body = vllm_wire.logprobs_probe_body(0.5, "r")
    assert body["sampling_params"]["logprobs"] == vllm_wire.PROBE_TOP_LOGPROBS and body["output_mode"] == "tokens"
