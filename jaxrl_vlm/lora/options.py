"""The LoRA options a user sets, declared once (default, bounds, help); the run config composes them as its `lora`
section (YAML keys and `--flags` are the field names). No jax here: the config imports it."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.options import opt

ALL_LINEAR = "all-linear"


@dataclass
class LoraOptions:
    """Low-rank adapters on the policy's linear layers; rank 0 trains every parameter (full fine-tuning)."""

    lora_rank: int = opt(0, "LoRA rank r (0: no adapters, full fine-tuning). With r > 0 only the adapters train and "
                            "get optimizer state; the base weights are frozen in --compute-dtype.", ge=0)
    lora_alpha: float = opt(16.0, "LoRA alpha: the adapter update is scaled by alpha / r (PEFT's lora_alpha).", gt=0.0)
    lora_dropout: float = opt(
        0.0, "Rank dropout of the adapters while training: each of the r components is dropped with this "
             "probability per micro-batch (survivors scaled by 1/(1-p)). It is not PEFT's input dropout: the adapters "
             "are applied as a weight update, so the model code stays the engine's.", ge=0.0, lt=1.0)
    lora_plus_lr_ratio: float = opt(
        1.0, "LoRA+ (Hayou et al. 2024): lora_B learns at this multiple of --lr, lora_A and the modules to save at "
             "--lr itself (schedule and weight decay alike); 1 is plain LoRA. With B starting at zero and A random, "
             "a slower A keeps the random input directions B learns against from being rewritten by Adam's "
             "full-size steps (the paper uses 16 for Adam).", gt=0.0)
    lora_target_modules: list[str] = opt(
        [ALL_LINEAR], f"Linear layers that get adapters: '{ALL_LINEAR}' (every linear of the text decoder; the LM head "
                      "and embeddings never) or HF module names, matched as PEFT does (a name or a '.'-suffix of "
                      "one: q_proj, mlp.down_proj, model.language_model.layers.0.self_attn.v_proj).")
    lora_modules_to_save: list[str] = opt(
        [], "Modules trained in full beside the adapters, as PEFT's modules_to_save (names matched like "
            "--lora-target-modules; their weight and bias tensors, e.g. the final norm model.language_model.norm). "
            "They are part of the trained state, the sync and the PEFT export.")
    lora_sync: str = opt(
        "auto", "What a weight sync sends the engine: 'auto' the adapters alone wherever the engine serves them (the "
                "embedded engine merges them into its base in memory; SGLang and vLLM load each version as a PEFT "
                "directory, lora_vNNNNNN/, selected per request) and the merged model elsewhere (adapters on the "
                "vision tower or --lora-modules-to-save, which their LoRA serving does not cover); 'merged' always "
                "the merged model.", choices=("auto", "merged"))
    lora_vision: bool = opt(False, "Adapters also on the vision tower and the patch mergers (their linears that match "
                                   "--lora-target-modules), and on the patch embedding's convolution when named "
                                   "(patch_embed.proj: all-linear leaves it out).")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.lora_rank
