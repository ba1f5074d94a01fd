"""Which of the prompts in line can all have their first tokens in time, and in what order.

Admission takes a burst's short prompts first (`Admission.in_turn`): that brings the most first
tokens soonest, but where a long prompt arrived first, the shorter ones can make it late when
serving it first would have kept every one of them in time (a 300-token prompt with 0.35 s left
behind two 60-token ones with 0.5 s left: shortest first ends it at 0.42 s, it first ends all
three in time).

With a time-to-first-token target, every prompt's deadline is its arrival plus the target. Taking
the prompts in deadline order and, whenever the one just added cannot finish by its deadline,
dropping the longest taken so far leaves the largest set that can all finish in time (Moore and
Hodgson's rule for one machine; here the forwards are the machine, and a prompt's work is its
uncached tokens). Those go first: in the queue's own order when that keeps each of them in time
too, else by deadline; the prompts dropped follow, in the queue's order.

On bench_load's trace this changes nothing: its late first tokens there (emulated, at
2026-12-04's targets) are prompts that no order makes in time once a higher priority's prompt
or a forward already running is served, not prompts a shorter one passed.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Callable, Hashable, Sequence, TypeVar

from .request import Request

Prompt = TypeVar("Prompt", bound=Hashable)


def in_time_first(prompts: Sequence[Prompt], deadline: Callable[[Prompt], float], tokens: Callable[[Prompt], int],
                  finish: Callable[[int], float]) -> list[Prompt]:
    """`prompts` (in the queue's order) reordered: the largest set that can all finish by their
    `deadline` first, then the rest. `tokens(prompt)`: the work a prompt adds; `finish(n)`: when
    the forwards computing the first n tokens of work in line end (monotonic in n)."""
    by_deadline = sorted(range(len(prompts)), key=lambda i: deadline(prompts[i]))  # stable: ties keep the queue's order
    taken: list[tuple[int, int]] = []  # a heap of (-tokens, index): the longest on top
    work = 0
    for i in by_deadline:
        heapq.heappush(taken, (-tokens(prompts[i]), i))
        work += tokens(prompts[i])
        if finish(work) > deadline(prompts[i]):
            # drop the longest: for work that adds up, every other one taken is in time again
            work += heapq.heappop(taken)[0]
    kept = sorted(i for _, i in taken)
    if not all_in_time([prompts[i] for i in kept], deadline, tokens, finish):
        kept.sort(key=lambda i: deadline(prompts[i]))
    dropped = set(range(len(prompts))) - set(kept)
    return [prompts[i] for i in kept] + [prompts[i] for i in sorted(dropped)]


def all_in_time(prompts: Sequence[Prompt], deadline: Callable[[Prompt], float], tokens: Callable[[Prompt], int],
                finish: Callable[[int], float]) -> bool:
    """Whether every prompt, computed in this order, finishes by its deadline."""
    work = 0
    for prompt in prompts:
        work += tokens(prompt)
        if finish(work) > deadline(prompt):
            return False
    return True


def first_tokens_in_time(order: list[Request], late: set[Request], uncached: dict[Request, int],
                         running: list[Request], max_batch_tokens: int, line: tuple[float, float], target: float,
                         now: float) -> list[Request]:
    """Admission's `order` (by priority, then shortest-first with aging) with each priority's new
    prompts that can still meet `target` (none in `late`) reordered by `in_time_first`: the largest
    set that can all have their first tokens in time first. Preempted requests and late ones keep
    their places. The work in line before a prompt: the running prefills' remaining tokens, every
    request of a higher priority, and the prompts before it; a forward holds `max_batch_tokens`
    (the running decodes among them) and takes `fixed + per_token x n` seconds (`line`)."""
    fixed, per_token = line
    decodes = sum(1 for r in running if r.remaining == 1)
    room = max(1, max_batch_tokens - decodes)  # prompt tokens a forward holds beside the decodes
    overhead = fixed + decodes * per_token  # what every forward costs besides its prompt tokens
    ahead = sum(r.remaining for r in running if r.remaining > 1)  # running prefills go first in every forward

    def reorderable(request: Request) -> bool:
        return not request.generated and request not in late

    result: list[Request] = []
    for _, group in itertools.groupby(order, key=lambda r: r.effective_priority):
        group = list(group)

        def finish(work: int, before: int = ahead) -> float:
            tokens = before + work
            return now + math.ceil(tokens / room) * overhead + tokens * per_token

        reordered = iter(in_time_first([r for r in group if reorderable(r)], lambda r: r.arrived + target,
                                       uncached.__getitem__, finish))
        result += [next(reordered) if reorderable(r) else r for r in group]
        ahead += sum(uncached[r] for r in group)
    return result
