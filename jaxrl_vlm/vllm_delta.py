"""Delta weight sync to a vLLM server: the trainer's side of the project's worker extension.

`jaxrl_vlm/vllm_ext/jaxrl_vlm_worker.py` runs inside vLLM's workers (`--worker-extension-cls`, passed by
`--launch-vllm`) and applies `jaxrl_vlm.weight_delta` directories to the HF-named tensors it holds. This side keeps
the matching host snapshot: the HF tensors (export names, untied head, the sync dtype) that the server last
confirmed, under their weight version. Each version is encoded against it, written next to the weight exports
(`delta_v000012/`, a directory the server reads: the same filesystem, as the disk sync needs), applied through
`/collective_rpc` inside the usual pause -> flush -> update -> continue sequence (`VLLMClient.update_weights_from_disk`
with `load_format` `DELTA_LOAD_FORMAT`), and confirmed by every worker's checksums against the manifest.
`WeightSyncer` (weight_sync.py) drives it in `--weight-sync-mode delta` and decides the full syncs: the first
version, a server whose extension holds another version than the delta's base (restarted: it holds none), a delta it
refuses, and checksums that differ after an apply.

A vLLM without the extension (an external server started without it) answers the state probe with an error: the
run then syncs it in full by HF export + `reload_weights`, and says why once.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_vlm import weight_delta
from jaxrl_vlm.models.families import family_model
from jaxrl_vlm.models.hf_io import weight_links
from jaxrl_vlm.vllm_ext import EXTENSION_DIR
from rollout import vllm_wire
from rollout.client import EngineError, WeightSyncError
from rollout.vllm_client import DeltaUnsupported

logger = logging.getLogger(__name__)

DELTA_PREFIX = "delta_v"


def delta_dir(root: Path, version: int) -> Path:
    return root / f"{DELTA_PREFIX}{version:06d}"


def hf_tensors(model: Any, *, dtype: Any = jnp.bfloat16, untie_embeddings: bool = False) -> dict[str, np.ndarray]:
    """The tensors `models.hf_io.to_hf` writes for `model`, byte for byte: HF stored names (in its order), torch
    layouts, `dtype`, and with `untie_embeddings` an explicit `lm_head.weight` for a tied model. One process: every
    parameter is pulled whole to the host."""
    cfg = model.cfg
    np_dtype = np.dtype(jnp.dtype(dtype))
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    links = weight_links(cfg)
    if untie_embeddings and cfg.tie_word_embeddings:
        (embed,) = [link for link in links if link.hf_key.endswith("language_model.embed_tokens.weight")]
        links = [*links, dataclasses.replace(embed, hf_key="lm_head.weight")]
    stored = family_model(cfg).stored_tensor_name
    out: dict[str, np.ndarray] = {}
    for link in links:
        parts = [np.asarray(jax.device_get(params[p].get_value())) for p in link.ours]
        out[stored(link.hf_key)] = np.ascontiguousarray(link.to_hf(parts).astype(np_dtype, copy=False))
    return out


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One version encoded and written for the server: the delta, its figures, its directory, the write seconds."""

    delta: weight_delta.WeightDelta
    stats: weight_delta.DeltaStats
    path: Path
    write_s: float


