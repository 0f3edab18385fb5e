"""Adapters: which linear layers get one, their parameters and shardings, and the weight update they make.

An adapter sits on one HF linear layer (`AdapterSite`: a `Link` whose tensor is a torch Linear weight [out, in]).
Its parameters are PEFT's, in PEFT's layout: lora_A [r, in] and lora_B [out, r], fp32 (they are what trains), and
the layer's weight becomes W + (alpha / r) * B @ A. The update is mapped to our parameters by the link's own
`to_ours` (transpose, head split, the vision tower's fused qkv split three ways), so the adapted model is the same
`Qwen3VL` / `Qwen2_5_VL` with other kernel values: the trainer, the engine and the merged export all run that one
model, and their numbers agree to the rounding of the kernels.

Why a weight update and not a second matmul path (x @ A @ B beside x @ W): the model files stay the engine's, every
mesh layout and remat keep working unchanged, and the reference policy is the base state itself. The cost is one
kernel-sized update per adapted layer inside the step (not kept: recomputed in the backward pass).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.lora.options import ALL_LINEAR, LoraOptions
from jaxrl_vlm.models.config import ModelConfig
from jaxrl_vlm.models.hf_io import abstract_model, weight_links
from jaxrl_vlm.models.hf_links import Link
from jaxrl_vlm.sharding.goldens import spec_to_json
from jaxrl_vlm.sharding.layout import abstract_mesh
from jaxrl_vlm.sharding.rules import resolve_rules, spec_with_notes

# Adapters is the trainable state: one {"lora_A": [r, in], "lora_B": [out, r]} per site, in `LoraSetup.sites` order,
# then one {"weight": ..., "bias": ...} (torch layout, the tensors it has) per module of `LoraSetup.saved`.
Adapters = list[dict[str, jax.Array]]


@dataclass(frozen=True)
class AdapterSite:
    """One adapted linear layer: its HF module name (PEFT's target), torch sizes, the link that maps a torch-layout
    weight update onto our parameters, and our (first) kernel's shape and logical names, whose leading `split` dims
    are the input: the adapters shard as that kernel does."""

    module: str
    in_features: int
    out_features: int
    link: Link
    kernel_shape: tuple[int, ...]
    kernel_names: tuple[str | None, ...]
    split: int
    # A convolution (the vision patch embedding, a torch Conv3d [out, C, T, P, P]) adapted as the linear map it is
    # (stride = kernel): its torch weight's shape; None for a Linear. PEFT's conv LoRA is the same update.
    conv_shape: tuple[int, ...] | None = None

    @property
    def vision(self) -> bool:
        return self.module.startswith("model.visual.")

    def torch_shaped(self, update: jax.Array) -> jax.Array:
        """A [out, in] update in the shape of the torch weight it adds to."""
        return update if self.conv_shape is None else update.reshape(self.conv_shape)


@dataclass(frozen=True)
class SavedModule:
    """A module trained in full beside the adapters (PEFT's modules_to_save): its tensors' links by tensor name
    ("weight", "bias"), each a plain copy onto one of our parameters, with that parameter's shape and logical names."""

    module: str
    tensors: tuple[tuple[str, Link, tuple[int, ...], tuple[str | None, ...]], ...]


@dataclass(frozen=True)
class LoraSetup:
    """The adapters of a run (static: part of the compiled step's configuration)."""

    sites: tuple[AdapterSite, ...]
    rank: int
    alpha: float
    dropout: float = 0.0
    saved: tuple[SavedModule, ...] = ()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(s.module for s in self.sites)


def _is_linear(link: Link) -> bool:
    """A torch Linear weight: 2-D, ".weight", and every one of our parameters it feeds is a matmul kernel (not the
    embedding, the LM head, a position table or the patch-embedding convolution)."""
    if not link.hf_key.endswith(".weight") or len(link.hf_shape) != 2:
        return False
    leaves = [str(p[-1]) for p in link.ours]
    return all("_kernel_" in leaf and not leaf.startswith("patch_") for leaf in leaves)


def _is_patch_conv(link: Link) -> bool:
    """The vision patch embedding's convolution weight: adapted only when named (it is not a linear layer)."""
    leaves = [str(p[-1]) for p in link.ours]
    return link.hf_key.endswith(".weight") and len(link.hf_shape) > 2 and len(leaves) == 1 and \
        leaves[0].startswith("patch_kernel")


def _matches(module: str, targets: Sequence[str]) -> bool:
    """PEFT's rule for a list of target names: the full module name or a '.'-suffix of it."""
    return any(module == t or module.endswith("." + t) for t in targets)


def linear_modules(cfg: ModelConfig) -> list[str]:
    """HF module names of every linear layer an adapter can sit on."""
    return [link.hf_key[: -len(".weight")] for link in weight_links(cfg) if _is_linear(link)]


def adapter_sites(cfg: ModelConfig, params: nnx.State, options: LoraOptions) -> tuple[AdapterSite, ...]:
    """The sites `options` select in the model of `cfg` (`params`: its parameter state, real or abstract, for the
    logical axis names). Raises ConfigError when a target name matches nothing."""
    targets = list(options.lora_target_modules)
    if not targets:
        raise ConfigError("--lora-target-modules is empty: name at least one linear layer, or all-linear")
    all_linear = ALL_LINEAR in targets
    names = [t for t in targets if t != ALL_LINEAR]
    flat = dict(nnx.to_flat_state(params))
    sites, matched = [], set()
    for link in weight_links(cfg):
        conv = _is_patch_conv(link)
        if not (_is_linear(link) or conv):
            continue
        module = link.hf_key[: -len(".weight")]
        site_is_vision = module.startswith("model.visual.")
        if site_is_vision and not options.lora_vision:
            continue
        hit = [t for t in names if _matches(module, [t])]
        matched.update(hit)
        if not ((all_linear and not conv) or hit):
            continue
        out_features, in_features = link.hf_shape[0], math.prod(link.hf_shape[1:])
        var = flat[link.ours[0]]
        shape = tuple(var.get_value().shape)
        logical = tuple(var.get_metadata().get("out_sharding") or (None,) * len(shape))
        split = next((k for k in range(1, len(shape)) if math.prod(shape[:k]) == in_features), None)
        if split is None:
            raise ValueError(f"{link.hf_key}: our kernel {shape} has no leading dims of the torch input size {in_features}")
        sites.append(AdapterSite(module, in_features, out_features, link, shape, logical, split,
                                 tuple(link.hf_shape) if conv else None))
    unknown = sorted(set(names) - matched)
    if unknown:
        scope = "" if options.lora_vision else " of the text decoder (the vision tower needs --lora-vision)"
        leaves = sorted({m.rsplit(".", 1)[-1] for m in linear_modules(cfg)})
        raise ConfigError(f"--lora-target-modules {unknown} match no linear layer{scope}; the model's linear layers "
                          f"are named {leaves}")
    if not sites:
        raise ConfigError("--lora-target-modules select no linear layer")
    return tuple(sites)


def saved_modules(cfg: ModelConfig, params: nnx.State, names: Sequence[str]) -> tuple[SavedModule, ...]:
    """The modules `names` select (PEFT's matching), with their ".weight" / ".bias" tensors; ConfigError for a name
    that matches no module, or a module that is a linear layer's adapter target too."""
    flat = dict(nnx.to_flat_state(params))
    by_module: dict[str, list] = {}
    for link in weight_links(cfg):
        module, _, tensor = link.hf_key.rpartition(".")
        if tensor in ("weight", "bias") and len(link.ours) == 1 and _matches(module, names):
            var = flat[link.ours[0]]
            shape = tuple(var.get_value().shape)
            logical = tuple(var.get_metadata().get("out_sharding") or (None,) * len(shape))
            by_module.setdefault(module, []).append((tensor, link, shape, logical))
    unknown = [n for n in names if not any(_matches(m, [n]) for m in by_module)]
    if unknown:
        raise ConfigError(f"--lora-modules-to-save {unknown} match no module of the model")
    return tuple(SavedModule(m, tuple(t)) for m, t in by_module.items())


def lora_setup(cfg: ModelConfig, params: nnx.State, options: LoraOptions) -> LoraSetup:
    sites = adapter_sites(cfg, params, options)
    saved = saved_modules(cfg, params, list(options.lora_modules_to_save))
    both = {s.module for s in sites} & {m.module for m in saved}
    if both:
        raise ConfigError(f"{sorted(both)} are both adapter targets and --lora-modules-to-save: choose one")
    return LoraSetup(sites, options.lora_rank, float(options.lora_alpha), float(options.lora_dropout), saved)


def init_adapters(setup: LoraSetup, key: jax.Array, base: nnx.State | None = None) -> Adapters:
    """PEFT's initialization: lora_A uniform in +-1/sqrt(in) (kaiming-uniform with a = sqrt(5)), lora_B zero, so
    the adapted model starts as the base; saved modules start as their `base` tensors (fp32)."""
    out = []
    for i, site in enumerate(setup.sites):
        bound = 1.0 / math.sqrt(site.in_features)
        a = jax.random.uniform(jax.random.fold_in(key, i), (setup.rank, site.in_features), jnp.float32, -bound, bound)
        out.append({"lora_A": a, "lora_B": jnp.zeros((site.out_features, setup.rank), jnp.float32)})
    if setup.saved and base is None:
        raise ValueError("init_adapters: the saved modules start from the base parameters; pass `base`")
    flat = dict(nnx.to_flat_state(base)) if setup.saved else {}
    for saved in setup.saved:
        out.append({name: jnp.asarray(link.to_hf([flat[link.ours[0]].get_value()]), jnp.float32)
                    for name, link, _, _ in saved.tensors})
    return out


def abstract_adapters(setup: LoraSetup) -> Adapters:
    return [{"lora_A": jax.ShapeDtypeStruct((setup.rank, s.in_features), jnp.float32),
             "lora_B": jax.ShapeDtypeStruct((s.out_features, setup.rank), jnp.float32)} for s in setup.sites] + [
        {name: jax.ShapeDtypeStruct(link.hf_shape, jnp.float32) for name, link, _, _ in m.tensors} for m in setup.saved]


def adapter_specs(setup: LoraSetup, rules: Any, mesh: Any) -> list[dict[str, jax.sharding.PartitionSpec]]:
    """PartitionSpecs of the adapters: lora_A's input dimension shards as the kernel's (first) input dimension
    does, lora_B's output as its first output dimension (a flattened [heads * head_dim] splits by heads, as the
    kernel's heads do); the rank dimension is never split (it is tiny)."""
    out = []
    for s in setup.sites:
        kernel, _ = spec_with_notes(s.kernel_names, s.kernel_shape, rules, mesh)
        entries = tuple(kernel) + (None,) * (len(s.kernel_shape) - len(kernel))
        a = jax.sharding.PartitionSpec(None, entries[0])
        b = jax.sharding.PartitionSpec(entries[s.split]) if entries[s.split] is not None else jax.sharding.PartitionSpec()
        out.append({"lora_A": a, "lora_B": b})
    for m in setup.saved:  # a copy of one parameter: sharded as it is
        out.append({name: spec_with_notes(names, shape, rules, mesh)[0] for name, _, shape, names in m.tensors})
    return out


def adapter_shardings(setup: LoraSetup, mesh: jax.sharding.Mesh, rules: Any) -> list[dict[str, jax.sharding.NamedSharding]]:
    return jax.tree.map(lambda spec: jax.sharding.NamedSharding(mesh, spec), adapter_specs(setup, rules, mesh),
                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def with_rank_dropout(adapters: Adapters, setup: LoraSetup, key: jax.Array) -> Adapters:
    """The adapters with each rank component of each site dropped with probability `setup.dropout` (lora_A's row
    zeroed, survivors scaled by 1/(1-p)); unchanged when the dropout is 0."""
    if setup.dropout == 0.0:
        return adapters
    keep = 1.0 - setup.dropout
    out = []
    for i, ad in enumerate(adapters[: len(setup.sites)]):
        mask = jax.random.bernoulli(jax.random.fold_in(key, i), keep, (setup.rank, 1)).astype(ad["lora_A"].dtype)
        out.append({"lora_A": ad["lora_A"] * mask / keep, "lora_B": ad["lora_B"]})
    return out + list(adapters[len(setup.sites):])


def torch_update(site_adapter: dict[str, jax.Array], scale: float) -> jax.Array:
    """The torch-layout weight update [out, in] = scale * B @ A, fp32."""
    b = site_adapter["lora_B"].astype(jnp.float32)
    a = site_adapter["lora_A"].astype(jnp.float32)
    return scale * jnp.matmul(b, a, precision=jax.lax.Precision.HIGHEST)


def merged_params(base: nnx.State, adapters: Adapters, setup: LoraSetup) -> nnx.State:
    """`base` with every adapted kernel replaced by (kernel + update), computed in fp32 and stored in the kernel's
    dtype, and every saved module's tensors replaced by the trained ones. Pure and traceable: inside a compiled step
    only `adapters` get gradients."""
    flat = list(nnx.to_flat_state(base))
    index = {path: i for i, (path, _) in enumerate(flat)}
    values = [var.get_value() for _, var in flat]
    for site, adapter in zip(setup.sites, adapters):
        parts = site.link.to_ours(site.torch_shaped(torch_update(adapter, setup.scale)))
        for path, part in zip(site.link.ours, parts):
            i = index[path]
            w = values[i]
            values[i] = (w.astype(jnp.float32) + part).astype(w.dtype)
    for saved, tensors in zip(setup.saved, adapters[len(setup.sites):]):
        for name, link, _, _ in saved.tensors:
            (part,) = link.to_ours(tensors[name])
            i = index[link.ours[0]]
            values[i] = part.astype(values[i].dtype)
    return nnx.from_flat_state([(path, var.replace(v)) for (path, var), v in zip(flat, values)])


def adapter_nbytes(adapters: Any, dtype: Any = None) -> int:
    """Bytes of the adapters, or of any array tree (in `dtype`, default their own): what a weight sync moves."""
    return sum(int(np.prod(x.shape)) * (jnp.dtype(dtype).itemsize if dtype is not None else x.dtype.itemsize)
               for x in jax.tree.leaves(adapters))


@dataclass(frozen=True)
class PolicyAdapters:
    """The adapters a merged policy model was made from (a copy: the train step donates its own buffers)."""

    setup: LoraSetup
    adapters: Adapters


# A merged model (`Trainer.policy_model`) -> its adapters. The run loops hand the weight syncer a model; this lets
# the syncer move only the adapters to an engine that serves them, without a second argument on every path.
_ADAPTERS_OF: "weakref.WeakKeyDictionary[Any, PolicyAdapters]" = weakref.WeakKeyDictionary()


def attach_adapters(model: Any, adapters: PolicyAdapters) -> Any:
    """Record that `model` is the base merged with `adapters`; returns `model`."""
    _ADAPTERS_OF[model] = adapters
    return model


def adapters_of(model: Any) -> PolicyAdapters | None:
    """The adapters `model` was merged from (`attach_adapters`), or None: a plain, fully trained model."""
    return _ADAPTERS_OF.get(model)


def adapter_layouts(model_cfg: ModelConfig, mesh_cfg: Any, options: LoraOptions, num_devices: int = 8) -> dict[str, Any]:
    """JSON-able layout of every adapter of `model_cfg` under the mesh layout `mesh_cfg` (an abstract mesh of
    `num_devices`): shapes and specs of lora_A and lora_B, and the specs of the adapted kernel's input and output
    dimensions they follow. Checked in as goldens (tests/goldens/lora/) like the parameters' own."""
    mesh = abstract_mesh(mesh_cfg, num_devices)
    rules = resolve_rules(mesh_cfg.sharding_rules)
    params = nnx.state(abstract_model(model_cfg), nnx.Param)
    setup = lora_setup(model_cfg, params, options)
    out: dict[str, Any] = {}
    for site, specs in zip(setup.sites, adapter_specs(setup, rules, mesh)):
        kernel = spec_to_json(spec_with_notes(site.kernel_names, site.kernel_shape, rules, mesh)[0], len(site.kernel_shape))
        out[site.module] = {
            "lora_A": {"shape": [setup.rank, site.in_features], "spec": spec_to_json(specs["lora_A"], 2)},
            "lora_B": {"shape": [site.out_features, setup.rank], "spec": spec_to_json(specs["lora_B"], 2)},
            "kernel_in_spec": kernel[0],
            "kernel_out_spec": kernel[site.split],
        }
    return {"num_devices": num_devices, "mesh": dict(mesh.shape), "rank": setup.rank, "adapters": out}

