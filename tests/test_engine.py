"""The serving engine: each request's greedy tokens equal `generate` with DynamicCache for that
request alone, whatever it was batched with, preempted or not; cancellation, threads, seeded
sampling, streaming, load shedding and shared prefixes."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading

import numpy as np
import pytest
import torch
from conftest import VOCAB, assert_pool_clean, make_model, manual_clock
from tiny_models import build
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import Engine, KVPool, Overloaded, PagedKVError, UnsupportedModelError
from hf_paged_kv.engine import SLO, EngineConfig, Limits, RequestFailed, Thresholds

NEW = 10


def prompts(lengths, seed=0):
    return [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed + i)).tolist()
            for i, n in enumerate(lengths)]


def alone(model, prompt, new=NEW):
    """What `generate` gives for this request alone, with the default cache (it stops after the
    model's EOS token, as the engine does by default)."""
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(),
                         max_new_tokens=new, do_sample=False)
    generated = out[0, len(prompt):].tolist()
    return generated[: generated.index(2) + 1] if 2 in generated else generated


@pytest.fixture(params=["llama", "mistral", "gpt2"])
def model(request):
    model = make_model(request.param, seed=3)
    yield model
    hf_paged_kv.disable(model)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2", "qwen2", "gemma2"])
def test_batched_requests_equal_generate_alone(arch):
    """Decodes of sequences of different lengths attend in one padded call (under Mistral's and
    Gemma-2's windows each from its own first visible key; Gemma-2 soft-caps too)."""
    model = make_model(arch, seed=3)
    batch = prompts([5, 17, 33, 40, 9, 64, 1, 23])
    expected = [alone(model, p) for p in batch]
    engine = Engine(model, pool=KVPool(num_blocks=96, block_size=8), max_batch_tokens=48)
    with engine:
        handles = [engine.submit(p, max_new_tokens=NEW) for p in batch]
        assert [h.result(timeout=120) for h in handles] == expected
    stats = engine.stats()
    assert stats["requests_finished"] == 8 and stats["max_running"] >= 4
    assert stats["tokens_generated"] == sum(map(len, expected))
    assert_pool_clean(engine.pool)


@pytest.mark.parametrize("controller", [False, True])
def test_preempted_requests_resume_with_identical_output(controller, caplog):
    """A pool too small for all of them at once: sequences are preempted (full blocks stay
    cached, the partial one is swapped or recomputed) and still give generate's tokens, with
    the controller's admission rules or without; every preemption is logged."""
    caplog.set_level(logging.INFO, logger="hf_paged_kv.engine")
    model = make_model("llama", seed=4)
    batch = prompts([30, 26, 35, 28, 31, 33], seed=10)
    expected = [alone(model, p, new=24) for p in batch]
    optimistic = Limits(max_batch_tokens=64, growth_ratio_init=0.0, growth_ratio_min=0.0)  # admit, then preempt
    # every request queued before the loop starts, and the controller kept in its normal state (a
    # long dwell): on a busy machine the first steps could otherwise see only some of them, or
    # pressure reserve room for growth, and nothing needed preempting
    engine = Engine(model, pool=KVPool(num_blocks=24, block_size=8), limits=optimistic, controller=controller,
                    slo=SLO() if controller else None, thresholds=Thresholds(dwell=600.0))
    engine.accepting = True
    handles = [engine.submit(p, max_new_tokens=24) for p in batch]
    with engine:
        results = [h.result(timeout=180) for h in handles]
    assert results == expected
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["requests_failed"] == 0
    # a preempted request coming back counts neither its own blocks as inherited nor a second
    # queue wait, and what it computes again is counted apart from the prompts
    assert stats["tokens_prefilled"] == sum(map(len, batch)) and stats["tokens_inherited"] == 0
    assert "hf_paged_kv_queue_time_seconds_count 6.0" in engine.prometheus()
    assert "hf_paged_kv_preemptions_total" in engine.prometheus()
    assert caplog.text.count("preempted request") == stats["preemptions"]
    assert_pool_clean(engine.pool)


def test_many_threads_submitting_at_once(model):
    batch = prompts([7, 19, 25, 11, 30, 3], seed=20)
    expected = [alone(model, p) for p in batch]
    results = {}
    engine = Engine(model, pool=KVPool(num_blocks=96, block_size=8))
    with engine:
        def client(i):
            results[i] = engine.submit(batch[i], max_new_tokens=NEW).result(timeout=120)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(batch))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert [results[i] for i in range(len(batch))] == expected


def test_streaming_sync_and_async(model):
    prompt = prompts([12])[0]
    expected = alone(model, prompt)
    with Engine(model, pool=KVPool(num_blocks=32, block_size=8)) as engine:
        assert list(engine.submit(prompt, max_new_tokens=NEW).stream()) == expected

        async def collect():
            return [t async for t in engine.submit(prompt, max_new_tokens=NEW).astream()]

        assert asyncio.run(collect()) == expected


