"""Prefix routing: the index of what each P caches, the P chosen by cached prefix against queued
work, and holds kept only while a tenant's holds are taken."""

from __future__ import annotations

import asyncio
import dataclasses
import tracemalloc

import pytest
from prometheus_client import REGISTRY

from kvrelay.prometheus_text import parse_samples
from kvrelay.proxy.config import Settings
from kvrelay.proxy.fleet import Pool, PromptPrefixes, Router
from kvrelay.proxy.fleet.hold_payoff import HoldPayoff
from kvrelay.proxy.fleet.pin_rests import PinRests
from kvrelay.proxy.fleet.pin_wait import PinWaits, PrefillPace
from kvrelay.proxy.fleet.prefix_index import PrefixIndex
from kvrelay.proxy.fleet.prefix_wait import PrefixesInFlight
from kvrelay.proxy.fleet.routing import PIN_WAIT_SHARE, PULL_COST
from kvrelay.proxy.telemetry import metrics
from kvrelay.proxy.turn import chat_shape, completion_shape
from tests.proxy.manual_clock import Clock

MIN_EVIDENCE = 16  # decided holds before a tenant's share is trusted (fleet/hold_payoff.py)

SYSTEM = "You are a careful assistant. " * 40  # 1160 characters shared by every request


def _take(holds: HoldPayoff, tenant: str, key: tuple[str, object], read: bool = True) -> None:
    """A next turn of `tenant` takes the hold under `key`, and its engine reads it (or not)."""
    holds.taken(tenant, key)
    holds.used(tenant, read)


def _chat(question: str, system: str = SYSTEM, model: str = "m") -> dict[str, object]:
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }


def _prefixes(body: dict[str, object], scope: str = "salt-a") -> PromptPrefixes:
    prefixes = chat_shape(body).prefixes(scope, body)
    assert prefixes is not None
    return prefixes


def _router(**settings: object) -> tuple[Router, Pool]:
    prefill = Pool("prefill", eject_after=2, readmit_after=2)
    decode = Pool("decode", eject_after=1, readmit_after=1)
    config = Settings(_env_file=None, **settings)  # type: ignore[arg-type]
    return Router(config, prefill, decode), prefill


# -- the prompt's prefixes ---------------------------------------------------------------------


def test_chat_prefixes_are_message_histories_in_characters() -> None:
    a = _prefixes(_chat("What is a block?"))
    b = _prefixes(_chat("Why is the sky blue?"))
    assert a.chars == (len(SYSTEM), len(SYSTEM) + len("What is a block?"))
    assert a.total == a.chars[-1]
    assert a.keys[0] == b.keys[0]  # the same system prompt
    assert a.keys[1] != b.keys[1]  # different questions


def test_the_last_messages_leading_runs_are_prefixes_too() -> None:
    """A document that requests share at the start of their new message is a prefix: the last
    message's leading runs of 512 characters, named after the history and the message's role,
    come before the whole prompt; earlier messages are prefixes whole."""
    document = "The shared document says what the answer is. " * 30  # 1380 characters
    a = _prefixes(_chat(document + "First question?"))
    b = _prefixes(_chat(document + "Second question?"))
    n = len(SYSTEM)
    assert a.chars == (n, n + 512, n + 1024, a.total)
    assert a.keys[:3] == b.keys[:3] and a.keys[3] != b.keys[3]
    # The same text as a system message renders differently: none of its runs is shared.
    as_system = _prefixes(
        {"model": "m", "messages": [{"role": "system", "content": SYSTEM + document + "?"}]}
    )
    assert set(as_system.keys).isdisjoint(a.keys)
    # A message of exactly two runs has one run key (its whole text is the message's key).
    exact = _prefixes(_chat("y" * 1024))
    assert exact.chars == (n, n + 512, n + 1024)
    # Once the message is history, it is one prefix again.
    later = {
        **_chat(document + "First question?"),
        "messages": [
            *_chat(document + "First question?")["messages"],  # type: ignore[misc]
            {"role": "assistant", "content": "An answer."},
            {"role": "user", "content": "And then?"},
        ],
    }
    assert _prefixes(later).chars == (n, a.total, a.total + 10, a.total + 19)
    assert _prefixes(later).keys[1] == a.keys[-1]


