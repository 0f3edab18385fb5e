"""What a run needs on disk before it starts: the model directory, the prompt data (created on demand) and the
eval sets (`--eval-prompt-data`, loaded like the prompt data). For an SFT run the data are conversations
(`data/sft.py`), created on demand by the task's `make_sft_dataset`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxrl_vlm.config import Config, ConfigError, EvalSetSpec, is_sft, parse_eval_prompt_data, row_input_key
from jaxrl_vlm.data.geo3k import DatasetError, PromptDataset, load_styled_dataset
from jaxrl_vlm.data.sft import ConversationDataset, load_conversation_dataset
from jaxrl_vlm.errors import CheckpointError
from jaxrl_vlm.models.hf_io import load_hf_config
from jaxrl_vlm.tiny import make_tiny
from rollout.encoding import ChatEncoder
from rollout.loading import LoadError, load_module
from rollout.processing import load_image_processor, load_tokenizer
from rollout.sample import Sample

logger = logging.getLogger(__name__)


def prepare_model(cfg: Config) -> Path:
    """The model directory, created on first use with `--make-tiny`. Its config.json is read here, before any data
    or model is made, so a directory that is not a model of a known family stops the run at once."""
    if not cfg.model.hf_checkpoint:
        raise ConfigError("--hf-checkpoint is required (a Qwen-VL HF directory, or a path for --make-tiny to create)")
    model_dir = Path(cfg.model.hf_checkpoint)
    if not (model_dir / "config.json").exists():
        if not cfg.model.make_tiny:
            if model_dir.name == "final_model":  # another run's export: a warm start whose run has not happened
                raise CheckpointError(f"--hf-checkpoint {model_dir}: no config.json yet. It is the final export of "
                                      f"the run in {model_dir.parent}: run that config first (an SFT warm start: "
                                      "the RL config's header names it), or point --hf-checkpoint elsewhere")
            raise CheckpointError(f"--hf-checkpoint {model_dir}: no config.json (an HF model directory; set "
                                  "--make-tiny to create a tiny random model there)")
        logger.info("creating a tiny random %s at %s", cfg.model.make_tiny_arch, model_dir)
        make_tiny(str(model_dir), seed=cfg.train.seed, arch=cfg.model.make_tiny_arch)
    load_hf_config(model_dir)
    return model_dir


def prepare_assets(cfg: Config) -> tuple[Path, Path]:
    """The model directory and the prompt data, created on first use when the config asks for it."""
    model_dir = prepare_model(cfg)
    if not cfg.data.prompt_data:
        raise ConfigError("--prompt-data is required (parquet or jsonl in the Geometry3K layout)")
    data_path = Path(cfg.data.prompt_data)
    if not data_path.exists():
        if not cfg.data.make_data:
            raise ConfigError(f"--prompt-data {data_path} does not exist (set --make-data to generate synthetic data)")
        make_synthetic_data(cfg, data_path, cfg.data.synthetic_rows, seed=cfg.train.seed)
    prepare_eval_data(cfg)
    return model_dir, data_path


def prepare_eval_data(cfg: Config) -> None:
    """With `--make-data`, the eval set files that do not exist yet, each with its own seed (never the training
    prompts')."""
    if not cfg.data.make_data:
        return
    for k, spec in enumerate(parse_eval_prompt_data(cfg.eval.eval_prompt_data)):
        if not Path(spec.path).exists():
            make_synthetic_data(cfg, Path(spec.path), cfg.data.synthetic_eval_rows, seed=cfg.train.seed + 1 + k)


def make_synthetic_data(cfg: Config, path: Path, num_rows: int, seed: int) -> None:
    """`--make-data`: write `num_rows` rows of the `--synthetic-data-module` generator at `path`: its prompts
    (`make_dataset`), or for an SFT run its transcripts (`make_sft_dataset`)."""
    what = "--synthetic-data-module"
    try:
        module = load_module(cfg.data.synthetic_data_module, what)
    except LoadError as e:
        raise ConfigError(str(e)) from e
    name = "make_sft_dataset" if is_sft(cfg) else "make_dataset"
    make_dataset = getattr(module, name, None)
    if not callable(make_dataset):
        raise ConfigError(f"{what} {cfg.data.synthetic_data_module}: the module has no {name}(path, num_rows, seed=, "
                          "image_size=)")
    logger.info("generating %d synthetic %s (%s, seed %d) at %s", num_rows, "transcripts" if is_sft(cfg) else "rows",
                cfg.data.synthetic_data_module, seed, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    make_dataset(str(path), num_rows, seed=seed, image_size=cfg.data.synthetic_image_size)


def load_dataset(cfg: Config, data_path: Path) -> Any:
    """The prompt dataset in the configured prompt style (the task's instructions, or the bare problem)."""
    d = cfg.data
    common = dict(input_key=row_input_key(cfg), label_key=d.label_key, image_key=d.image_key, on_bad_row=d.on_bad_row)
    return load_styled_dataset(str(data_path), d.prompt_style, system_prompt=d.system_prompt, **common)


def transcript_encoder(cfg: Config, model_dir: Path) -> ChatEncoder:
    """The model's tokenizer, chat template (with `--apply-chat-template-kwargs`) and image processor, which lay an
    SFT run's conversations out as the model sees them."""
    return ChatEncoder(load_tokenizer(model_dir), load_image_processor(model_dir),
                       template_kwargs=cfg.multiturn.apply_chat_template_kwargs)


def load_conversations(cfg: Config, data_path: Path, encoder: ChatEncoder) -> ConversationDataset:
    """An SFT run's conversations (`data/sft.py`) with the configured keys and bad-row policy."""
    d = cfg.data
    return load_conversation_dataset(str(data_path), encoder, input_key=row_input_key(cfg), image_key=d.image_key,
                                     tool_key=d.tool_key, on_bad_row=d.on_bad_row)


@dataclass
class EvalSet:
    """One eval set: its spec, the dataset loaded like the training prompts, and the dataset items it keeps
    (those whose file row lies in the spec's slice), in file order."""

    spec: EvalSetSpec
    dataset: PromptDataset | ConversationDataset
    items: list[int]

    @property
    def name(self) -> str:
        return self.spec.name

    def __len__(self) -> int:
        return len(self.items)

    def prompts(self) -> list[Sample]:
        """Fresh prompt Samples of the set, one per kept row."""
        return [self.dataset[i] for i in self.items]


Loader = Callable[[Config, Path], "PromptDataset | ConversationDataset"]


def load_eval_set(cfg: Config, spec: EvalSetSpec, loader: Loader = load_dataset) -> EvalSet:
    """Load one eval set with the training data's loader (default: the prompts' loader and prompt style); errors
    name the set."""
    where = f"eval set {spec.name!r} ({spec})"
    if not Path(spec.path).is_file():
        raise ConfigError(f"{where}: {spec.path} does not exist")
    try:
        dataset = loader(cfg, Path(spec.path))
    except DatasetError as e:
        raise ConfigError(f"{where}: {e}") from e
    # The slice selects file rows, as slime's PATH@[a:b] does (rows skipped by --on-bad-row skip stay skipped).
    total = len(dataset) + dataset.num_skipped
    wanted = set(range(total)[spec.rows])
    items = [i for i, row in enumerate(dataset.rows) if row in wanted]
    if not items:
        raise ConfigError(f"{where}: the slice keeps no usable row of the {total} in {spec.path}")
    return EvalSet(spec, dataset, items)


def load_eval_sets(cfg: Config, loader: Loader = load_dataset) -> list[EvalSet]:
    """Every `--eval-prompt-data` set, loaded with `loader` (empty when none is given)."""
    sets = [load_eval_set(cfg, spec, loader) for spec in parse_eval_prompt_data(cfg.eval.eval_prompt_data)]
    for s in sets:
        logger.info("eval set %s: %d %s from %s", s.name, len(s), "conversations" if is_sft(cfg) else "prompts", s.spec)
    return sets
