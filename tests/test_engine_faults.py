"""Faults the engine server, the rollout client and the data loader must survive (issue 17, rows 1-3 and 13).

Each test injects one fault and asserts the trusted behaviour:

* local media: `image_data` naming a local file is read only under `--allowed-local-media-path`, only when
  named like an image, with symlinks and `..` resolved first; images over the byte or pixel caps (a
  144-megapixel PNG, a 1.5 GB file) are refused before they are read or decoded, by the server and the loader;
* weight loading: corrupt safetensors headers, a list `weight_map`, an index naming `../` and a MemoryError
  are answered `success: false`, the old weights stay and the scheduler keeps serving; a stuck scheduler
  gets every control call a 503 within its deadline, and an update that never started is dropped;
* request limits: `n` and the body size are capped, deep or malformed JSON is a 400, large bodies are parsed
  off the event loop, `abort_all` must be a JSON bool, `--api-key` guards every path but the health probes,
  and a token id outside the tokenizer's vocabulary fails the sample with a named cause.

One small engine (tiny Qwen3-VL, short timeouts and caps) serves the engine tests; nothing here compiles a
program except the final health probe.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import shutil
import struct
import threading
import time
import types
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from PIL import Image, ImageFile

from envs.base import BaseInteractionEnv
from jaxrl_vlm.data.geo3k import DatasetError, load_prompt_dataset
from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions, build_app
from jaxrl_vlm.engine import server as engine_server
from jaxrl_vlm.engine.options import REQUEST_BYTES_BASE, REQUEST_BYTES_PER_TOKEN
from jaxrl_vlm.engine.weights import check_checkpoint_files
from jaxrl_vlm.models import hf_io
from rollout.client import EngineRequestError, EngineResponseError, RetryPolicy, SGLangClient
from rollout.encoding import ChatEncoder
from rollout.fake_engine import FakeSGLangServer, Tokens
from rollout.multiturn import RolloutContext, generate
from rollout.processing import (
    ImageDecodeError,
    ImageReadPolicy,
    ImageTooLarge,
    load_image,
)
from rollout.sample import Sample, Status
from rollout.sglang_wire import (
    AbortRequest,
    RequestError,
    SamplingParams,
    UpdateWeightsRequest,
    Unsupported,
    is_authorized,
    parse_generate,
    parse_json_body,
)

pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")

FAST = RetryPolicy(max_retries=0)
MAX_N = 4
BODY_CAP = 1 << 20
CONTROL_TIMEOUT_S = 2.0
UPDATE_TIMEOUT_S = 5.0
BIG_SIDE = 12_000  # 12000 x 12000 = 144 megapixels


# ---------------------------------------------------------------------------- helpers


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def bomb_png() -> bytes:
    """A valid 144-megapixel PNG of about 18 KB (bilevel, all black)."""
    data = _png(Image.new("1", (BIG_SIDE, BIG_SIDE)))
    assert len(data) < 4 << 20
    return data


@pytest.fixture()
def no_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any full decode of an image fails the test: a refused image must not be decoded first."""

    def refuse(self: Any, *a: Any, **k: Any) -> Any:
        raise AssertionError(f"decoded a {self.size} image")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)


