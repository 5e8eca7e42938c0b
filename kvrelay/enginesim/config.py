"""`EngineConfig`: every knob of one simulated engine (pool geometry, limits, timing, connector)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.connector.config import ConnectorConfig
from kvrelay.enginesim.costs import (
    DEFAULT_LINK,
    DEFAULT_TRANSFER_LAYOUT,
    TRANSFER_LAYOUTS,
    get_link,
    get_profile,
)
from kvrelay.enginesim.kvpool import BlockPool, KVLayout
from kvrelay.enginesim.model import ModelGeometry
from kvrelay.enginesim.residency import BlockResidency

DEFAULT_MODEL = "kvrelay-sim"


@dataclass(frozen=True)
class EngineConfig:
    """One engine: model identity, KV pool, scheduling limits and simulated costs."""

    model: str = DEFAULT_MODEL
    max_model_len: int = 4096
    num_blocks: int = 1024
    block_size: int = 16
    geometry: ModelGeometry = field(default_factory=ModelGeometry)
    kv_layout: KVLayout = KVLayout.KV_FIRST
    max_num_seqs: int = 64
    # Tokens one step may compute (vLLM's `--max-num-batched-tokens`): running decodes take
    # one each, prefill chunks the rest, so a long prompt is prefilled over several steps
    # while the engine's decoders keep going. 8192 is what vLLM 0.32 picks for online serving
    # on an H100 or H200 (the GPUs of every cost profile); 2048 on smaller GPUs.
    max_num_batched_tokens: int = 8192
    # vLLM's `--scheduling-policy`: "fcfs" admits waiting requests in arrival order (a
    # request's `priority` is ignored), "priority" by (priority, arrival), lower first.
    scheduling_policy: str = "fcfs"
    # Simulated compute: prefill sleeps this long per locally computed prompt token.
    prefill_us_per_token: float = 0.0
    # One decode step of the running batch; prefill computed in the same step adds its own
    # time to that step, so prefill work on an engine slows its decoding requests.
    decode_us_per_step: float = 0.0
    # A named GPU cost profile (`costs.PROFILES`) instead of the two flat knobs above: each
    # step waits the modelled time of its prefill chunks and decode batch, and each KV load
    # waits the modelled transfer time over `kv_link` on top of the real NIXL read.
    cost_profile: str | None = None
    kv_link: str = DEFAULT_LINK
    # How the modelled GPUs' caches are registered for those transfers, which sets how many
    # descriptors a read costs (`costs.TRANSFER_LAYOUTS`): block-major, as the connector asks
    # vLLM for on a GPU, or vLLM 0.32's per-layer pages.
    kv_transfer_layout: str = DEFAULT_TRANSFER_LAYOUT
    # vLLM's `--enable-prefix-caching`: full blocks stay findable in the pool until an
    # allocation takes them (`kvpool`). Off by default here (vLLM 0.32 turns it on): the
    # tests and benchmarks that rely on a prefix cache ask for it.
    enable_prefix_caching: bool = False
    # The model ends a reply with EOS with probability ~1/eos_period per token (0: never).
    eos_period: int = 64
    params_in_stream: bool = False
    # vLLM's `--enable-prompt-tokens-details`: `usage.prompt_tokens_details` in answers.
    enable_prompt_tokens_details: bool = False
    # Encode prompts in a child process, as vLLM's API server tokenizes apart from its engine
    # core (`tokenizer_process`): a fleet of engines on a few cores then steps on time.
    tokenizer_process: bool = False
    # A first line the chat template renders ("{messages}": their number): a template that
    # re-renders its first line every turn, so no block of a previous turn matches.
    chat_template_first_line: str = ""
    # A request waiting longer for remote KV means the connector never ended its load
    # (every connector timeout is far shorter): the engine stops with an error.
    remote_kv_wait_limit_s: float = 300.0
    # How this engine hosts the NIXL connector (None: a single engine, no KV transfer). The
    # connector's own settings type; the KV identity fields (model, dtype, block size, layers,
    # layout) are filled in from this config when the connector starts (`nixl_host`).
    connector: ConnectorConfig | None = None
    # vLLM's `--kv-events-config` JSON (`kvrelay.enginesim.kv_events`); None: no events.
    kv_events_config: str | None = None
    # vLLM's `--kv-cache-metrics` and `--kv-cache-metrics-sample`: the residency metrics
    # (`residency.py`), kept for that share of the blocks allocated.
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01

    def new_pool(self) -> BlockPool:
        """The engine's KV pool, as this config describes it (prefix caching in it or not,
        residency metrics kept or not)."""
        pool = BlockPool(
            self.num_blocks,
            self.block_size,
            self.geometry,
            self.kv_layout,
            prefix_caching=self.enable_prefix_caching,
        )
        if self.kv_cache_metrics:
            pool.residency = BlockResidency(self.kv_cache_metrics_sample)
        return pool

    def validate(self) -> None:
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.num_blocks * self.block_size < self.max_model_len:
            # A single request of max_model_len tokens must always fit the pool.
            raise ValueError(
                f"num_blocks * block_size ({self.num_blocks * self.block_size}) must be at least "
                f"max_model_len ({self.max_model_len})"
            )
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if not 0 < self.kv_cache_metrics_sample <= 1:
            raise ValueError("kv_cache_metrics_sample must be in (0, 1] (vLLM's bound)")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM refuses this too: every running request must fit one step's budget.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        get_link(self.kv_link)
        if self.kv_transfer_layout not in TRANSFER_LAYOUTS:
            raise ValueError(
                f"kv_transfer_layout must be one of {', '.join(TRANSFER_LAYOUTS)} "
                f"(got {self.kv_transfer_layout!r})"
            )
        if self.cost_profile is not None:
            get_profile(self.cost_profile)
            if self.prefill_us_per_token or self.decode_us_per_step:
                raise ValueError(
                    "a cost profile replaces prefill_us_per_token and decode_us_per_step: "
                    "give one or the other"
                )
