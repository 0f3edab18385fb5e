"""Bad input reaches the user as one line naming its cause, exit code 2, no traceback, before any model is built
(issue 46): a bad checkpoint directory, a bad config value, a dataset file without its prompt column and a refused
engine, for `jaxrl-vlm train`, `serve` and `eval`.

The commands run in-process (`cli.main`), with the trainer's policy and the engine's model made to fail the test if
they are ever built; one runs as a real process, as a user's terminal sees it.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from jaxrl_vlm import cli
from jaxrl_vlm.models.config import qwen3_vl_2b_instruct

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Inputs:
    model: Path  # a config.json of a known model, no weights: enough for every check that comes before the weights
    no_vision: Path  # config.json without vision_config
    no_config: Path  # an empty directory
    prompts: Path  # one good prompt row
    no_prompt_jsonl: Path  # rows with `question`, not `problem`
    no_prompt_parquet: Path
    out: Path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    root = tmp_path_factory.mktemp("bad_input")
    model, no_vision, no_config = root / "model", root / "no_vision", root / "no_config"
    for d in (model, no_vision, no_config):
        d.mkdir()
    config = qwen3_vl_2b_instruct().to_hf_dict()
    (model / "config.json").write_text(json.dumps(config))
    (no_vision / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "vision_config"}))
    png = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(png, format="PNG")
    picture = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    row = {"problem": "<image>Which color is the card?", "answer": "red", "images": [picture]}
    renamed = {("question" if k == "problem" else k): v for k, v in row.items()}
    (root / "prompts.jsonl").write_text(json.dumps(row) + "\n")
    (root / "no_prompt.jsonl").write_text((json.dumps(renamed) + "\n") * 3)
    pq.write_table(pa.Table.from_pylist([{**renamed, "images": []}]), root / "no_prompt.parquet")
    return Inputs(model, no_vision, no_config, root / "prompts.jsonl", root / "no_prompt.jsonl",
                  root / "no_prompt.parquet", root / "out")


@pytest.fixture(autouse=True)
def no_model_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every error here must come before the weights are read: building the trainer's policy or the engine's
    model fails the test."""
    from jaxrl_vlm.engine import core
    from jaxrl_vlm.job.trainer import Trainer

    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was built before the bad input was reported")

    monkeypatch.setattr(Trainer, "build_policy", built)
    monkeypatch.setattr(core, "from_hf", built)


