"""Stop strings on a model without a tokenizer (token-id prompts only): no text is made to match them in, so they
were ignored without a word and every answer ran to ``max_tokens`` (pass43's left item). Refused at the call, naming
``stop``, in-process and over HTTP; ``stop_token_ids`` still stop such a model, and a model with a tokenizer takes
stop strings as before."""

from __future__ import annotations

import httpx
import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.server import ModelSpec, create_app
from tests.helpers import ENGINE_BASE, CharTokenizer

from ..server.conftest import LiveServer


async def test_stop_strings_without_a_tokenizer_are_refused_at_the_call(tiny_models) -> None:
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE) as engine:
        assert engine.get_tokenizer() is None
        with pytest.raises(InvalidParameterError) as caught:
            await engine.generate([5, 6, 7], SamplingParams(max_tokens=4, stop=["a"]))
        assert caught.value.parameter == "stop" and "no tokenizer" in str(caught.value)
        with pytest.raises(InvalidParameterError):
            engine.stream([5, 6, 7], SamplingParams(max_tokens=4, stop="a"))
        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        first = out.outputs[0].token_ids[0]
        stopped = await engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True,
                                                                  stop_token_ids=[first]))
        assert stopped.outputs[0].finish_reason == "stop"
        engine.core.tokenizer = CharTokenizer()  # a model given a tokenizer takes them
        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=4, stop=["\U0010ffff"]))
        assert out.outputs[0].finish_reason == "length"


def test_over_http_it_is_a_400_naming_stop(tiny_models) -> None:
    app = create_app(ModelSpec(str(tiny_models["llama"][0]), "ids", dict(ENGINE_BASE)))
    with LiveServer(app) as live:
        r = httpx.post(f"{live.url}/v1/completions", json={"model": "ids", "prompt": [5, 6, 7], "max_tokens": 4,
                                                            "stop": ["a"]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
