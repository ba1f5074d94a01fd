"""One packed forward of the serving engine.

Every scheduled sequence contributes its next tokens – one for a decode, a chunk for a prefill –
concatenated into a single row `[1, N]` with positions restarting per sequence (`packed.run`).
Prefill chunks and decodes share the forward; only the logits of sequences that reach their last
token are computed (`logits_to_keep` with their indices).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache, GenerationConfig

from ..cache import packed, step
from ..cache.sequence import Sequence
from ..errors import PoolExhaustedError, UnsupportedModelError
from ..pool import KVPool
from .request import Request


def forward(model, backend, pool: KVPool, batch: list[tuple[Request, int]]) -> tuple[torch.Tensor, list[Request]]:
    """Run `batch` (request, tokens to feed) through `model`; returns the next-token logits
    `[k, vocab]` of the k requests whose fed tokens reach their end, and those requests. The
    sequences' blocks must already be allocated; nothing is committed here."""
    ids = np.concatenate([r.tokens()[r.computed : r.computed + n] for r, n in batch])
    sampled = [i for i, (r, n) in enumerate(batch) if r.computed + n == len(r.tokens())]
    counts = [n for _, n in batch]
    # the last fed position of each sampled request (the forward's last position when none is)
    keep = np.cumsum(counts)[sampled] - 1 if sampled else np.array([len(ids) - 1])
    logits = _packed(model, backend, pool, [r.sequence for r, _ in batch], counts, ids, keep)
    return (logits if sampled else logits[:0]), [batch[i][0] for i in sampled]


def _packed(model, backend, pool: KVPool, sequences: list[Sequence], counts: list[int], ids: np.ndarray,
            keep: np.ndarray | None = None) -> torch.Tensor:
    """The logits of the positions `keep` (every position for None) of a packed forward of
    `ids`, `counts[i]` of them for `sequences[i]` (their blocks allocated)."""
    device = model.get_input_embeddings().weight.device
    kept = {} if keep is None else {"logits_to_keep": step.to_device(keep, device)}
    with torch.inference_mode():
        return packed.run(model, backend, pool, sequences, counts, ids, device, **kept).logits[0]


def commit(batch: list[tuple[Request, int]]) -> None:
    """The forward succeeded: its tokens are now stored in the sequences."""
    for request, count in batch:
        fed = request.tokens()[request.computed : request.computed + count]
        request.sequence.tokens.extend(fed)
        request.sequence.length += count
        request.sequence.history.extend(b"\x01" * count)
        request.computed += count
        request.reached = max(request.reached, request.computed)


def token_kinds(batch: list[tuple[Request, int]]) -> tuple[int, int]:
    """`(prompt tokens computed for the first time, tokens computed again after a preemption)` of
    a forward not yet committed; the rest are decodes (the token sampled last, fed once)."""
    first = again = 0
    for request, count in batch:
        decode = 1 if request.generated and request.computed + count == len(request.tokens()) else 0
        repeated = max(0, min(request.computed + count - decode, request.reached) - request.computed)
        first, again = first + count - decode - repeated, again + repeated
    return first, again


# the reference of `check_packing`: two greedy tokens and their raw logits, with the model's own
# cache (its generation config may name one) whatever its stop tokens
_TWO_GREEDY_TOKENS = GenerationConfig(max_new_tokens=2, min_new_tokens=2, do_sample=False, num_beams=1,
                                      num_return_sequences=1, output_logits=True, return_dict_in_generate=True,
                                      pad_token_id=0)


def check_packing(model, backend, pool: KVPool) -> None:
    """Refuse a model that the engine's packed forwards would run otherwise than `generate`:
    two requests' prefill and decode, packed into one row with positions restarting per
    request, must give each request's logits from `generate` with its own cache. Kosmos-2 counts
    its positions from a padding offset, which generate's inputs give it and the engine's do
    not. A few tokens; skipped when the pool has no room for them."""
    embeddings = model.get_input_embeddings()
    generator = torch.Generator().manual_seed(0)
    rows, expected = [], []
    for length in (5, 4):
        prompt = torch.randint(0, embeddings.num_embeddings, (1, length), generator=generator).to(embeddings.weight.device)
        try:
            row, logits = _reference(model, prompt)
        except Exception as error:  # noqa: BLE001 - what transformers raises, named in the refusal
            raise UnsupportedModelError(f"{type(model).__name__} could not generate two tokens of a {length}-token "
                                        f"prompt, which the engine checks its packed forwards against: {error!r}") from error
        rows.append(row)
        expected.append(logits)
    try:
        packed = _decode_logits(model, backend, pool, rows)
    except PoolExhaustedError:
        return
    tolerance = 1e-3 if embeddings.weight.dtype in (torch.float32, torch.float64) else 5e-2
    for got, reference in zip(packed, expected):
        if (got - reference).abs().max() > tolerance * (1 + reference.abs().max()):
            raise UnsupportedModelError(
                f"{type(model).__name__} gives other logits in the engine's packed forwards (positions restarting per "
                "request) than in generate: it positions tokens otherwise or mixes them across the row, so the engine "
                "cannot batch it; serve it with generate and a PagedCache")


def _reference(model, prompt: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """The prompt and its first greedy token, and the logits of feeding that token back: from
    `generate` with the model's own cache, or two forwards on a DynamicCache for a model without it."""
    if getattr(model, "generate", None) is None:
        with torch.no_grad():
            cache = DynamicCache()
            first = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[0, -1].argmax()
            logits = model(input_ids=first.view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1]
        return torch.cat([prompt[0], first.view(1)]).cpu().numpy(), logits.float()
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=_TWO_GREEDY_TOKENS)
    return out.sequences[0, : prompt.shape[1] + 1].cpu().numpy(), out.logits[1][0].float()


def _decode_logits(model, backend, pool: KVPool, rows: list[np.ndarray]) -> torch.Tensor:
    """The logits `[len(rows), vocab]` (float) of each row's last token, fed in a packed decode
    after a packed prefill of the rest, on fresh blocks freed after."""
    sequences = [Sequence() for _ in rows]
    try:
        for feeds in ([row[:-1] for row in rows], [row[-1:] for row in rows]):
            counts = [len(fed) for fed in feeds]
            with pool.locked():
                pool.grow(sequences, counts)
            logits = _packed(model, backend, pool, sequences, counts, np.concatenate(feeds))
            for sequence, fed in zip(sequences, feeds):
                sequence.append(np.ones(len(fed), dtype=bool), fed)
        return logits.float()
    finally:
        with pool.locked():
            for sequence in sequences:
                pool.decref(sequence.blocks)
