"""The OpenAI-compatible server over real HTTP (uvicorn on a free local port), with the official
`openai` client as the client: completions and chat, whole and streamed, give the engine's own
tokens; errors come in OpenAI's shape; shedding is a 429 with Retry-After; a client that goes
away cancels its request and leaves no block behind; the `serve` entry point loads a model
directory."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import EOS, PAD, VOCAB, assert_pool_clean, make_model

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

import hf_paged_kv  # noqa: E402
from hf_paged_kv import Engine, KVPool, Overloaded  # noqa: E402
from hf_paged_kv.engine import Limits  # noqa: E402
from hf_paged_kv.serve.app import MAX_STOP_LENGTH, StopMatcher, create_app  # noqa: E402

NAME = "tiny-llama"
SPECIAL = {PAD, EOS}
# user turns start with w04, the others with w05; the assistant's turn starts with w06
CHAT_TEMPLATE = ("{% for m in messages %}{{ 'w04 ' if m['role'] == 'user' else 'w05 ' }}{{ m['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}w06{% endif %}")
EOS_PROMPT = [51, 15, 64, 14, 81, 52]  # its greedy continuation ends with EOS after 17 tokens (seed-11 llama)


def word_tokenizer():
    """Word-level: token i is the word "w%02d" (no word inside another, special ones included), so
    text and token ids map one to one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({word(i): i for i in range(VOCAB)}, unk_token=word(3)))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=word(PAD), eos_token=word(EOS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def word(i: int) -> str:
    return f"w{i:02d}"


def words(ids) -> list[str]:
    return [word(t) for t in ids if t not in SPECIAL]


def text_of(ids) -> str:
    return " ".join(map(word, ids))


@contextlib.contextmanager
def serving(engine, **options):
    """A real uvicorn server on a free port, in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, NAME, **options), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def served():
    model = make_model("llama", seed=11)
    engine = Engine(model, tokenizer=word_tokenizer(), pool=KVPool(num_blocks=128, block_size=8))
    with serving(engine, trust_headers=True) as url:  # X-Tenant and X-Priority taken, as behind a proxy
        yield engine, url
    assert not engine.thread, "the app's lifespan stops the engine"
    hf_paged_kv.disable(model)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="x", max_retries=0)


def direct(engine, ids, new, **kwargs):
    return engine.submit(ids, max_new_tokens=new, **kwargs).result(timeout=60)


def wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_completions_equal_the_engine_token_for_token(served, client):
    engine = served[0]
    for ids, new in ((torch.randint(3, VOCAB, (13,), generator=torch.Generator().manual_seed(1)).tolist(), 12),
                     (EOS_PROMPT, 30)):
        expected = direct(engine, ids, new)
        for prompt in (text_of(ids), ids):  # text, and token ids
            out = client.completions.create(model=NAME, prompt=prompt, max_tokens=new, temperature=0,
                                            extra_body={"return_token_ids": True})
            choice = out.choices[0]
            assert choice.model_extra["token_ids"] == expected and out.model_extra["prompt_token_ids"] == ids
            assert choice.text.split() == words(expected) and choice.text.startswith(" ")  # continues the prompt
            assert choice.finish_reason == ("stop" if expected[-1] == EOS else "length")
            assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(expected))
    assert expected[-1] == EOS and len(expected) < 30  # the second prompt really stopped at EOS


def test_streamed_completion_equals_the_engine(served, client):
    engine = served[0]
    ids = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = direct(engine, ids, 16)
    chunks = list(client.completions.create(model=NAME, prompt=text_of(ids), max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert len(choices) > 2  # really streamed, piece by piece
    assert "".join(c.text for c in choices).split() == words(expected)
    assert [t for c in choices for t in c.model_extra["token_ids"]] == expected
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert chunks[-1].usage.completion_tokens == len(expected) and chunks[-1].usage.prompt_tokens == len(ids)


def test_chat_completions_whole_and_streamed(served, client):
    engine, tokenizer = served[0], served[0].tokenizer
    messages = [{"role": "system", "content": "w07 w08"}, {"role": "user", "content": "w10 w11 w12"},
                {"role": "assistant", "content": "w13"}, {"role": "user", "content": [{"type": "text", "text": "w14"}]}]
    ids = [5, 7, 8, 4, 10, 11, 12, 5, 13, 4, 14, 6]  # the chat template, add_generation_prompt=True
    rendered = tokenizer.apply_chat_template(messages[:3] + [{"role": "user", "content": "w14"}],
                                             add_generation_prompt=True, tokenize=False)
    assert tokenizer(rendered, add_special_tokens=False)["input_ids"] == ids
    expected = direct(engine, ids, 10)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    message = out.choices[0].message
    assert message.role == "assistant" and message.content.split() == words(expected)
    assert out.choices[0].finish_reason == "length" and out.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=10, temperature=0,
                                            stream=True)
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in chunks).split() == words(expected)
    assert chunks[-1].finish_reason == "length"


def test_stop_strings_end_the_text_before_them(served, client):
    engine = served[0]
    ids = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = direct(engine, ids, 12)
    cut = next(i for i in range(3, 11) if expected[i] not in expected[:i] and expected[i] not in SPECIAL)
    stop = f" {word(expected[cut])} "  # a whole word, with the spaces around it (split over two pieces)
    before = engine.stats()
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0, stop=[stop, "zz"])
    assert out.choices[0].text.split() == words(expected[:cut]) and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0, stop=stop,
                                         stream=True)
    pieces = [c.choices[0] for c in streamed]
    assert "".join(p.text for p in pieces).split() == words(expected[:cut]) and pieces[-1].finish_reason == "stop"
    # both count as finished, not cancelled (the stream closing after its stop string cancels again)
    wait_for(lambda: engine.stats()["requests_finished"] == before["requests_finished"] + 2)
    assert engine.stats()["requests_cancelled"] == before["requests_cancelled"]


def test_a_stop_string_longer_than_the_cap_is_refused(client):
    """Matching costs up to a stop string's length per token, on the event loop: the length is capped."""
    at_cap = "w" * MAX_STOP_LENGTH
    assert client.completions.create(model=NAME, prompt="w05", max_tokens=2, stop=[at_cap, "zz"]).choices
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_STOP_LENGTH} characters") as refused:
        client.completions.create(model=NAME, prompt="w05", max_tokens=2, stop=["zz", at_cap + "w"])
    assert refused.value.param == "stop"


