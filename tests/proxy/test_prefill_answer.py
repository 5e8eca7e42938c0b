"""P's answer is read in one pydantic-core pass (`read_prefill_answer`); what it gives must be
what parsing the whole answer and then validating its params gives, for every answer an engine
(or something posing as one) can send."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest

from kvrelay.connector.protocol import KVTransferParams
from kvrelay.proxy.turn.prefill_leg import read_prefill_answer

HASHES = '["a1", "b2"]'
ANSWERS = [
    b'{"id":"cmpl-1","created":1795738680,"choices":[{"text":"x"}],'
    b'"usage":{"prompt_tokens":45,"prompt_tokens_details":{"cached_tokens":32}},'
    b'"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"p0",'
    b'"remote_block_ids":[[1,2,3]],"remote_block_hashes":' + HASHES.encode() + b","
    b'"remote_blocks_expiry_time":1795738710.25,"remote_port":5600,"kvr_prompt_tokens":45,'
    b'"kvr_local_hit_tokens":0,"kvr_loaded_tokens":32,"kvr_refused_blocks":{"hash":1},'
    b'"vendor_field":[1,{"nested":null}]}}',
    b'{"usage":{"prompt_tokens":3},"kv_transfer_params":{"remote_port":1,"remote_port":2}}',
    b'{"usage":1,"usage":{"prompt_tokens":7}}',  # a repeated key: the last one counts
    b'{"kv_transfer_params":{"remote_blocks_expiry_time":5}}',  # an integer where a float goes
    b'{"kv_transfer_params":{"remote_num_tokens":123456789012345678901234}}',
    b'{"usage":{"prompt_tokens":123456789012345678901234}}',  # beyond 64 bits: kept exact
    b'{"usage":{"prompt_tokens":-0.0,"x":1e400,"y":0.1}}',
    b'{"usage":"\\ud800"}',  # a lone surrogate
    b'{"kv_transfer_params":{"remote_engine_id":"\\ud800\\u0000"}}',
    b'{"kv_transfer_params":null,"usage":null}',
    b'{"kv_transfer_params":{"remote_port":true},"usage":{"prompt_tokens":9}}',  # unusable
    b'{"kv_transfer_params":{"remote_port":1.0}}',
    b'{"kv_transfer_params":{"remote_block_ids":[1,2]}}',
    b'{"kv_transfer_params":[],"usage":{"prompt_tokens":2}}',
    b'{"kv_transfer_params":{"remote_blocks_expiry_time":1e400}}',
    b'{"usage":{"prompt_tokens":1}} ',
    b'\xef\xbb\xbf{"usage":{"prompt_tokens":1}}',  # a byte order mark
    b"{}",
    b'{"usage":NaN,"kv_transfer_params":{"remote_port":3}}',  # what only Python's json reads
    b'{"usage":{"prompt_tokens":1}} trailing',
    b'{"usage":"\xff"}',
    b"[1]",
    b'"text"',
    b"{",
    b"",
    b'{"a":' + b"[" * 3000 + b"]" * 3000 + b"}",
]


def read_the_long_way(raw: bytes) -> tuple[KVTransferParams | None, Any] | None:
    """The whole answer parsed by the standard library, then its params validated."""
    with contextlib.suppress(ValueError, RecursionError):
        data = json.loads(raw)
        if type(data) is dict:
            params = KVTransferParams.from_wire_or_none(data.get("kv_transfer_params"))
            return params, data.get("usage")
    return None


def _comparable(answer: tuple[KVTransferParams | None, Any] | None) -> object:
    if answer is None:
        return None
    params, usage = answer
    # repr: NaN equals itself there, and types show (1 and 1.0 differ).
    wire = None if params is None else repr(params.to_wire())
    return wire, repr(usage)


@pytest.mark.parametrize("raw", ANSWERS, ids=range(len(ANSWERS)))
def test_p_answer_reads_as_parsing_it_whole_does(raw: bytes) -> None:
    assert _comparable(read_prefill_answer(raw)) == _comparable(read_the_long_way(raw))


def test_the_params_and_usage_are_read() -> None:
    answer = read_prefill_answer(ANSWERS[0])
    assert answer is not None
    params, usage = answer
    assert params is not None
    assert params.remote_block_ids == [[1, 2, 3]]
    assert params.kvr_loaded_tokens == 32
    assert params.to_wire()["vendor_field"] == [1, {"nested": None}]
    assert usage == {"prompt_tokens": 45, "prompt_tokens_details": {"cached_tokens": 32}}
    assert read_prefill_answer(b"[1]") is None
