"""Forwards that carry decodes stay within the decodes' per-token target.

Prefill chunks lengthen the forward that every running decode waits on: on bench_load's CPU
a 256-token forward takes 0.42 s, and with the controller's budget grown to 320-400 tokens a
request whose first token had just come waited longer than its 0.33 s per-token target for its
second (the trace's only per-token miss at 35b6103). With a per-token target
(`Limits.per_token_target`, which the load controller sets), a step's token budget is what fits,
on the recent steps' fitted cost line (`StepCosts.tokens_within`), in `MARGIN` of the least time
any running request with a first token can afford. One with `n` tokens, the first at `f`, still
meets its target (its mean time between tokens) if its next token comes by `f + n x target`;
each may also take one target since its last token (a gap that long never raises its mean above
the target, nor a mean already above it). So decodes that are ahead of their target – long ones,
mostly – cap nothing, and a step where nothing has a first token keeps the whole budget:
Sarathi-Serve caps every mixed forward at a fixed token budget; this one follows the decodes'
slack. Prompts still advance by at least `MIN_PREFILL` tokens a step, so that a target the
decodes alone use up does not stop every prefill and admission until they finish.

Given a time-to-first-token target (`Limits.ttft_target`, with or without a per-token one), the
forward may take more than pacing, or `Limits.max_batch_tokens`, allows, up to
`Limits.burst_batch_tokens`, where only that gives the prompts in line their first tokens in
time (`in_time`): prompts are taken in the order admission takes them (running prefills first; a
request recomputing after a preemption counts as work ahead of those behind it), each whole,
while one forward of all of them still ends within every one's target; the forward grows to the
last prompt that its own split – its rest in a second forward, with that forward's fixed cost
and the decodes fed again – would make late. The decodes may then miss their pace by one
forward, where the prompt would certainly miss its target: a decode's mean still meets its
target whenever it generates a few more tokens, which most do; the prompt had no second chance.
On bench_load's trace at its calibrated targets (TTFT 0.36 s, per-token 0.24 s), pacing that
split every prompt arriving beside a fresh decode left 21 of 99 first tokens late with the
controller, 9 with its pacing switched off, 12 without the controller; keeping the next prompt
in line whole, 11 (single runs, one after another). Two prompts arriving together (98 and 228
tokens, 181 and 110) missed a 0.41 s target by a few hundredths behind a 256-token budget, which
one forward of all their tokens (0.34-0.38 s) meets. A forward never grows past what one forward
can compute within the target, so requests arriving during it keep most of theirs.

A decode that admission resumes in the step (after a preemption) joins a forward whose budget
was set before it: it is paced from the next step on.
"""

from __future__ import annotations

import time
from typing import Callable

from .config import Limits
from .costs import StepCosts
from .request import Request

MARGIN = 0.85  # of a decode's allowance a step is planned to take: room for the fitted line's error
MIN_PREFILL = 16  # prompt tokens a paced step still holds (a block's worth)


def step_budget(running: list[Request], waiting: list[Request], limits: Limits, costs: StepCosts,
                now: float | None = None, uncached: Callable[[Request], int] | None = None) -> int:
    """The tokens the next forward, starting `now` (monotonic; default: now), may hold:
    `Limits.max_batch_tokens`, less where the running requests with a first token cannot afford
    the time (at least their decodes and `MIN_PREFILL` more), more where only one larger forward
    gives the prompts in line their first tokens in time (`in_time`). `waiting`: in the order
    admission takes them; `uncached(request)`: the tokens a waiting request would compute
    (default: all of them). Unchanged (and nothing fitted) when no prompt could join: nothing
    waits and every running request is decoding."""
    budget = limits.max_batch_tokens
    now = time.monotonic() if now is None else now
    if not (waiting or any(r.remaining > 1 for r in running)):
        return budget
    decodes = sum(1 for r in running if r.remaining == 1)
    paced = paced_budget(running, decodes, limits, costs, now)
    return max(paced, in_time(running, waiting, decodes, paced, limits, costs, now, uncached))


def paced_budget(running: list[Request], decodes: int, limits: Limits, costs: StepCosts, now: float) -> int:
    """`Limits.max_batch_tokens`, or with a per-token target the tokens the running requests with
    a first token can afford (`MARGIN` of the tightest allowance, on the fitted line), at least
    their `decodes` and `MIN_PREFILL` more."""
    budget, target = limits.max_batch_tokens, limits.per_token_target
    # decoding requests with a first token; one recomputing its KV after a preemption caps nothing:
    # its next token comes after its whole recompute, which smaller forwards only delay
    started = [r for r in running if r.first_token is not None and r.remaining == 1]
    if target is None or not started:
        return budget
    # a step's allowance is each request's slack before the step, or one target since its last token
    allowance = min(max(target - (now - r.last_token), slack(r, target, now)) for r in started)
    fits = costs.tokens_within(MARGIN * allowance)
    if fits is None:
        return budget
    return min(budget, max(fits, decodes + MIN_PREFILL))


def slack(request: Request, per_token_target: float, now: float) -> float:
    """Seconds `request` (running, with a first token) could pause now and still meet the
    per-token target if the token after the pause were its last."""
    return len(request.generated) * per_token_target - (now - request.first_token)


def in_time(running: list[Request], waiting: list[Request], decodes: int, paced: int, limits: Limits,
            costs: StepCosts, now: float, uncached: Callable[[Request], int] | None = None) -> int:
    """The tokens of the forward that gives the prompts in line (requests without a first token:
    the running ones, then `waiting` in admission's order; a request recomputing after a
    preemption is work ahead of those behind it) their first tokens within
    `Limits.ttft_target` when `paced` tokens would split one of them into a second forward that
    ends too late; at most `Limits.burst_batch_tokens` (or `max_batch_tokens`). 0 when no prompt
    needs more than `paced`."""
    target = limits.ttft_target
    zero = None if target is None else costs.tokens_within(0.0)  # minus a forward's fixed cost, in tokens
    if zero is None:
        return 0
    fixed = -zero
    ceiling = max(limits.max_batch_tokens, limits.burst_batch_tokens or 0)
    needed, room, grown = decodes, ceiling, 0
    for request in (r for r in [*running, *waiting] if r.remaining > 1):
        # a waiting request's cached prefix is inherited, not computed; a running one feeds what remains
        needed += request.remaining if uncached is None or request in running else uncached(request)
        if request.first_token is not None:  # recomputing after a preemption: work ahead, no first token to give
            continue
        left = target - (now - request.arrived)
        room = min(room, costs.tokens_within(left))  # one forward this large ends in time for all so far
        if needed > room:
            break
        # split: its rest in a second forward, with that forward's fixed cost and the decodes fed
        # again, ends past its target (with room for the line's error); those before it are whole
        if needed > paced and costs.tokens_within(MARGIN * left) < needed + decodes + fixed:
            grown = needed
    return grown
