"""Tools, structured output, ``n`` and logprobs from the demo engine, through Envoy with the official SDKs."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

CONFIG = """
backends:
  - {name: local, url: "demo://", models: [demo-model]}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}


class Event(BaseModel):
    title: str
    date: str = Field(json_schema_extra={"format": "date"})
    attendees: list[str] = Field(min_length=1)
    capacity: int = Field(ge=10, le=20)


@pytest.fixture(scope="module")
def stack(stack_factory):
    s = stack_factory(CONFIG)
    s.oa = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0, timeout=30)
    s.an = anthropic.Anthropic(base_url=s.url + "/anthropic", api_key="k", max_retries=0, timeout=30)
    return s


USER = [{"role": "user", "content": "what's the weather in Paris?"}]


def test_parse_returns_a_pydantic_object(stack):
    r = stack.oa.chat.completions.parse(model="demo-model", messages=USER, response_format=Event)
    event = r.choices[0].message.parsed
    assert isinstance(event, Event) and 10 <= event.capacity <= 20 and event.attendees
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0


def test_json_object_mode(stack):
    r = stack.oa.chat.completions.create(model="demo-model", messages=USER, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_call_non_streamed(stack):
    r = stack.oa.chat.completions.create(model="demo-model", messages=USER, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # The tool's result in the conversation makes the engine answer in text.
    follow = stack.oa.chat.completions.create(model="demo-model", tools=[WEATHER], messages=[
        *USER, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].finish_reason == "stop" and follow.choices[0].message.content
    # tool_choice none answers text too.
    plain = stack.oa.chat.completions.create(model="demo-model", messages=USER, tools=[WEATHER], tool_choice="none")
    assert plain.choices[0].message.tool_calls is None


def test_tool_call_streamed_accumulates(stack):
    with stack.oa.chat.completions.stream(
        model="demo-model", messages=USER, tools=[openai.pydantic_function_tool(Event, name="make_event")],
        tool_choice={"type": "function", "function": {"name": "make_event"}},
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "make_event"
    assert isinstance(call.function.parsed_arguments, Event)
    chunks = list(stack.oa.chat.completions.create(model="demo-model", messages=USER, tools=[WEATHER], stream=True))
    args = "".join(c.choices[0].delta.tool_calls[0].function.arguments or ""
                   for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.tool_calls) > 2  # arguments arrive in pieces
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


def test_n_choices(stack):
    r = stack.oa.chat.completions.create(model="demo-model", messages=USER, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 3
    chunks = list(stack.oa.chat.completions.create(model="demo-model", messages=USER, n=3, stream=True))
    texts = ["", "", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in r.choices]


def test_logprobs(stack):
    r = stack.oa.chat.completions.create(model="demo-model", messages=USER, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(t.logprob < 0 and len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob > t.top_logprobs[1].logprob for t in content)
    chunks = list(stack.oa.chat.completions.create(model="demo-model", messages=USER, logprobs=True, stream=True,
                                                   top_logprobs=1))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    plain = stack.oa.chat.completions.create(model="demo-model", messages=USER)
    assert plain.choices[0].logprobs is None
    legacy = stack.oa.completions.create(model="demo-model", prompt="say hi", logprobs=2)
    lp = legacy.choices[0].logprobs
    assert "".join(lp.tokens) == legacy.choices[0].text and all(v < 0 for v in lp.token_logprobs)
    assert all(len(alts) == 2 for alts in lp.top_logprobs)


ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather for a city",
                  "input_schema": WEATHER["function"]["parameters"]}


def test_anthropic_tool_use(stack):
    m = stack.an.messages.create(model="demo-model", max_tokens=100, tools=[ANTHROPIC_TOOL], messages=USER)
    assert m.stop_reason == "tool_use"
    block = m.content[0]
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, ANTHROPIC_TOOL["input_schema"])
    with stack.an.messages.stream(model="demo-model", max_tokens=100, tools=[ANTHROPIC_TOOL], messages=USER) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == block.input


def test_anthropic_stream_usage_has_input_tokens(stack):
    with stack.an.messages.stream(model="demo-model", max_tokens=100, messages=USER) as s:
        events = [e for e in s]
        final = s.get_final_message()
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.usage.input_tokens == final.usage.input_tokens > 0
    assert final.usage.output_tokens > 0 and final.stop_reason == "end_turn"


def test_responses_parse_returns_a_pydantic_object(stack):
    r = stack.oa.responses.parse(model="demo-model", input="plan an event", text_format=Event)
    assert isinstance(r.output_parsed, Event) and 10 <= r.output_parsed.capacity <= 20
    plain = stack.oa.responses.create(model="demo-model", input="plan an event")
    assert plain.output_text.startswith("[local] demo-model:")
