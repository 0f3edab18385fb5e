"""Shared test fixtures: tiny Qwen3-VL processing files and checkpoint, built (never downloaded).

The environment is set first, before anything can import jax: sharding tests
need 8 simulated CPU devices, and nothing may reach a model hub.
"""

from __future__ import annotations

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICE_FLAG).strip()
# XLA:CPU aborts the process (SIGABRT) when a collective's 8 simulated devices do not all arrive within its
# rendezvous timeout (40 s by default). On the 2-core machine under full load (two workers plus a subprocess
# compiling) a device thread can be starved that long: a run lost a worker so in `Trainer.train_on`
# (tests/test_eval.py) and xdist's replacement worker then failed the whole session. A genuinely deadlocked
# collective still aborts, after 15 minutes.
_COLLECTIVE_TIMEOUTS = ("--xla_cpu_collective_timeout_seconds=900",
                        "--xla_cpu_collective_call_terminate_timeout_seconds=900")
if "xla_cpu_collective_timeout_seconds" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] = " ".join([os.environ["XLA_FLAGS"], *_COLLECTIVE_TIMEOUTS])
# The suite's programs are tiny and most of its time is XLA:CPU compilation, mostly LLVM's optimisation passes:
# at backend optimisation level 0 a compile-bound module runs ~25% faster (tests/test_temperature.py: 73 -> 47 s
# of CPU; the whole suite 28 -> 24 min); execution slows less than that buys (the color_reveal learning run,
# the longest: 163 -> 198 s outside compilation). Results move by float rounding only (its own math
# functions and fused multiply-adds: a 2-step color_reveal run's grad norm 4.158713 vs 4.158712, same rewards);
# every comparison in the suite is between programs compiled under the same flags, or has a float tolerance.
# Set JAXRL_TEST_XLA_OPT_LEVEL to measure another level.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    _OPT_LEVEL = os.environ.get("JAXRL_TEST_XLA_OPT_LEVEL", "0")
    os.environ["XLA_FLAGS"] += f" --xla_backend_optimization_level={_OPT_LEVEL}"
# Tried and left out (2026-12-06): `--xla_cpu_use_fusion_emitters=false` compiles ~25% faster (the whole suite's
# compilation 1,439 -> 1,110 s) but runs slower (in-process execution 780 -> 955 s) and moves float rounding enough
# to break two tolerance checks (test_context_parallel[qwen3_5_moe-2], test_freeze_vision's first-step gradients).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache, for this process and every subprocess the tests start (servers, CLI runs,
# multi-host workers inherit the environment): the suite builds the same tiny models, train steps and engines in
# many modules and processes, and a program compiled once comes back from disk afterwards (also after the
# per-module clear below). Git-ignored; every run starts it empty (`pytest_configure`, below) and fills it within
# the run: an executable that an EARLIER run wrote can abort the process when loaded (SIGABRT, no message: the
# trainer's step in tests/test_train_layouts.py and tests/test_eval.py; reproducible on 1ff026d by running
# test_train_layouts.py twice), while one written and reused within the same run has not (a whole cold suite passes).
_XLA_CACHE = os.environ.get("JAXRL_TEST_XLA_CACHE", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), ".cache", "xla-tests"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _XLA_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

TINY_SEED = 0


# Measured seconds per test module (`scripts/suite_timing_table.py --write-durations`), used only to order modules.
MODULE_DURATIONS = Path(__file__).parent / "module_durations.json"


