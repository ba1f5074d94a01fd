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

With a time-to-first-token target too (`Limits.ttft_target`), pacing does not split the next
prompt in line – the first running request still feeding its prompt, else the head of the
queue – when one forward would give its first token in time and two would not (the second
forward's fixed cost and the decodes fed again): the decodes may then miss their pace by one
forward, where the prompt would certainly miss its target. A decode's mean still meets its
target whenever it generates a few more tokens, which most do; the prompt had no such second
chance. On bench_load's trace at its calibrated targets (TTFT 0.36 s, per-token 0.24 s), pacing
without this exception split prompts arriving beside a fresh decode: 21 of 99 first tokens
late with the controller, 9 with its pacing switched off, 12 without the controller, 11 with
this exception and no per-token miss (single runs, one after another).

A decode that admission resumes in the step (after a preemption or yielding its memory) joins
a forward whose budget was set before it: it is paced from the next step on.
"""

from __future__ import annotations

import time

from . import yielding
from .costs import StepCosts
from .request import Request
from .scheduler import Limits

MARGIN = 0.85  # of a decode's allowance a step is planned to take: room for the fitted line's error
MIN_PREFILL = 16  # prompt tokens a paced step still holds (a block's worth)


def step_budget(running: list[Request], waiting: list[Request], limits: Limits, costs: StepCosts,
                now: float | None = None) -> int:
    """The tokens the next forward, starting `now` (monotonic; default: now), may hold:
    `Limits.max_batch_tokens`, less where the running requests with a first token cannot afford
    the time; at least their decodes and `MIN_PREFILL` more, and the next prompt in line whole
    where only that gives its first token in time. Unpaced (and nothing fitted) when no prompt
    could join: nothing waits (`waiting`, in queue order) and every running request is decoding."""
    budget, target = limits.max_batch_tokens, limits.per_token_target
    now = time.monotonic() if now is None else now
    if target is None or not (waiting or any(r.remaining > 1 for r in running)):
        return budget
    # decoding requests with a first token; one recomputing its KV after a preemption caps nothing:
    # its next token comes after its whole recompute, which smaller forwards only delay
    started = [r for r in running if r.first_token is not None and r.remaining == 1]
    if not started:
        return budget
    # a step's allowance is each request's slack (see yielding) before the step, or one target since its last token
    allowance = min(max(target - (now - r.last_token), yielding.slack(r, target, 0.0, now)) for r in started)
    fits = costs.tokens_within(MARGIN * allowance)
    decodes = sum(1 for r in running if r.remaining == 1)
    if fits is None:
        return budget
    paced = min(budget, max(fits, decodes + MIN_PREFILL))
    return max(paced, unsplit(running, waiting, decodes, paced, limits, costs, now))


def unsplit(running: list[Request], waiting: list[Request], decodes: int, paced: int, limits: Limits,
            costs: StepCosts, now: float) -> int:
    """The tokens that finish the next prompt in line (the first request without a first token)
    in this forward, if the paced budget would split it and only one forward gives its first
    token within `Limits.ttft_target`; else 0."""
    target = limits.ttft_target
    if target is None:
        return 0
    # running prompts continue before the queue's; a waiting prompt's cached prefix is not counted (a bound from above)
    prompt = next((r for r in [*running, *waiting] if r.first_token is None and r.remaining > 1), None)
    if prompt is None:
        return 0
    needed = decodes + prompt.remaining
    if needed <= paced or needed > limits.max_batch_tokens:
        return 0
    in_time = costs.tokens_within(target - (now - prompt.arrived))  # one forward of at most this many: in time
    fixed = -costs.tokens_within(0.0)  # a forward's fixed cost, in tokens
    return needed if needed <= in_time < needed + decodes + fixed else 0
