"""Structured output: a request held to a JSON schema gives a document that parses and follows the
schema, greedy or sampled, on a random model that would never write JSON by itself; the rows
beside it in the batch keep their own tokens; a schema that cannot be compiled is refused at
submit. SmolLM2's tokenizer (a real byte-level vocabulary) on a tiny random Llama of its size."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_pool_clean
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_paged_kv
from hf_paged_kv import Engine, KVPool
from hf_paged_kv.engine.grammar import GrammarError

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow  # SmolLM2's tokenizer: converted once from the GGUF package (~30 s)

SCHEMA = {"type": "object",
          "properties": {"status": {"enum": ["new", "paid", "shipped"]}, "gift": {"type": "boolean"},
                         "code": {"type": "string", "maxLength": 4}},
          "required": ["status", "gift", "code"]}


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


@pytest.fixture
def model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    yield model
    hf_paged_kv.disable(model)


def follows_schema(document) -> bool:
    return (isinstance(document, dict) and set(document) == {"status", "gift", "code"}
            and document["status"] in ("new", "paid", "shipped") and isinstance(document["gift"], bool)
            and isinstance(document["code"], str) and len(document["code"]) <= 4)


def test_output_parses_and_follows_the_schema_greedy_or_sampled(model, tokenizer):
    prompt = tokenizer.encode("Write the order as JSON:")
    eos = tokenizer.eos_token_id
    plain = tokenizer.encode("Something else entirely")
    ids = torch.tensor([plain])
    expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(),
                              max_new_tokens=12, do_sample=False, eos_token_id=[], pad_token_id=0)[0, len(plain):]
    pool = KVPool(num_blocks=64, block_size=8)
    with Engine(model, tokenizer=tokenizer, pool=pool) as engine:
        handles = [engine.submit(prompt, max_new_tokens=80, json_schema=SCHEMA),
                   engine.submit(prompt, max_new_tokens=80, json_schema=SCHEMA, do_sample=True, seed=3),
                   engine.submit(prompt, max_new_tokens=80, json_schema=json.dumps(SCHEMA), do_sample=True,
                                 temperature=1.5, seed=4),
                   engine.submit(plain, max_new_tokens=12, eos_token_id=[])]  # batched beside them, unconstrained
        outputs = [h.result(timeout=120) for h in handles]
        free = engine.submit(prompt, max_new_tokens=20, eos_token_id=[]).result(timeout=60)
    for tokens in outputs[:3]:
        assert tokens[-1] == eos, tokenizer.decode(tokens)  # the document ended, and the request with it
        document = json.loads(tokenizer.decode(tokens[:-1]))
        assert follows_schema(document), document
    assert outputs[3] == expected.tolist()
    with pytest.raises(json.JSONDecodeError):  # without the schema the random model writes no JSON
        json.loads(tokenizer.decode(free))
    assert_pool_clean(pool)


def test_any_json_value_and_refusals(model, tokenizer):
    prompt = tokenizer.encode("JSON:")
    with Engine(model, tokenizer=tokenizer, pool=KVPool(num_blocks=64, block_size=8)) as engine:
        tokens = engine.submit(prompt, max_new_tokens=60, json_schema=True).result(timeout=120)
        text = tokenizer.decode(tokens[:-1] if tokens[-1] == tokenizer.eos_token_id else tokens)
        if tokens[-1] == tokenizer.eos_token_id:
            json.loads(text)
        else:  # cut at max_new_tokens: still the start of a JSON text
            assert text.lstrip()[:1] in ('{', '[', '"', '-', 't', 'f', 'n') or text.lstrip()[:1].isdigit(), text
        for schema, message in (({"type": "objekt"}, "cannot be compiled"), ("{not json", "cannot be compiled")):
            with pytest.raises(GrammarError, match=message):
                engine.submit(prompt, json_schema=schema)
        with pytest.raises(ValueError, match="needs an end token"):
            engine.submit(prompt, json_schema=SCHEMA, eos_token_id=[])
        assert engine.stats()["requests_waiting"] == 0


def test_the_server_gives_structured_output_to_the_openai_clients_parse(model, tokenizer):
    from typing import Literal

    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from pydantic import BaseModel, Field
    from test_server import serving

    class Order(BaseModel):
        status: Literal["new", "paid", "shipped"]
        gift: bool
        code: str = Field(max_length=4)

    engine = Engine(model, tokenizer=tokenizer, pool=KVPool(num_blocks=128, block_size=8))
    with serving(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "The order, please."}]
        parsed = client.chat.completions.parse(model="tiny-llama", messages=messages, response_format=Order,
                                               max_tokens=80, temperature=0)
        assert isinstance(parsed.choices[0].message.parsed, Order), parsed.choices[0].message.content
        several = client.chat.completions.create(
            model="tiny-llama", messages=messages, max_tokens=80, n=2, temperature=1.0, seed=1,
            response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA,
                                                                    "strict": True}})
        for choice in several.choices:
            assert choice.finish_reason == "stop" and follows_schema(json.loads(choice.message.content))
        streamed = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=80,
                                                  temperature=0, stream=True, response_format={
                                                      "type": "json_schema", "json_schema": {
                                                          "name": "Order", "schema": Order.model_json_schema()}})
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert Order.model_validate_json(text) == parsed.choices[0].message.parsed
        for response_format, message in (({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
                                          "cannot be compiled"), ({"type": "yaml"}, "must be text, json_object or json_schema"),
                                         ({"type": "json_schema", "json_schema": {"name": "x"}}, "must be a JSON schema")):
            answer = httpx.post(url + "/v1/chat/completions", json={"model": "tiny-llama", "messages": messages,
                                                                    "response_format": response_format})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "response_format", answer.text
            assert message in answer.json()["error"]["message"]
        assert engine.stats()["requests_waiting"] == 0 and engine.stats()["requests_running"] == 0


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}


def test_a_tool_loop_through_the_openai_client(model, tokenizer):
    """A forced call (named, or required among two tools) is one call whose arguments follow the
    function's parameters; its result goes back as a tool message and the conversation goes on;
    streamed, the call arrives whole in one delta."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from test_server import serving

    engine = Engine(model, tokenizer=tokenizer, pool=KVPool(num_blocks=256, block_size=8))
    with serving(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        first = client.chat.completions.create(model="tiny-llama", messages=messages, tools=[WEATHER, TIME],
                                               tool_choice=named, max_tokens=60, temperature=0)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f") and len(arguments["city"]) <= 8
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
        second = client.chat.completions.create(model="tiny-llama", messages=messages, tools=[WEATHER, TIME],
                                                max_tokens=8, temperature=0)
        assert second.choices[0].finish_reason in ("stop", "length")
        required = client.chat.completions.create(model="tiny-llama", messages=messages[:1], tools=[WEATHER, TIME],
                                                  tool_choice="required", max_tokens=60, temperature=1.0, seed=2)
        assert required.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")
        streamed = client.chat.completions.create(model="tiny-llama", messages=messages[:1], tools=[WEATHER, TIME],
                                                  tool_choice=named, max_tokens=60, temperature=0, stream=True)
        chunks = list(streamed)
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.function.name, d.function.arguments) for d in deltas] == [("get_weather", call.function.arguments)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        none = client.chat.completions.create(model="tiny-llama", messages=messages[:1], tools=[WEATHER],
                                              tool_choice="none", max_tokens=4, temperature=0)
        assert none.choices[0].message.tool_calls is None
        for body, param in (({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                             "tool_choice"), ({"tools": [{"type": "function"}]}, "tools"),
                            ({"tool_choice": "required"}, "tool_choice"), ({"tools": [WEATHER], "tool_choice": "maybe"},
                                                                           "tool_choice")):
            answer = httpx.post(url + "/v1/chat/completions",
                                json={"model": "tiny-llama", "messages": messages[:1], "max_tokens": 2} | body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert engine.stats()["requests_running"] == 0


def test_auto_tool_calls_are_parsed_from_the_hermes_tags_and_the_tools_reach_the_prompt(tokenizer):
    from hf_paged_kv.serve.tools import Tools, hermes_messages

    tools = Tools.of([WEATHER, TIME], "auto")
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
            '</tool_call><tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    content, calls = tools.calls(text)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    assert content == 'Let me check. <tool_call>{"name": "nope", "arguments": {}}</tool_call>'  # unknown: text
    assert tools.calls("no call here") == ("no call here", [])
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "name": "get_weather",
                                                                    "arguments": {"city": "Oslo", "unit": "c"}}]},
               {"role": "tool", "content": "cold", "tool_call_id": "1"}]
    rendered = hermes_messages(history, tools)
    assert rendered[0]["role"] == "system" and '"name": "get_weather"' in rendered[0]["content"]
    assert "<tool_call>" in rendered[2]["content"] and rendered[3] == {
        "role": "user", "content": "<tool_response>\ncold\n</tool_response>"}
    prompt = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in prompt and "get_time" in prompt
