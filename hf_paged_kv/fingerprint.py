"""The model fingerprint: which weights computed a block's K/V. It is part of every block hash,
so KV is inherited only by the weights, dtype and block size that computed it.

A fingerprint hashes the config, every weight's name, shape and dtype and a strided sample of
its values (`sample`), about 13 ms for SmolLM2-135M in fp32 on a 2-core CPU, and is re-taken at
each turn. A sample can miss an edit of a few elements (one weight changed in place), so the
weights' version counters are watched as well (`InPlaceEdits`): a weight edited in place since
`enable` gives the model a token of its own. Unedited, the fingerprint depends on the values
only, never on which tensor objects hold them, so the same weights give the same fingerprint
after a restart and reuse their disk tier.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import weakref

import torch


def model_fingerprint(model, params, config_digest: str, edits: str, block_size: int, dtype: torch.dtype) -> str:
    """Model identity for the prefix index and the disk tier: class, name, the config's digest,
    a hash of every weight's name, shape, dtype and sample, the token of in-place edits
    (`InPlaceEdits.token`), the pool's block size and dtype. One device-to-host copy per dtype
    of the weights (SmolLM2-135M: ~0.3M elements)."""
    digest = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        by_dtype: dict = {}
        for name, param in params:
            by_dtype.setdefault(param.dtype, []).append(sample(param))
            digest.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
        for weights_dtype in sorted(by_dtype, key=str):
            digest.update(torch.cat(by_dtype[weights_dtype]).cpu().view(torch.uint8).numpy().tobytes())
    edited = f"|edited={edits}" if edits else ""
    return (f"{type(model).__name__}|{model.config.name_or_path}|{config_digest}|{digest.hexdigest()}{edited}"
            f"|block_size={block_size}|dtype={dtype}")


def sample(param: torch.Tensor) -> torch.Tensor:
    """A strided view of `param` that holds an element of every row (index of dim 0: a token's
    embedding, a linear layer's output channel) and of every column: the stride is below the row
    length (no row is stepped over), at most the number of rows (the view has a row's length of
    elements or more) and coprime to the row length (the sampled column moves on each time). A
    weight changed in any whole row or column changes the sample, as almost every other update
    does; 1-D weights are taken whole. About max(rows, columns) elements per matrix: a view, no
    copy, of a contiguous weight."""
    flat = param.detach().reshape(-1)
    row = math.prod(param.shape[1:])
    stride = max(min(row - 1, param.shape[0] if param.dim() else 1), 1)
    while math.gcd(stride, row) > 1:
        stride -= 1
    return flat[::stride]


class InPlaceEdits:
    """The weights edited in place since they were first seen, by their version counters (torch
    counts every in-place change: `with torch.no_grad(): w[3, 7] += 1`, `load_state_dict`
    copying into them, an optimizer step). Usage, at each fingerprint::

        edits = InPlaceEdits(model.named_parameters())   # at enable
        edits.token(model.named_parameters())            # "" until a weight is edited in place

    An edit gives the model a token of its own, random and new at each edit, so its KV is
    shared only with itself, in this process: hashing the edited weights whole instead would
    read them all again after every optimizer step of a training loop that generates between
    steps. A tensor swapped in (`assign=True`, a replaced module) is watched from when it is
    first seen: its sample tells it apart. Edits through `.data` bypass the counter and are not
    seen, nor are weights created under `torch.inference_mode` (they have no counter)."""

    def __init__(self, params):
        self._seen: dict[str, tuple[weakref.ref, int | None]] = {}
        self._swapped = 0  # tensors swapped in under a known name: equal versions then mean other weights
        self._last: tuple[tuple, str] = ((), "")  # (what was edited, its token)
        self.token(params)

    def token(self, params) -> str:
        """The token of the weights' in-place edits ("" for none): the same while no version
        changes, a new one after any edit."""
        edited = []
        for name, param in params:
            version = _version(param)
            seen = self._seen.get(name)
            if seen is None or seen[0]() is not param:
                self._swapped += seen is not None
                self._seen[name] = (weakref.ref(param), version)
            elif version != seen[1]:
                edited.append((name, version))
        key = (self._swapped, *edited) if edited else ()
        if key != self._last[0]:
            self._last = (key, secrets.token_hex(8) if edited else "")
        return self._last[1]


def _version(param: torch.Tensor) -> int | None:
    try:
        return param._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None