def test_cancel_stops_a_request_and_frees_its_blocks(model):
    with Engine(model, pool=KVPool(num_blocks=64, block_size=8)) as engine:
        handle = engine.submit(prompts([20])[0], max_new_tokens=10_000, eos_token_id=[])
        first = next(iter(handle.stream()))
        handle.cancel()
        tokens = handle.result(timeout=30)
        assert tokens[0] == first and len(tokens) < 10_000 and handle.outcome == "cancelled"
        other = engine.submit(prompts([8])[0], max_new_tokens=3, eos_token_id=[]).result(timeout=30)
        assert len(other) == 3
    assert engine.stats()["requests_cancelled"] == 1
    assert_pool_clean(engine.pool)


def test_eos_stops_like_generate(model):
    prompt = prompts([15], seed=40)[0]
    free_run = alone(model, prompt, new=8)
    eos = free_run[3]  # a token it generates: generation must stop right after it
    with Engine(model, pool=KVPool(num_blocks=32, block_size=8)) as engine:
        got = engine.submit(prompt, max_new_tokens=8, eos_token_id=eos).result(timeout=60)
    assert got == free_run[: free_run.index(eos) + 1]


def test_seeded_sampling_is_reproducible_whatever_the_batch(model):
    prompt = prompts([14], seed=50)[0]
    kwargs = dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=40, top_p=0.9, eos_token_id=[])
    with Engine(model, pool=KVPool(num_blocks=64, block_size=8)) as engine:
        alone_run = engine.submit(prompt, seed=7, **kwargs).result(timeout=60)
        crowd = [engine.submit(p, seed=i, **kwargs) for i, p in enumerate(prompts([9, 30, 21], seed=60))]
        batched = engine.submit(prompt, seed=7, **kwargs).result(timeout=60)
        other_seed = engine.submit(prompt, seed=8, **kwargs).result(timeout=60)
        [h.result(timeout=60) for h in crowd]
    assert batched == alone_run and other_seed != alone_run


def test_requests_sharing_a_prefix_compute_it_once():
    """A burst of requests with one system prompt: the first computes it, the others wait for
    its blocks and inherit them."""
    model = make_model("llama", seed=5)
    system = prompts([64], seed=70)[0]
    batch = [system + q for q in prompts([5, 9, 7, 6], seed=80)]
    expected = [alone(model, p) for p in batch]
    engine = Engine(model, pool=KVPool(num_blocks=96, block_size=8), max_batch_tokens=96)
    with engine:
        handles = [engine.submit(p, max_new_tokens=NEW) for p in batch]
        assert [h.result(timeout=120) for h in handles] == expected
    stats = engine.stats()
    assert stats["tokens_inherited"] == 3 * 64  # three of the four inherited the whole system prompt
    assert stats["tokens_prefilled"] == 64 + sum(len(p) - 64 for p in batch)


def test_overloaded_engine_sheds_with_retry_after():
    model = make_model("llama", seed=6)
    engine = Engine(model, pool=KVPool(num_blocks=32, block_size=8), max_waiting=2)
    engine.accepting = True  # accept without running the loop, so the queue fills
    for prompt in prompts([5, 5]):
        engine.submit(prompt, max_new_tokens=4)
    with pytest.raises(Overloaded) as info:
        engine.submit(prompts([5])[0], max_new_tokens=4)
    assert info.value.retry_after == 5.0  # nothing admitted or measured yet: a fixed guess
    assert engine.stats()["requests_rejected"] == 1
    engine.start()
    engine.stop(drain=True)
    hf_paged_kv.disable(model)


def raise_once_in_a_step(engine, error: BaseException, monkeypatch) -> None:
    """`error` raised once, in the scheduler's plan of a step while a request runs."""
    schedule, armed = engine.scheduler.schedule, [True]

    def schedule_failing_once(model):
        if armed and engine.scheduler.running:
            armed.clear()
            raise error
        return schedule(model)

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_failing_once)


def test_a_step_that_fails_fails_the_requests_in_flight_and_the_engine_goes_on(monkeypatch):
    """A bug in a step (here one injected into the scheduler's choice of the next batch) must not
    kill the scheduler thread and leave every request waiting forever: the requests in flight
    fail, told the error's kind (its text may hold another request's data), their blocks go
    back, and the next request is served."""
    from hf_paged_kv.engine import RequestFailed

    model = make_model("llama", seed=6)
    engine = Engine(model, pool=KVPool(num_blocks=32, block_size=8))
    raise_once_in_a_step(engine, RuntimeError("injected fault, tenant 'bob'"), monkeypatch)
    first, second = prompts([9, 12], seed=30)
    with engine:
        with pytest.raises(RequestFailed, match=r"the engine's step failed \(RuntimeError; see the server log\)") as failed:
            engine.submit(first, max_new_tokens=30, eos_token_id=[]).result(timeout=60)
        assert "bob" not in str(failed.value)
        assert engine.submit(second, max_new_tokens=6).result(timeout=60) == alone(model, second, new=6)
    assert engine.stats()["requests_failed"] == 1
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_loop_that_dies_fails_its_requests_instead_of_leaving_them_waiting(monkeypatch):
    """An exception that is no `Exception` (an interrupt or SystemExit in the engine's thread)
    ends the loop: every request queued or in flight fails at once, submit refuses new ones,
    the blocks go back, and the engine starts again."""
    from hf_paged_kv.engine import RequestFailed

    model = make_model("llama", seed=6)
    engine = Engine(model, pool=KVPool(num_blocks=32, block_size=8))
    raise_once_in_a_step(engine, KeyboardInterrupt(), monkeypatch)
    first, second = prompts([9, 12], seed=30)
    engine.start()
    with pytest.raises(RequestFailed, match=r"the engine's loop ended \(KeyboardInterrupt"):
        engine.submit(first, max_new_tokens=30, eos_token_id=[]).result(timeout=60)
    engine.thread.join(timeout=60)
    with pytest.raises(PagedKVError, match="not running"):
        engine.submit(second, max_new_tokens=6)
    engine.stop()
    assert_pool_clean(engine.pool)
    with engine:
        assert engine.submit(second, max_new_tokens=6).result(timeout=60) == alone(model, second, new=6)
    hf_paged_kv.disable(model)