def test_the_stop_matcher_holds_back_only_what_may_begin_a_stop_string():
    matcher = StopMatcher(["abcd", "xyz"])
    fed = [matcher.feed(piece) for piece in ("ab", "c", "xa", "bc", "abx", "y")]
    assert fed == [("", False), ("", False), ("abcx", False), ("", False), ("abcab", False), ("", False)]
    assert matcher.feed("qabcdxyz") == ("xyq", True)  # the text ends before the first stop string met


def test_stop_token_ids_end_the_text_as_eos_does(served, client):
    """vLLM's `stop_token_ids`: the token ends generation (`finish_reason: "stop"`), its text is
    left out, its id is counted; also with `ignore_eos`."""
    engine = served[0]
    ids = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = direct(engine, ids, 12)
    cut = next(i for i in range(3, 11) if expected[i] not in expected[:i] and expected[i] not in SPECIAL)
    extra = {"stop_token_ids": [expected[cut]], "return_token_ids": True}
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0, extra_body=extra)
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == expected[: cut + 1] and out.usage.completion_tokens == cut + 1
    assert choice.text.split() == words(expected[:cut]) and choice.finish_reason == "stop"
    streamed = [c.choices[0] for c in client.completions.create(
        model=NAME, prompt=ids, max_tokens=12, temperature=0, stream=True, extra_body=extra | {"ignore_eos": True})]
    assert "".join(c.text for c in streamed).split() == words(expected[:cut])
    assert [t for c in streamed for t in c.model_extra["token_ids"]] == expected[: cut + 1]
    assert streamed[-1].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=NAME, prompt="w05 w06 w07", max_tokens=12, temperature=0.9, top_p=0.95, seed=123)
    first, again = (client.completions.create(**kwargs).choices[0].text for _ in range(2))
    assert first == again


@pytest.mark.parametrize("trusted", [True, False])
def test_tenants_come_from_the_x_tenant_header_only_where_the_operator_trusts_it(trusted):
    """No KV crosses tenants: the same prompt under another tenant computes its prefix again. A
    client picks its tenant by header only where the operator says a proxy sets it."""
    model = make_model("llama", seed=11)
    engine = Engine(model, tokenizer=word_tokenizer(), pool=KVPool(num_blocks=64, block_size=8))
    ids = torch.randint(3, VOCAB, (25,), generator=torch.Generator().manual_seed(4)).tolist()  # 3 full blocks
    with serving(engine, trust_headers=trusted) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

        def inherited(**kwargs) -> int:
            before = engine.stats()["tokens_inherited"]
            client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0, **kwargs)
            return engine.stats()["tokens_inherited"] - before

        assert inherited() == 0 and inherited() == 24  # computed once, then reused (tenant "default")
        assert inherited(extra_headers={"X-Tenant": "acme"}) == (0 if trusted else 24)
        assert inherited(user="zed") == 24  # `user` names the end user, not a tenant
    hf_paged_kv.disable(model)


def test_an_api_key_guards_every_route_but_health_metrics_and_version():
    model = make_model("llama", seed=11)
    engine = Engine(model, tokenizer=word_tokenizer(), pool=KVPool(num_blocks=32, block_size=8))
    with serving(engine, api_key="s3cret") as url:
        body = {"model": NAME, "prompt": "w05 w06", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            answer = httpx.post(url + "/v1/completions", json=body, headers=headers)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", answer.text
            assert answer.headers["x-request-id"]
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.post(url + "/tokenize", json={"prompt": "w05"}).status_code == 401
        for route in ("/health", "/metrics", "/version"):
            assert httpx.get(url + route).status_code == 200, route
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=NAME, prompt="w05 w06", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    hf_paged_kv.disable(model)


def test_tokenize_detokenize_version_and_request_ids(served):
    url = served[1]
    tokens = httpx.post(url + "/tokenize", json={"model": NAME, "prompt": "w05 w06 w07"}).json()
    assert tokens == {"count": 3, "max_model_len": tokens["max_model_len"], "tokens": [5, 6, 7]}
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "w09"}]}).json()
    assert chat["tokens"] == [4, 9, 6]  # the chat template: w04 (user) w09 w06 (the assistant's turn)
    assert httpx.post(url + "/detokenize", json={"model": NAME, "tokens": [5, 6, 7]}).json() == {"prompt": "w05 w06 w07"}
    assert httpx.post(url + "/detokenize", json={"tokens": [999]}).status_code == 400
    assert httpx.post(url + "/tokenize", json={}).status_code == 400
    assert httpx.get(url + "/version").json() == {"version": hf_paged_kv.__version__}
    echoed = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "w05", "max_tokens": 1},
                        headers={"X-Request-Id": "abc-123"})
    assert echoed.headers["x-request-id"] == "abc-123"
    made = {httpx.get(url + "/health").headers["x-request-id"] for _ in range(2)}
    assert len(made) == 2 and all(len(i) == 32 for i in made)


