"""Export a LoRA run's checkpoint: a PEFT adapter directory and the merged HF model.

    python scripts/export_lora.py configs/color_reveal_lora_tiny.yaml --checkpoint runs/color_reveal_lora_tiny/checkpoints \
        --out runs/color_reveal_lora_tiny/export [--step N] [--flag value ...]

The config (and its --flag overrides) must be the run's: it names the base checkpoint (--hf-checkpoint) and the
adapters (--lora-*). Writes OUT/adapter (adapter_config.json, adapter_model.safetensors: what
`peft.PeftModel.from_pretrained(base, OUT/adapter)`, SGLang's `/load_lora_adapter` and vLLM's `/v1/load_lora_adapter`
read) and OUT/merged (an HF model directory with the adapters merged into the base, fp32).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # noqa: E402

from jaxrl_vlm.checkpoint import CheckpointStore, abstract_like  # noqa: E402
from jaxrl_vlm.config import load_config  # noqa: E402
from jaxrl_vlm.distributed import export_hf  # noqa: E402
from jaxrl_vlm.job.trainer import Trainer  # noqa: E402
from jaxrl_vlm.lora.export import save_peft_adapter  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], usage="%(prog)s [CONFIG] --checkpoint DIR --out DIR "
                                "[--step N] [--flag value ...]")
    p.add_argument("--checkpoint", required=True, help="the run's checkpoint directory (OUTPUT_DIR/checkpoints)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest complete one)")
    p.add_argument("--out", required=True, help="output directory (adapter/ and merged/ are written under it)")
    ns, rest = p.parse_known_args(argv)
    # The run's YAML config comes first, then its --flag overrides (as `jaxrl-vlm train` takes them).
    config = rest.pop(0) if rest and not rest[0].startswith("-") else None
    cfg = load_config(config, rest)
    if not cfg.lora.enabled:
        raise SystemExit(f"{config or 'the config'} trains no adapters (--lora-rank is 0): nothing to export")
    base = cfg.model.hf_checkpoint
    trainer = Trainer(cfg)
    trainer.build_policy(Path(base))
    store = CheckpointStore(ns.checkpoint, read_only=True)
    try:
        step, state, _ = store.restore(abstract_like(trainer.state), ns.step)
    finally:
        store.close()
    trainer.state = state
    out = Path(ns.out)
    adapter = save_peft_adapter(trainer.lora, trainer.state.params, out / "adapter", base_model=str(base))
    merged = export_hf(trainer.policy_model(), out / "merged", dtype=jnp.float32, copy_from=str(base))
    print(f"step {step}: PEFT adapter -> {adapter}; merged model -> {merged}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