def test_a_temperature_too_small_for_the_scores_samples_their_limit_the_argmax():
    model = make_model("llama", seed=6)
    prompt = prompts([11], seed=31)[0]
    with Engine(model, pool=KVPool(num_blocks=32, block_size=8)) as engine:
        tokens = engine.submit(prompt, max_new_tokens=6, do_sample=True, temperature=1e-45, seed=1).result(timeout=60)
    assert tokens == alone(model, prompt, new=6)
    hf_paged_kv.disable(model)


def test_bad_sampling_arguments_and_token_ids_are_refused_at_submit(model):
    engine = Engine(model, pool=KVPool(num_blocks=32, block_size=8))
    engine.accepting = True  # submit only: nothing runs
    for kwargs, message in ((dict(do_sample=True, temperature=float("nan")), "temperature must be finite"),
                            (dict(top_k=2.5), "top_k must be an integer"), (dict(max_new_tokens=2.5), "integer"),
                            (dict(top_p=float("nan")), "top_p"), (dict(seed="x"), "seed must be an integer"),
                            (dict(do_sample="yes"), "do_sample must be True or False"),
                            (dict(eos_token_id="x"), "eos_token_id must be an integer"),
                            (dict(eos_token_id=[2, VOCAB]), f"eos_token_id outside the model's vocabulary of {VOCAB}")):
        with pytest.raises(ValueError, match=message):
            engine.submit([5, 6, 7], **kwargs)
    with pytest.raises(ValueError, match=f"outside the model's vocabulary of {VOCAB}: \\[{VOCAB}, -1\\]"):
        engine.submit([5, VOCAB, -1])
    for kwargs, message in ((dict(priority=None), "priority must be an integer"), (dict(priority="1"), "priority"),
                            (dict(priority=True), "priority"), (dict(tenant=""), "tenant must be"),
                            (dict(tenant="__public__"), "other than '__public__'"), (dict(tenant=None), "tenant")):
        with pytest.raises(ValueError, match=message):
            engine.submit([5, 6, 7], **kwargs)
    assert engine.stats()["requests_rejected"] == 0 and engine.stats()["requests_waiting"] == 0
    for prompt, message in ((torch.tensor([[5, 6], [7, 8]]), "one sequence of token ids, got a batch of 2"),
                            ([5.0, 6.0], "integer token ids"), (["5", "6"], "integer token ids")):
        with pytest.raises(ValueError, match=message):
            engine.submit(prompt)
    assert engine.stats()["requests_waiting"] == 0
    assert engine.submit(torch.tensor([[5, 6, 7]])).request.prompt == [5, 6, 7]  # as a tokenizer returns it
    assert engine.submit(np.array([5, 6, 7])).request.prompt == [5, 6, 7]
    handle = engine.submit([5, 6, 7])
    with pytest.raises(ValueError, match="outcome must be 'cancelled' or 'finished', got 'canceled'"):
        engine.cancel(handle, outcome="canceled")
    assert handle.request.cancel_requested is None
    engine.accepting = False


def test_a_row_that_cannot_be_sampled_fails_alone():
    from hf_paged_kv.engine.request import Request, SamplingParams
    from hf_paged_kv.engine.sampling import sample

    broken, fine = (Request([5], SamplingParams(do_sample=True, seed=1)) for _ in range(2))
    fine.generator = torch.Generator().manual_seed(1)
    broken.generator = "not a generator"
    chosen = sample(torch.randn(2, VOCAB), [broken, fine])
    assert isinstance(chosen[0], Exception) and isinstance(chosen[1], int)
    broken.generator = torch.Generator().manual_seed(1)
    scores = torch.randn(2, VOCAB)
    scores[0, 3] = float("nan")  # a broken forward's scores fail their row, not turn into the argmax
    scores[1, 4] = float("-inf")  # an impossible token is a score, not a fault
    chosen = sample(scores, [broken, fine])
    assert isinstance(chosen[0], ValueError) and "NaN" in str(chosen[0]) and isinstance(chosen[1], int)
    greedy = Request([5], SamplingParams())
    assert isinstance(sample(scores[:1], [greedy])[0], ValueError)  # greedy too: no argmax of NaNs
    assert SamplingParams(top_k=np.int64(5)).top_k == 5 and type(SamplingParams(top_k=np.int64(5)).top_k) is int
    for top_k in (2.0, float("inf"), True):
        with pytest.raises(ValueError, match="top_k must be an integer"):
            SamplingParams(top_k=top_k)


