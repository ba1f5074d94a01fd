"""Plugging the paged cache into a transformers model: `enable`, `disable`, hooks and the attention function.

    >>> pool = hf_paged_kv.enable(model)      # registers the backend, installs hooks, builds the pool
    >>> model.generate(**inputs, past_key_values=PagedCache())
    >>> hf_paged_kv.disable(model)            # back to the model's previous attention

How one forward runs on an enabled model:
1. the forward pre-hook sees `input_ids`, `attention_mask` and `past_key_values`; for a
   PagedCache it binds the cache to the model's pool and plans the forward (blocks, slots).
   On the first forward of a fresh cache inside `generate`, rows inherit their longest cached
   prefix and the hook drops the input columns no row needs to compute;
2. each attention layer calls `cache.update(k, v, layer_idx)`, which writes the real tokens
   into their blocks;
3. the registered attention function reads the whole sequence from the pool with the chosen
   backend.
A forward with any other cache (or none) runs plain SDPA, so an enabled model still works with
`DynamicCache`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_paged_kv.kernels import reference

from . import step
from .cache import PagedCache
from .errors import PagedKVError, UnsupportedModelError
from .pool import KVPool, LayerSpec
from .reuse.prefix_index import PUBLIC_TENANT

ATTENTION_NAME = "hf_paged_kv"  # no "flash"/"sdpa"/"paged|": those trigger special dispatch in transformers
_STATE_ATTR = "_hf_paged_kv_state"
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")
BACKENDS = ("torch", "triton")


@dataclass
class _EnabledState:
    pool: KVPool
    backend: str
    previous_attention: str
    handles: tuple


def enable(model, pool: KVPool | None = None, backend: str = "auto") -> KVPool:
    """Make `model` run its attention on paged KV and return its pool.

    Args:
        model: a decoder-only transformers model using the attention interface (Llama, Mistral,
            Qwen2/3, GPT-2 and alike).
        pool: a KVPool to use (its size and block size); default `KVPool()`.
        backend: "torch" (gather + SDPA), "triton" (paged kernels), or "auto": Triton on CUDA,
            torch otherwise.

    Idempotent: enabling an enabled model returns its pool (passing another pool is an error).
    """
    state = getattr(model, _STATE_ATTR, None)
    if state is not None:
        if pool is not None and pool is not state.pool:
            raise PagedKVError("model is already enabled with another pool; call hf_paged_kv.disable(model) first")
        return state.pool
    layers = _layer_specs(model)
    backend = _choose_backend(backend, layers)
    pool = pool if pool is not None else KVPool()
    pool.bind(layers, _model_dtype(model), _fingerprint(model))
    _register()
    previous = model.config._attn_implementation or "sdpa"
    model.set_attn_implementation(ATTENTION_NAME)
    handles = (
        model.register_forward_pre_hook(_before_forward, with_kwargs=True),
        model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True),
    )
    setattr(model, _STATE_ATTR, _EnabledState(pool, backend, previous, handles))
    return pool


def disable(model) -> None:
    """Undo `enable`: remove the hooks and restore the previous attention implementation."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return
    for handle in state.handles:
        handle.remove()
    model.set_attn_implementation(state.previous_attention)
    delattr(model, _STATE_ATTR)


def pool_of(model) -> KVPool:
    """The pool of an enabled model."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise PagedKVError("model is not enabled; call hf_paged_kv.enable(model)")
    return state.pool


def publish(model, prefix, tokenizer=None) -> int:
    """Compute (or find) the KV of `prefix` and share its full blocks with every tenant.

    `prefix` is token ids (a list or 1-D tensor) or text with its `tokenizer` (no special tokens
    are added). This is the only way KV crosses tenants: use it for prompts that are public,
    such as a common system prompt. Returns the number of tokens published (whole blocks).
    """
    cache = PagedCache()
    cache.tenant = PUBLIC_TENANT  # deliberately set here: the constructor refuses it
    with _prefix_blocks(model, prefix, tokenizer, cache) as blocks:
        return len(blocks) * pool_of(model).block_size


def pin(model, prefix, tokenizer=None, tenant: str = "default", priority: int = 0, ttl: float | None = None):
    """Compute (or find) the KV of `prefix` for `tenant` and lock its full blocks in device
    memory: they are never evicted until `unpin` or the TTL (seconds). Returns the `Pin`.

    `prefix` is token ids or text with its `tokenizer`. Raises `PinBudgetError` when the pool's
    pin budget cannot hold it even after displacing lower-priority pins.
    """
    pool = pool_of(model)
    with _prefix_blocks(model, prefix, tokenizer, PagedCache(tenant=tenant)) as blocks:
        if not blocks:
            raise ValueError(f"the prefix fills no block of {pool.block_size} tokens; nothing to pin")
        with pool._lock:
            return pool.pins.add(blocks, tenant, priority, ttl, "explicit")


def persist(model, prefix, tokenizer=None, tenant: str = "default") -> int:
    """Compute (or find) the KV of `prefix` and write its full blocks to the pool's disk tier
    now, so that a restarted process with the same model and directory reuses them. Returns the
    number of tokens written (whole blocks)."""
    pool = pool_of(model)
    if pool.disk is None:
        raise PagedKVError("persist needs a disk tier: KVPool(disk_dir=...)")
    with _prefix_blocks(model, prefix, tokenizer, PagedCache(tenant=tenant)) as blocks:
        with pool._lock:
            now = pool.index.clock()
            for block in blocks:
                pool.write_to_disk(block, pool.index.blocks[block], now)
    return len(blocks) * pool.block_size


@contextmanager
def _prefix_blocks(model, prefix, tokenizer, cache: PagedCache):
    """Run `prefix` (token ids, or text with its tokenizer) through `cache` on the enabled
    `model` and yield the prefix's full blocks, held by the cache until the block exits."""
    block_size = pool_of(model).block_size
    if isinstance(prefix, str):
        if tokenizer is None:
            raise ValueError("a text prefix needs its tokenizer")
        prefix = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    ids = torch.as_tensor(prefix, dtype=torch.long).reshape(1, -1).to(model.device)
    with cache:
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        yield cache.block_tables()[0][: ids.shape[1] // block_size]


def unpin(model, pin) -> None:
    """Release a pin; its blocks stay cached (evictable) for reuse."""
    pool = pool_of(model)
    with pool._lock:
        pool.pins.remove(pin)


# ----------------------------------------------------------------- model checks
def _layer_specs(model) -> list[LayerSpec]:
    config = model.config.get_text_config(decoder=True)
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError("encoder-decoder models are not supported: PagedCache is for decoder-only models")
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} does not use transformers' attention interface, so its attention cannot be paged"
        )
    if getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModelError("attention logit soft-capping is not supported by the paged backends")
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
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


