"""What a pin's wait costs a pulled turn, measured: `PinWaits` and `PrefillPace`.

A turn that pulls a prefix first waits for the holder's pin (`kvrelay.proxy.turn.prefix_pin`).
The router models that wait as half of the holder's current step (`routing.PIN_WAIT_SHARE`),
but a holder answers later than that whenever its step is long (a D prefilling a spilled
prompt) or its server is slow to admit the pin; on such a fleet a pull that looks cheaper than
computing the prefix makes its turn later. So the router also weighs what the fleet has
measured: how long each holder's pins took to answer lately (`PinWaits`), in tokens the reader
could have computed meanwhile, at the pace Ps compute prompt tokens while busy
(`PrefillPace`, from their own answers). Both figures are this worker's: other workers'
requests on a P take its time too, so with several workers the pace reads low (a pull weighs
less) and a pin's wait stays what it was for this worker's turns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# A moving mean over about the last five pins of a holder: one slow pin (a long step) moves it
# part of the way, a run of them moves it all the way.
PIN_WEIGHT = 0.2
# The pace counts the last minute or so of P's work: long enough for thousands of tokens,
# short enough to follow a change of load or model.
PACE_HALF_LIFE_S = 60.0
# Less busy time than this says too little of P's pace (one request's overheads dominate).
PACE_MIN_BUSY_S = 1.0
# How often the pace is shown (`kvrelay_prefill_pace_tokens_per_second`): a metric's write on
# every leg would cost the hot path for a figure that moves over a minute.
SHOW_EVERY_S = 1.0


class PinWaits:
    """Per holder URL, and per pool of holders, the moving mean of the pins' answer times
    (seconds), forgotten `forget_s` after the last pin: a holder no longer pulled from
    (because its pins weighed too much) is weighed by the model again after that, and so
    tried again. A holder not pinned lately is weighed by its pool's mean: engines of one pool
    run alike, so each of them need not make a turn wait before its own pins are known."""

    def __init__(self, forget_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._forget_s = forget_s
        self._clock = clock
        # url, or "pool:" + the pool's name -> (mean seconds, last pin at)
        self._mean: dict[str, tuple[float, float]] = {}

    def answered(self, url: str, pool: str, seconds: float) -> None:
        """A pin on `url`, an engine of `pool`, was answered `seconds` after it was asked."""
        now = self._clock()
        for key in (url, "pool:" + pool):
            known = self._mean.get(key)
            if known is None or now - known[1] > self._forget_s:
                mean = seconds
            else:
                mean = known[0] + PIN_WEIGHT * (seconds - known[0])
            self._mean[key] = (mean, now)

    def seconds(self, url: str, pool: str) -> float | None:
        """The holder's recent pin wait, else its pool's; None when neither answered a pin
        within `forget_s`."""
        now = self._clock()
        for key in (url, "pool:" + pool):
            known = self._mean.get(key)
            if known is not None and now - known[1] <= self._forget_s:
                return known[0]
        return None


class PrefillPace:
    """The prompt tokens the Ps compute per second of being busy (at least one of this
    worker's legs in flight on them), from their answers (`computed`: the prompt less what
    their cache or a pull gave), decayed with `PACE_HALF_LIFE_S`. Busy time accrues at each
    answer, so a P that is never idle still counts."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._inflight: dict[str, int] = {}
        self._accrued_at: dict[str, float] = {}  # url -> busy time counted up to then
        self._tokens = 0.0
        self._busy_s = 0.0
        self._ever_busy_s = 0.0  # undecayed: decay keeps the pace, not the evidence for it
        self._decayed_at = clock()
        self._shown_at = -math.inf

    def started(self, url: str) -> None:
        """A leg was sent to the P at `url`."""
        count = self._inflight.get(url, 0)
        if count == 0:
            self._accrued_at[url] = self._clock()
        self._inflight[url] = count + 1

    def ended(self, url: str, computed: int) -> bool:
        """A leg on the P at `url` ended, that P having computed `computed` prompt tokens for
        it (0: unknown, or it failed). True once `SHOW_EVERY_S` has passed since it last said
        so: the caller shows the pace (a metric) that often, not after every leg."""
        count = self._inflight.get(url, 0)
        if count == 0:
            return False  # not started here: nothing to accrue
        now = self._clock()
        self._decay(now)
        busy = max(0.0, now - self._accrued_at[url])
        self._busy_s += busy
        self._ever_busy_s += busy
        self._tokens += max(0, computed)
        if count == 1:
            del self._inflight[url], self._accrued_at[url]
        else:
            self._inflight[url] = count - 1
            self._accrued_at[url] = now
        if now - self._shown_at < SHOW_EVERY_S:
            return False
        self._shown_at = now
        return True

    def tokens_per_s(self) -> float | None:
        """The pace, or None until the Ps were busy `PACE_MIN_BUSY_S` in all and computed
        something."""
        self._decay(self._clock())
        if self._ever_busy_s < PACE_MIN_BUSY_S or self._tokens <= 0 or self._busy_s <= 0:
            return None
        return self._tokens / self._busy_s

    def _decay(self, now: float) -> None:
        elapsed = now - self._decayed_at
        if elapsed <= 0:
            return
        keep = math.pow(0.5, elapsed / PACE_HALF_LIFE_S)
        self._tokens *= keep
        self._busy_s *= keep
        self._decayed_at = now