def test_a_forward_that_fails_for_one_request_fails_only_that_one():
    """GPT-2's positions are learned (1024 here): the forward in which a request runs past them
    fails. The others in that forward are run again without it and served."""
    from hf_paged_kv.engine import RequestFailed

    model = make_model("gpt2", seed=8)
    short, too_long = prompts([9, 1020], seed=32)
    expected = alone(model, short, new=8)
    engine = Engine(model, pool=KVPool(num_blocks=160, block_size=8), max_batch_tokens=2048)
    engine.accepting = True  # both queued before the first step: they share its forward
    handles = [engine.submit(short, max_new_tokens=8), engine.submit(too_long, max_new_tokens=20, eos_token_id=[])]
    with engine:
        assert handles[0].result(timeout=60) == expected
        with pytest.raises(RequestFailed, match="forward failed"):
            handles[1].result(timeout=60)
    assert engine.stats()["requests_failed"] == 1
    assert len(engine.scheduler.costs.steps()) == engine.stats()["steps"] - 1  # all but the step run row by row
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)


def test_a_reader_whose_event_loop_closed_leaves_nothing_for_the_engine_to_trip_on():
    """An `astream` reader given up on (a timeout) inside an event loop that then closes: the
    engine pushing the next token must not raise (it did, and the scheduler thread died)."""
    import asyncio

    from hf_paged_kv.engine.request import TokenStream

    stream = TokenStream()

    async def first_token():
        async for token in stream:
            return token

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(first_token(), 0.05))  # waiting, cancelled; that loop is closed now
    assert not stream.waiters
    stream.push(7)
    loop = asyncio.new_event_loop()  # and a waiter whose loop closed before it could be removed
    stream.waiters.append((loop, loop.create_future()))
    loop.close()
    stream.push(8)
    stream.close()
    assert list(stream) == [7, 8] and not stream.waiters


def test_stop_and_start_and_a_submit_racing_with_stop(model):
    """A submit whose tokenization outlasts a concurrent stop() is refused, never lost; a stop
    that timed out leaves its loop running, and start() refuses to add a second one."""

    tokenizing, stopped = threading.Event(), threading.Event()

    class SlowTokenizer:
        def __call__(self, text):
            tokenizing.set()
            stopped.wait(10)
            return {"input_ids": [5, 6, 7]}

    engine = Engine(model, tokenizer=SlowTokenizer(), pool=KVPool(num_blocks=64, block_size=8)).start()
    outcome = []

    def submit():
        try:
            outcome.append(engine.submit("hello", max_new_tokens=2))
        except PagedKVError as error:
            outcome.append(error)

    thread = threading.Thread(target=submit)
    thread.start()
    tokenizing.wait(10)
    engine.stop()
    stopped.set()
    thread.join()
    assert isinstance(outcome[0], PagedKVError) and "stopped while the request was being submitted" in str(outcome[0])
    assert engine.stats()["requests_submitted"] == 0  # refused at the gate: never submitted
    engine.start()
    long = engine.submit(prompts([9], seed=34)[0], max_new_tokens=400, eos_token_id=[])
    engine.stop(drain=True, timeout=0.01)
    with pytest.raises(PagedKVError, match="still stopping"):
        engine.start()
    assert len(long.result(timeout=60)) == 400
    engine.thread.join(60)  # the loop drains and ends by itself: start() needs no second stop()
    engine.start()
    assert engine.submit([5, 6, 7], max_new_tokens=2).result(timeout=60)
    engine.stop()
    assert_pool_clean(engine.pool)


def test_one_token_prompts_ending_in_one_forward_are_counted(model):
    engine = Engine(model, pool=KVPool(num_blocks=32, block_size=8), controller=False)
    engine.accepting = True
    handles = [engine.submit([5 + i], max_new_tokens=1) for i in range(4)]  # all four end in the first forward
    with engine:
        for handle in handles:
            handle.result(timeout=60)
    stats = engine.stats()
    assert stats["steps"] == 1 and stats["max_running"] == 4 and stats["tokens_prefilled"] == 4
    assert_pool_clean(engine.pool)


def test_a_request_only_the_watermark_turns_away_is_admitted_when_nothing_runs(model):
    engine = Engine(model, pool=KVPool(num_blocks=8, block_size=8), limits=Limits(watermark=0.5), controller=False)
    with engine:  # 6 of 8 blocks, more than the watermark leaves free: it would wait forever
        assert len(engine.submit(prompts([40], seed=35)[0], max_new_tokens=4, eos_token_id=[]).result(timeout=60)) == 4
    assert_pool_clean(engine.pool)


