"""The `jaxrl-vlm` command line.

Subcommands import their heavy dependencies (jax, transformers) lazily, so `jaxrl-vlm config --dump`
answers in well under a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import types
import typing
from pathlib import Path

from jaxrl_vlm.config import Config, ConfigError, describe_options, is_sft, load_config
from jaxrl_vlm.engine.options import DTYPES, EngineOptions
from jaxrl_vlm.models.config import FAMILY_PARSERS
from jaxrl_vlm.xla_cpu_cores import confine_xla_threads
from rollout.client import EngineRefused, WorkerLost
from rollout.engine_link import EngineLost
from rollout.loading import LoadError, load_module
from rollout.options import MultiTurnOptions

# Bad input, each reported in one line (`jaxrl-vlm <command>: error: <cause>`) with exit code 2: `ConfigError`, its
# checkpoint and dataset errors included, and the two of rollout/, which cannot derive from it (rollout/ never
# imports jaxrl_vlm): user code that does not load, and an engine that cannot serve the run as it was started.
BAD_INPUT = (ConfigError, LoadError, EngineRefused)


def _cmd_config(ns: argparse.Namespace, rest: list[str]) -> int:
    if ns.help_options:
        print(describe_options())
        return 0
    config_path, overrides = split_config_argv(rest)
    cfg = load_config(config_path, overrides)
    for note in cfg.notes:  # what became of slime flags and spellings; stdout stays valid YAML
        print(f"# {note}", file=sys.stderr)
    print(cfg.dump_yaml(), end="")  # --dump is the only output mode today; the flag is accepted for clarity
    return 0


def _cmd_train(ns: argparse.Namespace, rest: list[str]) -> int:
    config_path, overrides = split_config_argv(rest)
    cfg = load_config(config_path, overrides)
    from jaxrl_vlm.distributed import initialize_from_env_or_config
    from jaxrl_vlm.sglang_launcher import apply_colocation

    colocation = apply_colocation(cfg.engine, os.environ)  # JAX's memory share is read when its backend starts
    if colocation:
        cfg.notes.append(colocation)
    initialize_from_env_or_config(cfg.distributed)  # before anything touches a JAX backend
    from jaxrl_vlm.job.run import run_training

    outcome = run_training(cfg)
    if outcome.preempted is not None:  # a preemption is a clean stop: exit 0, the checkpoint resumes it
        p = outcome.preempted
        print(f"run preempted ({p.signals}) after {p.completed_steps} steps: checkpoint of step {p.completed_steps} in "
              f"{p.directory}; resume with --load {p.directory}")
        return 0
    print(f"run finished: metrics, plots, checkpoints and final_model under {cfg.train.output_dir}")
    return 0


def _no_sft(cfg: Config, command: str) -> None:
    if is_sft(cfg):
        raise ConfigError(f"{command} samples from an engine; an SFT config (--loss-type sft_loss) has no rollout "
                          "(its held-out NLL is logged by `jaxrl-vlm train` with --eval-prompt-data)")


def _cmd_rollout(ns: argparse.Namespace, rest: list[str]) -> int:
    config_path, overrides = split_config_argv(rest)
    cfg = load_config(config_path, overrides)
    _no_sft(cfg, "jaxrl-vlm rollout")
    import asyncio

    from jaxrl_vlm.job.run import run_one_rollout

    result = asyncio.run(run_one_rollout(cfg, ns.dump))
    kept = len(result.samples)
    print(f"rollout: {len(result.groups)} groups, {kept} samples kept, dropped {dict(result.dropped)}")
    if ns.dump:
        from rollout.dump import validate_dump

        validate_dump(ns.dump)
        print(f"dump written and validated: {ns.dump}")
    return 0


def _cmd_eval(ns: argparse.Namespace, rest: list[str]) -> int:
    """Evaluate a checkpoint (ours, or an HF directory) on the config's eval sets and print a table."""
    config_path, overrides = split_config_argv(rest)
    cfg = load_config(config_path, overrides)
    _no_sft(cfg, "jaxrl-vlm eval")
    import asyncio

    from jaxrl_vlm.job.eval import evaluate_weights

    report = asyncio.run(evaluate_weights(cfg, ns.load, dump_dir=Path(ns.dump_dir) if ns.dump_dir else None))
    print(f"evaluated {report.weights}")
    print(report.table())
    if ns.metrics_json:
        Path(ns.metrics_json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.metrics_json).write_text(json.dumps({"weights": report.weights, "step": report.step,
                                                     "metrics": report.metrics}, indent=1, allow_nan=True))
    return 0


