"""pass29: a hostile tenant's costly features (structured output, logprobs, ``n``, stop lists, seeds) on a shared
server. What broke: a completions stream's ``text_offset`` counted from the text streamed so far, which a piece of
a character or a possible stop string holds back (and a stop string's tokens never add to), while the whole answer
counted its tokens' own characters, so the same seeded request's logprobs differed streamed and whole."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

# Seeded completions whose samples draw pieces of characters ("\ufffd" tokens) or stop at a stop string: found by
# a randomized comparison of whole and streamed answers on the tiny model (temperature 2 draws bytes freely).
BODIES = [
    {"max_tokens": 8, "seed": 88, "temperature": 2.0, "n": 2, "prompt": "y4j<\u20ac<", "logprobs": 2},
    {"max_tokens": 8, "seed": 205, "temperature": 2.0, "n": 2, "stop": ["a", "o"], "prompt": "ak\t8", "logprobs": 2},
    {"max_tokens": 30, "seed": 504, "temperature": 1.0, "n": 1, "prompt": "3[", "logprobs": 0},
    {"max_tokens": 8, "seed": 382, "temperature": 2.0, "n": 2, "stop": ["\u00e9", "e"], "prompt": ["ab", "cd"],
     "logprobs": 0},
]


def _streamed(http: httpx.Client, body: dict[str, Any]) -> dict[int, dict[str, list[Any]]]:
    """Each choice's logprobs, its chunks' lists joined."""
    joined: dict[int, dict[str, list[Any]]] = {}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                if choice["logprobs"]:
                    into = joined.setdefault(choice["index"], {key: [] for key in choice["logprobs"]})
                    for key, values in choice["logprobs"].items():
                        into[key] += values
    return joined


@pytest.mark.parametrize("body", BODIES, ids=lambda body: f"seed{body['seed']}")
def test_text_offsets_are_the_same_streamed_and_whole(server, body):
    body = {"model": "tiny", **body}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        whole = http.post("/v1/completions", json=body)
        assert whole.status_code == 200
        streamed = _streamed(http, body)
    for choice in whole.json()["choices"]:
        logprobs = choice["logprobs"]
        tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
        # Each offset counts the characters of the tokens before it, as `tokens` reads them.
        assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
        assert streamed[choice["index"]]["tokens"] == tokens
        assert streamed[choice["index"]]["text_offset"] == offsets
