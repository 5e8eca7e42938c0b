"""bench/sim_cpu.py: the simulator's own CPU, measured on a small engine and text."""

from __future__ import annotations

from bench import sim_cpu


def test_the_simulator_costs_are_measured_per_token_and_rendered() -> None:
    args = sim_cpu.parse_args(
        ["--requests", "2", "--prompt-tokens", "64", "--output-tokens", "8",
         "--text-words", "200", "--turns", "3", "--reps", "1", "--no-results"]
    )  # fmt: skip
    prefill_s, decode_s = sim_cpu.engine_costs(args)
    per_token_s, conversation_s = sim_cpu.tokenizer_costs(args)
    assert 0 < prefill_s < 0.01 and 0 < decode_s < 0.1
    assert 0 < per_token_s < 0.001 and 0 < conversation_s < 10
    text = sim_cpu.render(args, (prefill_s, decode_s), (per_token_s, conversation_s))
    assert "--requests 2 --prompt-tokens 64 --output-tokens 8" in text
    assert "| decode, per generated token (2 in the batch) |" in text
    assert "| tokenizer, the prompts of a 3-turn conversation |" in text