def test_models_metrics_and_health(served, client):
    engine, url = served
    assert [m.id for m in client.models.list()] == [NAME]
    metrics = httpx.get(url + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    for name in ("hf_paged_kv_requests_total", "hf_paged_kv_generated_tokens_total", "hf_paged_kv_kv_usage_ratio",
                 "hf_paged_kv_time_to_first_token_seconds_bucket", "hf_paged_kv_requests_running"):
        assert name in metrics.text
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}



def test_metrics_under_vllms_names_for_a_vllm_dashboard():
    from prometheus_client.parser import text_string_to_metric_families

    from hf_paged_kv.engine import EngineConfig

    model = make_model("llama", seed=11)
    engine = Engine(model, tokenizer=word_tokenizer(), pool=KVPool(num_blocks=64, block_size=8),
                    config=EngineConfig(served_model_name=NAME))
    shared = list(range(10, 35))  # three full blocks, sent twice
    with serving(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        answers = [client.completions.create(model=NAME, prompt=EOS_PROMPT, max_tokens=30, temperature=0)]
        answers += [client.completions.create(model=NAME, prompt=shared, max_tokens=3, temperature=0,
                                              extra_body={"ignore_eos": True}) for _ in range(2)]
        assert [a.choices[0].finish_reason for a in answers] == ["stop", "length", "length"]
        handle = engine.submit([5, 6, 7], max_new_tokens=500, eos_token_id=[])
        next(iter(handle.stream()))  # admitted and generating
        handle.cancel()
        handle.result(timeout=30)
        assert handle.outcome == "cancelled"
        text = httpx.get(url + "/metrics").text
    hf_paged_kv.disable(model)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    label = (("model_name", NAME),)

    def value(name, **labels):
        return samples[name, tuple(sorted({**dict(label), **labels}.items()))]

    assert value("vllm:request_success_total", finished_reason="stop") == 1
    assert value("vllm:request_success_total", finished_reason="length") == 2
    assert value("vllm:request_success_total", finished_reason="abort") == 1
    stats = engine.stats()
    assert value("vllm:generation_tokens_total") == stats["tokens_generated"]
    assert value("vllm:prompt_tokens_total") == value("vllm:prefix_cache_queries_total") == len(EOS_PROMPT) + 2 * 25 + 3
    assert value("vllm:prefix_cache_hits_total") == 24  # the second of the shared prompts: three blocks
    assert value("vllm:time_to_first_token_seconds_count") == 4 and value("vllm:e2e_request_latency_seconds_count") == 3
    assert value("vllm:request_generation_tokens_sum") == sum(a.usage.completion_tokens for a in answers)
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert (gauge, label) in samples, gauge


def test_invalid_or_unsupported_requests_are_400_in_openai_shape(served, client):
    url = served[1] + "/v1/completions"
    base = {"model": NAME, "prompt": "w05 w06", "max_tokens": 2}
    for extra, param in (({"n": 0}, "n"), ({"n": 65, "prompt": ["w05", "w06"]}, "n"), ({"logprobs": 21}, "logprobs"),
                         ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -3}, "presence_penalty"),
                         ({"logit_bias": {"w05": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                         ({"logit_bias": {"999": 1}}, "logit_bias"), ({"min_tokens": 3}, "min_tokens"),
                         ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
                         ({"cache_salt": ""}, "cache_salt"), ({"suffix": "w07"}, "suffix"),
                         ({"temperature": 3}, "temperature"),
                         ({"max_tokens": 5000}, "max_tokens"), ({"prompt": [1, 999]}, "prompt"),
                         ({"prompt": ["w05", ""]}, "prompt"), ({"max_tokens": "many"}, "max_tokens"),
                         ({"max_tokens": True}, "max_tokens"), ({"prompt": [True, 5]}, "prompt"), ({"n": True}, "n"),
                         ({"stop_token_ids": [999]}, "stop_token_ids"), ({"stop_token_ids": [True]}, "stop_token_ids"),
                         ({"skip_special_tokens": 1}, "skip_special_tokens")):  # a bool is a bool

        answer = httpx.post(url, json=base | extra)
        assert answer.status_code == 400, (extra, answer.text)
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"], extra
    assert httpx.post(url, json=base | {"frequency_penalty": 0, "logit_bias": {}, "store": False}).status_code == 200
    for number in (1, 1.0):  # strict numbers still take a JSON integer where a float is expected
        assert httpx.post(url, json=base | {"temperature": number, "top_p": number}).status_code == 200
    public = httpx.post(url, json=base, headers={"X-Tenant": "__public__"})  # the namespace every tenant reads
    assert public.status_code == 400 and "tenant must be" in public.json()["error"]["message"], public.text
    with pytest.raises(openai.BadRequestError, match="at most 128 choices per request"):
        client.completions.create(model=NAME, prompt="w05", n=129)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="w05")
    with pytest.raises(openai.BadRequestError, match="role must be system, developer, user, assistant or tool"):
        client.chat.completions.create(model=NAME, messages=[{"role": "function", "content": "w05", "name": "f"}])
    with pytest.raises(openai.BadRequestError, match="arguments must be a JSON object"):
        client.chat.completions.create(model=NAME, messages=[
            {"role": "user", "content": "w05"}, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}])


VLLM_NEUTRAL = {"repetition_penalty": 1, "min_p": 0, "min_tokens": 0, "skip_special_tokens": True,
                "include_stop_str_in_output": False, "stop_token_ids": []}


def test_a_vllm_client_neutral_extensions_are_accepted(served):
    url = served[1]
    completion = {"model": NAME, "prompt": "w05 w06", "max_tokens": 2} | VLLM_NEUTRAL
    chat = {"model": NAME, "messages": [{"role": "user", "content": "w05"}], "max_tokens": 2,
            "add_generation_prompt": True, "chat_template_kwargs": {}} | VLLM_NEUTRAL
    for route, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        answer = httpx.post(url + route, json=body)
        assert answer.status_code == 200, answer.text



