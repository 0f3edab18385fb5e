"""What the project does for a real vLLM, checked without one (tests/vllm_real checks it against the server):
the untied export its in-place reload needs, make-tiny's head size, pictures sent at the processor's size, the
launched server's dtype, and the run options."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from jaxrl_vlm.config import ConfigError, load_config
from jaxrl_vlm.job.session import _vllm_dtype_args
from jaxrl_vlm.vllm_ext import EXTENSION_DIR
from jaxrl_vlm.vllm_launcher import VLLMProcess
from rollout.processing import png_data_url_size, process_images, processor_size, resize_as_processor


def test_untied_export_has_its_own_head_and_the_same_logits(tiny_hf_checkpoint, tmp_path):
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from jaxrl_vlm.models.hf_io import from_hf, load_hf_config, to_hf

    out = to_hf(from_hf(tiny_hf_checkpoint), tmp_path / "untied", dtype="float32", copy_from=tiny_hf_checkpoint,
                untie_embeddings=True)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["text_config"]["tie_word_embeddings"] is False
    assert not load_hf_config(out).tie_word_embeddings  # our loader reads it as an untied model
    ids = torch.tensor([[3, 40, 41, 42, 43, 44]])
    tied = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_hf_checkpoint), dtype=torch.float32).eval()
    untied = Qwen3VLForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    assert untied.lm_head.weight.data_ptr() != untied.model.language_model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(untied.lm_head.weight, tied.model.language_model.embed_tokens.weight, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(untied(input_ids=ids).logits, tied(input_ids=ids).logits, rtol=0, atol=0)
    # Exported again from the untied model, nothing changes (the option only matters for tied models).
    from safetensors.numpy import load_file

    again = to_hf(from_hf(out), tmp_path / "again", dtype="float32", copy_from=out, untie_embeddings=True)
    first, second = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert sorted(first) == sorted(second) and "lm_head.weight" in first
    assert all(np.array_equal(first[k], second[k]) for k in first)


def test_make_tiny_head_dim_rescales_mrope_and_loads_in_transformers(tmp_path):
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from jaxrl_vlm.tiny import make_tiny

    out = make_tiny(tmp_path / "tiny32", head_dim=32)
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert text["head_dim"] == 32 and text["rope_parameters"]["mrope_section"] == [8, 4, 4]
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    assert model.model.language_model.layers[0].self_attn.q_proj.weight.shape[0] == 4 * 32
    with pytest.raises(ValueError, match="head_dim=20: must be a multiple of 8"):
        make_tiny(tmp_path / "bad", head_dim=20)
    with pytest.raises(ValueError, match="derives its head size"):
        make_tiny(tmp_path / "bad25", head_dim=32, arch="qwen2_5_vl")


@pytest.mark.parametrize("size", [(50, 70), (300, 200), (17, 130), (64, 64)])
def test_pictures_are_sent_at_the_processors_size_with_identical_pixels(tiny_image_processor, size):
    rng = np.random.default_rng(sum(size))
    image = Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
    sent = resize_as_processor(image, tiny_image_processor)
    assert sent.size == processor_size(tiny_image_processor, image.width, image.height)
    assert (sent is image) == (sent.size == image.size)
    a, b = process_images(tiny_image_processor, [image]), process_images(tiny_image_processor, [sent])
    np.testing.assert_array_equal(a["pixel_values"], b["pixel_values"])  # bit for bit: the engine's resize is moot
    np.testing.assert_array_equal(a["image_grid_thw"], b["image_grid_thw"])


def test_png_data_url_size_reads_the_header_only():
    buf = io.BytesIO()
    Image.new("RGB", (70, 50)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert png_data_url_size(url) == (70, 50)
    assert png_data_url_size(url[:40]) is None  # truncated: the full decode reports it
    assert png_data_url_size("data:image/jpeg;base64," + url.split(",", 1)[1]) is None
    assert png_data_url_size("data:image/png;base64,!!!!" + "A" * 60) is None


def _cfg(*extra: str):
    return load_config(None, ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", *extra])


def test_vllm_run_options_are_checked():
    with pytest.raises(ConfigError, match="--launch-vllm needs --vllm-python"):
        _cfg("--launch-vllm")
    with pytest.raises(ConfigError, match="--engine-url and --launch-vllm each name the engine"):
        _cfg("--launch-vllm", "--vllm-python", "py", "--engine-url", "http://h:1")
    with pytest.raises(ConfigError, match="--engine-api sglang contradicts --launch-vllm"):
        _cfg("--launch-vllm", "--vllm-python", "py", "--engine-api", "sglang")
    with pytest.raises(ConfigError, match="--engine-api vllm needs --engine-url or --launch-vllm"):
        _cfg("--engine-api", "vllm")
    with pytest.raises(ConfigError, match="engine_api"):
        _cfg("--engine-api", "trt")
    cfg = _cfg("--launch-vllm", "--vllm-python", "py", "--vllm-args=--max-model-len,4096")
    assert cfg.engine.vllm_args == ["--max-model-len", "4096"]
    assert _vllm_dtype_args(cfg) == ["--dtype", cfg.model.param_dtype]
    cfg = _cfg("--launch-vllm", "--vllm-python", "py", "--vllm-args=--dtype,bfloat16")
    assert _vllm_dtype_args(cfg) == []


def test_the_launcher_runs_the_module_form_in_dev_mode(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    proc = VLLMProcess("/venv/bin/python", "/ckpt", port=1234, extra_args=["--dtype", "float32"], log_path=tmp_path / "l")
    assert proc.command == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/ckpt",
                            "--host", "127.0.0.1", "--port", "1234", "--dtype", "float32", "--enable-scale-out",
                            "--logprobs-mode", "processed_logprobs",
                            "--worker-extension-cls", "jaxrl_vlm_worker.WeightDeltaExtension"]
    # The weight-delta extension is imported by vLLM's own interpreter from the project's vllm_ext directory.
    assert proc.extra_env == {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(EXTENSION_DIR)}
    with pytest.raises(Exception, match="--launch-vllm needs --vllm-python"):
        VLLMProcess("", "/ckpt", log_path=tmp_path / "l")


def test_untie_embeddings_command_writes_an_untied_copy(tiny_hf_checkpoint, tmp_path, capsys):
    from safetensors.numpy import load_file

    from jaxrl_vlm.cli import main

    assert main(["untie-embeddings", str(tiny_hf_checkpoint), str(tmp_path / "out")]) == 0
    assert "tie_word_embeddings false" in capsys.readouterr().out
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    np.testing.assert_array_equal(weights["lm_head.weight"], weights["model.language_model.embed_tokens.weight"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
