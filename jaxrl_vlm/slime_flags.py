"""slime's command line, understood: every flag of slime's geo3k VLM multi-turn run maps onto our settings or is
accepted with the reason it does not apply here.

A slime user brings their run line unchanged. Flags whose name is also ours (`--lr`, `--eps-clip-high`, ...) are
ours and mean the same; this table holds the others. Each entry says how many values the flag takes (slime's
argparse `nargs`), how it translates into our fields (`{field: raw value}`, coerced and checked by the config
like any other value), and a one-line note that the run logs once, so the user sees what became of the flag.

This module imports neither the config nor jax (the config imports it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxrl_vlm.sglang_launcher import RENAMED_SERVER_FLAGS

Values = list[str]
Translation = dict[str, Any]


class SlimeFlagError(ValueError):
    """A slime flag whose value has no meaning here (for example context parallelism > 1)."""


@dataclass(frozen=True)
class SlimeFlag:
    """One slime flag: `nargs` 0 (a switch), 1, or "+" (one or more values, slime's `nargs='+'`)."""

    nargs: int | str
    note: str
    translate: Callable[[Values], Translation]
    group: str = "misc"

    @property
    def applies(self) -> bool:
        """False for flags accepted only to be logged as not applicable."""
        return self.translate is not _NOTHING

    @property
    def fields(self) -> tuple[str, ...]:
        """The run-config options this flag sets: those its translation declares with `_writes` (the reference
        lists them; a test checks they are options)."""
        return getattr(self.translate, "fields", ())


def _writes(*fields: str) -> Callable[[Callable[[Values], Translation]], Callable[[Values], Translation]]:
    """Declare, on a translation function, the options it writes (`SlimeFlag.fields`)."""

    def mark(fn: Callable[[Values], Translation]) -> Callable[[Values], Translation]:
        fn.fields = fields  # type: ignore[attr-defined]
        return fn

    return mark


def _not_applicable(values: Values) -> Translation:
    return {}


_NOTHING = _not_applicable


def _one(field_name: str, convert: Callable[[str], Any] = str) -> Callable[[Values], Translation]:
    return _writes(field_name)(lambda values: {field_name: convert(values[0])})


def _switch(**fields: Any) -> Callable[[Values], Translation]:
    return _writes(*fields)(lambda values: dict(fields))


def _must_equal(flag: str, allowed: float, instead: str) -> Callable[[Values], Translation]:
    """A size or rate that has only one meaningful value here; anything else names what exists instead."""

    def check(values: Values) -> Translation:
        try:
            ok = float(values[0]) == allowed
        except ValueError:
            ok = False
        if not ok:
            raise SlimeFlagError(f"{flag} {values[0]}: not supported here ({instead})")
        return {}

    return check


# Megatron's --recompute-granularity values -> our --remat policy for every layer.
_RECOMPUTE_GRANULARITY = {"full": "full", "selective": "dots"}


@_writes("remat")
def _recompute_granularity(values: Values) -> Translation:
    if values[0] not in _RECOMPUTE_GRANULARITY:
        raise SlimeFlagError(f"--recompute-granularity {values[0]}: Megatron's choices are "
                             f"{sorted(_RECOMPUTE_GRANULARITY)}")
    return {"remat": _RECOMPUTE_GRANULARITY[values[0]]}


@_writes("image_key")
def _multimodal_keys(values: Values) -> Translation:
    try:
        mapping = json.loads(values[0])
    except json.JSONDecodeError as e:
        raise SlimeFlagError(f"--multimodal-keys: not JSON ({e}); slime's form is '{{\"image\": \"images\"}}'") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise SlimeFlagError(f"--multimodal-keys must be a JSON object of column names, got {values[0]!r}")
    unknown = sorted(set(mapping) - {"image"})
    if unknown:
        raise SlimeFlagError(f"--multimodal-keys: only images are supported, not {unknown}")
    return {"image_key": mapping["image"]} if "image" in mapping else {}


@_writes("engine_url", "engine_worker_urls")
def _external_engines(values: Values) -> Translation:
    urls = [v if "://" in v else f"http://{v}" for v in values]
    if len(urls) == 1:
        return {"engine_url": urls[0]}
    # Several engines are driven through sgl-router: generation goes to the router, control calls to each engine.
    return {"engine_worker_urls": urls}


def _server_flag(flag: str) -> str:
    """`--sglang-X` -> SGLang's `--X`, under its current name when SGLang renamed it (`RENAMED_SERVER_FLAGS`)."""
    server_flag = "--" + flag[len("--sglang-") :]
    return RENAMED_SERVER_FLAGS.get(server_flag, server_flag)


def _sglang_forward(flag: str) -> Callable[[Values], Translation]:
    """`--sglang-X v ...` -> `--X v ...` appended to the arguments of the SGLang server we launch."""
    server_flag = _server_flag(flag)
    return _writes("sglang_args")(lambda values: {"+sglang_args": [server_flag, *values]})


@_writes("max_tokens_per_device")
def _max_tokens_per_gpu(values: Values) -> Translation:
    return {"max_tokens_per_device": int(values[0])}


_WHY_ARCH = "model architecture is read from the HF config.json of --hf-checkpoint"
_WHY_PLACEMENT = "devices come from JAX (all local devices, or --local-device-ids / jax.distributed), not a Ray placement"

SLIME_FLAGS: dict[str, SlimeFlag] = {
    # ------------------------------------------------------------------ rollout / data
    "--multimodal-keys": SlimeFlag(1, "-> --image-key (the dataset column holding the images)", _multimodal_keys, "rollout"),
    "--apply-chat-template": SlimeFlag(
        0, "not applicable: the chat template is always applied (prompts are chat messages)", _NOTHING, "rollout"),
    "--rollout-external-engine-addrs": SlimeFlag(
        "+", "-> --engine-url (one engine) or --engine-worker-urls (several, behind --engine-url ROUTER)",
        _external_engines, "rollout"),
    # ------------------------------------------------------------------ algorithm
    # (--advantage-estimator gspo|cispo is our own flag; the config maps slime's spelling onto the loss.)
    # slime's TIS: the token_tis rollout correction and its band (rl/corrections.py). With
    # --custom-tis-function-path, slime's hook replaces the TIS weight: the config makes that correction `custom`.
    "--use-tis": SlimeFlag(
        0, "-> --rollout-correction token_tis (w = clip(exp(trainer - rollout), low, high); with "
        "--custom-tis-function-path, --rollout-correction custom)", _switch(rollout_correction="token_tis"), "algo"),
    "--tis-clip": SlimeFlag(1, "-> --rollout-correction-high (the upper clip of the TIS weight)",
                            _one("rollout_correction_high"), "algo"),
    "--tis-clip-low": SlimeFlag(1, "-> --rollout-correction-low (the lower clip of the TIS weight)",
                                _one("rollout_correction_low"), "algo"),
    "--calculate-per-token-loss": SlimeFlag(
        0, "-> --loss-aggregation token_mean (an SFT run's NLL is always the per-token mean)",
        _switch(loss_aggregation="token_mean"), "algo"),
    # ------------------------------------------------------------------ SFT (--loss-type sft_loss)
    "--disable-compute-advantages-and-returns": SlimeFlag(
        0, "not applicable: an SFT run (--loss-type sft_loss) computes no advantages, an RL run always does",
        _NOTHING, "sft"),
    "--debug-train-only": SlimeFlag(
        0, "not applicable: an SFT run (--loss-type sft_loss) starts no engine anyway", _NOTHING, "sft"),
    "--loss-mask-type": SlimeFlag(
        1, "not applicable: SFT assistant masks come from the model's own chat template, whatever its family "
        "(rollout/encoding.py encode_transcript)", _NOTHING, "sft"),
    # ------------------------------------------------------------------ sglang
    "--rollout-num-gpus-per-engine": SlimeFlag(
        1, "-> --tp-size N (the embedded engine's tensor parallelism; passed on to a launched SGLang)",
        _one("tp_size", int), "sglang"),
    "--rollout-num-gpus": SlimeFlag(1, f"not applicable: {_WHY_PLACEMENT}", _NOTHING, "misc"),
    # ------------------------------------------------------------------ fsdp backend
    "--train-backend": SlimeFlag(1, "not applicable: one JAX trainer; fsdp and megatron layouts are mesh configs "
                                 "(configs/mesh/*.yaml)", _NOTHING, "fsdp"),
    "--gradient-checkpointing": SlimeFlag(0, "-> --remat full", _switch(remat="full"), "fsdp"),
    "--attn-implementation": SlimeFlag(1, "not applicable: HF attention implementation; use --attention-impl "
                                       "(xla | pallas_gpu | pallas_tpu)", _NOTHING, "fsdp"),
    "--update-weight-buffer-size": SlimeFlag(
        1, "not applicable: weights go to SGLang as one safetensors export per version "
        "(/update_weights_from_disk), not in buffers", _NOTHING, "fsdp"),
    "--fsdp-cpu-offload": SlimeFlag(0, "not applicable: no CPU offload of parameters", _NOTHING, "fsdp"),
    # ------------------------------------------------------------------ megatron backend
    "--tensor-model-parallel-size": SlimeFlag(1, "-> --mesh-tensor N", _one("mesh_tensor", int), "megatron"),
    "--sequence-parallel": SlimeFlag(
        0, "not applicable: activations are sharded by the mesh's activation constraints", _NOTHING, "megatron"),
    "--pipeline-model-parallel-size": SlimeFlag(
        1, "accepted when 1 (no pipeline parallelism here)",
        _must_equal("--pipeline-model-parallel-size", 1, "no pipeline parallelism: use --mesh-fsdp / --mesh-tensor"),
        "megatron"),
    "--context-parallel-size": SlimeFlag(1, "-> --mesh-context N", _one("mesh_context", int), "megatron"),
    "--expert-model-parallel-size": SlimeFlag(1, "-> --mesh-expert N", _one("mesh_expert", int), "megatron"),
    "--expert-tensor-parallel-size": SlimeFlag(
        1, "accepted when 1: there is no separate expert tensor parallelism here (the experts' hidden dimension "
        "follows the layout's `mlp` rule, like every MLP's)",
        _must_equal("--expert-tensor-parallel-size", 1, "experts shard by the mesh layout's rules: `expert` over "
                    "--mesh-expert, their hidden dimension like every MLP's"), "megatron"),
    # Megatron's router losses, per sparse layer and summed over the layers; ours are transformers' (the aux loss
    # pooled over the layers) and ST-MoE's averaged over the layers, so the same coefficient is a different
    # strength. The exact conversion needs the model's layer count and top-k, which the config does not read:
    # the value is passed through and the note says how to convert it (tests/test_slime_compat.py checks it
    # against both closed forms).
    "--moe-aux-loss-coeff": SlimeFlag(
        1, "-> --router-aux-loss-coef, the same value, but normalised differently: Megatron adds, per sparse layer, "
        "c * (E/k) * sum_e f_e * P_e (f_e: the layer's fraction of tokens whose top-k holds expert e, P_e: its mean "
        "router probability); ours is transformers' c * E * sum_e f_e * P_e with f and P pooled over the L sparse "
        "layers. For Megatron's strength pass --router-aux-loss-coef c*L/k: equal in value and gradient when every "
        "sparse layer has the same expert load, exactly with one sparse layer",
        _one("router_aux_loss_coef", float), "megatron"),
    "--moe-z-loss-coeff": SlimeFlag(
        1, "-> --router-z-loss-coef, the same value, but normalised differently: Megatron adds c * mean_t "
        "logsumexp(router logits)^2 per sparse layer (a sum over layers); ours averages over the L sparse layers. "
        "For Megatron's strength pass --router-z-loss-coef c*L (then equal in value and gradient)",
        _one("router_z_loss_coef", float), "megatron"),
    "--recompute-granularity": SlimeFlag(
        1, "-> --remat full (full) or dots (selective: Megatron recomputes the core attention and keeps the linear "
        "layers' outputs; dots keeps the matmul outputs without batch dims and recomputes the attention einsums, "
        "softmax, norms and activations)",
        _recompute_granularity, "megatron"),
    "--recompute-method": SlimeFlag(1, "not applicable: --remat full recomputes every layer (uniform, 1 layer per "
                                    "checkpoint)", _NOTHING, "megatron"),
    "--recompute-num-layers": SlimeFlag(1, "not applicable: --remat full checkpoints each layer", _NOTHING, "megatron"),
    "--use-dynamic-batch-size": SlimeFlag(
        0, "-> packing on; with --max-tokens-per-gpu the micro-batch holds at most that many tokens per device",
        _switch(packing=True), "megatron"),
    "--max-tokens-per-gpu": SlimeFlag(1, "-> --max-tokens-per-device (packing token budget per device per micro-batch)",
                                      _max_tokens_per_gpu, "megatron"),
    "--attention-dropout": SlimeFlag(
        1, "accepted when 0 (RL trains without dropout)",
        _must_equal("--attention-dropout", 0, "the model has no dropout"), "megatron"),
    "--hidden-dropout": SlimeFlag(
        1, "accepted when 0 (RL trains without dropout)",
        _must_equal("--hidden-dropout", 0, "the model has no dropout"), "megatron"),
    "--accumulate-allreduce-grads-in-fp32": SlimeFlag(
        0, "not applicable: gradients are accumulated in the parameter dtype inside the compiled step (fp32 "
        "parameters by default)", _NOTHING, "megatron"),
    "--attention-softmax-in-fp32": SlimeFlag(
        0, "not applicable: attention softmax is always computed in fp32", _NOTHING, "megatron"),
    "--attention-backend": SlimeFlag(1, "not applicable: Megatron attention backend; use --attention-impl",
                                     _NOTHING, "megatron"),
    "--megatron-to-hf-mode": SlimeFlag(
        1, "not applicable: the JAX model exports HF safetensors directly", _NOTHING, "megatron"),
    "--ref-load": SlimeFlag(1, "not applicable: the reference model is the initial policy (--hf-checkpoint)",
                            _NOTHING, "megatron"),
    # ------------------------------------------------------------------ misc (Ray placement)
    "--actor-num-nodes": SlimeFlag(1, f"not applicable: {_WHY_PLACEMENT}", _NOTHING, "misc"),
    "--actor-num-gpus-per-node": SlimeFlag(1, f"not applicable: {_WHY_PLACEMENT}", _NOTHING, "misc"),
}

# slime's model-architecture arguments (scripts/models/*.sh, passed with the Megatron backend).
for _flag, _nargs in {
    "--num-layers": 1, "--hidden-size": 1, "--ffn-hidden-size": 1, "--num-attention-heads": 1,
    "--group-query-attention": 0, "--num-query-groups": 1, "--kv-channels": 1, "--use-rotary-position-embeddings": 0,
    "--disable-bias-linear": 0, "--normalization": 1, "--norm-epsilon": 1, "--rotary-base": 1, "--vocab-size": 1,
    "--swiglu": 0, "--untie-embeddings-and-output-weights": 0, "--qk-layernorm": 0, "--position-embedding-type": 1,
    "--max-position-embeddings": 1, "--seq-length": 1, "--make-vocab-size-divisible-by": 1,
}.items():
    SLIME_FLAGS[_flag] = SlimeFlag(_nargs, f"not applicable: {_WHY_ARCH}", _NOTHING, "model")

# slime's own example paths, for a run line copied verbatim: its example episode function and custom config are
# this project's default episode function and geo3k custom config.
SLIME_PATH_ALIASES: dict[str, str] = {
    "examples.geo3k_vlm_multi_turn.rollout.generate": "rollout.multiturn.generate",
    "examples/geo3k_vlm_multi_turn/geo3k_vlm_multi_turn_config.yaml": "configs/geo3k_multiturn.yaml",
}

# slime's SFT data path (`--rollout-function-path` of its SFT runs): here `--loss-type sft_loss` reads the
# conversations itself and runs no rollout function; the config accepts the path only with that loss type.
SLIME_SFT_ROLLOUT = "slime.rollout.sft_rollout.generate_rollout"

# Our own flags whose `--sglang-` prefix is not slime's forwarding prefix.
OWN_SGLANG_FLAGS = ("--sglang-python", "--sglang-args", "--sglang-server-concurrency")


def lookup(flag: str) -> SlimeFlag | None:
    """The slime flag `flag`, including any `--sglang-X` server flag (forwarded to a launched SGLang)."""
    if flag in SLIME_FLAGS:
        return SLIME_FLAGS[flag]
    if flag.startswith("--sglang-") and flag not in OWN_SGLANG_FLAGS:
        return SlimeFlag("*", f"-> {_server_flag(flag)} for a launched SGLang server (--launch-sglang)",
                         _sglang_forward(flag), "sglang")
    return None
