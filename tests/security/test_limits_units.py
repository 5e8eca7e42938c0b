"""In-process checks of the pieces that bound hostile input: the disputed-5xx judgement of
engines, the per-key breaker, the in-flight body budget, JSON depth, engine names, and the
log filter for malformed HTTP."""

from __future__ import annotations

import io
import json
import logging

import pytest
from aiohttp.http_exceptions import BadHttpMessage

from kvrelay.proxy.base import ProxyError
from kvrelay.proxy.config import SettingsError, load_settings
from kvrelay.proxy.fleet import Pool, name_key
from kvrelay.proxy.fleet.engine_names import engine_name
from kvrelay.proxy.http.body import BodyBudget, HeldBody, nesting_exceeds, parse_json_object
from kvrelay.proxy.http.server import ProtocolErrorFilter
from kvrelay.proxy.tenants import TenantBreaker


def test_disputed_5xx_from_one_key_never_ejects() -> None:
    pool = Pool("decode", eject_after=3, readmit_after=1)
    backend = pool.add("http://d0:8000")
    for _ in range(50):
        pool.record_disputed(backend, "tenant-b", "HTTP 500")
    assert backend.healthy and backend.failures == 0


def test_disputed_5xx_from_two_keys_count_as_failures() -> None:
    pool = Pool("decode", eject_after=2, readmit_after=1)
    backend = pool.add("http://d0:8000")
    pool.record_disputed(backend, "tenant-a", "HTTP 500")
    pool.record_disputed(backend, "tenant-b", "HTTP 500")
    assert backend.failures == 1 and backend.healthy
    pool.record_disputed(backend, "tenant-a", "HTTP 500")
    assert not backend.healthy
    assert "2 API keys" in (backend.last_error or "")


def test_disputes_older_than_the_window_are_forgotten() -> None:
    pool = Pool("decode", eject_after=1, readmit_after=1, dispute_window_s=0.0)
    backend = pool.add("http://d0:8000")
    pool.record_disputed(backend, "tenant-a", "HTTP 500")
    pool.record_disputed(backend, "tenant-b", "HTTP 500")
    assert backend.healthy and list(backend.disputed_by) == ["tenant-b"]


def test_a_served_request_wipes_the_disputes() -> None:
    pool = Pool("decode", eject_after=1, readmit_after=1)
    backend = pool.add("http://d0:8000")
    for _ in range(5):
        # Two keys' poisonous input, with a third key served between them: input, not engine.
        pool.record_disputed(backend, "tenant-a", "HTTP 500")
        pool.record_served(backend, "tenant-c")
        pool.record_disputed(backend, "tenant-b", "HTTP 500")
        pool.record_served(backend, "tenant-c")
    assert backend.healthy and backend.faults == 0


def test_a_key_alone_on_failing_engines_is_never_blamed() -> None:
    pool = Pool("decode", eject_after=3, readmit_after=1)
    d0, d1 = pool.add("http://d0:8000"), pool.add("http://d1:8000")
    pool.record_served(d0, "a")
    for _ in range(10):  # the engines fail this key, and nobody else is served meanwhile
        assert not pool.blames_input([d0, d1], "a")


def test_a_key_failing_where_others_are_served_is_blamed_once_per_service() -> None:
    pool = Pool("decode", eject_after=3, readmit_after=1)
    d0, d1 = pool.add("http://d0:8000"), pool.add("http://d1:8000")
    pool.record_served(d0, "other")
    assert pool.blames_input([d0, d1], "poison")  # d0 serves another key, fails this one
    # More 5xx with nobody else served between them are the same piece of evidence.
    assert not pool.blames_input([d0, d1], "poison")
    pool.record_served(d1, "other")
    assert pool.blames_input([d0, d1], "poison")


def test_engine_trouble_is_never_the_inputs_fault() -> None:
    pool = Pool("decode", eject_after=3, readmit_after=1)
    d0, d1 = pool.add("http://d0:8000"), pool.add("http://d1:8000")
    # Another key failed on d1 too, since it last served: the engine's trouble.
    pool.record_served(d0, "other")
    pool.record_served(d1, "other")
    pool.record_disputed(d1, "other", "HTTP 503")
    assert not pool.blames_input([d0, d1], "a")
    # An engine whose own probe fails, or that is out of its pool.
    pool.record_served(d1, "other")
    d0.probe_ok = False
    assert not pool.blames_input([d0, d1], "a")
    d0.probe_ok, d1.healthy = True, False
    pool.record_served(d0, "other")
    assert not pool.blames_input([d0, d1], "a")


def test_breaker_pauses_a_key_after_its_limit_and_only_that_key() -> None:
    engine = Pool("decode", eject_after=3, readmit_after=1).add("http://d0:8000")
    breaker = TenantBreaker(limit=3, cooldown_s=30)
    assert [breaker.strike("b", [engine]) for _ in range(3)] == [False, False, True]
    left = breaker.retry_after("b")
    assert left is not None and 29 < left <= 30
    assert breaker.retry_after("a") is None
    assert TenantBreaker(limit=0, cooldown_s=30).strike("b", [engine]) is False


