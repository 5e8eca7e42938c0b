"""Create a tiny random-weight Llama model and a locally trained tokenizer for real-vLLM tests.

No model can be downloaded, so the end-to-end suite builds one: a 2-layer Llama with small hidden
size, weights drawn from a fixed seed, and a byte-level BPE tokenizer trained on a generated
corpus, with a chat template so `/v1/chat/completions` works. The same seed gives the same files,
so every server in a run (P, D and the reference) serves the same model.

Run as a script to create one by hand: `python -m kvrelay.devtools.tiny_model /tmp/tiny-llama`.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 1024
# Jinja chat template in the usual "role header, content, end marker" shape; generation prompt
# opens an assistant turn so replies are greedy continuations of it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
_WORD_TEXT = (
    "the a of to and in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any new "
    "work part take get place made live where after back little only round man year came show "
    "every good me give our under name very through just form sentence great think say help "
    "low line differ turn cause much mean before move right boy old too same tell does set "
    "three want air well also play small end put home read hand port large spell add even land "
    "here must big high such follow act why ask men change went light kind off need house "
    "picture try us again animal point mother world near build self earth father cache block "
    "decode prefill token relay engine request reply conversation turn model"
)
_WORDS = _WORD_TEXT.split()


def _corpus(lines: int, rng: random.Random) -> list[str]:
    """Sentences of random common words, numbers and punctuation: enough BPE merges to matter."""
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        out.append(sentence)
    return out


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(SEED)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def _write_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        # Large init spread makes the logits peaky, so greedy picks have clear margins and
        # disaggregated and single-server runs agree despite float rounding differences.
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(path), safe_serialization=True)
    # transformers may write a newer dtype key only; vLLM reads torch_dtype.
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["torch_dtype"] = "float32"
    cfg_file.write_text(json.dumps(cfg, indent=2))


def create_tiny_model(path: Path) -> Path:
    """Write the tiny model and tokenizer to `path` (created if missing); return `path`."""
    path.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    _write_tokenizer(path)
    _write_model(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    args = parser.parse_args()
    print(create_tiny_model(args.path))


if __name__ == "__main__":
    main()
