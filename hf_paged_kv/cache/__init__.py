"""The `generate` side: `PagedCache` (`paged_cache`: the transformers Cache protocol and its
lifecycle), one row's block table (`sequence`), the planner of a forward (`forward_plan`: the
one place a forward's plan is built, on `planner`'s slot arithmetic and `step`'s `StepPlan`),
the packed forward the engine shares (`packed`), and what continuation turns keep (`history`).

Nothing is imported here: the pool imports `sequence`, and `paged_cache` imports the pool.
`PagedCache` is imported from `hf_paged_kv`.
"""
