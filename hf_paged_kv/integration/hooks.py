"""How hf_paged_kv plugs into a transformers model: `enable`, the forward wrapper and the
registered attention function.

`enable(model)` checks the model, binds a KVPool to its layer shapes, registers the attention
function "hf_paged_kv" (with a matching mask function) and wraps the model's `forward`:

1. the wrapper sees every forward `generate` makes. With a PagedCache in `past_key_values` it
   claims the cache for this thread (`PagedCache.claim`) before anything reads or changes its
   rows, tells the planner what it knows of the model and of the `generate` call (`_context`:
   the weights' fingerprint, whether a turn begins), has `forward_plan.plan` plan the forward
   (rows, inherited prefixes, blocks, write slots: a `ForwardPlan`), and runs the model on the
   plan's inputs (the columns it skips dropped) with its `StepPlan` active on this thread
   (`step.activate`);
2. each attention layer calls the registered `paged_attention`, which has the backend write the
   layer's new K/V into the pool and attend over the whole stored sequence;
3. when the forward returns, the cache commits (`finish_forward`); when it raises anything at
   all – KeyboardInterrupt and GeneratorExit included – the cache undoes it (`abort_forward`).

A forward with any other cache (or none) runs the model's previous attention unchanged, so an
enabled model still works with `DynamicCache`. The serving engine activates its own plans.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import sys
import time
import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import backends
from ..cache import forward_plan, history, step
from ..cache.paged_cache import PagedCache
from ..errors import NotEnabledError, PagedKVError, UnsupportedModelError
from ..pool import KVPool
from .fingerprint import InPlaceEdits, model_fingerprint
from .model_checks import REFUSED_KWARGS, check_config, probe, rope_length_limit

ATTENTION_NAME = "hf_paged_kv"  # no "flash"/"sdpa"/"paged|": those trigger special dispatch in transformers
_STATE_ATTR = "hf_paged_kv_state"
_PREVIOUS: dict[int, str] = {}  # id(a config of an enabled model) -> its attention implementation before enable
_PAGED: set[int] = set()  # id(the text config of an enabled model): the attention and masks that are paged
# how transformers composes a causal mask, with a sliding window and packed sequences: what the
# paged backends implement (any other part, such as an overlay letting image tokens attend to
# later ones, or a bidirectional mask, is refused)
_CAUSAL_MASK_PARTS = {"and_masks", "or_masks", "causal_mask_function", "sliding_window_overlay",
                      "sliding_window_causal_mask_function", "packed_sequence_mask_function", "padding_mask_function",
                      "add_offsets_to_mask_function", "blockwise_overlay"}


@dataclass
class _GenerateCall:
    """The `generate` call running on this thread with a PagedCache: its model and cache (held,
    so that no other object is taken for them) and whether the cache's turn has begun."""

    model: object
    cache: PagedCache
    begun: bool = False


# each model's in-place edits, kept across disable and enable: edited weights re-enabled must
# not take the unedited weights' fingerprint (their sample may not tell them apart)
_EDITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_CALL: contextvars.ContextVar[_GenerateCall | None] = contextvars.ContextVar("hf_paged_kv_call", default=None)


@dataclass
class EnabledState:
    pool: KVPool
    backend: object
    previous_attention: str
    original_forward: object
    original_generate: object
    config_digest: str
    fingerprint: str
    layout: dict  # weight name -> (dtype, device) at enable: a weight converted or moved later is refused
    edits: InPlaceEdits  # weights edited in place (a token of their own in the fingerprint)
    checked: float  # when the fingerprint was last taken (monotonic seconds)
    wrapped_before: tuple  # the methods of `_WRAPPED` the model had as instance attributes before enable
    rope_limit: int | None  # positions a forward may span with fixed RoPE frequencies (model_checks.rope_length_limit)


