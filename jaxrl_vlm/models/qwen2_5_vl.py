"""Qwen2.5-VL (windowed vision tower + Qwen2 text decoder) in plain Flax NNX.

Semantics follow transformers' `modeling_qwen2_5_vl.py`. The text decoder (here with q/k/v biases and no q/k
norm, and contiguous M-RoPE sections, by config), the ViT attention with 2-D rotary, the patch merger (here
with an RMSNorm), attention kernels and chunked log-probs are the shared layers (`layers.py`). What is
Qwen2.5-VL's own lives here:

- patch embedding without bias and no learned position table;
- blocks with RMSNorm and a gated (SwiGLU) MLP with biases;
- window attention: blocks in `fullatt_block_indexes` attend within an image frame, the others within
  a window of `window_size` pixels. The host hands over patches already in window order with a window id
  per patch (`vision.WindowedVisionInputs`), so a window block is the same attention with other ids;
- no deepstack;
- its HF tensor names (exported under the older `model.*` / `visual.*` names, as transformers saves it) and
  its registration (`FAMILY_MODEL`; the engine runs it on the paged KV cache, `paged_kv.py`). The config and
  its parser are `config.Qwen25VLConfig` / `qwen2_5_vl_from_hf_dict`.

Logical axis names are those of `layers.py`; the q/k/v biases of the text attention are
("heads" | "kv_heads", "head_dim").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_vlm.models import paged_kv
from jaxrl_vlm.models.activation_sharding import PATCH_HIDDEN, PATCH_MLP, constrain
from jaxrl_vlm.models.config import Qwen25VLConfig
from jaxrl_vlm.models.families import FamilyModel
from jaxrl_vlm.models.hf_links import (
    Link,
    ParamPath,
    copy_link,
    dense_link,
    merger_links,
    patch_embed_links,
    stored_tensor_name,
    text_decoder_links,
    vision_attention_links,
)
from jaxrl_vlm.models.layers import (
    AttentionMask,
    PatchMerger,
    RMSNorm,
    VisionAttentionParams,
    VisionLanguageDecoder,
    activation,
    param,
    patch_mask,
    remat_runner,
    run_block,
    vision_rotary_cos_sin,
)
from jaxrl_vlm.models.remat import RematPlan
from jaxrl_vlm.models.vision import WindowedVisionInputs

_VISION_NORM_EPS = 1e-6


class VisionBlock25(VisionAttentionParams):
    """Pre-RMSNorm ViT block with a gated MLP: x + attn(norm1 x), then + down(act(gate y) * up y)."""

    def __init__(self, cfg: Qwen25VLConfig, *, rngs: nnx.Rngs, param_dtype: jnp.dtype, compute_dtype: jnp.dtype):
        v = cfg.vision
        d, f = v.hidden_size, v.intermediate_size
        self.compute_dtype = compute_dtype
        self.act_name = v.hidden_act
        self.norm1 = RMSNorm(d, _VISION_NORM_EPS, param_dtype=param_dtype)
        self.norm2 = RMSNorm(d, _VISION_NORM_EPS, param_dtype=param_dtype)
        self._init_attention(d, v.num_heads, v.head_dim, rngs, param_dtype)
        self.gate_kernel_df = param(rngs, (d, f), ("vision_embed", "vision_mlp"), param_dtype)
        self.gate_bias_f = param(None, (f,), ("vision_mlp",), param_dtype, init="zeros")
        self.up_kernel_df = param(rngs, (d, f), ("vision_embed", "vision_mlp"), param_dtype)
        self.up_bias_f = param(None, (f,), ("vision_mlp",), param_dtype, init="zeros")
        self.down_kernel_fd = param(rngs, (f, d), ("vision_mlp", "vision_embed"), param_dtype)
        self.down_bias_d = param(None, (d,), ("vision_embed",), param_dtype, init="zeros")

    def __call__(self, x_pd: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask) -> jax.Array:
        cd = self.compute_dtype
        x_pd = constrain(x_pd, PATCH_HIDDEN)
        x = x_pd + self.attend(self.norm1(x_pd), cos, sin, mask)
        y = self.norm2(x).astype(cd)
        gate = constrain(jnp.einsum("pd,df->pf", y, self.gate_kernel_df[...].astype(cd)), PATCH_MLP)
        up = constrain(jnp.einsum("pd,df->pf", y, self.up_kernel_df[...].astype(cd)), PATCH_MLP)
        hidden = activation(self.act_name)(gate + self.gate_bias_f[...].astype(cd)) * (up + self.up_bias_f[...].astype(cd))
        out = constrain(jnp.einsum("pf,fd->pd", hidden, self.down_kernel_fd[...].astype(cd)), PATCH_HIDDEN)
        return x + out + self.down_bias_d[...].astype(cd)


class VisionTower25(nnx.Module):
    """Patch embed (no bias) + windowed ViT blocks + merger.

    Returns merged image tokens [M, D_text] in window order (the host's `image_token_index` is in the same
    order) and no deepstack features. Padding patches give garbage rows that the token scatter drops.
    """

    def __init__(
        self,
        cfg: Qwen25VLConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype,
        compute_dtype: jnp.dtype,
        remat: bool | str | RematPlan = False,
        attention_impl: str = "xla",
        patch_attention_block: int | None = None,
    ):
        v = cfg.vision
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.remat = RematPlan.of(remat)
        self.attention_impl = attention_impl
        self.patch_attention_block = patch_attention_block  # bounds frames, so their windows too
        self.full_attention_blocks = frozenset(v.fullatt_block_indexes)
        self.patch_kernel_cd = param(rngs, (v.patch_dim, v.hidden_size), ("vision_patch", "vision_embed"), param_dtype)
        kw = dict(rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.blocks = nnx.List([VisionBlock25(cfg, **kw) for _ in range(v.depth)])
        self.merger = PatchMerger(cfg, postshuffle_norm=False, rms_norm=True, **kw)

    def __call__(self, vis: WindowedVisionInputs) -> tuple[jax.Array, list[jax.Array]]:
        cd = self.compute_dtype
        x = jnp.einsum("pc,cd->pd", vis.pixel_values.astype(cd), self.patch_kernel_cd[...].astype(cd))
        cos, sin = vision_rotary_cos_sin(vis.patch_rotary_pos, self.cfg.vision)
        frame_mask = patch_mask(vis.patch_segment_ids, self.attention_impl, self.patch_attention_block)
        window_mask = patch_mask(vis.patch_window_ids, self.attention_impl, self.patch_attention_block)
        run = remat_runner(run_block, self.remat.vision)
        for i, block in enumerate(self.blocks):
            x = run(block, x, cos, sin, frame_mask if i in self.full_attention_blocks else window_mask)
        return self.merger(x), []


class Qwen25VL(VisionLanguageDecoder):
    """Qwen2.5-VL for causal LM: the shared decoder with the windowed vision tower.
    `model(tokens, positions, segment_ids, vision) -> hidden [B, T, D]`; `model.logits(hidden) -> [B, T, V]`."""

    def __init__(
        self,
        cfg: Qwen25VLConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype = jnp.float32,
        compute_dtype: jnp.dtype = jnp.float32,
        remat: bool | str | RematPlan = False,
        attention_impl: str = "xla",
        patch_attention_block: int | None = None,
    ):
        """remat, attention_impl and patch_attention_block as for `Qwen3VL`."""
        super().__init__(cfg, VisionTower25, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype,
                         remat=remat, attention_impl=attention_impl, patch_attention_block=patch_attention_block)


# ----------------------------------------------------------------------------- HF tensor names


def vision_links(cfg: Qwen25VLConfig) -> list[Link]:
    """The vision tower's tensors: patch embedding, blocks (gated MLP) and merger (`ln_q`, `mlp.0`, `mlp.2`)."""
    v = cfg.vision
    vd, vf = v.hidden_size, v.intermediate_size
    out = patch_embed_links(v, bias=False)
    for i in range(v.depth):
        hf = f"model.visual.blocks.{i}."
        me: ParamPath = ("visual", "blocks", i)
        out += [
            copy_link(hf + "norm1.weight", (vd,), me + ("norm1", "scale")),
            copy_link(hf + "norm2.weight", (vd,), me + ("norm2", "scale")),
            *vision_attention_links(hf, me, v),
        ]
        for name, ours in (("gate_proj", "gate"), ("up_proj", "up")):
            out += [
                dense_link(hf + f"mlp.{name}.weight", vf, vd, me + (f"{ours}_kernel_df",)),
                copy_link(hf + f"mlp.{name}.bias", (vf,), me + (f"{ours}_bias_f",)),
            ]
        out += [
            dense_link(hf + "mlp.down_proj.weight", vd, vf, me + ("down_kernel_fd",)),
            copy_link(hf + "mlp.down_proj.bias", (vd,), me + ("down_bias_d",)),
        ]
    out += merger_links("model.visual.merger.", ("visual", "merger"), v, vd, norm="ln_q", norm_bias=False,
                         fc1="mlp.0", fc2="mlp.2")
    return out


def weight_links(cfg: Qwen25VLConfig) -> list[Link]:
    """Every tensor of `Qwen2_5_VLForConditionalGeneration` (transformers-5 names) and where it lives in `Qwen25VL`."""
    return text_decoder_links(cfg) + vision_links(cfg)


FAMILY_MODEL = FamilyModel(
    model_class=Qwen25VL,
    weight_links=weight_links,
    init_cache=paged_kv.init_cache,
    prefill=paged_kv.prefill,
    decode=paged_kv.decode,
    prefill_rows=paged_kv.prefill_rows,
    stored_tensor_name=stored_tensor_name,
)
