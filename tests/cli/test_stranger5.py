"""A fifth stranger's first hour, bringing their own model: what failed or misled, each held to its fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def templateless_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """docs/formats.md's random-weight file: a vocabulary, but no chat template."""
    pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("stranger5") / "tiny.gguf"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_gguf.py"), str(path), "--shape", "tiny",
                    "--type", "q8_0"], check=True, capture_output=True, timeout=300)
    return path


def test_chat_with_a_model_without_a_chat_template_says_so(templateless_gguf, capsys) -> None:
    """``asyncinfer chat --model tiny.gguf "Hello there"`` said an 11-character message did not fit in
    4088 tokens; the model has no chat template, which is what the user needs to know (and what to use)."""
    from asyncinfer import cli

    assert cli.main(["chat", "--model", str(templateless_gguf), "--threads", "1", "--max-tokens", "4",
                     "Hello there"]) == 2
    err = capsys.readouterr().err
    assert "fits in" not in err
    assert err == (f"asyncinfer: error: {str(templateless_gguf)!r} has no chat template, so chat cannot render "
                   f"messages for it: send plain text with asyncinfer generate {templateless_gguf} --prompt TEXT\n")


def test_generate_chat_with_a_model_without_a_chat_template_is_refused_once(templateless_gguf, capsys) -> None:
    """``asyncinfer generate tiny.gguf --chat --prompt hi`` loaded the model, then failed every prompt on its own
    (``prompt='chat messages' is invalid``, exit status 1): refused once, as chat refuses it, with the fix."""
    from asyncinfer import cli

    assert cli.main(["generate", str(templateless_gguf), "--chat", "--threads", "1", "--max-tokens", "4",
                     "--prompt", "hi", "--prompt", "there"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"asyncinfer: error: {str(templateless_gguf)!r} has no chat template, so generate --chat "
                            f"cannot render messages for it: send plain text with asyncinfer generate "
                            f"{templateless_gguf} --prompt TEXT\n")


def test_chat_with_a_model_without_a_tokenizer_says_so(tmp_path, capsys) -> None:
    """A Hugging Face directory of config.json and weights only: chat said the message did not fit, and the
    first fix pointed to generate --prompt, which cannot encode text for it either."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncinfer import cli

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "bare")
    capsys.readouterr()  # transformers' progress bar
    assert cli.main(["chat", "--model", str(tmp_path / "bare"), "--threads", "1", "--max-tokens", "4", "hi"]) == 2
    assert capsys.readouterr().err == (
        f"asyncinfer: error: {str(tmp_path / 'bare')!r} has no tokenizer (no tokenizer files beside its weights, "
        "or none in its GGUF file), so chat cannot encode messages for it\n")


def test_generate_text_with_a_model_without_a_tokenizer_says_how_to_give_ids(tmp_path, capsys) -> None:
    """``generate --prompt TEXT`` on such a model failed each line with "prompt='a text prompt' is invalid: allowed
    token ids: ..." (exit status 1), never saying how to give ids (stranger79): refused once, with the form of a line
    that runs; a file of text and id lines runs its id lines, each text line refused in words that say what to send."""
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncinfer import cli

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "bare")
    capsys.readouterr()  # transformers' progress bar
    bare = str(tmp_path / "bare")
    assert cli.main(["generate", bare, "--threads", "1", "--max-tokens", "2", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == (
        f"asyncinfer: error: {bare!r} has no tokenizer (no tokenizer files beside its weights, or none in its GGUF "
        'file), so generate cannot encode text prompts for it: give each prompt as token ids, a --file line such as '
        '{"prompt": [1, 2, 3]}\n')
    lines = tmp_path / "mixed.jsonl"
    lines.write_text('{"prompt": "hi"}\n{"prompt": [1, 2, 3]}\n')
    assert cli.main(["generate", bare, "--threads", "1", "--max-tokens", "2", "--file", str(lines),
                     "--no-progress"]) == 1
    text, ids = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert text["error"] == ("prompt: this model was loaded without a tokenizer, so a text prompt cannot be encoded "
                             "for it: send the prompt as token ids (a list of integers)")
    assert len(ids["token_ids"]) == 2


def test_a_file_inside_a_model_directory_names_the_directory(tmp_path, capsys) -> None:
    """vLLM users point at a checkpoint's file (model.safetensors, config.json): 'is not a model' alone left
    them guessing; the error names the directory that is one."""
    from asyncinfer import cli

    model = tmp_path / "mymodel"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    assert cli.main(["info", str(model / "model.safetensors")]) == 2
    assert capsys.readouterr().err == (
        f"asyncinfer: error: {model / 'model.safetensors'} is not a model: expected a directory or a .gguf file; "
        f"its directory {model} is a Hugging Face model directory: give that\n")


def test_a_gguf_file_named_in_capitals_loads(templateless_gguf, tmp_path, capsys) -> None:
    """``TINY.GGUF`` was 'not a model: expected a directory or a .gguf file' (chat's own check takes it)."""
    from asyncinfer import cli

    upper = tmp_path / "TINY.GGUF"
    upper.symlink_to(templateless_gguf)
    assert cli.main(["info", str(upper)]) == 0
    assert "architecture: llama" in capsys.readouterr().out


def test_formats_md_lists_every_type_make_gguf_writes() -> None:
    """docs/formats.md gave ``--type f16|q8_0|q4_0|q4_1``; the script also writes bf16."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("stranger5_make_gguf", ROOT / "benchmarks" / "make_gguf.py")
    make_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_gguf)
    docs = (ROOT / "docs" / "formats.md").read_text()
    assert f"--type {'|'.join(make_gguf.TYPES)}`" in docs


def test_a_gguf_file_named_in_capitals_is_served_without_its_suffix() -> None:
    """``asyncinfer serve TINY.GGUF`` served the model as ``TINY.GGUF``; ``tiny.gguf`` is served as ``tiny``."""
    from asyncinfer.server import ModelSpec

    assert ModelSpec.served_name("/models/TINY.GGUF") == "TINY"
    assert ModelSpec.served_name("/models/tiny.gguf") == "tiny"
    assert ModelSpec.served_name("/models/.gguf") == "/models/.gguf"


def test_chat_says_when_the_chat_template_refuses_the_system_message(tmp_path, capsys) -> None:
    """Gemma's templates raise 'System role not supported': ``chat --system`` said the 2-character message
    did not fit in 2045 tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncinfer import cli

    tokenizers = pytest.importorskip("tokenizers")
    torch.manual_seed(0)
    model = tmp_path / "strict"
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(model)
    capsys.readouterr()  # transformers' progress bar
    vocab = {chr(ord("a") + i): i for i in range(26)} | {"<unk>": 26}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}')
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")
    assert cli.main(["chat", "--model", str(model), "--threads", "1", "--max-tokens", "2", "--system", "be brief",
                     "hi"]) == 2
    err = capsys.readouterr().err
    assert "fits in" not in err
    assert err == ("asyncinfer: error: the model's chat template refuses this conversation (the --system message "
                   "included): System role not supported\n")