def enable(model, pool: KVPool | None = None, backend: str = "auto") -> KVPool:
    """Make `model` run its attention on paged KV and return its pool.

    Args:
        model: a decoder-only transformers model whose attention goes through transformers'
            attention interface (see the README's table of architectures).
        pool: a KVPool to use (its size and block size); default `KVPool()`. Two models may
            share one pool if their layers have the same shapes: their KV stays apart (the
            model fingerprint is part of every block hash).
        backend: "torch" (zero-copy views or gather + SDPA), "triton" (paged kernels), or
            "auto": Triton on CUDA, torch otherwise.

    Idempotent: enabling an enabled model returns its pool (passing another pool is an error).
    """
    state = getattr(model, _STATE_ATTR, None)
    if state is not None:
        if pool is not None and pool is not state.pool:
            raise PagedKVError("model is already enabled with another pool; call hf_paged_kv.disable(model) first")
        return state.pool
    check_config(model)
    if model.config._attn_implementation == ATTENTION_NAME:
        raise PagedKVError("this model's config is an enabled model's (its attention is hf_paged_kv's already): give "
                           "each model its own config object (copy.deepcopy(config))")
    pool = pool if pool is not None else KVPool()
    _register()
    previous = model.config._attn_implementation or "sdpa"
    configs = [config for config in _configs(model) if id(config) not in _PREVIOUS]  # a sub-config may be shared
    _PREVIOUS.update({id(config): config._attn_implementation or previous for config in configs})
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        layers = probe(model)  # one token through the model: which layers, what KV shapes
        backend_name = backends.choose(backend, [spec.device for spec in layers])
        config_digest = hashlib.blake2b(model.config.to_json_string(use_diff=False).encode(), digest_size=16).hexdigest()
        params = sorted(model.named_parameters())
        edits = _EDITS.setdefault(model, InPlaceEdits())  # edits made before a disable still count
        fingerprint = model_fingerprint(model, params, config_digest, edits.token(params), pool.block_size,
                                        pool.dtype or _model_dtype(model))
        layout = {name: (param.dtype, param.device) for name, param in params}
        pool.bind(layers, _model_dtype(model), fingerprint)
    except BaseException:
        model.set_attn_implementation(previous)
        _forget_configs(configs)
        raise
    _PAGED.add(id(model.config.get_text_config(decoder=True)))
    original, original_generate = model.forward, getattr(model, "generate", None)
    state = EnabledState(pool, backends.create(backend_name, pool), previous, original, original_generate,
                         config_digest, fingerprint, layout, edits, time.monotonic(),
                         tuple(name for name in _WRAPPED if name in vars(model)), rope_length_limit(model))
    setattr(model, _STATE_ATTR, state)
    model.forward = _paged_forward(model, original)
    if original_generate is not None:  # a model without `generate` counts turns by forward width
        model.generate = _turn_marking_generate(model, original_generate)
    return pool