def _cmd_plot(ns: argparse.Namespace, rest: list[str]) -> int:
    """Overlay several runs' curves, one PNG per metric."""
    if rest:
        raise ConfigError(f"plot: unexpected arguments {rest}")
    from jaxrl_vlm.job.run_log import plot_runs

    try:
        written = plot_runs(ns.runs, ns.out)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from e
    print(f"wrote {len(written)} plots to {ns.out}: {', '.join(p.name for p in written)}")
    return 0


def _cmd_view(ns: argparse.Namespace, rest: list[str]) -> int:
    """Serve a run's trajectories as a local web page, or write them to one self-contained HTML file."""
    if rest:
        raise ConfigError(f"view: unexpected arguments {rest}")
    from jaxrl_vlm.viewer.server import export_html, index_run, serve

    try:
        index_run(ns.run)  # a missing or empty run fails here, before a server starts
        if ns.export:
            print(f"wrote {export_html(ns.run, ns.export)}")
            return 0
    except ValueError as e:  # no dumps, or a dump that breaks its invariants (rollout.dump.DumpError)
        raise ConfigError(str(e)) from e
    serve(ns.run, ns.host, ns.port)
    return 0


def _cmd_compare_losses(ns: argparse.Namespace, rest: list[str]) -> int:
    """Train each loss variant on the same saved rollouts from the same weights; a table and one plot per metric."""
    config_path, overrides = split_config_argv(rest)
    from jaxrl_vlm.job.compare import compare_losses, parse_variant

    variants = [parse_variant(spec) for spec in ns.variant]
    report = compare_losses(config_path, overrides, variants, ns.out)
    print(report.markdown)
    print(f"wrote {report.table_md}, {report.table_csv} and {len(report.plots)} plots to {report.plots[0].parent}: "
          f"{', '.join(p.name for p in report.plots)}; each variant's run under {report.run_dirs[0].parent}")
    return 0


# `make-dataset --task NAME`: the shipped tasks' generators (any other value is a module path, loaded like the env).
DATASET_TASKS = {"geo3k": "envs.geo3k.synthetic", "color_reveal": "envs.color_reveal.synthetic"}


def _cmd_make_dataset(ns: argparse.Namespace, rest: list[str]) -> int:
    """A task's synthetic prompts (`make_dataset`) or, with --sft, its SFT transcripts (`make_sft_dataset`)."""
    if rest:
        raise ConfigError(f"make-dataset: unexpected arguments {rest}")

    module_path = DATASET_TASKS.get(ns.task, ns.task)
    try:
        module = load_module(module_path, "make-dataset --task")
    except LoadError as e:
        raise ConfigError(str(e)) from e
    name = "make_sft_dataset" if ns.sft else "make_dataset"
    make = getattr(module, name, None)
    if not callable(make):
        raise ConfigError(f"make-dataset --task {ns.task}: {module_path} has no {name}(path, num_rows, seed=, image_size=)")
    kwargs = {} if ns.image_size is None else {"image_size": ns.image_size}
    try:
        path = make(ns.out, ns.num_rows, seed=ns.seed, **kwargs)
    except ValueError as e:
        raise ConfigError(f"make-dataset: {e}") from e
    what = "SFT transcripts" if ns.sft else "rows"
    print(f"wrote {ns.num_rows} synthetic {ns.task} {what} to {path}")
    return 0


