"""Which models hf_paged_kv can page, and the shape of their KV.

A model qualifies when it is decoder-only, keeps nothing but keys and values in its cache, and
calls transformers' attention interface exactly once per layer with that layer's `layer_idx`:
then the registered attention function sees every layer's queries, keys and values. What the
paged backends reproduce exactly: causal attention, sliding windows, grouped-query heads and
attention-logit soft-capping.

Rather than trusting attribute names (`head_dim`, `head_size`, `attention_head_size`) and flags
(`_supports_attention_backend`, absent on some models that do call the interface), `enable`
runs one token through the model with a recorder in place of attention (`probe`): the layers it
saw and the shapes of their keys and values decide. Everything else is refused here, with the
reason, before a block is allocated.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..cache import step
from ..errors import UnsupportedModelError
from ..pool import LayerSpec

SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
REFUSED_KWARGS = {
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "a relative position bias",
    "indices": "sparse (top-k) attention",
    "block_indices": "block-sparse attention",
}


@dataclass
class Recording:
    """What the attention interface received during the probe forward."""

    calls: dict = field(default_factory=lambda: defaultdict(list))  # layer_idx -> [(key shape, value shape, device)]
    kwargs: set = field(default_factory=set)  # names of the non-None extra arguments

    def record(self, module, key: torch.Tensor, value: torch.Tensor, kwargs: dict) -> None:
        self.calls[getattr(module, "layer_idx", None)].append((tuple(key.shape), tuple(value.shape), key.device))
        self.kwargs |= {name for name, value in kwargs.items() if value is not None}


def check_config(model) -> None:
    """What the config alone rules out."""
    config = model.config.get_text_config(decoder=True)
    seq2seq = getattr(model.config, "is_encoder_decoder", False) or getattr(type(model.config)(), "is_encoder_decoder",
                                                                           False)  # a seq2seq model's decoder alone
    cross = getattr(config, "add_cross_attention", False) or any(
        getattr(m, "is_cross_attention", False) or name.endswith(("encoder_attn", "crossattention"))
        for name, m in model.named_modules())
    if seq2seq or cross:
        raise UnsupportedModelError("encoder-decoder models and cross-attention are not supported: PagedCache is for "
                                    "decoder-only models")
    # ("vision": image tokens attend to each other, which a forward with an image is refused for: integration._check_causal)
    if getattr(config, "is_causal", True) is False or getattr(config, "use_bidirectional_attention", None) in (True, "all"):
        raise UnsupportedModelError("bidirectional attention is not supported: the paged backends attend causally, "
                                    "each token to the ones before it")
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not kinds <= SUPPORTED_LAYER_TYPES:
        raise UnsupportedModelError(
            f"layer types {sorted(kinds - SUPPORTED_LAYER_TYPES)} are not supported: only full and sliding attention "
            "(hybrid models keep recurrent or convolution state that a KV cache cannot hold)"
        )


def rope_length_limit(model) -> int | None:
    """How many positions a forward may span with fixed RoPE frequencies; None where they never
    change. With "dynamic" NTK scaling or Phi-3's "longrope", transformers picks the frequencies
    from the forward's largest position once it reaches the original context (for "dynamic",
    also from earlier forwards), so a key computed in one forward differs from the same key
    computed in another: such K/V must not be shared. Conservative where configs differ: the
    smaller of the original and the model's context."""
    config = model.config.get_text_config(decoder=True)
    parameters = getattr(config, "rope_parameters", None) or {}
    per_layer_type = all(isinstance(value, dict) for value in parameters.values()) and parameters
    context = getattr(config, "max_position_embeddings", None)
    limits = [min(p for p in (kind.get("original_max_position_embeddings"),
                              getattr(config, "original_max_position_embeddings", None), context) if p)
              for kind in (parameters.values() if per_layer_type else [parameters])
              if "dynamic" in kind.get("rope_type", "default") or kind.get("rope_type") == "longrope"]
    return min(limits) if limits else None


def probe(model) -> list[LayerSpec]:
    """Run one token through `model` (whose attention implementation is already hf_paged_kv's)
    and return one LayerSpec per layer, or UnsupportedModelError saying why not."""
    check_config(model)
    config = model.config.get_text_config(decoder=True)
    bos = getattr(config, "bos_token_id", None)  # 5.x configs hold only the token ids they declare
    token = bos if isinstance(bos, int) else 0
    device = model.get_input_embeddings().weight.device
    recording = Recording()
    with torch.no_grad(), step.probing(recording):
        try:
            model(input_ids=torch.tensor([[token]], device=device), use_cache=False)
        except UnsupportedModelError:
            raise
        except Exception as error:  # a model this check cannot even run
            raise UnsupportedModelError(f"{type(model).__name__} could not run a one-token forward: {error}") from error
    return _layer_specs(model, config, recording)


def _layer_specs(model, config, recording: Recording) -> list[LayerSpec]:
    name, calls = type(model).__name__, recording.calls
    if not calls:
        raise UnsupportedModelError(f"{name} does not use transformers' attention interface (its attention is "
                                    "written inside the model), so its attention cannot be paged")
    refused = sorted({reason for kwarg, reason in REFUSED_KWARGS.items() if kwarg in recording.kwargs})
    if refused:
        raise UnsupportedModelError(f"{name} uses {', '.join(refused)}, which the paged backends do not implement")
    layers = list(range(config.num_hidden_layers))
    if sorted(calls, key=lambda i: (i is None, i)) != layers:
        raise UnsupportedModelError(
            f"{name} calls attention for layer indices {sorted(calls, key=str)}, not once for each of its "
            f"{len(layers)} layers (hybrid layers, shared or re-used attention blocks)")
    for layer, seen in calls.items():
        if len(seen) != 1:
            raise UnsupportedModelError(f"{name} calls attention {len(seen)} times in layer {layer}; "
                                        "hf_paged_kv needs one call per layer")
        (key_shape, value_shape, _), = seen
        if key_shape[1] != value_shape[1] or key_shape[-1] != value_shape[-1]:
            raise UnsupportedModelError(f"{name} has keys {key_shape} and values {value_shape} of different shapes "
                                        "(multi-head latent attention); the pool stores both in one layout")
    return [LayerSpec(calls[i][0][0][1], calls[i][0][0][-1], calls[i][0][2]) for i in layers]