def test_a_shared_prefix_computed_again_after_it_expired_is_inherited_at_once():
    """A request sharing a prefix that another is computing waits for those blocks until the
    index takes them. An expired copy of the prefix kept its name, so the index did not take
    the new blocks and the wait lasted until the other request had finished generating."""
    model = make_model("llama", seed=9)
    pool = KVPool(num_blocks=64, block_size=8, ttl=10)
    clock = manual_clock(pool)
    prefix = prompts([32], seed=36)[0]
    first, second = (prefix + tail for tail in prompts([8, 8], seed=37))
    with Engine(model, pool=pool, controller=False, max_batch_tokens=16) as engine:
        engine.submit(prefix + [5], max_new_tokens=1).result(timeout=60)  # indexed at t = 0 ...
        clock[0] = 100.0  # ... and expired now, its name still taken
        long = engine.submit(first, max_new_tokens=30, eos_token_id=[])
        short = engine.submit(second, max_new_tokens=2, eos_token_id=[])
        assert short.result(timeout=60) == alone(model, second, new=2)
        long.result(timeout=60)
    assert short.request.last_token < long.request.last_token and short.timings["inherited"] == 32
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


def test_engine_and_generate_share_cached_prefixes():
    model = make_model("llama", seed=7)
    system = prompts([48], seed=90)[0]
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=8))
    hf_paged_kv.publish(model, system)
    with Engine(model) as engine:
        got = engine.submit(system + [5, 6, 7], max_new_tokens=NEW).result(timeout=60)
    assert engine.stats()["tokens_inherited"] == 48
    hf_paged_kv.disable(model)
    assert got == alone(model, system + [5, 6, 7])
    assert_pool_clean(pool)


def test_a_request_larger_than_the_pool_fails_alone_and_clearly():
    """A prompt beyond what the whole pool holds fails with RequestFailed at admission; a request
    that outgrows the pool while generating ends there with the tokens it has, as at the end of
    a context (none is lost, none streamed twice); the others are served."""
    from hf_paged_kv.engine import RequestFailed

    model = make_model("llama", seed=9)
    with Engine(model, pool=KVPool(num_blocks=8, block_size=8)) as engine:  # 64 tokens of KV
        too_long = engine.submit(prompts([80])[0], max_new_tokens=4)
        outgrows = engine.submit(prompts([40])[0], max_new_tokens=60, eos_token_id=[])
        fine = engine.submit(prompts([10])[0], max_new_tokens=4)
        with pytest.raises(RequestFailed, match="more than the pool can hold"):
            too_long.result(timeout=60)
        streamed = list(outgrows.stream())
        # 40 + 24 tokens fill its 8 blocks (the last one sampled needs no KV of its own)
        assert streamed == outgrows.result(timeout=60) and 23 <= len(streamed) <= 25
        expected = alone(model, prompts([40])[0], len(streamed))  # up to the model's EOS, which this one ignores
        assert streamed[: len(expected)] == expected
        assert len(fine.result(timeout=60)) >= 1
    assert engine.stats()["requests_failed"] == 1 and engine.stats()["requests_finished"] == 2
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)


def test_a_request_sharing_a_pinned_prefix_fits_beside_it():
    """Pinned blocks the request inherits cost it nothing: only the pins of other prefixes shrink
    what the pool can hold for it, and the refusal names them."""
    from hf_paged_kv.engine import RequestFailed

    model = make_model("llama", seed=9)
    prefix, tail, other = prompts([32, 30, 62], seed=40)
    with Engine(model, pool=KVPool(num_blocks=10, block_size=8, pin_budget=0.5), controller=False) as engine:
        pin = hf_paged_kv.pin(model, prefix)  # 4 of the 10 blocks
        shares = engine.submit(prefix + tail, max_new_tokens=2)  # 8 blocks, 4 of them the pinned ones
        assert shares.result(timeout=60) == alone(model, prefix + tail, 2)
        with pytest.raises(RequestFailed, match="8 blocks of 8.*10 blocks, 4 of them pinned"):
            engine.submit(other, max_new_tokens=2).result(timeout=60)
        hf_paged_kv.unpin(model, pin)
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)


def test_a_request_outgrowing_the_room_pins_leave_it_ends_with_its_tokens():
    """Pins of another prefix leave a running request less than the pool: it ends there with
    what it streamed (as at the end of a context), never failed with its tokens lost."""
    model = make_model("llama", seed=9)
    prefix, other = prompts([32, 20], seed=41)
    with Engine(model, pool=KVPool(num_blocks=10, block_size=8, pin_budget=0.5), controller=False) as engine:
        pin = hf_paged_kv.pin(model, prefix)  # 4 of the 10 blocks: 48 tokens left for the other
        handle = engine.submit(other, max_new_tokens=60, eos_token_id=[])
        tokens = handle.result(timeout=60)
        assert handle.request.outcome == "finished" and 27 <= len(tokens) <= 29
        hf_paged_kv.unpin(model, pin)
    assert engine.stats()["requests_failed"] == 0
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)


