"""bench/_features_off.py switches off what it names, and only that: the prices that
`instructions.py --without` reports are differences between proxies that really differ."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from bench import _common, instructions, proxy_overhead
from bench._features_off import launcher
from kvrelay.prometheus_text import parse_samples
from tests.bench.helpers import fake_engine, start
from tests.harness import REPO_ROOT, free_port

HIT = 'kvrelay_reuse_total{result="hit"}'
MISS = 'kvrelay_reuse_total{result="miss"}'


@pytest.fixture(scope="module")
def engines() -> Iterator[list[str]]:
    """The `serve` arguments that point kvrelay at a fake P and D."""
    (p_argv, p_url, p_side), (d_argv, d_url, d_side) = fake_engine("prefill"), fake_engine("decode")
    with start(p_argv, p_url + "/health", "fake-p"), start(d_argv, d_url + "/health", "fake-d"):
        yield [
            "--prefill", p_url, "--decode", d_url,
            "--side-channels", f"{p_url}=127.0.0.1:{p_side}", f"{d_url}=127.0.0.1:{d_side}",
        ]  # fmt: skip


def _proxy(
    stack: ExitStack, engines: list[str], without: str | None, env: dict[str, str] | None = None
) -> str:
    port = free_port()
    argv = [sys.executable, *launcher(without or ""), "serve", "--port", str(port), *engines]
    url = f"http://127.0.0.1:{port}"
    stack.enter_context(start(argv, url + "/ready", f"kvrelay-{without or 'all-features'}", env))
    return url


def _two_turns(url: str, stream: bool = False) -> dict[str, float]:
    """Two turns of one conversation, the second extending the first; /metrics after them."""
    for prompt in ("one two three four", "one two three four five six"):
        body = {"model": "fake", "prompt": prompt, "max_tokens": 2, "stream": stream}
        req = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Conversation-Id": f"c-{stream}"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            answer = resp.read()
            assert resp.status == 200
            assert answer.endswith(b"data: [DONE]\n\n") if stream else json.loads(answer)["choices"]
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return parse_samples(resp.read().decode())


def test_each_switch_changes_only_what_it_names(engines: list[str]) -> None:
    with ExitStack() as stack:
        whole_url = _proxy(stack, engines, None)
        whole = _two_turns(whole_url)
        assert whole.get(HIT) == 1 and whole.get(MISS) == 1  # the second turn reuses
        streamed = _two_turns(whole_url, stream=True)
        assert streamed.get(HIT) == 2 and streamed.get(MISS) == 2  # so does a streamed one
        no_lookup = _two_turns(_proxy(stack, engines, "finished_lookup"), stream=True)
        assert not no_lookup.get(HIT) and no_lookup.get(MISS) == 2  # D's params never fetched
        no_map = _two_turns(_proxy(stack, engines, "map"))
        assert not no_map.get(HIT) and no_map.get(MISS) == 2  # nothing stored, nothing found
        no_metrics = _two_turns(_proxy(stack, engines, "metrics"))
        assert not no_metrics.get(HIT) and not no_metrics.get(MISS)  # reused, but not counted
        everything_off = ",".join(instructions.FEATURES)
        assert not _two_turns(_proxy(stack, engines, everything_off)).get(MISS)


def _total(samples: dict[str, float], metric: str) -> float:
    return sum(v for k, v in samples.items() if k.split("{")[0] == metric)


def test_accounting_and_spill_switches(engines: list[str]) -> None:
    # A tiny spill factor: P's time beats D's by far less than that, so every first turn spills.
    eager = {"KVRELAY_PREFILL_SPILL_FACTOR": "0.01"}
    with ExitStack() as stack:
        whole = _two_turns(_proxy(stack, engines, None, eager))
        assert _total(whole, "kvrelay_prefill_spilled_total") >= 1
        assert _total(whole, "kvrelay_leg_accounts_total") >= 2  # both turns' legs accounted
        no_spill = _two_turns(_proxy(stack, engines, "spill", eager))
        assert _total(no_spill, "kvrelay_prefill_spilled_total") == 0
        assert no_spill.get(HIT) == 1 and _total(no_spill, "kvrelay_leg_accounts_total") >= 2
        no_accounts = _two_turns(_proxy(stack, engines, "accounting", eager))
        assert _total(no_accounts, "kvrelay_leg_accounts_total") == 0
        assert _total(no_accounts, "kvrelay_prompt_tokens_total") == 0
        assert no_accounts.get(HIT) == 1 and _total(no_accounts, "kvrelay_prefill_spilled_total")


def test_unknown_features_are_refused_before_anything_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench._features_off", "--without", "map,colour", "--", "serve"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "colour" in done.stderr
    with pytest.raises(SystemExit):
        instructions.parse_args(["--without", "metrics", "map,colour"])


def test_the_proxy_bound_without_target_runs_with_those_features_off() -> None:
    """`proxy_overhead.py --proxy-bound --without` starts kvrelay-w1-without this way."""
    p = _common.start_fake_engine("prefill", "fake-p")
    d = _common.start_fake_engine("decode", "fake-d")
    router = None
    try:
        router = _common.start_kvrelay("kvrelay-w1-without", [p], [d], without="accounting")
        samples = _two_turns(router.url)
        assert samples.get(HIT) == 1  # the turn itself runs as ever
        assert _total(samples, "kvrelay_leg_accounts_total") == 0
    finally:
        _common.stop_all(router.process if router else None, p.process, d.process)
    with pytest.raises(SystemExit):
        proxy_overhead.parse_args(["--proxy-bound", "--without", "accounting,colour"])
