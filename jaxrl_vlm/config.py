"""Typed run configuration: one place that lists every option, its default and its meaning.

A run's config is resolved from four layers, later ones winning:

1. the defaults below;
2. a YAML file (``jaxrl-vlm train CONFIG``), nested by section (``rollout: {rollout_batch_size: 8}``) or flat
   (``rollout_batch_size: 8``);
3. the ``--custom-config-path`` YAML (slime's mechanism for ``max_turns`` and friends). Its keys may be any
   typed field or a key declared by the loaded environment / generate function module in ``CONFIG_KEYS``;
   those land in ``Config.extra``;
4. ``--flag value`` command-line overrides, with slime's flag names (``--rollout-batch-size 8``).

Field names are globally unique across sections, so every field has exactly one flag:
``--`` + name with ``_`` replaced by ``-``. Unknown keys and wrong types are errors that name the key, the
source and the closest valid key. This module imports neither jax nor the rollout code it configures.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from rollout.loading import LoadError, load_function, load_module


class ConfigError(ValueError):
    """A config problem a user can fix: unknown key, wrong type, bad value, unreadable file."""


def opt(default: Any, help: str, *, choices: tuple | None = None) -> Any:
    """Declare an option with its help text (and optional allowed values)."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: _deepcopy(d), metadata=meta)
    return field(default=default, metadata=meta)