def _sparse_file(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: costs no disk, but reading it would cost `size` bytes of RAM
    return path


# ---------------------------------------------------------------------------- 1. local media (reader)


def test_a_server_reader_never_opens_local_files(tmp_path: Path, make_test_image) -> None:
    secret = tmp_path / "private.png"
    secret.write_bytes(_png(make_test_image(1)))
    policy = ImageReadPolicy.for_server(None)
    for item in (str(secret), secret, "file://" + str(secret), "private.png", "~/x.png", "/etc/hosts"):
        with pytest.raises(ImageDecodeError, match="does not read|reads no local paths"):
            load_image(item, policy)
    with pytest.raises(ImageDecodeError, match="reads no local paths"):
        load_image("/etc/shadow", policy)  # no '.': read as base64, never as a path
    # Data URLs and base64 still work; trusted callers (the default policy) still read any path.
    png = _png(make_test_image(2))
    assert load_image(_data_url(png), policy).size == (64, 64)
    assert load_image(base64.b64encode(png).decode(), policy).size == (64, 64)
    assert load_image(str(secret)).size == (64, 64)


def test_an_allowed_media_dir_admits_only_image_files_inside_it(tmp_path: Path, make_test_image) -> None:
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    png = _png(make_test_image(3))
    (allowed / "sub" / "ok.png").write_bytes(png)
    (allowed / "notes.txt").write_bytes(png)  # image bytes, but not named like an image
    (tmp_path / "outside.png").write_bytes(png)
    (allowed / "link.png").symlink_to(tmp_path / "outside.png")  # inside by name, outside in fact
    (allowed / "shadow.png").symlink_to("/etc/passwd")
    policy = ImageReadPolicy.for_server(allowed)

    assert load_image(str(allowed / "sub" / "ok.png"), policy).size == (64, 64)
    assert load_image("file://" + str(allowed / "sub" / "ok.png"), policy).size == (64, 64)
    for item in (tmp_path / "outside.png", allowed / "link.png", allowed / "shadow.png",
                 f"{allowed}/sub/../../outside.png", f"file://{allowed}/../outside.png"):
        with pytest.raises(ImageDecodeError, match="outside the allowed local media path"):
            load_image(str(item), policy)
    with pytest.raises(ImageDecodeError, match="not an image file name"):
        load_image(str(allowed / "notes.txt"), policy)
    with pytest.raises(ImageDecodeError, match="not found"):
        load_image(str(allowed / "missing.png"), policy)
    (allowed / "dir.png").mkdir()
    with pytest.raises(ImageDecodeError, match="not a regular file"):
        load_image(str(allowed / "dir.png"), policy)


def test_image_byte_caps_refuse_before_reading(tmp_path: Path, make_test_image, monkeypatch) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    huge = _sparse_file(allowed / "huge.png", 1_500_000_000)
    policy = ImageReadPolicy.for_server(allowed)
    real_open = open

    def no_big_reads(path: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        assert Path(path) != huge, "read the 1.5 GB file"
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", no_big_reads)
    with pytest.raises(ImageTooLarge, match="1500000000 bytes.*max_image_bytes"):
        load_image(str(huge), policy)
    monkeypatch.undo()

    small = ImageReadPolicy(max_bytes=1000)
    png = _png(make_test_image(4, 128))
    assert len(png) > 1000
    for item in (png, _data_url(png), base64.b64encode(png).decode()):
        with pytest.raises(ImageTooLarge, match="max_image_bytes"):
            load_image(item, small)


def test_only_common_raster_formats_are_opened() -> None:
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"  # PIL would hand EPS to Ghostscript
    for data in (eps, b"not an image at all"):
        for item in (data, _data_url(data)):
            with pytest.raises(ImageDecodeError, match="cannot decode image"):
                load_image(item, ImageReadPolicy.for_server(None))


def test_a_144_megapixel_png_is_refused_from_its_header(bomb_png: bytes, tmp_path: Path, no_decode) -> None:
    for policy in (ImageReadPolicy.for_server(None), ImageReadPolicy()):
        with pytest.raises(ImageTooLarge, match=r"12000x12000 = 144000000 pixels.*max_image_pixels"):
            load_image(_data_url(bomb_png), policy)
    path = tmp_path / "bomb.png"
    path.write_bytes(bomb_png)
    with pytest.raises(ImageTooLarge, match="144000000 pixels"):
        load_image(path)  # the trusted reader (datasets, envs) has the same cap
    with pytest.raises(ImageTooLarge, match="pixels"):
        load_image(Image.new("1", (BIG_SIDE, BIG_SIDE)))


def test_the_data_loader_caps_image_bytes_and_pixels(bomb_png: bytes, tmp_path: Path, make_test_image, no_decode) -> None:
    (tmp_path / "bomb.png").write_bytes(bomb_png)
    rows = [{"problem": "<image>Find x.", "answer": "1", "images": ["bomb.png"]},
            {"problem": "<image>Find y.", "answer": "2", "images": [_data_url(bomb_png)]}]
    path = tmp_path / "bombs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=r"row 0.*144000000 pixels.*max_image_pixels"):
        load_prompt_dataset(str(path))
    with pytest.raises(DatasetError, match=r"no usable rows \(2 read, 2 skipped\)"):
        load_prompt_dataset(str(path), on_bad_row="skip")
    # The byte cap is checked before the file is read (a sparse 1.5 GB "image").
    _sparse_file(tmp_path / "huge.png", 1_500_000_000)
    path.write_text(json.dumps({"problem": "<image>Find z.", "answer": "3", "images": ["huge.png"]}) + "\n")
    with pytest.raises(DatasetError, match=r"1500000000 bytes.*max_image_bytes"):
        load_prompt_dataset(str(path))
    with pytest.raises(DatasetError, match="max_pixels must be a positive int"):
        load_prompt_dataset(str(path), max_image_pixels=0)


def test_the_data_loader_still_reads_normal_images_under_custom_caps(tmp_path: Path, make_test_image) -> None:
    (tmp_path / "a.png").write_bytes(_png(make_test_image(5, 64)))
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps({"problem": "<image>Find x.", "answer": "1", "images": ["a.png"]}) + "\n")
    assert len(load_prompt_dataset(str(path), max_image_pixels=64 * 64)) == 1
    with pytest.raises(DatasetError, match="4096 pixels, more than the cap of 4095"):
        load_prompt_dataset(str(path), max_image_pixels=64 * 64 - 1)


# ---------------------------------------------------------------------------- 3. request limits (wire)

_NOTHING_UNSUPPORTED = Unsupported(server="test")


def test_sampling_n_and_batch_totals_are_capped() -> None:
    with pytest.raises(RequestError, match=r"n=1000000000 is more than this server's maximum of 256"):
        SamplingParams.from_json({"n": 10**9})
    assert SamplingParams.from_json({"n": 4}, max_n=4).n == 4
    with pytest.raises(RequestError, match="maximum of 3"):
        parse_generate({"input_ids": [1, 2], "sampling_params": {"n": 4}}, 10, _NOTHING_UNSUPPORTED, max_n=3)
    # n within the cap, but a batch multiplies it: refused before any prompt is built.
    with pytest.raises(RequestError, match=r"asks for 6 generations \(3 prompt\(s\) x n\)"):
        parse_generate({"input_ids": [[1], [2], [3]], "sampling_params": {"n": 2}}, 10, _NOTHING_UNSUPPORTED, max_n=5)
    raws, is_batch = parse_generate({"input_ids": [1], "sampling_params": {"n": 3}}, 10, _NOTHING_UNSUPPORTED, max_n=3)
    assert len(raws) == 3 and is_batch


def test_deep_or_malformed_json_is_a_request_error() -> None:
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000):
        with pytest.raises(RequestError, match="nests JSON too deeply"):
            parse_json_body(raw, "/generate")
    for raw in (b"{", b"\xff\xfe\x00garbage", b'{"a": 1} trailing'):
        with pytest.raises(RequestError, match="not valid JSON"):
            parse_json_body(raw, "/generate")
    assert parse_json_body(b'{"a": [1]}', "/generate") == {"a": [1]}