def disable(model) -> None:
    """Undo `enable`: restore the model's forward and its previous attention implementation."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return
    for name, original in zip(_WRAPPED, (state.original_forward, state.original_generate)):
        if original is not None and getattr(vars(model).get(name), "__wrapped__", None) is original:
            if name in state.wrapped_before:
                setattr(model, name, original)
            else:
                delattr(model, name)  # the class's method shows again
    model.set_attn_implementation(state.previous_attention)
    _forget_configs(_configs(model))
    delattr(model, _STATE_ATTR)


def is_enabled(model) -> bool:
    """Whether `enable(model)` is in effect."""
    return getattr(model, _STATE_ATTR, None) is not None


def pool_of(model) -> KVPool:
    """The pool of an enabled model."""
    return state_of(model).pool


def state_of(model) -> EnabledState:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise NotEnabledError("model is not enabled; call hf_paged_kv.enable(model)")
    return state


def current_fingerprint(model, max_age: float = 0.0, look: bool = False) -> str:
    """The model's fingerprint now (or as of at most `max_age` seconds ago). Changed weights give
    a new one, and what the old weights computed is forgotten. The weights are looked up anew at
    each check, so tensors swapped in (`load_state_dict(assign=True)`, replaced or injected
    modules, resized embeddings) count as well as in-place edits. A weight converted to another
    dtype or moved to another device is refused: the pool holds KV of the old dtype and devices.
    Within `max_age` only the first weight's dtype and device are checked (one lookup); with
    `look`, every weight's identity and version counter too (no values read: a tensor swapped in
    or edited in place is seen at once, an edit through `.data` after up to `max_age`)."""
    state = state_of(model)
    _refuse_converted(state, [next(model.named_parameters())])
    if time.monotonic() - state.checked <= max_age and (not look or state.edits.unchanged(model.named_parameters())):
        return state.fingerprint
    params = sorted(model.named_parameters())
    _refuse_converted(state, params)
    fingerprint = model_fingerprint(model, params, state.config_digest, state.edits.token(params),
                                    state.pool.block_size, state.pool.dtype or _model_dtype(model))
    state.checked = time.monotonic()
    if fingerprint != state.fingerprint:
        state.pool.change_model(state.fingerprint, fingerprint)
        state.fingerprint = fingerprint
    return fingerprint


# ------------------------------------------------------------------ forward wrapper
_WRAPPED = ("forward", "generate")


def _turn_marking_generate(model, original):
    """`generate`, marking a call given a PagedCache as one turn of its conversation: assisted
    decoding's verification forwards feed several tokens each, and would otherwise each re-take
    the fingerprint and count as a turn (`_begins_turn`)."""
    @functools.wraps(original)
    def generate(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        if isinstance(cache, PagedCache) and cache.is_initialized and cache.pool is state_of(model).pool:
            ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
            history.check_continues(cache.sequences, ids, kwargs.get("attention_mask"))
        token = _CALL.set(_GenerateCall(model, cache) if isinstance(cache, PagedCache) else None)
        try:
            return original(*args, **kwargs)
        finally:
            _CALL.reset(token)

    return generate


def _begins_turn(call: _GenerateCall | None, width: int) -> bool:
    """Whether this forward begins a turn of the conversation in its cache (re-takes the
    fingerprint, counts for `pin_turns`): in the `generate` call of its model given this cache
    (`call`), its first forward; any other forward when it feeds more than one token."""
    if call is not None:
        begun, call.begun = call.begun, True
        return not begun
    return width > 1


def _generate_call(model, cache: PagedCache):
    """The `generate` call of this model given this cache that is running, if any."""
    call = _CALL.get()
    return call if call is not None and call.model is model and call.cache is cache else None


def _paged_forward(model, original):
    signature = inspect.signature(original)

    def forward(*args, **kwargs):
        if getattr(vars(model).get("forward"), "_torchdynamo_orig_callable", None) is paged:
            raise PagedKVError("the forward was compiled after hf_paged_kv.enable, which never compiles it: compile it "
                               "first, then enable (model.forward = torch.compile(model.forward); hf_paged_kv.enable(model))")
        named = _by_name(signature, args, kwargs)  # generate passes keywords; a caller may pass the mask by position
        cache = named.get("past_key_values")
        if not isinstance(cache, PagedCache):
            return original(*args, **kwargs)
        if named.get("use_cache") is False:
            raise PagedKVError("a PagedCache was passed with use_cache=False, which would bypass it; drop "
                               "past_key_values or use_cache=False")
        state = state_of(model)
        cache.claim()  # before anything reads or changes its rows: another thread's forward would see them change
        try:
            plan = forward_plan.plan(cache, state.pool, named, _context(model, original, state, cache, named))
            with step.activate(plan.step, state.backend, plan.need_weights) as active:
                output = original(**plan.inputs(named))
            active.check_written(len(state.pool.layers))
        except BaseException:
            cache.abort_forward()
            raise
        cache.finish_forward()
        return output

    untraced = torch.compiler.disable(forward)  # host bookkeeping dynamo cannot trace

    @functools.wraps(original)  # generate reads the signature (logits_to_keep support) through __wrapped__
    def paged(*args, **kwargs):
        return untraced(*args, **kwargs)

    return paged


def _by_name(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """The forward's arguments by name."""
    if not args:
        return kwargs
    bound = signature.bind_partial(*args, **kwargs).arguments
    named = {}
    for name, value in bound.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            raise PagedKVError("this forward takes *args: pass its arguments by keyword")
        named.update(value if kind is inspect.Parameter.VAR_KEYWORD else {name: value})
    return named