def test_unknown_fields_are_ignored_and_logged_once(served, caplog):
    """A load-testing client sends fields of its own (and vLLM's `continuous_usage_stats`) with
    its defaults: they are accepted, as OpenAI and vLLM accept them."""
    url = served[1] + "/v1/completions"
    body = {"model": NAME, "prompt": "w05 w06", "max_tokens": 2, "whatever": 1, "add_generation_prompt": True}
    with caplog.at_level("WARNING", logger="hf_paged_kv.serve"):
        for _ in range(3):
            answer = httpx.post(url, json=body)
            assert answer.status_code == 200, answer.text
    logged = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert len(logged) == 2 and "'whatever'" in logged[0] + logged[1]  # once per name, not per request
    streamed = httpx.post(url, json=body | {"stream": True, "stream_options": {"include_usage": True, "x": 1}})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def test_penalties_bias_and_min_p_give_the_engines_own_tokens(served, client):
    engine, _ = served
    prompt = [51, 15, 64, 14, 81, 52, 15, 64]
    for extra in ({"repetition_penalty": 1.8}, {"presence_penalty": 2.0, "frequency_penalty": 1.0},
                  {"min_p": 0.2, "temperature": 1.0, "seed": 3}):
        answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                           extra_body=extra | {"return_token_ids": True})
        ours = {k: v for k, v in extra.items() if k not in ("temperature", "seed")}
        sampled = extra.get("temperature", 0) > 0
        expected = direct(engine, prompt, 12, do_sample=sampled, seed=extra.get("seed"), **ours)
        assert answer.choices[0].model_extra["token_ids"] == expected, extra
    plain = direct(engine, prompt, 12)
    assert direct(engine, prompt, 12, repetition_penalty=1.8) != plain  # the parameter changes the tokens
    biased = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, logit_bias={"7": 100})
    assert biased.choices[0].text.split() == ["w07"] * 3


def test_min_tokens_holds_back_the_end_and_stop_strings_can_stay_in_the_text(served, client):
    with_eos = {"logit_bias": {str(EOS): 100}}  # EOS would come first
    answer = client.completions.create(model=NAME, prompt=EOS_PROMPT, max_tokens=10, temperature=0,
                                       extra_body=with_eos | {"min_tokens": 3, "return_token_ids": True})
    ids = answer.choices[0].model_extra["token_ids"]
    assert len(ids) == 4 and ids[-1] == EOS and EOS not in ids[:3] and answer.choices[0].finish_reason == "stop"
    full = client.completions.create(model=NAME, prompt=EOS_PROMPT, max_tokens=6, temperature=0).choices[0].text
    stop = full.split()[2]
    cut = client.completions.create(model=NAME, prompt=EOS_PROMPT, max_tokens=6, temperature=0, stop=[stop])
    kept = client.completions.create(model=NAME, prompt=EOS_PROMPT, max_tokens=6, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop and kept.choices[0].finish_reason == "stop"


def test_special_tokens_are_shown_when_asked(served, client):
    padded = {"logit_bias": {str(PAD): 100}}  # PAD, a special token, every time
    hidden = client.completions.create(model=NAME, prompt="w05 w06", max_tokens=2, temperature=0, extra_body=padded)
    shown = client.completions.create(model=NAME, prompt="w05 w06", max_tokens=2, temperature=0,
                                      extra_body=padded | {"skip_special_tokens": False})
    assert hidden.choices[0].text.strip() == "" and shown.choices[0].text.split() == [word(PAD)] * 2


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(served):
    body = {"model": NAME, "prompt": "w05 w06 w07", "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    answer = httpx.post(served[1] + "/v1/completions", json=body)
    chunks = [json.loads(line[6:]) for line in answer.text.splitlines()
              if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == 3 for c in chunks) and counts == sorted(counts)
    assert counts[0] >= 1 and counts[-1] == 5 and len(set(counts)) > 2


def test_cache_salt_shares_cached_prefixes_only_between_equal_salts(served):
    url = served[1] + "/v1/completions"
    prompt = list(range(10, 42))  # four blocks of 8

    def cached(**extra) -> int:
        body = {"model": NAME, "prompt": prompt, "max_tokens": 1} | extra
        return httpx.post(url, json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="a") == 0
    assert cached(cache_salt="a") == 24  # the full blocks but the last, whose token the forward feeds
    assert cached(cache_salt="b") == 0 and cached() == 0  # another salt, no salt: none of a's
    assert cached(cache_salt="a", user="someone else") == 24  # `user` is no tenant
    tenant = httpx.post(url, json={"model": NAME, "prompt": prompt, "max_tokens": 1, "cache_salt": "a"},
                        headers={"X-Tenant": "acme"})
    assert tenant.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the tenant still counts



def test_n_choices_share_the_prompt_and_seeded_ones_are_reproducible(served, client):
    engine, _ = served
    prompt = list(range(10, 51))  # 41 tokens: five full blocks of 8
    before = engine.stats()
    greedy = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, n=4,
                                       extra_body={"ignore_eos": True})
    after = engine.stats()
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3] and len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.prompt_tokens == 41 and greedy.usage.completion_tokens == 24
    # the prompt is computed once: three samples inherit its five full blocks
    assert after["tokens_prefilled"] - before["tokens_prefilled"] <= 41 + 3 * 8
    assert after["tokens_inherited"] - before["tokens_inherited"] >= 3 * 40
    sampled = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3,
                                        extra_body={"return_token_ids": True})
    tokens = [c.model_extra["token_ids"] for c in sampled.choices]
    assert tokens == [direct(engine, prompt, 8, do_sample=True, seed=5 + k) for k in range(3)]
    assert len({tuple(t) for t in tokens}) > 1  # the samples differ
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w05 w06"}],
                                          max_tokens=3, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == chat.choices[1].message.content


