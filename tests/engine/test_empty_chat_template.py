"""A chat template of nothing but whitespace (a GGUF file's ``tokenizer.chat_template = ""``) is no chat template:
chats are refused as for a model without one, saying so. It rendered every chat as no text, refused as "allowed a
prompt of at least one token", which named nothing of the template."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError
from asyncinfer.commands import CommandError, check_chats_render
from asyncinfer.prompts import NO_CHAT_TEMPLATE
from asyncinfer.server.tool_formats import HERMES, tool_format
from tests.helpers import greedy, tiny_hf_model, write_gemma_gguf

VOCAB = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "\n", *"abdefhilmnorstuy", "\u2581t", "\u2581the"]


@pytest.mark.parametrize("template", [" \n\t ", "\n"])
async def test_a_blank_chat_template_is_refused_as_none(tmp_path, monkeypatch, template) -> None:
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))  # the built tokenizer's cache
    hf = tiny_hf_model("gemma3", 5, bos_token_id=2, eos_token_id=1)
    path = write_gemma_gguf(hf, tmp_path / "blank.gguf", vocab=VOCAB, chat_template=template)
    engine = AsyncEngine.from_pretrained(path, max_model_len=64, num_threads=1)
    async with engine:
        assert engine.tokenizer.chat_template == template  # the file's, as it is
        with pytest.raises(InvalidParameterError) as refused:
            await engine.generate([{"role": "user", "content": "hello"}], greedy(2))
        assert (refused.value.parameter, refused.value.allowed) == ("prompt", NO_CHAT_TEMPLATE)
        out = await engine.generate("the", greedy(2))  # text prompts are served
        assert len(out.token_ids) == 2
        with pytest.raises(CommandError, match="has no chat template, so asyncinfer chat cannot render messages"):
            check_chats_render(engine.tokenizer, path, "asyncinfer chat")
        assert tool_format(engine.tokenizer) is HERMES


def test_a_template_with_text_is_the_template() -> None:
    from asyncinfer.models.tokenizer import chat_template_of

    class Tokenizer:
        chat_template = "{{ messages[0]['content'] }}"

    assert chat_template_of(Tokenizer()) == Tokenizer.chat_template
    assert chat_template_of(None) is None
    assert chat_template_of(object()) is None
    Tokenizer.chat_template = " "
    assert chat_template_of(Tokenizer()) is None
