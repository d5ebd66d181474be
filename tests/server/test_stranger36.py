"""A stranger's first hour (stranger36): ``asyncinfer serve`` of a model without a tokenizer.

docs/serving.md says ``/v1/completions`` takes token ids for a model loaded without a tokenizer; so it did, and
answered each with ``"text": ""`` and nothing else: a 200 whose answer was nowhere (its tokens cannot be decoded,
and nothing carried them but ``logprobs``' ``token_id:<n>`` names), and a stream of no chunk but the last. Each
choice of such a model's completion carries its ``token_ids`` now (vLLM's field), whole and streamed, as
``asyncinfer generate``'s lines add ``token_ids`` for such a model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from asyncinfer.server import ModelSpec, create_app
from tests.server.conftest import TINY_OPTIONS, LiveServer

BODY = {"model": "ids", "prompt": [[5, 6, 7], [9, 10]], "max_tokens": 4, "temperature": 0, "logprobs": 0, "n": 2}


@pytest.fixture(scope="module")
def ids_server(tiny_models) -> Iterator[LiveServer]:
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS))) as live:
        yield live


def test_a_completion_of_a_model_without_a_tokenizer_carries_its_token_ids(ids_server) -> None:
    answer = httpx.post(ids_server.url + "/v1/completions", json=BODY, timeout=60).json()
    assert len(answer["choices"]) == 4
    for choice in answer["choices"]:
        assert choice["text"] == "" and len(choice["token_ids"]) == 4
        assert [f"token_id:{t}" for t in choice["token_ids"]] == choice["logprobs"]["tokens"]
    assert answer["usage"]["completion_tokens"] == 16


def test_a_streamed_completion_of_a_model_without_a_tokenizer_carries_its_token_ids(ids_server) -> None:
    whole = httpx.post(ids_server.url + "/v1/completions", json={**BODY, "logprobs": None}, timeout=60).json()
    for logprobs in (None, 0):
        streamed: dict[int, list[int]] = {}
        with httpx.stream("POST", ids_server.url + "/v1/completions", json={**BODY, "stream": True,
                                                                            "logprobs": logprobs}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
        assert streamed == {c["index"]: c["token_ids"] for c in whole["choices"]}


def test_a_model_with_a_tokenizer_answers_as_openai_does(server) -> None:
    answer = httpx.post(server.url + "/v1/completions", json={**BODY, "model": "tiny", "prompt": "hi"},
                        timeout=60).json()
    assert all("token_ids" not in choice for choice in answer["choices"])
