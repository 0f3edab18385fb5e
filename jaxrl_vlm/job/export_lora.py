"""`jaxrl-vlm export-lora`: a LoRA run's checkpoint as a PEFT adapter directory and a merged HF model.

The run's config (YAML and --flag overrides) names the base checkpoint (--hf-checkpoint) and the adapters
(--lora-*); the checkpoint holds the trained adapters. `OUT/adapter` is what `peft.PeftModel.from_pretrained(base,
OUT/adapter)`, SGLang's `/load_lora_adapter` and vLLM's `/v1/load_lora_adapter` read; `OUT/merged` is an HF model
directory with the adapters merged into the base (fp32), which transformers and every engine load. A finished run
writes the first itself (`final_adapter/`, beside `final_model/`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp

from jaxrl_vlm.checkpoint import CheckpointError, CheckpointStore, abstract_like
from jaxrl_vlm.config import Config, ConfigError
from jaxrl_vlm.distributed import export_hf
from jaxrl_vlm.job.trainer import Trainer
from jaxrl_vlm.lora.export import save_peft_adapter


@dataclass(frozen=True)
class LoraExport:
    step: int
    adapter: Path
    merged: Path | None


def export_checkpoint(cfg: Config, checkpoint: str | Path | None, out: str | Path | None, *, step: int | None = None,
                      merged: bool = True) -> LoraExport:
    """Restore the adapters of `checkpoint` (default OUTPUT_DIR/checkpoints; its latest complete step unless `step`)
    onto the base of `cfg` and write OUT/adapter (and OUT/merged; OUT defaults to OUTPUT_DIR/export). ConfigError
    when the config trains no adapters or the checkpoint has none to restore."""
    if not cfg.lora.enabled:
        raise ConfigError("export-lora: the config trains no adapters (--lora-rank is 0); its final_model/ is the model")
    run_dir = Path(cfg.train.output_dir)
    checkpoint = Path(checkpoint) if checkpoint is not None else run_dir / "checkpoints"
    out = Path(out) if out is not None else run_dir / "export"
    if not checkpoint.is_dir():
        raise ConfigError(f"export-lora: no checkpoint directory {checkpoint} (pass --checkpoint)")
    base = cfg.model.hf_checkpoint
    trainer = Trainer(cfg)
    trainer.build_policy(Path(base))
    store = CheckpointStore(checkpoint, read_only=True)
    try:
        done, state, _ = store.restore(abstract_like(trainer.state), step)
    except CheckpointError as e:  # no step, or another tree: other adapters, a full fine-tuning checkpoint
        raise ConfigError(f"export-lora: {e} (the checkpoint must be this config's run: pass its own config and "
                          "flags)") from e
    finally:
        store.close()
    trainer.state = state
    adapter = save_peft_adapter(trainer.lora, trainer.state.params, out / "adapter", base_model=str(base))
    merged_dir = (export_hf(trainer.policy_model(), out / "merged", dtype=jnp.float32, copy_from=str(base))
                  if merged else None)
    return LoraExport(done, adapter, merged_dir)