def pytest_configure(config: pytest.Config) -> None:
    # The controller (not an xdist worker, which starts after it) empties the compilation cache of earlier runs.
    # JAXRL_TEST_XLA_CACHE names a cache to keep as it is (e.g. to investigate the abort above).
    if not hasattr(config, "workerinput") and "JAXRL_TEST_XLA_CACHE" not in os.environ:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)
        # Every process started from here on keeps it: a test that runs pytest in a child process
        # (tests/test_flash_attention.py's TPU-interpreter child) would otherwise empty it mid-run, and every later
        # compilation of the suite would miss the cache (measured: 180 failed cache writes, ~1 min of the suite's wall
        # time).
        os.environ["JAXRL_TEST_XLA_CACHE"] = _XLA_CACHE
    timing_path = os.environ.get("JAXRL_SUITE_TIMING")
    if timing_path:
        from _suite_timing import register

        register(config, timing_path)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest modules first, each module's tests kept together and in their order.

    Under `-n 2 --dist loadfile --no-loadscope-reorder` (the README's command) xdist hands out whole modules in
    this order, so the longest start first and no worker is left running one long module at the end (longest
    processing time first). Modules missing from the file (new ones) keep their place after the measured ones.
    A plain run is reordered too; modules share no state, so the order changes nothing but when each one runs.
    """
    durations = json.loads(MODULE_DURATIONS.read_text()) if MODULE_DURATIONS.is_file() else {}
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))

    def key(item: pytest.Item) -> tuple[float, int]:
        module = item.nodeid.split("::")[0]
        return (-float(durations.get(module, 0.0)), first_seen[module])

    items.sort(key=key)  # stable: order within a module is kept


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs_after_each_module():
    """Drop JAX's compiled programs after every test module.

    Each compiled XLA CPU program holds memory mappings, and a module of engine tests leaves thousands of them
    (measured: 15 prefix-cache tests, +4,300); over the whole suite in one process they reach the kernel's
    vm.max_map_count (65,530) and the next compilation aborts the interpreter. Programs are rarely shared
    between modules; those that are come back from the persistent compilation cache on disk (above), not from a
    new compilation.
    """
    before = set(threading.enumerate())
    yield
    _report_leaked_threads(before)
    jax.clear_caches()
    gc.collect()


def _report_leaked_threads(before: set[threading.Thread], grace_s: float = 5.0) -> None:
    """Warn about the project's threads (engine scheduler, HTTP server, env hooks) that a module left running.

    A leaked engine keeps dispatching programs to the simulated devices while later modules of the same worker
    train on them; a stall in a full suite's test_eval (xdist worker asleep for 10 minutes) was never reproduced
    alone, and a thread left behind by an earlier module is one way to get it."""
    deadline = time.monotonic() + grace_s
    ours = [t for t in threading.enumerate() if t not in before and t.name.startswith(("jaxrl-vlm", "env-hook"))]
    for thread in ours:
        thread.join(max(0.0, deadline - time.monotonic()))
    leaked = sorted(t.name for t in ours if t.is_alive())
    if leaked:
        # A builtin category: xdist's controller rebuilds a worker's warning by importing its class's module by
        # name, and `conftest` there can be another directory's conftest (tests/sglang_conformance's: an
        # INTERNALERROR that stopped the run).
        warnings.warn(f"leaked threads: left running after the module: {leaked}", RuntimeWarning, stacklevel=1)


@pytest.fixture(scope="session")
def tiny_processing_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dir with tokenizer.json, tokenizer_config.json, chat_template.jinja and preprocessor_config.json."""
    from jaxrl_vlm.tiny_assets import save_tiny_processing

    return save_tiny_processing(tmp_path_factory.mktemp("tiny_processing"), seed=TINY_SEED)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_processing_dir: Path) -> Any:
    """The tiny tokenizer as every component loads it (rollout.processing.load_tokenizer)."""
    from rollout.processing import load_tokenizer

    return load_tokenizer(tiny_processing_dir)


def _tiny_processing_with_template(tmp_path_factory: pytest.TempPathFactory, name: str, template: str) -> Path:
    from jaxrl_vlm.tiny_assets import build_tiny_tokenizer, save_tiny_processing

    tokenizer = build_tiny_tokenizer(seed=TINY_SEED, chat_template=template)
    return save_tiny_processing(tmp_path_factory.mktemp(name), tokenizer, seed=TINY_SEED)


@pytest.fixture(scope="session")
def tiny_thinking_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny tokenizer (same vocabulary and ids) with the Qwen3-style thinking chat template, which rewrites
    earlier assistant turns; loaded from disk like every component loads a model's tokenizer."""
    from jaxrl_vlm.tiny_assets import QWEN3_THINKING_CHAT_TEMPLATE
    from rollout.processing import load_tokenizer

    return load_tokenizer(_tiny_processing_with_template(tmp_path_factory, "tiny_thinking", QWEN3_THINKING_CHAT_TEMPLATE))