def test_prefixes_are_scoped_by_cache_salt_and_by_what_renders_the_prompt() -> None:
    body = _chat("q")
    assert _prefixes(body, "salt-a").keys[0] != _prefixes(body, "salt-b").keys[0]
    other_model = _chat("q", model="other")
    assert _prefixes(body).keys[0] != _prefixes(other_model).keys[0]
    tools = {**body, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert _prefixes(body).keys[0] != _prefixes(tools).keys[0]


def test_text_prefixes_are_runs_of_characters() -> None:
    text = "x" * 1300
    body = {"model": "m", "prompt": text}
    prefixes = completion_shape(body).prefixes("", body)
    assert prefixes is not None
    assert prefixes.chars == (512, 1024) and prefixes.total == 1300
    longer = {"model": "m", "prompt": text + "y" * 300}
    more = completion_shape(longer).prefixes("", longer)
    assert more is not None and more.keys[:2] == prefixes.keys and len(more.keys) == 3
    edited = {"model": "m", "prompt": "z" + text[1:]}
    changed = completion_shape(edited).prefixes("", edited)
    assert changed is not None and set(changed.keys).isdisjoint(prefixes.keys)
    short = {"model": "m", "prompt": "short"}
    assert completion_shape(short).prefixes("", short) is None
    tokens = {"model": "m", "prompt": [1, 2, 3]}
    assert completion_shape(tokens).prefixes("", tokens) is None


# -- the index -----------------------------------------------------------------------------------


def test_index_answers_the_longest_cached_prefix_per_engine() -> None:
    index = PrefixIndex(ttl_s=60)
    first = _prefixes(_chat("What is a block?"))
    index.record("http://p0", first)
    index.record("http://p1", _prefixes(_chat("Something else")))
    assert index.cached_chars(first) == {"http://p0": first.total, "http://p1": len(SYSTEM)}
    stranger = _prefixes(_chat("q", system="Another system prompt"))
    assert index.cached_chars(stranger) == {}


def test_index_forgets_expired_prefixes_and_refreshes_on_record() -> None:
    clock = Clock()
    index = PrefixIndex(ttl_s=60, clock=clock)
    prompt = _prefixes(_chat("q"))
    index.record("http://p0", prompt)
    clock.now += 59
    assert index.cached_chars(prompt) == {"http://p0": prompt.total}
    index.record("http://p0", prompt)  # used again: its lifetime starts over
    clock.now += 59
    assert index.cached_chars(prompt) == {"http://p0": prompt.total}
    clock.now += 2
    assert index.cached_chars(prompt) == {}


def test_index_keeps_at_most_max_entries_least_recent_forgotten() -> None:
    index = PrefixIndex(ttl_s=60, max_entries=4)
    old = _prefixes(_chat("old", system="system one"))
    index.record("http://p0", old)
    index.record("http://p0", _prefixes(_chat("b", system="system two")))
    assert len(index) == 4
    index.record("http://p0", _prefixes(_chat("c", system="system three")))
    assert len(index) == 4
    assert index.cached_chars(old) == {}


def test_index_entry_memory_is_within_the_stated_bound() -> None:
    """The settings say about 420 bytes a prefix: measured with two engines per prefix, the
    keys (made per request, kept by the index) counted."""
    index = PrefixIndex(ttl_s=60)
    bodies = [_chat(f"question {i}", system=f"system {i}") for i in range(2000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for body in bodies:
        prompt = _prefixes(body, scope="968b6a19b16186b7d1fe7f52067ad23f")
        index.record("http://p0", prompt)
        index.record("http://p1", prompt)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(index) == 4000
    assert used / len(index) < 450


# -- the P chosen ------------------------------------------------------------------------------


def test_p_is_the_one_caching_the_prefix_until_its_queue_outweighs_it() -> None:
    router, prefill = _router()
    p0, p1 = prefill.add("http://p0"), prefill.add("http://p1")
    index = router.prefixes
    assert index is not None
    index.record(p1.url, _prefixes(_chat("What is a block?")))

    def pick(question: str, exclude: frozenset[str] = frozenset()) -> tuple[str, int, int]:
        prompt = _prefixes(_chat(question))
        chosen = router.pick_prefill(None, set(exclude), prompt.total + 1, prompt=prompt)
        assert chosen.backend is not None and not chosen.by_affinity
        return chosen.backend.url, chosen.work, prompt.total + 1

    url, work, whole = pick("Why is the sky blue?")
    assert url == p1.url and work == whole - len(SYSTEM)  # p1 computes only the question
    p1.outstanding_work = len(SYSTEM) - 10  # queued less than the prefix saves: still p1
    assert pick("Where do rivers go?")[0] == p1.url
    p1.outstanding_work = len(SYSTEM) + 10  # queued more: p0 computes it all, and sooner
    url, work, whole = pick("How far is the moon?")
    assert url == p0.url and work == whole
    # The choice is recorded as it is made: p0 now caches the system prompt too.
    p0.outstanding_work = p1.outstanding_work
    url, work, whole = pick("What is a prefix?")
    assert work == whole - len(SYSTEM)
    assert pick("What is a turn?", frozenset({p0.url}))[0] == p1.url


def test_a_p_caching_the_history_beats_one_pulling_it() -> None:
    router, prefill = _router()
    prefill.add("http://p0")
    p1 = prefill.add("http://p1")
    prompt = _prefixes(_chat("q"))
    router.prefixes.record(p1.url, prompt)  # type: ignore[union-attr]
    held = len(SYSTEM)  # the conversation's holder serves the history to any P
    work = prompt.total + 1
    pick = router.pick_prefill("http://p1", set(), work, prompt=prompt, held_chars=held)
    assert pick.backend is p1 and pick.by_affinity
    # p0 would pull it: it costs PULL_COST of computing, which p1's queue may outweigh.
    p1.outstanding_work = round(PULL_COST * held) + 10
    pick = router.pick_prefill("http://p1", set(), work, prompt=prompt, held_chars=held)
    assert pick.backend is not p1 and not pick.by_affinity
    assert pick.work == work - held + round(PULL_COST * held)


def _events_router(**settings: object) -> tuple[Router, Pool]:
    """A router following KV events (an endpoint named: no feed runs in a unit test)."""
    return _router(kv_events_endpoints='{"http://p0": "tcp://127.0.0.1:1"}', **settings)


# The blocks' extra keys as vLLM reports them: the cache salt on the first block only.
SALTED = [["salt-a"], *([None] * 19)]


def _tokens_prompt(tokens: list[int], body: dict[str, object]) -> PromptPrefixes:
    return _prefixes(body).with_tokens(tokens, "salt-a")


@pytest.mark.parametrize(("step_tokens", "pulls"), [(32, True), (8192, False)])
def test_a_queued_p_caching_a_prefix_has_another_p_pull_it(step_tokens: int, pulls: bool) -> None:
    """A pin waits for the holder's current step at most (`prefill_step_tokens`): with steps
    shorter than the holder's queue, the pull costs that step, PULL_COST of the prefix and the
    rest; with steps as long as the queue, waiting for the pin is waiting for the holder."""
    router, prefill = _events_router(prefix_pull_min_tokens=64, prefill_step_tokens=step_tokens)
    p0, p1 = prefill.add("http://p0"), prefill.add("http://p1")
    assert router.blocks is not None
    shared = list(range(1000, 1320))  # 320 tokens: 20 blocks of 16, the system prompt
    # p1's events: those 20 blocks, chained from the root.
    router.blocks.stored(p1.url, list(range(20)), None, shared, 16, SALTED)
    asked = iter(range(10))
    # A new question each time (the routing-fed index records each), a fifth of the
    # prompt in characters as in tokens.
    questions = [f"question {n} ".ljust(290, "x") for n in range(10)]
    total = _prefixes(_chat(questions[0])).total
    work, per_token = total + 1, total / 400
    source_chars = round(320 * per_token)

    def pick() -> tuple[str, int, str | None, int]:
        n = next(asked)
        tokens = shared + [5000 + n] * 80  # 400 tokens
        prompt = _tokens_prompt(tokens, _chat(questions[n]))
        chosen = router.pick_prefill(None, set(), work, prompt=prompt)
        assert chosen.backend is not None
        source = chosen.source
        return (
            chosen.backend.url,
            chosen.work,
            source.backend.url if source else None,
            source.tokens if source else 0,
        )

    # Idle: p1 serves it from its own cache, nobody pulls.
    assert pick() == (p1.url, work - source_chars, None, 0)
    # p1 backed up by three such prefixes: another P runs the turn.
    p1.outstanding_work = 3 * source_chars
    if pulls:
        pin_wait = round(PIN_WAIT_SHARE * step_tokens * per_token)
        assert pick() == (
            p0.url,
            work - source_chars + round(PULL_COST * source_chars) + pin_wait,
            p1.url,
            320,
        )
        # p0 pulled it, so it caches it now: the next such turn needs no pull.
        assert pick() == (p0.url, work - source_chars, None, 0)
    else:
        assert pick() == (p0.url, work, None, 0)


@pytest.mark.parametrize(
    ("pin_s", "forgotten", "pulls"),
    [(None, False, True), (0.005, False, True), (0.2, False, False), (0.2, True, True)],
)
def test_a_holder_whose_pins_answer_late_is_weighed_by_what_they_took(
    pin_s: float | None, forgotten: bool, pulls: bool
) -> None:
    """A pull waits for the holder's pin: the model's half step, or what the holder's pins
    took lately (`PinWaits`) in the tokens a P computes meanwhile (`PrefillPace`, from P's
    answers), whichever is longer. At P's 4,000 tokens a second, pins answered in 5 ms (20
    tokens) leave the pull of the 320-token prefix cheaper than computing it; pins of 0.2 s
    (800 tokens) cost more than the pull saves, so the turn's P computes it; a minute after
    the holder's last pin (`reuse_probe_interval_s`) the model weighs it again."""
    router, prefill = _events_router(prefix_pull_min_tokens=64, prefill_step_tokens=32)
    p0, p1 = prefill.add("http://p0"), prefill.add("http://p1")
    assert router.blocks is not None
    clock = Clock()
    object.__setattr__(router, "prefill_pace", PrefillPace(clock))
    object.__setattr__(router, "pin_waits", PinWaits(60.0, clock))
    shared = list(range(1000, 1320))  # 320 tokens: 20 blocks of 16
    router.blocks.stored(p1.url, list(range(20)), None, shared, 16, SALTED)
    prompt = _tokens_prompt(shared + [5000] * 80, _chat("question ".ljust(290, "x")))
    work, per_token = prompt.total + 1, prompt.total / 400
    source_chars = round(320 * per_token)
    p1.outstanding_work = 3 * source_chars  # queued: another P should run the turn
    # P's pace from its answers: 8,000 tokens computed over 2 s of being busy.
    router.prefill_started(p0.url)
    clock.now += 2.0
    router.prefill_ended(p0.url, 8000)
    assert router.prefill_pace.tokens_per_s() == pytest.approx(4000.0)
    if pin_s is not None:
        for _ in range(20):  # a run of them: the moving mean comes to that wait
            router.pin_answered(p1.url, "prefill", pin_s)
        assert router.measured_pin_wait_tokens(p1.url, "prefill") == pytest.approx(4000 * pin_s)
    if forgotten:
        clock.now += 61.0
        assert router.measured_pin_wait_tokens(p1.url, "prefill") == 0.0
    chosen = router.pick_prefill(None, set(), work, prompt=prompt)
    assert chosen.backend is p0
    if not pulls:
        assert chosen.source is None and chosen.work == work
        return
    assert chosen.source is not None and chosen.source.backend is p1
    modelled = PIN_WAIT_SHARE * 32  # p1's queue is longer than its step
    measured = 4000.0 * pin_s if pin_s is not None and not forgotten else 0.0
    pin_wait = round(max(modelled, measured) * per_token)
    assert chosen.work == work - source_chars + round(PULL_COST * source_chars) + pin_wait


def test_a_p_pulls_a_history_a_ds_events_show_cached_when_no_hold_names_it() -> None:
    """A conversation's history in a D's prefix cache (decoded there, its hold declined or
    ended: no entry, no held history) is pinned on that D for the chosen P to pull, even with
    one P; a P whose own events show as much is preferred as the source; with a held history
    the holder is pulled from instead, and with `prefix_pull` off nothing is."""
    shared = list(range(3000, 3320))  # 320 tokens: 20 blocks of 16
    prompt_tokens = shared + [11] * 80
    for ps in (1, 2):
        router, prefill = _events_router(prefix_pull_min_tokens=64)
        p0 = prefill.add("http://p0")
        if ps == 2:
            prefill.add("http://p1")
        d0 = router.decode.add("http://d0")
        assert router.blocks is not None
        router.blocks.stored(d0.url, list(range(20)), None, shared, 16, SALTED)
        prompt = _tokens_prompt(prompt_tokens, _chat(f"history {ps}".ljust(290, "x")))
        work = prompt.total + 1
        assert router.routes_by_prefix and router.wants_tokens  # one P too: a D may be pulled
        chosen = router.pick_prefill(None, set(), work, prompt=prompt)
        assert chosen.source is not None, ps
        assert chosen.source.backend is d0 and chosen.source.holder == "decode"
        assert chosen.source.tokens == 320
        source_chars = round(320 * prompt.total / 400)
        # The rest computed, the prefix at PULL_COST; an idle D's pin waits for nothing.
        assert chosen.work == round(work - source_chars + PULL_COST * source_chars)
        assert chosen.backend is not None and chosen.backend.url.startswith("http://p")
    # A P caching as much is the source, not the D.
    router, prefill = _events_router(prefix_pull_min_tokens=64, prefill_step_tokens=32)
    p0, p1 = prefill.add("http://p0"), prefill.add("http://p1")
    d0 = router.decode.add("http://d0")
    assert router.blocks is not None
    router.blocks.stored(d0.url, list(range(20)), None, shared, 16, SALTED)
    router.blocks.stored(p1.url, list(range(100, 120)), None, shared, 16, SALTED)
    p1.outstanding_work = 10_000
    prompt = _tokens_prompt(prompt_tokens, _chat("both".ljust(290, "x")))
    chosen = router.pick_prefill(None, set(), prompt.total + 1, prompt=prompt)
    assert chosen.backend is p0 and chosen.source is not None
    assert chosen.source.backend is p1 and chosen.source.holder == "prefill"
    # A held history, or prefix_pull off: no pin on D.
    for settings, held in (({}, 500), ({"prefix_pull": False}, 0)):
        router, prefill = _events_router(prefix_pull_min_tokens=64, **settings)
        prefill.add("http://p0")
        prefill.add("http://p1")
        d0 = router.decode.add("http://d0")
        assert router.blocks is not None
        router.blocks.stored(d0.url, list(range(20)), None, shared, 16, SALTED)
        prompt = _tokens_prompt(prompt_tokens, _chat("held".ljust(290, "x")))
        chosen = router.pick_prefill(None, set(), prompt.total + 1, prompt=prompt, held_chars=held)
        assert chosen.source is None, settings


def test_a_turns_routing_reads_the_events_index_once_for_its_prompt() -> None:
    """The spill, its pull source and P's pick look one turn's prompt up: the first lookup's
    snapshot serves them all; the next turn's prompt (another object) sees the index as it is."""
    router, prefill = _events_router()
    p0 = prefill.add("http://p0")
    assert router.blocks is not None
    shared = list(range(1000, 1320))  # 320 tokens: 20 blocks of 16
    router.blocks.stored(p0.url, list(range(20)), None, shared, 16, SALTED)
    prompt = _tokens_prompt(shared + [9] * 80, _chat("snapshot"))
    assert router.reported_tokens(prompt) == {p0.url: 320}
    router.blocks.cleared(p0.url)
    assert router.reported_tokens(prompt) == {p0.url: 320}  # the turn's snapshot
    assert router.reported_tokens(_tokens_prompt(shared + [9] * 80, _chat("snapshot"))) == {}


@pytest.mark.parametrize("prefix_pull", [True, False])
def test_a_spill_off_backed_up_ps_pulls_the_prefix_one_of_them_caches(prefix_pull: bool) -> None:
    """Both Ps backed up: the turn spills to D. With prefix_pull, D is to pull the prefix that
    p1's events show (pinned there) and prefill only the rest: the choice weighs the rest,
    PULL_COST of the prefix and the pin's wait (half of p1's step), D's busy count carries only
    the rest it computes; D's own count confirms it."""
    router, prefill = _events_router(
        prefix_pull=prefix_pull, prefix_pull_min_tokens=64, prefill_step_tokens=32
    )
    p0, p1 = prefill.add("http://p0"), prefill.add("http://p1")
    router.decode.add("http://d0")
    assert router.blocks is not None
    shared = list(range(1000, 1320))  # 320 tokens: 20 blocks of 16
    router.blocks.stored(p1.url, list(range(20)), None, shared, 16, SALTED)
    prompt = _tokens_prompt(shared + [9] * 80, _chat("spilled".ljust(290, "x")))
    work = prompt.total + 1
    p0.outstanding_work = p1.outstanding_work = 50 * work
    spill = router.spill(None, work, "", prompt)
    assert spill is not None and spill.backend.url == "http://d0" and not spill.holder
    estimated = round(work * 400 / prompt.total)  # the prompt's own characters a token
    pin_wait = PIN_WAIT_SHARE * 32  # p1's queue is longer than its step
    if prefix_pull:
        assert spill.source is not None and spill.source.backend is p1
        assert spill.source.tokens == 320
        assert spill.tokens == estimated - 320
    else:
        assert spill.source is None and spill.tokens == estimated
    # D counts 400 tokens: the spill still pays, its work counted again.
    counted = spill.counted(400, 0, work)
    assert counted is not None
    if prefix_pull:
        assert counted.source is spill.source
        assert counted.tokens == 400 - 320
        # The choice weighs the pull: P (which would pull too) level with D in queued work, the
        # spill does not pay; a token less queued on D and it does. D counted by its compute
        # alone (80 tokens against the pull's work) would have spilled both times.
        pulled_work = round(400 - 320 + PULL_COST * 320 + pin_wait)
        level = dataclasses.replace(
            spill, p_queued_chars=100, d_queued=100, factor=1.0, p_cached_chars=0
        )
        assert pulled_work > 80 and level.counted(400, 0, 400) is None
        cheaper = dataclasses.replace(level, d_queued=99).counted(400, 0, 400)
        assert cheaper is not None and cheaper.source is spill.source and cheaper.tokens == 80
    else:
        assert counted.source is None and counted.tokens == 400
    # d0 decoded a turn sharing the system prompt: its own cache is expected to hold it, so
    # a spill there pulls nothing and counts only the rest.
    router.decoded("http://d0", _tokens_prompt(shared + [8] * 80, _chat("decoded".ljust(290))))
    again = router.spill(None, work, "", prompt)
    assert again is not None and again.source is None
    d_cached = round(len(SYSTEM) * 400 / prompt.total)
    assert again.d_cached_chars == len(SYSTEM) and again.tokens == estimated - d_cached


def test_a_spill_pulls_the_prefix_another_ds_events_show_cached() -> None:
    """Both Ps backed up and neither caching the prompt; d1's events show its prefix (a request
    sharing the system prompt ran there) but d1 takes no spill (overloaded): the turn spills to
    d0, which pulls the prefix from d1 (pinned there) and computes only the rest. A D is never
    its own pull's source: once d0 caches as much itself, it pulls nothing."""
    router, prefill = _events_router(prefix_pull_min_tokens=64, prefill_step_tokens=32)
    p0, p1 = prefill.add("http://p0"), prefill.add("http://p1")
    d0, d1 = router.decode.add("http://d0"), router.decode.add("http://d1")
    assert router.blocks is not None
    shared = list(range(7000, 7320))  # 320 tokens: 20 blocks of 16
    router.blocks.stored(d1.url, list(range(20)), None, shared, 16, SALTED)
    d1.inflight = router.settings.decode_overload_inflight
    prompt = _tokens_prompt(shared + [9] * 80, _chat("d to d".ljust(290, "x")))
    work = prompt.total + 1
    p0.outstanding_work = p1.outstanding_work = 50 * work
    spill = router.spill(None, work, "", prompt)
    assert spill is not None and spill.backend is d0 and not spill.holder
    assert spill.source is not None and spill.source.backend is d1
    assert spill.source.holder == "decode" and spill.source.tokens == 320
    assert spill.tokens == round(work * 400 / prompt.total) - 320
    # d0's own events now show as much: no pin anywhere, d0 computes only the rest.
    router.blocks.stored(d0.url, list(range(100, 120)), None, shared, 16, SALTED)
    prompt = _tokens_prompt(shared + [9] * 80, _chat("d to d again".ljust(290, "x")))
    again = router.spill(None, prompt.total + 1, "", prompt)
    assert again is not None and again.backend is d0 and again.source is None


def test_a_spill_goes_to_the_d_whose_cache_holds_the_prompt_when_that_is_done_sooner() -> None:
    """Of the Ds, a spilled turn goes to the one that would be done with it soonest: its
    decode-only tokens queued plus what it would compute beyond its own prefix cache (d1 decoded
    a turn of the same conversation, so it caches its history), not to the least loaded one
    whatever it caches; once d1's queue outweighs what its cache saves, to the least loaded."""
    router, prefill = _router(prefix_pull=False)
    p0, p1 = prefill.add("http://p0"), prefill.add("http://p1")
    d0, d1 = router.decode.add("http://d0"), router.decode.add("http://d1")
    history = _chat("A long question about blocks. " * 20)
    router.decoded(d1.url, _prefixes(history))
    messages = [*history["messages"], {"role": "user", "content": "And then?"}]  # type: ignore[list-item]
    follow_up = _prefixes({**history, "messages": messages})
    work = follow_up.total + 1
    p0.outstanding_work = p1.outstanding_work = 50 * work
    d1.inflight, d1.outstanding_work = 1, 1 + 100  # d1 decodes one turn that prefilled 100
    spill = router.spill(None, work, "", follow_up)
    assert spill is not None and spill.backend is d1 and not spill.holder
    assert spill.d_cached_chars == _prefixes(history).total
    assert spill.tokens < work  # it computes only what its cache lacks
    # d1 with more queued than its cache saves: the least loaded D computes the whole prompt.
    d1.outstanding_work = 1 + work
    spill = router.spill(None, work, "", follow_up)
    assert spill is not None and spill.backend is d0 and spill.d_cached_chars == 0
    # d1 busy: not a candidate whatever it caches.
    d1.outstanding_work = 1 + 100
    d1.inflight = router.settings.decode_overload_inflight
    spill = router.spill(None, work, "", follow_up)
    assert spill is not None and spill.backend is d0


def test_an_idle_p_yields_a_turn_to_the_d_whose_cache_holds_its_history() -> None:
    """A turn with no held history (its hold gone, or holds off) whose history a D decoded:
    even with every P idle, that D computes only what its cache lacks while a P would compute
    the whole prompt, so the turn spills to it; a D caching no more than the P does not take it
    (the idle P computes no more than any D would)."""
    router, prefill = _router(prefix_pull=False)
    p0 = prefill.add("http://p0")
    router.decode.add("http://d0")
    d1 = router.decode.add("http://d1")
    history = _chat("A long question about blocks. " * 20)
    messages = [*history["messages"], {"role": "user", "content": "And then?"}]  # type: ignore[list-item]
    follow_up = _prefixes({**history, "messages": messages})
    work = follow_up.total + 1
    assert p0.outstanding_work == 0
    assert router.spill(None, work, "", follow_up) is None  # no D caches any of it
    router.decoded(d1.url, _prefixes(history))
    spill = router.spill(None, work, "", follow_up)
    assert spill is not None and spill.backend is d1 and not spill.holder
    assert spill.tokens < work // 4  # it computes only the new question
    # P caching the same history (it computed it): P computes no more than d1, no spill.
    assert router.prefixes is not None
    router.prefixes.record(p0.url, _prefixes(history))
    assert router.spill(None, work, "", follow_up) is None


def test_decode_only_cached_picks_the_d_expected_to_hold_the_most_of_the_prompt() -> None:
    """With `decode_only_cached`, a turn with no held history goes to the D whose prefix cache
    is expected to hold the most of it, when the rest is short; not when the setting is off, the
    rest is too long, that D is overloaded, or its such turns showed no cached tokens (for that
    tenant, until it shows some again)."""
    router, prefill = _router(decode_only_cached=True, conditional_max_uncached_tokens=64)
    prefill.add("http://p0")
    prefill.add("http://p1")
    d0, d1 = router.decode.add("http://d0"), router.decode.add("http://d1")
    history = _chat("A question about blocks. " * 10)
    messages = [*history["messages"], {"role": "user", "content": "And then?"}]  # type: ignore[list-item]
    follow_up = _prefixes({**history, "messages": messages})
    assert router.cached_decode_only(follow_up) is None  # no D decoded any of it
    router.decoded(d0.url, _prefixes(_chat("Something else")))  # the system prompt only
    router.decoded(d1.url, _prefixes(history))  # the whole history
    picked = router.cached_decode_only(follow_up, "t")
    assert picked is not None
    d, chars, uncached = picked
    assert d is d1 and chars == _prefixes(history).total
    assert uncached == round(len("And then?") / 4)  # the latest characters per token: 4
    assert router.cached_decode_only_fits(d1, 64) and not router.cached_decode_only_fits(d1, 65)
    # A prompt whose rest is long is not sent.
    long_rest = _prefixes(
        {**history, "messages": [*messages[:-1], {"role": "user", "content": "x" * 400}]}
    )
    assert router.cached_decode_only(long_rest) is None
    # d1 overloaded: not sent (d0's system prompt alone leaves too long a rest).
    d1.inflight = router.settings.decode_overload_inflight
    assert router.cached_decode_only(follow_up) is None
    d1.inflight = 0
    # d1's such turn showed no cached tokens for tenant t: withdrawn for t, not for others;
    # the holder's decode-only turns are another standing.
    router.cached_decode_served(d1.url, 0, "t")
    assert router.cached_decode_only(follow_up, "t") is None
    assert router.cached_decode_only(follow_up, "u") is not None
    assert router.decode_only.admits(d1.url, "t")
    off, prefill = _router(conditional_max_uncached_tokens=64, decode_only_cached=False)
    prefill.add("http://p0")
    off.decode.add("http://d1")
    off.decoded("http://d1", _prefixes(history))
    assert off.cached_decode_only(follow_up) is None


def test_decode_only_cached_follows_what_ds_events_report() -> None:
    """With the engines' KV events followed, the routing-fed index keeps a prompt only until its
    blocks are reported: what D's events show cached (a prefix other requests share, stored
    there by an earlier turn) is what sends a turn decode-only to that D; a P's events never
    do, and once D reports the blocks removed the turn goes no more."""
    router, prefill = _events_router(decode_only_cached=True, conditional_max_uncached_tokens=96)
    p0 = prefill.add("http://p0")
    prefill.add("http://p1")
    d0, d1 = router.decode.add("http://d0"), router.decode.add("http://d1")
    assert router.blocks is not None
    shared = list(range(5000, 5320))  # 320 tokens: 20 blocks of 16, the system prompt
    question = [7] * 80
    prompt = _tokens_prompt(shared + question, _chat("q1".ljust(290, "x")))
    assert router.cached_decode_only(prompt) is None  # nobody reported any of it
    router.blocks.stored(p0.url, list(range(20)), None, shared, 16, SALTED)
    prompt = _tokens_prompt(shared + question, _chat("q2".ljust(290, "x")))
    assert router.cached_decode_only(prompt) is None  # a P caches it: not a decode-only turn
    router.blocks.stored(d1.url, list(range(100, 120)), None, shared, 16, SALTED)
    prompt = _tokens_prompt(shared + question, _chat("q3".ljust(290, "x")))
    picked = router.cached_decode_only(prompt, "t")
    assert picked is not None
    d, chars, uncached = picked
    assert d is d1 and chars == prompt.total * 320 // 400
    assert uncached == 80  # the prompt's own tokens: 80 of them D lacks
    router.blocks.removed(d1.url, list(range(100, 120)))
    prompt = _tokens_prompt(shared + question, _chat("q4".ljust(290, "x")))
    assert router.cached_decode_only(prompt) is None
    assert d0.url not in router.reported_tokens(prompt)


def test_a_holder_whose_pin_came_too_late_serves_no_pulls_for_a_while() -> None:
    router, prefill = _events_router(prefix_pull_min_tokens=64, reuse_probe_interval_s=60)
    p0, p1 = prefill.add("http://p0"), prefill.add("http://p1")
    assert router.blocks is not None
    shared = list(range(1000, 1320))
    router.blocks.stored(p1.url, list(range(20)), None, shared, 16, SALTED)
    p1.outstanding_work = 10_000
    prompt = _tokens_prompt(shared + [7] * 80, _chat("late"))
    router.pin_too_slow(p1.url)
    chosen = router.pick_prefill(None, set(), prompt.total + 1, prompt=prompt)
    assert chosen.backend is p0 and chosen.source is None and chosen.work == prompt.total + 1


def test_no_pull_below_the_minimum_off_or_with_a_held_history() -> None:
    tokens = list(range(2000, 2400))
    body = _chat("short")
    for settings, held, stored in (
        ({"prefix_pull_min_tokens": 321}, 0, 320),  # fewer tokens than the minimum
        ({"prefix_pull": False}, 0, 320),  # off
        ({}, 500, 320),  # the conversation's holder is pulled from instead
    ):
        router, prefill = _events_router(**settings)
        prefill.add("http://p0")
        p1 = prefill.add("http://p1")
        assert router.blocks is not None
        router.blocks.stored(p1.url, list(range(20)), None, tokens[:stored], 16, SALTED)
        prompt = _tokens_prompt(tokens, body)
        p1.outstanding_work = 10_000
        chosen = router.pick_prefill(None, set(), prompt.total + 1, prompt=prompt, held_chars=held)
        assert chosen.backend is not p1 and chosen.source is None, settings


def test_prefix_routing_off_or_one_p_leaves_the_load_choice() -> None:
    router, prefill = _router(prefix_routing=False)
    assert router.prefixes is None and not router.routes_by_prefix
    router, prefill = _router()
    prefill.add("http://p0")
    assert not router.routes_by_prefix  # one P: nothing to choose, no index cost per turn
    prefill.add("http://p1")
    assert router.routes_by_prefix


# -- holds ---------------------------------------------------------------------------------------


def test_holds_stop_once_enough_have_ended_unused_and_probe_to_see_a_change() -> None:
    clock = Clock()
    holds = HoldPayoff(min_use=0.1, patience_s=60, ttl_s=600, clock=clock)
    decisions = []
    for i in range(300):  # one-off requests, one a second: a hold each, none taken
        hold = holds.worth_holding("t")
        decisions.append(hold)
        if hold:
            holds.made("t", ("t", f"c{i}"))
        clock.now += 1
    # Nothing is decided within the patience: the first minute holds, and the 16 holds that
    # then end unused are the evidence; from there one turn in ten probes.
    assert all(decisions[: 60 + int(MIN_EVIDENCE)])
    late = decisions[150:]
    assert 10 <= sum(late) <= 20
    assert holds.worth_holding("other")  # another tenant's holds are its own
    for i in range(400):  # conversations start continuing: the probes' holds are taken
        if holds.worth_holding("t"):
            holds.made("t", ("t", f"d{i}"))
            clock.now += 5
            _take(holds, "t", ("t", f"d{i}"))
        clock.now += 1
    assert all(holds.worth_holding("t") for _ in range(10))


def test_a_hold_is_not_judged_before_its_patience_is_over() -> None:
    """Conversations whose next turns come late (but within the patience) keep holding: a
    pending hold decides nothing."""
    clock = Clock()
    holds = HoldPayoff(min_use=0.1, patience_s=600, ttl_s=600, clock=clock)
    for i in range(200):  # 200 first turns in 200 s; next turns come 300 s later
        assert holds.worth_holding("t")
        holds.made("t", ("t", f"c{i}"))
        clock.now += 1
    for i in range(200):
        if i % 4 == 0:  # a quarter of the conversations continue
            _take(holds, "t", ("t", f"c{i}"))
        clock.now += 1
        assert holds.worth_holding("t")


def test_a_tenant_whose_next_turns_come_late_learns_to_wait_for_them() -> None:
    """A quarter of the conversations continue five minutes later. The first holds count
    unused after the minute's patience (no take seen yet), so the tenant stops holding but for
    probes; the late takes of earlier holds still count and show the delay, the patience grows
    to it, and the tenant holds again."""
    clock = Clock()
    holds = HoldPayoff(min_use=0.1, patience_s=60, ttl_s=600, clock=clock)
    held: set[int] = set()
    decisions = []
    for i in range(2000):
        hold = holds.worth_holding("t")
        decisions.append(hold)
        if hold:
            holds.made("t", ("t", i))
            held.add(i)
        earlier = i - 300
        if earlier % 4 == 0 and earlier in held:  # its next turn: it takes the hold
            _take(holds, "t", ("t", earlier))
        clock.now += 1
    assert not all(decisions[:300])  # judged on a minute's patience before any take came
    assert all(decisions[-300:])


def test_holds_that_are_taken_keep_holding() -> None:
    clock = Clock()
    holds = HoldPayoff(min_use=0.1, patience_s=10, ttl_s=600, clock=clock)
    for i in range(300):
        assert holds.worth_holding("t")
        holds.made("t", ("t", f"c{i}"))
        if i % 5 == 0:  # a fifth of the holds taken: they pay
            _take(holds, "t", ("t", f"c{i}"))
        clock.now += 1
    assert HoldPayoff(min_use=0, patience_s=10, ttl_s=600).worth_holding("t")


def test_holds_taken_but_never_read_stop_holding_as_unused_ones_do() -> None:
    """Every conversation continues, but its next turn reads none of the hold (it goes to
    another D, or P's own cache has the history): the holds pinned D for nothing, so the
    tenant stops holding but for probes, and holds again once next turns read them."""
    clock = Clock()
    holds = HoldPayoff(min_use=0.1, patience_s=60, ttl_s=600, clock=clock)
    unread = REGISTRY.get_sample_value("kvrelay_hold_decisions_total", {"decision": "unread"})
    decisions = []
    for i in range(300):
        hold = holds.worth_holding("t")
        decisions.append(hold)
        if hold:
            holds.made("t", ("t", f"c{i}"))
        if i >= 5 and decisions[i - 5]:  # its next turn takes the hold and reads nothing
            _take(holds, "t", ("t", f"c{i - 5}"), read=False)
        clock.now += 1
    assert all(decisions[:16])  # until the evidence is in
    assert 10 <= sum(decisions[150:]) <= 20  # one turn in ten probes
    after = REGISTRY.get_sample_value("kvrelay_hold_decisions_total", {"decision": "unread"})
    assert (after or 0.0) - (unread or 0.0) >= 16
    for i in range(300):  # next turns now read what the probes held
        if holds.worth_holding("t"):
            holds.made("t", ("t", f"r{i}"))
            _take(holds, "t", ("t", f"r{i}"))
        clock.now += 1
    assert all(holds.worth_holding("t") for _ in range(10))


def test_a_take_of_a_hold_another_worker_made_counts() -> None:
    clock = Clock()
    holds = HoldPayoff(min_use=0.1, patience_s=10, ttl_s=600, clock=clock)
    for i in range(100):  # this worker's holds all end unused (their next turns went elsewhere)
        holds.made("t", ("t", f"mine{i}"))
        _take(holds, "t", ("t", f"theirs{i}"))  # ... and it serves other workers' next turns
        clock.now += 1
        assert holds.worth_holding("t")


def test_holds_counted_unused_are_given_back_once_the_tenant_stops_paying() -> None:
    clock = Clock()
    holds = HoldPayoff(min_use=0.1, patience_s=60, ttl_s=600, clock=clock)
    for i in range(100):  # one-off requests, one a second
        if holds.worth_holding("t"):
            holds.made("t", ("t", f"c{i}"))
        assert holds.unpaid("paying") == []
        clock.now += 1
    # The holds made in the first 40 s were counted unused after their minute; the tenant's
    # holds do not pay, so those are given back now rather than at their lease's end, once.
    assert holds.unpaid("t") == [("t", f"c{i}") for i in range(40)]
    assert holds.unpaid("t") == []
    # A tenant whose holds are taken gives nothing back.
    for i in range(100):
        assert holds.worth_holding("p")
        holds.made("p", ("p", f"c{i}"))
        if i % 3 == 0:
            _take(holds, "p", ("p", f"c{i}"))
        clock.now += 1
    clock.now += 120
    assert holds.worth_holding("p") and holds.unpaid("p") == []


def test_a_next_turn_that_finds_its_hold_given_back_still_teaches_the_tenant() -> None:
    """As the late-takes case, with the give-back the proxy does: holds counted unused are
    given back while the tenant declines, so their next turns find no entry. Those next turns
    still count as takes (`missed`): the tenant learns that its conversations
    continue five minutes later and holds again, instead of giving back every probe before its
    take can come."""
    clock = Clock()
    holds = HoldPayoff(min_use=0.1, patience_s=60, ttl_s=600, clock=clock)
    held: set[int] = set()
    given: set[int] = set()
    decisions = []
    for i in range(2000):
        hold = holds.worth_holding("t")
        given |= {key[1] for key in holds.unpaid("t") if isinstance(key, tuple)}
        decisions.append(hold)
        if hold:
            holds.made("t", ("t", i))
            held.add(i)
        earlier = i - 300
        if earlier % 4 == 0 and earlier in held:  # its next turn looks its hold up
            if earlier in given:
                holds.missed("t", ("t", earlier))
            else:
                _take(holds, "t", ("t", earlier))
        clock.now += 1
    assert given  # the tenant was judged early, and its holds given back
    assert all(decisions[-300:])
    holds.missed("t", ("t", "never-held"))  # a lookup of nothing known changes nothing


# -- turns that wait for a prefix another turn is computing ------------------------------------


def test_a_turn_waits_only_for_a_leader_computing_most_of_its_prompt() -> None:
    """A lead covers the prompt's prefixes beyond what any engine caches by at least the
    minimum, and none already led; a later prompt finds it only through a prefix of at least
    half of itself and at least the minimum; `done` drops the lead's prefixes, once, and only
    its own."""
    in_flight = PrefixesInFlight(max_wait_s=5, min_chars=400)
    assert not PrefixesInFlight(max_wait_s=0, min_chars=400).on
    long_system = "You answer from the shared document. " * 30  # 1110 characters
    first = _prefixes(_chat("First question?", system=long_system))
    assert in_flight.leader_of(first) is None
    # An engine caches the system prompt already and the rest is under the minimum: nothing
    # worth waiting for is computed, and a prefix cached but for a partial block is not led.
    assert in_flight.lead(first, {"http://p0": first.chars[0]}) is None
    assert in_flight.lead(first, {"http://p0": first.chars[0] - 60}) is None
    long_question = _prefixes(_chat("A long question? " * 30, system=long_system))
    cached_system = in_flight.lead(long_question, {"http://p0": first.chars[0]})
    assert cached_system is not None and len(in_flight) == 1  # the rest only
    cached_system.done()
    lead = in_flight.lead(first, {})
    assert lead is not None and len(in_flight) == len(first.keys)
    assert in_flight.lead(first, {}) is None  # every prefix led already
    follower = _prefixes(_chat("Another question?", system=long_system))
    assert in_flight.leader_of(follower) is lead  # through the system prompt
    short = _prefixes(_chat("?", system="Short system prompt. "))
    assert in_flight.leader_of(short) is None
    # The shared system prompt is under half of this prompt: not worth waiting for.
    mostly_new = _prefixes(_chat("x" * 3000, system=long_system))
    assert in_flight.leader_of(mostly_new) is None
    # A document shared at the start of the user message: found through its runs.
    document = "The shared document says what the answer is. " * 30
    with_document = _prefixes(_chat(document + "First question?", system="Be brief. "))
    document_lead = in_flight.lead(with_document, {})
    assert document_lead is not None
    asking_again = _prefixes(_chat(document + "Second question?", system="Be brief. "))
    assert in_flight.leader_of(asking_again) is document_lead
    document_lead.done()
    other = PrefixesInFlight(max_wait_s=5, min_chars=2000)
    other.lead(first, {})
    assert other.leader_of(follower) is None  # the shared prefix is under the minimum
    lead.done()
    lead.done()
    assert len(in_flight) == 0 and in_flight.leader_of(follower) is None


async def test_waiters_go_on_when_the_lead_is_done_or_at_the_bound() -> None:
    """Waiters wake when the leader is done (counted computed) or after `max_wait_s`
    (counted timeout); a prompt nobody computes does not wait."""
    long_system = "Everyone waits for this system prompt. " * 30
    in_flight = PrefixesInFlight(max_wait_s=5, min_chars=400)
    lead = in_flight.lead(_prefixes(_chat("Lead?", system=long_system)), {})
    assert lead is not None
    waiter = asyncio.create_task(in_flight.wait(_prefixes(_chat("Wait?", system=long_system))))
    await asyncio.sleep(0)
    assert not waiter.done()
    computed = _counter('kvrelay_prefix_waits_total{result="computed"}')
    lead.done()
    await asyncio.wait_for(waiter, 1)
    assert _counter('kvrelay_prefix_waits_total{result="computed"}') == computed + 1
    quick = PrefixesInFlight(max_wait_s=0.01, min_chars=400)
    assert quick.lead(_prefixes(_chat("Lead?", system=long_system)), {}) is not None
    timeouts = _counter('kvrelay_prefix_waits_total{result="timeout"}')
    await asyncio.wait_for(quick.wait(_prefixes(_chat("Wait?", system=long_system))), 1)
    assert _counter('kvrelay_prefix_waits_total{result="timeout"}') == timeouts + 1
    await asyncio.wait_for(in_flight.wait(_prefixes(_chat("Nobody?"))), 1)


async def test_a_turn_leads_before_it_is_planned_and_again_on_what_it_then_knows() -> None:
    """A turn leads as soon as it knows its prompt; planned, it leads again (`relead`): a
    waiter whose prefix the new lead still covers waits on for it, one whose prefix the
    engines turned out to cache goes on at once, and ending the old lead never ends the new."""
    long_system = "Everyone waits for this system prompt. " * 30
    in_flight = PrefixesInFlight(max_wait_s=5, min_chars=400)
    prompt = _prefixes(_chat("The leader's own long question? " * 20, system=long_system))
    provisional = in_flight.lead(prompt, {})  # before tokens: no engine known to cache it
    assert provisional is not None
    follower = _prefixes(_chat("Wait?", system=long_system))
    same = _prefixes(_chat("The leader's own long question? " * 20, system=long_system))
    waiter = asyncio.create_task(in_flight.wait(follower))
    twin = asyncio.create_task(in_flight.wait(same))
    await asyncio.sleep(0)
    # Planned: the engines' events show the system prompt cached; the rest is still computed.
    lead = in_flight.relead(provisional, prompt, {"http://d0": prompt.chars[0]})
    assert lead is not None and lead is not provisional
    await asyncio.wait_for(waiter, 1)  # its prefix is cached: nothing to wait for
    await asyncio.sleep(0)
    assert not twin.done()  # the whole prompt is still being computed
    provisional.done()  # ending the old lead again leaves the new one in place
    assert in_flight.leader_of(same) is lead
    lead.done()
    await asyncio.wait_for(twin, 1)
    # A turn planned decode-only ends its lead; one that finds all of it cached leads nothing.
    again = in_flight.lead(prompt, {})
    assert in_flight.relead(again, prompt, {"http://d0": prompt.total}) is None
    assert len(in_flight) == 0 and in_flight.relead(None, prompt, {}) is not None


def _counter(name: str) -> float:
    return parse_samples(metrics.render()[0].decode()).get(name, 0.0)


def test_late_pins_rest_their_holder_longer_each_time_until_one_is_on_time() -> None:
    """A holder's first late pin rests it a few pin timeouts, each late pin after that twice
    as long, up to the bound; a pin on time ends the series; holders rest apart."""
    clock = Clock()
    rests = PinRests(timeout_s=0.5, max_rest_s=60, clock=clock)
    assert rests.serves("http://p0")
    assert [rests.late("http://p0") for _ in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    assert not rests.serves("http://p0") and rests.serves("http://p1")
    clock.now += 59.9
    assert not rests.serves("http://p0")
    clock.now += 0.1
    assert rests.serves("http://p0")
    rests.on_time("http://p0")
    assert rests.late("http://p0") == 2  # a new series
    assert PinRests(timeout_s=30, max_rest_s=60, clock=clock).late("http://p0") == 60
