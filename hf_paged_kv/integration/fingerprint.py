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
import threading
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
    """Whether a model's weights were edited in place, by their version counters (torch counts
    every in-place change: `with torch.no_grad(): w[3, 7] += 1`, `load_state_dict` copying into
    them, an optimizer step). Usage, at each fingerprint::

        edits = InPlaceEdits()                           # one per model, kept across disable/enable
        edits.token(model.named_parameters())            # "" until a weight is edited in place

    An edit gives the weights a token of their own, new at each later edit, so their KV is
    shared only with themselves, in this process (`is_local`): hashing the edited weights whole
    instead would read them all again after every optimizer step of a training loop that
    generates between steps. Once a weight was edited, the token stays, and a tensor swapped in
    (`assign=True`, a replaced module) renews it: its version restarts, and the sample cannot
    tell edited values from the ones before the edit. Before any edit, a swapped-in tensor is
    told apart by its sample alone, unless it holds the old one's storage (and its version
    counter), as `load_state_dict(model.state_dict(), assign=True)` gives. Edits through `.data`
    bypass the counter and are not seen, nor are weights created under `torch.inference_mode`
    (they have no counter)."""

    def __init__(self):
        self._seen: dict[str, tuple[weakref.ref, int, int | None]] = {}  # name -> (tensor, its storage, version)
        self._edited = False
        self._generation = 0  # counts the changes seen since the first edit
        self._salt = secrets.token_hex(8)  # tokens of one model in this process only
        self._lock = threading.Lock()  # two threads taking a fingerprint must agree on the token

    def token(self, params) -> str:
        """The token of the weights' in-place edits ("" for none): the same while nothing
        changes, a new one after any edit, or a tensor swapped in once one was edited."""
        params = list(params)
        with self._lock:
            changed = False
            for name, param in params:
                version, storage = _version(param), param.data_ptr()
                seen = self._seen.get(name)
                other_tensor = seen is not None and seen[0]() is not param
                # a tensor swapped in on the same storage (`load_state_dict(model.state_dict(),
                # assign=True)`) shares the old one's version counter: compared as the same tensor
                swapped = other_tensor and storage != seen[1]
                edited = seen is not None and not swapped and version != seen[2]
                self._edited = self._edited or edited
                changed = changed or edited or swapped
                if seen is None or other_tensor or edited:
                    self._seen[name] = (weakref.ref(param), storage, version)
            for name in self._seen.keys() - {name for name, _ in params}:  # weights that went (a module removed)
                del self._seen[name]
            if not self._edited:
                return ""
            self._generation += changed
            return f"{self._salt}.{self._generation}"

    def unchanged(self, params) -> bool:
        """Whether every weight is the tensor, at the version, that the last `token` saw: a look
        at identities and counters, no values read (an edit through `.data` passes it)."""
        with self._lock:
            count = 0
            for name, param in params:
                seen = self._seen.get(name)
                if seen is None or seen[0]() is not param or seen[2] != _version(param):
                    return False
                count += 1
            return count == len(self._seen)


def is_local(fingerprint: str) -> bool:
    """Whether `fingerprint` is of weights edited in place: known to this process only, its KV
    is of no use to another process or a restart."""
    return "|edited=" in fingerprint


def _version(param: torch.Tensor) -> int | None:
    try:
        return param._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None
