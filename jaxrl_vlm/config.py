"""Typed run configuration: one place that lists every option, its default and its meaning.

A run's config is resolved from four layers, later ones winning:

1. the defaults below;
2. a YAML file (``jaxrl-vlm train CONFIG``), nested by section (``rollout: {rollout_batch_size: 8}``) or flat
   (``rollout_batch_size: 8``);
3. the ``--custom-config-path`` YAML (slime's mechanism for ``max_turns`` and friends). Its keys may be any
   typed field or a key declared by the loaded environment / generate function module in ``CONFIG_KEYS``;
   those land in ``Config.extra``;
4. ``--flag value`` command-line overrides, with slime's flag names (``--rollout-batch-size 8``). slime's flags
   that are not ours (``slime_flags.py``) are translated onto our fields or accepted as not applicable; what
   became of each is in ``Config.notes``, logged once by the run.

Field names are globally unique across sections, so every field has exactly one flag:
``--`` + name with ``_`` replaced by ``-``. Unknown keys and wrong types are errors that name the key, the
source and the closest valid key.

Each option is declared once, with its default, help, bounds (``opt(gt=, ge=, lt=, le=)``) and choices, in the
options dataclass of the package that reads it: rollout (``rollout/options.py``), the embedded engine
(``engine/options.py``, composed into the engine section under each field's ``key``), the loss (``rl/options.py``,
composed into the algo section); the run's own options are declared below. This module imports no jax (a test
checks it): choices kept by a module that does (loss and KL registries, attention kernels) are read, importing
it, only when a value is checked.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxrl_vlm import slime_flags
from jaxrl_vlm.devices import check_disjoint, parse_device_ids
from jaxrl_vlm.engine.options import DTYPES, EngineOptions
from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.lora.options import LoraOptions
from jaxrl_vlm.lora.serving import engine_serves
from jaxrl_vlm.models.config import FAMILY_PARSERS
from jaxrl_vlm.models.remat import RematPlan
from jaxrl_vlm.rl.options import CUSTOM_CORRECTION, LossOptions, opd_problem, rollout_correction_problem
from jaxrl_vlm.rl.registries import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, LOSS_TYPES, POLICY_LOSSES
from rollout.hooks import HOOK_OPTIONS, load_hook
from rollout.loading import LoadError, load_function, load_module
from rollout.options import (
    DebugOptions,
    MultiTurnOptions,
    NamesOf,
    RolloutOptions,
    bound_error,
    check_template,
    opt,
    option_of,
    privileged_problem,
)


# --------------------------------------------------------------------------- sections
@dataclass
class ModelConfig:
    hf_checkpoint: str | None = opt(
        None, "HF checkpoint directory (safetensors + config + tokenizer + processor); the model family (Qwen3-VL or "
        "Qwen2.5-VL) comes from its config.json model_type.")
    # Declared with the engine's options: in a run, the embedded engine serves the trainer's weights in these dtypes.
    param_dtype: str = option_of(EngineOptions, "param_dtype", "Dtype of the trainable parameters (and of the "
                                 "embedded engine's).")
    compute_dtype: str = option_of(EngineOptions, "compute_dtype", "Dtype of activations/matmuls, the trainer's and "
                                   "the embedded engine's (bfloat16 on GPU/TPU).")
    remat: str = opt(
        "none", "Rematerialisation policy per layer kind: a policy for every layer (none, full, dots, offload) or "
        "comma-separated KIND=POLICY items after an optional default, kinds full_attention, linear_attention, moe, "
        "vision; e.g. 'full,vision=none' (jaxrl_vlm/models/remat.py).")
    attention_impl: str = option_of(
        EngineOptions, "attention_impl",
        "Attention of the training forward: xla (einsums, dense masks; under context parallelism K/V all-gathered), "
        "pallas_gpu or pallas_tpu (fused segment-aware flash kernels, O(T) memory; seq/patch buckets must be "
        "multiples of 16 (GPU) / 128 (TPU)), or ring (plain-XLA blockwise attention, no dense mask; under context "
        "parallelism K/V passed around the context group in zig-zag order, seq buckets multiples of 2 x cp; the "
        "vision tower keeps xla). The run's embedded engine builds its model with it too (its --attention-impl).",
    )
    logprob_chunk_size: int = opt(512, "Sequence chunk for log-prob computation (bounds fp32 vocab logits memory).",
                                  gt=0)
    make_tiny: bool = opt(False, "Create a tiny random model at --hf-checkpoint if it has no config.json (CPU demo runs).")
    make_tiny_arch: str = opt("qwen3_vl", "Family (config.json model_type) of the --make-tiny model.",
                              choices=tuple(FAMILY_PARSERS))


@dataclass
class DataConfig:
    prompt_data: str | None = opt(
        None, "Training data: prompts (parquet or jsonl in the Geometry3K layout), or with --loss-type sft_loss "
        "conversations (jaxrl_vlm/data/sft.py).")
    input_key: str | None = opt(
        None, "Row field holding the problem text with <image> markers (None: problem), or with --loss-type sft_loss "
        "the conversation, a list of {role, content} messages (None: messages; slime's --input-key).")
    label_key: str = opt("answer", "Row field holding the reference answer.")
    image_key: str = opt("images", "Row field holding the list of images.")
    tool_key: str = opt(
        "tools", "--loss-type sft_loss: the optional row field holding the conversation's tool schemas (a JSON list, "
        "rendered by the chat template as the task's tools are in rollout; slime's --tool-key).")
    on_bad_row: str = opt("error", "What to do with a malformed row: raise, or skip and count it.", choices=("error", "skip"))
    rollout_shuffle: bool = opt(True, "Shuffle prompts each epoch (deterministic by --seed).")
    system_prompt: str | None = opt(None, "System prompt prepended to every conversation (None: the task's default).")
    prompt_style: str = opt("geo3k", "Task prompt: geo3k's tool-call instructions and tool schema, or the bare problem.",
                            choices=NamesOf("jaxrl_vlm.data.geo3k", "PROMPT_STYLES"))
    synthetic_rows: int = opt(256, "Rows of synthetic data to generate when --prompt-data is missing and --make-data is on.")
    make_data: bool = opt(
        False, "Generate synthetic data (--synthetic-data-module) at --prompt-data, and at each --eval-prompt-data "
        "path, where the file does not exist.")
    synthetic_image_size: int = opt(224, "Side in pixels of generated synthetic images.")
    synthetic_data_module: str = opt(
        "envs.geo3k.synthetic",
        "The task's generator for --make-data: a module (dotted name or .py file) with "
        "make_dataset(path, num_rows, seed=, image_size=).")
    synthetic_eval_rows: int = opt(
        64, "Rows --make-data generates at a missing --eval-prompt-data path (seed: --seed + 1 + the set's position, "
        "so they are not the training prompts).")


# The rollout and multi-turn sections are declared where the rollout code reads them (rollout/options.py), the
# debug section (saved rollouts) where their files are written and read (rollout/rollout_data.py).
RolloutConfig = RolloutOptions
MultiTurnConfig = MultiTurnOptions
DebugConfig = DebugOptions


@dataclass
class _AlgoOptions:
    """The run's algorithm options; the loss hyper-parameters (`LossOptions`) are composed after them."""

    advantage_estimator: str = opt("grpo", "Advantage estimator (a registry name).", choices=ADVANTAGE_ESTIMATORS)
    disable_grpo_std_normalization: bool = opt(False, "Dr.GRPO: do not divide group-centred rewards by their std.")
    custom_advantage_function_path: str | None = opt(
        None,
        "Our advantage hook, in place of --advantage-estimator: `fn(rewards [N], group_index [N], *, "
        "std_normalization, eps) -> advantages [N]` (numpy, one per sample), the signature of the registered "
        "estimators (rl/advantages.py); called on the host before batching (docs/guides/hooks.md).")
    custom_reward_post_process_path: str | None = opt(
        None,
        "slime's reward post-processing: `fn(args, samples) -> (raw_rewards, rewards)`, two lists of one float per "
        "sample, called by the trainer before the advantages. `rewards` replace the rewards the advantage "
        "estimator sees (after it, --kl-coef shaping); `raw_rewards` are logged as rollout/raw_reward. Unlike "
        "slime, GRPO's group normalisation is the estimator's here, not the post-processing's.")
    policy_loss: str = opt("ppo_clip", "Policy loss (a loss registry name).", choices=POLICY_LOSSES)
    loss_type: str = opt(
        "policy_loss",
        "slime's --loss-type: policy_loss trains --policy-loss; custom_loss trains the function of "
        "--custom-loss-function-path; sft_loss is supervised fine-tuning on the conversations of --prompt-data: the "
        "mean NLL (temperature 1) of their assistant tokens, no engine, no rollout (jaxrl_vlm/job/sft.py).",
        choices=LOSS_TYPES,
    )
    custom_loss_function_path: str | None = opt(
        None,
        "The loss of --loss-type custom_loss: a JAX function `fn(inputs: LossInputs, cfg: LossConfig) -> (loss, "
        "metrics)` on the loss registry's contract (rl/losses.py), traced inside the compiled train step (slime's "
        "torch signature does not apply).")
    kl_coef: float = opt(
        0.0,
        "KL reward shaping (slime's --kl-coef, separate from the KL loss): the k1 estimate log p_old - log p_ref of "
        "each sampled token, summed over the response, times this coefficient is subtracted from the sample's "
        "reward before advantages. Needs reference log-probs (the initial policy).",
        ge=0,
    )
    rm_type: str | None = opt(
        None,
        "Where the reward comes from: None = the environment's verdict (or its module's reward_fn); math = slime's "
        "math reward: the last \\boxed{} of the model's whole response, graded against the label with math-verify.",
        choices=(None, "math"),
    )
    reward_key: str | None = opt(
        None, "When a reward is a mapping, the entry that is the scalar reward (slime's --reward-key)."
    )
    loss_aggregation: str = opt("seq_mean_token_mean", "How token losses are reduced.", choices=AGGREGATION_MODES)
    loss_aggregation_constant: float | None = opt(None, "Divisor for seq_mean_token_sum_norm (Dr.GRPO; default: --rollout-max-response-len).")


