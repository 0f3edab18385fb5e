"""Push new policy weights to the engine(s): versioned HF export + SGLang's disk-reload sequence.

Each version is exported as an HF safetensors directory of its own (`weights_v000012/`), written under a
temporary name and renamed when complete, so an engine never reads a half-written version. Then every
engine (every worker behind a router) runs pause -> flush (retried while busy) -> `/update_weights_from_disk`
with the `weight_version` -> continue (`SGLangClient.sync_weights_from_disk`), and then every engine must report
that version in `/model_info` (an engine that answers success yet keeps other weights is caught here,
not by silently off-policy training). Older versions are deleted only after the engines acknowledged the new one. A sync that still fails after the retries stops the run with a
clear error: training on by stale rollouts silently is worse than stopping.

An external engine that dies and comes back (`SGLangClient.link`, `--engine-reconnect-timeout`) restarts with its
initial weights: `restore` is the link's return hook. It pushes the version the engine must hold (the one being
loaded, else the last one loaded) unless every engine still reports it, and confirms it. A load that the outage
interrupted waits for the link instead of spending its retries, and is done once the restore pushed its version.

In memory (`mode` "memory", or "auto" with our embedded engine in this one-process job): `export` puts the
trainer's parameters straight into the engine replicas' shardings (device to device, also across disjoint device
sets; on the trainer's own devices one compiled cast-and-copy, `engine.weights.place_weights`) while the engine keeps
serving, and `load` runs the same pause -> flush -> update -> continue sequence with `load_format`
IN_MEMORY_LOAD_FORMAT, so the engine swaps them in and reports the same version a disk sync would set. The client
makes those calls on the engine object itself (`SGLangClient.local_engine`: the methods its HTTP handlers call), so
no HTTP round trip is left. The weights are rounded through the sync dtype first, so both paths serve the same
numbers. Where the engine sits on the trainer's devices in the trainer's dtypes (`can_share`: the job checks it when
the engine attaches), the trainer stops donating its parameters to the train step (`Trainer.share_params`) and the
engine serves the trainer's arrays as they are (`share_trainer_arrays`): no copy at all, and no more memory (the
engine held a copy of its own before). Otherwise they are copied once (the cast, or at equal dtypes a copy): a
donated buffer would be deleted under the engine. A retry stages the version again (`SyncReport.restage`): the
failed attempt may have consumed what was staged.

Delta (`mode` "delta", the embedded engine of a one-process job; `jaxrl_vlm.weight_delta`): the syncer keeps a host
snapshot of the bytes the engine holds, in the engine's dtypes (`engine.weights.serving_tensors`). Each version is
encoded against it (only changed elements travel), applied by the engine off to the side (`Engine.stage_delta`),
swapped in by the same pause -> flush -> update -> continue sequence, and confirmed twice: the version, then every
replica's checksum of every tensor against the manifest. The first version goes as a full sync in the same format
(no base), and so does any version whose delta the engine refuses (not its base, weights released) or whose
checksums differ afterwards (`sync/checksum_mismatches` counts those): the run never trains on weights that silently
diverged from the trainer's, and a confirmed delta makes the engine hold the trainer's exact bytes, so no periodic
full resync is needed. A restarted engine serves another version, so its delta is refused and it gets a full sync;
so does a delta refused at the swap (another version swapped in since it was staged) and the retry of a failed
attempt. `sync/full_resyncs` counts the versions sent in full after the first. In process, memory mode stays the
faster one (a delta reads every weight to the host to diff and checksum it, where memory mode makes one device
copy or none), so `auto` keeps memory for the embedded engine.

With a vLLM server (`jaxrl_vlm.vllm_delta`; `auto` means delta there) the same payload goes to the worker extension
the project ships, as a directory beside the exports: the snapshot is of the HF tensors (untied head, sync dtype),
the extension applies the delta in every vLLM worker inside the pause -> flush -> update -> continue sequence, and
its checksums are compared with the manifest; a server without the extension is synced in full, logged once.
SGLang has no delta route (`SGLANG_NO_DELTA`): with `delta` or `auto` it is synced in full, logged once, and every
report says so (`SyncReport.delta_unavailable`, `sync/delta_unavailable`), as for a multi-process job.

LoRA (a model from `Trainer.policy_model` carries its adapters, `lora.adapters.adapters_of`): in memory only the
adapters move; the engine merges them into the base it keeps (read once from `copy_from`, the run's base checkpoint)
on its own devices (`engine.weights.merge_adapters`). An engine reached over HTTP (SGLang, vLLM) serves the adapters
itself: each version is written as a PEFT adapter directory (`lora_v000012/`, atomically), and the same pause ->
flush -> update -> continue sequence loads it under a name of its own (`policy_v000012`: a new name per version, so
no prefix cached under an older adapter is reused), labels the worker's weights with the version
(`/update_weight_version`, which `confirm` and every sample's `weight_version` then read as for a full sync), and
makes every later request select it; the previous adapter is unloaded. `sync/gbytes` is then the adapters' bytes
(in memory, in the sync dtype; on disk, the directory's). Merged into the base instead, and sent whole (`sync/
adapters_only` 0): with `--lora-sync merged`, and for adapters SGLang's and vLLM's LoRA serving does not cover
(`serves_adapters`: the vision tower, `--lora-modules-to-save`, Qwen3.5's linear-attention projections).

Multi-host: every process calls `push` (gathering a sharded parameter is a collective); only process 0
writes files and talks to the engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_vlm import weight_delta
from jaxrl_vlm.distributed import barrier, export_hf, is_main_process
from jaxrl_vlm.engine.weights import aliasable, load_params_state, merge_adapters, param_arrays, serving_tensors
from jaxrl_vlm.lora.adapters import PolicyAdapters, adapter_nbytes, adapters_of
from jaxrl_vlm.lora.export import save_peft_adapter
from jaxrl_vlm.models.freezing import NOTHING_FROZEN, FrozenParts, split_params
from jaxrl_vlm.models.hf_io import write_tensor_subset
from jaxrl_vlm.vllm_delta import VLLMDeltaSync, hf_tensors
from rollout import vllm_wire
from rollout.client import EngineError, SGLangClient, WeightSyncError
from rollout.engine_link import MAX_OUTAGES_PER_REQUEST, EngineLost, LinkState
from rollout.sglang_wire import IN_MEMORY_LOAD_FORMAT

logger = logging.getLogger(__name__)

VERSION_PREFIX = "weights_v"
# --freeze-vision-tower / --freeze-vision-merger: the frozen tensors, copied once out of the first full version on disk
# (a partial checkpoint), for a restarted engine to load before a version that leaves them out.
FROZEN_DIR = "frozen_tensors"
ADAPTER_PREFIX = "lora_v"  # a LoRA version for an engine over HTTP: a PEFT adapter directory


# Why delta mode leaves SGLang on full syncs (read in sglang 0.5.23's http_server.py, io_struct.py and
# model_runner_components/weight_updater.py): it has no --update-weight-delta-* arguments and no route that applies a
# delta; /update_weights_from_tensor takes whole torch tensors serialized by torch.multiprocessing (CUDA IPC handles
# from a process on its node), /update_weights_from_distributed whole tensors over a torch NCCL group, and no route
# answers checksums of the bytes it holds (/get_weights_by_name returns the first 100 values), which the delta's
# confirmation needs.
SGLANG_NO_DELTA = ("SGLang 0.5.23 has no weight-delta route (no --update-weight-delta-* server arguments; "
                   "/update_weights_from_tensor and /update_weights_from_distributed take whole torch tensors over CUDA "
                   "IPC or NCCL) and no route that answers checksums of the weights it holds")


def adapter_name(version: int) -> str:
    """The name a LoRA version is loaded under in SGLang / vLLM (and selected by per request)."""
    return f"policy_v{version:06d}"


# Qwen3.5's gated delta-net projections (`linear_attn.in_proj_qkv`, `in_proj_z`, `in_proj_a`, `in_proj_b`,
# `out_proj`): SGLang 0.5.23's LoRA target list (`SUPPORTED_LORA_TARGET_MODULES`) names none but `out_proj`, and
# vLLM's LoRA on these layers is untested here; an engine that ignored one would sample from another policy than
# the trainer's, silently. They are merged and sent whole until an engine is shown to apply them.
ENGINE_UNSERVED_SITE = ".linear_attn."


def serves_adapters(lora: PolicyAdapters) -> bool:
    """Whether SGLang's and vLLM's LoRA serving covers these adapters: linear layers of the language model's
    attention and MLP only (no vision-tower adapters, no fully trained modules_to_save, which neither engine
    applies, and no linear-attention projections: `ENGINE_UNSERVED_SITE`)."""
    return not lora.setup.saved and not any(site.vision or ENGINE_UNSERVED_SITE in site.module
                                            for site in lora.setup.sites)


class WeightSyncFailed(RuntimeError):
    """The engines did not accept a new weight version after all retries; the run must stop."""


@dataclass
class SyncReport:
    """One weight version's export and load: where it went, how long each took, what it cost and retried."""

    version: int
    path: Path
    export_s: float
    sync_s: float
    bytes_written: int  # written to disk, or staged into the in-process engine (in the sync dtype)
    attempts: int
    errors: list[str] = field(default_factory=list)
    in_memory: bool = False  # staged in the in-process engine under `path.name`, not written to disk
    adapters_only: bool = False  # LoRA: only the adapters moved (`bytes_written` counts them)
    delta: DeltaSync | None = None  # delta mode: what was encoded and how it was confirmed
    # A run that freezes parameters (`models/freezing.py`): the bytes of the frozen tensors this version left out
    # (in the sync dtype; 0 when it carried them, to engines that did not hold them yet). None: nothing is frozen.
    frozen_left_out: int | None = None
    # Delta asked for and this engine takes full syncs only (`WeightSyncer.delta_unavailable`): why.
    delta_unavailable: str | None = None
    # In memory: stages this version in the engine again, for a retry after a failed attempt consumed the staged
    # weights (the swap took them) or had them refused (a delta whose base the engine no longer serves: it goes again
    # in full). Dropped once the load is over: it holds the trainer's arrays.
    restage: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def metrics(self) -> dict[str, float]:
        """The step metrics of this version's publication: export seconds, gigabytes written, in memory (0/1), and in
        delta mode the delta's bytes, changed fraction, time split and checksum mismatches."""
        out = {"sync/export_s": self.export_s, "sync/gbytes": self.bytes_written / 1e9,
               "sync/in_memory": float(self.in_memory), "sync/adapters_only": float(self.adapters_only)}
        if self.delta is not None:
            out.update(self.delta.metrics())
        elif self.delta_unavailable is not None:
            out.update({"sync/delta": 0.0, "sync/delta_unavailable": 1.0})
        if self.frozen_left_out is not None:
            out["sync/frozen_gbytes_left_out"] = self.frozen_left_out / 1e9
        return out


