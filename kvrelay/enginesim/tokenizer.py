"""A small deterministic byte-level BPE tokenizer shared by every enginesim instance.

Ids 0..255 are raw bytes, then a fixed list of merges (English sub-words), then special
tokens. Like a real BPE tokenizer, text re-encodes to the *greedy merged* ids, so a token
sequence the model emits (for instance the byte tokens ``t`` ``h`` next to each other) decodes
to text that re-tokenizes to different ids (``th``). That is the round-trip effect kvrelay
must survive (docs/DESIGN.md §1), met here for real.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Sequence
from typing import NamedTuple

# Merged tokens in rank order; each is built from two existing tokens (see `_build_merges`).
_MERGED: tuple[str, ...] = (
    " t",
    "th",
    "he",
    " a",
    "in",
    "er",
    "an",
    "re",
    "on",
    " th",
    "the",
    " the",
    "en",
    "at",
    "ou",
    "ed",
    "nd",
    "es",
    "or",
    "is",
    "it",
    "ing",
    " s",
    " w",
    " o",
    " c",
    " b",
    " f",
    " m",
    " p",
    " d",
    " h",
    " i",
    " l",
    " n",
    " g",
    " e",
    " r",
    " u",
    " y",
    "ar",
    "al",
    "le",
    "st",
    "to",
    " to",
    "of",
    " of",
    "and",
    " and",
    "ion",
    "ent",
    "as",
    "ll",
    "ve",
    "om",
    "ic",
    "ro",
    "ly",
    "ch",
    "se",
    "ur",
    "me",
    "ow",
    "ut",
    "ot",
    "id",
    "ay",
    "ac",
    "ad",
    "ol",
    "il",
    "ir",
    "am",
    "im",
    "et",
    "ers",
    "ation",
    "tion",
    " in",
    " is",
    " it",
    " be",
    " we",
    " you",
    " he",
    " on",
    " an",
    " at",
    " or",
    " as",
    " for",
    " that",
    "hat",
    " with",
    "ith",
    " this",
    "his",
    " are",
    " was",
    " not",
    " can",
    " will",
    " have",
    "ave",
    " do",
    " so",
    " if",
    " but",
    " all",
    " one",
    " out",
    " up",
    " what",
    " how",
    " when",
    " there",
    "ere",
    " their",
    " they",
    "ey",
    " from",
    "rom",
    " more",
    "ore",
    " about",
    " your",
    "our",
    " by",
    " my",
    " me",
    " no",
    " new",
    "ew",
    " time",
    "ime",
    " like",
    "ike",
    " just",
    "ust",
    " know",
    "now",
    " make",
    "ake",
    " good",
    "ood",
    " some",
    "ome",
    " kv",
    " cache",
    "ache",
    " block",
    "ock",
    " token",
    "oken",
    " model",
    "odel",
    " turn",
    "urn",
    "ight",
    " light",
    " right",
    " night",
    "ould",
    " would",
    " could",
    " should",
    "ever",
    " never",
    " every",
    ".",
    ",",
    "!",
    "?",
    "'s",
    "'t",
    "'re",
    "'ll",
)

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_NO_MERGE = 1 << 30

_PRETOKENIZE = re.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"
)


def _apply_merges(word: bytes, merges: dict[tuple[int, int], int]) -> list[int]:
    """Greedy BPE: repeatedly apply the earliest-added merge present in the sequence."""
    ids = list(word)
    while len(ids) > 1:
        new_id, pos = min(
            (merges.get((a, b), _NO_MERGE), i) for i, (a, b) in enumerate(itertools.pairwise(ids))
        )
        if new_id == _NO_MERGE:
            break
        ids[pos : pos + 2] = [new_id]
    return ids


def _build_merges() -> tuple[list[bytes], dict[tuple[int, int], int]]:
    vocab: list[bytes] = [bytes([i]) for i in range(256)]
    index: dict[bytes, int] = {b: i for i, b in enumerate(vocab)}
    merges: dict[tuple[int, int], int] = {}
    for text in _MERGED:
        # Merge the piece's current greedy encoding left to right until it is one token, so
        # every listed piece is reachable by encoding (as BPE training guarantees).
        ids = _apply_merges(text.encode(), merges)
        while len(ids) > 1:
            piece = vocab[ids[0]] + vocab[ids[1]]
            if piece not in index:
                merges[(ids[0], ids[1])] = len(vocab)
                index[piece] = len(vocab)
                vocab.append(piece)
            ids[0:2] = [index[piece]]
    return vocab, merges


_WORD_CACHE_SIZE = 1 << 16
_TEXT_CACHE_SIZE = 64
_TEXT_CACHE_MIN_CHARS = 1024  # shorter texts cost less to encode again than to keep


class _Encoded(NamedTuple):
    """A text's ids, and its head: the text up to the end of its last special token, whose
    ids are the first `head_ids` (the same in any text that starts with the head)."""

    ids: tuple[int, ...]
    head: str
    head_ids: int


class _WordIds(dict[str, tuple[int, ...]]):
    """A pre-tokenized word's ids, merged once and kept (a dict, so that a lookup of a known
    word runs no Python code: prompts are long and words repeat)."""

    def __init__(self, merges: dict[tuple[int, int], int]) -> None:
        super().__init__()
        self._merges = merges

    def __missing__(self, word: str) -> tuple[int, ...]:
        if len(self) >= _WORD_CACHE_SIZE:
            self.clear()
        ids = self[word] = tuple(_apply_merges(word.encode(), self._merges))
        return ids


class Tokenizer:
    """Byte-level BPE with a fixed merge table and three special tokens."""

    def __init__(self) -> None:
        self._vocab, self._merges = _build_merges()
        base = len(self._vocab)
        self.special_ids: dict[str, int] = {s: base + i for i, s in enumerate(SPECIAL_TOKENS)}
        self._special_by_id = {i: s for s, i in self.special_ids.items()}
        self.vocab_size = base + len(SPECIAL_TOKENS)
        self.eos_id = self.special_ids["<|im_end|>"]
        self.bos_id = self.special_ids["<|endoftext|>"]
        self._special_split = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
        self._word_ids = _WordIds(self._merges)
        # The latest long texts encoded (`_Encoded`): an engine is asked to encode the same
        # prompt more than once (a router's `/tokenize` before the request itself), a turn's
        # prompt starts with the previous turn's, and a long prompt costs milliseconds of the
        # host's CPU, which the simulated engines share.
        self._texts: dict[tuple[str, bool], _Encoded] = {}

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings become their ids when `parse_special`."""
        known = self._texts.get((text, parse_special))
        if known is not None:
            return list(known.ids)
        out: list[int] = []
        start = 0
        if parse_special:
            # Special tokens are split off before anything else, and none can overlap another,
            # so the ids up to the last one of a text this one starts with are this one's too.
            base = self._longest_known_head(text)
            if base is not None:
                out.extend(base.ids[: base.head_ids])
                start = len(base.head)
        head_chars, head_ids = start, len(out)
        parts = self._special_split.split(text[start:]) if parse_special else [text]
        word_ids = self._word_ids.__getitem__
        pos = start
        for part in parts:
            if not part:
                continue
            pos += len(part)
            special = self.special_ids.get(part) if parse_special else None
            if special is not None:
                out.append(special)
                head_chars, head_ids = pos, len(out)
                continue
            out.extend(itertools.chain.from_iterable(map(word_ids, _PRETOKENIZE.findall(part))))
        if len(text) >= _TEXT_CACHE_MIN_CHARS:
            if len(self._texts) >= _TEXT_CACHE_SIZE:
                self._texts.clear()  # not LRU: several threads encode; clear() is one step
            head = text[:head_chars] if parse_special else ""
            self._texts[(text, parse_special)] = _Encoded(tuple(out), head, head_ids)
        return out

    def _longest_known_head(self, text: str) -> _Encoded | None:
        best: _Encoded | None = None
        for known in list(self._texts.values()):  # a copy: another thread may clear the dict
            longer = best is None or len(known.head) > len(best.head)
            if known.head_ids and longer and text.startswith(known.head):
                best = known
        return best

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_by_id:
            return self._special_by_id[token_id].encode()
        return self._vocab[token_id]

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD like HF tokenizers."""
        chunks: list[bytes] = []
        for token_id in ids:
            if token_id in self._special_by_id:
                if not skip_special:
                    chunks.append(self._special_by_id[token_id].encode())
            elif 0 <= token_id < len(self._vocab):
                chunks.append(self._vocab[token_id])
        return b"".join(chunks).decode("utf-8", errors="replace")

    def output_vocab(self) -> list[int]:
        """Ids the simulated model may emit: printable ASCII pieces (letters, words, . , ! ?)."""
        allowed_punct = set(b" .,!?'")
        out: list[int] = []
        for token_id, piece in enumerate(self._vocab):
            if all((chr(c).isalnum() and c < 128) or c in allowed_punct for c in piece):
                out.append(token_id)
        return out


@functools.cache
def get_tokenizer() -> Tokenizer:
    """The process-wide tokenizer (immutable after construction)."""
    return Tokenizer()