@dataclass
class TrainConfig:
    global_batch_size: int | None = opt(None, "Samples per optimizer step (None: rollout_batch_size * n_samples_per_prompt).",
                                        ge=1)
    micro_batch_size: int | None = opt(None, "Rows per micro-batch for gradient accumulation (None: no accumulation).")
    num_steps_per_rollout: int = opt(1, "Optimizer steps per rollout (>1 recomputes old log-probs).", ge=1)
    use_routing_replay: bool = opt(
        False, "MoE (slime's flag; GSPO's Routing Replay): the experts each token went to in the old-policy forward, "
        "computed before a rollout's first optimizer step, are replayed in the current policy's forwards of every "
        "optimizer step of that rollout, so the importance ratio compares the same experts while the router moves. "
        "A no-op with one optimizer step per rollout (one global batch, --num-steps-per-rollout 1: the old policy "
        "is the current one). --use-rollout-routing-replay implies it (the engine's ids are replayed in every "
        "forward, as in slime). The reference forward routes itself, as slime's. A dense model is an error.")
    freeze_vision_tower: bool = opt(
        False, "Freeze the vision tower (patch embedding, position table, blocks; not its patch mergers): it keeps "
        "the checkpoint's weights in --param-dtype, gets no gradient and no optimizer state, is not in the "
        "checkpoints (reloaded from --hf-checkpoint on resume), and leaves every weight sync after the first "
        "(the engines already hold it). The final export still has it. With LoRA, adapters on it are an error.")
    freeze_vision_merger: bool = opt(
        False, "Freeze the vision tower's patch mergers (the main one and Qwen3-VL's deepstack mergers) as "
        "--freeze-vision-tower freezes the tower; either flag works alone, both freeze all of `model.visual`.")
    seed: int = opt(1234, "Seed of parameter init, data order and the trainer RNG.")
    output_dir: str = opt("runs/default", "Where metrics, plots, exports and checkpoints go.")
    freeze_gc: bool = opt(
        True, "Keep the run's process heap out of the cyclic garbage collector's full collections (jaxrl_vlm/"
        "gc_heap.py): frozen when the run starts and again after its first step, so the compiled train step, the "
        "engine's programs and the caches the first step built are never walked again. Unfrozen, a full collection "
        "of that heap stops every thread for about 0.1 s on the 2-core machine (docs/benchmarks.md), every few "
        "seconds: the trainer, the rollout's event loop and an embedded engine mid-round alike. What was alive at a "
        "freeze and later dies in a reference cycle is freed only when the run ends.")


@dataclass
class OptimConfig:
    optimizer: str = opt(
        "adamw",
        "Optimizer: adam is slime's Adam with weight decay, which is decoupled (AdamW, as Megatron's and "
        "torch's fused Adam apply it), so adam and adamw are the same update here.",
        choices=("adam", "adamw"),
    )
    lr: float = opt(1e-6, "Learning rate.", ge=0)
    min_lr: float = opt(0.0, "Final learning rate of a decaying schedule.", ge=0)
    lr_decay_style: str = opt("constant", "Learning-rate schedule.", choices=("constant", "linear", "cosine"))
    lr_warmup_iters: int = opt(0, "Linear warm-up steps.", ge=0)
    lr_decay_iters: int | None = opt(
        None,
        "Optimizer steps over which a decaying schedule reaches --min-lr, warm-up included, then holds it (Megatron's "
        "--lr-decay-iters; None: the whole run, --num-rollout x --num-steps-per-rollout). For runs bounded by wall "
        "time rather than --num-rollout.",
        ge=1,
    )
    weight_decay: float = opt(0.1, "AdamW weight decay.", ge=0)
    adam_beta1: float = opt(0.9, "Adam beta1.", ge=0, lt=1)
    adam_beta2: float = opt(0.98, "Adam beta2.", ge=0, lt=1)
    adam_eps: float = opt(1e-8, "Adam epsilon.", ge=0)
    clip_grad: float = opt(1.0, "Global-norm gradient clipping (0: off).", ge=0)


@dataclass
class BatchingConfig:
    seq_buckets: list[int] = opt([256, 512, 1024, 2048, 4096], "Allowed padded row lengths.")
    row_buckets: list[int] = opt([1, 2, 4, 8, 16, 32], "Allowed numbers of rows per micro-batch.")
    patch_buckets: list[int] = opt([0, 256, 1024, 4096, 16384], "Allowed padded vision-patch counts.")
    packing: bool = opt(True, "Pack several trajectories per row (segment-aware attention).")
    vision_reuse: bool = opt(
        True,
        "Run the vision tower once per distinct image of a micro-batch (content hash of its patches and grid) and "
        "gather its features into every sample that shows it (a GRPO group's prompt picture, earlier turns' "
        "pictures); false: once per sample's copy.",
    )
    max_tokens_per_device: int | None = opt(
        None,
        "Token budget of one micro-batch per device (slime's --use-dynamic-batch-size --max-tokens-per-gpu): the "
        "rows of a micro-batch are chosen so that rows x padded length <= this x batch-sharding devices.",
        gt=0,
    )
    overlong_policy: str = opt("error", "A trajectory longer than the largest bucket: raise, or truncate its tail.", choices=("error", "truncate"))