class _TiedVLLM(BaseHTTPRequestHandler):
    """What a vLLM server started from a checkpoint with tied embeddings answers on the routes a run probes:
    healthy, `owned_by: vllm`, and a weight checker that lists no `lm_head.weight`."""

    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(200, None)
        elif self.path == "/v1/models":
            self._answer(200, {"object": "list", "data": [{"id": "m", "root": "m", "owned_by": "vllm"}]})
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/weight_checker":
            self._answer(200, {"checksums": {"model.language_model.embed_tokens.weight": "5f1e"}})
        else:
            self._answer(404, {"detail": "Not Found"})

    def _answer(self, status: int, body: object) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def tied_vllm() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TiedVLLM)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def fails_in_one_line(capsys: pytest.CaptureFixture, argv: list[object], *causes: str) -> None:
    """Run `jaxrl-vlm ARGV`: exit code 2 and a single stderr line that names every one of `causes`."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as stop:  # argparse's own errors (a value off a flag's choices) exit from the parser
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    line = err.splitlines()[0]
    assert line.startswith(f"jaxrl-vlm {argv[0]}: error: "), line
    for cause in causes:
        assert cause in line, (cause, line)


# ----------------------------------------------------------------------------- a bad checkpoint directory
def test_train_names_a_checkpoint_without_vision_config_or_without_config_json(inputs, capsys):
    fails_in_one_line(capsys, ["train", "--hf-checkpoint", inputs.no_vision, "--output-dir", inputs.out],
                      f"{inputs.no_vision}/config.json", "vision_config")
    fails_in_one_line(capsys, ["train", "--hf-checkpoint", inputs.no_config, "--output-dir", inputs.out],
                      f"--hf-checkpoint {inputs.no_config}: no config.json")
    # A warm start whose run has not happened yet (configs/zoom_tiny.yaml before configs/zoom_sft_tiny.yaml).
    export = inputs.no_config / "sft_run" / "final_model"
    fails_in_one_line(capsys, ["train", "--hf-checkpoint", export, "--output-dir", inputs.out],
                      f"--hf-checkpoint {export}: no config.json yet", f"the run in {export.parent}: run that config")


def test_serve_names_a_checkpoint_without_vision_config_or_without_config_json(inputs, capsys):
    fails_in_one_line(capsys, ["serve", "--model", inputs.no_vision], f"{inputs.no_vision}/config.json",
                      "vision_config")
    fails_in_one_line(capsys, ["serve", "--model", inputs.no_config], f"{inputs.no_config}/config.json: missing")


def test_eval_names_a_bad_model_directory_and_a_load_that_is_no_checkpoint(inputs, capsys):
    sets = ["--eval-prompt-data", "held", inputs.prompts, "--output-dir", inputs.out]
    fails_in_one_line(capsys, ["eval", "--hf-checkpoint", inputs.no_vision, *sets], f"{inputs.no_vision}/config.json",
                      "vision_config")
    fails_in_one_line(capsys, ["eval", "--hf-checkpoint", inputs.no_config, *sets],
                      f"--hf-checkpoint {inputs.no_config}: no config.json")
    fails_in_one_line(capsys, ["eval", "--hf-checkpoint", inputs.model, "--load", inputs.no_vision, *sets],
                      f"{inputs.no_vision}/config.json", "vision_config")
    fails_in_one_line(capsys, ["eval", "--hf-checkpoint", inputs.model, "--load", inputs.no_config, *sets],
                      f"--load {inputs.no_config}: neither an HF model directory", "nor a checkpoint")


# ----------------------------------------------------------------------------- a bad config value
def test_train_names_the_option_out_of_bounds_or_off_its_choices(inputs, capsys):
    fails_in_one_line(capsys, ["train", "--hf-checkpoint", inputs.model, "--rollout-batch-size", "0"],
                      "--rollout-batch-size", "must be >= 1, got 0")
    fails_in_one_line(capsys, ["train", "--hf-checkpoint", inputs.model, "--param-dtype", "float16"],
                      "param_dtype", "'float16'", "float32", "bfloat16")
    fails_in_one_line(capsys, ["train", "--hf-checkpoint", inputs.model, "--prompt-data", inputs.prompts,
                               "--rollout-function-path", "no_such_module.generate", "--output-dir", inputs.out],
                      "--rollout-function-path", "'no_such_module'")


def test_a_config_file_that_is_not_yaml_is_one_line_too(capsys, tmp_path):
    (tmp_path / "broken.yaml").write_text("rollout:\n  num_rollout: [1,\n")  # the parser's message spans lines
    fails_in_one_line(capsys, ["train", tmp_path / "broken.yaml"], f"{tmp_path / 'broken.yaml'} is not valid YAML")


def test_make_tiny_names_an_output_path_that_is_a_file(capsys, tmp_path):
    (tmp_path / "weights").write_text("not a directory")
    fails_in_one_line(capsys, ["make-tiny", tmp_path / "weights"], f"{tmp_path / 'weights'} exists and is not a directory")


def test_make_tiny_keeps_a_model_already_in_the_output_directory(capsys, tmp_path):
    (tmp_path / "model").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "model" / name).write_text(name)
    fails_in_one_line(capsys, ["make-tiny", tmp_path / "model"], "already holds a model (config.json, "
                      "model.safetensors)", "--overwrite")
    assert [(tmp_path / "model" / n).read_text() for n in ("config.json", "model.safetensors")] == [
        "config.json", "model.safetensors"]


def test_serve_names_the_option_out_of_bounds_or_off_its_choices(inputs, capsys):
    fails_in_one_line(capsys, ["serve", "--model", inputs.model, "--max-batch", "0"], "max_batch must be >= 1, got 0")
    fails_in_one_line(capsys, ["serve", "--model", inputs.model, "--dtype", "float16"], "--dtype", "'float16'")
    fails_in_one_line(capsys, ["serve", "--model", inputs.model, "--xla-cpu-cores", "1-x"], "--xla-cpu-cores '1-x'",
                      "not a core or a range")
    jax.devices()  # now this process's XLA threads exist, and the flag says it cannot move them
    fails_in_one_line(capsys, ["serve", "--model", inputs.model, "--xla-cpu-cores", "auto"], "already started")


def test_env_serve_refuses_more_sessions_than_the_env_holds(capsys):
    """MiniWoB holds one Chrome page per episode (`browser_pool_size`, 8 by default): env-serve refuses more sessions
    before it binds its port or starts a browser."""
    fails_in_one_line(capsys, ["env-serve", "envs.miniwob", "--max-sessions", "9"], "max_sessions 9",
                      "browser_pool_size 8")


def test_eval_names_the_option_out_of_bounds(inputs, capsys):
    fails_in_one_line(capsys, ["eval", "--hf-checkpoint", inputs.model, "--eval-prompt-data", "held", inputs.prompts,
                               "--n-samples-per-eval-prompt", "0"], "n_samples_per_eval_prompt must be >= 1, got 0")


# ----------------------------------------------------------------------------- a dataset without its prompt column
@pytest.mark.parametrize("policy", ["error", "skip"])
def test_train_names_the_file_the_missing_column_and_the_columns_it_has(inputs, capsys, policy):
    """Under either bad-row policy: a file in which no row has the column is the file's error, not N skips."""
    base = ["train", "--hf-checkpoint", inputs.model, "--on-bad-row", policy, "--output-dir", inputs.out]
    fails_in_one_line(capsys, [*base, "--prompt-data", inputs.no_prompt_jsonl], str(inputs.no_prompt_jsonl),
                      "missing column(s) ['problem']", "['answer', 'images', 'question']")
    fails_in_one_line(capsys, [*base, "--prompt-data", inputs.no_prompt_parquet], str(inputs.no_prompt_parquet),
                      "missing column(s) ['problem']", "'question'")
    fails_in_one_line(capsys, [*base, "--prompt-data", inputs.prompts, "--eval-prompt-data", "held",
                               inputs.no_prompt_jsonl], "eval set 'held'", str(inputs.no_prompt_jsonl),
                      "missing column(s) ['problem']", "['answer', 'images', 'question']")