@dataclass
class DeltaSync:
    """A version sent as a weight delta to the in-process engine: its manifest, its encoder's figures and what the
    confirmation found. The payload and the new bytes are held until the engine confirmed them (the new bytes then
    become the snapshot), and not after: the syncer's history keeps every report."""

    manifest: weight_delta.DeltaManifest
    stats: weight_delta.DeltaStats
    delta: weight_delta.WeightDelta | None  # None once confirmed
    tensors: dict[str, Any] | None  # tensor name -> np.ndarray in the engine's dtype; None once confirmed
    apply_s: float = 0.0  # the engine applying it off to the side (`Engine.stage_delta`)
    confirm_s: float = 0.0  # every replica's checksums against the manifest
    write_s: float = 0.0  # writing the payload where it crosses by disk (none in process: it is handed over)
    checksum_mismatches: int = 0  # the syncer's running count, after this version
    full_resyncs: int = 0  # the syncer's running count of versions sent in full after the first, after this one

    @property
    def full(self) -> bool:
        return self.manifest.base_version is None

    def metrics(self) -> dict[str, float]:
        out = self.stats.metrics()
        out.update({"sync/delta": float(not self.full), "sync/apply_s": self.apply_s,
                    "sync/confirm_s": self.confirm_s, "sync/write_s": self.write_s,
                    "sync/checksum_mismatches": float(self.checksum_mismatches),
                    "sync/full_resyncs": float(self.full_resyncs)})
        return out