def _context(model, original, state: EnabledState, cache: PagedCache, kwargs: dict) -> forward_plan.Context:
    """What the planner is told of the model and of the `generate` call for this forward. Each
    new request or turn re-takes the fingerprint, so a conversation continued on changed weights
    stops sharing its KV; a decode step checks dtype and device only."""
    call = _generate_call(model, cache)
    new_turn = _begins_turn(call, forward_plan.input_shape(kwargs)[1])
    fingerprint = current_fingerprint(model, 0.0 if new_turn or not cache.is_initialized else float("inf"))
    return forward_plan.Context(original, state.backend, fingerprint, new_turn,
                                mask_extends=call is not None and not new_turn, reproducible=not model.training,
                                rope_limit=state.rope_limit, output_attentions=bool(model.config.output_attentions))


# ---------------------------------------------------------- attention and mask
def paged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                    sliding_window=None, softcap=None, **kwargs):
    """The registered attention function: writes the layer's new K/V into the pool, then
    `query` `[B, heads, T, dim]` attends to the stored sequence. Returns `([B, T, heads, dim],
    weights or None)` as transformers expects."""
    recording, current = step.probe_recording(), step.current()
    if recording is not None or (current is not None and id(module.config) in _PAGED):
        _check_no_scores(module, attention_mask)
    if recording is not None:  # enable is checking the model
        recording.record(module, key, value, kwargs)
    # another cache (or none), or a module outside the paged text model (a vision tower): its own attention
    if current is None or id(module.config) not in _PAGED:
        return _previous_attention(module)(module, query, key, value, attention_mask, dropout=dropout,
                                           scaling=scaling, sliding_window=sliding_window, softcap=softcap, **kwargs)
    for name in REFUSED_KWARGS.keys() & kwargs.keys():  # one set operation per layer call
        if kwargs[name] is not None:
            raise UnsupportedModelError(f"attention argument {name!r} ({REFUSED_KWARGS[name]}) is not supported by "
                                        "the paged backends")
    if dropout:
        raise PagedKVError("PagedCache is for inference: attention dropout must be 0 (call model.eval())")
    if key.shape[2] != query.shape[2]:
        raise UnsupportedModelError("the attention received other keys than its queries' tokens (cross-attention?); "
                                    "hf_paged_kv pages decoder self-attention only")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer, plan = module.layer_idx, current.plan
    # stored without their graph: the pool outlives the forward, and holding its autograd graph
    # would keep every grad-enabled forward's activations alive (gradients never reach stored KV)
    current.backend.write(plan, layer, *(t.detach() if t.requires_grad else t for t in (key, value)))
    current.written.add(layer)
    out, weights = current.backend.attention(query, layer, plan, scale, sliding_window, softcap,
                                             need_weights=current.need_weights, new_kv=(key, value))
    if weights is not None:
        weights = _logical_weights(weights, plan)
    return out.transpose(1, 2).contiguous(), weights


def _check_no_scores(module, attention_mask) -> None:
    """The paged backends mask by the plan: a mask the model built itself may say what the plan
    says (causal, padding: 0 and the masking minimum), never add scores of its own (Doge's dynamic mask)."""
    if torch.is_tensor(attention_mask) and attention_mask.is_floating_point() and bool(
            ((attention_mask != 0) & (attention_mask > torch.finfo(attention_mask.dtype).min / 2)).any()):
        raise UnsupportedModelError(f"{type(module).__name__} adds scores of its own to the attention (a mask with "
                                    "values other than 0 and the masking minimum), which the paged backends do not "
                                    "implement")


