"""The P leg of a turn: P prefills the prompt (pulling the old turn's KV on a reuse hit) and
keeps its KV for D.

P is chosen by the router (`kvrelay.proxy.fleet.Router.pick_prefill`: the P the turn's plan
prefers, the conversation's previous P, else the least loaded); on a connect error, a 5xx
or a timeout another P is tried (`kvrelay.proxy.turn.attempts`). When no P answers, the leg
gives up and D prefills alone (decode-only); a 4xx means the prompt itself is bad, which the
client is told.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvrelay.connector.protocol import (
    KV_TRANSFER_PARAMS,
    REMOTE_PREFILL_CACHED_TOKENS,
    KVTransferParams,
)
from kvrelay.kvcache_map import KVEntry
from kvrelay.proxy.base import jsoncodec, upstream_error_from_body
from kvrelay.proxy.engines import UpstreamError
from kvrelay.proxy.fleet import Backend, Pool, PrefixSource, PromptPrefixes, Router
from kvrelay.proxy.turn.accounting import UNKNOWN_ACCOUNT, PromptAccount, usage_figures
from kvrelay.proxy.turn.attempts import Attempts, LegFailure, Verdict
from kvrelay.proxy.turn.legs import prefill_body, prefill_priority

log = logging.getLogger(__name__)

# Has a prefix's source P keep it for the turn's P to pull: its params, or None
# (`kvrelay.proxy.turn.prefix_pin.PrefixPin.pin`).
Pinner = Callable[[PrefixSource, Sequence[int]], Awaitable[KVTransferParams | None]]


@dataclass(slots=True)  # not frozen: made on every turn (see `PromptShape`), never changed
class PrefillAnswer:
    """What P gave the turn: where it ran, its params for D, its prompt's token count, what it
    reported of the prompt, and whether it was the P the plan preferred."""

    backend: Backend
    params: KVTransferParams | None  # parsed once, here at the edge; None when unusable
    prompt_tokens: int | None
    account: PromptAccount  # what P reported it did with the prompt
    by_affinity: bool = False  # the conversation's previous P, as the plan preferred
    pulled_prefix: bool = False  # P was sent another P's pinned prefix to pull


class _PrefillReply(BaseModel):
    """The two fields of P's answer a turn reads. pydantic-core reads them from the answer's
    bytes in one pass (its JSON reader keeps every integer exact and builds no Python object
    for the fields skipped), where parsing the whole answer into Python and then validating the
    params took two; anything this refuses is read the long way (`read_prefill_answer`).
    Only keys go to the reader's string cache: block hashes and ids are new on every answer,
    and caching them cost more than the parse (a long prompt's answer: 58 -> 41 us)."""

    model_config = ConfigDict(extra="ignore", cache_strings="keys")

    kv_transfer_params: KVTransferParams | None = None
    usage: Any = None


def read_prefill_answer(raw: bytes) -> tuple[KVTransferParams | None, Any] | None:
    """P's params (None when absent or unusable) and its `usage`; None when the answer is not a
    JSON object."""
    try:
        reply = _PrefillReply.model_validate_json(raw)
    except ValueError:  # not JSON, not an object, NaN, unusable params: the long way decides
        try:
            data = jsoncodec.loads(raw)
        except (ValueError, RecursionError):
            return None
        if not isinstance(data, dict):
            return None
        return KVTransferParams.from_wire_or_none(data.get(KV_TRANSFER_PARAMS)), data.get("usage")
    return reply.kv_transfer_params, reply.usage


class PrefillLeg:
    """One turn's P leg: its request, its retries, and reading P's answer."""

    def __init__(self, attempts: Attempts, pool: Pool, router: Router, request_id: str) -> None:
        self._attempts = attempts
        self._pool = pool
        self._router = router
        self._request_id = request_id

    async def run(
        self,
        body: dict[str, Any],
        entry: KVEntry | None,
        prefer: str | None,
        work: int,
        tenant: str = "",
        prompt: PromptPrefixes | None = None,
        pin: Pinner | None = None,
        priority_tokens: int = 0,
    ) -> PrefillAnswer | None:
        """P's answer, or None when no P answered (D then prefills alone). `entry`: the
        conversation's usable entry, whose blocks P pulls; `prefer`: the P to try first (the
        conversation's previous P); `work` is the prompt's weight; `tenant`'s standing decides
        P affinity; `prompt`: the prompt's prefixes when P is chosen by what it caches
        (`Router.routes_by_prefix`). What P is expected to compute counts against its
        outstanding work while it prefills. `pin`: asks the P a pick names as a prefix's
        source to keep it (`PrefixPin`; once per turn): the Ps tried from then on pull it,
        the source itself excepted. `priority_tokens`: `prefill_priority_tokens`, the size of
        one level of P's request priority (0: none set)."""
        attempts, pool, router = self._attempts, self._pool, self._router
        report = attempts.report
        reuse = entry.to_kv_transfer_params() if entry is not None else None
        held_chars = (
            round(entry.num_tokens * entry.chars_per_token)
            if entry is not None and entry.chars_per_token
            else 0
        )
        priority = None
        if priority_tokens:
            # What P computes, the held history it pulls left out. Its own prefix cache may
            # save more; that differs from P to P, and the body is made once for all tried.
            cpt = router.chars_per_token(entry, prompt)
            priority = prefill_priority(work - held_chars, cpt, priority_tokens)
        payload = pulled = plain = jsoncodec.dumps(prefill_body(body, reuse, priority))
        pinned: KVTransferParams | None = None
        pinned_at: str | None = None  # the source asked (its URL), once asked
        affine: set[str] = set()
        computes: dict[str, int] = {}  # P -> the prompt characters it is expected to compute
        sources: dict[str, PrefixSource] = {}  # P -> the P it would pull a prefix from

        def pick(exclude: set[str]) -> Backend | None:
            chosen = router.pick_prefill(prefer, exclude, work, tenant, prompt, held_chars)
            backend = chosen.backend
            if backend is not None:
                computes[backend.url] = chosen.work
                if chosen.by_affinity:
                    affine.add(backend.url)
                if chosen.source is not None:
                    sources[backend.url] = chosen.source
            return backend

        for backend in attempts.tries("prefill", pick):
            source = sources.get(backend.url)
            if (
                source is not None
                and pinned_at is None
                and pin is not None
                and prompt is not None
                and prompt.tokens
            ):
                pinned_at = source.backend.url
                pinned = await pin(source, prompt.tokens)
                if pinned is not None:
                    pulled = jsoncodec.dumps(prefill_body(body, pinned, priority))
            pulls = pinned is not None and backend.url != pinned_at
            payload = pulled if pulls else plain  # the source serves it from its cache
            start = time.monotonic()
            router.prefill_started(backend.url)
            computed = 0  # what P's answer says it computed: P's pace (`PrefillPace`)
            try:
                with pool.busy(backend, computes[backend.url]):
                    status, raw = await self._post_read(backend, payload)
                report.leg_answered("prefill", status)
                report.leg_latency("prefill", str(status // 100) + "xx", start)
                verdict = attempts.verdict(pool, backend, status)
                if verdict is Verdict.REFUSED:
                    log.warning("prefill on %s answered %d", backend.url, status)
                    continue
                if verdict is Verdict.REJECTED:
                    raise upstream_error_from_body(status, raw, "prefill")  # D refuses it too
                answer = self._answer(backend, raw, backend.url in affine, pulls)
                computed = answer.account.computed or 0
                return answer
            except LegFailure as exc:
                await attempts.failed(pool, backend, exc, start)
                continue
            finally:
                router.prefill_ended(backend.url, computed)
        report.fell_back("decode_only")
        log.warning(
            "no prefill engine answered; decode engine prefills (request %s)", self._request_id
        )
        return None

    async def _post_read(self, backend: Backend, payload: bytes) -> tuple[int, bytes]:
        resp = await self._attempts.send(backend, payload)
        try:
            return resp.status, await resp.read()
        except UpstreamError as exc:
            raise LegFailure(f"reading the answer failed: {type(exc).__name__}") from exc
        finally:
            resp.release()

    @staticmethod
    def _answer(backend: Backend, raw: bytes, by_affinity: bool, pulls: bool) -> PrefillAnswer:
        answer = read_prefill_answer(raw)
        if answer is None:
            return PrefillAnswer(backend, None, None, UNKNOWN_ACCOUNT, by_affinity, pulls)
        params, usage = answer
        prompt_tokens, _ = usage_figures(usage)  # bounded: it sizes the next turn's estimate
        account = _account(params, usage)
        return PrefillAnswer(backend, params, prompt_tokens, account, by_affinity, pulls)


def _account(params: KVTransferParams | None, usage: object) -> PromptAccount:
    """What P reported it did with the prompt: its connector's report, else vLLM's own total
    (`remote_prefill_cached_tokens`, or the usage details: P's answer is P's own figure)."""
    connector = PromptAccount.from_connector(params)
    if connector is not None:  # kvrelay's connector: the split, prompt tokens included
        return connector
    cached = params.__dict__[REMOTE_PREFILL_CACHED_TOKENS] if params is not None else None
    return PromptAccount.from_usage(usage, cached)