@dataclass
class _EngineRunOptions:
    """How a run reaches its engine; the embedded engine's own options (`EngineOptions`) are composed after these."""

    engine_url: str | None = opt(None, "URL of an SGLang server or router (None: start the embedded JAX engine).")
    engine_worker_urls: list[str] = opt([], "Worker URLs behind a router: control calls go to each directly.")
    launch_sglang: bool = opt(False, "Spawn `python -m sglang.launch_server` from --sglang-python (its own venv) and stop it at the end.")
    sglang_python: str | None = opt(None, "Interpreter of the separate SGLang venv.")
    sglang_args: list[str] = opt([], "Extra arguments for sglang.launch_server.")
    engine_api: str = opt(
        "auto", "The protocol of --engine-url / a launched engine: SGLang's native API or vLLM's (token-in/token-out "
        "route and dev-mode control routes). auto: vllm with --launch-vllm, else asked of the server at --engine-url "
        "(SGLang answers /model_info, vLLM /v1/models as owner). The embedded engine speaks SGLang's.",
        choices=("auto", "sglang", "vllm"))
    launch_vllm: bool = opt(
        False, "Spawn vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, dev mode, --enable-scale-out, "
        "--logprobs-mode processed_logprobs) from --vllm-python (its own venv) and stop it at the end.")
    vllm_python: str | None = opt(None, "Interpreter of the separate vLLM venv (scripts/setup_vllm_cpu_venv.sh builds one).")
    vllm_args: list[str] = opt([], "Extra arguments for vLLM's server, e.g. --max-model-len 4096 --dtype float32.")
    engine_host: str = opt("127.0.0.1", "Bind address of the embedded engine.")
    engine_port: int = opt(0, "Port of the embedded engine (0: a free port).")
    rollout_devices: str | None = opt(
        None, "Local devices of the embedded engine (its device_ids), e.g. '0-3' or '0,1,2,3' (exactly tp_size x "
        "dp_size of them; None: the first tp_size x dp_size). With --train-devices, engine and trainer get disjoint "
        "devices and run side by side (--max-staleness >= 1).")
    engine_request_timeout: float = opt(300.0, "Seconds per /generate request.", gt=0)
    engine_start_timeout: float = opt(900.0, "Seconds to wait for the engine (embedded, launched or external) to become healthy.",
                                      gt=0)
    engine_max_retries: int = opt(3, "Retries of a /generate request on connection errors and 5xx.", ge=0)
    engine_reconnect_timeout: float = opt(
        300.0,
        "--engine-url: seconds to wait for an engine that became unreachable (connection refused or reset) to come "
        "back. Meanwhile no /generate is sent (requests wait, /health is probed with backoff); on return the "
        "trainer's weights are pushed again unless the engine still reports them, their version is confirmed, and "
        "the requests the outage cut are re-sent. Past it the run stops naming the URL; episodes still waiting FAIL "
        "with cause engine_lost. 0: no waiting (a lost engine fails requests after --engine-max-retries). The wait "
        "counts in --episode-timeout: keep that longer.",
        ge=0.0, le=86400.0)
    allow_worker_loss: bool = opt(
        False,
        "--engine-worker-urls behind a router: a worker that a control call (pause, flush, update, continue, version "
        "check) cannot reach is dropped and the run carries on with the others (logged, counted in "
        "engine/workers_lost). Without it the run stops naming the worker. The last worker is never dropped.")
    engine_api_key: str | None = opt(
        None, "SGLang's --api-key: sent as `Authorization: Bearer` to --engine-url and its workers, passed to a launched "
        "SGLang, and required by the embedded engine's server. A credential: redacted from config dumps, checkpoints "
        "and trackers, and not in the args that rollout and env functions receive.")
    weight_sync_dir: str | None = opt(None, "Directory for versioned weight exports (a RAM disk is best; None: under output_dir).")
    disable_weight_sync: bool = opt(False, "Do not push new weights to the engine (for ablations only).")
    weight_sync_dtype: str | None = opt(None, "Dtype of exported weights (None: bfloat16 for --engine-url, the param dtype for the embedded engine).", choices=(None, *DTYPES))
    weight_sync_mode: str = opt(
        "auto", "How new weights reach the engine: `disk` (versioned HF export + /update_weights_from_disk), `memory` "
        "(the embedded engine in this process: device to device, same pause/flush/update/continue sequence and "
        "version, no disk and no HTTP), `delta` (only the changed elements, bit-exact and checksummed: a full sync "
        "first, after an engine restart and on any mismatch; the embedded engine of a one-process job, or a vLLM with "
        "the project's worker extension; an engine that cannot take deltas, SGLang among them, is synced in full and "
        "the run logs why once), `auto` (memory for the embedded engine of a one-process job, which is faster there "
        "than delta; delta for vLLM in a one-process job, full syncs for a server without the extension; else disk).",
        choices=("auto", "disk", "memory", "delta"))
    colocate: bool = opt(
        False,
        "Engine and trainer share the same devices (slime's --colocate), synchronously: after each rollout the engine "
        "is flushed and releases its weights and KV cache (/release_memory_occupation), training runs, then the engine "
        "takes back its weights, gets the new ones and its KV cache (/resume_memory_occupation). A launched SGLang "
        "also needs --sglang-args --enable-memory-saver; with --launch-sglang on the same GPUs, JAX gets "
        "1 - mem_fraction_static - colocate_margin of each GPU (XLA_PYTHON_CLIENT_MEM_FRACTION).",
    )
    colocate_margin: float = opt(0.05, "Share of GPU memory left to neither JAX nor SGLang when colocated.", ge=0)

    @property
    def rollout_device_ids(self) -> tuple[int, ...] | None:
        return None if self.rollout_devices is None else parse_device_ids(self.rollout_devices, "--rollout-devices")


@dataclass
class EvalConfig:
    eval_interval: int | None = opt(
        None, "Also evaluate every N steps (None: only before training and at the end, when eval sets are given)."
    )
    eval_prompt_data: list[str] = opt(
        [],
        "Eval sets as NAME PATH pairs (slime's syntax), PATH optionally sliced by file rows as PATH@[start:end] "
        "(python slice semantics; either end may be omitted: @[:64], @[10:]). Loaded like --prompt-data.",
    )
    n_samples_per_eval_prompt: int = opt(1, "Samples per eval prompt (a group; pass@k needs k <= this).")
    eval_temperature: float | None = opt(None, "Eval sampling temperature (None: --rollout-temperature).")
    eval_top_p: float | None = opt(None, "Eval top-p (None: --rollout-top-p).")
    eval_top_k: int | None = opt(None, "Eval top-k (None: --rollout-top-k).")
    eval_max_response_len: int | None = opt(None, "Eval response budget (None: --rollout-max-response-len).")
    log_passrate: bool = opt(
        False, "Log pass@k (k = 1, 2, 4, ... <= the samples per prompt; reward == 1 is a pass) for eval sets "
        "(eval/<name>/pass@k) and the training rollout (passrate/pass@k).")
    skip_eval_before_train: bool = opt(False, "Do not evaluate at step 0.")


# An eval set's name becomes a metric namespace (eval/<name>/...) and a directory (<output_dir>/eval/<name>/).
_EVAL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# slime's generalized path: PATH@[start:end], integers (possibly negative), either may be omitted.
_SLICED_PATH = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")


@dataclass(frozen=True)
class EvalSetSpec:
    """One `--eval-prompt-data` pair: the set's name, its file, and the file rows it keeps (`rows`)."""

    name: str
    path: str
    start: int | None = None
    end: int | None = None

    @property
    def rows(self) -> slice:
        """The kept file rows, with python slice semantics (row = jsonl line - 1, or parquet row)."""
        return slice(self.start, self.end)

    @property
    def sliced(self) -> bool:
        return self.start is not None or self.end is not None

    def __str__(self) -> str:
        if not self.sliced:
            return self.path
        return f"{self.path}@[{'' if self.start is None else self.start}:{'' if self.end is None else self.end}]"


