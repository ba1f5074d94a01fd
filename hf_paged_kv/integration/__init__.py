"""Wiring into transformers: `enable`/`disable`, the wrapped forward and the attention and mask
functions (`hooks`), which models qualify (`model_checks`), the weights' fingerprint in every
block hash (`fingerprint`), and the text-generation pipeline with a fresh cache per call
(`pipeline`).

Nothing is imported here: the tiers import `fingerprint`, and `hooks` imports the pool. The
public functions are imported from `hf_paged_kv`.
"""