def test_a_list_of_prompts_gives_one_choice_each_in_order(served, client):
    engine, _ = served
    prompts = [[51, 15, 64], [20, 21, 22, 23, 24], [70, 71]]
    answer = client.completions.create(model=NAME, prompt=prompts, max_tokens=5, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in answer.choices] == [direct(engine, p, 5) for p in prompts]
    assert answer.usage.prompt_tokens == 10
    texts = client.completions.create(model=NAME, prompt=["w05 w06", "w07"], max_tokens=2, temperature=0, n=2)
    assert [c.index for c in texts.choices] == [0, 1, 2, 3] and texts.choices[0].text == texts.choices[1].text


def test_several_choices_stream_each_under_its_index(served):
    body = {"model": NAME, "prompt": ["w05 w06", "w07 w08 w09"], "max_tokens": 4, "temperature": 0, "n": 2,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    answer = httpx.post(served[1] + "/v1/completions", json=body)
    assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    text = {i: "" for i in range(4)}
    finished = {}
    for c in chunks:
        for choice in c["choices"]:
            text[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finished[choice["index"]] = choice["finish_reason"]
    whole = httpx.post(served[1] + "/v1/completions",
                       json={k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}).json()
    assert text == {c["index"]: c["text"] for c in whole["choices"]} and finished == dict.fromkeys(range(4), "length")
    assert chunks[-1]["usage"]["completion_tokens"] == 16 and chunks[-1]["usage"]["prompt_tokens"] == 5



def test_logprobs_in_chat_and_completions_whole_and_streamed(served, client):
    engine, url = served
    prompt = [51, 15, 64, 14]
    handle = engine.submit(prompt, max_new_tokens=5, eos_token_id=[], logprobs=3)
    tokens = handle.result(timeout=60)
    expected = handle.request.logprobs  # the engine's, which test_sampling compares with a direct forward
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True})
    logprobs = answer.choices[0].logprobs
    assert logprobs.tokens == [word(t) for t in tokens]
    assert logprobs.token_logprobs == pytest.approx([lp for lp, _ in expected], abs=1e-6)
    assert [list(top) for top in logprobs.top_logprobs] == [[word(t) for t, _ in top] for _, top in expected]
    assert logprobs.text_offset == [3 * i for i in range(5)]  # "w51" is 3 characters
    chat = [{"role": "user", "content": "w05 w06"}]
    whole = client.chat.completions.create(model=NAME, messages=chat, max_tokens=4, temperature=0, logprobs=True,
                                           top_logprobs=2, extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the top one
    streamed = client.chat.completions.create(model=NAME, messages=chat, max_tokens=4, temperature=0, logprobs=True,
                                              top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
    parts = [c for chunk in streamed for choice in chunk.choices if choice.logprobs
             for c in choice.logprobs.content]
    assert [(c.token, c.logprob) for c in parts] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=NAME, messages=chat, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    for body, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs")):
        answer = httpx.post(url + "/v1/chat/completions",
                            json={"model": NAME, "messages": chat, "max_tokens": 2} | body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "w05", "logprobs": 21}).status_code == 400



def test_best_of_returns_the_likeliest_samples_and_echo_the_prompt(served, client):
    engine, url = served
    prompt = [51, 15, 64, 14]
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=1.0, seed=9, n=2,
                                       best_of=4, extra_body={"ignore_eos": True, "return_token_ids": True})
    samples = []
    for k in range(4):  # the four samples the server drew, drawn again: seeds 9..12
        handle = engine.submit(prompt, max_new_tokens=6, do_sample=True, seed=9 + k, eos_token_id=[], logprobs=0)
        tokens = handle.result(timeout=60)
        samples.append((sum(logprob for logprob, _ in handle.request.logprobs), tokens))
    likeliest = [tokens for _, tokens in sorted(samples, key=lambda s: s[0], reverse=True)[:2]]
    assert [c.model_extra["token_ids"] for c in answer.choices] == likeliest and [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].logprobs is None  # ranked by them, not asked for them
    assert answer.usage.completion_tokens == 24  # every sample drawn is billed, as OpenAI does
    echoed = client.completions.create(model=NAME, prompt="w05 w06", max_tokens=2, temperature=0, echo=True)
    plain = client.completions.create(model=NAME, prompt="w05 w06", max_tokens=2, temperature=0)
    assert echoed.choices[0].text == "w05 w06" + plain.choices[0].text
    streamed = client.completions.create(model=NAME, prompt="w05 w06", max_tokens=2, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    for body, param in (({"best_of": 1, "n": 2}, "best_of"), ({"best_of": 3, "stream": True}, "best_of"),
                        ({"echo": True, "logprobs": 1}, "echo"), ({"best_of": 200}, "best_of")):
        answer = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "w05", "max_tokens": 2} | body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_errors_name_the_field_at_fault(served):
    """The prompt when it alone is too long, else the field that set the completion's length, as
    the client spelled it; null for a body that is no JSON object."""
    url = served[1]

    def error(route: str, **request) -> dict:
        answer = httpx.post(url + route, **request)
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]

    def completion(prompt, max_tokens) -> dict:
        return error("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": max_tokens})

    def chat(content: str, **limit) -> dict:
        return error("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": content}]}
                     | limit)

    context = served[0].model.config.max_position_embeddings
    too_long = completion([5] * context, 1)
    assert (too_long["param"], too_long["code"]) == ("prompt", "context_length_exceeded")
    assert "shorten the prompt" in too_long["message"]
    assert completion([5] * (context - 10), 20)["param"] == "max_tokens"  # the sum is too long
    assert chat(" ".join(["w10"] * context), max_tokens=5)["param"] == "messages"
    for limit in (0, context):
        named = chat("w10", max_completion_tokens=limit)
        assert named["param"] == "max_completion_tokens" and "max_tokens" not in named["message"], named
    assert "max_completion_tokens must be at least 1" in chat("w10", max_completion_tokens=0)["message"]
    assert chat("w10", max_tokens=0)["param"] == "max_tokens"
    malformed = error("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert malformed["param"] is None and "character" in malformed["message"]
    assert error("/v1/completions", json=[1, 2])["param"] is None


def test_a_lone_surrogate_or_an_unbounded_priority_is_a_400_for_that_request_alone(served, client):
    """JSON lets a string hold a lone surrogate (text cut inside an emoji): in `user` it reached
    the engine as a tenant that no digest could encode, and the step failed every request in it,
    each told the other's user name; in the prompt, messages or model it was a 500. A 400-digit
    X-Priority failed every request once the controller shed by it."""
    url, engine = served[1], served[0]
    failed = engine.stats()["requests_failed"]
    streaming = client.completions.create(model=NAME, prompt="w05 w06", max_tokens=24, stream=True,
                                          extra_body={"ignore_eos": True})
    raw = {"content-type": "application/json"}
    bodies = [('/v1/completions', '{"model": "%s", "prompt": "w05", "user": "bob\\ud83d"}' % NAME, "body.user"),
              ('/v1/completions', '{"model": "%s", "prompt": "w05 \\ud83d"}' % NAME, "body.prompt"),
              ('/v1/completions', '{"model": "m\\udc00", "prompt": "w05"}', "body.model"),
              ('/v1/chat/completions', '{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d"}]}' % NAME,
               "body.messages[0].content"),
              ('/v1/chat/completions', '{"model": "%s", "messages": [{"\\ud83d": "user"}]}' % NAME,
               "a key of body.messages[0]")]
    for route, body, where in bodies:
        answer = httpx.post(url + route, content=body.encode(), headers=raw)
        assert answer.status_code == 400, answer.text
        assert f"{where} holds a lone surrogate" in answer.json()["error"]["message"]
    answer = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "w05", "max_tokens": 2},
                        headers={"X-Priority": "-" + "9" * 400})
    assert answer.status_code == 400 and "priority must be within" in answer.json()["error"]["message"]
    chunks = list(streaming)  # the request beside them was served whole
    assert len("".join(c.choices[0].text for c in chunks).split()) == 24 and chunks[-1].choices[0].finish_reason == "length"
    assert engine.stats()["requests_failed"] == failed


