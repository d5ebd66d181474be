"""The official ``openai`` client against create_app on a loopback port: every answer equals the engine's own."""

from __future__ import annotations

import asyncio
import base64
import random

import httpx
import numpy as np
import openai
import pytest
import torch

from asyncinfer import SamplingParams

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"max_tokens": 12, "temperature": 0}  # over HTTP, a request without `temperature` samples at 1


def generate(server, prompt, model="tiny", **params):
    return server.call(server.engine.generate(prompt, SamplingParams(**params), model=model))


def test_models_and_health(server, client) -> None:
    cards = client.models.list().data
    assert [(c.id, c.kind) for c in cards] == [("tiny", "generate"), ("ids", "generate"), ("minilm", "embed")]
    assert cards[0].max_model_len == 512 and cards[0].owned_by == "asyncinfer"
    assert cards[2].max_model_len == 256  # all-MiniLM-L6-v2 reads 256 tokens a text (its max_seq_length)
    assert client.models.retrieve("minilm").id == "minilm"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_equals_engine_generate(server, client) -> None:
    want = generate(server, MESSAGES, **GREEDY)
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    assert got.object == "chat.completion" and got.model == "tiny" and got.id.startswith("chatcmpl-")
    (choice,) = got.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(server.engine.apply_chat_template(MESSAGES)) == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids) and got.usage.total_tokens == (
        got.usage.prompt_tokens + got.usage.completion_tokens)


def test_content_parts_and_developer_role_render_as_text(server, client) -> None:
    parts = [{"role": "developer", "content": "You are terse."},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    plain = [MESSAGES[0], {"role": "user", "content": "What is the capital\nof France?"}]
    got = client.chat.completions.create(model="tiny", messages=parts, **GREEDY)
    assert got.choices[0].message.content == generate(server, plain, **GREEDY).text


def test_chat_stream_with_usage_equals_engine_generate(server, client) -> None:
    want = generate(server, MESSAGES, max_tokens=20, ignore_eos=True)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == want.text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(want.prompt_token_ids), 20)
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)


def test_stream_ends_with_done_on_the_wire(server) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"  # a buffering proxy (nginx) passes each event on as it comes
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_sampling_fields_reach_the_engine(server, client) -> None:
    """Seeded sampling with every mapped field: n samples equal the engine's, sample by sample."""
    fields = {"temperature": 0.9, "top_p": 0.9, "seed": 1234, "presence_penalty": 0.5, "frequency_penalty": 0.3,
              "n": 3}
    extra = {"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.1}
    want = generate(server, MESSAGES, max_tokens=16, **fields, **extra)
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=16, **fields,
                                         extra_body=extra)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.message.content for c in got.choices] == [o.text for o in want.outputs]
    assert len({o.text for o in want.outputs}) > 1  # really sampled, and each sample kept its seed
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)


def test_stop_strings(server, client) -> None:
    full = generate(server, MESSAGES, max_tokens=20, ignore_eos=True).text
    stop = full[5:8]
    want = generate(server, MESSAGES, max_tokens=20, ignore_eos=True, stop=[stop])
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, stop=[stop], temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want.text and got.choices[0].finish_reason == "stop"
    assert stop not in want.text


def test_chat_logprobs(server, client) -> None:
    want = generate(server, MESSAGES, max_tokens=6, ignore_eos=True, logprobs=3)
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    tok = server.engine.tokenizer
    content = got.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([lp.token_id]) for lp in want.logprobs]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].bytes == list(content[0].token.encode())


def test_completions_several_prompts_and_samples(server, client) -> None:
    prompts = ["The quick brown fox", "1, 2, 3,"]
    fields = {"temperature": 0.8, "seed": 7, "n": 2, "max_tokens": 10}
    wants = [generate(server, p, **fields) for p in prompts]
    got = client.completions.create(model="tiny", prompt=prompts, **fields)
    assert got.object == "text_completion" and [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [o.text for w in wants for o in w.outputs]
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in wants)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt=prompts, stream=True, **fields):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == [c.text for c in got.choices]