def test_abort_all_and_weight_flags_parse_as_sglangs_pydantic_bools() -> None:
    """SGLang 0.5.23's request models (pydantic) read "false" as false, "true"/1 as true, and refuse anything else
    (checked against its own app in tests/sglang_conformance); `{}` is its no-op."""
    assert AbortRequest.from_json({"abort_all": "false"}) is None  # neither rid nor abort_all: nothing aborted
    assert AbortRequest.from_json({"abort_all": "false", "rid": "r"}).rid == "r"
    for body in ({"abort_all": "true"}, {"abort_all": 1}, {"abort_all": True}):
        assert AbortRequest.from_json(body).rid is None
    assert AbortRequest.from_json({}) is None
    with pytest.raises(RequestError, match="abort_all must be a boolean"):
        AbortRequest.from_json({"abort_all": "maybe"})
    assert AbortRequest.from_json({"abort_all": False, "rid": "r1"}).rid == "r1"
    with pytest.raises(RequestError, match="rid must be a string"):
        AbortRequest.from_json({"rid": 5})
    assert UpdateWeightsRequest.from_json({"model_path": "/x", "abort_all_requests": "false"}).abort_all_requests is False
    assert UpdateWeightsRequest.from_json({"model_path": "/x", "flush_cache": "no"}).flush_cache is False
    with pytest.raises(RequestError, match="flush_cache must be a boolean"):
        UpdateWeightsRequest.from_json({"model_path": "/x", "flush_cache": "nah"})
    with pytest.raises(RequestError, match="weight_version must be a string"):  # SGLang: 400 for an int
        UpdateWeightsRequest.from_json({"model_path": "/x", "weight_version": 3})
    ok = UpdateWeightsRequest.from_json({"model_path": "/x", "weight_version": "3", "flush_cache": False})
    assert ok.weight_version == "3" and ok.flush_cache is False and ok.abort_all_requests is False