def _deepcopy(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


# --------------------------------------------------------------------------- sections
@dataclass
class ModelConfig:
    hf_checkpoint: str | None = opt(None, "HF Qwen3-VL checkpoint directory (safetensors + config + tokenizer + processor).")
    param_dtype: str = opt("float32", "Dtype of the trainable parameters.", choices=("float32", "bfloat16"))
    compute_dtype: str = opt("float32", "Dtype of activations/matmuls (bfloat16 on GPU/TPU).", choices=("float32", "bfloat16"))
    remat: str = opt("none", "Rematerialisation per decoder layer.", choices=("none", "full"))
    attention_impl: str = opt(
        "xla",
        "Attention of the training forward: xla (einsums, dense masks), pallas_gpu or pallas_tpu (fused "
        "segment-aware flash kernels, O(T) memory; seq/patch buckets must be multiples of 16 (GPU) / 128 (TPU)).",
        choices=("xla", "pallas_gpu", "pallas_tpu"),
    )
    logprob_chunk_size: int = opt(512, "Sequence chunk for log-prob computation (bounds fp32 vocab logits memory).")
    make_tiny: bool = opt(False, "Create a tiny random Qwen3-VL at --hf-checkpoint if it has no config.json (CPU demo runs).")


@dataclass
class DataConfig:
    prompt_data: str | None = opt(None, "Training prompts: parquet or jsonl in the Geometry3K layout.")
    input_key: str = opt("problem", "Row field holding the problem text (with <image> markers).")
    label_key: str = opt("answer", "Row field holding the reference answer.")
    image_key: str = opt("images", "Row field holding the list of images.")
    on_bad_row: str = opt("error", "What to do with a malformed row: raise, or skip and count it.", choices=("error", "skip"))
    rollout_shuffle: bool = opt(True, "Shuffle prompts each epoch (deterministic by --seed).")
    system_prompt: str | None = opt(None, "System prompt prepended to every conversation (None: the task's default).")
    prompt_style: str = opt("geo3k", "Task prompt: geo3k's tool-call instructions and tool schema, or the bare problem.", choices=("geo3k", "plain"))
    synthetic_rows: int = opt(256, "Rows of synthetic geo3k to generate when --prompt-data is missing and --make-data is on.")
    make_data: bool = opt(False, "Generate a synthetic geo3k dataset at --prompt-data if the file does not exist.")
    synthetic_image_size: int = opt(224, "Side in pixels of generated synthetic diagrams.")


@dataclass
class RolloutConfig:
    rollout_function_path: str = opt("rollout.driver.generate_rollout", "Dotted path of the whole-step rollout function.")
    custom_generate_function_path: str = opt("rollout.multiturn.generate", "Dotted path of the per-sample episode function.")
    rollout_interaction_env_path: str | None = opt("envs.geo3k", "Module (dotted or .py path) exposing build_env(sample, args).")
    custom_config_path: str | None = opt(None, "YAML whose keys become attributes of args (max_turns, ...).")
    num_rollout: int = opt(10, "Number of rollout -> train iterations.")
    rollout_batch_size: int = opt(4, "Prompts per rollout step.")
    n_samples_per_prompt: int = opt(4, "Samples per prompt (a group).")
    over_sampling_batch_size: int | None = opt(None, "Prompts submitted at a time when dynamic filtering drops groups.")
    rollout_max_response_len: int = opt(512, "Token budget of the whole response, observation tokens included.")
    rollout_max_context_len: int | None = opt(None, "Maximum prompt+response length (None: no extra limit).")
    rollout_temperature: float = opt(1.0, "Sampling temperature.")
    rollout_top_p: float = opt(1.0, "Nucleus sampling threshold in (0, 1].")
    rollout_top_k: int = opt(-1, "Top-k sampling (-1: whole vocabulary).")
    rollout_seed: int = opt(42, "Seed of the rollout sampler.")
    rollout_stop_token_ids: list[int] = opt([], "Extra stop token ids (the model's EOS ids always stop).")
    sglang_server_concurrency: int = opt(64, "Maximum in-flight /generate requests per engine.")
    dynamic_filter: str | None = opt(None, "Group filter: drop groups whose rewards are all equal.", choices=(None, "zero_std"))
    partial_rollout: bool = opt(False, "Resume unfinished episodes in the next step instead of discarding them.")
    mask_offpolicy_in_partial_rollout: bool = opt(False, "Mask tokens of resumed episodes sampled by older weights.")
    episode_timeout: float = opt(600.0, "Wall-clock limit of one episode in seconds.")


@dataclass
class MultiTurnConfig:
    max_turns: int = opt(3, "Maximum model turns per episode.")
    max_env_retries_per_turn: int = opt(2, "Retries of an env step that raises or times out before the episode FAILs.")
    env_step_timeout: float = opt(30.0, "Seconds an env step may take.")
    delta_check: str = opt("strict", "Prefix-stability check of observation deltas at finalize.", choices=("strict", "warn", "off"))


@dataclass
class AlgoConfig:
    advantage_estimator: str = opt("grpo", "Advantage estimator.", choices=("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"))
    disable_grpo_std_normalization: bool = opt(False, "Dr.GRPO: do not divide group-centred rewards by their std.")
    policy_loss: str = opt("ppo_clip", "Policy loss from the loss registry.")
    eps_clip: float = opt(0.2, "Lower PPO clip range.")
    eps_clip_high: float | None = opt(None, "Upper PPO clip range (None: equal to --eps-clip; DAPO uses 0.28).")
    eps_clip_c: float | None = opt(None, "Dual-clip constant (> 1) capping the loss of negative-advantage tokens.")
    use_kl_loss: bool = opt(False, "Add a KL(policy || reference) loss term.")
    kl_loss_coef: float = opt(0.0, "Coefficient of the KL loss term.")
    kl_loss_type: str = opt("low_var_kl", "KL estimator.", choices=("k1", "k2", "k3", "low_var_kl"))
    entropy_coef: float = opt(0.0, "Entropy bonus coefficient.")
    use_tis: bool = opt(False, "Truncated importance sampling against rollout log-probs.")
    tis_clip: float = opt(2.0, "Upper clip of TIS weights.")
    tis_clip_low: float = opt(0.0, "Lower clip of TIS weights.")
    loss_aggregation: str = opt("seq_mean_token_mean", "How token losses are reduced.", choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"))
    loss_aggregation_constant: float | None = opt(None, "Divisor for seq_mean_token_sum_norm (Dr.GRPO; default: --rollout-max-response-len).")


@dataclass
class TrainConfig:
    global_batch_size: int | None = opt(None, "Samples per optimizer step (None: rollout_batch_size * n_samples_per_prompt).")
    micro_batch_size: int | None = opt(None, "Rows per micro-batch for gradient accumulation (None: no accumulation).")
    num_steps_per_rollout: int = opt(1, "Optimizer steps per rollout (>1 recomputes old log-probs).")
    seed: int = opt(1234, "Seed of parameter init, data order and the trainer RNG.")
    output_dir: str = opt("runs/default", "Where metrics, plots, exports and checkpoints go.")


@dataclass
class OptimConfig:
    optimizer: str = opt("adamw", "Optimizer.", choices=("adamw",))
    lr: float = opt(1e-6, "Learning rate.")
    min_lr: float = opt(0.0, "Final learning rate of a decaying schedule.")
    lr_decay_style: str = opt("constant", "Learning-rate schedule.", choices=("constant", "linear", "cosine"))
    lr_warmup_iters: int = opt(0, "Linear warm-up steps.")
    weight_decay: float = opt(0.1, "AdamW weight decay.")
    adam_beta1: float = opt(0.9, "Adam beta1.")
    adam_beta2: float = opt(0.98, "Adam beta2.")
    adam_eps: float = opt(1e-8, "Adam epsilon.")
    clip_grad: float = opt(1.0, "Global-norm gradient clipping (0: off).")


@dataclass
class BatchingConfig:
    seq_buckets: list[int] = opt([256, 512, 1024, 2048, 4096], "Allowed padded row lengths.")
    row_buckets: list[int] = opt([1, 2, 4, 8, 16, 32], "Allowed numbers of rows per micro-batch.")
    patch_buckets: list[int] = opt([0, 256, 1024, 4096, 16384], "Allowed padded vision-patch counts.")
    packing: bool = opt(True, "Pack several trajectories per row (segment-aware attention).")
    overlong_policy: str = opt("error", "A trajectory longer than the largest bucket: raise, or truncate its tail.", choices=("error", "truncate"))


@dataclass
class EngineConfig:
    engine_url: str | None = opt(None, "URL of an SGLang server or router (None: start the embedded JAX engine).")
    engine_worker_urls: list[str] = opt([], "Worker URLs behind a router: control calls go to each directly.")
    launch_sglang: bool = opt(False, "Spawn `python -m sglang.launch_server` from --sglang-python (its own venv) and stop it at the end.")
    sglang_python: str | None = opt(None, "Interpreter of the separate SGLang venv.")
    sglang_args: list[str] = opt([], "Extra arguments for sglang.launch_server.")
    engine_host: str = opt("127.0.0.1", "Bind address of the embedded engine.")
    engine_port: int = opt(0, "Port of the embedded engine (0: a free port).")
    engine_max_batch: int = opt(32, "Decode slots of the embedded engine.")
    engine_max_seq_len: int = opt(4096, "Tokens per decode slot of the embedded engine (prompt with expanded pads + response).")
    engine_prefix_cache: bool = opt(
        True,
        "Embedded engine: keep finished requests' KV cache so a later turn of the same conversation prefills only its "
        "new tokens (and new images); SGLang's radix cache plays this role.",
    )
    engine_request_timeout: float = opt(300.0, "Seconds per /generate request.")
    engine_start_timeout: float = opt(900.0, "Seconds to wait for the engine (embedded, launched or external) to become healthy.")
    engine_max_retries: int = opt(3, "Retries of a /generate request on connection errors and 5xx.")
    weight_sync_dir: str | None = opt(None, "Directory for versioned weight exports (a RAM disk is best; None: under output_dir).")
    disable_weight_sync: bool = opt(False, "Do not push new weights to the engine (for ablations only).")
    weight_sync_dtype: str | None = opt(None, "Dtype of exported weights (None: bfloat16 for --engine-url, the param dtype for the embedded engine).", choices=(None, "float32", "bfloat16"))


@dataclass
class MeshConfig:
    mesh_config: str | None = opt(None, "YAML file with a mesh section (configs/mesh/*.yaml) merged over these values.")
    mesh_data: int = opt(-1, "Size of the data axis (-1: fill).")
    mesh_fsdp: int = opt(1, "Size of the fsdp axis (-1: fill).")
    mesh_tensor: int = opt(1, "Size of the tensor axis (-1: fill).")
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
    save_interval: int = opt(0, "Steps between checkpoints (0: only at the end).")
    keep_checkpoints: int = opt(3, "How many recent checkpoints to keep.")


@dataclass
class DistributedConfig:
    coordinator_address: str | None = opt(None, "host:port of process 0's jax.distributed coordinator (or env JAXRL_COORDINATOR).")
    num_processes: int | None = opt(None, "Processes in the job (or env JAXRL_NUM_PROCESSES).")
    process_id: int | None = opt(None, "This process's id, 0..num_processes-1 (or env JAXRL_PROCESS_ID).")
    local_device_ids: list[int] = opt([], "Local devices this process uses (default all; or env JAXRL_LOCAL_DEVICE_IDS).")
    distributed_auto: bool = opt(False, "Let jax detect the cluster: TPU pod, SLURM, Open MPI (or env JAXRL_DISTRIBUTED=auto).")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "multiturn": MultiTurnConfig,
    "algo": AlgoConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "batching": BatchingConfig,
    "engine": EngineConfig,
    "mesh": MeshConfig,
    "checkpoint": CheckpointConfig,
    "distributed": DistributedConfig,
}


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
    engine: EngineConfig = field(default_factory=EngineConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    # Keys declared by the loaded env / generate module (CONFIG_KEYS) and set via --custom-config-path.
    extra: dict[str, Any] = field(default_factory=dict)

    def to_namespace(self) -> types.SimpleNamespace:
        """The flat `args` that rollout functions and environments receive (slime's convention)."""
        flat: dict[str, Any] = {}
        for section in SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, section)))
        flat.update(self.extra)
        return types.SimpleNamespace(**flat)

    def to_dict(self) -> dict[str, Any]:
        out = {section: dataclasses.asdict(getattr(self, section)) for section in SECTIONS}
        if self.extra:
            out["extra"] = dict(self.extra)
        return out

    def dump_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ------------------------------------------------------------------ field index
