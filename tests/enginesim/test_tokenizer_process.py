"""`EncodingProcess`: prompts encoded in a child process, as vLLM's API server does apart from
its engine core; the same ids and errors as in process, and no child left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvrelay.devtools import EngineFactory, live_children
from kvrelay.enginesim.chat import render_chat
from kvrelay.enginesim.tokenizer import Tokenizer
from kvrelay.enginesim.tokenizer_process import EncodingProcess
from tests.harness import REPO_ROOT, wait_until

TEXTS = (
    "plain words, and more plain words",
    "<|im_start|>user\nWhat is a block?<|im_end|>\n<|im_start|>assistant\n",
    "é 漢字 🙂 tabs\tand\nnewlines " * 40,
)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_child_encodes_as_the_tokenizer_does_and_sends_its_errors_back() -> None:
    local = Tokenizer()
    remote = EncodingProcess()
    try:
        for text in TEXTS:
            assert remote.encode(text) == local.encode(text)
            assert remote.encode(text, parse_special=False) == local.encode(
                text, parse_special=False
            )
        with pytest.raises(UnicodeEncodeError):
            remote.encode("a lone surrogate \ud800")
        assert remote.encode(TEXTS[0]) == local.encode(TEXTS[0])  # still serving
        pid = remote.pid
        assert pid is not None and _running(pid)
    finally:
        remote.close()
    assert not _running(pid)
    remote.close()  # a second close does nothing


def test_the_child_exits_when_its_parent_dies() -> None:
    code = (
        "import os, signal\n"
        "from kvrelay.enginesim.tokenizer_process import EncodingProcess\n"
        "t = EncodingProcess()\n"
        "t.encode('warm up')\n"
        "print(t.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -9, done.stderr
    pid = int(done.stdout.split()[0])
    wait_until(lambda: not _running(pid), 30, what="the tokenizer's child to exit with its parent")


def test_an_engine_with_a_tokenizer_process_serves_the_same_ids_and_stops_it() -> None:
    factory = EngineFactory()
    try:
        engine = factory(
            "tok", "--tokenizer-process", "--num-blocks", "64", "--max-model-len", "512",
            connector=False,
        )  # fmt: skip
        assert engine.process is not None and engine.process.proc is not None
        children = live_children(parent=engine.process.proc.pid)
        assert children, "the engine started no tokenizer process"
        local = Tokenizer()
        tok = httpx.post(engine.url + "/tokenize", json={"prompt": TEXTS[0]}, timeout=30)
        assert tok.status_code == 200 and tok.json()["tokens"] == local.encode(TEXTS[0])
        messages = [{"role": "user", "content": "What is a block?"}]
        chat = httpx.post(
            engine.url + "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 4},
            timeout=30,
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(local.encode(render_chat(messages)))
        lone_surrogate = b'{"prompt": "x \\ud800", "max_tokens": 1}'  # JSON may carry one
        bad = httpx.post(
            engine.url + "/v1/completions",
            content=lone_surrogate,
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    finally:
        factory.close()
    for pid in children:
        wait_until(lambda p=pid: not _running(p), 30, what="the tokenizer process to stop")
