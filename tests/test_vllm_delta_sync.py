"""The trainer's side of delta sync to vLLM (`WeightSyncer` in delta mode, `jaxrl_vlm.vllm_delta`) against a fake
vLLM client whose worker is the real extension class with the model load stubbed: what goes in full and what is
counted when a worker holds another version, refuses a delta, or answers other checksums; a server without the
extension is named once. The real server runs the happy paths and both restarts (tests/vllm_real/test_vllm_delta.py).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxrl_vlm import weight_delta as wd
from jaxrl_vlm.vllm_ext import jaxrl_vlm_worker as ext
from jaxrl_vlm.weight_sync import DeltaSync, SyncReport, WeightSyncer, WeightSyncFailed
from rollout import vllm_wire
from rollout.client import WeightSyncError
from rollout.vllm_client import DeltaUnsupported

BF16 = np.dtype(ml_dtypes.bfloat16)
URL = "http://vllm:8000"


class _Worker(ext.WeightDeltaExtension):
    def __init__(self):
        self.model_runner = type("Runner", (), {"get_model": lambda self: object()})()
        self.loaded: list[list[str]] = []

    def _jaxrl_vlm_load(self, model, tensors, meta, load, rest):
        self.loaded.append(list(load))
        return 0


class FakeVLLM:
    """The calls the syncer makes on a `VLLMClient`, answered by one extension worker in this process."""

    engine_api = "vllm"
    link = None

    def __init__(self, extension: bool = True):
        self.worker_urls = [URL]
        self.url = URL
        self.worker = _Worker()
        self.extension = extension
        self.version = "default"
        self.wrong_checksum: str | None = None  # answer a wrong checksum for this tensor (once)

    async def delta_states(self, url=None):
        if not self.extension:
            raise DeltaUnsupported(URL, "/collective_rpc jaxrl_vlm_delta_state answered HTTP 500")
        return (vllm_wire.delta_state_of(self.worker.jaxrl_vlm_delta_state()),)

    async def delta_checksums(self, url=None, *, recompute=False):
        version, checksums = vllm_wire.delta_checksums_of(self.worker.jaxrl_vlm_checksums(recompute))
        if self.wrong_checksum is not None:
            checksums[self.wrong_checksum], self.wrong_checksum = "0" * 64, None
        return [(version, checksums)]

    async def sync_weights_from_disk(self, path, version, *, load_format=None, **_):
        assert load_format == vllm_wire.DELTA_LOAD_FORMAT
        answer = vllm_wire.delta_applied_of(self.worker.jaxrl_vlm_apply_delta(path))
        if answer.refusal is not None:
            raise WeightSyncError({URL: f"{answer.refusal.value}: {answer.message}"})
        self.version = version

    async def get_weight_versions(self):
        return {URL: self.version}


def _tensors(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {f"model.layers.{i}.mlp.up_proj.weight": rng.normal(size=(32, 16)).astype(BF16) for i in range(3)}
    for k, name in enumerate(sorted(out)):
        for s in range(1, step + 1):  # each version moves two of the three tensors
            if (s + k) % 3:
                out[name].reshape(-1)[s + k] = BF16.type(float(s + 1))
    return out


def _syncer(client, tmp_path) -> WeightSyncer:
    return WeightSyncer(client, tmp_path / "weights", mode="delta", retries=0, retry_wait_s=0.0)


async def _send(syncer: WeightSyncer, version: int) -> SyncReport:
    """What `WeightSyncer.export` builds for vLLM in delta mode (from the model's HF tensors), then `load`."""
    tensors = _tensors(version)
    await syncer.vllm_delta.probe(syncer.client)
    enc = syncer.vllm_delta.encode(tensors, version)
    report = SyncReport(version=version, path=enc.path, export_s=0.0, sync_s=0.0, bytes_written=enc.stats.bytes,
                        attempts=0, delta=DeltaSync(enc.delta.manifest, enc.stats, enc.delta, tensors))
    return await syncer.load(report)


def _sent(reports: list[SyncReport]) -> list[tuple[bool, int, int]]:
    """Per version: sent in full, then the running counts of checksum mismatches and of full resyncs."""
    return [(r.delta.full, r.delta.checksum_mismatches, r.delta.full_resyncs) for r in reports]


def test_deltas_follow_a_full_sync_and_a_worker_without_the_base_gets_it_in_full(tmp_path):
    client = FakeVLLM()
    syncer = _syncer(client, tmp_path)

    async def run():
        reports = [await _send(syncer, v) for v in (1, 2)]
        client.worker.__dict__.pop("_jaxrl_vlm_state")  # a restarted server: its extension holds nothing
        reports += [await _send(syncer, v) for v in (3, 4)]
        return reports

    reports = asyncio.run(run())
    assert _sent(reports) == [(True, 0, 0), (False, 0, 0), (True, 0, 1), (False, 0, 1)]
    assert client.worker.jaxrl_vlm_checksums(recompute=True)["checksums"] == wd.tensor_checksums(_tensors(4))
    assert syncer.vllm_delta.snapshot.version == "4" and client.version == "4"
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["delta_v000004"]
    # A full sync loads every tensor into the model, a delta only those it changes.
    assert [len(names) for names in client.worker.loaded] == [3, 2, 3, 2]
    metrics = reports[1].metrics()
    assert metrics["sync/delta"] == 1.0 and metrics["sync/bytes"] < metrics["sync/full_bytes"]


def test_a_refused_delta_and_other_checksums_after_it_each_send_the_version_in_full(tmp_path):
    client = FakeVLLM()
    syncer = _syncer(client, tmp_path)

    async def run():
        reports = [await _send(syncer, 1)]
        # The worker's bytes drifted under the same version: the delta's checksums cannot come out right.
        state = client.worker.__dict__["_jaxrl_vlm_state"]
        name = sorted(state.tensors)[0]
        state.tensors[name] = state.tensors[name].copy()
        state.tensors[name][0] ^= 1
        reports.append(await _send(syncer, 2))
        client.wrong_checksum = sorted(state.tensors)[1]  # the next answer disagrees once
        reports.append(await _send(syncer, 3))
        return reports

    reports = asyncio.run(run())
    assert _sent(reports) == [(True, 0, 0), (True, 1, 1), (True, 2, 2)]
    assert client.worker.jaxrl_vlm_checksums(recompute=True)["checksums"] == wd.tensor_checksums(_tensors(3))


def test_checksums_that_differ_after_a_full_sync_stop_the_run(tmp_path):
    client = FakeVLLM()
    syncer = _syncer(client, tmp_path)

    async def run():
        await _send(syncer, 1)
        client.wrong_checksum = "model.layers.0.mlp.up_proj.weight"
        original = client.delta_checksums

        async def always_wrong(url=None, *, recompute=False):
            client.wrong_checksum = "model.layers.0.mlp.up_proj.weight"
            return await original(url, recompute=recompute)

        client.delta_checksums = always_wrong
        await _send(syncer, 2)

    with pytest.raises(WeightSyncFailed, match="after a full sync vLLM still holds other bytes"):
        asyncio.run(run())


def test_a_server_without_the_extension_is_named_once_and_synced_in_full(tmp_path, caplog):
    client = FakeVLLM(extension=False)
    syncer = _syncer(client, tmp_path)
    assert syncer.vllm_delta_mode()
    with caplog.at_level(logging.WARNING, logger="jaxrl_vlm.vllm_delta"):
        assert not asyncio.run(syncer.vllm_delta.probe(client))
        assert not asyncio.run(syncer.vllm_delta.probe(client))
    (record,) = caplog.records
    assert "no weight-delta extension" in record.message and vllm_wire.WORKER_EXTENSION_CLS in record.message
    assert not syncer.vllm_delta.ready  # `export` then writes a full HF version for reload_weights


class FakeSGLang:
    """The calls the syncer makes on an `SGLangClient` of an external SGLang (no `engine_api`, no local engine)."""

    link = None
    local_engine = None

    def __init__(self):
        self.worker_urls = [URL]
        self.loads: list[tuple[str, str, dict]] = []

    async def sync_weights_from_disk(self, path, version, *, flush_timeout_s, flush_poll_s, **how):
        self.loads.append((path, version, how))  # `how`: a load_format or lora_name, none for a full sync

    async def get_weight_versions(self):
        return {URL: self.loads[-1][1]}


@pytest.mark.parametrize("mode", ["delta", "auto"])
def test_sglang_keeps_full_syncs_named_once_and_counted_in_the_metrics(tmp_path, caplog, monkeypatch, mode):
    """SGLang 0.5.23 has no delta route: `delta` (and `auto`, which means delta where an engine takes it) syncs every
    version in full through the disk, logs why once naming the routes it lacks, and the metrics say so."""
    from jaxrl_vlm import weight_sync

    def export_version(model, root, version, **kw):  # the full HF export, without a model
        path = weight_sync.version_dir(root, version)
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"x" * 10)
        return path

    monkeypatch.setattr(weight_sync, "export_version", export_version)
    client = FakeSGLang()
    syncer = WeightSyncer(client, tmp_path / "weights", mode=mode, retries=0)
    with caplog.at_level(logging.INFO, logger="jaxrl_vlm.weight_sync"):
        reports = [asyncio.run(syncer.push(type("Model", (), {})(), v)) for v in (1, 2)]
    (record,) = [r for r in caplog.records if "SGLang" in r.message]
    assert record.levelno == (logging.WARNING if mode == "delta" else logging.INFO)
    assert "/update_weights_from_tensor" in record.message and "--update-weight-delta-" in record.message
    assert [(Path(p).name, v, how) for p, v, how in client.loads] == [("weights_v000001", "1", {}),
                                                                      ("weights_v000002", "2", {})]
    for r in reports:
        m = r.metrics()
        assert m["sync/delta"] == 0.0 and m["sync/delta_unavailable"] == 1.0 and m["sync/in_memory"] == 0.0
        assert r.delta is None and not r.in_memory
    disk = WeightSyncer(client, tmp_path / "disk", mode="disk")
    assert disk.memory_engine() is None and disk.delta_unavailable() is None


def test_auto_means_deltas_for_vllm(tmp_path):
    """`auto` (the default) sends deltas to a vLLM with the extension, as `delta` does; one without it is synced in
    full, and why is what the metrics' `sync/delta_unavailable` stands for."""
    syncer = WeightSyncer(FakeVLLM(), tmp_path / "weights", mode="auto", retries=0)
    assert syncer.vllm_delta_mode() and syncer.memory_engine() is None
    reports = [asyncio.run(_send(syncer, v)) for v in (1, 2)]
    assert [r.delta.full for r in reports] == [True, False] and syncer.delta_unavailable() is None
    bare = WeightSyncer(FakeVLLM(extension=False), tmp_path / "bare", mode="auto", retries=0)
    assert not asyncio.run(bare.vllm_delta.probe(bare.client))
    assert "/collective_rpc" in bare.delta_unavailable()
