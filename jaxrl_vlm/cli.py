"""The `jaxrl-vlm` command line.

Subcommands import their heavy dependencies (jax, transformers) lazily, so `jaxrl-vlm config --dump`
answers in well under a second.
"""

from __future__ import annotations

import argparse
import sys

from jaxrl_vlm.config import ConfigError, describe_options, load_config


def _cmd_config(ns: argparse.Namespace, rest: list[str]) -> int:
    if ns.help_options:
        print(describe_options())
        return 0
    config_path, overrides = split_config_argv(rest)
    cfg = load_config(config_path, overrides)
    print(cfg.dump_yaml(), end="")  # --dump is the only output mode today; the flag is accepted for clarity
    return 0


def _cmd_make_dataset(ns: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise ConfigError(f"make-dataset: unexpected arguments {rest}")
    from jaxrl_vlm.data.synthetic import make_dataset

    path = make_dataset(ns.out, num_rows=ns.num_rows, seed=ns.seed, image_size=ns.image_size)
    print(f"wrote {ns.num_rows} synthetic geo3k rows to {path}")
    return 0


def split_config_argv(rest: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] --flag value ...` -> (config path or None, overrides).

    Parsed by hand rather than by argparse because override values (`--rollout-batch-size 8`) would otherwise
    be mistaken for the positional config path.
    """
    if rest and not rest[0].startswith("--"):
        return rest[0], rest[1:]
    return None, rest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl-vlm", description="Multi-turn agentic RL for vision-language models in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config", help="Resolve a config (YAML + --flag overrides) and print it.")
    p.usage = "jaxrl-vlm config [CONFIG.yaml] [--flag value ...] [--help-options]"
    p.add_argument("--dump", action="store_true", help="Print the resolved config as YAML (the default action).")
    p.add_argument("--help-options", action="store_true", help="List every option with its flag, default and meaning.")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("make-dataset", help="Write a synthetic Geometry3K-style parquet dataset with real diagrams.")
    p.add_argument("out", help="Output .parquet path.")
    p.add_argument("--num-rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=224)
    p.set_defaults(func=_cmd_make_dataset)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        return ns.func(ns, rest)
    except ConfigError as e:
        print(f"jaxrl-vlm {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
