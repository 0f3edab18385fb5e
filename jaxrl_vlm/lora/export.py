"""LoRA exports: a PEFT adapter directory, and reading one back.

The directory is what `peft.PeftModel.from_pretrained(base, dir)` loads and what SGLang's and vLLM's LoRA loaders
read: `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules = the adapted modules' full names, so
PEFT's suffix match selects exactly them) and `adapter_model.safetensors` with
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], PEFT's own names and layout. The
modules trained in full (`--lora-modules-to-save`) are PEFT's
`modules_to_save`, their tensors stored as `base_model.model.<module>.weight`. The merged HF model is the ordinary export of the merged policy (`Trainer.policy_model()` with `models.hf_io.to_hf`);
`export_checkpoint` writes both from a run's checkpoint (`jaxrl-vlm export-lora`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxrl_vlm.distributed import barrier, gather_tree, is_main_process
from jaxrl_vlm.lora.adapters import Adapters, AdapterSite, LoraSetup

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_config(setup: LoraSetup, base_model: str | None = None) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": setup.rank,
        "lora_alpha": setup.alpha,
        "lora_dropout": setup.dropout,
        "target_modules": list(setup.modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": [m.module for m in setup.saved] or None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def _peft_shapes(site: AdapterSite, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """PEFT's shapes of a site's lora_A and lora_B: [r, in] and [out, r] for a Linear; for a convolution lora_A is a
    convolution with the layer's kernel [r, C, *kernel] and lora_B a 1x..x1 one [out, r, 1, ...]."""
    if site.conv_shape is None:
        return (rank, site.in_features), (site.out_features, rank)
    ones = (1,) * (len(site.conv_shape) - 2)
    return (rank, *site.conv_shape[1:]), (site.out_features, rank, *ones)


def peft_tensors(setup: LoraSetup, adapters: Adapters, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """PEFT's tensor names -> host arrays in `dtype` (a collective under several processes: every leaf is gathered)."""
    host = gather_tree(adapters) if jax.process_count() > 1 else jax.device_get(adapters)
    out = {}
    for site, ad in zip(setup.sites, host):
        a, b = _peft_shapes(site, setup.rank)
        out[f"{PREFIX}{site.module}.lora_A.weight"] = np.ascontiguousarray(np.asarray(ad["lora_A"]).astype(dtype).reshape(a))
        out[f"{PREFIX}{site.module}.lora_B.weight"] = np.ascontiguousarray(np.asarray(ad["lora_B"]).astype(dtype).reshape(b))
    for saved, tensors in zip(setup.saved, host[len(setup.sites):]):
        for name, _, _, _ in saved.tensors:
            out[f"{PREFIX}{saved.module}.{name}"] = np.ascontiguousarray(np.asarray(tensors[name]).astype(dtype))
    return out


def save_peft_adapter(setup: LoraSetup, adapters: Adapters, out_dir: str | os.PathLike, *, dtype: Any = np.float32,
                      base_model: str | None = None) -> Path:
    """Write the adapters as a PEFT adapter directory, atomically (a temporary sibling renamed when complete, so an
    engine never reads half a version; an existing directory is replaced). Returns it. A collective under several
    processes: every process gathers, process 0 writes."""
    out = Path(out_dir)
    tensors = peft_tensors(setup, adapters, dtype)
    if is_main_process():
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(peft_config(setup, base_model), indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    if jax.process_count() > 1:
        barrier(f"save_peft_adapter:{out}")
    return out


def load_peft_adapter(path: str | os.PathLike, setup: LoraSetup) -> Adapters:
    """Adapters of `setup` read from a PEFT adapter directory (fp32 host arrays). Raises ValueError naming the
    file and the first module that is missing, mis-shaped, or of another rank or alpha."""
    root = Path(path)
    config = json.loads((root / CONFIG_NAME).read_text())
    if int(config["r"]) != setup.rank or float(config["lora_alpha"]) != setup.alpha:
        raise ValueError(f"{root / CONFIG_NAME}: r={config['r']}, lora_alpha={config['lora_alpha']}; this run's "
                         f"adapters have r={setup.rank}, lora_alpha={setup.alpha}")
    tensors = load_file(str(root / WEIGHTS_NAME))
    out = []
    for site in setup.sites:
        pair = {}
        ours = {"lora_A": (setup.rank, site.in_features), "lora_B": (site.out_features, setup.rank)}
        for name, shape in zip(("lora_A", "lora_B"), _peft_shapes(site, setup.rank)):
            key = f"{PREFIX}{site.module}.{name}.weight"
            if key not in tensors:
                raise ValueError(f"{root / WEIGHTS_NAME}: no tensor {key}")
            if tuple(tensors[key].shape) != shape:
                raise ValueError(f"{root / WEIGHTS_NAME}: {key} has shape {tuple(tensors[key].shape)}, expected {shape}")
            pair[name] = tensors[key].astype(np.float32).reshape(ours[name])
        out.append(pair)
    for saved in setup.saved:
        whole = {}
        for name, link, _, _ in saved.tensors:
            key = f"{PREFIX}{saved.module}.{name}"
            if key not in tensors or tuple(tensors[key].shape) != tuple(link.hf_shape):
                raise ValueError(f"{root / WEIGHTS_NAME}: no tensor {key} of shape {tuple(link.hf_shape)} (modules_to_save)")
            whole[name] = tensors[key].astype(np.float32)
        out.append(whole)
    return out


def adapter_dir_bytes(path: str | os.PathLike) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
