"""CachedTokenizer: a GGUF file's cached tokenizer without transformers, and the same ids and chat prompts as
transformers' own tokenizer built from the same file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import jinja2
import pytest
from transformers import AutoTokenizer

from asyncinfer.models.loader import gguf_tokenizer
from asyncinfer.models.tokenizer import CachedTokenizer, load_cached

TEXTS = ["What is the capital of France?", "  leading spaces, tabs\tand\nnewlines  ", "Émoji 🤖🎉 and 中文字符",
         "<|im_start|>user\nspecial tokens inline<|im_end|>", "<s> a </s> b <unk>", "", "the turn ends<end_of_turn>"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Émoji 🤖 and 中文"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And of Italy?"}],
    [{"role": "user", "content": "hi", "name": None}, {"role": "assistant", "content": "ok", "reasoning": "short"}],
]
# A template using what chat templates use: namespace, loop controls, tojson (non-ASCII kept), tools, the
# special tokens as variables, a message's reasoning under its aliases, dict(), raise_exception, generation blocks.
TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% if tools %}{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}"
    "  {% if m.role == 'tool' %}{{ raise_exception('no tool turns here') }}{% endif %}"
    "  {% if m.role == 'system' %}{% continue %}{% endif %}"
    "  {% set ns.n = ns.n + 1 %}"
    "<start_of_turn>{{ m.role }} {{ ns.n }}\n"
    "  {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% if m.reasoning_content is defined %}[{{ m.reasoning_content }}|{{ m.thinking }}]{% endif %}"
    "  {% else %}{{ m.content | tojson }}{{ dict(a=1) | tojson }}{% endif %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% else %}{{ eos_token }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "météo", "parameters": {"type": "object"}}}]


def write_tokenizer_gguf(path: Path, template: str) -> Path:
    """A GGUF holding only a sentencepiece-style vocabulary ("llama", as llama.cpp writes Llama's and Gemma's)
    and a chat template: what transformers builds a tokenizer from."""
    words = ["\u2581the", "\u2581capital", "\u2581of", "\u2581France", "?", "\u2581a", "\u2581b", "\u2581is", "what",
             "\u2581What", "\u2581and", "\u2581And", "\u2581Italy", "\u2581hi", "ok", "hi", "Be", "\u2581brief", "."]
    vocab = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>", "\u2581", "\n", *words,
             *sorted({c for w in words for c in w} - set(words))]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_vocab_size(len(vocab))
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab)
    writer.add_token_scores([-float(i) for i in range(len(vocab))])
    writer.add_token_types([2 if t == "<unk>" else 3 if t.startswith("<") and t.endswith(">") else 1 for t in vocab])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def assert_same(ours: CachedTokenizer, reference, conversations=CONVERSATIONS, **chat) -> None:
    assert isinstance(ours, CachedTokenizer)
    assert ours.get_vocab() == reference.get_vocab() and len(ours) == len(reference)
    assert ours.special_tokens_map == reference.special_tokens_map
    assert ours.all_special_tokens == reference.all_special_tokens and ours.all_special_ids == reference.all_special_ids
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id"):
        assert getattr(ours, name) == getattr(reference, name), name
    assert ours.chat_template == reference.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            assert ours(text, add_special_tokens=special)["input_ids"] == ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    for messages in conversations:
        for prompt in (True, False):
            text = reference.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False, **chat)
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False, **chat) == text
            ids = reference.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True, **chat)
            ids = list(ids if isinstance(ids, list) else ids["input_ids"])
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt, **chat) == ids
            assert ids == reference.encode(text, add_special_tokens=False)


@pytest.mark.real_model
def test_the_default_models_tokenizer_is_transformers_to_the_id(real_gguf, real_hf_reference) -> None:
    assert_same(gguf_tokenizer(real_gguf), real_hf_reference[1])


@pytest.fixture
def template_gguf(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    return write_tokenizer_gguf(tmp_path / "tok.gguf", TEMPLATE)


def test_a_gguf_built_tokenizer_and_its_template_are_transformers_to_the_id(template_gguf) -> None:
    reference = AutoTokenizer.from_pretrained(template_gguf.parent, gguf_file=template_gguf.name)
    first = gguf_tokenizer(template_gguf)  # built by transformers, cached, read back from the cache
    again = gguf_tokenizer(template_gguf)
    assert_same(first, reference)
    assert_same(again, reference)
    assert_same(again, reference, tools=TOOLS)
    assert "météo" in again.apply_chat_template(CONVERSATIONS[0], tools=TOOLS, tokenize=False)  # tojson: no \\u
    assert again.apply_chat_template(CONVERSATIONS[0], tokenize=False, eos_token="<END>").endswith("<END>")
    bad = [{"role": "tool", "content": "x"}]
    for tokenizer in (again, reference):
        with pytest.raises(jinja2.TemplateError, match="no tool turns here"):
            tokenizer.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ValueError, match="empty"):
        again.apply_chat_template([], tokenize=False)


def test_the_sandbox_refuses_what_transformers_refuses() -> None:
    from asyncinfer.models.tokenizer import compile_chat_template

    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_chat_template("{% set ns = namespace(_x=1) %}{{ ns._x }}").render(messages=[])
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_chat_template("{{ messages.append(1) }}").render(messages=[])  # immutable sandbox


def test_loading_the_cache_imports_no_transformers(template_gguf) -> None:
    cache = gguf_tokenizer(template_gguf)  # builds the cache (transformers, once)
    assert isinstance(cache, CachedTokenizer)
    from asyncinfer.model_source import tokenizer_cache_dir

    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from asyncinfer.models.loader import gguf_tokenizer\n"
        f"tok = gguf_tokenizer(Path({str(template_gguf)!r}))\n"
        "assert type(tok).__name__ == 'CachedTokenizer', type(tok)\n"
        "assert tok.encode('the capital of France?') and tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "assert 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=__file__.rsplit("/tests/", 1)[0])
    assert (tokenizer_cache_dir(template_gguf) / "tokenizer.json").is_file()


def test_another_configuration_loads_through_transformers(template_gguf) -> None:
    """A cache this class cannot reproduce exactly (here an option it does not implement) is not taken."""
    from asyncinfer.model_source import tokenizer_cache_dir

    gguf_tokenizer(template_gguf)
    cache = tokenizer_cache_dir(template_gguf)
    assert load_cached(cache) is not None
    config = json.loads((cache / "tokenizer_config.json").read_text())
    (cache / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert load_cached(cache) is None
    tokenizer = gguf_tokenizer(template_gguf)  # the stamp still matches: loaded with the class that built it
    assert not isinstance(tokenizer, CachedTokenizer) and type(tokenizer).__module__.startswith("transformers")
    (cache / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert load_cached(cache) is None


def test_a_file_rewritten_at_the_same_size_and_time_gets_its_own_tokenizer(template_gguf) -> None:
    """pass70: the cache's stamp was the file's path, size and modification time, so a file rewritten with other
    metadata of the same size, its time kept (``cp -p``, ``rsync -a``, an archive), kept its old chat template and
    vocabulary. The stamp holds a digest of the header (the metadata the tokenizer is built from) too."""
    import os

    first = gguf_tokenizer(template_gguf)
    said = first.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    info = template_gguf.stat()
    other = TEMPLATE.replace("<start_of_turn>", "<START_OF_TURN>")
    assert len(other) == len(TEMPLATE) and other != TEMPLATE
    write_tokenizer_gguf(template_gguf.with_name("other.gguf"), other).replace(template_gguf)
    os.utime(template_gguf, ns=(info.st_atime_ns, info.st_mtime_ns))
    after = template_gguf.stat()
    assert (after.st_size, after.st_mtime_ns) == (info.st_size, info.st_mtime_ns)
    again = gguf_tokenizer(template_gguf)
    assert again.apply_chat_template(CONVERSATIONS[0], tokenize=False) == said.replace(
        "<start_of_turn>", "<START_OF_TURN>")
