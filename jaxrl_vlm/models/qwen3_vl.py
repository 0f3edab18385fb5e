"""Qwen3-VL (vision tower with learned positions and deepstack mergers, Qwen3 text decoder) in plain Flax NNX.

Semantics follow transformers' `modeling_qwen3_vl.py`. The text decoder, attention, norms, ViT attention and
patch merger are the shared layers (`layers.py`); what is Qwen3-VL's own lives here:

- patch embedding with bias, and a learned square position table bilinearly resampled to each image
  (host-side taps in `vision.VisionInputs`);
- LayerNorm blocks with a two-matrix MLP (fc1, act, fc2);
- deepstack: mergers after the blocks of `deepstack_visual_indexes`, whose features are added to the hidden
  states after the first decoder layers;
- its HF tensor names, and its registration (`FAMILY_MODEL`): the engine runs it on the paged KV cache
  (`paged_kv.py`). The config and its parser are `config.Qwen3VLConfig` / `qwen3_vl_from_hf_dict`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_vlm.models import paged_kv
from jaxrl_vlm.models.activation_sharding import PATCH_HIDDEN, PATCH_MLP, constrain
from jaxrl_vlm.models.config import Qwen3VLConfig
from jaxrl_vlm.models.families import FamilyModel
from jaxrl_vlm.models.hf_links import (
    Link,
    ParamPath,
    copy_link,
    dense_link,
    merger_links,
    patch_embed_links,
    text_decoder_links,
    vision_attention_links,
)
from jaxrl_vlm.models.layers import (
    AttentionMask,
    LayerNorm,
    PatchMerger,
    VisionAttentionParams,
    VisionLanguageDecoder,
    activation,
    param,
    patch_mask,
    run_block,
    run_block_remat,
    vision_rotary_cos_sin,
)
from jaxrl_vlm.models.vision import VisionInputs


class VisionBlock(VisionAttentionParams):
    """Pre-norm ViT block; attention only among patches of the same image frame, 2-D rotary."""

    def __init__(self, cfg: Qwen3VLConfig, *, rngs: nnx.Rngs, param_dtype: jnp.dtype, compute_dtype: jnp.dtype):
        v = cfg.vision
        d, f = v.hidden_size, v.intermediate_size
        self.compute_dtype = compute_dtype
        self.act_name = v.hidden_act
        self.norm1 = LayerNorm(d, param_dtype=param_dtype)
        self.norm2 = LayerNorm(d, param_dtype=param_dtype)
        self._init_attention(d, v.num_heads, v.head_dim, rngs, param_dtype)
        self.fc1_kernel_df = param(rngs, (d, f), ("vision_embed", "vision_mlp"), param_dtype)
        self.fc1_bias_f = param(None, (f,), ("vision_mlp",), param_dtype, init="zeros")
        self.fc2_kernel_fd = param(rngs, (f, d), ("vision_mlp", "vision_embed"), param_dtype)
        self.fc2_bias_d = param(None, (d,), ("vision_embed",), param_dtype, init="zeros")

    def __call__(self, x_pd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
        cd = self.compute_dtype
        x_pd = constrain(x_pd, PATCH_HIDDEN)
        x = x_pd + self.attend(self.norm1(x_pd), cos, sin, mask)
        y = self.norm2(x).astype(cd)
        hmid = constrain(jnp.einsum("pd,df->pf", y, self.fc1_kernel_df[...].astype(cd)), PATCH_MLP)
        hmid = activation(self.act_name)(hmid + self.fc1_bias_f[...].astype(cd))
        out = constrain(jnp.einsum("pf,fd->pd", hmid, self.fc2_kernel_fd[...].astype(cd)), PATCH_HIDDEN)
        return x + out + self.fc2_bias_d[...].astype(cd)


class VisionTower(nnx.Module):
    """Patch embed + interpolated learned positions + ViT blocks + mergers.

    Returns merged image tokens [M, D_text] and one deepstack feature [M, D_text] per
    `deepstack_visual_indexes` entry (M = P / merge**2; padding patches give garbage rows that the
    token scatter drops).
    """

    def __init__(
        self,
        cfg: Qwen3VLConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype,
        compute_dtype: jnp.dtype,
        remat: bool = False,
        attention_impl: str = "xla",
        patch_attention_block: int | None = None,
    ):
        v = cfg.vision
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.remat = remat
        self.attention_impl = attention_impl
        self.patch_attention_block = patch_attention_block
        self.patch_kernel_cd = param(rngs, (v.patch_dim, v.hidden_size), ("vision_patch", "vision_embed"), param_dtype)
        self.patch_bias_d = param(None, (v.hidden_size,), ("vision_embed",), param_dtype, init="zeros")
        self.pos_embed_sd = param(rngs, (v.num_position_embeddings, v.hidden_size), ("vision_pos", "vision_embed"), param_dtype)
        kw = dict(rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.blocks = nnx.List([VisionBlock(cfg, **kw) for _ in range(v.depth)])
        self.merger = PatchMerger(cfg, postshuffle_norm=False, **kw)
        self.deepstack_mergers = nnx.List(
            [PatchMerger(cfg, postshuffle_norm=True, **kw) for _ in v.deepstack_visual_indexes]
        )


    def __call__(self, vis: VisionInputs) -> tuple[jax.Array, list[jax.Array]]:
        cd = self.compute_dtype
        x = jnp.einsum("pc,cd->pd", vis.pixel_values.astype(cd), self.patch_kernel_cd[...].astype(cd))
        x = x + self.patch_bias_d[...].astype(cd)
        table = self.pos_embed_sd[...].astype(cd)
        pos = jnp.einsum("pj,pjd->pd", vis.pos_interp_w.astype(cd), jnp.take(table, vis.pos_interp_idx, axis=0))
        x = x + pos
        cos, sin = vision_rotary_cos_sin(vis.patch_rotary_pos, self.cfg.vision)
        seg = vis.patch_segment_ids
        mask = patch_mask(seg, self.attention_impl, self.patch_attention_block)
        deepstack = []
        ds_index = {layer: j for j, layer in enumerate(self.cfg.vision.deepstack_visual_indexes)}
        run = run_block_remat if self.remat else run_block
        for i, block in enumerate(self.blocks):
            x = run(block, x, cos, sin, mask)
            if i in ds_index:
                deepstack.append(self.deepstack_mergers[ds_index[i]](x))
        return self.merger(x), deepstack


class Qwen3VL(VisionLanguageDecoder):
    """Qwen3-VL for causal LM: the shared decoder with Qwen3-VL's vision tower (learned positions, deepstack)."""

    def __init__(
        self,
        cfg: Qwen3VLConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype = jnp.float32,
        compute_dtype: jnp.dtype = jnp.float32,
        remat: bool = False,
        attention_impl: str = "xla",
        patch_attention_block: int | None = None,
    ):
        """remat: recompute each decoder layer and vision block in the backward pass (activation
        memory ~ one layer); attention_impl: "xla" (einsums, dense masks), or "pallas_gpu" / "pallas_tpu"
        (the fused segment-aware kernels of `flash_attention.py`); patch_attention_block: the most patches of
        one image frame (`rollout.processing.max_frame_patches`), which lets the XLA vision attention work
        chunk by chunk (`local_segment_attention`; None: dense)."""
        super().__init__(cfg, VisionTower, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype,
                         remat=remat, attention_impl=attention_impl, patch_attention_block=patch_attention_block)


