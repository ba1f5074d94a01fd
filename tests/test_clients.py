"""The clients and agent frameworks people already use, driving the server unchanged: LangChain
(`ChatOpenAI` with `bind_tools` in a tool loop and `with_structured_output`, `OpenAI.batch` over
a list of prompts) and LiteLLM (completion, streaming). A tiny random Llama with SmolLM2's
tokenizer and chat template serves them: its text is noise, but a forced tool call or a schema
holds it to valid JSON, which is what the clients parse."""

from __future__ import annotations

import json
import os
from typing import Literal

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_paged_kv
from hf_paged_kv import Engine, KVPool

pytest.importorskip("xgrammar")
langchain_openai = pytest.importorskip("langchain_openai")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM would fetch its price list
litellm = pytest.importorskip("litellm")
pytestmark = pytest.mark.slow  # SmolLM2's tokenizer: converted once from the GGUF package (~30 s)

from pydantic import BaseModel, Field  # noqa: E402
from test_server import serving  # noqa: E402

NAME = "tiny-llama"


class Order(BaseModel):
    status: Literal["new", "paid", "shipped"]
    gift: bool
    code: str = Field(max_length=4)


@pytest.fixture(scope="module")
def served(smollm2):
    tokenizer = smollm2[1]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    engine = Engine(model, tokenizer=tokenizer, pool=KVPool(num_blocks=256, block_size=8))
    with serving(engine) as url:
        yield engine, url + "/v1"
    hf_paged_kv.disable(model)


def chat(url: str, **options):
    return langchain_openai.ChatOpenAI(model=NAME, base_url=url, api_key="x", max_retries=0, temperature=0,
                                       **{"max_tokens": 60} | options)


def test_langchain_tool_loop_with_bind_tools(served):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["c", "f"]) -> str:  # bounded: the model is noise
        """The weather in a city."""
        return f"18 degrees {unit} in {city}"

    llm = chat(served[1]).bind_tools([get_weather], tool_choice="get_weather")
    messages = [HumanMessage("What is the weather in Paris?")]
    answer = llm.invoke(messages)
    (call,) = answer.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    result = get_weather.invoke(call["args"])
    messages += [answer, ToolMessage(result, tool_call_id=call["id"])]
    follow_up = chat(served[1], max_tokens=6).bind_tools([get_weather]).invoke(messages)
    assert isinstance(follow_up.content, str)


def test_langchain_structured_output_and_completions_batch(served):
    order = chat(served[1]).with_structured_output(Order).invoke("The order as JSON, please.")
    assert isinstance(order, Order)
    llm = langchain_openai.OpenAI(model=NAME, base_url=served[1], api_key="x", max_retries=0, temperature=0,
                                  max_tokens=5, batch_size=3)
    prompts = ["Once upon a time", "The weather today", "Dear customer", "In the beginning"]
    texts = llm.batch(prompts)
    engine = served[0]
    expected = [engine.tokenizer.decode(engine.submit(p, max_new_tokens=5).result(timeout=60), skip_special_tokens=True)
                for p in prompts]
    assert texts == expected  # one choice per prompt, in order, though sent as lists of three


def test_litellm_completion_and_stream(served):
    base = dict(model=f"openai/{NAME}", api_base=served[1], api_key="x", max_tokens=6, temperature=0)
    answer = litellm.completion(messages=[{"role": "user", "content": "Hello"}], **base)
    assert answer.choices[0].message.content is not None and answer.usage.completion_tokens <= 6
    streamed = litellm.completion(messages=[{"role": "user", "content": "Hello"}], stream=True, **base)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed)
    assert text == answer.choices[0].message.content
    structured = litellm.completion(messages=[{"role": "user", "content": "Order?"}], response_format=Order,
                                    **base | {"max_tokens": 60})
    assert Order.model_validate(json.loads(structured.choices[0].message.content))
