"""The router's JSON on its hot path (`pdlab.router.validation`): msgspec, with the json module for what it refuses."""

from __future__ import annotations

import json

import pytest

from pdlab.router.validation import RequestError, dump_json, parse_json


@pytest.mark.parametrize("raw", [b'{"prompt": "hi", "max_tokens": 4, "n": 123456789012345678901234567890}',
                                 '{"prompt": "é ✓ 汉字", "x": [1.5, null, true, {"y": []}]}'.encode(),
                                 b'{"prompt": "a \\ud800 b"}'])
def test_what_the_json_module_reads_is_read_the_same_and_written_back(raw):
    assert parse_json(raw) == json.loads(raw)
    assert json.loads(dump_json(parse_json(raw))) == json.loads(raw)


@pytest.mark.parametrize(("raw", "message"), [(b'{"t": NaN}', "NaN is not a JSON value"),
                                              (b'{"t": -Infinity}', "-Infinity is not a JSON value"),
                                              (b'{"t": 1,}', "malformed JSON body"),
                                              (b"[" * 100_000 + b"]" * 100_000, "nested too deeply")])
def test_a_request_that_is_not_json_is_a_400(raw, message):
    with pytest.raises(RequestError, match=message) as refused:
        parse_json(raw)
    assert refused.value.status == 400


def test_an_instances_answer_is_read_leniently():
    assert parse_json(b'{"logprob": -Infinity}', strict=False) == {"logprob": float("-inf")}