def test_api_key_rule_matches_sglang() -> None:
    assert is_authorized("/generate", None, None)
    assert not is_authorized("/generate", None, "k")
    assert not is_authorized("/generate", "Bearer wrong", "k")
    assert not is_authorized("/update_weights_from_disk", "k", "k")
    assert is_authorized("/generate", "Bearer k", "k")
    assert is_authorized("/health", None, "k") and is_authorized("/health_generate", None, "k")
    assert is_authorized("/ready", None, "k")  # SGLang 0.5.23 exempts /ready too
    assert is_authorized("/generate", "bearer k", "k") and not is_authorized("/generate", "Bearer  k", "k")


def test_engine_options_derive_the_body_cap_and_validate_limits() -> None:
    assert EngineOptions(max_seq_len=4096).request_bytes_cap == REQUEST_BYTES_BASE + REQUEST_BYTES_PER_TOKEN * 4096
    assert EngineOptions(max_request_bytes=123).request_bytes_cap == 123
    for bad in ({"max_n": 0}, {"max_image_pixels": -1}, {"max_request_bytes": 0}, {"control_timeout_s": float("nan")},
                {"weight_update_timeout_s": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineOptions(**bad)


# ---------------------------------------------------------------------------- 2. weight files (preflight)


def _header_file(path: Path, header: bytes, length: int | None = None, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)


def test_corrupt_checkpoint_files_are_refused_before_any_tensor_is_read(tmp_path: Path) -> None:
    cases: dict[str, str] = {}

    def case(name: str, needle: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        cases[name] = needle
        return d

    _header_file(case("list_header", "a JSON list, not an object") / "model.safetensors", b"[1, 2, 3]")
    _header_file(case("huge_length", "header length 1152921504606846976") / "model.safetensors", b"{}", length=1 << 60)
    _header_file(case("bad_offsets", "outside the file") / "model.safetensors",
                 json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode(), data=b"\0" * 8)
    _header_file(case("bad_span", "needs 16") / "model.safetensors",
                 json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode(), data=b"\0" * 8)
    _header_file(case("deep_header", "nests too deeply") / "model.safetensors", b"[" * 100_000 + b"]" * 100_000)
    d = case("list_weight_map", "'weight_map' must be an object")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    d = case("dotdot_index", "is not a file of the checkpoint directory")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../other/model.safetensors"}}))
    d = case("absolute_index", "is not a file of the checkpoint directory")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "/etc/model.safetensors"}}))
    d = case("missing_shard", "missing")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
    for name, needle in cases.items():
        with pytest.raises(hf_io.CheckpointError, match=needle):
            check_checkpoint_files(tmp_path / name)
    with pytest.raises(FileNotFoundError):
        check_checkpoint_files(tmp_path / "nowhere")


# ---------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("allowed_media")


@pytest.fixture(scope="module")
def engine(tiny_hf_checkpoint: Path, media_dir: Path) -> EmbeddedEngine:
    config = EngineOptions(max_batch=2, max_seq_len=256, min_prefill_bucket=64, min_kv_bucket=256, decode_batch_sizes=(2,),
                           min_patch_bucket=64, allowed_local_media_path=str(media_dir), max_n=MAX_N,
                           max_request_bytes=BODY_CAP, control_timeout_s=CONTROL_TIMEOUT_S,
                           weight_update_timeout_s=UPDATE_TIMEOUT_S)
    eng = EmbeddedEngine(str(tiny_hf_checkpoint), config=config)
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def image_prompt(engine: EmbeddedEngine, make_test_image) -> list[int]:
    encoder = ChatEncoder(engine.engine.tokenizer, engine.engine.image_processor)
    return encoder.encode_prompt([{"role": "user", "content": [{"type": "image", "image": make_test_image(1)},
                                                               {"type": "text", "text": "hi"}]}]).wire_ids


