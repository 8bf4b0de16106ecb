"""The demo engine's tool, schema and structured-output planner (tests/integration/test_demo_shapes.py
drives it through Envoy with the official SDKs)."""

from __future__ import annotations

import enum
import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from sidecar.devstack.demo.shapes import anthropic_tool, openai_tool, schema_instance

# ------------------------------------------------------------------ schema generator

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a", "b"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 5, "maximum": 7}, "minItems": 3, "maxItems": 4},
    {"type": "array", "items": {"type": "string"}, "maxItems": 0},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 12},
    {"type": "integer", "maximum": -3},
    {"type": "integer", "minimum": 2, "multipleOf": 5},
    {"type": "number", "exclusiveMinimum": 2.0, "exclusiveMaximum": 2.5},
    {"type": "number", "maximum": -10},
    {"type": "number", "minimum": 100},
    {"type": "string", "enum": ["red", "green"]},
    {"const": "fixed"},
    {"type": "string", "minLength": 30},
    {"type": "string", "maxLength": 2},
    {"type": "boolean"},
    {"type": ["string", "null"]},
    {"type": ["null", "integer"]},
    {"anyOf": [{"type": "integer", "minimum": 4}, {"type": "null"}]},
    {"oneOf": [{"type": "null"}, {"type": "boolean"}]},
    {"type": "object", "properties": {"nested": {"$ref": "#/$defs/Inner"}}, "required": ["nested"],
     "$defs": {"Inner": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}},
    {"type": "object", "properties": {"legacy": {"$ref": "#/definitions/L"}},
     "definitions": {"L": {"type": "string", "enum": ["only"]}}},
    {"allOf": [{"type": "object", "properties": {"p": {"type": "integer"}}, "required": ["p"]},
               {"properties": {"q": {"type": "boolean"}}, "required": ["q"]}]},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": {"type": "boolean"}},
]

FORMATS = {"date": "date", "date-time": "date-time", "email": "email", "uri": "uri", "uuid": "uuid", "ipv4": "ipv4"}


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_generated_values_validate(schema):
    value = schema_instance(schema)
    jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator)
    assert schema_instance(schema) == value  # deterministic


def test_specific_choices():
    assert schema_instance({"type": "string", "enum": ["red", "green"]}) == "red"
    assert schema_instance({"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 12}) == 11
    assert schema_instance({"type": "array", "items": {"type": "integer"}, "minItems": 3}) == [1, 1, 1]
    assert schema_instance({"type": ["string", "null"]}) is not None
    assert schema_instance({"anyOf": [{"type": "integer", "minimum": 4}, {"type": "null"}]}) == 4


def test_string_formats_are_plausible():
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for fmt in FORMATS:
        value = schema_instance({"type": "string", "format": fmt})
        assert isinstance(value, str) and checker.conforms(value, fmt), (fmt, value)
    assert "@" in schema_instance({"type": "string", "format": "email"})


def test_recursive_schema_terminates():
    schema = {"$ref": "#/$defs/Node", "$defs": {"Node": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
        "parent": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}}}
    value = schema_instance(schema)
    jsonschema.validate(value, schema)


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Address(BaseModel):
    street: str
    postcode: str = Field(min_length=5, max_length=5)


class Person(BaseModel):
    name: str
    age: int = Field(ge=18, le=99)
    score: float = Field(gt=0, lt=1)
    email: str = Field(json_schema_extra={"format": "email"})
    colour: Colour
    kind: Literal["customer", "staff"]
    tags: list[str] = Field(min_length=2)
    address: Address
    previous: Address | None = None
    active: bool


def test_pydantic_model_schema_round_trips():
    person = Person.model_validate(schema_instance(Person.model_json_schema()))
    assert 18 <= person.age <= 99 and 0 < person.score < 1 and len(person.tags) >= 2
    assert len(person.address.postcode) == 5 and person.kind == "customer" and person.colour is Colour.RED


# ------------------------------------------------------------------ tool choice


TOOLS = [
    {"type": "function", "function": {"name": "web_search", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "book", "parameters": {"type": "object"}}},
]


@pytest.mark.parametrize("choice, messages, expected", [
    ("auto", [{"role": "user", "content": "hi"}], "get_weather"),
    (None, [{"role": "user", "content": "hi"}], "get_weather"),
    ("required", [{"role": "user", "content": "hi"}], "web_search"),
    ({"type": "function", "function": {"name": "book"}}, [], "book"),
    ("none", [], None),
    ("auto", [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c", "content": "x"}], None),
])
def test_openai_tool_choice(choice, messages, expected):
    body = {"tools": TOOLS, "messages": messages}
    if choice is not None:
        body["tool_choice"] = choice
    picked = openai_tool(body)
    assert (picked[0] if picked else None) == expected


def test_anthropic_tool_choice():
    tools = [{"type": "web_search_20250305", "name": "web_search"},
             {"name": "a", "input_schema": {"type": "object"}}, {"name": "b", "input_schema": {"type": "object"}}]
    assert anthropic_tool({"tools": tools})[0] == "a"
    assert anthropic_tool({"tools": tools, "tool_choice": {"type": "tool", "name": "b"}})[0] == "b"
    assert anthropic_tool({"tools": tools, "tool_choice": {"type": "none"}}) is None
    result = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "sunny"}]}]
    assert anthropic_tool({"tools": tools, "messages": result}) is None
    assert anthropic_tool({"tools": tools, "messages": result, "tool_choice": {"type": "any"}})[0] == "a"


@pytest.mark.parametrize("body", [
    {"tools": 5}, {"tools": "x", "tool_choice": "required"}, {"tools": [{"function": {"name": "f", "parameters": 7}}]},
    {"tools": [{"function": {"name": "f", "parameters": {"type": "object", "properties": [1], "required": 3}}}]},
    {"tools": [{"function": {"name": "f", "parameters": {"anyOf": "x", "allOf": [{"properties": 2}]}}}]},
])
def test_odd_tool_bodies_do_not_break_the_planner(body):
    from sidecar.devstack.demo.shapes import chat_replies

    replies = chat_replies({**body, "messages": []}, ["hi"])
    assert len(replies) == 1
    if replies[0].tool_call is not None:
        json.loads(replies[0].tool_call.arguments)
    assert anthropic_tool({"tools": body["tools"]}) is None