def test_automatic_hot_pins_give_way_to_a_request_that_needs_their_room():
    """Hot-spot pins are a cache policy, not a promise: a request that fits the pool only without
    them unpins them, and is served whole."""
    model = make_model("llama", seed=9)
    hot, other = prompts([24, 60], seed=43)
    pool = KVPool(num_blocks=10, block_size=8, pin_budget=0.5, hot_threshold=2.0)
    with Engine(model, pool=pool, controller=False) as engine:
        for _ in range(4):  # the prefix gets hot: pinned automatically
            engine.submit(hot + [5], max_new_tokens=1).result(timeout=60)
        assert any(p["reason"] == "hot" for p in pool.stats()["pins"])
        handle = engine.submit(other, max_new_tokens=16, eos_token_id=[])  # 76 tokens of KV: 10 blocks
        assert len(handle.result(timeout=60)) == 16 and handle.request.outcome == "finished"
    assert not any(p["reason"] == "hot" for p in pool.stats()["pins"])
    hf_paged_kv.disable(model)


def test_a_request_that_ended_before_its_intake_never_runs(model):
    """A cancel handled before the loop takes the request in (submit and cancel racing the
    loop's intake) ends it for good: it is never queued, run, or counted twice, and a draining
    stop() returns."""
    engine = Engine(model, pool=KVPool(num_blocks=16, block_size=8))
    engine.accepting = True  # accept without running the loop: the request sits in the intake queue
    handle = engine.submit([5, 6, 7], max_new_tokens=4)
    handle.request.ask_to_stop("cancelled")  # handle.cancel(), and the loop handling it before its intake:
    engine.outcomes.end(handle.request, "cancelled")
    engine.start()
    engine.stop(drain=True, timeout=10)
    assert engine.thread is None and handle.result(timeout=1) == []
    stats = engine.stats()
    assert stats["requests_cancelled"] == 1 and stats["requests_finished"] == 0 and stats["tokens_generated"] == 0
    assert stats["requests_running"] == 0 and stats["blocks_used"] == 0
    hf_paged_kv.disable(model)


def test_a_fault_that_repeats_every_pass_does_not_keep_stop_waiting(model, monkeypatch):
    engine = Engine(model, pool=KVPool(num_blocks=16, block_size=8))

    def broken(*_):
        raise RuntimeError("fails every time")

    monkeypatch.setattr(engine.load, "tick", broken)  # logged once, fails nothing
    monkeypatch.setattr(engine.scheduler, "schedule", broken)  # fails every step
    with engine:
        handle = engine.submit([5, 6, 7], max_new_tokens=4)
        with pytest.raises(RequestFailed, match="step failed"):
            handle.result(timeout=10)
        engine.stop(drain=False, timeout=10)
    assert engine.thread is None
    hf_paged_kv.disable(model)


def test_stop_ends_what_is_queued_when_no_loop_runs_and_cancel_checks_the_engine(model):
    engine = Engine(model, pool=KVPool(num_blocks=16, block_size=8))
    engine.accepting = True  # requests queued, but the loop never started
    handle = engine.submit([5, 6, 7], max_new_tokens=4)
    engine.stop()
    assert handle.done and handle.result(timeout=1) == [] and handle.request.outcome == "cancelled"
    other = Engine(model, pool=engine.pool)
    with pytest.raises(ValueError, match="another engine"):
        other.cancel(handle)
    hf_paged_kv.disable(model)


def test_a_request_memory_turns_away_is_looked_up_once_not_every_step():
    """While memory turns a request away, admission probes its cached prefix without inheriting
    it: no lookup counted, no block touched, nothing fed to the hot-spot pins for each step it
    waits."""
    model = make_model("llama", seed=9)
    prefix, first, long, second = prompts([24, 4, 20, 5], seed=50)
    limits = Limits(watermark=0.9, max_running=4, max_batch_tokens=64)  # while one runs, 28 blocks stay free
    with Engine(model, pool=KVPool(num_blocks=32, block_size=8), limits=limits, controller=False) as engine:
        engine.submit(prefix + first, max_new_tokens=1).result(timeout=60)  # leaves the prefix cached
        before = engine.stats()["lookups"]
        running = engine.submit(long, max_new_tokens=40, eos_token_id=[])
        next(iter(running.stream()))
        waiting = engine.submit(prefix + second, max_new_tokens=2)
        assert len(running.result(timeout=60)) == 40
        assert waiting.result(timeout=60) == alone(model, prefix + second, 2)
        assert waiting.timings["admitted"] >= running.timings["finished"]  # it waited the whole decode
        stats = engine.stats()
    assert stats["lookups"] - before == 2, stats["lookups"] - before  # each request's admission, once
    assert stats["blocks_pinned"] == 0
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)