def parse_eval_prompt_data(values: list[str]) -> list[EvalSetSpec]:
    """`--eval-prompt-data NAME PATH[@[start:end]] [NAME PATH ...]` -> one `EvalSetSpec` per set.

    Raises ConfigError naming the set for: a NAME without a PATH, a name that is not a metric-safe word (or looks
    like a path, i.e. the pairs are shifted), a repeated name, and a malformed slice. Paths are checked when the
    sets are loaded (`jaxrl_vlm.job.assets.load_eval_sets`), not here: a config may name another host's files.
    """
    values = list(values)
    if len(values) % 2:
        raise ConfigError(
            f"--eval-prompt-data takes NAME PATH pairs, got {len(values)} values {values}: the last name "
            f"{values[-1]!r} has no path (slime's syntax: --eval-prompt-data aime /data/aime.jsonl@[0:64])"
        )
    specs: list[EvalSetSpec] = []
    for name, raw in zip(values[0::2], values[1::2]):
        if not _EVAL_NAME.match(name) or name.lower().endswith((".jsonl", ".parquet")):
            raise ConfigError(
                f"--eval-prompt-data: eval set name {name!r} (paired with {raw!r}) must be a word of letters, digits, "
                "'_', '.', '-' (it names the metrics eval/<name>/... and not a file); the values are NAME PATH pairs"
            )
        if any(s.name == name for s in specs):
            raise ConfigError(f"--eval-prompt-data: eval set {name!r} is given twice")
        if not raw.strip():
            raise ConfigError(f"--eval-prompt-data: eval set {name!r} has an empty path")
        start = end = None
        path = raw
        if "@[" in raw:
            m = _SLICED_PATH.match(raw)
            if m is None:
                raise ConfigError(
                    f"--eval-prompt-data: eval set {name!r}: bad row slice in {raw!r}; the form is PATH@[start:end] "
                    "with integers, either of which may be omitted (PATH@[0:64], PATH@[:64], PATH@[10:], PATH@[-50:])"
                )
            path = m["path"]
            start = int(m["start"]) if m["start"] else None
            end = int(m["end"]) if m["end"] else None
        specs.append(EvalSetSpec(name, path, start, end))
    return specs


@dataclass
class TrackingConfig:
    use_wandb: bool = opt(False, "Log metrics to Weights & Biases (pip install 'jaxrl-vlm[wandb]').")
    wandb_project: str | None = opt(None, "W&B project.")
    wandb_group: str | None = opt(None, "W&B group.")
    wandb_key: str | None = opt(None, "W&B API key (else the environment's WANDB_API_KEY or a prior login).")
    wandb_mode: str | None = opt(None, "W&B mode (None: online).", choices=(None, "online", "offline", "disabled"))
    wandb_dir: str | None = opt(None, "W&B local directory (None: <output_dir>/wandb).")
    wandb_run_name: str | None = opt(None, "W&B run name (None: the output directory's name).")
    use_tensorboard: bool = opt(False, "Also write TensorBoard event files (<output_dir>/tb; no torch needed).")
    tensorboard_dir: str | None = opt(None, "TensorBoard log directory (None: <output_dir>/tb).")


@dataclass
class MeshConfig:
    mesh_config: str | None = opt(None, "YAML file with a mesh section (configs/mesh/*.yaml) merged over these values.")
    mesh_data: int = opt(-1, "Size of the data axis (-1: fill).")
    mesh_fsdp: int = opt(1, "Size of the fsdp axis (-1: fill).")
    mesh_context: int = opt(
        1, "Size of the context axis: each row's positions are split in contiguous blocks over this many devices "
        "(context parallelism; slime's --context-parallel-size; -1: fill).")
    mesh_tensor: int = opt(1, "Size of the tensor axis (-1: fill).")
    mesh_expert: int = opt(
        1, "Size of the expert axis: the routed experts of MoE layers are split over this many devices, each "
        "device's tokens sent to their experts' devices by an all-to-all; a data-parallel axis for everything else "
        "(expert parallelism; slime's --expert-model-parallel-size; -1: fill).")
    moe_capacity_factor: float | None = opt(
        None, "Expert parallelism: (token, expert) copies one device may send to one device of its expert group, as "
        "a multiple of the balanced share (local tokens x top-k / expert-parallel size). Copies over it are dropped "
        "(that expert's output left out) and counted in the routing's `dropped`. None: room for the worst case, so "
        "nothing is ever dropped and the result equals one device's (as transformers and the engine compute it).",
        gt=0.0)
    train_devices: str | None = opt(
        None, "Local devices of the trainer's mesh, e.g. '4-7' (None: all local devices). See --rollout-devices.")

    @property
    def train_device_ids(self) -> tuple[int, ...] | None:
        return None if self.train_devices is None else parse_device_ids(self.train_devices, "--train-devices")
    sharding_rules: dict[str, Any] = opt({}, "Logical axis name -> mesh axis (or list of axes, or null) overrides.")
    activation_constraints: bool = opt(
        True,
        "Constrain activations to batch-row sharding at every layer, so FSDP gathers weights instead of "
        "all-reducing activations; false leaves the choice to XLA's sharding propagation.",
    )


@dataclass
class CheckpointConfig:
    save: str | None = opt(None, "Checkpoint directory (None: <output_dir>/checkpoints).")
    load: str | None = opt(None, "Resume from this checkpoint directory (latest complete step).")
    load_step: int | None = opt(None, "Resume from this step of --load instead of the latest (e.g. when it is corrupt).")
    save_interval: int = opt(0, "Steps between checkpoints (0: only at the end).", ge=0)
    keep_checkpoints: int = opt(3, "How many recent checkpoints to keep.", ge=0)
    preemption_policy: str = opt(
        "finish",
        "On SIGTERM/SIGINT (spot VMs, schedulers): finish the training step in progress when it fits in "
        "--preemption-grace-seconds, else abort it; or abort it at once. Either way a checkpoint is written and the "
        "run exits 0 (a second signal aborts at once).",
        choices=("finish", "abort"),
    )
    preemption_grace_seconds: float = opt(
        30.0,
        "Seconds between SIGTERM and the SIGKILL that follows it (the scheduler's grace period): finishing the step "
        "is given up when it would not leave time for the checkpoint.",
        gt=0.0,
    )


@dataclass
class DistributedConfig:
    coordinator_address: str | None = opt(None, "host:port of process 0's jax.distributed coordinator (or env JAXRL_COORDINATOR).")
    num_processes: int | None = opt(None, "Processes in the job (or env JAXRL_NUM_PROCESSES).")
    process_id: int | None = opt(None, "This process's id, 0..num_processes-1 (or env JAXRL_PROCESS_ID).")
    local_device_ids: list[int] = opt([], "Local devices this process uses (default all; or env JAXRL_LOCAL_DEVICE_IDS).")
    distributed_auto: bool = opt(False, "Let jax detect the cluster: TPU pod, SLURM, Open MPI (or env JAXRL_DISTRIBUTED=auto).")


def _compose(name: str, own: type, component: type, *, keyed_only: bool, declared: Iterable[type] = (),
             help_prefix: str = "") -> type:
    """The section `name`: `own` followed by the fields of a component's options, as declared there (default, help, bounds, choices),
    each under its `key` (else its name). `keyed_only`: only the fields that name a `key`. A key that `own` or a
    `declared` section already holds (e.g. the engine's seed is `rollout_seed`) is that option, not a new one."""
    taken = {f.name for cls in (own, *declared) for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(component)
    extra = []
    for f in dataclasses.fields(component):
        key = f.metadata["key"] or (None if keyed_only else f.name)
        if key is None or key in taken:
            continue
        text = f.metadata["help"]
        if help_prefix and text[1:2].islower():  # "Embedded engine: most requests ...", "...: KV-cache memory ..."
            text = text[0].lower() + text[1:]
        meta = {**f.metadata, "help": help_prefix + text}
        default = {"default": f.default} if f.default_factory is dataclasses.MISSING else {"default_factory": f.default_factory}
        extra.append((key, hints[f.name], field(**default, metadata=meta)))
    cls = dataclasses.make_dataclass(name, extra, bases=(own,))
    cls.__module__ = __name__
    return cls


# The adapters are declared where the trainer reads them (lora/options.py), the section is that dataclass.
LoraConfig = LoraOptions
AlgoConfig = _compose("AlgoConfig", _AlgoOptions, LossOptions, keyed_only=False)
EngineConfig = _compose("EngineConfig", _EngineRunOptions, EngineOptions, keyed_only=True,
                        help_prefix="Embedded engine: ", declared=(ModelConfig, RolloutConfig))

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "multiturn": MultiTurnConfig,
    "algo": AlgoConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "batching": BatchingConfig,
    "lora": LoraConfig,
    "engine": EngineConfig,
    "eval": EvalConfig,
    "tracking": TrackingConfig,
    "mesh": MeshConfig,
    "checkpoint": CheckpointConfig,
    "distributed": DistributedConfig,
    "debug": DebugConfig,
}


