"""Running decodes make room for first tokens, swapped out to the host tier.

In a burst the pool fills with sequences that are decoding, and a new request waits for one of
them to finish: its first token comes late while the decodes run well inside their per-token
target. With both targets set (`Limits.ttft_target` and `Limits.per_token_target`, which the load
controller sets from its SLO) and a host tier to take what they step out with, a new request that
memory turns away while it can still get its first token in time swaps out running decodes that
can afford the pause: their full blocks stay cached and go to the host tier when the pool evicts
them, their partial block is kept in host memory, and they resume with exactly the KV they had,
copied back (recomputed only where the host tier had to drop a block meanwhile).

A decode can afford a pause while it would still meet its per-token target (the mean time
between its tokens) if its next token after the pause were its last: with `g` tokens generated
(the first, at `f`, included), at time `t`, its slack is `g x target - (t - f) - one step`. Victims need a slack of
at least `MIN_SLACK` time-to-first-token targets (they wait for memory to free, which in a burst
takes about that long) and more than one token still to generate (one about to end frees its
blocks anyway); the lowest (effective) priority goes first, then the most slack; none is above
the priority of the request it makes room for, none was admitted in the same step, and victims
are taken only when together they free the blocks it lacks. Their priority does not rise (as it
does after a preemption because memory ran out); while their slack lasts they let others pass,
after that they take their turn like any request memory turns away; and a decode that paused
has less slack, so the same one is not chosen again and again.
"""

from __future__ import annotations

from typing import Callable

from .request import Request

# the least slack, in time-to-first-token targets, a decode needs to be swapped out
MIN_SLACK = 2.0


def slack(request: Request, per_token_target: float, step_seconds: float, now: float) -> float:
    """Seconds `request` (running, with a first token) could pause now and still meet the
    per-token target if the token after the pause were its last."""
    return len(request.generated) * per_token_target - (now - request.first_token) - step_seconds


def victims(running: list[Request], requester: Request, shortfall: int, frees: Callable[[Request], int],
            per_token_target: float, min_slack: float, step_seconds: float, now: float) -> list[Request]:
    """The running decodes to swap out so that `requester` fits: lowest priority first, then
    the most slack, each with at least `min_slack` seconds of it and a priority no higher than
    the requester's, until what they free (`frees(request)`, in blocks) covers `shortfall`; none
    when they cannot cover it."""
    if shortfall <= 0:
        return []
    spare = {r: slack(r, per_token_target, step_seconds, now) for r in running
             if r is not requester and r.first_token is not None and r.remaining == 1
             and r.params.max_new_tokens - len(r.generated) > 1  # one about to end frees its blocks anyway
             and r.effective_priority <= requester.effective_priority}
    chosen, freed = [], 0
    for request in sorted((r for r, s in spare.items() if s >= min_slack),
                          key=lambda r: (r.effective_priority, -spare[r])):
        chosen.append(request)
        freed += frees(request)
        if freed >= shortfall:
            return chosen
    return []
