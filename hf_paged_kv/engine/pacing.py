"""Forwards that carry decodes stay within the decodes' per-token target.

Prefill chunks lengthen the forward that every running decode waits on: on bench_load's CPU
a 256-token forward takes 0.42 s, and with the controller's budget grown to 320-400 tokens a
request whose first token had just come waited longer than its 0.33 s per-token target for its
second (the trace's only per-token miss at 35b6103). With a per-token target
(`Limits.per_token_target`, which the load controller sets), a step's token budget is what fits,
on the recent steps' fitted cost line (`StepCosts.tokens_within`), in `MARGIN` of the least time
any of its decodes can afford. A decode with `n` tokens, the first at `f`, still meets its target
(its mean time between tokens) if its next token comes by `f + n x target`; each may have at
least one target (a step that long leaves its mean no worse than the target). So decodes that
are ahead of their target – long ones, mostly – cap nothing, and a step without decodes keeps
the whole budget: Sarathi-Serve caps every mixed forward at a fixed token budget; this one
follows the decodes' slack.
"""

from __future__ import annotations

from .costs import StepCosts
from .request import Request
from .scheduler import Limits

MARGIN = 0.85  # of a decode's allowance a step is planned to take: room for the fitted line's error


def step_budget(running: list[Request], limits: Limits, costs: StepCosts, now: float) -> int:
    """The tokens the next forward may hold: `Limits.max_batch_tokens`, less where its decodes
    cannot afford the time (never fewer than the decodes themselves)."""
    budget, target = limits.max_batch_tokens, limits.per_token_target
    decodes = [r for r in running if r.remaining == 1 and r.first_token is not None]
    if target is None or not decodes:
        return budget
    allowance = min(max(target, len(r.generated) * target - (now - r.first_token)) for r in decodes)
    fits = costs.tokens_within(MARGIN * allowance)
    return budget if fits is None else max(len(decodes), min(budget, fits))