def _cmd_untie_embeddings(ns: argparse.Namespace, rest: list[str]) -> int:
    """Copy a checkpoint with an explicit LM head: what a vLLM server must start from to take weight syncs."""
    if rest:
        raise ConfigError(f"untie-embeddings: unexpected arguments {rest}")
    import jax.numpy as jnp  # jax and the model code only for this command (CLI start-up stays light)

    from jaxrl_vlm.models.hf_io import from_hf, to_hf

    src = Path(ns.src)
    config = json.loads((src / "config.json").read_text())
    dtype = jnp.dtype(config.get("dtype") or config.get("torch_dtype") or "bfloat16")  # the checkpoint's own
    out = to_hf(from_hf(src, param_dtype=dtype), ns.out, dtype=dtype, copy_from=src, untie_embeddings=True)
    print(f"wrote {out} ({dtype}): tie_word_embeddings false, explicit lm_head.weight")
    return 0


def _cmd_export_lora(ns: argparse.Namespace, rest: list[str]) -> int:
    config_path, overrides = split_config_argv(rest)
    cfg = load_config(config_path, overrides)
    from jaxrl_vlm.job.export_lora import export_checkpoint  # jax only for this command

    done = export_checkpoint(cfg, ns.checkpoint, ns.out, step=ns.step, merged=not ns.no_merged)
    merged = f"; merged model -> {done.merged}" if done.merged is not None else ""
    print(f"step {done.step}: PEFT adapter -> {done.adapter}{merged}")
    return 0


def _cmd_make_tiny(ns: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise ConfigError(f"make-tiny: unexpected arguments {rest}")
    from jaxrl_vlm.tiny import make_tiny, summarize

    try:
        out = make_tiny(ns.out, seed=ns.seed, vocab_size=ns.vocab_size, init=ns.init, dtype=ns.dtype, arch=ns.arch,
                        head_dim=ns.head_dim, overwrite=ns.overwrite)
    except FileExistsError as e:  # its message names the command already
        raise ConfigError(str(e)) from e
    except ValueError as e:
        raise ConfigError(f"make-tiny: {e}") from e
    print(summarize(out))
    return 0


def _cmd_dump_shardings(ns: argparse.Namespace, rest: list[str]) -> int:
    """Parameter and input shardings of each layout as JSON (the goldens under tests/goldens/sharding/)."""
    if rest:
        raise ConfigError(f"dump-shardings: unexpected arguments {rest}")
    if ns.out and len(ns.mesh_config) != 1:
        raise ConfigError("dump-shardings: --out takes one --mesh-config; use --out-dir for several")
    from jaxrl_vlm.sharding.goldens import dump_shardings, format_dump

    if ns.hf_checkpoint:
        from jaxrl_vlm.models.hf_io import load_hf_config

        model_cfg = load_hf_config(ns.hf_checkpoint)
    else:
        from jaxrl_vlm.tiny import tiny_model_config

        model_cfg = tiny_model_config(ns.vocab_size, arch=ns.arch)
    for mesh_path in ns.mesh_config:
        mesh_cfg = load_config(None, ["--mesh-config", mesh_path]).mesh
        text = format_dump(dump_shardings(model_cfg, mesh_cfg, ns.num_devices))
        target = Path(ns.out) if ns.out else Path(ns.out_dir) / f"{Path(mesh_path).stem}.json" if ns.out_dir else None
        if target is None:
            print(text, end="")
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            print(f"wrote {target}", file=sys.stderr)
    return 0


def _cmd_serve(ns: argparse.Namespace, rest: list[str]) -> int:
    """The embedded JAX engine behind SGLang's native HTTP API, in the foreground."""
    if rest:
        raise ConfigError(f"serve: unexpected arguments {rest}")
    given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineOptions) if hasattr(ns, f.name)}
    if ns.dtype is not None:  # --dtype sets both, unless one is given on its own
        given = {"param_dtype": ns.dtype, "compute_dtype": ns.dtype, **given}
    try:
        config = EngineOptions(**given)
        if ns.xla_cpu_cores is not None:  # before anything starts jax's backends
            confine_xla_threads(ns.xla_cpu_cores)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"serve: {e}") from e
    from jaxrl_vlm.engine import serve

    serve(ns.model, host=ns.host, port=ns.port, config=config, weight_version=ns.weight_version, api_key=ns.api_key)
    return 0