def test_eval_names_the_file_the_missing_column_and_the_columns_it_has(inputs, capsys):
    fails_in_one_line(capsys, ["eval", "--hf-checkpoint", inputs.model, "--eval-prompt-data", "held",
                               inputs.no_prompt_parquet, "--output-dir", inputs.out], "eval set 'held'",
                      str(inputs.no_prompt_parquet), "missing column(s) ['problem']", "'question'")


# ----------------------------------------------------------------------------- a refused engine
def test_train_and_eval_refuse_a_vllm_with_a_tied_head_naming_it(inputs, tied_vllm, capsys):
    fails_in_one_line(capsys, ["train", "--hf-checkpoint", inputs.model, "--prompt-data", inputs.prompts,
                               "--engine-url", tied_vllm, "--output-dir", inputs.out],
                      tied_vllm, "tied word embeddings", "jaxrl-vlm untie-embeddings")
    fails_in_one_line(capsys, ["eval", "--hf-checkpoint", inputs.model, "--eval-prompt-data", "held", inputs.prompts,
                               "--engine-url", tied_vllm, "--engine-api", "vllm", "--output-dir", inputs.out],
                      tied_vllm, "tied word embeddings")


# ----------------------------------------------------------------------------- as a terminal sees it
def test_the_issues_command_ends_in_one_line_and_exit_code_2_in_a_real_process(inputs, tmp_path):
    """`jaxrl-vlm train configs/color_reveal_tiny.yaml --hf-checkpoint DIR`, DIR's config.json without
    vision_config: a traceback with exit code 1 before issue 46."""
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl_vlm.cli", "train", str(ROOT / "configs" / "color_reveal_tiny.yaml"),
         "--hf-checkpoint", str(inputs.no_vision), "--output-dir", str(tmp_path / "out")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"jaxrl-vlm train: error: {inputs.no_vision}/config.json: config has no "
                                        "'vision_config' object"], proc.stderr
    assert not (tmp_path / "runs").exists()  # stopped before the config's data were made
