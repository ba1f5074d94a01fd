"""Attention backends: how a forward's K/V reach the pool and how attention reads them back.

A backend has two calls, made by the registered attention function for every layer:

    write(plan, layer, key, value)        # key/value [B, kv_heads, T, head_dim] -> pool slots
    attention(query, layer, plan, scale, window=None, softcap=None, need_weights=False, new_kv=None)
        -> (output [B, heads, T, head_dim], weights [B, heads, T, keys] or None)

`new_kv` is the forward's own `(key, value)`, which a backend may attend directly where they are
every row's whole sequence (the torch backend does, for prefills into empty rows).

`torch` (gather or zero-copy views + SDPA, built on `hf_paged_kv.kernels.reference`) runs
anywhere; `triton` (paged kernels) is the default on CUDA.
"""

from __future__ import annotations

import os

from ..errors import PagedKVError

NAMES = ("torch", "triton")


def choose(name: str, devices) -> str:
    """Resolve "auto" (Triton when every layer is on CUDA and Triton is installed) and check the name."""
    if name == "auto":
        return "triton" if all(d.type == "cuda" for d in devices) and _triton_available() else "torch"
    if name not in NAMES:
        raise ValueError(f"backend must be one of {NAMES + ('auto',)}, got {name!r}")
    if name == "triton" and not _triton_available():
        raise PagedKVError("backend='triton' needs the triton package (pip install triton)")
    elsewhere = sorted({str(d) for d in devices if d.type != "cuda"})
    if name == "triton" and elsewhere and os.environ.get("TRITON_INTERPRET") != "1":
        raise PagedKVError(f"backend='triton' runs its kernels on CUDA devices, and the model has layers on "
                           f"{', '.join(elsewhere)}: use backend='torch' (or 'auto'), or set TRITON_INTERPRET=1 before "
                           "anything imports triton to run the kernels in Triton's (slow) interpreter")
    return name


def create(name: str, pool):
    """The backend object for `name` ("torch" or "triton") on `pool`."""
    if name == "triton":
        from .triton_backend import TritonBackend  # imports Triton: only when asked for

        return TritonBackend(pool)
    from .torch_backend import TorchBackend

    return TorchBackend(pool)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
