"""What one prompt may cost the event loop, and texts no tokenizer can encode (issue 25).

A chat of more than ``MAX_CHAT_MESSAGES`` messages is refused before its template runs; a
chat of many messages (empty ones included) is templated and tokenized in a worker thread,
never on the caller's loop; a text with a lone surrogate is an ``InvalidParameterError``
naming the prompt (or the embed text), not the tokenizer's ``TypeError``.
"""

from __future__ import annotations

import threading

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.prompts import MAX_CHAT_MESSAGES
from tests.helpers import TemplateSpy

pytestmark = pytest.mark.real_model

ONE = SamplingParams(max_tokens=1)


async def test_many_chat_messages_are_refused_before_work_or_templated_off_the_loop(real_gguf, monkeypatch) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=2048) as engine:
        spy = TemplateSpy(engine.tokenizer)
        monkeypatch.setattr(engine.tokenizer, "apply_chat_template", spy)
        flood = [{"role": "user", "content": ""}] * 100_000
        for call in (lambda: engine.stream(flood, ONE), lambda: engine.count_tokens(flood)):
            with pytest.raises(InvalidParameterError) as err:
                call()  # at the call: stream() too
            assert err.value.parameter == "prompt" and f"at most {MAX_CHAT_MESSAGES} chat messages" in str(err.value)
        with pytest.raises(InvalidParameterError, match="chat messages"):
            await engine.generate(flood, ONE)
        assert spy.threads == []  # refused before the template ran
        # Under the limit, many empty messages cost the template real work: it runs in a worker thread.
        many = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}] * 500
        with pytest.raises(InvalidParameterError) as err:  # 1000 messages render to more than max_model_len tokens
            await engine.generate(many, ONE)
        assert err.value.parameter == "prompt"
        assert spy.threads and threading.main_thread() not in spy.threads
        spy.threads.clear()
        few = [{"role": "user", "content": ""}, {"role": "assistant", "content": "ok"}] * 40 + [
            {"role": "user", "content": "Hi"}]  # 81 messages, 86 characters: costlier than OFF_LOOP_CHARS
        out = await engine.generate(few, ONE)
        assert spy.threads and threading.main_thread() not in spy.threads
        assert len(out.prompt_token_ids) == engine.count_tokens(few)


async def test_a_lone_surrogate_is_an_invalid_parameter_naming_the_prompt(real_gguf, minilm_dir) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=512) as engine:
        await engine.add_model("minilm", "all-MiniLM-L6-v2")
        bad = "caf\ud800 au lait"
        for prompt, parameter in ((bad, "prompt"), ("x" * 5000 + bad, "prompt"),  # long: tokenized off the loop
                                  ([{"role": "user", "content": bad}], "prompt[0]"),
                                  ([{"role": "user", "content": "hi"}, {"role": "\udfff", "content": "x"}], "prompt[1]")):
            with pytest.raises(InvalidParameterError) as err:
                await engine.generate(prompt, ONE)
            assert err.value.parameter == parameter and "surrogate" in str(err.value)
            with pytest.raises(InvalidParameterError) as err:
                async for _ in engine.stream(prompt, ONE):
                    pass
            assert err.value.parameter == parameter
            with pytest.raises(InvalidParameterError):
                engine.count_tokens(prompt)
        for texts, parameter in ((bad, "texts"), (["fine", bad], "texts[1]")):
            with pytest.raises(InvalidParameterError) as err:
                await engine.embed(texts, model="minilm")
            assert err.value.parameter == parameter and "surrogate" in str(err.value)
        # Valid text beyond the BMP is fine, and the engine serves on.
        assert (await engine.generate("caf\u00e9 \U0001f916", ONE)).finish_reason == "length"
        assert tuple((await engine.embed(["caf\u00e9 \U0001f916"], model="minilm")).shape) == (1, 384)


async def test_chat_roles_are_the_server_s_and_developer_renders_as_system(real_gguf) -> None:
    """One rule for the library and HTTP (asyncinfer.prompts.CHAT_ROLES): an unknown role is refused naming
    the message's role; ``developer`` renders as ``system``, as the server sends it to the template."""
    from asyncinfer.prompts import CHAT_ROLES
    from asyncinfer.server.protocol import chat_history

    async with await AsyncEngine.load(real_gguf, max_model_len=256) as engine:
        for call in (lambda m: engine.generate(m, ONE), lambda m: engine.count_tokens(m)):
            with pytest.raises(InvalidParameterError) as err:
                result = call([{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}])
                if hasattr(result, "__await__"):
                    await result
            assert err.value.parameter == "prompt[1].role" and err.value.value == "robot"
            assert "'system', 'developer', 'user', 'assistant', 'tool'" in str(err.value)
        as_developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        assert engine.apply_chat_template(as_developer) == engine.apply_chat_template(as_system)
        assert chat_history(as_developer) == as_system  # the server's rendering: the same
        assert engine.apply_chat_template([{"role": "tool", "content": "4"}])  # a role both accept
    assert set(CHAT_ROLES) == {"system", "developer", "user", "assistant", "tool"}


async def test_a_token_id_past_the_vocabulary_is_named_with_its_index(real_gguf) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=256) as engine:
        vocab = engine.model_config.vocab_size
        with pytest.raises(InvalidParameterError) as err:
            await engine.generate([5, 6, vocab + 7], ONE)
        assert err.value.parameter == "prompt" and err.value.value == vocab + 7
        # the id and its place, not the id alone as if it were the prompt ("prompt=49159 is invalid")
        assert str(err.value) == f"prompt token id {vocab + 7} (at index 2) is invalid: allowed token ids in [0, {vocab - 1}]"
