"""The typed config: YAML + custom config + slime-named CLI flags; unknown keys and wrong types are errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from jaxrl_vlm.config import FIELDS, FLAGS, Config, ConfigError, load_config, parse_cli_overrides

# Every slime flag the foundation issue names, with a value and where it must land.
SLIME_FLAGS = [
    ("--hf-checkpoint", "/ckpt/Qwen3-VL-2B", ("model", "hf_checkpoint"), "/ckpt/Qwen3-VL-2B"),
    ("--rollout-function-path", "my.rollout.fn", ("rollout", "rollout_function_path"), "my.rollout.fn"),
    ("--custom-generate-function-path", "my.gen.generate", ("rollout", "custom_generate_function_path"), "my.gen.generate"),
    ("--rollout-interaction-env-path", "envs.geo3k", ("rollout", "rollout_interaction_env_path"), "envs.geo3k"),
    ("--num-rollout", "3000", ("rollout", "num_rollout"), 3000),
    ("--rollout-batch-size", "64", ("rollout", "rollout_batch_size"), 64),
    ("--n-samples-per-prompt", "8", ("rollout", "n_samples_per_prompt"), 8),
    ("--global-batch-size", "512", ("train", "global_batch_size"), 512),
    ("--rollout-max-response-len", "4096", ("rollout", "rollout_max_response_len"), 4096),
    ("--rollout-max-context-len", "8192", ("rollout", "rollout_max_context_len"), 8192),
    ("--rollout-temperature", "0.7", ("rollout", "rollout_temperature"), 0.7),
    ("--rollout-top-p", "0.9", ("rollout", "rollout_top_p"), 0.9),
    ("--rollout-top-k", "20", ("rollout", "rollout_top_k"), 20),
    ("--advantage-estimator", "dr_grpo", ("algo", "advantage_estimator"), "dr_grpo"),
    ("--eps-clip", "0.1", ("algo", "eps_clip"), 0.1),
    ("--eps-clip-high", "0.28", ("algo", "eps_clip_high"), 0.28),
    ("--eps-clip-c", "3", ("algo", "eps_clip_c"), 3.0),
    ("--use-kl-loss", "true", ("algo", "use_kl_loss"), True),
    ("--kl-loss-coef", "0.01", ("algo", "kl_loss_coef"), 0.01),
    ("--kl-loss-type", "k3", ("algo", "kl_loss_type"), "k3"),
    ("--entropy-coef", "0.001", ("algo", "entropy_coef"), 0.001),
    ("--tis-clip", "1.5", ("algo", "rollout_correction_high"), 1.5),
    ("--tis-clip-low", "0.5", ("algo", "rollout_correction_low"), 0.5),
    ("--lr", "1e-6", ("optim", "lr"), 1e-6),
    ("--weight-decay", "0.1", ("optim", "weight_decay"), 0.1),
    ("--clip-grad", "1.0", ("optim", "clip_grad"), 1.0),
    ("--save", "/tmp/save", ("checkpoint", "save"), "/tmp/save"),
    ("--load", "/tmp/load", ("checkpoint", "load"), "/tmp/load"),
    ("--save-interval", "20", ("checkpoint", "save_interval"), 20),
    ("--engine-url", "http://127.0.0.1:30000", ("engine", "engine_url"), "http://127.0.0.1:30000"),
    ("--mesh-fsdp", "4", ("mesh", "mesh_fsdp"), 4),
    ("--seq-buckets", "512,1024", ("batching", "seq_buckets"), [512, 1024]),
]


@pytest.mark.parametrize("flag,raw,where,expected", SLIME_FLAGS, ids=[f[0] for f in SLIME_FLAGS])
def test_slime_flag_lands_in_typed_config(flag, raw, where, expected):
    cfg = load_config(None, [flag, raw])
    value = getattr(getattr(cfg, where[0]), where[1])
    assert value == expected
    assert type(value) is type(expected)


def test_every_field_has_a_unique_flag_and_help():
    assert len(FLAGS) == len(FIELDS)
    for info in FIELDS.values():
        assert info.help, f"{info.name} has no help text"


def test_bare_boolean_flag_means_true_and_explicit_false_works():
    cfg = load_config(None, ["--use-kl-loss", "--rollout-batch-size", "2"])
    assert cfg.algo.use_kl_loss is True and cfg.rollout.rollout_batch_size == 2
    assert load_config(None, ["--use-kl-loss", "false"]).algo.use_kl_loss is False
    assert load_config(None, ["--use-kl-loss=0"]).algo.use_kl_loss is False


def test_unknown_cli_flag_names_it_and_the_closest_valid_one():
    with pytest.raises(ConfigError, match=r"--rollout-batch-sise.*--rollout-batch-size"):
        parse_cli_overrides(["--rollout-batch-sise", "8"])


def test_engine_flags_as_a_list_value_go_after_an_equals_sign():
    # `--sglang-args --enable-foo` cannot be told from two of our flags: the error shows the form that works.
    with pytest.raises(ConfigError, match=r"--sglang-args needs a value .*--sglang-args=--enable-foo,\.\.\."):
        parse_cli_overrides(["--sglang-args", "--enable-foo", "--lr", "1e-3"])
    assert load_config(None, ["--sglang-args=--enable-foo,--mem-fraction-static,0.5"]).engine.sglang_args == [
        "--enable-foo", "--mem-fraction-static", "0.5"]
    with pytest.raises(ConfigError, match=r"option --lr needs a value$"):
        parse_cli_overrides(["--lr"])


def test_wrong_type_names_the_field():
    with pytest.raises(ConfigError, match=r"rollout\.rollout_batch_size.*integer.*'eight'"):
        load_config(None, ["--rollout-batch-size", "eight"])
    with pytest.raises(ConfigError, match=r"algo\.use_kl_loss.*boolean"):
        load_config(None, ["--use-kl-loss", "maybe"])
    with pytest.raises(ConfigError, match=r"algo\.kl_loss_type.*not one of"):
        load_config(None, ["--kl-loss-type", "k9"])


def test_yaml_nested_and_flat_forms(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent(
            """
            rollout:
              rollout_batch_size: 16
              n_samples_per_prompt: 8
            lr: 2.0e-6
            algo:
              eps_clip_high: 0.28
            """
        )
    )
    cfg = load_config(str(path), ["--n-samples-per-prompt", "4"])
    assert cfg.rollout.rollout_batch_size == 16
    assert cfg.rollout.n_samples_per_prompt == 4  # the command line wins over the file
    assert cfg.optim.lr == 2e-6
    assert cfg.algo.eps_clip_high == 0.28


def test_yaml_unknown_key_names_file_key_and_suggestion(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  rollout_batch_sise: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    msg = str(err.value)
    assert str(path) in msg and "rollout.rollout_batch_sise" in msg and "rollout_batch_size" in msg


def test_yaml_key_in_wrong_section_says_where_it_belongs(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("algo:\n  lr: 1.0e-5\n")
    with pytest.raises(ConfigError, match=r"algo\.lr.*belongs to section 'optim'"):
        load_config(str(path))


def test_yaml_wrong_type_names_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  num_rollout: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"rollout\.num_rollout.*integer"):
        load_config(str(path))


def test_unreadable_and_invalid_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "missing.yaml"))
    path = tmp_path / "broken.yaml"
    path.write_text("rollout: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(path))


def test_custom_config_keys_become_attributes_of_args(tmp_path):
    custom = tmp_path / "multi_turn.yaml"
    custom.write_text("max_turns: 5\nmax_env_retries_per_turn: 4\nrollout_interaction_env_path: envs.geo3k\n")
    cfg = load_config(None, ["--custom-config-path", str(custom)])
    args = cfg.to_namespace()
    assert args.max_turns == 5 and args.max_env_retries_per_turn == 4
    assert args.rollout_interaction_env_path == "envs.geo3k"
    # The command line still wins over the custom config.
    cfg = load_config(None, ["--custom-config-path", str(custom), "--max-turns", "2"])
    assert cfg.multiturn.max_turns == 2


def test_custom_config_unknown_key_is_error_unless_declared_by_the_env(tmp_path):
    env_file = tmp_path / "my_env.py"
    env_file.write_text(
        "CONFIG_KEYS = {'hint_penalty': (float, 0.0, 'penalty per hint')}\n"
        "def build_env(sample, args):\n    raise NotImplementedError\n"
    )
    custom = tmp_path / "c.yaml"
    custom.write_text("hint_penalty: 0.5\n")
    with pytest.raises(ConfigError, match="unknown key 'hint_penalty'"):
        load_config(None, ["--custom-config-path", str(custom)])
    cfg = load_config(None, ["--custom-config-path", str(custom), "--rollout-interaction-env-path", str(env_file)])
    assert cfg.extra == {"hint_penalty": 0.5}
    assert cfg.to_namespace().hint_penalty == 0.5
    # A declared key still has its declared type.
    custom.write_text("hint_penalty: lots\n")
    with pytest.raises(ConfigError, match="hint_penalty.*number"):
        load_config(None, ["--custom-config-path", str(custom), "--rollout-interaction-env-path", str(env_file)])


def test_unimportable_env_module_error_says_what_failed(tmp_path):
    custom = tmp_path / "c.yaml"
    custom.write_text("some_key: 1\n")
    with pytest.raises(ConfigError, match=r"rollout-interaction-env-path.*no_such_env_module"):
        load_config(None, ["--custom-config-path", str(custom), "--rollout-interaction-env-path", "no_such_env_module"])


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="rollout_top_p"):
        load_config(None, ["--rollout-top-p", "0"])
    with pytest.raises(ConfigError, match=r"eps_clip_c \(--eps-clip-c\) must be > 1"):
        load_config(None, ["--eps-clip-c", "0.5"])
    with pytest.raises(ConfigError, match="seq_buckets"):
        load_config(None, ["--seq-buckets", "1024,512"])


def test_mesh_config_file_merges_and_rejects_non_mesh_keys(tmp_path):
    mesh = tmp_path / "fsdp.yaml"
    mesh.write_text("mesh:\n  mesh_data: 1\n  mesh_fsdp: -1\n  sharding_rules: {embed: fsdp}\n")
    cfg = load_config(None, ["--mesh-config", str(mesh)])
    assert (cfg.mesh.mesh_data, cfg.mesh.mesh_fsdp) == (1, -1)
    assert cfg.mesh.sharding_rules == {"embed": "fsdp"}
    mesh.write_text("mesh:\n  mesh_data: 1\nlr: 1.0\n")
    with pytest.raises(ConfigError, match="may only set mesh options"):
        load_config(None, ["--mesh-config", str(mesh)])


def test_dump_round_trips_through_yaml(tmp_path):
    cfg = load_config(None, ["--rollout-batch-size", "3", "--seq-buckets", "[128, 256]"])
    path = tmp_path / "dumped.yaml"
    path.write_text(cfg.dump_yaml())
    again = load_config(str(path))
    assert again == cfg
    assert isinstance(Config().to_namespace().lr, float)


@pytest.mark.slow
def test_cli_config_dump_and_error_exit_code(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "jaxrl_vlm.cli", "config", "--rollout-batch-size", "8", "--dump"],
        capture_output=True, text=True, check=True,
    )
    assert "rollout_batch_size: 8" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "jaxrl_vlm.cli", "config", "--rollout-batch-sise", "8"], capture_output=True, text=True
    )
    assert bad.returncode == 2
    assert "--rollout-batch-size" in bad.stderr


def test_every_shipped_run_config_resolves():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    runs = [p for p in sorted((root / "configs").glob("*.yaml")) if "multiturn" not in p.name and "example" not in p.name]
    assert runs, "no run configs shipped"
    import os

    cwd = os.getcwd()
    os.chdir(root)  # configs name their custom config relative to the repository root
    try:
        for path in runs:
            cfg = load_config(str(path))
            assert cfg.multiturn.max_turns >= 1, path
    finally:
        os.chdir(cwd)
    two_b = load_config(str(root / "configs/geo3k_qwen3vl_2b.yaml"), ["--custom-config-path", str(root / "configs/geo3k_multiturn.yaml")])
    # The seed's run: GRPO, max_turns 3, 4096-token budget, n=8, lr 1e-6, eps 0.2/0.28.
    assert (two_b.multiturn.max_turns, two_b.rollout.rollout_max_response_len, two_b.rollout.n_samples_per_prompt) == (3, 4096, 8)
    assert (two_b.optim.lr, two_b.algo.eps_clip, two_b.algo.eps_clip_high, two_b.algo.advantage_estimator) == (1e-6, 0.2, 0.28, "grpo")
    # Qwen2.5-VL-3B: the public geo3k recipe (verl / EasyR1): lr 1e-6, n=5, temperature 1, KL loss low_var_kl 0.01.
    three_b = load_config(str(root / "configs/geo3k_qwen25vl_3b.yaml"), ["--custom-config-path", str(root / "configs/geo3k_multiturn.yaml")])
    assert (three_b.optim.lr, three_b.rollout.n_samples_per_prompt, three_b.rollout.rollout_temperature) == (1e-6, 5, 1.0)
    assert (three_b.algo.use_kl_loss, three_b.algo.kl_loss_type, three_b.algo.kl_loss_coef) == (True, "low_var_kl", 0.01)
    assert three_b.model.hf_checkpoint.endswith("Qwen2.5-VL-3B-Instruct") and three_b.multiturn.max_turns == 3
    # Qwen3.5-2B: slime's run_geo3k_qwen35.sh (T 0.8, constant lr 1e-6, eval every 20) with the 2B's non-thinking
    # default spelled out, so the prompt, the deltas and the finalize check render alike.
    q35 = load_config(str(root / "configs/geo3k_qwen3_5_2b.yaml"), ["--custom-config-path", str(root / "configs/geo3k_multiturn.yaml")])
    assert q35.model.hf_checkpoint.endswith("Qwen3.5-2B") and q35.multiturn.max_turns == 3
    assert q35.multiturn.apply_chat_template_kwargs == {"enable_thinking": False}
    assert (q35.rollout.rollout_temperature, q35.optim.lr, q35.optim.lr_decay_style, q35.eval.eval_interval) == (0.8, 1e-6, "constant", 20)
    assert (q35.rollout.n_samples_per_prompt, q35.rollout.rollout_max_response_len) == (8, 4096)
