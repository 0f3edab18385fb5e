"""HF tensor names of the Qwen-VL families, and how each maps to our parameters (numpy only).

A `Link` ties one HF tensor (transformers 5's name and torch layout) to one or more of our parameters
(their paths in the model state) with the two layout conversions; `hf_io` reads and writes checkpoints
through a family's list of links (`FamilyModel.weight_links`). The helpers here are what the families
share: torch Linear and head layouts, the text decoder, patch embedding, ViT attention and patch merger.
A family file composes its own list from them.

Names: transformers 5 saves `model.language_model.*` and `model.visual.*`; released Qwen2.5-VL (and what
transformers 5 still saves for it) use the older `model.*` / `visual.*` (`current_tensor_name`,
`stored_tensor_name`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from jaxrl_vlm.models.config import ModelConfig

ParamPath = tuple[str | int, ...]


def current_tensor_name(key: str) -> str:
    """transformers-5 name of a tensor stored under the older Qwen-VL layout (released Qwen2.5-VL):
    `model.X` -> `model.language_model.X`, `visual.X` -> `model.visual.X`; other names unchanged."""
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + key[len("model."):]
    return key


def stored_tensor_name(key: str) -> str:
    """The older layout's name of a transformers-5 tensor name (inverse of `current_tensor_name`). transformers
    still saves Qwen2.5-VL this way, as released checkpoints are, so our Qwen2.5-VL exports do too."""
    if key.startswith("model.visual."):
        return key[len("model."):]
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    return key


@dataclass(frozen=True)
class SplitLayout:
    """A tensor that a checkpoint may store as several tensors instead (transformers' `save_pretrained` writes
    Qwen3.5-MoE's fused experts one tensor per expert and reads either form back).

    keys / shapes: the stored tensors, in the order `join` takes them; join: those arrays -> the tensor in its
    `Link.hf_shape` layout (a copy: the parts live in different places of the file)."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    join: Callable[[Sequence[np.ndarray]], np.ndarray]


@dataclass(frozen=True)
class Link:
    """One HF tensor <-> one or more of our parameters.

    to_ours maps the torch-layout array to our arrays (numpy views when possible);
    to_hf maps our arrays back to the torch layout.
    stored_layouts: other layouts a checkpoint may hold the tensor in, as (stored shape, view of it in the
    `hf_shape` layout), which transformers converts alike at load time (released Qwen3-VL-MoE stores its expert
    tensors transposed); a shape equal to `hf_shape` is read as `hf_shape`'s layout, as transformers does.
    stored_splits: other ways a checkpoint may hold the tensor as several tensors (`SplitLayout`), read when
    `hf_key` itself is absent. Export always writes `hf_key`.
    """

    hf_key: str
    hf_shape: tuple[int, ...]
    ours: tuple[ParamPath, ...]
    to_ours: Callable[[np.ndarray], Sequence[np.ndarray]]
    to_hf: Callable[[Sequence[np.ndarray]], np.ndarray]
    stored_layouts: tuple[tuple[tuple[int, ...], Callable[[np.ndarray], np.ndarray]], ...] = ()
    stored_splits: tuple[SplitLayout, ...] = ()

    def canonical(self, stored: np.ndarray) -> np.ndarray:
        """`stored` (as read from a checkpoint) in the `hf_shape` layout."""
        if tuple(stored.shape) == self.hf_shape:
            return stored
        return dict(self.stored_layouts)[tuple(stored.shape)](stored)


def per_expert_split(prefix: str, projections: Sequence[str], num_experts: int, shape: tuple[int, ...]) -> SplitLayout:
    """The per-expert form of a stacked expert tensor: `{prefix}{e}.{proj}.weight` of `shape` (torch Linear
    [out, in]) for each projection in `projections` and expert e; joined as [E, *shape] per projection,
    concatenated along dim 1 (gate rows then up rows for a fused gate_up tensor)."""
    keys = tuple(f"{prefix}{e}.{proj}.weight" for proj in projections for e in range(num_experts))
    n = len(projections)

    def join(parts: Sequence[np.ndarray]) -> np.ndarray:
        stacks = [np.stack(parts[j * num_experts : (j + 1) * num_experts]) for j in range(n)]
        return stacks[0] if n == 1 else np.concatenate(stacks, axis=1)

    return SplitLayout(keys, (tuple(shape),) * len(keys), join)


def copy_link(key: str, shape: tuple[int, ...], path: ParamPath) -> Link:
    return Link(key, shape, (path,), lambda w: (w,), lambda xs: xs[0])


def dense_link(key: str, out_dim: int, in_dim: int, path: ParamPath) -> Link:
    """torch Linear weight [out, in] <-> our kernel [in, out]."""
    return Link(key, (out_dim, in_dim), (path,), lambda w: (w.T,), lambda xs: xs[0].T)


def heads_in_link(key: str, n: int, h: int, d: int, path: ParamPath) -> Link:
    """torch [n*h, d] <-> ours [d, n, h] (q/k/v projections)."""
    return Link(
        key,
        (n * h, d),
        (path,),
        lambda w: (w.reshape(n, h, d).transpose(2, 0, 1),),
        lambda xs: xs[0].transpose(1, 2, 0).reshape(n * h, d),
    )


def heads_out_link(key: str, n: int, h: int, d: int, path: ParamPath) -> Link:
    """torch [d, n*h] <-> ours [n, h, d] (attention output projection)."""
    return Link(
        key,
        (d, n * h),
        (path,),
        lambda w: (w.reshape(d, n, h).transpose(1, 2, 0),),
        lambda xs: xs[0].transpose(2, 0, 1).reshape(d, n * h),
    )


def text_decoder_links(cfg: ModelConfig) -> list[Link]:
    """The text decoder's tensors (shared by the families; q/k/v biases and q/k norms as the config says)."""
    t = cfg.text
    d, n, kv, h, f = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.intermediate_size
    out: list[Link] = [copy_link("model.language_model.embed_tokens.weight", (t.vocab_size, d), ("embed_vd",))]
    for i in range(t.num_hidden_layers):
        hf = f"model.language_model.layers.{i}."
        me: ParamPath = ("layers", i)
        out += [
            heads_in_link(hf + "self_attn.q_proj.weight", n, h, d, me + ("attn", "q_kernel_dnh")),
            heads_in_link(hf + "self_attn.k_proj.weight", kv, h, d, me + ("attn", "k_kernel_dkh")),
            heads_in_link(hf + "self_attn.v_proj.weight", kv, h, d, me + ("attn", "v_kernel_dkh")),
            heads_out_link(hf + "self_attn.o_proj.weight", n, h, d, me + ("attn", "o_kernel_nhd")),
        ]
        if t.attention_bias:
            out += [
                split_heads_link(hf + "self_attn.q_proj.bias", n, h, me + ("attn", "q_bias_nh")),
                split_heads_link(hf + "self_attn.k_proj.bias", kv, h, me + ("attn", "k_bias_kh")),
                split_heads_link(hf + "self_attn.v_proj.bias", kv, h, me + ("attn", "v_bias_kh")),
            ]
        if t.qk_norm:
            out += [
                copy_link(hf + "self_attn.q_norm.weight", (h,), me + ("attn", "q_norm", "scale")),
                copy_link(hf + "self_attn.k_norm.weight", (h,), me + ("attn", "k_norm", "scale")),
            ]
        out += [
            dense_link(hf + "mlp.gate_proj.weight", f, d, me + ("mlp", "gate_kernel_df")),
            dense_link(hf + "mlp.up_proj.weight", f, d, me + ("mlp", "up_kernel_df")),
            dense_link(hf + "mlp.down_proj.weight", d, f, me + ("mlp", "down_kernel_fd")),
            copy_link(hf + "input_layernorm.weight", (d,), me + ("input_norm", "scale")),
            copy_link(hf + "post_attention_layernorm.weight", (d,), me + ("post_attn_norm", "scale")),
        ]
    out.append(copy_link("model.language_model.norm.weight", (d,), ("final_norm", "scale")))
    if not cfg.tie_word_embeddings:
        out.append(dense_link("lm_head.weight", t.vocab_size, d, ("lm_head_dv",)))
    return out


def split_heads_link(key: str, n: int, h: int, path: ParamPath) -> Link:
    """torch bias [n*h] <-> ours [n, h]."""
    return Link(key, (n * h,), (path,), lambda b: (b.reshape(n, h),), lambda xs: xs[0].reshape(n * h))


def patch_embed_links(v: Any, *, bias: bool) -> list[Link]:
    vd, p = v.hidden_size, v.patch_size
    conv_shape = (vd, v.in_channels, v.temporal_patch_size, p, p)
    out = [
        Link(
            "model.visual.patch_embed.proj.weight",
            conv_shape,
            (("visual", "patch_kernel_cd"),),
            lambda w: (w.reshape(vd, -1).T,),
            lambda xs: xs[0].T.reshape(conv_shape),
        )
    ]
    if bias:
        out.append(copy_link("model.visual.patch_embed.proj.bias", (vd,), ("visual", "patch_bias_d")))
    return out


def vision_attention_links(hf: str, me: ParamPath, v: Any) -> list[Link]:
    """A ViT block's fused qkv and output projection (`VisionAttentionParams`), shared by the families."""
    vd, vn, vh = v.hidden_size, v.num_heads, v.head_dim
    return [
        Link(
            hf + "attn.qkv.weight",
            (3 * vd, vd),
            (me + ("q_kernel_dnh",), me + ("k_kernel_dnh",), me + ("v_kernel_dnh",)),
            lambda w: tuple(w.reshape(3, vn, vh, vd)[j].transpose(2, 0, 1) for j in range(3)),
            lambda xs: np.stack([x.transpose(1, 2, 0) for x in xs]).reshape(3 * vd, vd),
        ),
        Link(
            hf + "attn.qkv.bias",
            (3 * vd,),
            (me + ("q_bias_nh",), me + ("k_bias_nh",), me + ("v_bias_nh",)),
            lambda b: tuple(b.reshape(3, vn, vh)[j] for j in range(3)),
            lambda xs: np.stack(list(xs)).reshape(3 * vd),
        ),
        heads_out_link(hf + "attn.proj.weight", vn, vh, vd, me + ("o_kernel_nhd",)),
        copy_link(hf + "attn.proj.bias", (vd,), me + ("o_bias_d",)),
    ]


def merger_links(hf: str, me: ParamPath, v: Any, norm_dim: int, *, norm: str, norm_bias: bool, fc1: str, fc2: str) -> list[Link]:
    m = v.hidden_size * v.merge_unit
    out = [copy_link(hf + norm + ".weight", (norm_dim,), me + ("norm", "scale"))]
    if norm_bias:
        out.append(copy_link(hf + norm + ".bias", (norm_dim,), me + ("norm", "bias")))
    return out + [
        dense_link(hf + fc1 + ".weight", m, m, me + ("fc1_kernel_mf",)),
        copy_link(hf + fc1 + ".bias", (m,), me + ("fc1_bias_f",)),
        dense_link(hf + fc2 + ".weight", v.out_hidden_size, m, me + ("fc2_kernel_fd",)),
        copy_link(hf + fc2 + ".bias", (v.out_hidden_size,), me + ("fc2_bias_d",)),
    ]


def learned_position_vision_links(cfg: Any) -> list[Link]:
    """The tensors of `layers.LearnedPositionVisionTower` under transformers' Qwen3-VL names (Qwen3-VL, Qwen3.5):
    patch embedding, position table, blocks, merger and the deepstack mergers, if any."""
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