class VLLMDeltaSync:
    """The snapshot of what a vLLM server's extension holds, and the calls that encode, check and confirm against it.

    `snapshot` is None until a version is confirmed, and again after anything that leaves the server's bytes
    unknown; the next version then goes in full."""

    def __init__(self, root: Path, *, bucket_bytes: int = weight_delta.DEFAULT_BUCKET_BYTES) -> None:
        self.root = Path(root)
        self.bucket_bytes = bucket_bytes
        self.snapshot: weight_delta.WeightSnapshot | None = None
        self.unsupported: str | None = None  # why the server takes full syncs only (None: the extension answered)
        self.probed = False
        # Versions whose bytes on a worker were not the trainer's (a delta refused by a worker that held its base,
        # checksums that differed after an apply), and versions sent in full after the first (those, and a worker
        # without the delta's base: restarted).
        self.checksum_mismatches = 0
        self.full_resyncs = 0

    @property
    def ready(self) -> bool:
        """The extension answered on every worker: versions go as deltas."""
        return self.probed and self.unsupported is None

    async def probe(self, client: Any) -> bool:
        """Ask every worker once whether it runs the extension; without it, log once why syncs stay full."""
        if not self.probed:
            try:
                for url in client.worker_urls:
                    await client.delta_states(url)
            except DeltaUnsupported as e:
                self.unsupported = str(e)
                logger.warning(
                    "delta weight sync: the vLLM at %s has no weight-delta extension (%s); its weights are "
                    "synced in full (HF export + reload_weights). Start it with %s %s and %s on its PYTHONPATH "
                    "(--launch-vllm does) for delta syncs", e.url, e.reason, vllm_wire.WORKER_EXTENSION_FLAG,
                    vllm_wire.WORKER_EXTENSION_CLS, EXTENSION_DIR)
            self.probed = True
        return self.unsupported is None

    def encode(self, tensors: dict[str, np.ndarray], version: int, *, full: bool = False) -> Encoded:
        """`tensors` as a delta from the snapshot (in full without one, with `full`, or when the tensors are not the
        snapshot's), written to `delta_v{version}/`."""
        base = None if full else self.snapshot
        try:
            # compact: the worker extension reads the byte planes and 8-bit gaps (an older one refuses them by name,
            # and the trainer falls back to a full sync).
            delta, stats = weight_delta.encode_delta(base, tensors, str(version), bucket_bytes=self.bucket_bytes,
                                                     compact=True)
        except weight_delta.BaseMismatch as e:  # other tensors than the snapshot's: the server needs them all
            logger.warning("weight version %d: %s; sending it in full", version, e)
            delta, stats = weight_delta.encode_delta(None, tensors, str(version), bucket_bytes=self.bucket_bytes)
        t0 = time.perf_counter()
        path = weight_delta.save_delta(delta, delta_dir(self.root, version))
        return Encoded(delta, stats, path, time.perf_counter() - t0)

    def encode_snapshot(self) -> Encoded:
        """The confirmed snapshot in full (its own version): what a restarted server must hold again."""
        if self.snapshot is None:
            raise RuntimeError("no weight version was confirmed yet: nothing to send a restarted vLLM")
        return self.encode(self.snapshot.tensors, int(self.snapshot.version), full=True)

    async def stale_workers(self, client: Any, base: str) -> dict[str, list[str | None]]:
        """The workers whose extension holds another version than `base` (None: nothing, as after a restart), and
        what they hold."""
        out: dict[str, list[str | None]] = {}
        for url in client.worker_urls:
            held = [s.version for s in await client.delta_states(url)]
            if any(v != base for v in held):
                out[url] = held
        return out

    async def mismatches(self, client: Any, manifest: weight_delta.DeltaManifest) -> list[str]:
        """The tensors whose checksum, on any worker, is not the manifest's (empty: every worker holds the trainer's
        bytes of this version)."""
        wrong: set[str] = set()
        for url in client.worker_urls:
            for version, checksums in await client.delta_checksums(url):
                if version != manifest.target_version:
                    return [f"<every tensor: worker {url} holds version {version}>"]
                wrong.update(weight_delta.checksum_mismatches(manifest, checksums))
        return sorted(wrong)

    def confirmed(self, delta: weight_delta.WeightDelta, tensors: dict[str, np.ndarray]) -> None:
        """Every worker holds `delta`'s target: its tensors become the snapshot; older delta directories go."""
        base = self.snapshot if delta.manifest.base_version is not None else weight_delta.WeightSnapshot("", {})
        self.snapshot = base.after(delta, tensors)
        keep = delta_dir(self.root, int(delta.manifest.target_version)).name
        for path in self.root.glob(f"{DELTA_PREFIX}*"):
            if path.is_dir() and path.name != keep:
                shutil.rmtree(path)

    def _resend_full(self, report: Any) -> None:
        """Turn `report` (a `weight_sync.SyncReport` carrying a `DeltaSync`) into this version in full: what crossed
        for it so far stays counted (bytes, encode and write seconds), and so does the resync."""
        sync = report.delta
        self.snapshot = None
        self.full_resyncs += 1
        sync.full_resyncs = self.full_resyncs
        enc = self.encode(sync.tensors, report.version, full=True)
        sync.write_s += enc.write_s
        before = sync.stats
        sync.stats = dataclasses.replace(enc.stats, bytes=enc.stats.bytes + before.bytes,
                                         diff_s=enc.stats.diff_s + before.diff_s,
                                         encode_s=enc.stats.encode_s + before.encode_s,
                                         checksum_s=enc.stats.checksum_s + before.checksum_s)
        sync.manifest, sync.delta = enc.delta.manifest, enc.delta
        report.path = enc.path
        report.bytes_written += enc.stats.bytes

    async def deliver(self, client: Any, report: Any, push: Callable[[Any], Awaitable[None]],
                      sync: Callable[[Any], Awaitable[None]], confirm: Callable[[int], Awaitable[None]]) -> list[str]:
        """Make every worker hold `report`'s version (a `SyncReport` whose `delta` this class encoded): a delta
        whose base a worker does not hold, or that a worker refuses, or whose checksums differ afterwards, goes again
        in full (`full_resyncs`; the last two also count in `checksum_mismatches`). `push` is one pause -> flush ->
        apply -> continue, `sync` the same with the syncer's retries and engine-loss handling, `confirm` checks the
        served weight version.
        Returns the tensors that still differ after a full sync (empty: confirmed, and the snapshot advanced)."""
        delta_sync = report.delta
        if not delta_sync.full:
            stale = await self.stale_workers(client, delta_sync.manifest.base_version)
            if stale:
                logger.warning("weight version %d: vLLM worker(s) hold weight-delta version(s) %s, not the delta's base "
                               "%s (restarted?); sending it in full", report.version, stale,
                               delta_sync.manifest.base_version)
                self._resend_full(report)
        t0 = time.perf_counter()
        if delta_sync.full:
            await sync(report)
        else:
            try:
                await push(report)  # one try: a refused delta is not retried, it goes in full
            except (WeightSyncError, EngineError) as e:
                # Every worker held the delta's base (checked above): a refusal says its bytes are not the snapshot's.
                self.checksum_mismatches += 1
                delta_sync.checksum_mismatches = self.checksum_mismatches
                logger.warning("weight version %d: the delta was not applied (%s); sending it in full", report.version,
                               e)
                self._resend_full(report)
                await sync(report)
        await confirm(report.version)
        delta_sync.apply_s += time.perf_counter() - t0
        while True:
            t1 = time.perf_counter()
            wrong = await self.mismatches(client, delta_sync.manifest)
            delta_sync.confirm_s += time.perf_counter() - t1
            if not wrong:
                self.confirmed(delta_sync.delta, delta_sync.tensors)
                delta_sync.delta = delta_sync.tensors = None
                # The running counts after this version (a restore may have counted one since it was encoded).
                delta_sync.checksum_mismatches, delta_sync.full_resyncs = self.checksum_mismatches, self.full_resyncs
                return []
            self.checksum_mismatches += 1
            delta_sync.checksum_mismatches = self.checksum_mismatches
            self.snapshot = None
            if delta_sync.full:
                return wrong
            logger.warning("weight version %d: after the delta, vLLM's checksums differ in %d tensor(s), e.g. %s; "
                           "sending it in full", report.version, len(wrong), wrong[:3])
            self._resend_full(report)
            t0 = time.perf_counter()
            await sync(report)
            await confirm(report.version)
            delta_sync.apply_s += time.perf_counter() - t0

    async def restore(self, client: Any, target: Any, push: Callable[[Any], Awaitable[None]],
                      confirm: Callable[[int], Awaitable[None]]) -> int | None:
        """The engine link's return hook for a delta-synced vLLM (`target`: the version being loaded, else the last
        loaded): a server whose extension still holds the snapshot's version was a blip (None). A restarted one
        gets the confirmed snapshot in full, or `target` itself when it is the first, full version and nothing was
        confirmed yet; returns the version it now holds (counted in `full_resyncs`)."""
        held = self.snapshot.version if self.snapshot is not None else None
        if held is not None and not await self.stale_workers(client, held):
            return None
        if self.snapshot is None:
            if not target.delta.full or target.delta.delta is None:
                raise RuntimeError("a restarted vLLM needs a full weight version, and none is at hand")
            report = target
        else:
            enc = self.encode_snapshot()
            report = dataclasses.replace(target, version=int(self.snapshot.version), path=enc.path)
            manifest = enc.delta.manifest
        logger.warning("the vLLM at %s came back without the weights it held (restarted): sending version %d in full",
                       client.url, report.version)
        self.full_resyncs += 1
        await push(report)
        await confirm(report.version)
        if self.snapshot is not None:
            wrong = await self.mismatches(client, manifest)
            if wrong:
                raise RuntimeError(f"after restoring weight version {report.version} in full, vLLM's checksums "
                                   f"differ in {len(wrong)} tensor(s), e.g. {wrong[:3]}")
        return report.version
