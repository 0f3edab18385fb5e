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
sets) while the engine keeps serving, and `load` runs the same pause -> flush -> update -> continue sequence with
`load_format` IN_MEMORY_LOAD_FORMAT, so the engine swaps them in and reports the same version a disk sync would
set. The weights are rounded through the sync dtype first, so both paths serve the same numbers.

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
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_vlm.distributed import barrier, export_hf, is_main_process
from jaxrl_vlm.engine.weights import load_params_state, merge_adapters
from jaxrl_vlm.lora.adapters import PolicyAdapters, adapter_nbytes, adapters_of
from jaxrl_vlm.lora.export import save_peft_adapter
from rollout.client import EngineError, SGLangClient, WeightSyncError
from rollout.engine_link import MAX_OUTAGES_PER_REQUEST, EngineLost, LinkState
from rollout.sglang_wire import IN_MEMORY_LOAD_FORMAT

logger = logging.getLogger(__name__)

VERSION_PREFIX = "weights_v"
ADAPTER_PREFIX = "lora_v"  # a LoRA version for an engine over HTTP: a PEFT adapter directory


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

    def metrics(self) -> dict[str, float]:
        """The step metrics of this version's publication: export seconds, gigabytes written, in memory (0/1)."""
        return {"sync/export_s": self.export_s, "sync/gbytes": self.bytes_written / 1e9,
                "sync/in_memory": float(self.in_memory), "sync/adapters_only": float(self.adapters_only)}


def version_dir(root: Path, version: int) -> Path:
    return root / f"{VERSION_PREFIX}{version:06d}"


def export_version(model: Any, root: Path, version: int, *, dtype: Any = jnp.bfloat16, copy_from: str | None = None,
                   max_shard_bytes: int = 5 * 1024**3, untie_embeddings: bool = False) -> Path:
    """Export `model` (a `Qwen3VL`) to `root/weights_vNNNNNN/` atomically (temp dir + rename).

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
              untie_embeddings=untie_embeddings)
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
    into every version so each one is also a valid `--model-path` for a cold start.
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
    ):
        if mode not in ("auto", "disk", "memory"):
            raise ValueError(f"weight sync mode must be auto, disk or memory, got {mode!r}")
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

    async def push(self, model: Any, version: int) -> SyncReport:
        """Export `model` as `version` and load it into every engine (all of them, or none: see WeightSyncFailed)."""
        return await self.load(self.export(model, version))

    def memory_engine(self) -> Any:
        """The in-process engine that takes weights in memory, or None (disk). An engine not yet attached (a
        resumed run exports its weights before the engine starts) means disk."""
        engine = getattr(self.client, "local_engine", None) if self.client is not None else None
        if self.mode == "disk" or engine is None or jax.process_count() > 1:
            if self.mode == "memory" and self.client is not None:
                raise WeightSyncFailed("--weight-sync-mode memory needs the embedded engine of a one-process job; "
                                       "this engine is another process (use disk or auto)")
            return None
        return engine

    def export(self, model: Any, version: int) -> SyncReport:
        """Write `model` as `version` (blocking; the asynchronous loop runs it in a worker thread, generation goes
        on meanwhile), or stage it in the in-process engine's memory; `load` then makes the engines take it."""
        t0 = time.perf_counter()
        engine = self.memory_engine()
        lora = adapters_of(model) if self.lora_sync == "auto" else None
        if engine is not None:
            name = version_dir(Path(), version).name
            if lora is not None:
                merged = merge_adapters(self._engine_base(engine), lora.adapters, lora.setup, via_dtype=self.dtype)
                engine.stage_weights(name, merged)
                return SyncReport(version=version, path=Path(name), export_s=time.perf_counter() - t0, sync_s=0.0,
                                  bytes_written=adapter_nbytes(lora.adapters, self.dtype), attempts=0, in_memory=True,
                                  adapters_only=True)
            params = nnx.state(model, nnx.Param)
            engine.stage_weights(name, params, via_dtype=self.dtype)
            # What was staged (in the sync dtype), counted as the adapters are: full and LoRA syncs compare.
            return SyncReport(version=version, path=Path(name), export_s=time.perf_counter() - t0, sync_s=0.0,
                              bytes_written=adapter_nbytes(params, self.dtype), attempts=0, in_memory=True)
        main = jax.process_index() == 0
        if self.client is not None and self.http_adapters(lora):
            path = save_peft_adapter(lora.setup, lora.adapters, self.root / f"{ADAPTER_PREFIX}{version:06d}",
                                     dtype=self.dtype, base_model=self.copy_from)
            return SyncReport(version=version, path=path, export_s=time.perf_counter() - t0, sync_s=0.0,
                              bytes_written=_dir_bytes(path) if main else 0, attempts=0, adapters_only=True)
        untie = self.untie_embeddings or bool(getattr(self.client, "needs_untied_export", False))
        path = export_version(model, self.root, version, dtype=self.dtype, copy_from=self.copy_from,
                              untie_embeddings=untie)
        export_s = time.perf_counter() - t0
        return SyncReport(version=version, path=path, export_s=export_s, sync_s=0.0,
                          bytes_written=_dir_bytes(path) if main else 0, attempts=0)

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
                await self._sync(report)
            finally:
                self._loading = None
                if report.in_memory:  # consumed by a successful update; freed here after a failed one
                    self.client.local_engine.discard_staged(report.path.name)
            await self.confirm(report.version)
        report.sync_s = time.perf_counter() - t1
        if main:
            self._delete_old_versions(keep=report.version)
        self.history.append(report)
        return report

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
        if target.in_memory:
            raise RuntimeError("an in-memory weight version cannot be restored into a restarted engine")
        reported = await self.client.get_weight_versions()
        if all(v == str(target.version) for v in reported.values()):
            return False
        logger.warning("engine(s) report weight version(s) %s after coming back (restarted): pushing version %d "
                       "from %s", reported, target.version, target.path)
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
