"""How many first tokens *any* schedule could deliver within a target on this machine: an upper
bound on availability, measured in the same run as the systems it bounds.

A serving benchmark that misses its availability target has to say whether a better scheduler
could have met it or whether the machine cannot. The bound answers that from two measurements of
the model alone and the trace itself, with every simplification on the optimistic side:

* **Forwards.** A forward over n tokens takes at least `fixed + per_token * n` seconds: a line
  under the median times of the model alone (no cache, no engine) at several n up to the batch
  budget. Forwards run one after another, and a request's first token comes out of the forward
  that takes its last prompt token, after it arrived.
* **Reuse.** A request computes only the prompt tokens that no other request arriving before its
  deadline has in common with it (the longest common prefix, not rounded down to whole blocks,
  and always cached when wanted); at least its last token.
* **Nothing else costs.** Decoding, sampling, cache writes and scheduling are free, and the
  per-token target is ignored.

The bound holds as far as the line does: it is measured, on medians, so "at least" means on this
machine in the run that measured it.

Then for requests j..k in arrival order (their deadlines `arrival + ttft` are in the same order),
every request of them served in time was computed inside `[arrival_j, arrival_k + ttft]` in at
least one forward: the most of them in time is the most smallest works that fit in that span less
one forward's fixed cost. Spans that do not overlap hold different forwards and different
requests, so the misses they force add up; the best set of disjoint spans (a weighted interval
schedule) gives the fewest misses any schedule must have. Spans are capped (`WINDOW`,
`SPAN_TARGETS`) to keep long traces cheap; a span left out only loosens the bound.

The same bound limits latency percentiles (`ttft_floors`): if at most k - 1 of a set of requests
can have their first token within a target, the k-th fastest of them comes later than it, in any
schedule that serves them all.
"""

from __future__ import annotations

import bisect
import statistics

import numpy as np

# Spans considered: at most this many requests and this many targets long (bounds the cost on long,
# busy traces; leaving spans out only loosens the bound)
WINDOW = 256
SPAN_TARGETS = 16
SLACK = 1e-9  # relative: a schedule that fits exactly counts as in time, float rounding included
STEP = 1.01  # successive targets of `ttft_floors`, 1% apart


def forward_line(time_forward, sizes: list[int], repeats: int = 5) -> tuple[float, float]:
    """`(fixed, per_token)` seconds: a line under the median of `repeats` timings of
    `time_forward(n)` (seconds for one forward over n tokens) at each n in `sizes` (at least two;
    the sizes alternate, so that a slow spell of the machine touches them all). The line goes
    through the smallest forward's median with the least slope that keeps every other median on or
    above it (the smallest forward's time is the steadiest and almost all fixed cost); where that
    line would cross zero, through the origin instead. Both parts are >= 0."""
    if len(set(sizes)) < 2 or min(sizes) < 1:
        raise ValueError(f"forward_line needs at least two different sizes of >= 1 token, got {sizes}")
    sizes = sorted(set(sizes))
    time_forward(sizes[-1])  # warm-up
    timings = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            timings[n].append(time_forward(n))
    medians = {n: statistics.median(t) for n, t in timings.items()}
    first = sizes[0]
    per_token = max(0.0, min((medians[n] - medians[first]) / (n - first) for n in sizes[1:]))
    fixed = min(medians[n] - per_token * n for n in sizes)
    if fixed < 0:
        per_token, fixed = min(medians[n] / n for n in sizes), 0.0
    return fixed, per_token


def uncached_tokens(prompts: list[list[int]], arrivals: list[float], ttft: float) -> list[int]:
    """Per request, its prompt tokens less the longest prefix it shares with another request that
    arrives before its deadline (`arrival + ttft`); at least 1."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])  # neighbours share the longest prefixes
    rank = {i: r for r, i in enumerate(order)}
    out = []
    for j, prompt in enumerate(prompts):
        shared = 0
        for step in (-1, 1):  # the nearest eligible neighbour on each side shares the most
            r = rank[j] + step
            while 0 <= r < len(order) and arrivals[order[r]] > arrivals[j] + ttft:
                r += step
            if 0 <= r < len(order):
                shared = max(shared, common_prefix(prompt, prompts[order[r]]))
        out.append(max(1, len(prompt) - shared))
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def most_in_time(arrivals: list[float], works: list[float], ttft: float, fixed: float) -> int:
    """The most requests any schedule can give their first token within `ttft` of arrival, when
    request i needs `works[i]` seconds of forwards after it arrives and each forward costs `fixed`
    more (see the module's docstring)."""
    if ttft <= 0:
        raise ValueError(f"the time-to-first-token target must be > 0, got {ttft}")
    order = np.argsort(arrivals, kind="stable")
    t = np.asarray(arrivals, dtype=float)[order]
    w = np.asarray(works, dtype=float)[order]
    n = len(t)
    after = np.searchsorted(t, t + ttft, side="left")  # the first request a span ending at t[k] + ttft leaves out
    misses = np.zeros(n + 1, dtype=int)  # misses[i]: misses that disjoint spans force among requests i..
    for i in range(n - 1, -1, -1):
        best = misses[i + 1]
        kept: list[float] = []
        for k in range(i, min(n, i + WINDOW)):
            if t[k] - t[i] > SPAN_TARGETS * ttft:
                break
            bisect.insort(kept, w[k])
            room = t[k] + ttft - t[i] - fixed
            fit = int(np.searchsorted(np.cumsum(kept), room + SLACK * max(1.0, abs(room)), side="right"))
            best = max(best, len(kept) - fit + misses[after[k]])
        misses[i] = best
    return n - int(misses[0])


def ttft_floors(in_time, count: int, start: float) -> list[float]:
    """Lower bounds on the sorted times to first token of `count` requests in any schedule that
    serves them all: the k-th fastest first token among them takes longer than `floors[k - 1]`
    seconds. `in_time(target)` is an upper bound on how many of the requests can be in time at
    `target` (`most_in_time` on them), read on targets 1% apart from `start` (> 0) up to the first
    that allows all `count`. `floors[k - 1]` is the longest target read at which fewer than k can be
    in time (0.0 where none is): more time never serves fewer, so that bounds every shorter target
    too, whatever the counts read before it; between targets it rounds down, the safe side."""
    if start <= 0:
        raise ValueError(f"the first target must be > 0, got {start}")
    targets, counts = [start], [in_time(start)]
    while counts[-1] < count:
        targets.append(targets[-1] * STEP)
        counts.append(in_time(targets[-1]))
    return [max((t for t, c in zip(targets, counts) if c < k), default=0.0) for k in range(1, count + 1)]
