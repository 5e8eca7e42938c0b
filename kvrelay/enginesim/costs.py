"""Engine costs of a real GPU, modelled from public figures (sources and assumptions: README).

A `CostProfile` is a model on a GPU type with a tensor-parallel size, plus the efficiency
assumptions that turn datasheet peaks into step times. One engine step is costed as a roofline
over the whole step (vLLM runs prefill chunks and decode tokens in one forward pass):

    step = overhead + max(FLOPs / (peak * MFU), bytes / (HBM bandwidth * efficiency)) + all-reduce

per GPU of the TP group (FLOPs, weights and KV heads are split evenly over the ranks). A long
prefill is compute-bound, a decode batch memory-bound; the `max` picks whichever the shape is.

A KV transfer costs what a NIXL READ was measured to cost, not only its bytes:

    transfer = per-transfer latency + descriptors * per-descriptor cost + bytes / link rate

with each TP rank moving its share over its own link (its own descriptors, in parallel). The
descriptors are what the engine registers (`descriptors`, by `TRANSFER_LAYOUTS`): in the
block-major layout the connector asks vLLM 0.32 for on a GPU (`BLHNC`, every layer's page
inside each block) a read is one descriptor per run of consecutive blocks; in vLLM 0.32's
per-layer layout (one page per layer, K and V together), one per layer per run. The engine's own
link is shared by its concurrent loads (`engine.py` queues them behind each other). Links
(`LINKS`) carry the figures they were measured or published at, named in their comments. All
times are seconds; the engine waits them out, never burns them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GB = 1e9
TB = 1e12

# How the engines' KV caches are registered for transfers (`CostProfile.descriptors`):
# block-major is what the connector asks vLLM 0.32 for on a GPU, and what vLLM's own NIXL
# connector reads packed block rows as; per-layer is vLLM 0.32's default, which a connector
# gets where it does not ask (or `block_major` is off).
BLOCK_MAJOR = "block-major"
PER_LAYER = "per-layer"
TRANSFER_LAYOUTS = (BLOCK_MAJOR, PER_LAYER)
DEFAULT_TRANSFER_LAYOUT = BLOCK_MAJOR


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet figures of one GPU."""

    name: str
    peak_flops: float  # dense BF16 tensor-core FLOP/s (no sparsity)
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per GPU, one direction


@dataclass(frozen=True)
class ModelSpec:
    """Architecture figures of one model (from its published config)."""

    name: str
    params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    dtype_bytes: int = 2  # BF16 weights and KV cache

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer: 2 * layers * KV heads * head dim * dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def q_dim(self) -> int:
        """Width of the attention queries (heads * head dim), which sets attention FLOPs."""
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class LinkSpec:
    """A KV transfer path between two engines' GPUs (per GPU; TP ranks move in parallel)."""

    name: str
    line_rate: float  # bytes/s, one direction
    efficiency: float  # share of the line rate a large read achieves
    latency_s: float  # fixed cost of one transfer (set-up, completion notification)
    per_descriptor_s: float = 0.0  # cost of each descriptor of a READ, whatever its size

    def transfer_time(self, num_bytes: float, descriptors: int = 1) -> float:
        """Seconds to move `num_bytes` in `descriptors` pieces as one transfer (0 bytes:
        nothing moves)."""
        if num_bytes <= 0:
            return 0.0
        return (
            self.latency_s
            + max(1, descriptors) * self.per_descriptor_s
            + num_bytes / (self.line_rate * self.efficiency)
        )