async def post(url: str, path: str, body: Any = None, *, method: str = "POST", data: Any = None,
               headers: dict[str, str] | None = None, timeout_s: float = 60.0) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async with s.request(method, url + path, json=body if data is None else None, data=data, headers=headers) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text) if text.strip() else None
            except ValueError:
                return r.status, text


def _message(answer: Any) -> str:
    return answer["error"]["message"] if isinstance(answer, dict) and isinstance(answer.get("error"), dict) else str(answer)


async def test_the_server_reads_images_only_as_allowed(engine, media_dir, image_prompt, make_test_image, tmp_path, bomb_png):
    png = _png(make_test_image(6))
    (media_dir / "diagram.png").write_bytes(png)
    (media_dir / "notes.txt").write_bytes(png)
    secret = tmp_path / "private.png"
    secret.write_bytes(png)
    (media_dir / "escape.png").symlink_to(secret)
    _sparse_file(media_dir / "huge.png", 1_500_000_000)
    refused = {
        "/etc/passwd": "invalid base64",  # no image suffix, so never a path: read as base64
        "/proc/self/environ": "invalid base64",
        "/etc/ssl/certs/ca-certificates.crt": "outside the allowed local media path",
        "/etc/passwd.png": "outside the allowed local media path",
        str(secret): "outside the allowed local media path",
        str(media_dir / "escape.png"): "outside the allowed local media path",
        f"{media_dir}/../{tmp_path.name}/private.png": "outside the allowed local media path",
        str(media_dir / "notes.txt"): "not an image file name",
        str(media_dir / "huge.png"): "max_image_bytes",
        _data_url(bomb_png): "144000000 pixels",
    }
    for item, needle in refused.items():
        status, answer = await post(engine.url, "/generate", {"input_ids": image_prompt, "image_data": [item]})
        assert status == 400 and needle in _message(answer), (item, answer)
    # A file inside the allowed directory is read (prepared as the scheduler would receive it).
    raws, _ = parse_generate({"input_ids": image_prompt, "image_data": [str(media_dir / "diagram.png")]},
                             engine.engine.cfg.text.vocab_size, _NOTHING_UNSUPPORTED)
    prepared = engine.engine.preparer.prepare(raws[0])
    assert prepared.prompt.image_grid_thw is not None and len(prepared.prompt.image_grid_thw) == 1


async def test_the_144_megapixel_png_is_not_decoded_by_the_server(engine, image_prompt, bomb_png, no_decode):
    status, answer = await post(engine.url, "/generate", {"input_ids": image_prompt, "image_data": [_data_url(bomb_png)]})
    assert status == 400 and "it was not decoded" in _message(answer)