# ----------------------------------------------------------------------------- HF tensor names


def vision_links(cfg: Qwen3VLConfig) -> list[Link]:
    """The vision tower's tensors: patch embedding, position table, blocks, merger and deepstack mergers."""
    v = cfg.vision
    vd, vf = v.hidden_size, v.intermediate_size
    out = patch_embed_links(v, bias=True)
    out.append(copy_link("model.visual.pos_embed.weight", (v.num_position_embeddings, vd), ("visual", "pos_embed_sd")))
    for i in range(v.depth):
        hf = f"model.visual.blocks.{i}."
        me: ParamPath = ("visual", "blocks", i)
        out += [
            copy_link(hf + "norm1.weight", (vd,), me + ("norm1", "scale")),
            copy_link(hf + "norm1.bias", (vd,), me + ("norm1", "bias")),
            copy_link(hf + "norm2.weight", (vd,), me + ("norm2", "scale")),
            copy_link(hf + "norm2.bias", (vd,), me + ("norm2", "bias")),
            *vision_attention_links(hf, me, v),
            dense_link(hf + "mlp.linear_fc1.weight", vf, vd, me + ("fc1_kernel_df",)),
            copy_link(hf + "mlp.linear_fc1.bias", (vf,), me + ("fc1_bias_f",)),
            dense_link(hf + "mlp.linear_fc2.weight", vd, vf, me + ("fc2_kernel_fd",)),
            copy_link(hf + "mlp.linear_fc2.bias", (vd,), me + ("fc2_bias_d",)),
        ]
    m = vd * v.merge_unit
    mergers: list[tuple[str, ParamPath, int]] = [("model.visual.merger.", ("visual", "merger"), vd)]
    mergers += [
        (f"model.visual.deepstack_merger_list.{j}.", ("visual", "deepstack_mergers", j), m)
        for j in range(len(v.deepstack_visual_indexes))
    ]
    for hf, me, norm_dim in mergers:
        out += merger_links(hf, me, v, norm_dim, norm="norm", norm_bias=True, fc1="linear_fc1", fc2="linear_fc2")
    return out


def weight_links(cfg: Qwen3VLConfig) -> list[Link]:
    """Every tensor of `Qwen3VLForConditionalGeneration` and where it lives in `Qwen3VL`."""
    return text_decoder_links(cfg) + vision_links(cfg)


FAMILY_MODEL = FamilyModel(
    model_class=Qwen3VL,
    weight_links=weight_links,
    init_cache=paged_kv.init_cache,
    prefill=paged_kv.prefill,
    decode=paged_kv.decode,
)