def _cmd_env_serve(ns: argparse.Namespace, rest: list[str]) -> int:
    """An env module behind OpenEnv's WebSocket protocol (envs/env_server.py), in the foreground."""
    import asyncio

    import yaml

    from envs.env_server import EnvServer, serve as serve_env  # CLI start-up laziness: aiohttp's server

    if rest:
        raise ConfigError(f"env-serve: unexpected arguments {rest}")
    keys: dict[str, typing.Any] = {}
    if ns.custom_config_path:
        with open(ns.custom_config_path, encoding="utf-8") as f:
            keys = yaml.safe_load(f) or {}
        if not isinstance(keys, dict):
            raise ConfigError(f"env-serve: {ns.custom_config_path} is not a mapping of env keys")
    args = types.SimpleNamespace(**{**dataclasses.asdict(MultiTurnOptions()), **keys})
    if ns.max_turns is not None:
        args.max_turns = ns.max_turns
    if ns.api_key is None and ns.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger(__name__).warning("env-serve: bound to %s without --api-key: anyone who reaches it can "
                                            "drive the env", ns.host)
    module = load_module(ns.env_module, "env-serve ENV_MODULE")
    try:
        server = EnvServer(module, args, max_sessions=ns.max_sessions, api_key=ns.api_key)
    except ValueError as e:
        raise ConfigError(f"env-serve: {e}") from e
    try:
        asyncio.run(serve_env(server, ns.host, ns.port))
    except KeyboardInterrupt:
        pass
    return 0


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """One flag per `EngineOptions` field (`--max-batch`, plus the SGLang spellings its `flags` declare), with the
    field's help, default, choices and bounds; a flag left out keeps the field's default (the bounds are checked
    when the options are built)."""
    hints = typing.get_type_hints(EngineOptions)
    for f in dataclasses.fields(EngineOptions):
        meta, flag = f.metadata, "--" + f.name.replace("_", "-")
        bounds = "".join(f" {sign} {meta[b]:g}" for b, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
                         if meta[b] is not None)
        help_text = f"{meta['help']} (default: {f.default}{';' + bounds if bounds else ''})"
        tp = hints[f.name]
        members = [a for a in typing.get_args(tp) if a is not type(None)] if isinstance(tp, types.UnionType) else [tp]
        if members == [bool]:  # --x / --no-x; a switch on by default also takes SGLang's --disable-* spelling
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=help_text)
            for alias in meta["flags"]:
                p.add_argument(alias, dest=f.name, action="store_false" if f.default else "store_true",
                               default=argparse.SUPPRESS, help=f"Sets {flag} to {not f.default}.")
            continue
        kwargs: dict = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if str in members:
            kwargs["type"] = str
        elif typing.get_origin(members[0]) is tuple:
            kwargs.update(nargs="+", type=typing.get_args(members[0])[0])
        else:
            kwargs["type"] = members[0]
        if meta["choices"] is not None:
            kwargs["choices"] = list(meta["choices"])
        p.add_argument(flag, *meta["flags"], **kwargs)


