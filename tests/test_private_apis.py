"""Pins on the library internals kvrelay relies on, so an upgrade that changes them fails here
rather than silently (a slower fallback, a wrong connection, an unshaped error page).

- `kvrelay.kvcache_map._resp`: redis-py's pool attributes (`connection_class`,
  `connection_kwargs`), its plain-TCP `Connection` class and `AsyncScript.sha`/`.script`.
- `kvrelay.proxy.telemetry.metrics`: prometheus-client's children's value stores
  (`_value`, `_sum`, `_buckets`, `_upper_bounds`) and its `MutexValue` float.
- `kvrelay.proxy.http.protocol_errors`: aiohttp's `web_server.RequestHandler` name, read by
  `Server.__call__` at each connection, and `RequestHandler.handle_error`'s signature.
- `kvrelay.connector.protocol` and `kvrelay.kvcache_map._entry`: pydantic keeps a model's field
  values in the instance `__dict__`, the names given in `__pydantic_fields_set__` and unknown
  fields in `__pydantic_extra__` (read directly on every turn: cheaper than attributes).
"""

from __future__ import annotations

import hashlib
import inspect
import math

import redis.asyncio as aioredis
from aiohttp import web_protocol, web_server
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.values import MutexValue
from redis.asyncio.connection import Connection
from redis.commands.core import AsyncScript

from kvrelay.connector.protocol import KVTransferParams
from kvrelay.kvcache_map import KVEntry
from kvrelay.kvcache_map._resp import RedisAddress, RespConnection
from kvrelay.proxy.http.protocol_errors import ShapedErrorsRequestHandler
from kvrelay.proxy.telemetry import metrics

# -- redis-py ----------------------------------------------------------------------------------


def test_redis_pool_exposes_the_address_and_credentials_of_a_plain_tcp_url() -> None:
    client = aioredis.Redis.from_url("redis://user:pw@db.example:6380/3", socket_timeout=1.5)
    pool = client.connection_pool
    assert pool.connection_class is Connection
    kw = pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["username"], kw["password"], kw["db"]) == (
        "db.example", 6380, "user", "pw", 3,
    )  # fmt: skip
    conn = RespConnection.for_client(client, stale_after=1.0)
    assert conn is not None
    assert conn._address == RedisAddress(
        "db.example", 6380, username="user", password="pw", db=3, connect_timeout=1.5
    )


def test_redis_tls_pools_use_another_connection_class() -> None:
    # `for_client` tells a TLS (or Unix-socket) pool by its connection class and leaves it alone.
    for url in ("rediss://db.example:6380/0", "unix:///tmp/redis.sock"):
        client = aioredis.Redis.from_url(url)
        assert client.connection_pool.connection_class is not Connection
        assert RespConnection.for_client(client, stale_after=1.0) is None


def test_redis_script_carries_its_sha1_and_text() -> None:
    client = aioredis.Redis.from_url("redis://localhost:6379/0")
    script = client.register_script("return 1")
    assert isinstance(script, AsyncScript)
    assert script.sha == hashlib.sha1(b"return 1").hexdigest()
    assert script.script == "return 1"


# -- prometheus-client -------------------------------------------------------------------------


def test_prometheus_children_keep_their_values_in_mutex_floats() -> None:
    registry = CollectorRegistry()
    counter = Counter("pin_counter", "c", ["l"], registry=registry).labels("a")
    gauge = Gauge("pin_gauge", "g", ["l"], registry=registry).labels("a")
    histogram = Histogram("pin_hist", "h", ["l"], buckets=(1, 2), registry=registry).labels("a")
    assert type(counter._value) is MutexValue and isinstance(counter._value._value, float)
    assert type(gauge._value) is MutexValue
    assert type(histogram._sum) is MutexValue
    assert all(type(b) is MutexValue for b in histogram._buckets)
    assert list(histogram._upper_bounds) == [1, 2, math.inf]
    # The wrappers take the fast path (no fallback to the child) and what they add shows.
    fast = [metrics._fast_child(child) for child in (counter, gauge, histogram)]
    assert [type(f) for f in fast] == [
        metrics._FastCounter, metrics._FastGauge, metrics._FastHistogram,
    ]  # fmt: skip
    fast[0].inc(2)
    fast[1].inc(3)
    fast[2].observe(1.5)
    text = generate_latest(registry).decode()
    assert 'pin_counter_total{l="a"} 2.0' in text
    assert 'pin_gauge{l="a"} 3.0' in text
    assert 'pin_hist_bucket{l="a",le="1.0"} 0.0' in text
    assert 'pin_hist_bucket{l="a",le="2.0"} 1.0' in text
    assert 'pin_hist_sum{l="a"} 1.5' in text


# -- pydantic ----------------------------------------------------------------------------------


def test_pydantic_models_keep_fields_in_the_instance_dict() -> None:
    params = KVTransferParams.from_wire(
        {"remote_host": "d0", "remote_port": 7, "release_token": "t", "vendor": 1}
    )
    assert params is not None
    assert params.__dict__["remote_host"] == "d0" and params.__dict__["remote_request_id"] is None
    assert set(params.__dict__) == set(KVTransferParams.model_fields)
    assert params.__pydantic_fields_set__ == params.model_fields_set
    given = {"remote_host", "remote_port", "release_token", "vendor"}  # extras count as given
    assert params.__pydantic_fields_set__ == given
    assert params.__pydantic_extra__ == params.model_extra == {"vendor": 1}
    # What the direct reads give is what the public API gives.
    assert params.to_wire() == params.model_dump(exclude_unset=True)
    entry = KVEntry(
        engine_id="e", host="d0", port=7, url="http://d0:1", request_id="r", block_ids=[[1]],
        num_tokens=3, fingerprint="f", expires_at=1.0,
    )  # fmt: skip
    assert entry.__dict__ == dict(entry)


# -- aiohttp -----------------------------------------------------------------------------------


def test_aiohttp_server_builds_its_handler_from_the_module_level_name() -> None:
    source = inspect.getsource(web_server.Server.__call__)
    assert "RequestHandler(self" in source
    assert web_server.RequestHandler in (
        web_protocol.RequestHandler,
        ShapedErrorsRequestHandler,
    )


def test_aiohttp_handle_error_signature_is_the_one_overridden() -> None:
    ours = inspect.signature(ShapedErrorsRequestHandler.handle_error)
    theirs = inspect.signature(web_protocol.RequestHandler.handle_error)
    assert list(ours.parameters) == list(theirs.parameters)
    assert [p.default for p in ours.parameters.values()] == [
        p.default for p in theirs.parameters.values()
    ]
