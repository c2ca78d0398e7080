"""Deterministic tokenization and pseudo-word generation for the reference engine.

The engine has no real model, so it needs two things that are cheap, exact and reproducible:

- a prompt tokenizer, so ``usage.prompt_tokens`` is a well-defined count: every run of word
  characters is split into pieces of at most four characters, every other non-space character is
  one token; chat messages add a fixed framing cost (see :func:`count_chat_tokens`);
- a generator of pseudo-words: token ``i`` of a request is a function of a seed derived from the
  prompt and of ``i`` only, so the same request always yields the same text.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence

_PIECE = re.compile(r"\w+|[^\w\s]", re.UNICODE)
WORD_PIECE_CHARS = 4
# Like OpenAI's accounting: every message costs a few framing tokens (role markers), and the reply
# is primed with an assistant marker.
TOKENS_PER_MESSAGE = 3
TOKENS_REPLY_PRIMING = 3

_SYLLABLES = (
    "ka", "lo", "mi", "ren", "tu", "sa", "vor", "el", "in", "da", "po", "shi", "ra", "ne", "bo",
    "qua", "zi", "mar", "te", "lun", "go", "fa", "ith", "or", "cel", "an", "dro", "vi", "um", "pe",
)


def count_text_tokens(text: str) -> int:
    """Tokens in ``text``: word runs in pieces of up to four characters, punctuation one each."""
    total = 0
    for match in _PIECE.finditer(text):
        piece = match.group(0)
        total += math.ceil(len(piece) / WORD_PIECE_CHARS) if piece[0].isalnum() or piece[0] == "_" else 1
    return total


def count_chat_tokens(messages: Sequence[tuple[str, str]]) -> int:
    """Tokens of a chat prompt given as ``(role, text)`` pairs, framing included."""
    total = TOKENS_REPLY_PRIMING
    for role, text in messages:
        total += TOKENS_PER_MESSAGE + count_text_tokens(role) + count_text_tokens(text)
    return total


def prompt_seed(prompt_text: str) -> int:
    """A stable 64-bit seed for a prompt (never Python's randomized ``hash``)."""
    return int.from_bytes(hashlib.blake2b(prompt_text.encode("utf-8"), digest_size=8).digest(), "big")


def pseudo_word(seed: int, index: int) -> str:
    """Token ``index`` of the stream seeded by ``seed``: one to three syllables, no spaces."""
    # A cheap integer mix (splitmix64) keeps this a pure function of (seed, index).
    value = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    value ^= value >> 31
    syllable_count = 1 + value % 3
    value //= 3
    parts = []
    for _ in range(syllable_count):
        parts.append(_SYLLABLES[value % len(_SYLLABLES)])
        value //= len(_SYLLABLES)
    return "".join(parts)


def token_text(seed: int, index: int) -> str:
    """The text a token contributes to the output: a space then the pseudo-word (none first)."""
    word = pseudo_word(seed, index)
    return word if index == 0 else " " + word
