"""`ScriptBatcher`: the Redis map's script calls, each sent at once while nothing else is in
flight, and gathered into pipelines while Redis is busy with others.

redis-py spends far more CPU on a command than Redis spends running it: a connection taken
from the pool and given back, the command packed, the reply waited for and parsed, some two
hundred Python calls in all. Under load many turns write the map at once (their engines'
answers arrived in the same poll). A call made while another is in flight is queued; the
calls queued during one event-loop iteration go out on the next as one non-transactional
pipeline, sharing one checkout, one write and one read. A call made while nothing is in
flight is sent at once, as a plain call: a lone client pays nothing and waits for nothing.

Each call keeps its own outcome: a script error reaches its caller only; a broken connection
reaches every call in its pipeline, as it would have reached each of them alone. With
`wait_replicas`, one `WAIT` ends the pipeline: it confirms every write sent before it on the
connection, so each caller learns what it would have learned from its own `WAIT`.

In a pipeline scripts go as `EVALSHA`, loaded first if Redis is not known to have them. After
a Redis restart or `SCRIPT FLUSH` Redis answers NOSCRIPT without running them: the scripts are
loaded again and those calls sent again, once, in one pipeline. A caller that gave up while
queued (its timeout, a cancelled request) is left out of the pipeline, so a `take` nobody
waits for any more does not remove the entry.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

# What a script call gives its caller: the script's reply and how many replicas acknowledged
# the write (`WAIT`'s reply; 0 when the batcher does not wait for replicas).
Outcome = tuple[Any, int]


@dataclass(slots=True)
class _Call:
    script: AsyncScript
    keys: list[str]
    args: list[Any]
    future: asyncio.Future[Outcome] | None  # None: the caller sends it itself


class ScriptBatcher:
    """Runs the map's scripts: alone while nothing is in flight, else batched per iteration.

    Use it from the event loop that owns `client`; `drain` waits for the pipelines still in
    flight (the map's `close`).
    """

    def __init__(self, client: aioredis.Redis, *, wait_replicas: int, wait_ms: int) -> None:
        self._r = client
        self._wait_replicas = wait_replicas
        self._wait_ms = wait_ms
        self._sending = 0  # calls and pipelines in flight
        self._queue: list[_Call] = []  # calls made meanwhile: the next pipeline
        self._pipelines: set[asyncio.Task[None]] = set()
        self._loaded: set[str] = set()  # scripts (SHA-1) Redis is known to have
        self.pipelines_sent = 0  # with more than one call (tests and benchmarks read it)

    async def run(self, script: AsyncScript, keys: list[str], args: list[Any]) -> Outcome:
        """One script call's outcome: its reply and the replicas that acknowledged it."""
        if self._sending or self._queue:
            loop = asyncio.get_running_loop()
            if not self._queue:
                # After every callback already due in this iteration: the calls they make
                # join the same pipeline.
                loop.call_soon(self._send_queued)
            future: asyncio.Future[Outcome] = loop.create_future()
            self._queue.append(_Call(script, keys, args, future))
            return await future
        self._sending += 1
        try:
            return await self._alone(_Call(script, keys, args, None))
        finally:
            self._sending -= 1

    async def drain(self) -> None:
        """Wait for the pipelines in flight (each is bounded by the client's socket timeout)."""
        while self._pipelines:
            await asyncio.gather(*self._pipelines, return_exceptions=True)

    def _send_queued(self) -> None:
        calls = [call for call in self._queue if call.future is not None and not call.future.done()]
        self._queue = []
        if not calls:
            return
        self._sending += 1
        task = asyncio.get_running_loop().create_task(self._send(calls))
        self._pipelines.add(task)
        task.add_done_callback(self._pipelines.discard)

    async def _send(self, calls: list[_Call]) -> None:
        try:
            if len(calls) == 1:
                outcomes: list[Outcome | BaseException] = [await self._alone(calls[0])]
            else:
                outcomes = await self._pipelined(calls)
        except BaseException as exc:  # the connection failed: every call in it failed
            for call in calls:
                _settle(call, exc)
            if not isinstance(exc, Exception):
                raise  # cancelled (the loop is closing): the callers have been told
            return
        finally:
            self._sending -= 1
        for call, outcome in zip(calls, outcomes, strict=True):
            _settle(call, outcome)

    async def _alone(self, call: _Call) -> Outcome:
        """One call as redis-py sends it (NOSCRIPT handled by `Script`); WAIT on the same
        connection when replicas must confirm."""
        if not self._wait_replicas:
            outcome = await call.script(keys=call.keys, args=call.args), 0
        else:
            async with self._r.pipeline(transaction=False) as pipe:
                await call.script(keys=call.keys, args=call.args, client=pipe)
                pipe.execute_command("WAIT", self._wait_replicas, self._wait_ms)
                reply, acked = await pipe.execute()
            outcome = reply, int(acked)
        self._loaded.add(call.script.sha)
        return outcome

    async def _pipelined(self, calls: list[_Call]) -> list[Outcome | BaseException]:
        outcomes = await self._pipeline_once(calls)
        unknown = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, NoScriptError)]
        if unknown:
            # Redis restarted or flushed its scripts since they were loaded; nothing ran.
            self._loaded.clear()
            again = await self._pipeline_once([calls[i] for i in unknown])
            for i, outcome in zip(unknown, again, strict=True):
                outcomes[i] = outcome
        return outcomes

    async def _pipeline_once(self, calls: list[_Call]) -> list[Outcome | BaseException]:
        # Scripts are loaded before the pipeline rather than after a NOSCRIPT answer: with
        # `wait_replicas` every pipeline ends in a WAIT, and a second one would double it.
        for script in {call.script.sha: call.script for call in calls}.values():
            if script.sha not in self._loaded:
                await self._r.script_load(script.script)
                self._loaded.add(script.sha)
        pipe = self._r.pipeline(transaction=False)
        for call in calls:
            pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
        if self._wait_replicas:
            pipe.execute_command("WAIT", self._wait_replicas, self._wait_ms)
        self.pipelines_sent += 1
        replies = await pipe.execute(raise_on_error=False)
        acked = 0
        if self._wait_replicas:
            waited = replies.pop()
            if isinstance(waited, BaseException):
                raise waited
            acked = int(waited)
        return [reply if isinstance(reply, BaseException) else (reply, acked) for reply in replies]


def _settle(call: _Call, outcome: Outcome | BaseException) -> None:
    future = call.future
    if future is None or future.done():  # the caller gave up after the pipeline was sent
        return
    if isinstance(outcome, asyncio.CancelledError):
        future.cancel()
    elif isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
