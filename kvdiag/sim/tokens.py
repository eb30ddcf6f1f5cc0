"""The simulated model's tokenizer: a small fixed vocabulary and a cheap prompt-length estimate.

Token ids are computed in EngineCore; the API server turns them into text. Each vocabulary
entry's JSON form is computed once, so an SSE event is two string joins, not a json.dumps.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

# Word pieces of the sort a random small model emits (stream.txt shows "igh", "~", "", "ssist").
_PIECES = (
    " the", " of", " and", " to", " a", " in", " is", " that", " for", " it", " with", " as", " was",
    " on", " be", " at", " by", " this", " had", " not", " are", " but", " from", " or", " have", " an",
    " they", " which", " one", " you", " were", " all", " we", " her", " she", " there", " would",
    " their", " will", " when", " who", " him", " been", " has", " more", " if", " no", " out", " so",
    " said", " what", " up", " its", " about", " into", " than", " them", " can", " only", " other",
    "igh", "~", "", "ssist", "ing", "ed", "er", "ly", "tion", "s", ".", ",", "\n", " model", " cache",
    " page", " token", " engine", " kv", " memory", " block", " layer", " stream", " request",
)
VOCAB: tuple[str, ...] = _PIECES
VOCAB_SIZE = len(VOCAB)
VOCAB_JSON: tuple[str, ...] = tuple(json.dumps(p, ensure_ascii=False) for p in VOCAB)

_CHAT_TEMPLATE_TOKENS = 10   # role markers and the generation prompt
_CHAT_PER_MESSAGE_TOKENS = 4


def token_id(rid: int, index: int, seed: int) -> int:
    """The ``index``-th token of request ``rid``: deterministic, cheap, well spread."""
    return (rid * 2654435761 + index * 40503 + seed * 97) % VOCAB_SIZE


def count_text_tokens(text: str) -> int:
    """Roughly one token per word, at least one per four characters of a long word."""
    n = 0
    for word in text.split():
        n += 1 + len(word) // 8
    return n


def count_prompt_tokens(prompt: object) -> int:
    """Prompt length of a /v1/completions ``prompt`` (text, token ids, or a list of either)."""
    if isinstance(prompt, str):
        return max(1, count_text_tokens(prompt))
    if isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, Sequence) and prompt:
        return max(count_prompt_tokens(p) for p in prompt)
    return 1


def count_chat_tokens(messages: Sequence[object]) -> int:
    """Prompt length of a chat ``messages`` list after a chat template."""
    n = _CHAT_TEMPLATE_TOKENS
    for msg in messages:
        n += _CHAT_PER_MESSAGE_TOKENS
        if isinstance(msg, dict):
            content = msg.get("content")
            if isinstance(content, str):
                n += count_text_tokens(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        n += count_text_tokens(part["text"])
    return n


def detokenize(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)