def test_token_id_prompts_give_the_exact_tokens(server, client, tiny_models, hf_greedy) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 17)]
    got = client.completions.create(model="ids", prompt=prompts, max_tokens=8, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    for prompt, choice in zip(prompts, got.choices):
        ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
        assert ids == hf_greedy(tiny_models["qwen2"][1], prompt, 8)
    one = client.completions.create(model="ids", prompt=prompts[0], max_tokens=8, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].logprobs.tokens == got.choices[0].logprobs.tokens
    assert one.usage.prompt_tokens == 5


def test_completion_stream_usage_counts_the_prompt_tokens(server, client) -> None:
    want = generate(server, "The quick brown fox", max_tokens=5, ignore_eos=True)
    chunks = list(client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5, temperature=0,
                                            stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == want.text
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == 5


def test_embeddings_float_and_base64(server, client) -> None:
    texts = ["The cat sat on the mat.", "Paris is the capital of France."]
    want = server.call(server.engine.embed(texts, model="minilm"))
    packed = client.embeddings.create(model="minilm", input=texts)  # the client asks for base64 by default
    plain = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
    for got in (packed, plain):
        assert [d.index for d in got.data] == [0, 1] and got.model == "minilm"
        assert torch.allclose(torch.tensor([d.embedding for d in got.data]), want, atol=1e-6)
        assert got.usage.prompt_tokens == got.usage.total_tokens > 2 * 2
    raw = httpx.post(server.url + "/v1/embeddings",
                     json={"model": "minilm", "input": texts[0], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    alone = server.call(server.engine.embed(texts[0], model="minilm"))[0]
    assert torch.equal(torch.from_numpy(vector.copy()), alone)  # base64 carries the float32 bits as they are
    assert client.embeddings.create(model="minilm", input="one", dimensions=384).data[0].embedding
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="minilm", input="one", dimensions=128)
    assert err.value.body["param"] == "dimensions"


async def test_sixteen_concurrent_async_clients(server) -> None:
    prompts = [[{"role": "user", "content": f"Count to {i}, please."}] for i in range(16)]
    wants = [generate(server, p, max_tokens=24, ignore_eos=True).text for p in prompts]
    steps_before = server.engine.step_stats().steps

    async def one(i: int) -> str:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
            if i % 2:
                out = await c.chat.completions.create(model="tiny", messages=prompts[i], max_tokens=24, temperature=0,
                                                      extra_body={"ignore_eos": True})
                return out.choices[0].message.content
            pieces = []
            async for chunk in await c.chat.completions.create(model="tiny", messages=prompts[i], max_tokens=24,
                                                               temperature=0, stream=True,
                                                               extra_body={"ignore_eos": True}):
                pieces.append(chunk.choices[0].delta.content or "")
            return "".join(pieces)

    got = await asyncio.gather(*(one(i) for i in range(16)))
    assert got == wants
    stats = server.engine.step_stats()  # batch_sizes keeps the last 1024 steps: take this test's from the end
    batch_sizes = stats.batch_sizes[len(stats.batch_sizes) - (stats.steps - steps_before):]
    assert max(batch_sizes) > 1  # they shared engine steps: one engine, many requests
    server.wait_idle()


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_stream_with_usage_refuses_a_too_long_prompt_by_characters_before_tokenizing(server, client, route,
                                                                                      monkeypatch) -> None:
    """With include_usage the server counts the prompt itself: a text that cannot fit max_model_len whatever
    its tokens is refused by its characters, as generate() refuses it, never tokenized first."""
    calls: list[int] = []
    tokenizer = server.engine.get_tokenizer("tiny")
    real = type(tokenizer).__call__

    def spy(self, text, *args, **kwargs):  # the tokenizer's every use, by text length
        calls.append(len(text) if isinstance(text, str) else -1)
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", spy)
    text = "word " * 400_000  # 2 M characters, far past 512 tokens' worth
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                                stream=True, stream_options={"include_usage": True}))
        else:
            list(client.completions.create(model="tiny", prompt=text, stream=True,
                                           stream_options={"include_usage": True}))
    assert "characters" in str(err.value) and err.value.body["param"] == ("messages" if route == "chat" else "prompt")
    assert not [n for n in calls if n > 100_000]
