"""Each option is declared once (issue 26): the engine's in `EngineOptions`, the loss's in `LossOptions`; the run
config composes them, `serve`'s flags are made from them, and the trainer copies them by name. The config and its
option modules import no jax."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_vlm import cli
from jaxrl_vlm.config import FIELDS, Config, ConfigError, load_config
from jaxrl_vlm.engine.options import EngineOptions
from jaxrl_vlm.rl.options import LossOptions
from jaxrl_vlm.rl.registries import AGGREGATION_MODES, KL_ESTIMATORS, LOSS_TYPES

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_config_and_the_command_line_loads_no_jax():
    code = (
        "import sys\n"
        "import jaxrl_vlm.config, jaxrl_vlm.cli, jaxrl_vlm.engine.options, jaxrl_vlm.rl.options\n"
        "jaxrl_vlm.config.Config().dump_yaml()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _serve_parser():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    return sub.choices["serve"]


def test_serve_offers_every_engine_option_with_its_help_and_default():
    flags = {s: a for a in _serve_parser()._actions for s in a.option_strings}
    for f in dataclasses.fields(EngineOptions):
        flag = "--" + f.name.replace("_", "-")
        assert flag in flags, flag
        assert flags[flag].dest == f.name and f.metadata["help"] in flags[flag].help
        assert f"default: {f.default}" in flags[flag].help
        if f.metadata["choices"] is not None:
            assert flags[flag].choices == list(f.metadata["choices"])


def _serve_options(argv: list[str]) -> EngineOptions:
    ns = _serve_parser().parse_args(["--model", "m", *argv])
    given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineOptions) if hasattr(ns, f.name)}
    return EngineOptions(**given)


def test_serve_flags_build_the_engine_options_sglang_spellings_included():
    assert _serve_options([]) == EngineOptions()  # a flag left out keeps the field's default, written once
    options = _serve_options(["--max-batch", "4", "--max-seq-len", "256", "--disable-radix-cache", "--control-timeout",
                              "5", "--weight-update-timeout", "7", "--tp-size", "2", "--devices", "0-1",
                              "--decode-batch-sizes", "1", "4", "--max-prefills-per-step", "3"])
    assert options == EngineOptions(max_batch=4, max_seq_len=256, prefix_cache=False, control_timeout_s=5.0,
                                    weight_update_timeout_s=7.0, tp_size=2, device_ids=(0, 1),
                                    decode_batch_sizes=(1, 4), max_prefills_per_step=3)
    assert _serve_options(["--no-prefix-cache"]).prefix_cache is False
    with pytest.raises(SystemExit):  # choices are argparse's
        _serve_parser().parse_args(["--model", "m", "--param-dtype", "int8"])


def test_serve_checks_the_declared_bounds_naming_the_option(capsys):
    assert cli.main(["serve", "--model", "m", "--max-batch", "0"]) == 2
    assert "serve: max_batch must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["serve", "--model", "m", "--control-timeout", "-1"]) == 2
    assert "control_timeout_s must be > 0, got -1" in capsys.readouterr().err


def test_the_run_config_composes_the_engine_options_under_their_keys():
    run = Config()
    for f in dataclasses.fields(EngineOptions):
        key = f.metadata["key"]
        if key is None:
            continue
        assert key in FIELDS, key
        info = FIELDS[key]
        if info.section == "engine" and key != "rollout_devices":  # declared here, composed there
            assert info.default == f.default and f.metadata["help"][1:] in info.help, key
            assert (info.gt, info.ge, info.lt, info.le) == tuple(f.metadata[b] for b in ("gt", "ge", "lt", "le"))
    # The run's engine: its engine section, the model's dtypes and the rollout seed, read by key.
    assert EngineOptions.from_run_config(run) == EngineOptions()
    cfg = load_config(None, ["--engine-max-batch", "8", "--engine-control-timeout", "5", "--engine-prefix-cache",
                             "false", "--compute-dtype", "bfloat16", "--rollout-seed", "7", "--tp-size", "2",
                             "--rollout-devices", "2-3"])
    assert EngineOptions.from_run_config(cfg) == EngineOptions(
        max_batch=8, control_timeout_s=5.0, prefix_cache=False, compute_dtype="bfloat16", seed=7, tp_size=2,
        device_ids=(2, 3))


def test_an_engine_option_the_run_holds_elsewhere_is_declared_once():
    """The engine's seed is the rollout seed and its dtypes and attention the trainer's: `serve` and a run's engine
    start from the same default and accept the same values (issue 46: the seed was 42 for `train` and 0 for `serve`, and
    `serve` offered float16, which the trainer refused)."""
    shared = [f for f in dataclasses.fields(EngineOptions) if f.metadata["key"] and
              FIELDS[f.metadata["key"]].section != "engine"]
    assert sorted(f.metadata["key"] for f in shared) == ["attention_impl", "compute_dtype", "param_dtype", "rollout_seed"]
    for f in shared:
        info = FIELDS[f.metadata["key"]]
        assert info.default == f.default and info.choices == f.metadata["choices"], info
        assert (info.gt, info.ge, info.lt, info.le) == tuple(f.metadata[b] for b in ("gt", "ge", "lt", "le"))
    assert _serve_options([]).seed == Config().rollout.rollout_seed


def test_the_algo_section_composes_the_loss_options():
    for f in dataclasses.fields(LossOptions):
        info = FIELDS[f.name]
        assert info.section == "algo" and info.default == f.default and info.help == f.metadata["help"]
    # Choices are the registries themselves, not copies of their names.
    assert FIELDS["kl_loss_type"].choices is KL_ESTIMATORS
    assert FIELDS["loss_aggregation"].choices is AGGREGATION_MODES
    assert FIELDS["loss_type"].choices is LOSS_TYPES
    with pytest.raises(ConfigError, match=r"kl_loss_type='k9' is not one of \['k1', 'k2', 'k3', 'low_var_kl'\]"):
        load_config(None, ["--kl-loss-type", "k9"])


def test_choices_kept_by_jax_modules_are_read_from_them_when_a_value_is_checked():
    with pytest.raises(ConfigError,
                       match=r"attention_impl='flash' is not one of \['xla', 'pallas_gpu', 'pallas_tpu', 'ring'\]"):
        load_config(None, ["--attention-impl", "flash"])
    with pytest.raises(ConfigError, match=r"prompt_style='fancy' is not one of"):
        load_config(None, ["--prompt-style", "fancy"])
    assert load_config(None, ["--attention-impl", "pallas_gpu"]).model.attention_impl == "pallas_gpu"


def test_the_trainer_copies_every_loss_option_by_name():
    from jaxrl_vlm.job.trainer import loss_config

    values = {"eps_clip": 0.3, "eps_clip_high": 0.28, "eps_clip_c": 3.0, "rollout_correction": "icepop",
              "rollout_correction_high": 1.5, "rollout_correction_low": 0.1, "use_kl_loss": True, "kl_loss_coef": 0.01,
              "kl_loss_type": "low_var_kl", "entropy_coef": 0.001, "router_aux_loss_coef": 0.002,
              "router_z_loss_coef": 0.0005, "opd_kl_coef": 0.5, "opd_only": True, "opd_baseline": "mean",
              "opsd_beta": 0.3, "opsd_jsd_clip": 0.1}
    assert set(values) | {"custom_tis_function_path"} == {f.name for f in dataclasses.fields(LossOptions)}
    argv = [a for k, v in values.items() for a in (FIELDS[k].flag, str(v))]
    opd = ["--use-opd", "--opd-teacher-url", "http://127.0.0.1:1"]  # --opd-only needs a teacher (never reached here)
    loss = loss_config(load_config(None, [*argv, *opd, "--loss-aggregation", "token_mean"]), num_sequences=4)
    assert {k: getattr(loss, k) for k in values} == values
    assert (loss.custom_tis_function_path, loss.num_sequences, loss.aggregation) == (None, 4, "token_mean")