@pytest.fixture(scope="session")
def tiny_vl_thinking_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Like `tiny_thinking_tokenizer`, with the Qwen3-VL-Thinking-style template whose generation prompt opens
    `<think>`."""
    from jaxrl_vlm.tiny_assets import QWEN3_VL_THINKING_CHAT_TEMPLATE
    from rollout.processing import load_tokenizer

    return load_tokenizer(
        _tiny_processing_with_template(tmp_path_factory, "tiny_vl_thinking", QWEN3_VL_THINKING_CHAT_TEMPLATE))


@pytest.fixture(scope="session")
def tiny_qwen25_processing_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like `tiny_processing_dir` for Qwen2.5-VL: the same vocabulary and ids, the Qwen2.5-VL-style chat
    template (default system prompt) and patch-14 CLIP-normalized preprocessing."""
    from jaxrl_vlm.tiny_assets import QWEN2_5_VL_CHAT_TEMPLATE, build_tiny_tokenizer, save_tiny_processing

    tokenizer = build_tiny_tokenizer(seed=TINY_SEED, chat_template=QWEN2_5_VL_CHAT_TEMPLATE)
    return save_tiny_processing(tmp_path_factory.mktemp("tiny_qwen25_processing"), tokenizer, seed=TINY_SEED,
                                arch="qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_image_processor(tiny_processing_dir: Path) -> Any:
    """Qwen3-VL image processing (patch 16, merge 2) with a 64x64..128x128 pixel range."""
    from rollout.processing import load_image_processor

    return load_image_processor(tiny_processing_dir)


@pytest.fixture(scope="session")
def tiny_hf_config(tiny_tokenizer: Any) -> dict[str, Any]:
    """The tiny Qwen3-VL config dict (transformers 5 format) matching the tiny tokenizer."""
    from jaxrl_vlm.tiny_assets import tiny_qwen3_vl_hf_config

    return tiny_qwen3_vl_hf_config(tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tiny_processing_dir: Path, tiny_hf_config: dict[str, Any]
) -> Path:
    """A random float32 Qwen3VLForConditionalGeneration (seed 0) saved with save_pretrained, plus processing files.

    torch is imported here, not at module level: tests that do not need it skip the ~8 s import.
    """
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    out = tmp_path_factory.mktemp("tiny_qwen3_vl")
    torch.manual_seed(TINY_SEED)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**tiny_hf_config)).to(torch.float32).eval()
    # Like Qwen3-VL-Instruct's generation_config: both <|im_end|> and <|endoftext|> stop generation.
    text_config = tiny_hf_config["text_config"]
    model.generation_config.eos_token_id = [text_config["eos_token_id"], text_config["pad_token_id"]]
    model.save_pretrained(str(out))
    for item in tiny_processing_dir.iterdir():
        shutil.copy2(item, out / item.name)
    return out


def _test_image(seed: int, size: int | tuple[int, int] = 64) -> Image.Image:
    """Deterministic RGB image of `size` (width, height): smooth gradients plus seeded blocky noise.

    Not plain noise, so resizing and compression behave as on real pictures.
    """
    width, height = (size, size) if isinstance(size, int) else size
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=3)
    freq = rng.uniform(0.02, 0.2, size=(3, 2))
    channels = [
        127.5 + 90.0 * np.sin(freq[c, 0] * xx + freq[c, 1] * yy + phase[c]) for c in range(3)
    ]
    base = np.stack(channels, axis=-1)
    blocks = rng.integers(-30, 31, size=(height // 8 + 1, width // 8 + 1, 3)).repeat(8, 0).repeat(8, 1)
    pixels = np.clip(base + blocks[:height, :width], 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="session")
def make_test_image() -> Callable[..., Image.Image]:
    """`make_test_image(seed, size)` -> deterministic RGB PIL image; size is an int or (width, height)."""
    return _test_image
