"""What a launched SGLang or vLLM server needs to serve this run's adapters (`--launch-sglang` / `--launch-vllm` with
`--lora-rank`): LoRA enabled, a maximum rank that fits, and (vLLM) runtime adapter loading. The user's own server
arguments win: a flag they already pass is not added. No jax here.

An external engine (`--engine-url`) must be started this way by the user: SGLang with `--enable-lora
--max-lora-rank R --lora-target-modules ...`, vLLM with `--enable-lora --max-lora-rank R` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (docs/guides/lora.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxrl_vlm.lora.options import ALL_LINEAR, LoraOptions

# vLLM accepts only these --max-lora-rank values (vllm/config/lora.py, MaxLoRARanks).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM serves /v1/load_lora_adapter and /v1/unload_lora_adapter only with this set.
VLLM_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def engine_serves(options: LoraOptions) -> bool:
    """Whether the engines are sent the adapters (not the merged model), judged from the options alone: SGLang's and
    vLLM's LoRA serving covers the language model's linear layers, not the vision tower or modules_to_save."""
    return options.enabled and options.lora_sync == "auto" and not options.lora_vision and not options.lora_modules_to_save


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _missing(args: Sequence[str], wanted: list[tuple[str, list[str]]]) -> list[str]:
    out: list[str] = []
    for flag, values in wanted:
        if not _given(args, flag):
            out += [flag, *values]
    return out


def sglang_lora_args(options: LoraOptions, given: Sequence[str]) -> list[str]:
    """SGLang's LoRA server arguments that `given` lacks: adapters loaded at run time need the rank bound and the
    target modules up front (`all`, or the targets' last names: SGLang matches module names by them)."""
    if not engine_serves(options):
        return []
    targets = (["all"] if ALL_LINEAR in options.lora_target_modules
               else sorted({t.rsplit(".", 1)[-1] for t in options.lora_target_modules}))
    return _missing(given, [("--enable-lora", []), ("--max-lora-rank", [str(options.lora_rank)]),
                            ("--lora-target-modules", targets)])


def vllm_lora_args(options: LoraOptions, given: Sequence[str]) -> list[str]:
    """vLLM's LoRA server arguments that `given` lacks: the smallest --max-lora-rank vLLM accepts that holds the
    rank, and two adapters per batch (requests of the old and the new version may meet in one batch)."""
    if not engine_serves(options):
        return []
    rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= options.lora_rank), None)
    if rank is None:
        raise ValueError(f"--lora-rank {options.lora_rank}: vLLM serves adapters of rank <= {VLLM_MAX_LORA_RANKS[-1]}; "
                         "use --lora-sync merged")
    return _missing(given, [("--enable-lora", []), ("--max-lora-rank", [str(rank)]), ("--max-loras", ["2"])])
