"""Tests for sidecar.payload.rewrite (JSON body rewriting) and sidecar.payload.sse (the streaming SSE rewriter)."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field

import orjson
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sidecar.payload import rewrite, sse
from sidecar.payload.rewrite import Usage, rewrite_json_body
from sidecar.payload.sse import SSERewriter
from tests.support.properties import budget

UNICODE = "héllo→✓😀"


def run(rw: SSERewriter, chunks) -> bytes:
    """Feed ``chunks`` through ``rw`` and return everything it released."""
    return b"".join([rw.feed(c) for c in chunks]) + rw.finish()


def split_at(data: bytes, cuts) -> list[bytes]:
    """Split ``data`` at the given positions (duplicates and ends allowed)."""
    points = [0, *sorted(set(cuts)), len(data)]
    return [data[a:b] for a, b in zip(points, points[1:])]


def chunk(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def openai_chunk(model="gpt-4o-2024-08-06", content="Hi", **extra) -> dict:
    obj = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    obj.update(extra)
    return obj


# ---------------------------------------------------------------------------
# rewrite_json_body
# ---------------------------------------------------------------------------


class TestJsonBody:
    def test_rewrites_top_level_model_and_keeps_everything_else(self):
        body = orjson.dumps(
            {
                "id": "chatcmpl-1",
                "model": "gpt-4o-2024-08-06",
                "choices": [{"message": {"role": "assistant", "content": UNICODE}}],
                "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
            }
        )
        out, usage = rewrite_json_body(body, "client-" + UNICODE, "openai")
        obj = orjson.loads(out)
        assert obj["model"] == "client-" + UNICODE
        expected = orjson.loads(body)
        expected["model"] = "client-" + UNICODE
        assert obj == expected
        assert list(obj) == list(expected)
        assert usage == Usage(11, 7, True)

    @pytest.mark.parametrize(
        "obj",
        [
            {"model": "m", "x": 1},
            {"x": 1},
            {"model": 5},
            {"model": None},
            {"model": ["m"]},
            {"nested": {"model": "other"}},
        ],
    )
    def test_unchanged_body_is_the_same_object(self, obj):
        body = b" " + orjson.dumps(obj) + b"\n"
        out, _ = rewrite_json_body(body, "m", "openai")
        assert out is body

    def test_model_none_only_reads_usage(self):
        body = orjson.dumps({"model": "upstream", "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
        out, usage = rewrite_json_body(body, None, "openai")
        assert out is body
        assert usage == Usage(3, 4, True)

    @pytest.mark.parametrize(
        "body",
        [b"", b"{", b'{"model": "a",}', b"not json", b'{"model": "a"} trailing', b"\xff\xfe", b'{"a": NaN}'],
    )
    def test_invalid_json_is_untouched(self, body):
        out, usage = rewrite_json_body(body, "client", "openai")
        assert out is body
        assert usage == Usage()

    @pytest.mark.parametrize("body", [b'["model"]', b'"model"', b"42", b"null", b'[{"model": "a"}]'])
    def test_non_object_is_untouched(self, body):
        out, usage = rewrite_json_body(body, "client", "anthropic")
        assert out is body
        assert usage == Usage()

    def test_too_large_is_untouched_and_usage_not_read(self, monkeypatch):
        body = orjson.dumps({"model": "a", "usage": {"input_tokens": 1, "output_tokens": 2}})
        monkeypatch.setattr(rewrite, "MAX_JSON_REWRITE", len(body) - 1)
        out, usage = rewrite_json_body(body, "client", "anthropic")
        assert out is body
        assert usage == Usage()
        monkeypatch.setattr(rewrite, "MAX_JSON_REWRITE", len(body))
        out, usage = rewrite_json_body(body, "client", "anthropic")
        assert orjson.loads(out)["model"] == "client"
        assert usage == Usage(1, 2, True)

    def test_anthropic_usage(self):
        body = orjson.dumps(
            {
                "id": "msg_1",
                "type": "message",
                "model": "claude-sonnet-4",
                "content": [{"type": "text", "text": UNICODE}],
                "usage": {"input_tokens": 25, "output_tokens": 9, "cache_read_input_tokens": 100},
            }
        )
        out, usage = rewrite_json_body(body, "alias", "anthropic")
        assert orjson.loads(out)["model"] == "alias"
        assert orjson.loads(out)["content"][0]["text"] == UNICODE
        assert usage == Usage(25, 9, True)

    def test_anthropic_ignores_openai_usage_keys(self):
        body = orjson.dumps({"model": "m", "usage": {"prompt_tokens": 25, "completion_tokens": 9}})
        _, usage = rewrite_json_body(body, None, "anthropic")
        assert usage == Usage(0, 0, True)

    def test_responses_api_usage(self):
        body = orjson.dumps(
            {
                "id": "resp_1",
                "object": "response",
                "model": "gpt-4.1",
                "output": [],
                "usage": {"input_tokens": 40, "output_tokens": 12, "total_tokens": 52},
            }
        )
        out, usage = rewrite_json_body(body, "alias", "openai")
        assert orjson.loads(out)["model"] == "alias"
        assert usage == Usage(40, 12, True)

    @pytest.mark.parametrize("usage_obj", [None, "12", [1, 2], 3])
    def test_usage_that_is_not_an_object_is_not_seen(self, usage_obj):
        body = orjson.dumps({"model": "m", "usage": usage_obj})
        _, usage = rewrite_json_body(body, None, "openai")
        assert usage == Usage()

    def test_bad_token_counts_read_as_zero(self):
        body = orjson.dumps({"usage": {"prompt_tokens": "7", "completion_tokens": True}})
        _, usage = rewrite_json_body(body, None, "openai")
        assert usage == Usage(0, 0, True)
        body = orjson.dumps({"usage": {"prompt_tokens": -1, "completion_tokens": 2.0}})
        _, usage = rewrite_json_body(body, None, "openai")
        assert usage == Usage(0, 0, True)

    def test_unknown_family(self):
        with pytest.raises(ValueError):
            rewrite_json_body(b"{}", None, "gemini")


# ---------------------------------------------------------------------------
# SSERewriter: examples
# ---------------------------------------------------------------------------


class TestSSEOpenAI:
    def test_rewrites_model_in_every_chunk(self):
        events = [chunk(openai_chunk(content=c)) for c in ["a", UNICODE, "c"]]
        rw = SSERewriter("client", "openai")
        out = run(rw, events)
        assert out == b"".join(chunk(openai_chunk(model="client", content=c)) for c in ["a", UNICODE, "c"])

    def test_done_passes_through(self):
        rw = SSERewriter("client", "openai")
        assert rw.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
        assert rw.finish() == b""

    def test_chunk_without_model_is_byte_identical(self):
        raw = b'data: {"id":"x",  "choices":[], "usage" :  null}\n\n'
        assert run(SSERewriter("client", "openai"), [raw]) == raw

    def test_chunk_with_non_string_model_is_byte_identical(self):
        raw = b'data: {"model": 12, "choices": []}\n\n'
        assert run(SSERewriter("client", "openai"), [raw]) == raw

    def test_chunk_with_same_model_is_byte_identical(self):
        raw = b'data: {"model" : "client",  "choices": []}\n\n'
        assert run(SSERewriter("client", "openai"), [raw]) == raw

    def test_model_none_is_byte_identical(self):
        raw = chunk(openai_chunk(usage=None)).replace(b'":', b'": ')
        rw = SSERewriter(None, "openai")
        assert run(rw, [raw]) == raw

    def test_nested_model_is_not_rewritten(self):
        raw = b'data: {"choices":[{"model":"inner"}]}\n\n'
        assert run(SSERewriter("client", "openai"), [raw]) == raw

    def test_comments_are_preserved(self):
        raw = b": keep-alive\n\n:\n\n" + chunk(openai_chunk())
        out = run(SSERewriter("client", "openai"), [raw])
        assert out == b": keep-alive\n\n:\n\n" + chunk(openai_chunk(model="client"))

    def test_other_lines_of_a_rewritten_event_are_preserved(self):
        raw = b": note\nevent: completion\nid: 7\ndata: {\"model\":\"up\"}\nretry: 1000\n\n"
        out = run(SSERewriter("client", "openai"), [raw])
        assert out == b": note\nevent: completion\nid: 7\ndata: {\"model\":\"client\"}\nretry: 1000\n\n"

    def test_data_without_space(self):
        out = run(SSERewriter("client", "openai"), [b'data:{"model":"up","x":1}\n\n'])
        assert out == b'data:{"model":"client","x":1}\n\n'

    @pytest.mark.parametrize("line", [b'data-x: {"model":"up"}', b'data_{"model":"up"}', b'Data: {"model":"up"}'])
    def test_field_that_only_starts_with_data_is_not_data(self, line):
        raw = line + b"\n\n"
        assert run(SSERewriter("client", "openai"), [raw]) == raw

    def test_crlf(self):
        raw = b'data: {"model":"up"}\r\n\r\ndata: {"model":"up2"}\r\n\r\n'
        out = run(SSERewriter("client", "openai"), [raw])
        assert out == b'data: {"model":"client"}\r\n\r\n' * 2

    def test_lone_cr(self):
        raw = b'data: {"model":"up"}\r\rdata: [DONE]\r\r'
        out = run(SSERewriter("client", "openai"), [raw])
        assert out == b'data: {"model":"client"}\r\rdata: [DONE]\r\r'

    def test_mixed_line_endings_keep_their_style(self):
        raw = b'event: a\r\ndata: {"model":"up"}\r\r\n: c\ndata: {"model":"up"}\n\r'
        out = run(SSERewriter("client", "openai"), [raw])
        assert out == b'event: a\r\ndata: {"model":"client"}\r\r\n: c\ndata: {"model":"client"}\n\r'

    def test_multi_line_data_is_joined_and_edited_in_place(self):
        raw = b'event: chunk\ndata: {"model":\ndata:  "up",\nid: 3\ndata: "x": [1,\ndata: 2]}\n\n'
        out = run(SSERewriter("client", "openai"), [raw])
        assert out == b'event: chunk\ndata: {"model":\ndata:  "client",\nid: 3\ndata: "x": [1,\ndata: 2]}\n\n'

    def test_every_line_keeps_its_ending(self):
        raw = b'data: {"model":\r\ndata: "up"}\n\r\n'
        out = run(SSERewriter("client", "openai"), [raw])
        assert out == b'data: {"model":\r\ndata: "client"}\n\r\n'

    def test_other_lines_inside_a_multi_line_event_stay_in_place(self):
        raw = b'data: {"model":\n: c\rdata: "up"}\n\ndata: {"model": "up"}\n\n'
        out = run(SSERewriter("client", "openai"), [raw])
        assert out == b'data: {"model":\n: c\rdata: "client"}\n\ndata: {"model": "client"}\n\n'
        assert parse_sse(out) == [([(":", " c")], '{"model":\n"client"}'), ([], '{"model": "client"}')]

    @pytest.mark.parametrize(
        "payload",
        [
            b'hello "model"',
            b'{not json "model"',
            b'{"model": "up"',
            b'[1, {"model": "up"}]',
            b'"model"',
            b'{"model": "\xff\xfe"}',
            b'{"model": NaN}',
            b'{"model": "up"} {}',
        ],
    )
    def test_non_json_or_non_object_data_is_byte_identical(self, payload):
        raw = b"data: " + payload + b"\n\n"
        assert run(SSERewriter("client", "openai"), [raw]) == raw

    def test_event_without_data_is_byte_identical(self):
        raw = b'event: ping\nid: 1\n\nretry: 5\n\n'
        assert run(SSERewriter("client", "openai"), [raw]) == raw

    def test_incomplete_event_is_held_back(self):
        raw = chunk(openai_chunk())
        rw = SSERewriter("client", "openai")
        assert rw.feed(raw[:50]) == b""
        assert rw.buffered == 50
        assert rw.feed(raw[50:-1]) == b""
        assert rw.feed(raw[-1:]) == chunk(openai_chunk(model="client"))
        assert rw.buffered == 0

    def test_several_events_in_one_chunk_and_partial_tail(self):
        a, b = chunk(openai_chunk(content="a")), chunk(openai_chunk(content="b"))
        rw = SSERewriter("client", "openai")
        out = rw.feed(a + b + b[:10])
        assert out == chunk(openai_chunk(model="client", content="a")) + chunk(
            openai_chunk(model="client", content="b")
        )
        assert rw.feed(b[10:]) == chunk(openai_chunk(model="client", content="b"))

    def test_utf8_split_inside_a_character(self):
        raw = chunk(openai_chunk(model=UNICODE, content=UNICODE))
        cut = raw.index("😀".encode()) + 2
        rw = SSERewriter("client", "openai")
        out = run(rw, [raw[:cut], raw[cut:]])
        assert out == chunk(openai_chunk(model="client", content=UNICODE))

    def test_cr_then_lf_across_chunks(self):
        raw = b'data: {"model":"up"}\r\n\r\ndata: {"model":"up"}\r\n\r\n'
        expected = b'data: {"model":"client"}\r\n\r\n' * 2
        for cut in range(len(raw) + 1):
            rw = SSERewriter("client", "openai")
            assert run(rw, [raw[:cut], raw[cut:]]) == expected, cut

    @pytest.mark.parametrize(
        "raw, expected",
        [
            (
                b'data: {"model":"up"}\r\r\ndata: {"model":"up"}\r\n\r\n',
                b'data: {"model":"client"}\r\r\ndata: {"model":"client"}\r\n\r\n',
            ),
            (
                b'data: {"model":"up"}\r\n\rdata:{"model":"up"}\n\r\n',
                b'data: {"model":"client"}\r\n\rdata:{"model":"client"}\n\r\n',
            ),
            (
                b':\r\n\r\n\rdata: {"model":"\xc3\xa9"}\r\rdata: [DONE]\n\n',
                b':\r\n\r\n\rdata: {"model":"client"}\r\rdata: [DONE]\n\n',
            ),
        ],
    )
    def test_all_two_and_three_way_splits(self, raw, expected):
        for i in range(len(raw) + 1):
            for j in range(i, len(raw) + 1):
                rw = SSERewriter("client", "openai")
                assert run(rw, [raw[:i], raw[i:j], raw[j:]]) == expected, (i, j)

    def test_event_released_when_its_blank_line_is_a_trailing_cr(self):
        rw = SSERewriter("client", "openai")
        assert rw.feed(b'data: {"model":"up"}\r\r') == b'data: {"model":"client"}\r\r'
        assert rw.feed(b"\ndata: [DONE]\r\n\r\n") == b"\ndata: [DONE]\r\n\r\n"

    def test_finish_rewrites_an_event_missing_only_its_blank_line(self):
        rw = SSERewriter("client", "openai")
        assert rw.feed(b'data: {"model":"up"}\n') == b""
        assert rw.finish() == b'data: {"model":"client"}\n'

    def test_finish_rewrites_an_event_ending_in_cr(self):
        rw = SSERewriter("client", "openai")
        assert rw.feed(b': c\rdata: {"model":"up"}\r') == b""
        assert rw.finish() == b': c\rdata: {"model":"client"}\r'

    def test_finish_releases_a_partial_line_as_is(self):
        rw = SSERewriter("client", "openai")
        assert rw.feed(b'data: {"model":"up"}') == b""
        assert rw.finish() == b'data: {"model":"up"}'
        assert rw.finish() == b""

    def test_usage_last_non_null_wins(self):
        events = [
            chunk(openai_chunk(usage=None)),
            chunk(openai_chunk(choices=[], usage={"prompt_tokens": 1, "completion_tokens": 2})),
            chunk(openai_chunk(usage=None)),
            chunk(openai_chunk(choices=[], usage={"prompt_tokens": 10, "completion_tokens": 20})),
            b"data: [DONE]\n\n",
        ]
        rw = SSERewriter(None, "openai")
        out = run(rw, events)
        assert out == b"".join(events)
        assert rw.usage == Usage(10, 20, True)

    def test_no_usage(self):
        rw = SSERewriter("client", "openai")
        run(rw, [chunk(openai_chunk(usage=None)), b"data: [DONE]\n\n"])
        assert rw.usage == Usage()

    def test_usage_read_from_multi_line_data(self):
        raw = b'data: {"usage":\ndata: {"prompt_tokens": 5, "completion_tokens": 6}}\n\n'
        rw = SSERewriter(None, "openai")
        assert run(rw, [raw]) == raw
        assert rw.usage == Usage(5, 6, True)

    def test_unknown_family(self):
        with pytest.raises(ValueError):
            SSERewriter(None, "cohere")


class TestSSEResponsesAPI:
    def events(self, model):
        resp = {"id": "resp_1", "object": "response", "model": model, "output": [], "usage": None}
        done = dict(resp, usage={"input_tokens": 30, "output_tokens": 8, "total_tokens": 38})
        return [
            b"event: response.created\n" + chunk({"type": "response.created", "sequence_number": 0, "response": resp}),
            b"event: response.output_text.delta\n"
            + chunk({"type": "response.output_text.delta", "sequence_number": 1, "delta": UNICODE}),
            b"event: response.completed\n"
            + chunk({"type": "response.completed", "sequence_number": 2, "response": done}),
        ]

    def test_rewrites_response_model_and_reads_usage(self):
        rw = SSERewriter("client", "openai")
        out = run(rw, self.events("gpt-4.1"))
        assert out == b"".join(self.events("client"))
        assert rw.usage == Usage(30, 8, True)

    def test_model_none_passes_through_and_reads_usage(self):
        rw = SSERewriter(None, "openai")
        assert run(rw, self.events("gpt-4.1")) == b"".join(self.events("gpt-4.1"))
        assert rw.usage == Usage(30, 8, True)

    def test_response_object_without_response_type_is_untouched(self):
        raw = chunk({"type": "something", "response": {"model": "up"}})
        assert run(SSERewriter("client", "openai"), [raw]) == raw


class TestSSEAnthropic:
    def events(self, model):
        return [
            b"event: message_start\n"
            + chunk(
                {
                    "type": "message_start",
                    "message": {
                        "id": "msg_1",
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "usage": {"input_tokens": 25, "output_tokens": 1},
                    },
                }
            ),
            b"event: content_block_start\n"
            + chunk({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            b"event: ping\n" + chunk({"type": "ping"}),
            b"event: content_block_delta\n"
            + chunk({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": UNICODE}}),
            b"event: message_delta\n"
            + chunk({"type": "message_delta", "delta": {"stop_reason": None}, "usage": {"output_tokens": 7}}),
            b"event: message_delta\n"
            + chunk({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 15}}),
            b"event: content_block_stop\n" + chunk({"type": "content_block_stop", "index": 0}),
            b"event: message_stop\n" + chunk({"type": "message_stop"}),
        ]

    def test_rewrites_message_start_only(self):
        rw = SSERewriter("client-" + UNICODE, "anthropic")
        out = run(rw, self.events("claude-sonnet-4"))
        assert out == b"".join(self.events("client-" + UNICODE))

    def test_usage(self):
        rw = SSERewriter(None, "anthropic")
        out = run(rw, self.events("claude-sonnet-4"))
        assert out == b"".join(self.events("claude-sonnet-4"))
        assert rw.usage == Usage(25, 15, True)

    def test_usage_when_stream_stops_before_message_delta(self):
        rw = SSERewriter(None, "anthropic")
        run(rw, self.events("claude")[:3])
        assert rw.usage == Usage(25, 1, True)

    def test_top_level_model_is_not_rewritten(self):
        raw = chunk({"type": "message_delta", "model": "up", "usage": {"output_tokens": 3}})
        rw = SSERewriter("client", "anthropic")
        assert run(rw, [raw]) == raw
        assert rw.usage == Usage(0, 3, True)

    def test_strip_injected_usage_does_not_apply(self):
        raw = chunk({"type": "message_delta", "choices": [], "usage": {"output_tokens": 1}}) + chunk(
            {"type": "message_delta", "model": "up", "usage": None}
        )
        rw = SSERewriter("client", "anthropic", strip_injected_usage=True)
        assert run(rw, [raw]) == raw


class TestStripInjectedUsage:
    def test_drops_usage_chunk_and_removes_usage_null(self):
        usage_chunk = {"id": "c", "model": "up", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
        events = [
            chunk(openai_chunk(model="up", content="a", usage=None)),
            chunk(openai_chunk(model="up", content="b", usage=None)),
            chunk(usage_chunk),
            b"data: [DONE]\n\n",
        ]
        rw = SSERewriter("client", "openai", strip_injected_usage=True)
        out = run(rw, events)
        assert out == (
            chunk(openai_chunk(model="client", content="a"))
            + chunk(openai_chunk(model="client", content="b"))
            + b"data: [DONE]\n\n"
        )
        assert rw.usage == Usage(9, 4, True)

    def test_without_model_rewrite(self):
        events = [chunk(openai_chunk(usage=None)), chunk({"choices": [], "usage": {"prompt_tokens": 2}})]
        rw = SSERewriter(None, "openai", strip_injected_usage=True)
        assert run(rw, events) == chunk(openai_chunk())
        assert rw.usage == Usage(2, 0, True)

    def test_not_stripped_without_the_flag(self):
        events = [chunk(openai_chunk(usage=None)), chunk({"choices": [], "usage": {"prompt_tokens": 2}})]
        rw = SSERewriter(None, "openai")
        assert run(rw, events) == b"".join(events)
        assert rw.usage == Usage(2, 0, True)

    def test_usage_on_a_chunk_with_choices_is_cut_and_counted(self):
        """Engines that report usage on content or finish chunks (vLLM
        continuous_usage_stats): what the router asked for never reaches the client."""
        raw = chunk(openai_chunk(usage={"prompt_tokens": 2, "completion_tokens": 3}))
        rw = SSERewriter(None, "openai", strip_injected_usage=True)
        assert run(rw, [raw]) == chunk(openai_chunk())
        assert rw.usage == Usage(2, 3, True)

    def test_dropped_event_takes_its_comments_and_line_ending(self):
        raw = b'data: {"model":"up"}\r\r: c\rdata: {"choices":[],"usage":{}}\r\r\ndata: [DONE]\r\r'
        expected = b'data: {"model":"client"}\r\rdata: [DONE]\r\r'
        for cut in range(len(raw) + 1):
            rw = SSERewriter("client", "openai", strip_injected_usage=True)
            assert run(rw, [raw[:cut], raw[cut:]]) == expected, cut

    def test_the_engine_s_own_members_of_the_usage_chunk_move_to_the_finishing_chunk(self):
        """llama.cpp puts its timings on the last chunk: the usage chunk when usage was asked
        for, the finishing chunk otherwise. Only the usage the router asked for goes."""
        finish = openai_chunk(model="up", usage=None)
        finish["choices"][0]["finish_reason"] = "length"
        timings = {"prompt_n": 9, "predicted_n": 4, "predicted_per_second": 1234.5}
        usage_chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "up", "choices": [],
                       "usage": {"prompt_tokens": 9, "completion_tokens": 4}, "timings": timings}
        raw = chunk(openai_chunk(model="up", content="a")) + chunk(finish) + chunk(usage_chunk) + b"data: [DONE]\n\n"
        for cut in range(0, len(raw) + 1, 5):
            rw = SSERewriter("client", "openai", strip_injected_usage=True)
            out = run(rw, [raw[:cut], raw[cut:]])
            events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
            assert [e["model"] for e in events] == ["client", "client"], cut
            assert events[1]["choices"][0]["finish_reason"] == "length" and events[1]["timings"] == timings, cut
            assert "usage" not in events[0] and "usage" not in events[1] and out.endswith(b"data: [DONE]\n\n"), cut
            assert rw.usage == Usage(9, 4, True)

    def test_a_finishing_chunk_is_held_only_until_the_next_event(self):
        finish = openai_chunk(usage=None)
        finish["choices"][0]["finish_reason"] = "stop"
        rw = SSERewriter(None, "openai", strip_injected_usage=True)
        assert rw.feed(chunk(finish)) == b""  # the usage chunk may follow
        assert rw.feed(b"data: [DONE]\n\n") == chunk(openai_chunk() | {"choices": finish["choices"]}) + b"data: [DONE]\n\n"
        rw = SSERewriter(None, "openai", strip_injected_usage=True, max_line=len(chunk(finish)))
        assert rw.feed(chunk(finish)) == b""
        long = b"data: " + b"x" * len(chunk(finish)) + b"\n\n"  # forwarded as is, after the held event
        assert rw.feed(long) + rw.finish() == chunk(openai_chunk() | {"choices": finish["choices"]}) + long
        rw = SSERewriter(None, "openai", strip_injected_usage=True)
        assert rw.feed(chunk(finish)) == b"" and rw.finish() == chunk(openai_chunk() | {"choices": finish["choices"]})

    def test_dropped_at_finish(self):
        rw = SSERewriter(None, "openai", strip_injected_usage=True)
        assert rw.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 4}}\n') == b""
        assert rw.finish() == b""
        assert rw.usage == Usage(4, 0, True)


# ---------------------------------------------------------------------------
# Only the model value changes: every other byte stays as the upstream sent it
# ---------------------------------------------------------------------------


def swapped(raw: bytes, old: bytes = b'"up"', new: bytes = b'"client"') -> bytes:
    """``raw`` with every ``old`` replaced: the output the cases below expect."""
    return raw.replace(old, new)


class TestOnlyTheModelValueChanges:
    @pytest.mark.parametrize(
        "raw",
        [
            pytest.param(b'data:{"id":"x","model":"up","choices":[]}\n\n', id="data-without-space"),
            pytest.param(
                b'data: {"id":"caf\\u00e9","model":"up","choices":[{"delta":{"content":"\\u00e9\\ud83d\\ude00 \\u0022"}}]}\n\n',
                id="unicode-escapes-elsewhere",
            ),
            pytest.param(
                b'data: {"id":"caf\xc3\xa9","model":"up","choices":[{"delta":{"content":"\xf0\x9f\x98\x80"}}]}\n\n',
                id="raw-utf8-elsewhere",
            ),
            pytest.param(b'data: { "id" : "x" ,\t"model"  :  "up" , "choices" : [ ] }  \n\n', id="spaced"),
            pytest.param(b'data: {\ndata:   "model": "up",\ndata:   "choices": []\ndata: }\n\n', id="pretty-printed"),
            pytest.param(b'data: {"id": "x",\ndata:"model": "up"}\n\n', id="two-lines-model-on-second"),
            pytest.param(b'data:{"model":\ndata:  "up", "id": "x"}\n\n', id="two-lines-value-on-second"),
            pytest.param(b'data: {"model": "up",\ndata: "id": "x"}\n\n', id="two-lines-model-on-first"),
            pytest.param(b'data: {"model": "up"}\r\n\r\ndata:{"model":"up"}\r\n\r\n', id="crlf"),
            pytest.param(b'event: c\r\ndata:{\r\ndata: "model":"up"}\r\n\r\n', id="crlf-two-lines"),
            pytest.param(b'data: {"model": "up"}\r\rdata: {\rdata: "model": "up"}\r\r', id="lone-cr"),
            pytest.param(
                b'data: {"choices":[{"model":"inner"}],"model":"up","x":{"model":"deep","y":["model"]}}\n\n',
                id="nested-model-key",
            ),
            pytest.param(b'data: {"content":"the \\"model\\": \\"x\\"","model":"up"}\n\n', id="model-in-a-string"),
            pytest.param(b'data: {"role":"model","model":"up","note":"\\"model\\""}\n\n', id="model-as-a-value"),
            pytest.param(b'data: {"model":"up","x":1,"model":"up"}\n\n', id="duplicate-key"),
            pytest.param(b': c\nevent: e\nid: 1\ndata: {"model" :"up"}\nretry: 5\n\n', id="other-fields"),
        ],
    )
    def test_openai_events(self, raw):
        expected = swapped(raw)
        assert run(SSERewriter("client", "openai"), [raw]) == expected
        for cut in range(len(raw) + 1):
            assert run(SSERewriter("client", "openai"), [raw[:cut], raw[cut:]]) == expected, cut

    def test_key_spelled_with_an_escape(self):
        raw = b'data: {"mod\\u0065l":"up","x":{"model":"inner"}}\n\n'
        out = run(SSERewriter("client", "openai"), [raw])
        assert out == b'data: {"mod\\u0065l":"client","x":{"model":"inner"}}\n\n'

    def test_model_value_with_escapes_is_replaced_whole(self):
        raw = b'data: {"model":"\\u0075p\\/\\"x\\"","id":"\\u00e9"}\n\n'
        assert run(SSERewriter("client", "openai"), [raw]) == b'data: {"model":"client","id":"\\u00e9"}\n\n'

    def test_client_name_is_json_encoded(self):
        raw = b'data: {"model":"up","id":"\\u00e9"}\n\n'
        out = run(SSERewriter('a"b\\c\u00e9\n', "openai"), [raw])
        assert out == b'data: {"model":' + orjson.dumps('a"b\\c\u00e9\n') + b',"id":"\\u00e9"}\n\n'

    def test_responses_events(self):
        raw = (
            b'data: {"type":"response.created","response":{"id":"r","model" : "up","x":{"model":"deep"}},'
            b'"model":"client"}\n\n'
            b'data:{"type": "response.completed", "model": "up",\n'
            b'data: "response": {"model": "up", "usage": {"input_tokens": 2, "output_tokens": 3}}}\n\n'
        )
        rw = SSERewriter("client", "openai")
        assert run(rw, [raw]) == swapped(raw)
        assert rw.usage == Usage(2, 3, True)

    def test_anthropic_message_start(self):
        raw = (
            b'event: message_start\r\n'
            b'data: {"type": "message_start",\r\n'
            b'data:  "message": {"id": "m\\u00e9", "model" : "up", "content": [{"model": "x"}],\r\n'
            b'data:   "usage": {"input_tokens": 4, "output_tokens": 1}}, "model": "up"}\r\n\r\n'
        )
        rw = SSERewriter("client", "anthropic")
        out = run(rw, [raw])
        assert out == raw.replace(b'"model" : "up"', b'"model" : "client"')
        assert rw.usage == Usage(4, 1, True)

    @pytest.mark.parametrize(
        "raw",
        [
            b'{"id":"x","model":"up","usage":{"prompt_tokens":1,"completion_tokens":2}}',
            b' \n{\n  "id" : "caf\\u00e9",\n  "model":   "up",\n  "choices": [ {"message": {"content": '
            b'"\\"model\\": \\"up\\" \xc3\xa9", "model": "nested"}} ]\n}\n',
            b'{"choices":[{"model":"inner"}],"model":"up"}',
            b'{"model":"up","model":"up"}',
            b'{"note": "model", "model"\n:\n"up"}',
        ],
    )
    def test_json_bodies(self, raw):
        out, _ = rewrite_json_body(raw, "client", "openai")
        expected = raw.replace(b'"model":   "up"', b'"model":   "client"').replace(b'"model":"up"', b'"model":"client"')
        expected = expected.replace(b'"model"\n:\n"up"', b'"model"\n:\n"client"')
        assert out == expected

    def test_json_body_escaped_key(self):
        out, _ = rewrite_json_body(b'{"mod\\u0065l" : "up", "x": {"model": "in"}}', "client", "openai")
        assert out == b'{"mod\\u0065l" : "client", "x": {"model": "in"}}'


class TestInjectedUsageIsCutOut:
    """With ``strip_injected_usage`` the ``"usage": null`` member goes with one
    comma; the rest of the event keeps its bytes."""

    @pytest.mark.parametrize(
        "raw, expected",
        [
            (b'data: {"id":"x","model":"up","choices":[{"delta":{}}],"usage":null}\n\n',
             b'data: {"id":"x","model":"client","choices":[{"delta":{}}]}\n\n'),
            (b'data:{"usage": null, "model": "up", "choices": []}\n\n',
             b'data:{"model": "client", "choices": []}\n\n'),
            (b'data: {"id": "x", "usage" : null , "model": "up"}\r\n\r\n',
             b'data: {"id": "x", "model": "client"}\r\n\r\n'),
            (b'data: { "usage":null }\n\n', b'data: {  }\n\n'),
            (b'data: {\ndata:   "model": "up",\ndata:   "usage": null\ndata: }\n\n',
             b'data: {\ndata:   "model": "client"\ndata: \ndata: }\n\n'),
            (b'data: {\ndata:   "usage": null,\ndata:   "model": "up"\ndata: }\n\n',
             b'data: {\ndata:   \ndata:   "model": "client"\ndata: }\n\n'),
            (b'data: {"a":1,"usage":null,"usage":null}\n\n', b'data: {"a":1}\n\n'),
            (b'data: {"usage":null, "usage":null,\t"a":1}\n\n', b'data: {"a":1}\n\n'),
            (b'data: {"a":1,\r\ndata:"usage":null\r\ndata:\t,"b":2}\n\n', b'data: {"a":1,\r\ndata:\r\ndata:"b":2}\n\n'),
            (b'data: {"usage":null,"a":1,"usage":null}\n\n', b'data: {"a":1}\n\n'),
            (b'data: {"x":{"usage":null},"usage":null,"model":"up"}\n\n',
             b'data: {"x":{"usage":null},"model":"client"}\n\n'),
            (b'data: {"id":"caf\\u00e9","usage":null,"model":"up"}\n\n',
             b'data: {"id":"caf\\u00e9","model":"client"}\n\n'),
        ],
    )
    def test_cut(self, raw, expected):
        out = run(SSERewriter("client", "openai", strip_injected_usage=True), [raw])
        assert out == expected
        assert orjson.loads(parse_sse(out)[0][1]) == {
            k: ("client" if k == "model" else v) for k, v in orjson.loads(parse_sse(raw)[0][1]).items() if k != "usage"
        }


class TestLongEvents:
    def test_long_line_passes_through_with_bounded_memory(self):
        max_line = 1000
        huge = b'data: {"model":"up","pad":"' + b"x" * 50_000 + UNICODE.encode() * 10 + b'"}\n\n'
        before = chunk({"model": "up", "n": 1})
        after = chunk({"model": "up", "n": 2})
        stream = before + huge + after
        rw = SSERewriter("client", "openai", max_line=max_line)
        out = []
        for i in range(0, len(stream), 97):
            piece = stream[i : i + 97]
            out.append(rw.feed(piece))
            assert rw.buffered <= max_line
        out.append(rw.finish())
        assert b"".join(out) == chunk({"model": "client", "n": 1}) + huge + chunk({"model": "client", "n": 2})

    def test_long_event_output_starts_before_it_ends(self):
        rw = SSERewriter("client", "openai", max_line=100)
        head = b'data: {"model":"up","pad":"' + b"y" * 200
        assert rw.feed(head) == head
        assert rw.feed(b"zz") == b"zz"
        assert rw.feed(b'"}\n\ndata: {"model":"up"}\n\n') == b'"}\n\ndata: {"model":"client"}\n\n'

    def test_long_event_in_a_single_chunk(self):
        huge = b'data: {"model":"up","pad":"' + b"x" * 300 + b'"}\n\n'
        small = b'data: {"model":"up"}\n\n'
        rw = SSERewriter("client", "openai", max_line=100)
        rewritten = b'data: {"model":"client"}\n\n'
        assert run(rw, [small + huge + small]) == rewritten + huge + rewritten

    def test_limit_is_inclusive(self):
        raw = b'data: {"model":"up"}\n\n'
        rw = SSERewriter("client", "openai", max_line=len(raw) - 1)
        assert run(rw, [raw]) == b'data: {"model":"client"}\n\n'
        rw = SSERewriter("client", "openai", max_line=len(raw) - 2)
        assert run(rw, [raw]) == raw

    def test_many_short_lines_count_towards_the_limit(self):
        raw = b": c\n" * 100 + b'data: {"model":"up"}\n\n'
        rw = SSERewriter("client", "openai", max_line=200)
        out = []
        for i in range(0, len(raw), 7):
            out.append(rw.feed(raw[i : i + 7]))
            assert rw.buffered <= 200
        assert b"".join(out) + rw.finish() == raw

    def test_long_event_usage_is_not_read(self):
        raw = chunk({"choices": [], "usage": {"prompt_tokens": 1}, "pad": "p" * 200})
        rw = SSERewriter(None, "openai", strip_injected_usage=True, max_line=100)
        assert run(rw, [raw[:150], raw[150:]]) == raw
        assert rw.usage == Usage()

    def test_module_limit_is_the_default(self, monkeypatch):
        monkeypatch.setattr(sse, "MAX_SSE_LINE", 64)
        huge = b'data: {"model":"up","pad":"' + b"x" * 100 + b'"}\n\n'
        rw = SSERewriter("client", "openai")
        assert rw.max_line == 64
        assert run(rw, [huge[:70], huge[70:]]) == huge

    @pytest.mark.parametrize("blank", [b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r", b"\r\n\n", b"\r\r\n"])
    def test_long_event_fed_in_small_pieces(self, blank):
        huge = b'data: {"model":"up","pad":"' + UNICODE.encode() * 30 + b'"}' + blank
        nxt = b'data: {"model":"up"}\n\n'
        for size in (1, 2, 3):
            rw = SSERewriter("client", "openai", max_line=64)
            stream = huge + nxt
            out = run(rw, [stream[i : i + size] for i in range(0, len(stream), size)])
            assert out == huge + b'data: {"model":"client"}\n\n', size

    def test_long_event_ending_with_cr_across_chunks(self):
        huge = b'data: {"model":"up","pad":"' + b"x" * 100 + b'"}\r\r'
        nxt = b'\ndata: {"model":"up"}\r\n\r\n'
        stream = huge + nxt
        expected = huge + b'\ndata: {"model":"client"}\r\n\r\n'
        for cut in range(len(stream) + 1):
            rw = SSERewriter("client", "openai", max_line=50)
            assert run(rw, [stream[:cut], stream[cut:]]) == expected, cut


# ---------------------------------------------------------------------------
# Property tests against a model of event streams
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """Data that is not a JSON object: passes through unchanged."""

    lines: tuple[str, ...]


@dataclass
class Ev:
    lines: list[tuple[str, str, str]]  # (kind, text, terminator); kind "data" or "other"
    blank: str | None  # terminator of the blank line; None: stream ends without one
    payload: object = None  # dict, Raw or None (no data lines)
    indent: bool = False  # a dict payload was written with OPT_INDENT_2 (one data line per line)


@dataclass
class Scenario:
    family: str
    model: str | None
    strip: bool
    max_line: int
    events: list[Ev]
    stream: bytes = b""
    expected: bytes = b""
    expected_events: list = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)

    def rewriter(self) -> SSERewriter:
        return SSERewriter(self.model, self.family, strip_injected_usage=self.strip, max_line=self.max_line)


TOKENS = ["a", "Z", " ", "0", '"', "\\", "/", "{", "}", ":", ",", UNICODE, "é", "→", "😀", "\u2028",
          '"model"', '"usage"', "message_start", "data: ", "\n", "\r", "\r\n\r\n", "\t"]
text = st.lists(st.sampled_from(TOKENS), max_size=6).map("".join)
line_text = text.map(lambda s: s.replace("\r", "").replace("\n", ""))
names = st.sampled_from(["gpt-4o", "claude-sonnet-4", UNICODE, "client-model"])
counts = st.integers(0, 10**6)
ABSENT = object()


def put(obj: dict, key: str, value):
    if value is not ABSENT:
        obj[key] = value
    return obj


raw_payloads = st.one_of(
    st.just(Raw(("[DONE]",))),
    st.lists(line_text.map(lambda s: "~" + s), min_size=1, max_size=3).map(lambda ls: Raw(tuple(ls))),
    st.just(Raw(('["model", 1]',))),
    st.just(Raw(('{"model": "gpt-4o"',))),
)

openai_usage = st.builds(
    lambda p, c: {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}, counts, counts
)


@st.composite
def openai_payloads(draw):
    kind = draw(st.sampled_from(["chunk", "chunk", "chunk", "usage", "created", "delta", "completed", "raw"]))
    model = draw(st.one_of(names, names, names, names, st.just(ABSENT), st.just(None), st.just(7)))
    if kind == "chunk":
        obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1}
        put(obj, "model", model)
        obj["choices"] = [{"index": 0, "delta": {"content": draw(text)}, "finish_reason": None}]
        return put(obj, "usage", draw(st.one_of(st.just(ABSENT), st.just(None), st.just(None), openai_usage)))
    if kind == "usage":
        obj = put({"id": "chatcmpl-1", "object": "chat.completion.chunk"}, "model", model)
        obj["choices"] = []
        obj["usage"] = draw(openai_usage)
        return obj
    if kind in ("created", "completed"):
        resp = put({"id": "resp_1", "object": "response"}, "model", model)
        resp["output"] = [{"type": "message", "content": [{"type": "output_text", "text": draw(text)}]}]
        if kind == "completed":
            i, o = draw(counts), draw(counts)
            resp["usage"] = {"input_tokens": i, "output_tokens": o, "total_tokens": i + o}
        else:
            resp["usage"] = None
        return {"type": "response." + kind, "sequence_number": draw(counts), "response": resp}
    if kind == "delta":
        return {"type": "response.output_text.delta", "sequence_number": 3, "delta": draw(text)}
    return draw(raw_payloads)


@st.composite
def anthropic_payloads(draw):
    kind = draw(
        st.sampled_from(
            ["start", "start", "start", "block_start", "delta", "delta", "ping",
             "message_delta", "stop", "decoy", "raw"]
        )
    )
    if kind == "start":
        msg = {"id": "msg_1", "type": "message", "role": "assistant"}
        put(msg, "model", draw(st.one_of(names, st.just(ABSENT), st.just(None))))
        msg["content"] = []
        msg["usage"] = {"input_tokens": draw(counts), "output_tokens": draw(counts)}
        return {"type": "message_start", "message": msg}
    if kind == "block_start":
        return {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    if kind == "delta":
        return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": draw(text)}}
    if kind == "ping":
        return {"type": "ping"}
    if kind == "message_delta":
        return {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": draw(counts)}}
    if kind == "stop":
        return {"type": "message_stop"}
    if kind == "decoy":
        return {"type": "content_block_delta", "model": draw(names), "delta": {"text": "message_start"}}
    return draw(raw_payloads)


other_lines = st.one_of(
    line_text.map(lambda s: ":" + s),
    st.sampled_from(["event: message_start", "event: completion", "id: 42", "id:", "retry: 1000",
                     "data-x: {}", "x-custom", ":"]),
)

TERMINATORS = {"lf": ["\n"], "crlf": ["\r\n"], "cr": ["\r"], "mixed": ["\n", "\r\n", "\r"]}


@st.composite
def events_for(draw, payloads, style):
    terms = st.sampled_from(TERMINATORS[style])
    kind = draw(st.sampled_from(["payload", "payload", "payload", "payload", "comments", "empty"]))
    if kind == "empty":
        blank_terms = ["\r\n", "\r"] if style == "mixed" else TERMINATORS[style]
        return Ev([], draw(st.sampled_from(blank_terms)))
    others = draw(st.lists(other_lines, max_size=3))
    if kind == "comments":
        return Ev([("other", t, draw(terms)) for t in others or [":"]], draw(terms))
    payload = draw(payloads)
    indent = False
    if isinstance(payload, Raw):
        values = list(payload.lines)
    elif draw(st.booleans()):
        values = [orjson.dumps(payload).decode()]
    else:
        indent = True
        values = orjson.dumps(payload, option=orjson.OPT_INDENT_2).decode().split("\n")
    data_lines = [("data", ("data: " if draw(st.booleans()) else "data:") + v) for v in values]
    # random interleaving that keeps the order within both groups
    merged, i, j = [], 0, 0
    while i < len(data_lines) or j < len(others):
        if j == len(others) or (i < len(data_lines) and draw(st.booleans())):
            merged.append(data_lines[i])
            i += 1
        else:
            merged.append(("other", others[j]))
            j += 1
    return Ev([(k, t, draw(terms)) for k, t in merged], draw(terms), payload, indent)


def fix_terminators(events: list[Ev]) -> None:
    """Keep a lone CR from merging with a following blank LF into one CRLF."""
    prev = ""
    for ev in events:
        for _, _, term in ev.lines:
            prev = term
        if ev.blank == "\n" and prev == "\r":
            ev.blank = "\r\n"
        if ev.blank is not None:
            prev = ev.blank


def expected_transform(sc: Scenario, payload: dict, usage: Usage):
    """What the rewriter must do with one JSON object: ("keep"|"drop"|"rewrite", object)."""
    obj = copy.deepcopy(payload)
    changed = False
    if sc.family == "anthropic":
        if obj.get("type") == "message_start":
            msg = obj["message"]
            usage.prompt_tokens = msg["usage"]["input_tokens"]
            usage.completion_tokens = msg["usage"]["output_tokens"]
            usage.seen = True
            if sc.model is not None and isinstance(msg.get("model"), str) and msg["model"] != sc.model:
                msg["model"] = sc.model
                changed = True
        elif obj.get("type") == "message_delta":
            usage.completion_tokens = obj["usage"]["output_tokens"]
            usage.seen = True
        return ("rewrite" if changed else "keep"), obj
    if isinstance(obj.get("usage"), dict):
        usage.prompt_tokens = obj["usage"]["prompt_tokens"]
        usage.completion_tokens = obj["usage"]["completion_tokens"]
        usage.seen = True
        if sc.strip and obj.get("choices") == []:
            return "drop", None
    if sc.strip and "usage" in obj and (obj["usage"] is None or isinstance(obj["usage"], dict)):
        del obj["usage"]  # null, or counts on a chunk with choices: what the router asked for
        changed = True
    if sc.model is not None and isinstance(obj.get("model"), str) and obj["model"] != sc.model:
        obj["model"] = sc.model
        changed = True
    resp = obj.get("response")
    if isinstance(resp, dict):
        if sc.model is not None and isinstance(resp.get("model"), str) and resp["model"] != sc.model:
            resp["model"] = sc.model
            changed = True
        if isinstance(resp.get("usage"), dict):
            usage.prompt_tokens = resp["usage"]["input_tokens"]
            usage.completion_tokens = resp["usage"]["output_tokens"]
            usage.seen = True
    return ("rewrite" if changed else "keep"), obj


def edited_lines(sc: Scenario, ev: Ev) -> bytes:
    """The event's lines as the rewriter must edit them: each rewritten model
    value replaced where it stands and a stripped ``usage`` (null or counts) cut out
    with the comma before it (generated chunks put ``usage`` last); every
    other byte, line prefix and terminator as sent."""
    marked = copy.deepcopy(ev.payload)
    if sc.family == "anthropic":
        owners = [marked["message"]]
    else:
        resp = marked.get("response")
        owners = [marked, resp] if str(marked.get("type")).startswith("response.") else [marked]
    names = {}
    for i, owner in enumerate(owners):
        name = owner.get("model") if isinstance(owner, dict) else None
        if sc.model is not None and isinstance(name, str) and name != sc.model:
            mark = f"\u27eamodel{i}\u27eb"
            names[orjson.dumps(mark).decode()] = name
            owner["model"] = mark
    usage = marked.get("usage", ABSENT)
    cut = sc.family == "openai" and sc.strip and (usage is None or isinstance(usage, dict))
    text = orjson.dumps(marked, option=orjson.OPT_INDENT_2 if ev.indent else 0).decode()
    old, new = text, text
    for mark, name in names.items():
        old = old.replace(mark, orjson.dumps(name).decode())
        new = new.replace(mark, orjson.dumps(sc.model).decode())
    if cut:
        # Generated chunks put usage last: it goes with the comma before it,
        # and its line breaks stay (the data lines, now empty, with them).
        assert list(marked)[-1] == "usage"
        start = new.rindex("," + ("\n  " if ev.indent else "") + '"usage":')
        end = len(new) - (2 if ev.indent else 1)  # before the object's closing "}"
        new = new[:start] + "\n" * new[start:end].count("\n") + new[end:]
    old_values, new_values = old.split("\n"), new.split("\n")
    assert len(old_values) == len(new_values)
    out, i = [], 0
    for kind, t, term in ev.lines:
        if kind == "data":
            # The line's value as SSE reads it may have lost one leading space
            # of the JSON line to the optional space after "data:".
            prefix = "data: " if t.startswith("data: ") else "data:"
            skip = len(prefix) - (len(t) - len(old_values[i]))
            assert t.endswith(old_values[i]) and skip in (0, 1)
            t = prefix + new_values[i][skip:]
            i += 1
        out.append((t + term).encode())
    assert i == len(old_values)
    return b"".join(out)


def field_of(line: str) -> tuple[str, str]:
    if line.startswith(":"):
        return ":", line[1:]
    name, _, value = line.partition(":")
    return name, value[1:] if value.startswith(" ") else value


def described(lines) -> tuple[list, str | None]:
    """(non-data fields in order, joined data or None) of a list of line texts."""
    fields, data = [], []
    for line in lines:
        name, value = field_of(line)
        if name == "data":
            data.append(value)
        else:
            fields.append((name, value))
    return fields, ("\n".join(data) if data else None)


def parse_sse(raw: bytes) -> list[tuple[list, str | None]]:
    """Reference event-stream parser: every event, including empty ones and an unterminated tail."""
    lines = re.split(r"\r\n|\r|\n", raw.decode("utf-8"))
    events, current = [], []
    for line in lines[:-1]:
        if line == "":
            events.append(described(current))
            current = []
        else:
            current.append(line)
    if lines[-1]:
        current.append(lines[-1])
    if current:
        events.append(described(current))
    return events


def build(sc: Scenario) -> Scenario:
    fix_terminators(sc.events)
    stream, expected, parsed, usage = [], [], [], Usage()
    for ev in sc.events:
        content = "".join(t + term for _, t, term in ev.lines).encode()
        raw = content + (ev.blank or "").encode()
        stream.append(raw)
        complete = ev.blank is not None or ev.lines[-1][2] != ""
        fields, data = described([t for _, t, _ in ev.lines])
        if not isinstance(ev.payload, dict) or len(content) > sc.max_line or not complete:
            expected.append(raw)
            parsed.append((fields, data))
            continue
        action, obj = expected_transform(sc, ev.payload, usage)
        if action == "keep":
            expected.append(raw)
            parsed.append((fields, data))
        elif action == "rewrite":
            expected.append(edited_lines(sc, ev) + (ev.blank or "").encode())
            parsed.append((fields, obj))
    sc.stream = b"".join(stream)
    sc.expected = b"".join(expected)
    sc.expected_events = parsed
    sc.usage = usage
    return sc


@st.composite
def scenarios(draw, max_events=8):
    family = draw(st.sampled_from(["openai", "anthropic"]))
    style = draw(st.sampled_from(["lf", "crlf", "cr", "mixed"]))
    payloads = openai_payloads() if family == "openai" else anthropic_payloads()
    events = draw(st.lists(events_for(payloads, style), max_size=max_events))
    if draw(st.booleans()):
        tail = draw(events_for(payloads, style))
        if tail.lines:
            tail.blank = None
            if draw(st.booleans()):
                tail.lines[-1] = (*tail.lines[-1][:2], "")
            events.append(tail)
    return build(
        Scenario(
            family=family,
            model=draw(st.sampled_from([None, "client-model", "mödel→✓😀"])),
            strip=draw(st.booleans()),
            max_line=draw(st.one_of(st.just(1 << 30), st.just(1 << 30), st.integers(16, 2000))),
            events=events,
        )
    )


def interesting_cuts(data: bytes) -> list[int]:
    """Positions right after a CR and inside multi-byte UTF-8 characters."""
    return [i for i in range(1, len(data)) if data[i - 1] == 13 or 0x80 <= data[i] < 0xC0]


PROPERTY = settings(deadline=None, max_examples=budget(150), suppress_health_check=[HealthCheck.too_slow])


class TestSSEProperties:
    @PROPERTY
    @given(scenarios())
    def test_whole_stream_matches_model(self, sc):
        rw = sc.rewriter()
        out = run(rw, [sc.stream])
        assert out == sc.expected
        assert rw.usage == sc.usage
        actual = parse_sse(out)
        assert len(actual) == len(sc.expected_events)
        for (fields, data), (exp_fields, exp_data) in zip(actual, sc.expected_events):
            assert fields == exp_fields
            if isinstance(exp_data, dict):
                assert orjson.loads(data) == exp_data
            else:
                assert data == exp_data

    @PROPERTY
    @given(scenarios(), st.data())
    def test_any_split_gives_the_same_output(self, sc, data):
        n = len(sc.stream)
        cuts = data.draw(st.lists(st.integers(0, n), max_size=12))
        tricky = interesting_cuts(sc.stream)
        if tricky:
            cuts += data.draw(st.lists(st.sampled_from(tricky), max_size=6))
        rw = sc.rewriter()
        out = []
        for piece in split_at(sc.stream, cuts):
            out.append(rw.feed(piece))
            assert rw.buffered <= sc.max_line
        out.append(rw.finish())
        assert b"".join(out) == sc.expected
        assert rw.usage == sc.usage

    @settings(deadline=None, max_examples=budget(40), suppress_health_check=[HealthCheck.too_slow])
    @given(scenarios(max_events=4))
    def test_every_single_cut_and_byte_by_byte(self, sc):
        data = sc.stream
        for cut in range(len(data) + 1):
            rw = sc.rewriter()
            assert run(rw, [data[:cut], data[cut:]]) == sc.expected, cut
            assert rw.usage == sc.usage
        rw = sc.rewriter()
        assert run(rw, [data[i : i + 1] for i in range(len(data))]) == sc.expected
        assert rw.usage == sc.usage

    @settings(deadline=None, max_examples=budget(60), suppress_health_check=[HealthCheck.too_slow])
    @given(scenarios(max_events=4), st.integers(200, 3000), st.data())
    def test_huge_event_passes_through_with_bounded_memory(self, sc, size, data):
        max_line = 150
        huge_payload = {"model": "up", "usage": None, "choices": [], "pad": UNICODE * (size // 20)}
        huge = (": big\r\ndata: " + orjson.dumps(huge_payload).decode() + "\r\n\r\n").encode()
        sc.max_line = max_line
        position = data.draw(st.integers(0, len(sc.events)))
        if sc.events and sc.events[-1].blank is None:
            position = min(position, len(sc.events) - 1)
        head = build(Scenario(sc.family, sc.model, sc.strip, max_line, sc.events[:position]))
        tail = build(Scenario(sc.family, sc.model, sc.strip, max_line, sc.events[position:]))
        stream = head.stream + huge + tail.stream
        cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=40))
        rw = SSERewriter(sc.model, sc.family, strip_injected_usage=sc.strip, max_line=max_line)
        out = []
        for piece in split_at(stream, cuts):
            out.append(rw.feed(piece))
            assert rw.buffered <= max_line
        out.append(rw.finish())
        assert b"".join(out) == head.expected + huge + tail.expected


# Random JSON objects in random serialisation styles: only the model value changes.

SENTINEL = "\ue000"
plain_text = st.text(st.characters(blacklist_characters=SENTINEL, blacklist_categories=("Cs",)), max_size=8)
json_keys = st.one_of(st.sampled_from(["model", "usage", "id", "choices", '"model"', "é", "\\u"]), plain_text)
json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    plain_text,
    st.sampled_from(["model", '"model": "x"', "\\", "\n\r", "\u2028"]),
)
json_values = st.recursive(
    json_leaves,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(json_keys, kids, max_size=4)),
    max_leaves=10,
)
model_names = st.one_of(st.sampled_from(["up", "client", "é→✓😀", 'q"uo\\te', ""]), plain_text)


@st.composite
def styled_documents(draw):
    """``(text, old, new, expected)``: a JSON object text whose top-level model
    is ``old``, and the text with only that value's bytes set to ``new``."""
    items = list(draw(st.dictionaries(json_keys, json_values, max_size=6)).items())
    items = [kv for kv in items if kv[0] != "model"]
    items.insert(draw(st.integers(0, len(items))), ("model", SENTINEL))
    obj = dict(items)
    style = draw(st.sampled_from(["orjson", "json", "json"]))
    if style == "orjson":
        text = orjson.dumps(obj).decode()
        ascii_ = False
    else:
        ascii_ = draw(st.booleans())
        text = json.dumps(
            obj,
            ensure_ascii=ascii_,
            indent=draw(st.sampled_from([None, 0, 2, "\t"])),
            separators=draw(st.sampled_from([None, (",", ":"), (", ", ": "), (" , ", " : "), (",\n", ":\t")])),
        )
    mark = json.dumps(SENTINEL, ensure_ascii=ascii_)
    assume(text.count(mark) == 1)
    old, new = draw(model_names), draw(model_names)
    before = text.replace(mark, json.dumps(old, ensure_ascii=ascii_))
    after = text.replace(mark, orjson.dumps(new).decode()) if old != new else before
    return before, old, new, after