def _logical_weights(weights: torch.Tensor, plan) -> torch.Tensor:
    """Attention weights over stored keys, spread over logical positions (zeros at pads), as
    `DynamicCache` gives them."""
    batch, heads, width, stored = weights.shape
    index = plan.on("k_logical", weights.device)[:, None, None, :stored].expand(batch, heads, width, stored)
    logical = torch.zeros(batch, heads, width, plan.logical_length, dtype=weights.dtype, device=weights.device)
    return logical.scatter_add_(-1, index, weights)


def _previous_attention(module):
    previous = _PREVIOUS.get(id(module.config), "sdpa")
    if previous == "eager" or previous not in ALL_ATTENTION_FUNCTIONS:
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[previous]


def paged_mask(*args, config=None, **kwargs):
    """Mask function registered with the attention: a paged forward builds its own masks from
    the plan (causal, with a sliding window: any other mask is refused); any other forward, or a
    module outside the paged text model, gets the mask of its previous attention."""
    if step.current() is not None and id(config) in _PAGED:
        _check_causal(kwargs.get("mask_function"))
        return None
    previous = _PREVIOUS.get(id(config), "sdpa")
    return ALL_MASK_ATTENTION_FUNCTIONS[previous if previous in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"](
        *args, config=config, **kwargs)


def _check_causal(mask_function) -> None:
    """Refuse a mask that transformers composed with parts the paged backends do not implement
    (it composes closures: their cells hold the parts)."""
    parts, seen = [mask_function], set()
    while parts:
        part = parts.pop()
        if not callable(part) or id(part) in seen:
            continue
        seen.add(id(part))
        name = getattr(part, "__qualname__", "").split(".")[0]
        cells = [cell.cell_contents for cell in getattr(part, "__closure__", None) or ()]
        # a block overlay is a no-op where no token is in a block (-1 everywhere: a prompt without media)
        in_blocks = name == "blockwise_overlay" and any(torch.is_tensor(c) and bool((c >= 0).any()) for c in cells)
        if name not in _CAUSAL_MASK_PARTS or in_blocks:
            raise UnsupportedModelError(
                f"this forward's attention mask has a part the paged backends do not implement ({name}: a "
                "bidirectional or block overlay, such as image tokens attending to each other, or a custom mask); "
                "hf_paged_kv's attention is causal, with an optional sliding window")
        for contents in cells:
            parts.extend(contents if isinstance(contents, tuple) else [contents])


def _register() -> None:
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)


# -------------------------------------------------------------------- helpers
def _configs(model) -> list:
    """The model's config, its text config and its other sub-configs (a vision tower's, ...)."""
    config = model.config
    subs = [getattr(config, name, None) for name in getattr(config, "sub_configs", {})]
    return list({id(c): c for c in [config, config.get_text_config(decoder=True), *subs] if c is not None}.values())


def _forget_configs(configs: list) -> None:
    for config in configs:
        _PREVIOUS.pop(id(config), None)
        _PAGED.discard(id(config))


def _model_dtype(model) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _refuse_converted(state: EnabledState, params) -> None:
    """Raise if a weight known at enable now has another dtype or device (`model.to`, tensors of
    another dtype assigned): its KV would not fit the pool. Weights added since are hashed only."""
    for name, param in params:
        if state.layout.get(name, (param.dtype, param.device)) != (param.dtype, param.device):
            raise PagedKVError(
                f"the model's dtype or device changed after hf_paged_kv.enable ({name} is now {param.dtype} on "
                f"{param.device}); its pool holds {state.pool.dtype} KV. Call hf_paged_kv.disable(model), then "
                "enable it again with a new KVPool"
            )