def test_breaker_lets_a_paused_key_back_after_the_cooldown() -> None:
    engine = Pool("decode", eject_after=3, readmit_after=1).add("http://d0:8000")
    breaker = TenantBreaker(limit=1, cooldown_s=0.000001)
    assert breaker.strike("b", [engine])
    assert breaker.retry_after("b") is None


def test_a_failure_charged_to_an_engine_voids_the_strikes_it_explains() -> None:
    pool = Pool("decode", eject_after=3, readmit_after=1)
    d0, d1 = pool.add("http://d0:8000"), pool.add("http://d1:8000")
    breaker = TenantBreaker(limit=2, cooldown_s=30)
    assert not breaker.strike("b", [d0])
    pool.record_failure(d0, "health probe failed")  # d0 was the trouble after all
    assert not breaker.strike("b", [d1])  # the first strike no longer counts
    # A pause lifts as soon as an engine it rests on is charged a failure.
    assert breaker.strike("b", [d1])
    assert breaker.retry_after("b") is not None
    pool.record_failure(d1, "HTTP 503 (for 2 API keys)")
    assert breaker.retry_after("b") is None


def test_budget_refuses_what_does_not_fit_and_gets_it_back() -> None:
    budget = BodyBudget(100)
    first, second = HeldBody(budget), HeldBody(budget)
    first.grow_to(60)
    with pytest.raises(ProxyError) as refused:
        second.grow_to(41)
    assert refused.value.status == 503 and refused.value.code == "body_budget_exhausted"
    first.release()
    second.grow_to(100)
    assert budget.used == 100
    second.release()
    assert budget.used == 0


@pytest.mark.parametrize("depth", [2, 5, 64])
def test_depth_within_the_limit_parses(depth: int) -> None:
    raw = b'{"x":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    assert isinstance(parse_json_object(raw, 64), dict)


@pytest.mark.parametrize("depth", [65, 990, 100_000])
def test_depth_over_the_limit_is_a_400_naming_it(depth: int) -> None:
    raw = b'{"x":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    with pytest.raises(ProxyError) as err:
        parse_json_object(raw, 64)
    assert err.value.status == 400 and err.value.code == "json_too_deep"
    assert "json_max_depth" in err.value.message


def test_nesting_check_counts_objects_and_arrays() -> None:
    value = json.loads('{"a": [{"b": [1]}]}')  # depth 4
    assert not nesting_exceeds(value, 4) and nesting_exceeds(value, 3)


def test_nesting_check_finds_one_deep_member_among_many_flat_ones() -> None:
    messages: list[object] = [{"role": "user", "content": "x" * 100} for _ in range(200)]
    messages.insert(137, {"role": "user", "content": [{"type": "text", "text": [[["deep"]]]}]})
    value = {"model": "m", "messages": messages, "n": 1, "stop": None}
    # body > messages > message > content > part > text > [] > [] : depth 8
    assert not nesting_exceeds(value, 8) and nesting_exceeds(value, 7)
    assert not nesting_exceeds({"a": [], "b": {}}, 2) and nesting_exceeds({"a": [[]]}, 2)
    assert not nesting_exceeds("scalar", 1) and not nesting_exceeds({}, 1)


@pytest.mark.parametrize("raw", [b"", b"   ", b"\n\t \r\n"])
def test_an_empty_body_is_a_400_saying_so(raw: bytes) -> None:
    with pytest.raises(ProxyError) as err:
        parse_json_object(raw, 64)
    assert err.value.status == 400 and err.value.code == "empty_body"


def test_engine_names_are_stable_and_reveal_no_address() -> None:
    key = name_key(load_settings({"connector_secret": "s3cret"}, env_file=None))
    name = engine_name("decode", "http://10.1.2.3:8000", key)
    assert name == engine_name("decode", "http://10.1.2.3:8000", key)
    assert name.startswith("decode-") and "10.1.2.3" not in name and "8000" not in name
    assert name != engine_name("decode", "http://10.1.2.3:8001", key)
    # Keyed: without the deployment's secret the name cannot be computed from an address.
    assert name != engine_name("decode", "http://10.1.2.3:8000", b"")
    other = name_key(load_settings({"connector_secret": "other"}, env_file=None))
    assert name != engine_name("decode", "http://10.1.2.3:8000", other)
    # The same secret gives the same names in every worker and replica.
    assert key == name_key(load_settings({"connector_secret": "s3cret"}, env_file=None))


def test_inflight_budget_must_fit_one_largest_body() -> None:
    with pytest.raises(SettingsError, match="inflight_body_bytes"):
        load_settings({"body_limit_bytes": 4096, "inflight_body_bytes": 2048}, env_file=None)


def test_protocol_errors_log_one_warning_line_without_traceback() -> None:
    logger = logging.getLogger("test.protocol-errors")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.addFilter(ProtocolErrorFilter())
    try:
        try:
            raise BadHttpMessage("Invalid character in Content-Length:\n\n  nope\n  ^")
        except BadHttpMessage as exc:
            logger.exception("Error handling request from %s", "127.0.0.1", exc_info=exc)
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.startswith("WARNING "), text
    assert "malformed HTTP" in text and "Traceback" not in text