# Options that are credentials: never written to config dumps, checkpoint metadata or trackers.
SECRETS: tuple[tuple[str, str], ...] = (("tracking", "wandb_key"), ("engine", "engine_api_key"))
REDACTED = "<redacted>"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    multiturn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    # Keys declared by the loaded env / generate module (CONFIG_KEYS) and set via --custom-config-path.
    extra: dict[str, Any] = field(default_factory=dict)
    # What became of slime flags and spellings (one line each; logged once by the run, not part of the config).
    notes: list[str] = field(default_factory=list)

    def option(self, name: str) -> Any:
        """The value of the option `name` (a field name, unique across sections), wherever its section is."""
        return getattr(getattr(self, FIELDS[name].section), name)

    def to_namespace(self) -> types.SimpleNamespace:
        """The flat `args` that rollout functions and environments receive (slime's convention), without the
        credentials (SECRETS): no env, hook or dump needs them."""
        flat: dict[str, Any] = {}
        for section in SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, section)))
        for _, key in SECRETS:
            del flat[key]
        flat.update(self.extra)
        return types.SimpleNamespace(**flat)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, for dumps, checkpoints and trackers: secrets are redacted."""
        out = {section: dataclasses.asdict(getattr(self, section)) for section in SECTIONS}
        for section, key in SECRETS:
            if out[section][key] is not None:
                out[section][key] = REDACTED
        if self.extra:
            out["extra"] = dict(self.extra)
        return out

    def dump_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ------------------------------------------------------------------ what a run is
SFT_LOSS = "sft_loss"  # --loss-type of a supervised fine-tuning run (slime's value)


def is_sft(cfg: Config) -> bool:
    """Whether the run is supervised fine-tuning on conversations (`--loss-type sft_loss`), not RL."""
    return cfg.algo.loss_type == SFT_LOSS


def row_input_key(cfg: Config) -> str:
    """The dataset field of `--input-key`: as set, else `messages` for an SFT run's conversations and `problem`
    for RL prompts (slime's SFT runs pass `--input-key messages`; here that is the default)."""
    if cfg.data.input_key is not None:
        return cfg.data.input_key
    return "messages" if is_sft(cfg) else "problem"


# ------------------------------------------------------------------ field index
@dataclass(frozen=True)
class FieldInfo:
    section: str
    name: str
    type: Any
    help: str
    choices: Collection[Any] | None  # a tuple, or a registry (its names, resolved when a value is checked)
    default: Any
    gt: float | None = None  # bounds of a number, declared on the field (`opt(..., gt=, ge=, lt=, le=)`)
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _build_field_index() -> dict[str, FieldInfo]:
    index: dict[str, FieldInfo] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in index:
                raise RuntimeError(f"config field {f.name!r} defined in both {index[f.name].section} and {section}")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            index[f.name] = FieldInfo(section, f.name, hints[f.name], f.metadata.get("help", ""), f.metadata.get("choices"),
                                      default, **{b: f.metadata.get(b) for b in ("gt", "ge", "lt", "le")})
    return index


FIELDS: dict[str, FieldInfo] = _build_field_index()
FLAGS: dict[str, FieldInfo] = {info.flag: info for info in FIELDS.values()}


def _closest(name: str, candidates: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


# ------------------------------------------------------------------ type coercion
def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert `value` to type `tp`; raise ConfigError naming `where` on mismatch."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {tp}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = args or (Any,)
        return [coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        key_tp, val_tp = args or (Any, Any)
        return {coerce(k, key_tp, where): coerce(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{where}: expected a boolean, got {type(value).__name__} {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where}: cannot interpret {value!r} as {tp}")


# ------------------------------------------------------------------ loading
def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def flatten_config_mapping(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Nested-by-section or flat YAML -> {field_name: value}; unknown keys are errors."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: section {key!r} must be a mapping, got {type(value).__name__}")
            section_fields = {f.name for f in dataclasses.fields(SECTIONS[key])}
            for sub_key, sub_value in value.items():
                if sub_key not in section_fields:
                    hint = _closest(sub_key, section_fields) or _closest(sub_key, FIELDS)
                    where = FIELDS[sub_key].section if sub_key in FIELDS else None
                    extra = f" (it belongs to section {where!r})" if where else ""
                    raise ConfigError(f"{source}: unknown key {key}.{sub_key}{extra}{hint}")
                flat[sub_key] = sub_value
        elif key in FIELDS:
            flat[key] = value
        elif key == "extra" and isinstance(value, dict):
            flat.update({f"extra.{k}": v for k, v in value.items()})
        else:
            raise ConfigError(f"{source}: unknown key {key!r}{_closest(key, list(FIELDS) + list(SECTIONS))}")
    return flat


def _values_after(argv: list[str], i: int) -> list[str]:
    """The values of the flag at argv[i]: every following token up to the next `--flag`."""
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return argv[i + 1 : j]


def parse_cli_overrides(argv: list[str], notes: list[str] | None = None) -> dict[str, Any]:
    """`--flag value`, `--flag=value`, a bare boolean `--flag`, a list flag with several values, or one of slime's
    flags (`slime_flags.SLIME_FLAGS`) -> {field_name: raw value}. What became of each slime flag goes to `notes`."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}: options are --flag value")
        flag, eq, inline = token.partition("=")
        values = [inline] if eq else _values_after(argv, i)
        i += 1 if eq else 1 + len(values)
        info = FLAGS.get(flag)
        if info is None:
            _apply_slime_flag(flag, values, out, notes)
            continue
        if _is_bool(info.type) and not values:
            raw: Any = True
        elif not values:
            hint = ""
            if i < len(argv) and argv[i].startswith("--") and typing.get_origin(_strip_optional(info.type)) is list:
                # An engine's own flags look like ours: only the `=` form hands them over as values.
                hint = f" (values that start with '--' go after '=': {flag}={argv[i]},...)"
            raise ConfigError(f"option {flag} needs a value{hint}")
        elif len(values) > 1:
            if typing.get_origin(_strip_optional(info.type)) is not list:
                raise ConfigError(f"option {flag} takes one value, got {values}")
            raw = values
        else:
            raw = values[0]
        out[info.name] = _parse_cli_value(raw, info)
    return out


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _apply_slime_flag(flag: str, values: list[str], out: dict[str, Any], notes: list[str] | None) -> None:
    """Translate one slime flag into our fields (`+name` appends to a list field), or reject it clearly."""
    entry = slime_flags.lookup(flag)
    if entry is None:
        raise ConfigError(f"unknown option {flag}{_closest(flag, [*FLAGS, *slime_flags.SLIME_FLAGS])}")
    if entry.nargs == 0 and values:
        raise ConfigError(f"option {flag} is a switch and takes no value, got {values}")
    if entry.nargs == 1 and len(values) != 1:
        raise ConfigError(f"option {flag} takes one value, got {values}")
    if entry.nargs == "+" and not values:
        raise ConfigError(f"option {flag} needs at least one value")
    try:
        translated = entry.translate(values)
    except (slime_flags.SlimeFlagError, ValueError) as e:
        raise ConfigError(str(e)) from None
    for name, value in translated.items():
        if name.startswith("+"):
            out.setdefault(name[1:], []).extend(value)
        else:
            out[name] = value
    if notes is not None:
        shown = f"{flag} {' '.join(values)}".strip()
        notes.append(f"slime flag {shown}: {entry.note}")


def _is_bool(tp: Any) -> bool:
    return tp is bool or (typing.get_origin(tp) in (typing.Union, types.UnionType) and bool in typing.get_args(tp))


def _parse_cli_value(raw: Any, info: FieldInfo) -> Any:
    if not isinstance(raw, str):
        return raw
    if raw.lower() in ("none", "null"):
        return None
    base = info.type
    if typing.get_origin(base) in (typing.Union, types.UnionType):
        base = next(a for a in typing.get_args(base) if a is not type(None))
    if base is str:
        return raw
    if typing.get_origin(base) in (list, dict) and raw.strip()[:1] in "[{":
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"{info.flag}: cannot parse {raw!r}: {e}") from None
    return raw


def declared_extra_keys(flat: dict[str, Any]) -> dict[str, tuple]:
    """CONFIG_KEYS declared by the env module and the generate function's module: {key: (type, default, help)}."""
    declared: dict[str, tuple] = {}
    for key in ("rollout_interaction_env_path", "custom_generate_function_path"):
        path = flat.get(key, FIELDS[key].default)
        if not path:
            continue
        what = f"--{key.replace('_', '-')}"
        try:
            if key == "rollout_interaction_env_path":
                module = load_module(path, what)
            else:
                module = sys.modules[load_function(path, what).__module__]
        except LoadError as e:
            raise ConfigError(str(e)) from e
        for name, spec in getattr(module, "CONFIG_KEYS", {}).items():
            declared[name] = spec
    if flat.get("env_url") is not None:  # the task's episodes on an env server: the remote client's keys too
        declared.update(load_module("envs.remote", "--env-url").CONFIG_KEYS)
    return declared


def _apply(cfg: Config, flat: dict[str, Any], source: str, declared: dict[str, tuple]) -> None:
    for key, value in flat.items():
        if key.startswith("extra."):
            key = key[len("extra.") :]
        if key in FIELDS:
            info = FIELDS[key]
            value = coerce(value, info.type, f"{source}: {info.section}.{key}")
            if info.choices is not None and value not in info.choices:
                raise ConfigError(f"{source}: {info.section}.{key}={value!r} is not one of {list(info.choices)}")
            setattr(getattr(cfg, info.section), key, value)
        elif key in declared:
            tp = declared[key][0]
            cfg.extra[key] = coerce(value, tp, f"{source}: {key}")
        else:
            raise ConfigError(f"{source}: unknown key {key!r}{_closest(key, list(FIELDS) + list(declared))}")


def load_config(path: str | None = None, argv: list[str] | None = None, *,
                overlays: Sequence[tuple[str, dict[str, Any]]] = ()) -> Config:
    """Resolve defaults <- YAML file <- custom config <- CLI flags <- `overlays` into a validated Config.

    `overlays`: (source name, config mapping, nested or flat as in a YAML file) layers applied last, in order;
    `jaxrl-vlm compare-losses` puts each loss variant there, over the base run's file and flags.
    """
    notes: list[str] = []
    file_flat = flatten_config_mapping(read_yaml(path), str(path)) if path else {}
    cli_flat = parse_cli_overrides(list(argv or []), notes)
    for flat, source in ((file_flat, str(path)), (cli_flat, "command line")):
        _slime_spellings(flat, source, notes)
    for source, data in overlays:  # later layers win, like later flags on the command line
        overlay = flatten_config_mapping(data, source)
        _slime_spellings(overlay, source, notes)
        cli_flat = {**cli_flat, **overlay}
    merged = {**file_flat, **cli_flat}

    mesh_path = merged.get("mesh_config")
    mesh_flat: dict[str, Any] = {}
    if mesh_path:
        mesh_flat = flatten_config_mapping(read_yaml(mesh_path), str(mesh_path))
        bad = [k for k in mesh_flat if FIELDS[k].section != "mesh"]
        if bad:
            raise ConfigError(f"{mesh_path}: a mesh file may only set mesh options, found {bad}")

    custom_path = merged.get("custom_config_path")
    custom_data: dict[str, Any] = {}
    if custom_path:
        raw = read_yaml(custom_path)
        custom_data = {}
        for key, value in raw.items():
            if key in SECTIONS and isinstance(value, dict):
                custom_data.update(flatten_config_mapping({key: value}, str(custom_path)))
            else:
                custom_data[key] = value
        _slime_spellings(custom_data, str(custom_path), notes)
    # env/generate paths may themselves be set by the custom config (slime's example does this).
    paths_view = {**merged, **{k: v for k, v in custom_data.items() if k in FIELDS}, **cli_flat}
    needs_declared = any(k not in FIELDS for k in custom_data) or any(k.startswith("extra.") for k in merged)
    declared = declared_extra_keys(paths_view) if needs_declared else {}

    cfg = Config()
    _apply(cfg, mesh_flat, str(mesh_path), declared)
    _apply(cfg, file_flat, str(path), declared)
    _apply(cfg, custom_data, str(custom_path), declared)
    _apply(cfg, cli_flat, "command line", declared)
    _load_as_hf_checkpoint(cfg, notes)
    _slime_sft_rollout(cfg, notes)
    _slime_tis_hook(cfg, notes)
    cfg.notes = notes
    validate(cfg)
    return cfg


def _slime_sft_rollout(cfg: Config, notes: list[str]) -> None:
    """slime's SFT run line names its SFT rollout function; here SFT is `--loss-type sft_loss`, which needs none."""
    if cfg.rollout.rollout_function_path != slime_flags.SLIME_SFT_ROLLOUT:
        return
    if not is_sft(cfg):
        raise ConfigError(f"--rollout-function-path {slime_flags.SLIME_SFT_ROLLOUT} is slime's SFT data path: add "
                          "--loss-type sft_loss (slime's SFT runs pass both)")
    notes.append(f"--rollout-function-path {slime_flags.SLIME_SFT_ROLLOUT}: slime's SFT data path; --loss-type "
                 "sft_loss reads the conversations itself (jaxrl_vlm/data/sft.py) and runs no rollout function")


def _slime_tis_hook(cfg: Config, notes: list[str]) -> None:
    """slime's `--use-tis --custom-tis-function-path F`: the hook replaces the TIS weight, so it is the correction."""
    a = cfg.algo
    if a.custom_tis_function_path is not None and a.rollout_correction == "token_tis":
        a.rollout_correction = CUSTOM_CORRECTION
        notes.append(f"--use-tis with --custom-tis-function-path {a.custom_tis_function_path}: the hook replaces the "
                     "TIS weight (slime's order) -> --rollout-correction custom")


# slime spells GSPO and CISPO as advantage estimators; here they are policy losses over GRPO advantages.
_SLIME_LOSS_ESTIMATORS = ("gspo", "cispo")
# slime's TIS options as keys of slime's --custom-config-path YAML (our own config files use our names): the
# translations of its flags.
_SLIME_TIS_KEYS = ("use_tis", "tis_clip", "tis_clip_low")
# slime's --opd-type values name its engines: sglang -> any engine's prompt log-probs, megatron -> the trainer.
_SLIME_OPD_TYPES = {"sglang": "engine", "megatron": "trainer"}


def _slime_spellings(flat: dict[str, Any], source: str, notes: list[str]) -> None:
    """Rewrite slime's spellings in one config layer in place: its example paths (when they do not exist here),
    its TIS keys (`use_tis`, `tis_clip`, `tis_clip_low`) and `advantage_estimator: gspo|cispo`."""
    for key in ("custom_generate_function_path", "custom_config_path"):
        value = flat.get(key)
        alias = slime_flags.SLIME_PATH_ALIASES.get(value) if isinstance(value, str) else None
        if alias is None or Path(value).exists():
            continue
        if key == "custom_config_path" and not Path(alias).exists():
            alias = str(Path(__file__).resolve().parents[1] / alias)  # the repository's configs/, from any cwd
        flat[key] = alias
        notes.append(f"{source}: slime's example path {value} -> {alias} (this project's equivalent)")
    for key in _SLIME_TIS_KEYS:
        if key not in flat:
            continue
        value, entry = flat.pop(key), slime_flags.SLIME_FLAGS["--" + key.replace("_", "-")]
        if entry.nargs == 0 and not coerce(value, bool, f"{source}: {key}"):
            continue  # use_tis: false is the default, no correction
        translated = entry.translate([] if entry.nargs == 0 else [str(value)])
        for name, new in translated.items():
            if name in flat:
                raise ConfigError(f"{source}: {key} (slime's spelling of {name}) and {name} are both set: keep one")
            flat[name] = new
        notes.append(f"{source}: slime's {key}: {value} -> " + ", ".join(f"{k}: {v}" for k, v in translated.items()))
    opd_type = flat.get("opd_type")
    if opd_type in _SLIME_OPD_TYPES:
        flat["opd_type"] = _SLIME_OPD_TYPES[opd_type]
        notes.append(f"{source}: opd_type {opd_type} (slime's spelling) -> {flat['opd_type']}")
    estimator = flat.get("advantage_estimator")
    if estimator in _SLIME_LOSS_ESTIMATORS:
        loss = flat.get("policy_loss", estimator)
        if loss != estimator:
            raise ConfigError(f"{source}: advantage_estimator={estimator} (slime's spelling of the {estimator} loss) "
                              f"conflicts with policy_loss={loss}")
        flat["advantage_estimator"], flat["policy_loss"] = "grpo", estimator
        notes.append(f"{source}: advantage_estimator {estimator} (slime's spelling) -> grpo advantages with the "
                     f"{estimator} policy loss")


def _load_as_hf_checkpoint(cfg: Config, notes: list[str]) -> None:
    """slime passes the HF model directory as `--load` (Megatron bridge mode): when that directory is not one of
    our checkpoints, it is the model to start from."""
    load = cfg.checkpoint.load
    if not load:
        return
    path = Path(load)
    is_hf = (path / "config.json").exists() or (cfg.model.hf_checkpoint is not None and path == Path(cfg.model.hf_checkpoint))
    if not is_hf:
        return
    if cfg.model.hf_checkpoint and Path(cfg.model.hf_checkpoint) != path:
        raise ConfigError(f"--load {load} is an HF model directory but --hf-checkpoint is {cfg.model.hf_checkpoint}: "
                          "pass the model once (--hf-checkpoint) and --load only for our checkpoints")
    cfg.model.hf_checkpoint, cfg.checkpoint.load = load, None
    notes.append(f"--load {load}: an HF model directory, not a checkpoint of ours -> --hf-checkpoint {load}")


def validate(cfg: Config) -> None:
    """Cross-field checks that types alone cannot express."""
    b = cfg.batching
    _validate_numbers(cfg)
    try:
        RematPlan.parse(cfg.model.remat)
    except ValueError as e:
        raise ConfigError(f"--remat: {e}") from None
    if cfg.engine.engine_api_key is not None and not cfg.engine.engine_api_key.strip():
        raise ConfigError("engine_api_key must be a non-empty string (or unset for no key)")
    if any(arg.split("=", 1)[0] == "--api-key" for arg in cfg.engine.sglang_args):
        raise ConfigError("sglang_args: set the key with --engine-api-key instead of --api-key there (the client must "
                          "send it too, and --engine-api-key keeps it out of dumps)")
    for name in ("seq_buckets", "row_buckets"):
        buckets = getattr(b, name)
        if not buckets or sorted(set(buckets)) != buckets or buckets[0] < 1:
            raise ConfigError(f"{name} must be a non-empty strictly increasing list of positive ints, got {buckets}")
    if sorted(set(b.patch_buckets)) != b.patch_buckets or (b.patch_buckets and b.patch_buckets[0] < 0):
        raise ConfigError(f"patch_buckets must be strictly increasing and >= 0, got {b.patch_buckets}")
    _validate_eval(cfg.eval)
    _validate_hooks(cfg)
    _validate_debug(cfg.debug)
    _validate_async(cfg)
    _validate_sft(cfg)
    _validate_placement(cfg)
    try:  # the embedded engine's own checks across its options (KV pages for one request, ...), at startup
        EngineOptions.from_run_config(cfg)
    except ValueError as e:
        raise ConfigError(f"engine options: {e}") from None


def _validate_placement(cfg: Config) -> None:
    """Device lists parse and are disjoint; the embedded-engine options are not set for an external engine;
    --colocate (shared devices, memory released while training) is synchronous and has no device lists."""
    e, m = cfg.engine, cfg.mesh
    rollout = parse_device_ids(e.rollout_devices, "--rollout-devices") if e.rollout_devices is not None else None
    train = parse_device_ids(m.train_devices, "--train-devices") if m.train_devices is not None else None
    if e.tp_size % e.ep_size:
        raise ConfigError(f"--ep-size {e.ep_size} must divide --tp-size {e.tp_size}: the experts are split over ep of "
                          "a replica's tp devices (SGLang's rule)")
    if rollout is not None and len(rollout) != e.tp_size * e.dp_size:
        raise ConfigError(f"--rollout-devices {e.rollout_devices} names {len(rollout)} devices, but the engine has "
                          f"tp_size {e.tp_size} x dp_size {e.dp_size} = {e.tp_size * e.dp_size}")
    if rollout is not None and train is not None:
        check_disjoint(rollout, train)
    launchers = _external_engine_flags(e)
    if len(launchers) > 1:
        raise ConfigError(f"{' and '.join(launchers)} each name the engine: choose one")
    external = external_engine(cfg)
    if e.launch_vllm and not e.vllm_python:
        raise ConfigError("--launch-vllm needs --vllm-python (the interpreter of vLLM's own venv)")
    if e.launch_sglang and e.engine_api == "vllm" or e.launch_vllm and e.engine_api == "sglang":
        raise ConfigError(f"--engine-api {e.engine_api} contradicts {external}")
    if e.engine_api == "vllm" and not external:
        raise ConfigError("--engine-api vllm needs --engine-url or --launch-vllm (the embedded engine speaks SGLang's API)")
    if external and rollout is not None:
        raise ConfigError(f"--rollout-devices places the embedded engine; with {external} the engine's devices are "
                          "its own (CUDA_VISIBLE_DEVICES of its process)")
    if e.launch_sglang and engine_serves(cfg.lora) and max(e.dp_size, _flag_int(e.sglang_args, "--dp-size", 1)) > 1:
        raise ConfigError("--lora-rank with --launch-sglang and --dp-size > 1: SGLang loads adapters at run time only "
                          "with one data-parallel replica (sglang 0.5.23 asserts dp_size == 1 in /load_lora_adapter); "
                          "use --lora-sync merged, or one replica per engine behind the router")
    if e.engine_url and (e.tp_size > 1 or e.dp_size > 1):
        raise ConfigError("--tp-size / --dp-size configure an engine this job starts; the one at --engine-url was "
                          "started with its own")
    if e.weight_sync_mode == "memory" and external:
        raise ConfigError(f"--weight-sync-mode memory needs the embedded engine in this process; {external} is "
                          "another process (use disk or auto)")
    if e.colocate:
        if rollout is not None or train is not None:
            raise ConfigError("--colocate shares every device between engine and trainer; it does not combine with "
                              "--rollout-devices / --train-devices")
        if cfg.rollout.max_staleness > 0:
            raise ConfigError(f"--colocate is synchronous (the engine frees its memory while training); it does not "
                              f"combine with --max-staleness {cfg.rollout.max_staleness}")


def _flag_int(args: list[str], flag: str, default: int) -> int:
    """The integer value of `flag` in a server's argument list (`--flag N` or `--flag=N`), else `default`."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        else:
            continue
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"sglang_args: {flag} {value!r} is not an integer") from None
    return default


def _validate_numbers(cfg: Config) -> None:
    """NaN, infinities and numbers outside the bounds declared on their field are errors naming the key and its
    flag (a NaN lr would train nothing)."""
    for info in FIELDS.values():
        value = getattr(getattr(cfg, info.section), info.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        where = f"{info.section}.{info.name} ({info.flag})"
        if not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {value}")
        problem = bound_error(where, value, {"gt": info.gt, "ge": info.ge, "lt": info.lt, "le": info.le})
        if problem:
            raise ConfigError(problem)


def _validate_hooks(cfg: Config) -> None:
    """slime's hooks (rollout/hooks.py): every path set loads now, so a bad one fails at startup naming its flag
    (this imports the user's file, which may import jax); and the options that go with them agree."""
    for option in HOOK_OPTIONS:
        info = FIELDS[option]
        try:
            load_hook(getattr(getattr(cfg, info.section), option), option)
        except LoadError as e:
            raise ConfigError(str(e)) from e
    r, a = cfg.rollout, cfg.algo
    if (a.loss_type == "custom_loss") != (a.custom_loss_function_path is not None):
        raise ConfigError("--loss-type custom_loss and --custom-loss-function-path go together (slime's "
                          f"convention), got --loss-type {a.loss_type} and --custom-loss-function-path "
                          f"{a.custom_loss_function_path}")
    # The rollout correction's band, and the custom TIS hook as the correction it replaces.
    problem = rollout_correction_problem(a.rollout_correction, a.rollout_correction_low, a.rollout_correction_high,
                                         a.custom_tis_function_path)
    if problem:
        raise ConfigError(problem)
    problem = opd_problem(r.use_opd, r.opd_type, r.opd_teacher_url, r.opd_teacher_checkpoint, a.opd_only,
                          a.opd_kl_coef)
    if problem:
        raise ConfigError(problem)
    if r.use_opd and r.opd_type == "self":
        problem = privileged_problem(r.opsd_privileged_field, r.opsd_privileged_template)
        if problem:
            raise ConfigError(problem)
    if r.opd_teacher_api != "auto" and r.opd_teacher_url is None:
        raise ConfigError(f"--opd-teacher-api {r.opd_teacher_api} is the protocol of --opd-teacher-url, which is not "
                          "set (an embedded teacher from --opd-teacher-checkpoint speaks SGLang's)")
    if r.group_rm and r.custom_rm_path is None:
        raise ConfigError("--group-rm scores groups with --custom-rm-path, which is not set")
    if r.custom_rm_path is not None and a.rm_type is not None:
        raise ConfigError(f"--custom-rm-path {r.custom_rm_path} and --rm-type {a.rm_type} both replace the env's "
                          "reward: set one")


def _validate_debug(d: DebugConfig) -> None:
    """Saved-rollout paths: a `{rollout_id}` template each, and not both (a replay would rewrite its own input)."""
    for name in ("save_debug_rollout_data", "load_debug_rollout_data"):
        template = getattr(d, name)
        if template is not None:
            try:
                check_template(template, "--" + name.replace("_", "-"))
            except ValueError as e:
                raise ConfigError(str(e)) from None
    if d.save_debug_rollout_data is not None and d.load_debug_rollout_data is not None:
        raise ConfigError("--load-debug-rollout-data replays saved rollouts and --save-debug-rollout-data saves new "
                          "ones: set one (a replay would only copy its input)")


# Options of the synchronous driver's step that the asynchronous stream replaces (rollout/streaming.py).
_SYNC_ONLY_ROLLOUT = {
    "partial_rollout": "in-flight episodes continue across steps anyway; --inflight-update-policy says what a weight "
                       "update does to them",
    "mask_offpolicy_in_partial_rollout": "off-policy tokens are corrected by --use-tis and bounded by --max-staleness",
    "over_sampling_batch_size": "the stream replaces every dropped group as it goes",
    "buffer_filter_path": "there are no carried partial groups to filter",
}


def _validate_async(cfg: Config) -> None:
    """--max-staleness K >= 1 runs the streaming rollout (rollout/streaming.py): the default rollout function only,
    without the step-bound options it replaces."""
    r = cfg.rollout
    if r.max_staleness < 0:
        raise ConfigError(f"max_staleness must be >= 0 (0: synchronous), got {r.max_staleness}")
    if r.max_staleness == 0:
        return
    if r.rollout_function_path != RolloutOptions().rollout_function_path:
        raise ConfigError(f"--max-staleness {r.max_staleness} streams groups with the default rollout driver; "
                          f"--rollout-function-path {r.rollout_function_path} produces whole steps (use "
                          "--max-staleness 0 with it)")
    for key, why in _SYNC_ONLY_ROLLOUT.items():
        if getattr(r, key) not in (None, False):
            raise ConfigError(f"--{key.replace('_', '-')} does not apply with --max-staleness {r.max_staleness}: {why}")
    if cfg.engine.disable_weight_sync:
        raise ConfigError("--disable-weight-sync with --max-staleness >= 1: the engine would never reach a newer "
                          "version, so every sample would soon be too stale to train")
    for name in ("save_debug_rollout_data", "load_debug_rollout_data"):
        if getattr(cfg.debug, name) is not None:
            raise ConfigError(f"--{name.replace('_', '-')} works on whole synchronous steps; it does not apply with "
                              f"--max-staleness {r.max_staleness} (use --max-staleness 0)")


def _external_engine_flags(engine: Any) -> list[str]:
    return [flag for flag, on in (("--engine-url", bool(engine.engine_url)), ("--launch-sglang", engine.launch_sglang),
                                  ("--launch-vllm", engine.launch_vllm)) if on]


def external_engine(cfg: Config) -> str | None:
    """The flag that names an engine in another process (`--engine-url`, `--launch-sglang`, `--launch-vllm`), or
    None for the embedded engine of this process."""
    flags = _external_engine_flags(cfg.engine)
    return flags[0] if flags else None


# RL options that mean nothing to an SFT run (no rollout, no reward, no engine, no reference policy): set, they are
# errors naming the flag, not silently ignored.
_RL_ONLY_OPTIONS = ("use_kl_loss", "kl_coef", "rollout_correction", "rollout_correction_low", "rollout_correction_high",
                    "entropy_coef", "custom_tis_function_path",
                    "custom_advantage_function_path", "custom_reward_post_process_path", "custom_rm_path", "rm_type",
                    "engine_url", "engine_worker_urls", "launch_sglang", "launch_vllm", "partial_rollout", "dynamic_filter",
                    "max_staleness", "save_debug_rollout_data", "load_debug_rollout_data", "use_opd")


def _validate_sft(cfg: Config) -> None:
    """`--loss-type sft_loss`: the RL-only options are at their defaults."""
    if not is_sft(cfg):
        return
    set_here = [FIELDS[k].flag for k in _RL_ONLY_OPTIONS
                if getattr(getattr(cfg, FIELDS[k].section), k) != FIELDS[k].default]
    if set_here:
        raise ConfigError(f"--loss-type sft_loss trains on the conversations of --prompt-data, with no rollout, "
                          f"reward, reference policy or engine: {', '.join(set_here)} do not apply (remove them)")


def _validate_eval(e: EvalConfig) -> None:
    """The eval section: NAME PATH pairs with valid slices (parse_eval_prompt_data), and its sampling settings."""
    parse_eval_prompt_data(e.eval_prompt_data)
    if e.eval_interval is not None and e.eval_interval < 1:
        raise ConfigError(f"eval_interval must be >= 1, got {e.eval_interval} (`--eval-interval none` evaluates only "
                          "before training and at the end)")
    if e.eval_interval is not None and not e.eval_prompt_data:
        raise ConfigError(f"--eval-interval {e.eval_interval} needs eval sets: --eval-prompt-data NAME PATH ...")
    if e.n_samples_per_eval_prompt < 1:
        raise ConfigError(f"n_samples_per_eval_prompt must be >= 1, got {e.n_samples_per_eval_prompt}")
    if e.eval_temperature is not None and e.eval_temperature < 0:
        raise ConfigError(f"eval_temperature must be >= 0, got {e.eval_temperature}")
    if e.eval_top_p is not None and not 0.0 < e.eval_top_p <= 1.0:
        raise ConfigError(f"eval_top_p must be in (0, 1], got {e.eval_top_p}")
    if e.eval_max_response_len is not None and e.eval_max_response_len < 1:
        raise ConfigError(f"eval_max_response_len must be >= 1, got {e.eval_max_response_len}")


def describe_options() -> str:
    """Every option with its flag, type, default and meaning (for `jaxrl-vlm config --help-options`)."""
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for info in FIELDS.values():
            if info.section != section:
                continue
            tp = info.type.__name__ if isinstance(info.type, type) else str(info.type).replace("typing.", "")
            choices = f" choices={list(info.choices)}" if info.choices else ""
            bounds = "".join(f" {op}{b:g}" for op, b in ((">", info.gt), (">=", info.ge), ("<", info.lt), ("<=", info.le))
                             if b is not None)
            lines.append(f"  {info.flag:<40} {tp:<22} default={info.default!r}{choices}{bounds}\n      {info.help}")
    return "\n".join(lines)
