"""One engine request: sampling settings, progress through the scheduler, and its outputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvrelay.connector.protocol import DO_REMOTE_PREFILL


class ReqState(Enum):
    """Where a request is in the engine (vLLM's states, minus the ones a sim does not need)."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """The sampling settings the simulated model honours (greedy, deterministic)."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineError:
    """A request that ended in an error (OpenAI error fields)."""

    status: int
    message: str
    type: str = "InternalServerError"


@dataclass
class Output:
    """One increment of a request's result, delivered to its sink on the engine thread."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    error: EngineError | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    loaded_tokens: int = 0
    # vLLM's `num_cached_tokens` / `num_cache_creation_tokens` of the request (`PrefillStats`).
    num_cached_tokens: int = 0
    cache_creation_tokens: int = 0


@dataclass(eq=False)
class SimRequest:
    """Engine-internal state of one request; `all_token_ids` grows as tokens are generated."""

    request_id: str
    client_request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    kv_transfer_params: dict[str, Any] | None
    sink: Callable[[Output], None]
    # vLLM's `cache_salt`: only requests with the same salt share prefix-cache blocks.
    cache_salt: str | None = None
    # vLLM's request priority: under --scheduling-policy priority, lower is admitted first.
    priority: int = 0
    all_token_ids: list[int] = field(init=False)
    state: ReqState = ReqState.WAITING
    block_ids: list[int] = field(default_factory=list)
    # Positions whose KV is in this request's blocks.
    num_computed: int = 0
    # Where this admission's prefill started (what was cached or loaded before the first
    # chunk); None until that chunk runs. A prefill may span several steps (chunked).
    prefill_start: int | None = None
    # Prefix hashes of every token position (the model's KV seeds).
    hashes: list[int] = field(default_factory=list)
    digest: bytes | None = None
    external: tuple[int, bool] | None = None
    loaded_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the engine's own prefix cache
    # vLLM's `PrefillStats` of the first admission (local hit, external tokens planned) and
    # what the first output reported from them (`num_cached_tokens`, cache creation).
    admitted_local: int | None = None
    admitted_external: int = 0
    num_cached_tokens: int | None = None
    cache_creation_tokens: int = 0
    text: str = ""
    emitted_chars: int = 0
    aborted: bool = False
    loading_since: float = 0.0  # monotonic; when it last started waiting for remote KV
    last_token_at: float = 0.0  # monotonic; the end of the step that sampled its last token
    preempted: bool = False
    connector_view: Any = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def wants_remote_prefill(self) -> bool:
        return bool(self.kv_transfer_params and self.kv_transfer_params.get(DO_REMOTE_PREFILL))
