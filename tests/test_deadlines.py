"""The order that gives the most prompts their first tokens in time (Moore and Hodgson's rule)."""

from __future__ import annotations

import itertools
import random

from hf_paged_kv.engine.deadlines import all_in_time, in_time_first


def linear(per_token: float = 0.001, start: float = 0.0):
    return lambda work: start + work * per_token


def in_time_count(order, deadline, tokens, finish) -> int:
    work, count = 0, 0
    for prompt in order:
        work += tokens[prompt]
        count += finish(work) <= deadline[prompt]
    return count


def test_the_queue_order_stands_when_it_keeps_every_prompt_in_time():
    tokens = {"short": 10, "middle": 50, "long": 120}
    deadline = {"long": 0.4, "short": 0.5, "middle": 0.5}
    queue = ["short", "middle", "long"]  # shortest first: the long one still ends at 0.18 s
    assert in_time_first(queue, deadline.get, tokens.get, linear()) == queue


def test_a_long_prompt_due_first_goes_first_where_shorter_ones_would_make_it_late():
    tokens = {"a": 60, "b": 60, "long": 300}
    deadline = {"long": 0.35, "a": 0.5, "b": 0.5}
    queue = ["a", "b", "long"]  # shortest first, the long one ends at 0.42 s, past 0.35
    assert not all_in_time(queue, deadline.get, tokens.get, linear())
    order = in_time_first(queue, deadline.get, tokens.get, linear())
    assert order == ["long", "a", "b"]
    assert all_in_time(order, deadline.get, tokens.get, linear())


def test_where_not_all_can_be_in_time_the_longest_gives_way():
    tokens = {"long": 300, **{f"s{i}": 60 for i in range(5)}}
    deadline = {"long": 0.35, **{f"s{i}": 0.5 for i in range(5)}}
    queue = [f"s{i}" for i in range(5)] + ["long"]
    # the long one first keeps 4 of 6 in time; the five short ones first keep 5
    assert in_time_first(queue, deadline.get, tokens.get, linear()) == queue


def test_no_order_keeps_more_prompts_in_time():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 6)
        names = list(range(n))
        tokens = {i: rng.randint(1, 300) for i in names}
        deadline = {i: rng.uniform(0.0, 0.8) for i in names}
        finish = linear(start=rng.uniform(0.0, 0.1))
        order = in_time_first(names, deadline.get, tokens.get, finish)
        assert sorted(order) == names
        best = max(in_time_count(p, deadline, tokens, finish) for p in itertools.permutations(names))
        assert in_time_count(order, deadline, tokens, finish) == best
