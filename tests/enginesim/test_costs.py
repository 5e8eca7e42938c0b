"""GPU cost profiles: each profile's times follow its stated formula from the raw public figures,
and an engine given a profile waits those times (prefill, decode batch, KV transfer) without
spending CPU on them.

The expected values are computed here from the figures the README cites, independently of
`costs.py`, so a change of formula or figure there fails these tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay.enginesim.cli import build_parser, config_from_args
from kvrelay.enginesim.config import EngineConfig
from kvrelay.enginesim.costs import BLOCK_MAJOR, LINKS, PER_LAYER, PROFILES, get_profile
from kvrelay.enginesim.engine import EngineCore, run_to_completion
from kvrelay.enginesim.request import Output, SamplingParams, SimRequest
from kvrelay.enginesim.runner import EngineRunner
from tests.enginesim.fakes import FakeLoadingHost, ModelledClock

# name: (params, layers, hidden, heads, kv heads, head dim,
#        peak BF16 FLOP/s, HBM bytes, HBM bytes/s, TP)
RAW = {
    "llama3-8b-h100": (8.03e9, 32, 4096, 32, 8, 128, 989e12, 80e9, 3.35e12, 1),
    "llama3-8b-h200": (8.03e9, 32, 4096, 32, 8, 128, 989e12, 141e9, 4.8e12, 1),
    "llama3-70b-h100-tp4": (70.6e9, 80, 8192, 64, 8, 128, 989e12, 80e9, 3.35e12, 4),
    "llama3-70b-h100-tp8": (70.6e9, 80, 8192, 64, 8, 128, 989e12, 80e9, 3.35e12, 8),
}
MFU, HBM_EFF, OVERHEAD = 0.5, 0.8, 1e-3
NVLINK_DIR = 450e9  # NVLink 4: 900 GB/s bidirectional per GPU
AR_LATENCY = 10e-6
BF16 = 2


def expected_step(name: str, prefills: list[tuple[int, int]], contexts: list[int]) -> float:
    params, layers, hidden, heads, kv_heads, head_dim, peak, _, bw, tp = RAW[name]
    tokens = sum(n for n, _ in prefills) + len(contexts)
    attn_pairs = sum(n * c + n * (n + 1) / 2 for n, c in prefills) + sum(contexts)
    flops = 2 * params * tokens + 4 * layers * heads * head_dim * attn_pairs
    kv_token = 2 * layers * kv_heads * head_dim * BF16
    hbm = params * BF16 + kv_token * (sum(n + c for n, c in prefills) + sum(contexts))
    t = OVERHEAD + max(flops / tp / (peak * MFU), hbm / tp / (bw * HBM_EFF))
    if tp > 1:
        ring = 2 * (tp - 1) / tp * tokens * hidden * BF16 / NVLINK_DIR
        t += 2 * layers * (ring + AR_LATENCY)
    return t


def test_every_profile_is_pinned_here() -> None:
    assert sorted(PROFILES) == sorted(RAW)


@pytest.mark.parametrize("name", sorted(RAW))
def test_prefill_time_follows_the_stated_formula(name: str) -> None:
    profile = get_profile(name)
    for n, c in [(1024, 0), (8192, 0), (32768, 0), (474, 12000), (1, 0)]:
        assert profile.prefill_time(n, c) == pytest.approx(expected_step(name, [(n, c)], []))


@pytest.mark.parametrize("name", sorted(RAW))
def test_decode_step_time_follows_the_stated_formula(name: str) -> None:
    profile = get_profile(name)
    for contexts in ([8192], [8192] * 32, [8192] * 128, [100, 30000, 5000]):
        assert profile.decode_step_time(contexts) == pytest.approx(
            expected_step(name, [], contexts)
        )
    # A step that prefills and decodes is one forward pass: one roofline, one overhead.
    mixed = profile.step_time([(2048, 4096)], [8192] * 16)
    assert mixed == pytest.approx(expected_step(name, [(2048, 4096)], [8192] * 16))
    assert profile.step_time([], []) == 0.0


def test_shapes_land_in_the_regime_the_roofline_says() -> None:
    p = get_profile("llama3-8b-h100")
    # Decode at batch 1 is the weights read: 16.06 GB at 80% of 3.35 TB/s, plus the KV.
    weights_s = 8.03e9 * BF16 / (3.35e12 * 0.8)
    assert p.decode_step_time([1]) == pytest.approx(OVERHEAD + weights_s, rel=1e-3)
    # An 8k prefill is compute-bound: 2 * params * tokens at 50% of 989 TFLOP/s dominates.
    assert p.prefill_time(8192) > 2 * 8.03e9 * 8192 / (989e12 * 0.5)
    assert 0.29 < p.prefill_time(8192) < 0.32


def test_kv_bytes_per_token() -> None:
    assert get_profile("llama3-8b-h100").model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    seventy = get_profile("llama3-70b-h100-tp4")
    assert seventy.model.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327680
    assert seventy.kv_bytes_per_token_per_rank == 327680 // 4
    assert get_profile("llama3-70b-h100-tp8").kv_bytes_per_token_per_rank == 327680 // 8


@pytest.mark.parametrize("name", sorted(RAW))
def test_block_count_is_what_the_gpu_memory_leaves(name: str) -> None:
    params, layers, _, _, kv_heads, head_dim, _, hbm, _, tp = RAW[name]
    reserve, utilization, block = 4e9, 0.9, 16
    free = hbm * utilization - params * BF16 / tp - reserve
    per_block = block * 2 * layers * (kv_heads // tp) * head_dim * BF16
    profile = get_profile(name)
    assert profile.block_size == block
    assert profile.num_blocks() == int(free // per_block)


def test_transfer_time_counts_every_descriptor_and_every_byte() -> None:
    rdma, cuda = LINKS["rdma-400g-13us"], LINKS["cuda-ipc-h200"]
    eight = get_profile("llama3-8b-h100")
    per_token = 131072  # 32 layers x 2 x 8 KV heads x 128 x 2 bytes
    wire = 8192 * per_token / (400e9 / 8 * 0.9)
    # vLLM 0.32's per-layer pages: one descriptor per layer for each run of consecutive
    # blocks. 8192 tokens in one run: 32 descriptors; scattered (the default, every block
    # its own run): 32 x 512.
    assert eight.transfer_time(8192, rdma, block_runs=1, layout=PER_LAYER) == pytest.approx(
        30e-6 + 32 * 12.6e-6 + wire
    )
    assert eight.transfer_time(8192, rdma, layout=PER_LAYER) == pytest.approx(
        30e-6 + 32 * 512 * 12.6e-6 + wire
    )
    # Block-major (every layer's page inside each block), the default: one descriptor a run.
    assert eight.transfer_time(8192, rdma, block_runs=1) == pytest.approx(30e-6 + 12.6e-6 + wire)
    assert eight.transfer_time(8192, rdma) == eight.transfer_time(8192, rdma, layout=BLOCK_MAJOR)
    assert eight.transfer_time(8192, rdma) == pytest.approx(30e-6 + 512 * 12.6e-6 + wire)
    # The measured H200 figure: a 15k-token pull of scattered blocks per-layer is about 210 ms
    # of descriptors on top of its bytes, where bytes alone would be about 1 ms; block-major
    # about 8 ms.
    bytes_s = 15_008 * per_token / (1.99e12 * 0.95)
    pull = eight.transfer_time(15_008, cuda, layout=PER_LAYER)
    assert pull == pytest.approx(30e-6 + 32 * 938 * 7.3e-6 + bytes_s)
    assert 0.2 < pull < 0.23
    assert eight.transfer_time(15_008, cuda) == pytest.approx(30e-6 + 938 * 7.3e-6 + bytes_s)
    # Each TP rank moves its share over its own link, with its own descriptors, at once.
    tp4 = get_profile("llama3-70b-h100-tp4")
    assert tp4.transfer_time(1000, rdma, block_runs=2, layout=PER_LAYER) == pytest.approx(
        30e-6 + 80 * 2 * 12.6e-6 + 1000 * 81920 / (50e9 * 0.9)
    )
    assert eight.transfer_time(0, rdma) == 0.0
    # The published bracket for UCX over InfiniBand: 1.1 to 12.6 us a descriptor.
    assert LINKS["rdma-400g-1us"].per_descriptor_s < rdma.per_descriptor_s
    with pytest.raises(ValueError, match="unknown KV transfer layout"):
        eight.transfer_time(8192, rdma, layout="split")


def test_unknown_names_and_mixed_knobs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown cost profile"):
        EngineConfig(cost_profile="gpt-9").validate()
    with pytest.raises(ValueError, match="unknown KV link"):
        EngineConfig(kv_link="carrier-pigeon").validate()
    with pytest.raises(ValueError, match="kv_transfer_layout"):
        EngineConfig(kv_transfer_layout="split").validate()
    with pytest.raises(ValueError, match="replaces"):
        EngineConfig(cost_profile="llama3-8b-h100", decode_us_per_step=10).validate()


# ----- the command line ------------------------------------------------------------------------
def _cli(*argv: str) -> EngineConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_a_profile_sets_the_pool_unless_told_otherwise() -> None:
    profile = get_profile("llama3-8b-h100")
    cfg = _cli("--cost-profile", "llama3-8b-h100")
    assert cfg.cost_profile == "llama3-8b-h100"
    assert (cfg.num_blocks, cfg.block_size) == (profile.num_blocks(), 16)
    assert cfg.max_model_len == 131072
    scaled = _cli("--cost-profile", "llama3-8b-h100", "--kv-scale", "0.01")
    assert scaled.num_blocks == round(profile.num_blocks() * 0.01)
    # The pool caps the context length, so a scaled-down pool still validates.
    assert scaled.max_model_len == scaled.num_blocks * 16
    scaled.validate()
    told = _cli(
        "--cost-profile", "llama3-8b-h100", "--num-blocks", "500", "--max-model-len", "2048"
    )  # fmt: skip
    assert (told.num_blocks, told.max_model_len) == (500, 2048)
    with pytest.raises(ValueError, match="kv-scale"):
        _cli("--cost-profile", "llama3-8b-h100", "--kv-scale", "0")
    assert cfg.kv_transfer_layout == BLOCK_MAJOR
    assert _cli("--kv-transfer-layout", PER_LAYER).kv_transfer_layout == PER_LAYER
    plain = _cli()
    assert (plain.cost_profile, plain.num_blocks, plain.block_size, plain.max_model_len) == (
        None, 1024, 16, 4096,
    )  # fmt: skip


# ----- the engine waits the modelled times -----------------------------------------------------
def _request(rid: str, prompt: list[int], max_tokens: int, sink: Any) -> SimRequest:
    return SimRequest(
        request_id=rid, client_request_id=rid, prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        kv_transfer_params=None, sink=sink,
    )  # fmt: skip


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(i * 7 + seed) % 200 + 3 for i in range(n)]


def test_each_step_waits_for_its_prefill_chunks_and_decode_contexts() -> None:
    name = "llama3-70b-h100-tp4"
    clock = ModelledClock()
    waits = clock.waits
    cfg = EngineConfig(cost_profile=name, num_blocks=512, max_model_len=4096)
    core = EngineCore(cfg, wait=clock.wait, clock=clock.clock)
    outs: list[Output] = []
    core.add_request(_request("a", _prompt(300), 3, outs.append))
    run_to_completion(core, lambda: bool(outs) and outs[-1].finished)
    profile = get_profile(name)
    # Prefill of 300 tokens, then one decode token attending 301, then 302 positions.
    assert waits == pytest.approx(
        [profile.prefill_time(300), profile.decode_step_time([301]),
         profile.decode_step_time([302])]
    )  # fmt: skip

    # Two at once: B prefills while A decodes, in one step (one roofline).
    waits.clear()
    outs_a: list[Output] = []
    outs_b: list[Output] = []
    core.add_request(_request("A", _prompt(100, 1), 3, outs_a.append))
    core.step()
    core.add_request(_request("B", _prompt(50, 2), 1, outs_b.append))
    core.step()
    assert waits == pytest.approx([profile.prefill_time(100), profile.step_time([(50, 0)], [101])])


def test_a_local_prefix_hit_is_context_not_computed_work() -> None:
    name = "llama3-8b-h100"
    clock = ModelledClock()
    waits = clock.waits
    cfg = EngineConfig(
        cost_profile=name, num_blocks=512, max_model_len=4096, enable_prefix_caching=True,
    )  # fmt: skip
    core = EngineCore(cfg, wait=clock.wait, clock=clock.clock)
    first: list[Output] = []
    core.add_request(_request("first", _prompt(200), 1, first.append))
    run_to_completion(core, lambda: bool(first) and first[-1].finished)
    waits.clear()
    second: list[Output] = []
    core.add_request(_request("second", _prompt(200) + _prompt(40, 5), 1, second.append))
    run_to_completion(core, lambda: bool(second) and second[-1].finished)
    # 200 tokens are 12 full blocks (192 tokens) of the prefix cache; 48 are computed.
    assert waits == pytest.approx([get_profile(name).prefill_time(48, 192)])


@pytest.mark.parametrize(("layout", "descriptors"), [(PER_LAYER, 80 * 100), (BLOCK_MAJOR, 100)])
def test_loaded_kv_waits_its_modelled_transfer_time_on_top_of_the_read(
    layout: str, descriptors: int
) -> None:
    name, loaded = "llama3-70b-h100-tp4", 1600
    now = [100.0]
    link = "rdma-400g-13us"
    cfg = EngineConfig(
        cost_profile=name,
        num_blocks=512,
        max_model_len=4096,
        kv_link=link,
        kv_transfer_layout=layout,
    )
    core = EngineCore(cfg, FakeLoadingHost(loaded), wait=lambda s: None, clock=lambda: now[0])
    outs: list[Output] = []
    core.add_request(_request("r", _prompt(1700), 1, outs.append))
    core.step()  # admitted, the read starts and is reported finished
    transfer = get_profile(name).transfer_time(loaded, LINKS[link], layout=layout)
    # No holder's block ids to pair with (a fake load): every block counts as its own run.
    assert transfer == pytest.approx(1600 * 81920 / 45e9 + 30e-6 + descriptors * 12.6e-6)
    now[0] += transfer * 0.99
    core.step()
    assert "r" not in core.running and not outs and core.has_work
    assert core.busy
    now[0] += transfer * 0.02
    core.step()
    core.deliver_outputs()
    assert outs and outs[-1].finished
    assert outs[-1].loaded_tokens == loaded


def test_loads_that_end_together_share_the_engines_link() -> None:
    # Two reads reported finished in the same step: the link moves one after the other, so
    # the second arrives a whole transfer after the first.
    name, loaded, link = "llama3-8b-h100", 800, "rdma-400g-13us"
    now = [0.0]
    cfg = EngineConfig(cost_profile=name, num_blocks=512, max_model_len=4096, kv_link=link)
    core = EngineCore(cfg, FakeLoadingHost(loaded), wait=lambda s: None, clock=lambda: now[0])
    for rid in ("a", "b"):
        core.add_request(_request(rid, _prompt(900, len(rid)), 1, lambda out: None))
    core.step()
    transfer = get_profile(name).transfer_time(loaded, LINKS[link])
    assert sorted(ready for _, ready in core.arriving.values()) == pytest.approx(
        [transfer, 2 * transfer]
    )


def test_an_abort_while_the_modelled_transfer_runs_frees_the_blocks() -> None:
    now = [0.0]
    cfg = EngineConfig(cost_profile="llama3-8b-h100", num_blocks=512, max_model_len=4096)
    core = EngineCore(cfg, FakeLoadingHost(800), wait=lambda s: None, clock=lambda: now[0])
    core.add_request(_request("r", _prompt(900), 1, lambda out: None))
    core.step()
    core.step()
    assert core.pool.num_free < 512
    core.abort("r")
    assert core.pool.num_free == 512 and not core.has_work
    assert core.counters["requests_aborted"] == 1


@pytest.fixture
def profiled_runner() -> Iterator[EngineRunner]:
    cfg = EngineConfig(cost_profile="llama3-70b-h100-tp4", num_blocks=512, max_model_len=8192)
    runner = EngineRunner(EngineCore(cfg))
    runner.start()
    try:
        yield runner
    finally:
        runner.stop()


def test_a_modelled_prefill_is_waited_out_not_computed(profiled_runner: EngineRunner) -> None:
    n = 6000
    modelled = get_profile("llama3-70b-h100-tp4").prefill_time(n)
    assert modelled > 0.4
    done = threading.Event()

    def sink(out: Output) -> None:
        if out.finished:
            done.set()

    wall0, cpu0 = time.monotonic(), time.process_time()
    profiled_runner.submit(_request("long", _prompt(n), 1, sink))
    assert done.wait(timeout=30), "the engine did not answer"
    wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    assert wall >= modelled
    # The modelled time is spent waiting: the process's CPU time (every thread) is a small
    # share of it.
    assert cpu < 0.5 * modelled, (cpu, modelled)
    # The engine publishes the modelled time it waited out, and the time it fell behind it:
    # a sleep's late wake-up at most, far from the step itself.
    snap = profiled_runner.snapshot
    assert snap["modelled_step_seconds"] >= modelled * 0.999
    assert 0.0 <= snap["behind_model_seconds"] < 0.5 * modelled