def test_chat_history_sent_back_as_the_client_received_it(client):
    """An answer's message `model_dump()`-ed into the next request carries the fields of an
    answer this server never fills (refusal, tool_calls, ...), empty: they are dropped. A field
    with content is refused, by name."""
    question, follow_up = {"role": "user", "content": "w10 w11"}, {"role": "user", "content": "w12"}
    answer = client.chat.completions.create(model=NAME, messages=[question], max_tokens=3, temperature=0)
    received = answer.choices[0].message.model_dump()
    assert {"refusal", "tool_calls", "function_call"} <= received.keys()

    def prompt_ids(assistant: dict) -> list[int]:
        out = client.chat.completions.create(model=NAME, messages=[question, assistant, follow_up], max_tokens=1,
                                             extra_body={"return_token_ids": True})
        return out.model_extra["prompt_token_ids"]

    plain = prompt_ids({"role": "assistant", "content": received["content"]})
    assert prompt_ids(received) == plain
    assert prompt_ids(received | {"tool_calls": [], "annotations": [], "audio": {}, "refusal": ""}) == plain
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert prompt_ids(received | {"tool_calls": [call]}) != plain  # a past call is part of the history now
    with pytest.raises(openai.BadRequestError, match="audio") as refused:
        prompt_ids(received | {"audio": {"id": "a1"}})
    assert refused.value.param == "messages[1].audio"


SLOW_TOKENIZERS = [("/v1/completions", "encode", {"prompt": "w05 w06"}),
                   ("/v1/chat/completions", "apply_chat_template", {"messages": [{"role": "user", "content": "w05"}]})]


@pytest.mark.parametrize("route, method, prompt", SLOW_TOKENIZERS)
def test_a_slow_tokenization_does_not_stall_the_server(served, monkeypatch, route, method, prompt):
    """Prompts are tokenized and chat templates applied off the event loop: while one request's
    tokenizer works, the server answers others."""
    tokenizer, url = served[0].tokenizer, served[1]
    working, release = threading.Event(), threading.Event()
    tokenize = getattr(tokenizer, method)

    def slow(*args, **kwargs):
        working.set()
        release.wait(30)
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(tokenizer, method, slow)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, url + route, json={"model": NAME, "max_tokens": 2} | prompt, timeout=30)
        try:
            assert working.wait(5), "the tokenizer was not called"
            assert httpx.get(url + "/health", timeout=2).status_code == 200
        finally:
            release.set()
        assert answer.result().status_code == 200, answer.result().text


def test_a_tiny_temperature_a_negative_seed_message_names_and_stream_options(served, client):
    engine, url = served
    ids = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(6)).tolist()
    greedy = direct(engine, ids, 8)
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=1e-45, seed=-1,
                                    extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == greedy  # sampling's limit as the temperature goes to 0
    answer = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "w05", "max_tokens": 2,
                                                       "stream_options": {"include_usage": True}})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stream_options"
    tokenizer, template = engine.tokenizer, engine.tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}{{ m['name'] ~ ' ' if m['name'] is defined else '' }}"
                               "{{ m['content'] }} {% endfor %}")
    try:  # a message's name reaches a chat template that shows it
        shown = [client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "w10", "name": who}], max_tokens=1,
            extra_body={"return_token_ids": True}).model_extra["prompt_token_ids"] for who in ("w20", "w21")]
    finally:
        tokenizer.chat_template = template
    assert shown == [[20, 10], [21, 10]]


