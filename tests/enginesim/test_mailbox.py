"""`Mailbox`: calls posted from the engine thread run on the loop in order, a batch per wake-up."""

from __future__ import annotations

import asyncio
import threading

from kvrelay.enginesim.mailbox import Mailbox


def test_calls_posted_from_another_thread_run_in_order_with_one_wake_up_per_batch() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        mailbox = Mailbox(loop)
        wake_ups = 0
        original = loop.call_soon_threadsafe

        def counting(callback, *args):  # type: ignore[no-untyped-def]
            nonlocal wake_ups
            wake_ups += 1
            return original(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        got: list[int] = []
        all_in = asyncio.Event()

        def receive(n: int) -> None:
            got.append(n)
            if len(got) == 3000:
                all_in.set()

        # A step's outputs: 1000 posted while the loop is busy elsewhere (this coroutine does
        # not yield until the thread is done) arrive with one wake-up.
        thread = threading.Thread(target=lambda: [mailbox.post(receive, n) for n in range(1000)])
        thread.start()
        thread.join()
        assert wake_ups == 1 and got == []
        await asyncio.sleep(0)
        assert got == list(range(1000))
        # Posted while the loop runs the batches: every call arrives, in order.
        poster = threading.Thread(
            target=lambda: [mailbox.post(receive, n) for n in range(1000, 3000)]
        )
        poster.start()
        await asyncio.wait_for(all_in.wait(), timeout=10)
        poster.join()
        assert got == list(range(3000))

    asyncio.run(scenario())
