"""A vLLM P/D pair loading the test-only stalling connector (`tests.vllm.faulty_connector`),
built on `kvrelay.devtools.vllm_servers`."""

from __future__ import annotations

from pathlib import Path

from kvrelay.devtools import free_port, vllm_servers

# KV blocks of the fault pair's D: the smallest pool that still fits MAX_MODEL_LEN (vLLM
# checks at start-up), so two long requests run it out and one is preempted.
FAULTY_DECODE_BLOCKS = 40


def faulty_pair(
    model_dir: Path, fault_dirs: tuple[Path, Path]
) -> tuple[vllm_servers.VLLMServer, vllm_servers.VLLMServer]:
    """P and D loading `tests.vllm.faulty_connector` (kvrelay's connector plus stalls a test
    arms through files in each engine's fault directory), with fixed engine ids. D has a small
    pool and no prefix cache (a preempted request must recompute or load, never hit locally);
    both fail requests whose KV load failed (vLLM's `kv_load_failure_policy: fail`)."""
    servers = []
    for name, cpu, fault_dir in (("P", 0, fault_dirs[0]), ("D", 1, fault_dirs[1])):
        side = free_port()
        config = {
            **vllm_servers.kvrelay_transfer_config(side),
            "kv_connector": "FakeStallingConnector",
            "kv_connector_module_path": "tests.vllm.faulty_connector",
            "engine_id": f"faulty-{name}",
            "kv_load_failure_policy": "fail",
        }
        env = {"KVRELAY_FAULT_DIR": str(fault_dir)}
        servers.append(
            vllm_servers.VLLMServer(f"faulty-{name}", model_dir, cpu, config, side, extra_env=env)
        )
    servers[1].extra_args = [
        "--num-gpu-blocks-override", str(FAULTY_DECODE_BLOCKS), "--no-enable-prefix-caching",
    ]  # fmt: skip
    return servers[0], servers[1]