def version_dir(root: Path, version: int) -> Path:
    return root / f"{VERSION_PREFIX}{version:06d}"


def export_version(model: Any, root: Path, version: int, *, dtype: Any = jnp.bfloat16, copy_from: str | None = None,
                   max_shard_bytes: int = 5 * 1024**3, untie_embeddings: bool = False,
                   leave_out: frozenset[str] = frozenset()) -> Path:
    """Export `model` (a `Qwen3VL`) to `root/weights_vNNNNNN/` atomically (temp dir + rename), without the HF tensors
    `leave_out` (listed as kept: `hf_io.KEPT_TENSORS_FILE`).

    A collective with several processes: every process gathers each tensor, process 0 writes.
    """
    final = version_dir(root, version)
    tmp = final.with_name(final.name + ".partial")
    main = is_main_process()
    if main:
        if tmp.exists():
            shutil.rmtree(tmp)
        root.mkdir(parents=True, exist_ok=True)
    export_hf(model, tmp, dtype=dtype, copy_from=copy_from, max_shard_bytes=max_shard_bytes,
              untie_embeddings=untie_embeddings, leave_out=leave_out)
    if main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    barrier(f"export_version:{final.name}")
    return final


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


class WeightSyncer:
    """Exports each new version and makes every engine load it.

    `copy_from`: the original HF checkpoint directory; its config, tokenizer and processor files are copied
    into every version so each one is also a valid `--model-path` for a cold start (a full version: see `frozen`).

    `frozen` (--freeze-vision-tower / --freeze-vision-merger): parameters that never change. Versions carry them
    until one has been loaded into the engines; later ones leave them out (in memory the engine keeps its arrays; on
    disk the directory lists them as kept, and SGLang's and vLLM's reloads update only the tensors a directory
    has). Their copy in `FROZEN_DIR` goes first to an engine that restarted, before a version without them.
    """

    def __init__(
        self,
        client: SGLangClient | None,
        root: str | Path,
        *,
        copy_from: str | None = None,
        dtype: Any = jnp.bfloat16,
        retries: int = 2,
        retry_wait_s: float = 2.0,
        keep_versions: int = 1,
        flush_timeout_s: float = 60.0,
        flush_poll_s: float = 1.0,
        mode: str = "disk",
        untie_embeddings: bool = False,
        lora_sync: str = "auto",
        delta_bucket_bytes: int = weight_delta.DEFAULT_BUCKET_BYTES,
        frozen: FrozenParts = NOTHING_FROZEN,
    ):
        if mode not in ("auto", "disk", "memory", "delta"):
            raise ValueError(f"weight sync mode must be auto, disk, memory or delta, got {mode!r}")
        if lora_sync not in ("auto", "merged"):
            raise ValueError(f"lora_sync must be auto or merged, got {lora_sync!r}")
        self.mode = mode
        self.lora_sync = lora_sync
        self.client = client
        # Versions carry an explicit LM head (models.hf_io.to_hf): set for a launched vLLM, and whenever the attached
        # client's engine needs it (`needs_untied_export`).
        self.untie_embeddings = untie_embeddings
        self.root = Path(root)
        self.copy_from = copy_from
        self.dtype = dtype
        self.retries = retries
        self.retry_wait_s = retry_wait_s
        self.keep_versions = max(1, keep_versions)
        self.flush_timeout_s = flush_timeout_s
        # Asynchronous training meets requests in flight, which the pause aborts: the first flush is then usually
        # busy for a moment, and a short poll keeps the engine's stop short.
        self.flush_poll_s = flush_poll_s
        self.history: list[SyncReport] = []
        # One weight operation on the engines at a time: a load and the link's restore never interleave.
        self._engine_ops = asyncio.Lock()
        self._loading: SyncReport | None = None  # the version being loaded, which a restore must push
        self.restored_version: int | None = None  # the last version a restore pushed and confirmed
        self._engine_base_state: Any = None  # LoRA in memory: the base the adapters are merged into (first replica)
        self.delta_bucket_bytes = delta_bucket_bytes
        # Delta mode: the bytes the in-process engine holds as last confirmed (None: the next version goes in full).
        self.snapshot: weight_delta.WeightSnapshot | None = None
        self.checksum_mismatches = 0  # delta mode: versions whose checksums differed after the apply
        # Delta mode: versions sent in full after the first (a checksum mismatch, a restarted engine, a refused or
        # missing base, a failed swap).
        self.full_resyncs = 0
        self.frozen = frozen
        self.frozen_held = False  # the engines hold the frozen parameters: a version was loaded into them
        # Delta mode with vLLM (`jaxrl_vlm.vllm_delta`): what its worker extension holds, and its own counts.
        self.vllm_delta = VLLMDeltaSync(self.root, bucket_bytes=delta_bucket_bytes)
        # Delta asked for (`delta`, or `auto` with vLLM) and this engine takes full syncs only: why (logged once;
        # `SyncReport.delta_unavailable`). A vLLM without the extension: `vllm_delta.unsupported`.
        self.full_only: str | None = None
        # In memory: the trainer keeps the arrays it is given to sync (its train step does not donate them,
        # `Trainer.share_params`), so the in-process engine may serve them as they are, with no copy.
        self.share_trainer_arrays = False
        # The in-process engine and the elements of its whole model, read once (its structure never changes).
        self._serving_elements: tuple[Any, int] | None = None

    async def push(self, model: Any, version: int) -> SyncReport:
        """Export `model` as `version` and load it into every engine (all of them, or none: see WeightSyncFailed)."""
        if self.vllm_delta_mode():
            await self.vllm_delta.probe(self.client)  # before the first export: deltas need the extension
        return await self.load(self.export(model, version))

    def vllm_delta_mode(self) -> bool:
        """Deltas to a vLLM server (its worker extension applies them; without one, full syncs): `delta`, and `auto`,
        whose default it is, in a one-process job (`hf_tensors` reads every parameter whole on one process)."""
        return (self.mode in ("delta", "auto") and getattr(self.client, "engine_api", None) == "vllm"
                and jax.process_count() == 1)

    def delta_unavailable(self) -> str | None:
        """Why this engine takes full syncs although deltas were asked for (None: they go, or were not asked for)."""
        return self.vllm_delta.unsupported if self.vllm_delta_mode() else self.full_only

    def _full_syncs_only(self, why: str) -> None:
        """Delta asked for, and this engine cannot take it: say why once; every version then goes in full."""
        if self.full_only is None:
            self.full_only = why
            logger.log(logging.WARNING if self.mode == "delta" else logging.INFO,
                       "weight sync (--weight-sync-mode %s): %s; every version is synced in full (an HF export "
                       "the engine reloads)", self.mode, why)

    def can_share(self, params: Any) -> bool:
        """Whether the in-process engine, synced in memory, can serve some of `params` (the trainer's parameter state)
        as they are: arrays already in its first replica's dtypes and shardings, which rounding through the sync
        dtype leaves unchanged (`engine.weights.aliasable`). The trainer must then stop donating them
        (`Trainer.share_params`) before `share_trainer_arrays` is set."""
        if self.mode not in ("auto", "memory") or getattr(self.client, "local_engine", None) is None:
            return False
        engine = self.memory_engine()
        if engine is None:
            return False
        served = param_arrays(engine.runner.params)
        return any(path in served and aliasable(x, served[path], self.dtype) for path, x in param_arrays(params).items())

    def memory_engine(self) -> Any:
        """The in-process engine that takes weights in memory, or None (disk). An engine not yet attached (a
        resumed run exports its weights before the engine starts) means disk."""
        engine = getattr(self.client, "local_engine", None) if self.client is not None else None
        if self.mode == "disk" or engine is None or jax.process_count() > 1:
            if self.mode == "memory" and self.client is not None:
                raise WeightSyncFailed("--weight-sync-mode memory needs the embedded engine of a one-process job; "
                                       "this engine is another process (use disk or auto)")
            if self.mode in ("delta", "auto") and self.client is not None and not self.vllm_delta_mode():
                # (`auto` means memory for the embedded engine, deltas for vLLM: only those two are "asked for".)
                api = getattr(self.client, "engine_api", "sglang")
                if engine is None and api == "sglang":
                    self._full_syncs_only(SGLANG_NO_DELTA)
                elif jax.process_count() > 1 and (self.mode == "delta" or api == "vllm"):
                    self._full_syncs_only(f"delta sync runs in one-process jobs; this job has "
                                          f"{jax.process_count()} processes")
            return None
        return engine

    def export(self, model: Any, version: int) -> SyncReport:
        """Write `model` as `version` (blocking; the asynchronous loop runs it in a worker thread, generation goes
        on meanwhile), or stage it in the in-process engine's memory; `load` then makes the engines take it."""
        t0 = time.perf_counter()
        engine = self.memory_engine()
        lora = adapters_of(model) if self.lora_sync == "auto" else None
        leave_out = bool(self.frozen) and self.frozen_held
        frozen_left_out = None if not self.frozen else 0
        if engine is not None:
            name = version_dir(Path(), version).name
            if lora is not None:
                merged = merge_adapters(self._engine_base(engine), lora.adapters, lora.setup, via_dtype=self.dtype)
                engine.stage_weights(name, merged)
                return SyncReport(version=version, path=Path(name), export_s=time.perf_counter() - t0, sync_s=0.0,
                                  bytes_written=adapter_nbytes(lora.adapters, self.dtype), attempts=0, in_memory=True,
                                  adapters_only=True, restage=lambda: engine.stage_weights(name, merged))
            if self.mode == "delta":  # frozen tensors never differ from the snapshot: no delta carries them
                delta = self._stage_delta(engine, name, nnx.state(model, nnx.Param), version)
                report = SyncReport(version=version, path=Path(name), export_s=time.perf_counter() - t0, sync_s=0.0,
                                    bytes_written=delta.stats.bytes, attempts=0, in_memory=True, delta=delta)
                report.restage = lambda: self._resend_full(report)
                return report
            # The model itself: the engine reads its parameters through its pytree (no `nnx.state` graph walk).
            params = model
            if leave_out:
                params, frozen = split_params(nnx.state(model, nnx.Param), self.frozen.paths)
                frozen_left_out = adapter_nbytes(frozen, self.dtype)
            share = self.share_trainer_arrays
            engine.stage_weights(name, params, via_dtype=self.dtype, partial=leave_out, may_alias=share)
            # What was staged (in the sync dtype), counted as the adapters are: full and LoRA syncs compare. A whole
            # model's count is the serving model's, read once per engine.
            if leave_out:
                elements = sum(x.size for x in param_arrays(params).values())
            else:
                if self._serving_elements is None or self._serving_elements[0] is not engine:
                    self._serving_elements = (engine, sum(x.size for x in param_arrays(engine.runner.params).values()))
                elements = self._serving_elements[1]
            return SyncReport(version=version, path=Path(name), export_s=time.perf_counter() - t0, sync_s=0.0,
                              bytes_written=elements * jnp.dtype(self.dtype).itemsize, attempts=0, in_memory=True,
                              frozen_left_out=frozen_left_out,
                              restage=lambda: engine.stage_weights(name, params, via_dtype=self.dtype,
                                                                   partial=leave_out, may_alias=share))
        main = jax.process_index() == 0
        if self.client is not None and self.http_adapters(lora):
            path = save_peft_adapter(lora.setup, lora.adapters, self.root / f"{ADAPTER_PREFIX}{version:06d}",
                                     dtype=self.dtype, base_model=self.copy_from)
            return SyncReport(version=version, path=path, export_s=time.perf_counter() - t0, sync_s=0.0,
                              bytes_written=_dir_bytes(path) if main else 0, attempts=0, adapters_only=True)
        if self.vllm_delta_mode() and self.vllm_delta.ready:
            # HF tensors with the untied head a vLLM reload needs; frozen ones never differ, no delta carries them.
            tensors = hf_tensors(model, dtype=self.dtype, untie_embeddings=True)
            enc = self.vllm_delta.encode(tensors, version)
            return SyncReport(version=version, path=enc.path, export_s=time.perf_counter() - t0, sync_s=0.0,
                              bytes_written=enc.stats.bytes, attempts=0,
                              delta=DeltaSync(enc.delta.manifest, enc.stats, enc.delta, tensors, write_s=enc.write_s,
                                              checksum_mismatches=self.vllm_delta.checksum_mismatches,
                                              full_resyncs=self.vllm_delta.full_resyncs))
        untie = self.untie_embeddings or bool(getattr(self.client, "needs_untied_export", False))
        path = export_version(model, self.root, version, dtype=self.dtype, copy_from=self.copy_from,
                              untie_embeddings=untie, leave_out=self.frozen.hf_keys if leave_out else frozenset())
        export_s = time.perf_counter() - t0
        if leave_out:
            frozen_left_out = adapter_nbytes(split_params(nnx.state(model, nnx.Param), self.frozen.paths)[1],
                                             self.dtype)
        return SyncReport(version=version, path=path, export_s=export_s, sync_s=0.0,
                          bytes_written=_dir_bytes(path) if main else 0, attempts=0, frozen_left_out=frozen_left_out,
                          delta_unavailable=self.delta_unavailable())

    def _stage_delta(self, engine: Any, name: str, params: Any, version: int) -> DeltaSync:
        """Encode `params` against the snapshot (none: in full) and have the engine apply it off to the side; a delta
        the engine refuses (it does not hold the snapshot's bytes) goes again in full."""
        new = serving_tensors(params, engine.runner.params, via_dtype=self.dtype)
        for base in ((self.snapshot, None) if self.snapshot is not None else (None,)):
            # compact: the embedded engine reads the format's byte planes and byte gaps.
            delta, stats = weight_delta.encode_delta(base, new, str(version), bucket_bytes=self.delta_bucket_bytes,
                                                     compact=True)
            t0 = time.perf_counter()
            try:
                engine.stage_delta(name, delta)
            except weight_delta.WeightDeltaError as e:
                if base is None:
                    raise
                if isinstance(e, weight_delta.ChecksumMismatch):  # the engine's bytes were not the snapshot's
                    self.checksum_mismatches += 1
                # Also how a restarted engine shows: it serves another version (its startup checkpoint's).
                logger.warning("weight version %d: the engine refused the delta from version %s (%s); sending it in "
                               "full", version, base.version, e)
                self.snapshot = None
                self.full_resyncs += 1
                continue
            return DeltaSync(delta.manifest, stats, delta, new, apply_s=time.perf_counter() - t0,
                             full_resyncs=self.full_resyncs)
        raise AssertionError("unreachable: a full sync either stages or raises")

    def _resend_full(self, report: SyncReport) -> None:
        """Stage delta-mode `report`'s version in full (its held bytes, without a base): after the engine refused
        the delta at the swap (another version was swapped in meanwhile), a failed attempt that consumed what was
        staged, or checksums that differ after the apply. A version already in full is staged again as it is."""
        sync = report.delta
        engine = self.client.local_engine
        full = sync.delta
        if not sync.full:
            full, stats = weight_delta.encode_delta(None, sync.tensors, str(report.version),
                                                    bucket_bytes=self.delta_bucket_bytes)
            # What crossed to the engine for this version: the delta and the full sync.
            sync.stats = dataclasses.replace(stats, bytes=stats.bytes + sync.stats.bytes,
                                             diff_s=stats.diff_s + sync.stats.diff_s,
                                             encode_s=stats.encode_s + sync.stats.encode_s,
                                             checksum_s=stats.checksum_s + sync.stats.checksum_s)
            report.bytes_written += stats.bytes
            self.snapshot = None
            self.full_resyncs += 1
            sync.full_resyncs = self.full_resyncs
        t0 = time.perf_counter()
        engine.stage_delta(report.path.name, full)
        sync.manifest, sync.delta, sync.apply_s = full.manifest, full, sync.apply_s + time.perf_counter() - t0

    async def _confirm_delta(self, report: SyncReport) -> None:
        """Every replica of the in-process engine holds the manifest's checksums; then the snapshot advances. A
        mismatch after a delta resends the version in full (counted); after a full sync it stops the run."""
        sync = report.delta
        engine = self.client.local_engine
        for attempt in ("delta", "full"):
            t0 = time.perf_counter()
            wrong = sorted({name for replica in range(len(engine.runners))
                            for name in weight_delta.checksum_mismatches(sync.manifest,
                                                                         engine.weight_checksums(replica))})
            sync.confirm_s += time.perf_counter() - t0
            if not wrong:
                base = self.snapshot if not sync.full else weight_delta.WeightSnapshot("", {})
                self.snapshot = base.after(sync.delta, sync.tensors)
                sync.checksum_mismatches = self.checksum_mismatches
                sync.delta = sync.tensors = None
                return
            self.checksum_mismatches += 1
            self.snapshot = None
            if sync.full or attempt == "full":
                raise WeightSyncFailed(f"weight version {report.version}: after a full sync the engine still holds "
                                       f"other bytes than the trainer's in {len(wrong)} tensor(s), e.g. {wrong[:3]}")
            logger.warning("weight version %d: after the delta the engine's checksums differ in %d tensor(s), e.g. "
                           "%s; sending it in full", report.version, len(wrong), wrong[:3])
            self._resend_full(report)
            await self._sync(report)
            await self.confirm(report.version)

    def http_adapters(self, lora: PolicyAdapters | None) -> bool:
        """Whether an engine over HTTP is sent these adapters (not the merged model): it must then hold the base."""
        return lora is not None and self.lora_sync == "auto" and serves_adapters(lora)

    def _engine_base(self, engine: Any) -> Any:
        """The base parameters the adapters are merged into, in the first replica's shardings (`stage_weights` copies
        the merged state to the other replicas): the run's base checkpoint (`copy_from`) read once, since the engine
        may serve an earlier version's weights by now (a resumed run's first export goes by disk)."""
        if self._engine_base_state is None:
            runner = engine.runners[0]
            self._engine_base_state = (runner.params if self.copy_from is None
                                       else load_params_state(self.copy_from, runner.cfg, runner.params))
        return self._engine_base_state

    async def load(self, report: SyncReport) -> SyncReport:
        """Make every engine load the exported `report` and confirm its version (no engine attached: export only).

        Also serves a version exported before the engine was attached (a resumed run's own weights)."""
        main = jax.process_index() == 0
        t1 = time.perf_counter()
        if self.client is not None and main:
            self._loading = report
            try:
                if report.delta is not None and not report.in_memory:  # to vLLM's worker extension
                    wrong = await self.vllm_delta.deliver(self.client, report, self._push, self._sync, self.confirm)
                    if wrong:
                        raise WeightSyncFailed(f"weight version {report.version}: after a full sync vLLM still holds "
                                               f"other bytes than the trainer's in {len(wrong)} tensor(s), e.g. "
                                               f"{wrong[:3]}")
                else:
                    await self._sync(report)
                    await self.confirm(report.version)
                    if report.delta is not None:
                        await self._confirm_delta(report)
            finally:
                self._loading = None
                report.restage = None
                if report.in_memory:  # consumed by a successful update; freed here after a failed one
                    self.client.local_engine.discard_staged(report.path.name)
            if self.vllm_delta_mode():  # a resumed run's first version went by disk: deltas from the next one
                await self.vllm_delta.probe(self.client)
            if self.frozen and not self.frozen_held:
                await asyncio.to_thread(self._keep_frozen_copy, report)
                self.frozen_held = True
        report.sync_s = time.perf_counter() - t1
        if main:
            self._delete_old_versions(keep=report.version)
        self.history.append(report)
        return report

    def _keep_frozen_copy(self, report: SyncReport) -> None:
        """After the first version the engines loaded (it carried the frozen tensors): copy them out of it, when it is
        a directory, for a restarted engine (`restore`). In memory a restarted engine cannot be restored anyway."""
        if report.in_memory or report.adapters_only or report.frozen_left_out or report.delta is not None:
            return  # (a delta-synced vLLM is restored from the snapshot, frozen tensors included)
        dest = self.root / FROZEN_DIR
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        write_tensor_subset(report.path, tmp, self.frozen.hf_keys)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)

    async def confirm(self, version: int) -> None:
        """Every engine reports `version` in `/model_info`, or WeightSyncFailed naming the ones that don't."""
        if self.client is None:
            raise RuntimeError("WeightSyncer.confirm needs an attached client")
        try:
            reported = await self.client.get_weight_versions()
        except EngineError as e:
            raise WeightSyncFailed(f"could not read the engines' weight version (expected {version}): {e}") from e
        wrong = {url: v for url, v in reported.items() if v != str(version)}
        if wrong:
            raise WeightSyncFailed(
                f"engines report weight version(s) {wrong}, but the trainer's weights are version {version}; "
                "stopping rather than training on rollouts of other weights")

    async def _push(self, report: SyncReport) -> None:
        if report.in_memory:
            how = {"load_format": IN_MEMORY_LOAD_FORMAT}
        elif report.adapters_only:  # a PEFT adapter directory, loaded under this version's adapter name
            how = {"lora_name": adapter_name(report.version)}
        elif report.delta is not None:  # a weight-delta directory for vLLM's worker extension
            how = {"load_format": vllm_wire.DELTA_LOAD_FORMAT}
        else:
            how = {}
        async with self._engine_ops:
            await self.client.sync_weights_from_disk(
                str(report.path), str(report.version), flush_timeout_s=self.flush_timeout_s,
                flush_poll_s=self.flush_poll_s, **how)

    async def _sync(self, report: SyncReport) -> None:
        link = self.client.link
        attempt = outages = 0
        while attempt <= self.retries:
            attempt += 1
            report.attempts = attempt
            try:
                await self._push(report)
                return
            except (WeightSyncError, EngineError) as e:
                report.errors.append(f"attempt {attempt}: {e}")
                if link is not None and link.armed and link.state is not LinkState.UP:
                    # The engine is lost: wait for it (the restore pushes this version) instead of retrying.
                    outages += 1
                    if outages > MAX_OUTAGES_PER_REQUEST:
                        raise EngineLost(link.url, f"weight version {report.version}: the engine at {link.url} was "
                                                   f"lost {outages} times during its load; errors: {report.errors}")
                    logger.warning("weight sync of version %d interrupted by the loss of the engine; waiting for it",
                                   report.version)
                    attempt -= 1
                    await link.wait_up()  # raises EngineLost when it does not come back
                    if self.restored_version == report.version:
                        return
                    continue
                logger.warning("weight sync of version %d failed (attempt %d): %s", report.version, attempt, e)
                if attempt <= self.retries:
                    if report.restage is not None:
                        # In process: what was staged may be gone (the failed swap took it, or refused a delta whose
                        # base is no longer served); stage it again (a delta in full). The engine's own calls have
                        # waited already (flush, update timeouts): nothing to wait out.
                        await asyncio.to_thread(report.restage)
                    else:
                        await asyncio.sleep(self.retry_wait_s)
        raise WeightSyncFailed(
            f"engines did not load weight version {report.version} from {report.path} after {report.attempts} attempts; "
            f"stopping rather than training on stale rollouts. Errors: {report.errors}"
        )

    async def restore(self) -> bool:
        """The engine link's return hook: make a returned engine hold the version it must hold (the one being loaded,
        else the last one loaded), unless every engine still reports it (a blip, not a restart). Returns whether the
        weights were pushed; raises when the engine fails again (the link then probes on)."""
        target = self._loading or (self.history[-1] if self.history else None)
        if target is None:
            raise RuntimeError("the engine came back before any weights were loaded into it: nothing to restore")
        if target.delta is not None and not target.in_memory:  # a delta-synced vLLM: the snapshot goes in full
            restored = await self.vllm_delta.restore(self.client, target, self._push, self.confirm)
            if restored is not None:
                self.restored_version = restored
            return restored is not None
        if target.in_memory:
            raise RuntimeError("an in-memory weight version cannot be restored into a restarted engine")
        reported = await self.client.get_weight_versions()
        if all(v == str(target.version) for v in reported.values()):
            return False
        logger.warning("engine(s) report weight version(s) %s after coming back (restarted): pushing version %d "
                       "from %s", reported, target.version, target.path)
        if target.frozen_left_out:  # the restarted engine holds its startup checkpoint's: put the trainer's back
            await self._push(dataclasses.replace(target, path=self.root / FROZEN_DIR))
        await self._push(target)
        await self.confirm(target.version)
        self.restored_version = target.version
        return True

    def _delete_old_versions(self, keep: int) -> None:
        """Remove versions older than the newest `keep_versions` ones (only ever after a successful sync)."""
        current = {version_dir(self.root, keep).name, f"{ADAPTER_PREFIX}{keep:06d}"}
        for prefix in (VERSION_PREFIX, ADAPTER_PREFIX):
            versions = sorted(p for p in self.root.glob(f"{prefix}*") if p.is_dir() and not p.name.endswith(".partial"))
            for path in versions[: -self.keep_versions]:
                if path.name not in current:
                    shutil.rmtree(path, ignore_errors=False)