class TestStyledDocumentProperties:
    @PROPERTY
    @given(styled_documents(), st.sampled_from(["", " ", "\n", "\r\n\t "]), st.sampled_from(["", "\n", "  "]))
    def test_json_body(self, doc, lead, trail):
        text, old, new, expected = doc
        body = (lead + text + trail).encode()
        out, _ = rewrite_json_body(body, new, "openai")
        assert out == (lead + expected + trail).encode()
        parsed = orjson.loads(body)
        parsed["model"] = new
        assert orjson.loads(out) == parsed
        if old == new:
            assert out is body

    @PROPERTY
    @given(styled_documents(), st.data())
    def test_sse_event(self, doc, data):
        text, old, new, expected = doc
        lines, want = text.split("\n"), expected.split("\n")
        assert len(lines) == len(want)
        raw, out_expected = [], []
        for before, after in zip(lines, want):
            if data.draw(st.booleans()):
                raw.append(b": note\n")
                out_expected.append(b": note\n")
            prefix = data.draw(st.sampled_from([b"data:", b"data: "]))
            term = data.draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
            raw.append(prefix + before.encode() + term)
            out_expected.append(prefix + after.encode() + term)
        # A lone CR and a blank LF would read as one CRLF.
        blank = data.draw(st.sampled_from([b"\r", b"\r\n"] if term == b"\r" else [b"\n", b"\r\n", b"\r"]))
        stream = b"".join(raw) + blank + b"data: [DONE]\n\n"
        expected_stream = b"".join(out_expected) + blank + b"data: [DONE]\n\n"
        cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=6))
        rw = SSERewriter(new, "openai")
        out = b"".join(rw.feed(piece) for piece in split_at(stream, cuts)) + rw.finish()
        assert out == expected_stream
        (_, got), (_, sent) = parse_sse(out)[0], parse_sse(stream)[0]
        parsed = orjson.loads(sent)
        parsed["model"] = new
        assert orjson.loads(got) == parsed