async def test_request_limits_answer_4xx_and_the_server_keeps_serving(engine, monkeypatch):
    url = engine.url
    status, answer = await post(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"n": 10**9}})
    assert status == 400 and f"maximum of {MAX_N}" in _message(answer)
    status, answer = await post(url, "/generate", {"input_ids": [[1], [2], [3]], "sampling_params": {"n": 2}})
    assert status == 400 and "6 generations" in _message(answer)

    # Over the body cap: 413, whether Content-Length announces it or the body is streamed (chunked).
    big = b'{"input_ids": [' + b"1, " * (BODY_CAP // 3) + b"1]}"
    status, answer = await post(url, "/generate", data=big, headers={"Content-Type": "application/json"})
    assert status == 413 and "max_request_bytes" in _message(answer)

    async def chunks():
        for k in range(0, len(big), 64 << 10):
            yield big[k : k + (64 << 10)]

    status, answer = await post(url, "/generate", data=chunks(), headers={"Content-Type": "application/json"})
    assert status == 413 and "max_request_bytes" in _message(answer)

    # Deep or malformed JSON: 400, never 500; on every endpoint that reads a body.
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/generate", "/abort_request", "/pause_generation", "/update_weights_from_disk"):
        status, answer = await post(url, path, data=deep)
        assert status == 400 and "nests JSON too deeply" in _message(answer), (path, answer)
        status, answer = await post(url, path, data=b'{"input_ids": [1,')
        assert status == 400 and "not valid JSON" in _message(answer), (path, answer)

    # A large body is parsed in a worker thread, not on the event loop.
    threads: list[str] = []
    real_parse = engine_server.parse_json_body

    def spy(raw: bytes, where: str) -> Any:
        threads.append(threading.current_thread().name)
        return real_parse(raw, where)

    monkeypatch.setattr(engine_server, "parse_json_body", spy)
    small = {"input_ids": [1], "sampling_params": {"n": 10**9}}
    large = {**small, "rid": "x" * (engine_server.JSON_INLINE_BYTES + 1)}
    for body in (small, large):
        status, _ = await post(url, "/generate", body)
        assert status == 400
    assert threads[0] == "jaxrl-vlm-engine-http" and threads[1].startswith("jaxrl-vlm-prepare"), threads
    monkeypatch.undo()

    # abort_all parses as SGLang's pydantic bool: the string "false" aborts nothing (a 200 no-op, as SGLang).
    aborted: list[Any] = []
    monkeypatch.setattr(engine.engine.scheduler, "abort", lambda rid, *a: aborted.append(rid))
    status, answer = await post(url, "/abort_request", {"abort_all": "false"})
    assert status == 200 and aborted == []
    status, _ = await post(url, "/abort_request", {"abort_all": True})
    assert status == 200 and aborted == [None]
    monkeypatch.undo()

    status, _ = await post(url, "/v1/loads", method="GET")
    assert status == 200 and engine.engine.scheduler.alive


async def test_api_key_guards_every_path_but_health(engine):
    app = build_app(engine.engine, api_key="s3cret")
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        for path, method in (("/get_model_info", "GET"), ("/v1/loads", "GET"), ("/flush_cache", "POST"),
                             ("/update_weights_from_disk", "POST"), ("/generate", "POST")):
            status, answer = await post(url, path, {"model_path": "/x", "input_ids": [1]}, method=method)
            assert status == 401 and answer == {"error": "Unauthorized"}, path
            status, _ = await post(url, path, {}, method=method, headers={"Authorization": "Bearer wrong"})
            assert status == 401
        status, _ = await post(url, "/health", method="GET")
        assert status == 200
        async with SGLangClient(url, retry=FAST, api_key="s3cret") as client:
            assert (await client.get_model_info())["model_path"] == engine.model_dir
            assert await client.get_weight_version() == engine.engine.scheduler.weight_version
        async with SGLangClient(url, retry=FAST) as client:
            with pytest.raises(EngineRequestError, match="HTTP 401") as err:
                await client.get_weight_version()
            assert "s3cret" not in str(err.value)
    finally:
        await runner.cleanup()


def test_binding_a_non_loopback_host_without_a_key_warns(caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="jaxrl_vlm.engine.server")
    for host, key, warns in (("0.0.0.0", None, True), ("::", None, True), ("10.1.2.3", None, True),
                             ("0.0.0.0", "k", False), ("127.0.0.1", None, False), ("localhost", None, False)):
        caplog.clear()
        with pytest.raises(Exception):  # noqa: B017 - no model there: start() fails right after its check
            EmbeddedEngine(str(tmp_path / "no_model"), host=host, api_key=key).start()
        assert ("without an API key" in caplog.text) is warns, (host, key)
    assert engine_server.is_loopback("::1") and not engine_server.is_loopback("example.com")


async def test_corrupt_weights_and_memory_errors_keep_the_old_weights_and_the_scheduler(
        engine, tiny_hf_checkpoint, tmp_path, monkeypatch):
    def corrupt(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(tiny_hf_checkpoint, d)
        return d

    _header_file(corrupt("list_header") / "model.safetensors", b"[]")
    _header_file(corrupt("huge_length") / "model.safetensors", b"{}", length=(1 << 64) - 1)
    d = corrupt("list_weight_map")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    d = corrupt("dotdot_index")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../list_header/model.safetensors"}}))

    sched = engine.engine.scheduler
    params, version, updates = engine.engine.runner.params, sched.weight_version, sched.stats.weight_updates
    async with SGLangClient(engine.url, retry=FAST) as client:
        for name in ("list_header", "huge_length", "list_weight_map", "dotdot_index"):
            answer = await client.update_weights_from_disk(str(tmp_path / name), "bad")
            assert answer["success"] is False and "CheckpointError" in answer["message"], (name, answer)

        calls = {"n": 0}
        real_get = hf_io.SafetensorsReader.get

        def exhausted(self: Any, key: str) -> Any:
            calls["n"] += 1
            if calls["n"] > 3:
                raise MemoryError("injected: host memory exhausted")
            return real_get(self, key)

        monkeypatch.setattr(hf_io.SafetensorsReader, "get", exhausted)
        answer = await client.update_weights_from_disk(str(tiny_hf_checkpoint), "bad")
        assert answer["success"] is False and "MemoryError: injected" in answer["message"]
        monkeypatch.undo()

        assert sched.alive and engine.engine.runner.params is params
        assert await client.get_weight_version() == version and sched.stats.weight_updates == updates
        # Still a working engine: a real update succeeds, and the scheduler generates (health probe).
        answer = await client.update_weights_from_disk(str(tiny_hf_checkpoint), version)
        assert answer["success"] is True and sched.stats.weight_updates == updates + 1
        assert await client.health()


@pytest.mark.slow
@pytest.mark.ci_step  # CI's own step for long tests (.ci/run), not the README's test command: see pyproject.toml
async def test_a_stuck_scheduler_answers_503_within_the_deadlines(engine, tiny_hf_checkpoint, monkeypatch):
    sched, runner = engine.engine.scheduler, engine.engine.runner
    release = threading.Event()
    loads: list[str] = []
    real_load = runner.load_weights

    def stuck_load(path: Any) -> None:
        loads.append(str(path))
        if len(loads) == 1:
            release.wait(60)  # a device call that does not come back
        real_load(path)

    monkeypatch.setattr(runner, "load_weights", stuck_load)
    updates = sched.stats.weight_updates
    url = engine.url
    first = asyncio.ensure_future(post(url, "/update_weights_from_disk", {"model_path": str(tiny_hf_checkpoint)}))
    try:
        deadline = time.monotonic() + 30
        while not loads:
            assert time.monotonic() < deadline, "the update never started"
            await asyncio.sleep(0.01)
        for path, method in (("/pause_generation", "POST"), ("/flush_cache", "POST"), ("/continue_generation", "POST"),
                             ("/v1/loads", "GET"), ("/get_server_info", "GET")):
            t0 = time.monotonic()
            status, answer = await post(url, path, {}, method=method)
            elapsed = time.monotonic() - t0
            assert status == 503 and "did not answer within" in _message(answer), (path, answer)
            assert CONTROL_TIMEOUT_S <= elapsed < CONTROL_TIMEOUT_S + 5, (path, elapsed)
        status, _ = await post(url, "/health_generate", method="GET")
        assert status == 503
        # A second update queues behind the stuck one and times out: answered success false, then dropped.
        status, answer = await post(url, "/update_weights_from_disk", {"model_path": str(tiny_hf_checkpoint), "weight_version": "never"})
        assert status == 503 and answer["success"] is False and "did not answer within" in answer["message"]
        status, answer = await first
        assert status == 503 and answer["success"] is False
    finally:
        release.set()
    # The stuck load finishes; the queued one is dropped, never loaded behind its caller's back.
    deadline = time.monotonic() + 30
    while sched.stats.weight_updates == updates:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    status, _ = await post(url, "/continue_generation", {})  # the timed-out pause was applied late: undo it
    assert status == 200
    status, loads_answer = await post(url, "/v1/loads", method="GET")
    assert status == 200 and loads_answer["loads"][0]["num_running_reqs"] == 0
    assert loads == [str(tiny_hf_checkpoint)] and sched.weight_version != "never" and sched.alive


# ---------------------------------------------------------------------------- row 13: token ids >= vocab


async def test_the_client_refuses_token_ids_outside_the_vocabulary():
    async with FakeSGLangServer(script=[Tokens((5, 1024, 2)), Tokens((5, 6, 2)), Tokens((-1,))], eos_token_id=2) as srv:
        async with SGLangClient(srv.url, retry=FAST, vocab_size=1024) as client:
            with pytest.raises(EngineResponseError, match=r"output token id 1024 at position 1 is outside the "
                                                          r"tokenizer's vocabulary \[0, 1024\)"):
                await client.generate([1, 2], sampling_params={"max_new_tokens": 8})
            assert (await client.generate([1, 2], sampling_params={"max_new_tokens": 8})).output_ids == [5, 6, 2]
            with pytest.raises(EngineResponseError, match="output token id -1"):
                await client.generate([1, 2], sampling_params={"max_new_tokens": 8}, return_logprob=False)


class _OneTurnEnv(BaseInteractionEnv):
    def reset(self) -> None:
        pass

    async def step(self, response_text: str):
        return {"obs_str": ""}, True, {}

    def verdict(self):
        return 1.0

    def close(self) -> None:
        pass


async def test_a_bad_token_id_fails_the_sample_with_a_named_cause(tiny_tokenizer, tiny_image_processor):
    encoder = ChatEncoder(tiny_tokenizer, tiny_image_processor)
    vocab = len(tiny_tokenizer)
    reply = Tokens(tuple(encoder.tokenize("x = 7")) + (vocab + 5, encoder.vision.im_end))
    env_module = types.ModuleType("one_turn_env")
    env_module.build_env = lambda sample, args: _OneTurnEnv()
    async with FakeSGLangServer(generate_fn=lambda body: reply, eos_token_id=encoder.vision.im_end,
                                image_token_id=encoder.vision.image_pad) as srv:
        async with SGLangClient(srv.url, retry=FAST, vocab_size=vocab) as client:
            ctx = RolloutContext(client=client, encoder=encoder, env_module=env_module, generate_slots=asyncio.Semaphore(2))
            args = types.SimpleNamespace(
                rollout_max_response_len=64, rollout_max_context_len=None, max_turns=2, max_env_retries_per_turn=0,
                env_step_timeout=5.0, episode_timeout=30.0, delta_check="strict", rollout_temperature=1.0,
                rollout_top_p=1.0, rollout_top_k=-1, rollout_stop_token_ids=[], partial_rollout=False,
                rollout_context=ctx)
            sample = await generate(args, Sample(prompt=[{"role": "user", "content": "Find x."}], label="7"))
    assert sample.status is Status.FAILED and str(sample.termination) == "engine_error"
    assert f"output token id {vocab + 5}" in sample.metadata["error"] and "vocabulary" in sample.metadata["error"]


async def test_the_fake_engine_applies_the_same_limits():
    async with FakeSGLangServer(api_key="k", max_n=2) as srv:
        status, answer = await post(srv.url, "/generate", {"input_ids": [1]})
        assert status == 401 and answer == {"error": "Unauthorized"}
        status, _ = await post(srv.url, "/health", method="GET")
        assert status == 200
        auth = {"Authorization": "Bearer k"}
        status, answer = await post(srv.url, "/generate", {"input_ids": [1], "sampling_params": {"n": 3}}, headers=auth)
        assert status == 400 and "maximum of 2" in _message(answer)
        status, answer = await post(srv.url, "/abort_request", {"abort_all": "maybe"}, headers=auth)
        assert status == 400 and "abort_all must be a boolean" in _message(answer)
        status, answer = await post(srv.url, "/generate", data=b"[" * 100_000 + b"]" * 100_000, headers=auth)
        assert status == 400
        async with SGLangClient(srv.url, retry=FAST, api_key="k") as client:
            assert (await client.generate([1, 2], sampling_params={"max_new_tokens": 8})).output_ids[-1] == srv.eos_token_id
        assert all(r.headers.get("Authorization") == "Bearer k" for r in srv.requests_to("/generate")[-1:])
