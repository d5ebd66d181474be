"""A model file that leads into the kernel's pseudo-files (``/proc``, ``/sys``) is refused unread (pass70): they are
regular files to ``stat`` of size 0 whatever a read gives, and some wait for ever (``/proc/kmsg`` waits for the
kernel's next message), so a ``config.json`` linked there could hang a load or a swap."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, ModelLoadError
from asyncinfer.models.checkpoint import load_hf_tokenizer


@pytest.mark.parametrize(("name", "target"), [("config.json", "/proc/self/status"),
                                              ("tokenizer.json", "/proc/version"),
                                              ("model.safetensors", "/sys/kernel/mm/transparent_hugepage/enabled")])
def test_a_model_file_into_the_kernels_files_is_refused_by_name(tiny_models, tmp_path, name, target) -> None:
    if not Path(target).exists():
        target = "/proc/self/status"  # (a machine without that sysfs file: the same rule)
    model = tmp_path / "model"
    model.mkdir()
    for item in tiny_models["llama"][0].iterdir():
        (model / item.name).symlink_to(item)
    if name == "tokenizer.json":
        (model / "tokenizer_config.json").write_text("{}")
    (model / name).unlink(missing_ok=True)
    (model / name).symlink_to(target)
    with pytest.raises(ModelLoadError, match=rf"cannot read {model / name}: it is the kernel's file "):
        AsyncEngine.from_pretrained(model, dtype="float32", device="cpu", num_threads=1)


@pytest.mark.parametrize("target", ["/proc/version", "fifo"])
def test_an_additional_chat_template_is_checked_as_every_tokenizer_file(tiny_models, tmp_path, target) -> None:
    """pass71: transformers reads every file of additional_chat_templates/, which no check looked at: one linked to
    /proc/kmsg hung the load (and a swap to it) for ever."""
    import os

    model = tmp_path / "model"
    model.mkdir()
    for item in tiny_models["llama"][0].iterdir():
        (model / item.name).symlink_to(item)
    (model / "tokenizer_config.json").write_text("{}")
    templates = model / "additional_chat_templates"
    templates.mkdir()
    (templates / "fine.jinja").write_text("{{ messages }}")
    evil = templates / "evil.jinja"
    if target == "fifo":
        os.mkfifo(evil)
        said = "it is not a regular file"
    else:
        evil.symlink_to(target)
        said = "it is the kernel's file"
    with pytest.raises(ModelLoadError, match=rf"cannot read {evil}: {said}"):
        AsyncEngine.from_pretrained(model, dtype="float32", device="cpu", num_threads=1)


def test_any_file_beside_the_tokenizer_is_checked_too(tiny_models, tmp_path) -> None:
    """transformers opens names of its own beyond the ones asyncinfer knows (a Mistral ``tekken.json``...): a file of
    the model's directory that leads to the kernel's files is refused whatever its name."""
    model = tmp_path / "model"
    model.mkdir()
    for item in tiny_models["llama"][0].iterdir():
        (model / item.name).symlink_to(item)
    (model / "tokenizer_config.json").write_text("{}")
    (model / "tekken.json").symlink_to("/proc/version")
    with pytest.raises(ModelLoadError, match=rf"cannot read {model / 'tekken.json'}: it is the kernel's file "):
        AsyncEngine.from_pretrained(model, dtype="float32", device="cpu", num_threads=1)


def test_entries_of_additional_chat_templates_transformers_skips_are_left_alone(tiny_models, tmp_path) -> None:
    """pass74: every entry of additional_chat_templates/ was held to be a readable file, where transformers reads its
    regular ``*.jinja`` files alone: a leftover folder or a link to a deleted blob there (or a ``chat_template.jinja``
    linked to nothing) refused a model transformers loads."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    model = tmp_path / "model"
    model.mkdir()
    for item in tiny_models["llama"][0].iterdir():
        (model / item.name).symlink_to(item)
    Tokenizer(WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    templates = model / "additional_chat_templates"
    templates.mkdir()
    (templates / "tool.jinja").write_text("{{ messages }}")
    (templates / "old").mkdir()
    (templates / "README.md").symlink_to(tmp_path / "deleted-blob")
    (templates / "gone.jinja").symlink_to(tmp_path / "deleted-blob")
    (model / "chat_template.jinja").symlink_to(tmp_path / "deleted-blob")
    tokenizer = load_hf_tokenizer(model, 320)
    assert list(tokenizer.chat_template) == ["tool"]
