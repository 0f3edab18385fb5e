"""Decode throughput of the embedded engine against transformers' `generate` (batch 1), in one run.

    python scripts/bench_engine.py [--size tiny|small] [--new-tokens 64] [--concurrency 1 8 32]

Builds a random Qwen3-VL checkpoint of the chosen size (transformers, saved with `save_pretrained`,
with the tiny tokenizer and processor files), then measures on the same machine and prompt:

* transformers: greedy `generate` of N new tokens at batch 1 (EOS ignored), tokens / wall time;
* the engine: C concurrent `/generate` requests over loopback HTTP (SGLangClient), N new tokens each
  (EOS ignored), total tokens / wall time, after an untimed warm-up round that compiles the programs.

Both timings include the prompt's prefill (short next to N tokens). Printed: tokens/s, ratio to
transformers, decode steps per token and the compiled-program count (compile time and host
overhead are reported, not hidden). `--json FILE` also writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},  # tiny_assets defaults: hidden 64, 2 layers
    "small": {"text_config": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
                              "num_key_value_heads": 4, "head_dim": 32,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [8, 4, 4],
                                                  "mrope_interleaved": True}},
              "vision_config": {"out_hidden_size": 256}},
}


def build_checkpoint(size: str, out: Path) -> Path:
    """A random fp32 Qwen3-VL of `size` saved by transformers, plus tokenizer / processor files."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from jaxrl_vlm.tiny_assets import save_tiny_processing, tiny_qwen3_vl_hf_config
    from rollout.processing import load_tokenizer

    proc = save_tiny_processing(out / "processing", seed=0)
    config = tiny_qwen3_vl_hf_config(load_tokenizer(proc), **SIZES[size])
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**config)).to(torch.float32).eval()
    model.generation_config.eos_token_id = [config["text_config"]["eos_token_id"]]
    model_dir = out / "model"
    model.save_pretrained(str(model_dir))
    for item in proc.iterdir():
        shutil.copy2(item, model_dir / item.name)
    return model_dir


def bench_transformers(model_dir: Path, prompt: list[int], new_tokens: int, repeats: int, threads: int) -> dict[str, float]:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    torch.set_num_threads(threads)
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        model.generate(input_ids=x, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(input_ids=x, **kwargs)
            best = min(best, time.perf_counter() - start)
    produced = out.shape[1] - x.shape[1]
    return {"tokens": produced, "seconds": best, "tokens_per_s": produced / best}


async def _round(url: str, prompt: list[int], concurrency: int, new_tokens: int) -> tuple[int, float]:
    from rollout.client import SGLangClient

    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    async with SGLangClient(url, timeout_s=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(client.generate(prompt, sampling_params=params) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return sum(len(r.output_ids) for r in results), elapsed


def bench_engine(model_dir: Path, prompt: list[int], new_tokens: int, concurrencies: list[int], repeats: int) -> list[dict[str, Any]]:
    from jaxrl_vlm.engine import EmbeddedEngine, EngineConfig

    max_batch = max(concurrencies)
    config = EngineConfig(max_batch=max_batch, max_seq_len=max(256, len(prompt) + new_tokens + 1), min_kv_bucket=128)
    rows = []
    with EmbeddedEngine(str(model_dir), config=config) as engine:
        for c in concurrencies:
            compile_start = time.perf_counter()
            asyncio.run(_round(engine.url, prompt, c, new_tokens))  # compiles this concurrency's programs
            warmup_s = time.perf_counter() - compile_start
            best, tokens, steps = float("inf"), 0, 0
            for _ in range(repeats):
                before = engine.stats.decode_steps
                tokens, elapsed = asyncio.run(_round(engine.url, prompt, c, new_tokens))
                if elapsed < best:
                    best, steps = elapsed, engine.stats.decode_steps - before
            rows.append({"concurrency": c, "tokens": tokens, "seconds": best, "tokens_per_s": tokens / best,
                         "decode_steps": steps, "ms_per_decode_step": 1e3 * best / max(1, steps), "warmup_s": warmup_s,
                         "compiled_programs": engine.engine.runner.num_programs})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--torch-threads", type=int, default=max(1, os.cpu_count() or 1))
    p.add_argument("--json", default=None, help="Also write the results to this file.")
    ns = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        model_dir = build_checkpoint(ns.size, Path(tmp))
        from rollout.encoding import ChatEncoder
        from rollout.processing import load_image_processor, load_tokenizer

        encoder = ChatEncoder(load_tokenizer(model_dir), load_image_processor(model_dir))
        prompt = encoder.encode_prompt([{"role": "user", "content": "Find the area of the triangle with base 6."}]).wire_ids
        hf = bench_transformers(model_dir, prompt, ns.new_tokens, ns.repeats, ns.torch_threads)
        rows = bench_engine(model_dir, prompt, ns.new_tokens, ns.concurrency, ns.repeats)

    print(f"\nsize={ns.size} prompt={len(prompt)} tokens, {ns.new_tokens} new tokens per request, greedy, EOS ignored")
    print(f"transformers generate (batch 1): {hf['tokens_per_s']:.1f} tok/s")
    print(f"{'concurrent':>10} {'engine tok/s':>13} {'vs HF':>7} {'steps':>6} {'ms/step':>8} {'warm-up s':>10} {'programs':>9}")
    for r in rows:
        print(f"{r['concurrency']:>10} {r['tokens_per_s']:>13.1f} {r['tokens_per_s'] / hf['tokens_per_s']:>6.2f}x "
              f"{r['decode_steps']:>6} {r['ms_per_decode_step']:>8.2f} {r['warmup_s']:>10.2f} {r['compiled_programs']:>9}")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"size": ns.size, "new_tokens": ns.new_tokens, "transformers": hf, "engine": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