def _fingerprint(model) -> str:
    """Model identity for the prefix index and the disk tier: class, name, a hash of the full
    config and a hash of a sample of every weight (so fine-tunes of one config differ)."""
    import hashlib

    digest = hashlib.blake2b(model.config.to_json_string(use_diff=False).encode(), digest_size=16)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            sample = param.detach().reshape(-1)[:256].float().cpu().numpy()
            digest.update(name.encode() + str(tuple(param.shape)).encode() + sample.tobytes())
    return f"{type(model).__name__}|{model.config._name_or_path}|{digest.hexdigest()}"


def _model_dtype(model) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _choose_backend(backend: str, layers: list[LayerSpec]) -> str:
    if backend == "auto":
        on_cuda = all(spec.device.type == "cuda" for spec in layers)
        return "triton" if on_cuda and _triton_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS + ('auto',)}, got {backend!r}")
    if backend == "triton" and not _triton_available():
        raise PagedKVError("backend='triton' needs the triton package (pip install triton)")
    return backend


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------ hooks
def _before_forward(model, args, kwargs):
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, PagedCache):
        step.set_active(None)
        return None
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    inputs = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
    if inputs is None:
        raise PagedKVError("forward needs input_ids or inputs_embeds")
    state = getattr(model, _STATE_ATTR)
    cache.bind(state.pool)
    # Only generate-style calls (logits of the last position only) may skip cached prompt tokens.
    allow_reuse = kwargs.get("logits_to_keep") == 1
    plan = cache.begin_forward(input_ids, kwargs.get("attention_mask"), inputs.shape[0], inputs.shape[1], allow_reuse)
    plan.backend = state.backend
    step.set_active(plan)
    return _drop_cached_columns(args, kwargs, plan.skip) if plan.skip else None


def _drop_cached_columns(args, kwargs, skip: int):
    """Shorten the forward to the columns some row still computes (prefix reuse). Positions
    are kept as they were, so RoPE and learned position embeddings see the true positions."""
    kwargs = dict(kwargs)
    mask = kwargs.get("attention_mask")
    if kwargs.get("position_ids") is None:
        if mask is not None:
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp_min(0)
        else:
            ids = kwargs.get("input_ids", args[0] if args else None)
            kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device)[None]
    kwargs["position_ids"] = kwargs["position_ids"][..., skip:]
    if mask is not None:
        kwargs["attention_mask"] = mask[:, skip:]
    if args:
        args = (args[0][:, skip:], *args[1:])
    else:
        kwargs["input_ids"] = kwargs["input_ids"][:, skip:]
    return args, kwargs


def _after_forward(model, args, kwargs, output):
    cache = kwargs.get("past_key_values")
    if isinstance(cache, PagedCache):
        cache.end_forward(succeeded=output is not None)
    step.set_active(None)


# -------------------------------------------------------- attention and mask
def paged_attention_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None, **kwargs
):
    """The registered attention function: `query` `[B, heads, T, dim]` against the paged KV."""
    plan = step.active()
    if plan is None:  # this forward uses another cache (or none): plain SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"attention argument {name!r} is not supported by the paged backends")
    if dropout:
        raise PagedKVError("PagedCache is for inference: attention dropout must be 0 (call model.eval())")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = module.layer_idx
    if plan.backend == "triton":
        from hf_paged_kv.kernels import triton_backend

        out = triton_backend.attention(query, layer, plan, scale, sliding_window)
    else:
        out = _torch_attention(query, layer, plan, scale, sliding_window)
    return out.transpose(1, 2).contiguous(), None


def _torch_attention(query, layer: int, plan: step.StepPlan, scale: float, window):
    pool, device, new = plan.pool, query.device, query.shape[2]
    memo_key = ("torch", device, window, new)
    if memo_key not in plan.memo:
        length = max(plan.max_kv_len, 1)
        slots = reference.gather_slots(plan.on("block_tables", device), pool.block_size, length)
        windowed = window is not None and length > window
        if plan.uniform and not windowed and new in (1, length):
            mask, causal = None, new > 1
        else:
            mask = reference.attention_mask(plan.on("q_pos", device), plan.on("kv_lens", device), length, window)
            causal = False
        plan.memo[memo_key] = (slots, mask, causal)
    slots, mask, causal = plan.memo[memo_key]
    keys = reference.gather(pool.key_cache[layer], slots).to(query.dtype)
    values = reference.gather(pool.value_cache[layer], slots).to(query.dtype)
    return reference.sdpa(query, keys, values, mask, scale, is_causal=causal)


def paged_mask(*args, **kwargs):
    """Mask function registered with the attention: paged forwards build their own masks from
    per-row lengths; any other forward gets the SDPA mask."""
    if step.active() is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def _register() -> None:
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)