def test_a_model_whose_rope_scales_with_length_is_served_within_its_original_context():
    """One packed forward gives every request in it the RoPE frequencies of its longest
    position: the engine serves such a model only where they stay fixed, and there exactly."""
    from test_reuse import length_scaled_rope_model

    model = length_scaled_rope_model("dynamic")
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 20, 9)]
    with Engine(model, pool=KVPool(num_blocks=32, block_size=8), max_batch_tokens=16) as engine:
        handles = [engine.submit(p, max_new_tokens=8) for p in prompts] + [engine.submit(prompts[1], max_new_tokens=12)]
        expected = [alone(model, p, new=8) for p in prompts] + [alone(model, prompts[1], new=12)]  # 32: on the limit
        assert [h.result(timeout=60) for h in handles] == expected
        with pytest.raises(ValueError, match="max_new_tokens=13 pass max_model_len=32: where this model's RoPE starts"):
            engine.submit(prompts[1], max_new_tokens=13)
        assert engine.max_model_len == 32
        if importlib.util.find_spec("fastapi") is not None:  # the server's default max_tokens fills no more
            from hf_paged_kv.serve.app import OpenAIServer

            assert OpenAIServer(engine, "tiny").context == 32
        model.train()
        with pytest.raises(PagedKVError, match="train mode"):
            engine.submit(prompts[0])
        model.eval()
    hf_paged_kv.disable(model)


def test_a_request_that_fills_the_pool_exactly_is_served():
    """The token that reaches max_new_tokens is never fed back: a 48-token prompt with one new
    token needs 48 tokens of KV, which 12 blocks of 4 hold; it was refused as needing 49."""
    model = make_model("llama", seed=4)
    prompt = torch.randint(3, VOCAB, (48,), generator=torch.Generator().manual_seed(7)).tolist()
    pool = KVPool(num_blocks=12, block_size=4)
    with Engine(model, pool=pool, max_batch_tokens=64) as engine:
        assert engine.submit(prompt, max_new_tokens=1, eos_token_id=[]).result(timeout=60) == alone(model, prompt, new=1)
        with pytest.raises(RequestFailed, match="needs 49 tokens of KV \\(13 blocks of 4\\)"):
            engine.submit(prompt, max_new_tokens=2, eos_token_id=[]).result(timeout=60)
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


@pytest.mark.parametrize("arch", ["kosmos2", "kosmos2_5"])
def test_a_model_whose_packed_forwards_differ_from_generate_is_refused(arch):
    """Kosmos-2 counts positions from a padding offset, which generate's inputs give it and the
    engine's packed forwards do not: its tokens differed from generate's; the engine refuses it
    at construction (generate with a PagedCache serves it)."""
    model = build(arch)
    pool = KVPool(num_blocks=32, block_size=4)
    with pytest.raises(UnsupportedModelError, match="than in generate"):
        Engine(model, pool=pool, controller=False)
    assert_pool_clean(pool)
    assert not hf_paged_kv.is_enabled(model)  # left as it came: generate with a PagedCache serves it
    hf_paged_kv.enable(model, pool=pool)
    hf_paged_kv.disable(model)


def test_the_packing_check_uses_the_models_own_generation_config_cache():
    """The engine checks its packed forwards against generate with the model's own cache: a
    generation config naming a static cache is served (passing a cache beside it was refused)."""
    model = make_model("llama", seed=3)
    prompt = prompts([9])[0]
    expected = alone(model, prompt)
    model.generation_config.cache_implementation = "static"
    with Engine(model, pool=KVPool(num_blocks=32, block_size=4), controller=False) as engine:
        assert engine.submit(prompt, max_new_tokens=NEW).result(timeout=60) == expected
    hf_paged_kv.disable(model)


def test_the_packing_check_runs_greedy_whatever_the_generation_config_and_without_generate():
    """The check's reference is one greedy row: a generation config asking for beams compared
    the winning beam's tokens with the first beam's logits (refused by chance); a model without
    `generate` is checked with two forwards on a DynamicCache."""
    for without_generate in (False, True):
        model = make_model("llama", seed=3)
        prompt = prompts([9])[0]
        expected = alone(model, prompt)
        model.generation_config.num_beams = 4
        if without_generate:
            model.generate = None
        with Engine(model, pool=KVPool(num_blocks=32, block_size=4), controller=False) as engine:
            assert engine.submit(prompt, max_new_tokens=NEW).result(timeout=60) == expected
        hf_paged_kv.disable(model)


@pytest.mark.parametrize("assign", [False, True])
def test_a_request_right_after_the_weights_change_inherits_nothing_of_the_old_ones(assign):
    """The engine re-takes the fingerprint at most once a second, and looks at every weight's
    tensor and version counter at each admitting step: new weights (copied in place or
    assigned) were served the old weights' KV for up to a second."""
    prompt = prompts([40], seed=60)[0]
    other = make_model("llama", seed=2)
    expected = alone(other, prompt, new=8)
    model = make_model("llama", seed=1)
    with Engine(model, pool=KVPool(num_blocks=64, block_size=8), controller=False) as engine:
        engine.submit(prompt, max_new_tokens=8, eos_token_id=[]).result(timeout=60)
        with torch.no_grad():
            model.load_state_dict(other.state_dict(), assign=assign)
        handle = engine.submit(prompt, max_new_tokens=len(expected), eos_token_id=[])
        assert handle.result(timeout=60) == expected
    assert engine.stats()["tokens_inherited"] == 0
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)


