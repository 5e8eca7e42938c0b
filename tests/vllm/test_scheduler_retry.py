"""vLLM's own scheduler retries an admission with another local prefix hit; kvrelay's read follows.

No engine is started: vLLM's real `Scheduler` (CPU build, the tiny model's config, a 12-block
KV pool) runs in-process with kvrelay's adapter as its connector, and the test plays the model
runner (one sampled token per finished prefill). A holder (the connector core) holds a prompt;
the request that loads it waits while the pool is full, and its local prefix hit shrinks from
two blocks to none as another request's decode evicts them. The read vLLM finally admits must
fill every block vLLM counts as loaded, from the holder's matching blocks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrelay.connector.metadata import RequestView
from kvrelay.connector.scheduler import ConnectorScheduler
from kvrelay.devtools import vllm_servers

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

NUM_BLOCKS = 12
HOLDER_BLOCKS = [50, 51, 52, 53, 54]
PROMPT = [1000 + i for i in range(160)]


class InProcessScheduler:
    """vLLM's `Scheduler` with kvrelay's connector, stepped by hand (the test is the runner)."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        model = ModelConfig(
            model=str(model_dir), dtype="float32", max_model_len=vllm_servers.MAX_MODEL_LEN, seed=0
        )
        cache = CacheConfig(block_size=vllm_servers.BLOCK_SIZE, enable_prefix_caching=True)
        cache.num_gpu_blocks = NUM_BLOCKS
        self.config = VllmConfig(
            model_config=model,
            cache_config=cache,
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=vllm_servers.MAX_MODEL_LEN,
                max_model_len=vllm_servers.MAX_MODEL_LEN,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVRelayConnector",
                kv_connector_module_path="kvrelay.connector.vllm.adapter",
                kv_role="kv_both",
                kv_buffer_device="cpu",
                engine_id="reader",
                kv_connector_extra_config={
                    "side_channel_host": "127.0.0.1",
                    "side_channel_port": 0,
                    # The pool is a few blocks, a turn half of it: every hold kept (the cap
                    # on one hold has its own test, tests/vllm/test_hold_budget.py).
                    "hold_max_fraction": vllm_servers.HOLD_MAX_FRACTION,
                },
            ),
            device_config=DeviceConfig("cpu"),
        )
        parallel = self.config.parallel_config
        spec = FullAttentionSpec(
            block_size=vllm_servers.BLOCK_SIZE, num_kv_heads=model.get_num_kv_heads(parallel),
            head_size=model.get_head_size(), dtype=torch.float32,
        )  # fmt: skip
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(model.get_num_layers(parallel))]
        self.kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
        )  # fmt: skip
        self.sched = Scheduler(
            self.config, self.kv_cache_config, StructuredOutputManager(self.config),
            block_size=vllm_servers.BLOCK_SIZE,
        )  # fmt: skip
        hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(vllm_servers.BLOCK_SIZE, hash_fn)
        self.asked: list[tuple[str, int, tuple[int | None, bool]]] = []
        connector: Any = self.sched.connector
        ask = connector.get_num_new_matched_tokens

        def recorded(request: Any, num_computed: int) -> tuple[int | None, bool]:
            answer: tuple[int | None, bool] = ask(request, num_computed)
            self.asked.append((request.request_id, num_computed, answer))
            return answer

        connector.get_num_new_matched_tokens = recorded

    def add(self, rid: str, prompt: list[int], max_tokens: int, params: Any = None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": params} if params else None
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        self.sched.add_request(
            Request(rid, prompt, sampling, None, block_hasher=self._hasher)  # type: ignore[arg-type]
        )

    def step(self) -> Any:
        """One engine step; every request whose prompt is now computed samples a token."""
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            done = req.num_computed_tokens + out.num_scheduled_tokens[rid] >= req.num_tokens
            sampled.append([7] if done else [])
        self.sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
            ),
        )
        return out.kv_connector_metadata.core

    def shutdown(self) -> None:
        self.sched.shutdown()


@pytest.fixture
def scheduler(tiny_model: Path) -> Iterator[InProcessScheduler]:
    os.environ.setdefault("KVRELAY_CONNECTOR_SECRET", vllm_servers.CONNECTOR_SECRET)
    sched = InProcessScheduler(tiny_model)
    try:
        yield sched
    finally:
        sched.shutdown()


@pytest.fixture
def holder(scheduler: InProcessScheduler) -> Iterator[ConnectorScheduler]:
    from kvrelay.connector.vllm.settings import connector_config

    config = connector_config(scheduler.config, scheduler.kv_cache_config)
    core = ConnectorScheduler(config.model_copy(update={"engine_id": "holder"}))
    core.start()
    try:
        yield core
    finally:
        core.shutdown()


def test_retried_admission_reads_every_block_vllm_counts_as_loaded(
    scheduler: InProcessScheduler, holder: ConnectorScheduler
) -> None:
    # The holder computed 140 tokens of the prompt (blocks 50..54, the last one partial).
    view = RequestView("h1", None, PROMPT[:140], PROMPT[:141], {"do_remote_decode": True})
    _, held = holder.request_finished(view, [HOLDER_BLOCKS])
    assert held is not None
    params = {**held, "do_remote_decode": False, "do_remote_prefill": True}
    # F fills the pool and decodes on; A leaves the prompt's first two blocks in the cache.
    scheduler.add("F", [2000 + i for i in range(250)], 80)
    scheduler.add("A", [*PROMPT[:64], 5], 1)
    scheduler.step()
    scheduler.add("B", PROMPT, 4, params)

    meta = None
    for _ in range(200):
        meta = scheduler.step()
        if "B" in meta.reqs_to_recv:
            break
    assert meta is not None and "B" in meta.reqs_to_recv, "B was never admitted"

    asks = [(n, answer) for rid, n, answer in scheduler.asked if rid == "B"]
    assert asks[0] == (64, (76, True)), "first ask: A's two blocks were a local hit"
    assert len({n for n, _ in asks}) > 1, "the local hit changed between retries"
    vllm_request = scheduler.sched.requests["B"]
    loaded = vllm_request.num_computed_tokens - asks[-1][0]
    local_hit_blocks = asks[-1][0] // vllm_servers.BLOCK_SIZE
    blocks = scheduler.sched.kv_cache_manager.get_block_ids("B")[0]
    spec = meta.reqs_to_recv["B"]
    # Every block vLLM counts as loaded (past its last local hit) is read, from the holder's
    # block at the same position.
    last = -(-(asks[-1][0] + loaded) // vllm_servers.BLOCK_SIZE)
    assert spec.local_block_ids == tuple(blocks[local_hit_blocks:last])
    assert spec.remote_block_ids == tuple(HOLDER_BLOCKS[local_hit_blocks:last])
