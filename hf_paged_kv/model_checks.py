"""Which models hf_paged_kv can page, and the shape of their KV.

A model qualifies when it is decoder-only and every attention layer goes through transformers'
attention interface with a `layer_idx`: the registered attention function then sees every
layer's queries, keys and values. What the paged backends reproduce exactly: full causal
attention, sliding windows, grouped-query heads and attention-logit soft-capping. The rest is
refused here, at `enable`, with the reason.
"""

from __future__ import annotations

from .errors import UnsupportedModelError
from .pool import LayerSpec

SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}


def layer_specs(model) -> list[LayerSpec]:
    """One LayerSpec per attention layer, or UnsupportedModelError saying why not."""
    config = model.config.get_text_config(decoder=True)
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError("encoder-decoder models are not supported: PagedCache is for decoder-only models")
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} does not use transformers' attention interface, so its attention cannot be paged"
        )
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not kinds <= SUPPORTED_LAYER_TYPES:
        raise UnsupportedModelError(f"layer types {sorted(kinds)} are not supported (only full and sliding attention)")
    attention = {}
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int):
            if getattr(module, "is_cross_attention", False):
                raise UnsupportedModelError("cross-attention is not supported")
            attention[module.layer_idx] = module
    if sorted(attention) != list(range(config.num_hidden_layers)):
        raise UnsupportedModelError(
            f"found attention modules for layers {sorted(attention)}, expected 0..{config.num_hidden_layers - 1}"
        )
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return [
        LayerSpec(kv_heads, attention[i].head_dim, next(attention[i].parameters()).device)
        for i in range(config.num_hidden_layers)
    ]