def test_a_chat_without_max_tokens_fills_a_pool_smaller_than_the_context():
    """The default completion length is what the context leaves, but no more than one request
    can hold in the pool: a client that sends no max_tokens is not told to reduce it."""
    from fastapi.testclient import TestClient

    model = make_model("llama", seed=13)
    engine = Engine(model, tokenizer=word_tokenizer(), pool=KVPool(num_blocks=16, block_size=8))  # 128 < 256
    with TestClient(create_app(engine, NAME)) as http:
        answer = http.post("/v1/chat/completions", json={"model": NAME, "ignore_eos": True,
                                                         "messages": [{"role": "user", "content": "w10 w11"}]})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["total_tokens"] == 128 and answer.json()["choices"][0]["finish_reason"] == "length"
    with TestClient(create_app(engine, NAME)) as http:  # a prompt that alone fills the pool: told so
        long = " ".join(f"w{10 + i % 50}" for i in range(130))
        answer = http.post("/v1/chat/completions",
                           json={"model": NAME, "messages": [{"role": "user", "content": long}]})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["code"] == "kv_pool_too_small", answer.text
    assert error["param"] == "messages" and "fills the KV pool (128 tokens" in error["message"]
    with TestClient(create_app(engine, NAME)) as http:  # also with max_tokens: the prompt is at fault
        answer = http.post("/v1/completions", json={"model": NAME, "prompt": [5] * 128, "max_tokens": 1})
    error = answer.json()["error"]
    assert answer.status_code == 400 and (error["param"], error["code"]) == ("prompt", "kv_pool_too_small"), error
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)


def test_an_overloaded_engine_answers_429_with_retry_after():
    model = make_model("llama", seed=12)
    engine = Engine(model, tokenizer=word_tokenizer(), pool=KVPool(num_blocks=128, block_size=8),
                    limits=Limits(max_running=1, max_waiting=2))
    with serving(engine) as url:
        fillers = [engine.submit([5, 6, 7], max_new_tokens=900, eos_token_id=[])]  # runs for seconds
        wait_for(lambda: engine.stats()["requests_running"] == 1)
        with pytest.raises(Overloaded):  # and the queue behind it is full
            for _ in range(10):
                fillers.append(engine.submit([5, 6, 7], max_new_tokens=900, eos_token_id=[]))
        assert len(fillers) == 3
        answer = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "w05", "max_tokens": 2})
        assert answer.status_code == 429, answer.text
        assert int(answer.headers["retry-after"]) >= 1
        assert answer.json()["error"]["code"] == "rate_limit_exceeded"
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w05"}], max_tokens=2)
        for handle in fillers:
            handle.cancel()
        wait_for(lambda: all(h.done for h in fillers))
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)


def cancelled_after(engine, disconnect) -> None:
    """`disconnect()` runs a client that goes away mid-request: its request is cancelled (not
    finished), and every block goes back."""
    before = engine.stats()["requests_cancelled"]
    disconnect()
    wait_for(lambda: engine.stats()["requests_cancelled"] > before and engine.stats()["requests_running"] == 0)
    assert_pool_clean(engine.pool)


def test_a_streaming_client_that_disconnects_cancels_its_request(served):
    engine, url = served
    body = {"model": NAME, "prompt": "w05 w06 w07", "max_tokens": 900, "stream": True, "ignore_eos": True}

    def disconnect():
        with httpx.Client(timeout=30) as http, http.stream("POST", url + "/v1/completions", json=body) as answer:
            assert answer.status_code == 200
            first = next(line for line in answer.iter_lines() if line.startswith("data: "))
            assert '"text"' in first
        # leaving the blocks closes the connection after the first chunk

    cancelled_after(engine, disconnect)


def test_a_waiting_non_streaming_client_that_disconnects_cancels_its_request(served, monkeypatch):
    """The engine's forwards wait until the server cancels the request: however fast the
    machine, the request cannot finish before its client gives up."""
    engine, url = served
    body = {"model": NAME, "prompt": "w08 w09", "max_tokens": 900, "ignore_eos": True}
    cancelled, cancel = threading.Event(), engine.cancel

    def cancel_and_release(handle, outcome="cancelled"):
        cancel(handle, outcome)
        cancelled.set()

    def wait_for_the_cancel(module, args):
        cancelled.wait(30)

    monkeypatch.setattr(engine, "cancel", cancel_and_release)
    hook = engine.model.get_input_embeddings().register_forward_pre_hook(wait_for_the_cancel)

    def disconnect():
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.2))

    try:
        cancelled_after(engine, disconnect)
    finally:
        cancelled.set()
        hook.remove()


class ScriptedHandle:
    """A request handle whose stream gives `tokens`, then ends with `error` (if any)."""

    def __init__(self, tokens, error=None):
        self.tokens, self.error, self.done, self.cancelled = tokens, error, False, False
        self.outcome, self.request = None, SimpleNamespace(inherited=0)

    async def astream(self):
        for token in self.tokens:
            yield token
        self.done, self.outcome = True, "finished" if self.error is None else "failed"
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class ScriptedEngine:
    """Just what the app reads of an engine; `submit` hands out `self.next`."""

    def __init__(self):
        self.tokenizer, self.eos, self.pool = word_tokenizer(), (EOS,), SimpleNamespace(block_size=8, num_blocks=64)
        embeddings = SimpleNamespace(num_embeddings=VOCAB)
        self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=256),
                                     get_input_embeddings=lambda: embeddings)
        self.thread, self.accepting, self.next, self.max_model_len = None, False, None, None

    def start(self):
        self.thread, self.accepting = SimpleNamespace(is_alive=lambda: True), True

    def stop(self, drain=True):
        self.thread, self.accepting = None, False

    def submit(self, ids, **kwargs):
        return self.next