@dataclass(frozen=True)
class CostProfile:
    """A model served on `tp` GPUs of one type, with its efficiency assumptions."""

    name: str
    model: ModelSpec
    gpu: GPUSpec
    tp: int
    mfu: float  # share of peak FLOP/s the compute-bound part reaches
    hbm_efficiency: float  # share of HBM bandwidth the memory-bound part reaches
    step_overhead_s: float  # scheduling, sampling and launch per step
    allreduce_latency_s: float  # fixed cost of one all-reduce in the TP group
    gpu_memory_utilization: float = 0.9  # vLLM's default
    activation_reserve_bytes: float = 4 * GB  # per GPU: activations peak, CUDA graphs
    block_size: int = 16  # vLLM's default on CUDA

    def __post_init__(self) -> None:
        if self.model.num_kv_heads % self.tp:
            raise ValueError(f"{self.name}: KV heads do not split evenly over TP {self.tp}")

    @property
    def kv_bytes_per_token_per_rank(self) -> int:
        return self.model.kv_bytes_per_token // self.tp

    # ----- compute ----------------------------------------------------------------------------
    def step_time(
        self, prefills: Sequence[tuple[int, int]] = (), decode_contexts: Sequence[int] = ()
    ) -> float:
        """One step: `prefills` are (new tokens, tokens already in KV before them) chunks;
        `decode_contexts` the KV length each decoding request reads for its next token.
        An empty step costs nothing."""
        m = self.model
        tokens = sum(n for n, _ in prefills) + len(decode_contexts)
        if tokens == 0:
            return 0.0
        # Causal attention: new token i of a chunk attends to the c earlier tokens and to the
        # i+1 chunk tokens up to itself; each (query, key) pair costs 2*q_dim for QK^T and
        # 2*q_dim for AV, per layer.
        pairs = sum(n * c + n * (n + 1) // 2 for n, c in prefills) + sum(decode_contexts)
        flops = 2 * m.params * tokens + 4 * m.num_layers * m.q_dim * pairs
        # Weights are read once per step; KV is read for every context and written for the
        # new prefill tokens (activations stay in cache and are left out).
        kv_tokens = sum(n + c for n, c in prefills) + sum(decode_contexts)
        hbm = m.weight_bytes + m.kv_bytes_per_token * kv_tokens
        compute_s = flops / self.tp / (self.gpu.peak_flops * self.mfu)
        memory_s = hbm / self.tp / (self.gpu.hbm_bandwidth * self.hbm_efficiency)
        return self.step_overhead_s + max(compute_s, memory_s) + self.allreduce_time(tokens)

    def allreduce_time(self, tokens: int) -> float:
        """Megatron TP: two all-reduces per layer (after attention, after the MLP) of the
        step's activations (tokens * hidden * dtype), ring over NVLink, not overlapped."""
        if self.tp == 1:
            return 0.0
        size = tokens * self.model.hidden_size * self.model.dtype_bytes
        ring = 2 * (self.tp - 1) / self.tp * size / self.gpu.nvlink_bandwidth
        return 2 * self.model.num_layers * (ring + self.allreduce_latency_s)

    def prefill_time(self, new_tokens: int, context: int = 0) -> float:
        """A step that only prefills `new_tokens` on top of `context` tokens already in KV."""
        return self.step_time([(new_tokens, context)], ())

    def decode_step_time(self, contexts: Sequence[int]) -> float:
        """A step that only decodes one token for each request of these KV lengths."""
        return self.step_time((), contexts)

    # ----- memory -----------------------------------------------------------------------------
    def num_blocks(self) -> int:
        """KV blocks per GPU (the same on every rank): what vLLM's memory profiling leaves."""
        free = (
            self.gpu.hbm_bytes * self.gpu_memory_utilization
            - self.model.weight_bytes / self.tp
            - self.activation_reserve_bytes
        )
        return int(free // (self.block_size * self.kv_bytes_per_token_per_rank))

    def descriptors(self, block_runs: int, layout: str = DEFAULT_TRANSFER_LAYOUT) -> int:
        """READ descriptors of one rank for `block_runs` runs of consecutive blocks in `layout`
        (`TRANSFER_LAYOUTS`): one a run block-major, one a layer and run per-layer."""
        if layout == BLOCK_MAJOR:
            return block_runs
        if layout == PER_LAYER:
            return self.model.num_layers * block_runs
        raise ValueError(f"unknown KV transfer layout {layout!r} (known: {TRANSFER_LAYOUTS})")

    def transfer_time(
        self,
        tokens: int,
        link: LinkSpec,
        block_runs: int | None = None,
        layout: str = DEFAULT_TRANSFER_LAYOUT,
    ) -> float:
        """KV of `tokens` tokens between two engines of this profile, in `block_runs` runs of
        consecutive blocks (None: every block its own run, the fragmented pool's worst case)
        registered in `layout`: every rank moves its share over its own link at once, so the
        time is one rank's."""
        if block_runs is None:
            block_runs = -(-tokens // self.block_size)
        num_bytes = tokens * self.kv_bytes_per_token_per_rank
        return link.transfer_time(num_bytes, self.descriptors(block_runs, layout))


# ----- public figures (README: "Cost profiles" names each source) ------------------------------
H100_SXM = GPUSpec(
    "H100 SXM5 80GB",
    peak_flops=989 * TB,
    hbm_bytes=80 * GB,
    hbm_bandwidth=3.35 * TB,
    nvlink_bandwidth=450 * GB,
)
H200_SXM = GPUSpec(
    "H200 SXM 141GB",
    peak_flops=989 * TB,
    hbm_bytes=141 * GB,
    hbm_bandwidth=4.8 * TB,
    nvlink_bandwidth=450 * GB,
)
LLAMA3_8B = ModelSpec(
    "Llama-3.1-8B",
    params=8.03e9,
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_model_len=131072,
)
LLAMA3_70B = ModelSpec(
    "Llama-3.1-70B",
    params=70.6e9,
    num_layers=80,
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    max_model_len=131072,
)

# Efficiency assumptions shared by every profile (README says why these values).
MFU = 0.5
HBM_EFFICIENCY = 0.8
STEP_OVERHEAD_S = 1e-3
ALLREDUCE_LATENCY_S = 10e-6


def _profile(name: str, model: ModelSpec, gpu: GPUSpec, tp: int) -> CostProfile:
    return CostProfile(
        name,
        model,
        gpu,
        tp,
        mfu=MFU,
        hbm_efficiency=HBM_EFFICIENCY,
        step_overhead_s=STEP_OVERHEAD_S,
        allreduce_latency_s=ALLREDUCE_LATENCY_S,
    )


PROFILES: dict[str, CostProfile] = {
    p.name: p
    for p in (
        _profile("llama3-8b-h100", LLAMA3_8B, H100_SXM, 1),
        _profile("llama3-8b-h200", LLAMA3_8B, H200_SXM, 1),
        _profile("llama3-70b-h100-tp4", LLAMA3_70B, H100_SXM, 4),
        _profile("llama3-70b-h100-tp8", LLAMA3_70B, H100_SXM, 8),
    )
}

LINKS: dict[str, LinkSpec] = {
    # One 400 Gb/s ConnectX-7 NIC per GPU (DGX H100's layout): P and D on different nodes,
    # NIXL over UCX on InfiniBand. What a descriptor costs there, as published for small
    # READs: about 1.1 us (uccl-project/uccl PR #677: nixlbench, 1000 descriptors of 4 KiB at
    # 3.79 GB/s) up to about 12.6 us (ai-dynamo/nixl issue #1598: 0.324 GB/s at 4 KiB over
    # RDMA with the UCX backend, which the NIXL developers called the expected figure then).
    # The two profiles bracket it; a comparison states which it ran.
    "rdma-400g-1us": LinkSpec(
        "rdma-400g-1us",
        line_rate=400e9 / 8,
        efficiency=0.9,
        latency_s=30e-6,
        per_descriptor_s=1.1e-6,
    ),
    "rdma-400g-13us": LinkSpec(
        "rdma-400g-13us",
        line_rate=400e9 / 8,
        efficiency=0.9,
        latency_s=30e-6,
        per_descriptor_s=12.6e-6,
    ),
    # Inside one node over cuda_ipc (NVLink): this project's own H200 measurement
    # (bench/RESULTS.md, "transfer (GPU)": about 7.3 us per descriptor whatever its size, and a
    # device-to-device copy of 1.74-1.99 TB/s, which large descriptors approach; "transfer
    # descriptors (GPU, 8b)": 5.8-6.8 us for 64 KiB per-layer pages, 5.9 us for 2 MiB
    # block-major blocks).
    "cuda-ipc-h200": LinkSpec(
        "cuda-ipc-h200",
        line_rate=1.99 * TB,
        efficiency=0.95,
        latency_s=30e-6,
        per_descriptor_s=7.3e-6,
    ),
}
DEFAULT_LINK = "rdma-400g-13us"


def get_profile(name: str) -> CostProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown cost profile {name!r} (known: {', '.join(sorted(PROFILES))})"
        ) from None


def get_link(name: str) -> LinkSpec:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown KV link {name!r} (known: {', '.join(sorted(LINKS))})") from None