@dataclass(frozen=True)
class FieldInfo:
    section: str
    name: str
    type: Any
    help: str
    choices: tuple | None
    default: Any

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
            index[f.name] = FieldInfo(section, f.name, hints[f.name], f.metadata.get("help", ""), f.metadata.get("choices"), default)
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


def parse_cli_overrides(argv: list[str]) -> dict[str, Any]:
    """`--flag value` / `--flag=value` / bare boolean `--flag` -> {field_name: raw value}."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}: options are --flag value")
        flag, eq, inline = token.partition("=")
        info = FLAGS.get(flag)
        if info is None:
            raise ConfigError(f"unknown option {flag}{_closest(flag, FLAGS)}")
        if eq:
            raw: Any = inline
            i += 1
        elif _is_bool(info.type) and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
            raw = True
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"option {flag} needs a value")
            raw = argv[i + 1]
            i += 2
        out[info.name] = _parse_cli_value(raw, info)
    return out


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


def load_config(path: str | None = None, argv: list[str] | None = None) -> Config:
    """Resolve defaults <- YAML file <- custom config <- CLI flags into a validated Config."""
    file_flat = flatten_config_mapping(read_yaml(path), str(path)) if path else {}
    cli_flat = parse_cli_overrides(list(argv or []))
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
    # env/generate paths may themselves be set by the custom config (slime's example does this).
    paths_view = {**merged, **{k: v for k, v in custom_data.items() if k in FIELDS}, **cli_flat}
    needs_declared = any(k not in FIELDS for k in custom_data) or any(k.startswith("extra.") for k in file_flat)
    declared = declared_extra_keys(paths_view) if needs_declared else {}

    cfg = Config()
    _apply(cfg, mesh_flat, str(mesh_path), declared)
    _apply(cfg, file_flat, str(path), declared)
    _apply(cfg, custom_data, str(custom_path), declared)
    _apply(cfg, cli_flat, "command line", declared)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field checks that types alone cannot express."""
    r, a, b = cfg.rollout, cfg.algo, cfg.batching
    positive = {
        "num_rollout": r.num_rollout,
        "rollout_batch_size": r.rollout_batch_size,
        "n_samples_per_prompt": r.n_samples_per_prompt,
        "rollout_max_response_len": r.rollout_max_response_len,
        "max_turns": cfg.multiturn.max_turns,
        "sglang_server_concurrency": r.sglang_server_concurrency,
        "num_steps_per_rollout": cfg.train.num_steps_per_rollout,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if not 0.0 < r.rollout_top_p <= 1.0:
        raise ConfigError(f"rollout_top_p must be in (0, 1], got {r.rollout_top_p}")
    if r.rollout_temperature < 0:
        raise ConfigError(f"rollout_temperature must be >= 0, got {r.rollout_temperature}")
    if a.eps_clip_c is not None and a.eps_clip_c <= 1.0:
        raise ConfigError(f"eps_clip_c must be > 1 (dual clip), got {a.eps_clip_c}")
    if cfg.multiturn.max_env_retries_per_turn < 0:
        raise ConfigError("max_env_retries_per_turn must be >= 0")
    for name in ("seq_buckets", "row_buckets"):
        buckets = getattr(b, name)
        if not buckets or sorted(set(buckets)) != buckets or buckets[0] < 1:
            raise ConfigError(f"{name} must be a non-empty strictly increasing list of positive ints, got {buckets}")
    if sorted(set(b.patch_buckets)) != b.patch_buckets or (b.patch_buckets and b.patch_buckets[0] < 0):
        raise ConfigError(f"patch_buckets must be strictly increasing and >= 0, got {b.patch_buckets}")
    gbs = cfg.train.global_batch_size
    if gbs is not None and gbs < 1:
        raise ConfigError(f"global_batch_size must be >= 1, got {gbs}")


def describe_options() -> str:
    """Every option with its flag, type, default and meaning (for `jaxrl-vlm config --help-options`)."""
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for info in FIELDS.values():
            if info.section != section:
                continue
            tp = str(info.type).replace("typing.", "")
            choices = f" choices={list(info.choices)}" if info.choices else ""
            lines.append(f"  {info.flag:<40} {tp:<22} default={info.default!r}{choices}\n      {info.help}")
    return "\n".join(lines)