def test_shed_or_failed_requests_get_their_own_status():
    """A request the load controller turns away while it waits is a 429 (streamed or not: the
    status line waits for the first token); a failure is a 500, or an error event once streaming."""
    from fastapi.testclient import TestClient

    from hf_paged_kv.engine.request import RequestFailed

    engine = ScriptedEngine()
    body = {"model": NAME, "prompt": "w05", "max_tokens": 8}
    with TestClient(create_app(engine, NAME)) as http:
        for stream in (False, True):
            engine.next = ScriptedHandle([], Overloaded(2.2, "shed"))
            answer = http.post("/v1/completions", json=body | {"stream": stream})
            assert answer.status_code == 429 and answer.headers["retry-after"] == "3", answer.text
            assert answer.json()["error"]["code"] == "rate_limit_exceeded"
        engine.next = ScriptedHandle([10, 11], RequestFailed("forward failed"))
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error"
        engine.next = ScriptedHandle([10, 11], RequestFailed("forward failed"))
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as answer:
            events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
        assert answer.status_code == 200 and events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:2]).split() == ["w10", "w11"]
        assert json.loads(events[-2])["error"]["message"] == "forward failed"
        assert http.get("/health").status_code == 200
    assert engine.thread is None  # the app stopped its engine


# ------------------------------------------------------------------------------ the entry point
def test_serve_refuses_a_missing_model_directory(tmp_path):
    from hf_paged_kv import serve

    with pytest.raises(SystemExit, match="no such directory"):
        serve.main(["--model", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="no config.json"):
        serve.main(["--model", str(tmp_path)])


def test_serve_says_what_is_wrong_with_its_options_without_a_traceback(tmp_path):
    from hf_paged_kv import serve

    make_model("llama", seed=13).save_pretrained(tmp_path / "no-tokenizer")
    with pytest.raises(SystemExit, match="its tokenizer cannot be loaded"):
        serve.build_app(serve.parse_args(["--model", str(tmp_path / "no-tokenizer"), "--device", "cpu"]))
    word_tokenizer().save_pretrained(tmp_path / "no-tokenizer")
    with pytest.raises(SystemExit, match="error: max_bytes=100 holds no block"):
        serve.build_app(serve.parse_args(["--model", str(tmp_path / "no-tokenizer"), "--max-bytes", "100",
                                          "--device", "cpu"]))
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: this machine's torch sees no CUDA device"):
            serve.build_app(serve.parse_args(["--model", str(tmp_path / "no-tokenizer"), "--device", "cuda"]))
    with pytest.raises(SystemExit, match="--device gpu0"):
        serve.build_app(serve.parse_args(["--model", str(tmp_path / "no-tokenizer"), "--device", "gpu0"]))


def test_serve_builds_an_app_from_a_model_directory(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from hf_paged_kv import serve

    make_model("llama", seed=13).save_pretrained(tmp_path / "tiny")
    word_tokenizer().save_pretrained(tmp_path / "tiny")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    app = serve.build_app(serve.parse_args(["--model", str(tmp_path / "tiny"), "--num-blocks", "32",
                                            "--block-size", "8", "--max-running", "4", "--device", "cpu"]))
    # nothing is downloaded (local_files_only), and the process's environment is left as it was
    assert "HF_HUB_OFFLINE" not in os.environ
    engine = app.state.engine
    assert (engine.pool.num_blocks, engine.pool.block_size, engine.limits.max_running) == (32, 8, 4)
    with TestClient(app) as http:
        out = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "w09 w10"}]})
        assert out.status_code == 200, out.text
        assert out.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                                       "prompt_tokens_details": {"cached_tokens": 0}}
        assert http.get("/health").status_code == 200
    assert engine.thread is None  # stopped with the app
    assert not hf_paged_kv.is_enabled(engine.model)  # the engine enabled it: it leaves it as it came
    assert engine.load.controller is None  # no SLO targets given: nothing shed or paced


def test_serve_takes_vllms_flag_names_and_slo_targets(tmp_path, capsys):
    from hf_paged_kv import serve

    make_model("llama", seed=13).save_pretrained(tmp_path / "tiny")
    word_tokenizer().save_pretrained(tmp_path / "tiny")
    args = serve.parse_args(["--model", str(tmp_path / "tiny"), "--max-num-seqs", "4", "--max-num-batched-tokens",
                             "64", "--max-model-len", "100", "--slo-ttft", "1.5", "--slo-tpot", "0.2",
                             "--num-blocks", "32", "--device", "cpu"])
    assert serve.engine_config(args) == hf_paged_kv.EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100, slo=hf_paged_kv.SLO(ttft=1.5, per_token=0.2),
        served_model_name="tiny")
    app = serve.build_app(args)
    engine = app.state.engine
    assert (engine.limits.max_running, engine.limits.max_batch_tokens, engine.max_model_len) == (4, 64, 100)
    assert engine.load.controller is not None
    from fastapi.testclient import TestClient

    with TestClient(app) as http:
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 100
    hf_paged_kv.disable(engine.model)
    for wrong, message in ((["--slo-ttft", "1"], "give both SLO targets"), (["--slo-ttft", "0", "--slo-tpot", "1"],
                                                                             "--slo-ttft must be a number of seconds")):
        with pytest.raises(SystemExit):
            serve.parse_args(["--model", "x", *wrong])
        assert message in capsys.readouterr().err