def split_config_argv(rest: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] --flag value ...` -> (config path or None, overrides).

    Parsed by hand rather than by argparse because override values (`--rollout-batch-size 8`) would otherwise
    be mistaken for the positional config path.
    """
    if rest and not rest[0].startswith("--"):
        return rest[0], rest[1:]
    return None, rest


class _HelpWithOptions(argparse.Action):
    """`-h/--help` of a command that takes run options: its usage, then every option (flag, type, default, bounds,
    choices, meaning), which argparse cannot list since the options are parsed from the config, not by argparse."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: typing.Any):
        super().__init__(option_strings, dest=dest, nargs=0, help="Show this help, with every run option, and exit.")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: typing.Any,
                 option_string: str | None = None) -> None:
        try:
            print(parser.format_help())
            print("run options (a YAML key, or --flag VALUE after the config; slime's flag names are accepted too):")
            print(describe_options(), flush=True)
        except BrokenPipeError:  # `... --help | head`: the reader has what it wanted (Python's documented remedy)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        parser.exit()


def _command_with_run_options(sub: typing.Any, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, add_help=False)
    p.add_argument("-h", "--help", action=_HelpWithOptions)
    return p


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its sub-commands' too), reporting a bad command line as other bad input is reported: in
    one line, exit code 2; the usage is one `--help` away."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxrl-vlm", description="Multi-turn agentic RL for vision-language models in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config", help="Resolve a config (YAML + --flag overrides) and print it.")
    p.usage = "jaxrl-vlm config [CONFIG.yaml] [--flag value ...] [--help-options]"
    p.add_argument("--dump", action="store_true", help="Print the resolved config as YAML (the default action).")
    p.add_argument("--help-options", action="store_true", help="List every option with its flag, default and meaning.")
    p.set_defaults(func=_cmd_config)

    p = _command_with_run_options(sub, "train", help="Run the main RL job: rollout -> train -> weight sync, for --num-rollout steps "
                       "(with --loss-type sft_loss: supervised fine-tuning on conversations, no engine).")
    p.usage = "jaxrl-vlm train CONFIG.yaml [--flag value ...]"
    p.set_defaults(func=_cmd_train)

    p = _command_with_run_options(sub, "rollout", help="Run one rollout step with the current weights (for debugging an environment).")
    p.usage = "jaxrl-vlm rollout CONFIG.yaml [--flag value ...] [--dump FILE.jsonl]"
    p.add_argument("--dump", default=None, help="Write every sample with per-turn decoded text, per-token log-probs "
                   "and the pictures as sent (in FILE_images/) to this JSONL file; `jaxrl-vlm view FILE` shows it.")
    p.set_defaults(func=_cmd_rollout)

    p = _command_with_run_options(sub, "eval", help="Evaluate a checkpoint or HF directory on the config's eval sets; print a table.")
    p.usage = ("jaxrl-vlm eval CONFIG.yaml [--load CHECKPOINT_DIR | HF_DIR] [--flag value ...] "
               "[--dump-dir DIR] [--metrics-json FILE]")
    p.add_argument("--load", default=None,
                   help="A checkpoint directory of ours (its latest step, restored onto --hf-checkpoint) or an HF "
                        "model directory (default: --hf-checkpoint itself).")
    p.add_argument("--dump-dir", default=None, help="Write each set's samples to DIR/<set>/step_<k>.jsonl.")
    p.add_argument("--metrics-json", default=None, help="Also write the metrics as JSON to this file.")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("view", help="Browse a run's episodes turn by turn (pictures, tokens, log-probs) in a browser.")
    p.usage = "jaxrl-vlm view RUN_DIR|DUMP.jsonl [--port N] [--host H] [--export FILE.html]"
    p.add_argument("run", metavar="RUN_DIR", help="A run's --output-dir (rollout/ and eval/ dumps) or one dump file.")
    p.add_argument("--host", default="127.0.0.1", help="Address to serve on.")
    p.add_argument("--port", type=int, default=8765, help="Port to serve on.")
    p.add_argument("--export", default=None, metavar="FILE.html",
                   help="Write one self-contained page (pictures embedded) instead of serving.")
    p.set_defaults(func=_cmd_view)

    p = sub.add_parser("plot", help="Overlay runs' curves (reward, eval reward, repetition, length, turns, truncation).")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="Run output directories (or their metrics.jsonl).")
    p.add_argument("--out", default="plots_compare", help="Directory for the PNGs (one per metric).")
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("compare-losses",
                       help="Train loss variants on the same saved rollouts from the same weights; table and plots.")
    p.usage = ("jaxrl-vlm compare-losses CONFIG.yaml --load-debug-rollout-data PATH --variant SPEC [--variant SPEC ...] "
               "--out DIR [--flag value ...]")
    p.add_argument("--variant", action="append", required=True, metavar="SPEC",
                   help="A loss variant: NAME=FLAGS ('gspo=--policy-loss gspo'; 'base=' is the base config), a config "
                        "YAML (named after the file), or NAME=FILE.yaml. Repeat for each variant.")
    p.add_argument("--out", required=True, help="Directory for the table (comparison.md, .csv), plots/ and runs/.")
    p.set_defaults(func=_cmd_compare_losses)

    p = sub.add_parser("make-dataset", help="Write a task's synthetic prompts (or, with --sft, SFT transcripts) with "
                       "real pictures.")
    p.add_argument("out", help="Output .parquet path (.jsonl too for color_reveal and for --sft).")
    p.add_argument("--task", default="geo3k",
                   help=f"{' | '.join(DATASET_TASKS)}, or a module with make_dataset / make_sft_dataset (default geo3k).")
    p.add_argument("--sft", action="store_true",
                   help="SFT transcripts (conversations with a right answer, for --loss-type sft_loss) instead of prompts.")
    p.add_argument("--num-rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=None, help="Picture side in pixels (default: the task's, 224 "
                   "for geo3k, 64 for color_reveal).")
    p.set_defaults(func=_cmd_make_dataset)

    p = sub.add_parser("make-tiny", help="Write a tiny random Qwen-VL checkpoint (our init + exporter) with tokenizer/processor.")
    p.add_argument("out", help="Output directory (a valid --hf-checkpoint / --model-path afterwards).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the weight init.")
    p.add_argument("--vocab-size", type=int, default=1024, help="Tokenizer and embedding size.")
    p.add_argument("--init", choices=("scaled", "hf"), default="scaled", help="Fan-in scaled init, or HF's std 0.02.")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="Dtype of the safetensors.")
    p.add_argument("--arch", choices=tuple(FAMILY_PARSERS), default="qwen3_vl",
                   help="Model family (config.json model_type); docs/reference/models.md lists them.")
    p.add_argument("--head-dim", type=int, default=None,
                   help="Text head size (default 16); vLLM's CPU attention needs 32 or more (qwen3_vl only).")
    p.add_argument("--overwrite", action="store_true", help="Replace a model already in OUT (refused without it).")
    p.set_defaults(func=_cmd_make_tiny)

    p = sub.add_parser("untie-embeddings", help="Copy an HF checkpoint with an explicit LM head (tie_word_embeddings "
                                                "false): start an external vLLM from it (docs/guides/vllm.md).")
    p.add_argument("src", help="HF checkpoint directory.")
    p.add_argument("out", help="Output directory.")
    p.set_defaults(func=_cmd_untie_embeddings)

    p = sub.add_parser("export-lora", help="Write a LoRA run's checkpoint as a PEFT adapter directory (OUT/adapter) "
                       "and the merged HF model (OUT/merged).")
    p.usage = "jaxrl-vlm export-lora CONFIG.yaml [--checkpoint DIR] [--out DIR] [--step N] [--no-merged] [--flag value ...]"
    p.add_argument("--checkpoint", default=None, help="The run's checkpoint directory (default OUTPUT_DIR/checkpoints).")
    p.add_argument("--out", default=None, help="Output directory: adapter/ and merged/ under it (default OUTPUT_DIR/export).")
    p.add_argument("--step", type=int, default=None, help="Checkpoint step (default: the latest complete one).")
    p.add_argument("--no-merged", action="store_true", help="Write the adapter directory only.")
    p.set_defaults(func=_cmd_export_lora)

    p = sub.add_parser("dump-shardings", help="Print/write each mesh layout's parameter and input shardings as JSON.")
    p.usage = (
        "jaxrl-vlm dump-shardings --mesh-config configs/mesh/fsdp.yaml [--out FILE | --out-dir DIR] "
        "[--num-devices 8] [--hf-checkpoint DIR]"
    )
    p.add_argument("--mesh-config", action="append", required=True, help="Mesh layout YAML (repeatable).")
    p.add_argument("--out", default=None, help="Write the JSON here (one layout).")
    p.add_argument("--out-dir", default=None, help="Write <layout stem>.json here for each layout.")
    p.add_argument("--num-devices", type=int, default=8, help="Devices of the (abstract) mesh.")
    p.add_argument("--hf-checkpoint", default=None, help="Model config to lay out (default: the make-tiny model).")
    p.add_argument("--vocab-size", type=int, default=1024, help="Vocabulary of the default tiny model.")
    p.add_argument("--arch", choices=tuple(FAMILY_PARSERS), default="qwen3_vl", help="Family of the default tiny model.")
    p.set_defaults(func=_cmd_dump_shardings)

    p = sub.add_parser("serve", help="Serve a Qwen-VL checkpoint with the embedded JAX engine (SGLang's native HTTP API).")
    p.add_argument("--model", required=True, help="HF checkpoint directory of a supported family (safetensors, config, tokenizer, processor).")
    p.add_argument("--host", default="127.0.0.1", help="Bind address (loopback by default).")
    p.add_argument("--port", type=int, default=30000, help="Port (0 picks a free one).")
    p.add_argument("--weight-version", default="default", help="Initial weight_version reported by the server.")
    p.add_argument("--api-key", default=None,
                   help="Require 'Authorization: Bearer KEY' on every endpoint but /health* (SGLang's flag name).")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="--param-dtype and --compute-dtype at once.")
    p.add_argument("--xla-cpu-cores", default=None, metavar="CORES",
                   help="Run XLA's CPU threads on these cores only (a list as taskset -c takes, e.g. 1 or 2-7; 'auto': "
                        "all but the lowest), the engine's Python on every core, as vLLM's CPU server keeps its compute "
                        "off its API server's core. For a CPU host: faster for small models at low concurrency; slower "
                        "where the compute needs every core, and XLA compiles on those cores only; refused on a GPU or TPU "
                        "host (default: all cores for both).")
    add_engine_options(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("env-serve", help="Serve an env module over OpenEnv's WebSocket protocol (/ws, /health, /schema).")
    p.add_argument("env_module", help="Env module, as --rollout-interaction-env-path (e.g. envs.sokoban).")
    p.add_argument("--host", default="127.0.0.1", help="Bind address (loopback by default).")
    p.add_argument("--port", type=int, default=8000, help="Port (0 picks a free one).")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="Concurrent episodes; one more gets CAPACITY_REACHED, which the client retries (default: "
                        "what the env holds at once, where it says (its session_capacity; MiniWoB: browser_pool_size), "
                        "else 64; more than the env holds is refused). A rollout step runs rollout_batch_size x "
                        "n_samples_per_prompt episodes at once: the surplus waits.")
    p.add_argument("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on every path but /health.")
    p.add_argument("--max-turns", type=int, default=None, help="max_turns the env is built with (default 3).")
    p.add_argument("--custom-config-path", default=None, help="YAML of the env's keys (its CONFIG_KEYS), as in training.")
    p.set_defaults(func=_cmd_env_serve)

    from jaxrl_vlm.bench.cli_args import add_bench_parser

    add_bench_parser(sub)  # `jaxrl-vlm bench sharding ...` (parser only; jax is imported when it runs)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Our own progress messages at INFO; libraries (absl, orbax, jax) stay at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("jaxrl_vlm", "rollout", "envs"):
        logging.getLogger(name).setLevel(logging.INFO)
    parser = build_parser()
    ns, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        return ns.func(ns, rest)
    except BAD_INPUT as e:
        print(f"jaxrl-vlm {ns.command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except (EngineLost, WorkerLost) as e:  # the engine (or a router worker) is gone: the run stops, saying which
        print(f"jaxrl-vlm {ns.command}: error: {one_line(e)}", file=sys.stderr)
        return 1


def one_line(error: BaseException) -> str:
    """The error's message on one line (a YAML parser's, for one, spans several)."""
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