def test_without_slo_targets_nothing_is_shed_or_paced():
    """No targets given: no controller, no target-driven rule, no refusal but a full queue. 24
    requests from 4 threads at once into a pool that holds a few of them at a time all finish
    (a default engine once refused 13 of them on a busy machine)."""
    model = make_model("llama", seed=5)
    engine = Engine(model, pool=KVPool(num_blocks=24, block_size=8), max_batch_tokens=32)
    assert engine.load.controller is None
    assert (engine.limits.ttft_target, engine.limits.per_token_target, engine.limits.burst_batch_tokens) == (None,) * 3
    batch = prompts([20 + i % 7 for i in range(24)], seed=40)
    handles = [None] * len(batch)

    def client(first: int) -> None:
        for i in range(first, len(batch), 4):
            handles[i] = engine.submit(batch[i], max_new_tokens=6)

    with engine:
        threads = [threading.Thread(target=client, args=(first,)) for first in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        results = [h.result(timeout=300) for h in handles]
    stats = engine.stats()
    assert all(results) and stats["requests_finished"] == 24 and stats["requests_rejected"] == 0
    assert stats["controller"] == {"state": "off"} and stats["goodput"] is None and stats["availability"] is None
    assert "hf_paged_kv_availability_ratio NaN" in engine.prometheus()
    assert_pool_clean(engine.pool)


def test_load_control_needs_targets():
    model = make_model("llama", seed=5)
    with pytest.raises(ValueError, match="service-level targets"):
        Engine(model, pool=KVPool(num_blocks=16, block_size=8), controller=True)
    assert not hf_paged_kv.is_enabled(model)  # refused before enabling anything
    engine = Engine(model, pool=KVPool(num_blocks=16, block_size=8), slo=SLO(ttft=30.0, per_token=30.0))
    assert engine.load.controller is not None and engine.limits.ttft_target == 30.0
    hf_paged_kv.disable(model)


def test_an_engine_leaves_the_model_as_it_found_it():
    """An engine that enabled the model disables it when it stops (and enables it again on a
    restart), so a second engine with a new pool on the same model just works; one given an
    enabled model leaves it enabled."""
    model = make_model("llama", seed=6)
    prompt = prompts([12], seed=50)[0]
    expected = alone(model, prompt)
    first = Engine(model, pool=KVPool(num_blocks=16, block_size=8))
    for _ in range(2):  # stopped and started again: same pool, same tokens
        with first:
            assert first.submit(prompt, max_new_tokens=NEW).result(timeout=60) == expected
        assert not hf_paged_kv.is_enabled(model)
    second = Engine(model, pool=KVPool(num_blocks=32, block_size=4))
    with second:
        assert second.submit(prompt, max_new_tokens=NEW).result(timeout=60) == expected
    assert not hf_paged_kv.is_enabled(model)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=16, block_size=8))
    with Engine(model) as third:
        assert third.pool is pool and third.submit(prompt, max_new_tokens=NEW).result(timeout=60) == expected
    assert hf_paged_kv.pool_of(model) is pool
    hf_paged_kv.disable(model)


def test_one_config_object_with_the_older_names_still_taken():
    """`EngineConfig` holds what a user tunes; fields may come one by one (older names too), a
    `Limits` given for experiments wins for its sizes, and a wrong name or value is refused."""
    model = make_model("llama", seed=7)
    pool = KVPool(num_blocks=32, block_size=8)
    engine = Engine(model, pool=pool, config=EngineConfig(max_num_seqs=3, max_model_len=40), max_waiting=5)
    assert (engine.limits.max_running, engine.limits.max_batch_tokens, engine.limits.max_waiting) == (3, 512, 5)
    assert engine.config == EngineConfig(max_num_seqs=3, max_model_len=40, max_waiting=5)
    assert Engine(model, max_running=2, max_batch_tokens=16).config.max_num_batched_tokens == 16
    assert Engine(model, limits=Limits(max_running=9), max_num_seqs=2).config.max_num_seqs == 9
    with pytest.raises(TypeError, match="unknown settings \\['max_runing'\\]"):
        Engine(model, max_runing=2)
    for wrong in (dict(max_num_seqs=0), dict(max_model_len=2.5), dict(backend="cuda"), dict(slo=2.0)):
        with pytest.raises(ValueError, match="EngineConfig"):
            EngineConfig(**wrong)
    with engine:
        with pytest.raises(ValueError, match="max_new_tokens=10 pass max_model_len=40: the engine's configured limit"):
            engine.submit(list(range(3, 34)), max_new_tokens=10)
        assert engine.submit(list(range(3, 33)), max_new_tokens=8).result(timeout=60)
    hf_paged_kv.disable(model)
