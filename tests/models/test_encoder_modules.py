"""An encoder directory is read as sentence-transformers reads it (pass79, stranger72): a module it would apply to
every vector (Dense) is refused, not skipped; without modules.json a ``1_Pooling`` folder is not read; the length a
text is cut to is the tokenizer's ``model_max_length`` where ``sentence_bert_config.json`` sets none (version 6
saves it there); ``asyncinfer embed`` prints cosines whatever the vectors' length."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from asyncinfer import ModelLoadError, cli
from asyncinfer.models.encoder import load_encoder, read_encoder_config
from tests.helpers import save_tiny_bert

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *[f"w{i}" for i in range(60)]]
TEXTS = [" ".join(f"w{i % 60}" for i in range(100)), "w1 w2 w3"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-bert")
    save_tiny_bert(path, VOCAB)
    return path


def st_dir(src: Path, where: Path, modules: list[str], pooling: str = "mean") -> Path:
    """A copy of ``src`` with modules.json listing ``modules`` (sentence-transformers' types, by kind)."""
    shutil.copytree(src, where)
    folders = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    (where / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": folders[kind], "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(modules)]))
    (where / "1_Pooling").mkdir()
    (where / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 32, "pooling_mode": pooling}))
    return where


def st_vectors(path: Path) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SentenceTransformer(str(path), device="cpu")
    return torch.tensor(model.encode(TEXTS, batch_size=2))


def test_another_packages_module_of_a_known_name_is_refused(tiny_bert, tmp_path) -> None:
    """pass86: types were matched by their last name: my_pkg.Pooling passed as sentence-transformers' Pooling."""
    path = st_dir(tiny_bert, tmp_path / "st", ["Transformer", "Pooling"])
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps([modules[0], {**modules[1], "type": "my_pkg.Pooling"}]))
    with pytest.raises(ModelLoadError, match=r"module '1' of type 'my_pkg\.Pooling' is not supported"):
        read_encoder_config(path)


def test_a_dense_module_is_refused_not_skipped(tiny_bert, tmp_path) -> None:
    """pass79: LaBSE's layout (Pooling, Dense, Normalize) loaded with the Dense module skipped: vectors of the right
    size at a cosine of -0.02 to 0.14 from the model's."""
    path = st_dir(tiny_bert, tmp_path / "st", ["Transformer", "Pooling", "Dense", "Normalize"])
    with pytest.raises(ModelLoadError, match=r"modules\.json: module '2' of type 'sentence_transformers\.models\.Dense' "
                                             r"is not supported: asyncinfer runs Transformer, Pooling, Normalize "
                                             r"modules, and sentence-transformers would apply this one to every vector$"):
        read_encoder_config(path)


@pytest.mark.parametrize("modules", [["Transformer", "Normalize"], ["Transformer", "Pooling", "Pooling"],
                                     ["Transformer", "Normalize", "Pooling"], ["Pooling", "Transformer"]])
def test_modules_other_than_transformer_pooling_normalize_in_order_are_refused(tiny_bert, tmp_path, modules) -> None:
    """pass81: a Transformer alone (token vectors, no sentence's) was pooled by the mean; pass82: a second Pooling
    module (sentence-transformers' last decides) was skipped for the first, and a Normalize before the Pooling
    normalised the sentence's vector, which sentence-transformers leaves at its length."""
    path = st_dir(tiny_bert, tmp_path / "st", modules)
    with pytest.raises(ModelLoadError, match=rf"modules\.json lists the modules {', '.join(modules)}: asyncinfer "
                                             r"embeds sentences as Transformer, Pooling and optionally Normalize, in "
                                             r"that order$"):
        read_encoder_config(path)


def test_without_modules_json_a_pooling_folder_is_not_read(tiny_bert, tmp_path) -> None:
    """pass79: sentence-transformers pools a directory without modules.json by the mean; a 1_Pooling folder saying
    cls was followed (a cosine of 0.5-0.7 from sentence-transformers' vectors)."""
    path = st_dir(tiny_bert, tmp_path / "st", [], pooling="cls")
    (path / "modules.json").unlink()
    encoder = load_encoder(path, torch.float32, "cpu")
    assert encoder.config.pooling == "mean"
    cosine = F.cosine_similarity(encoder.encode(TEXTS), st_vectors(path), dim=-1)
    assert cosine.min().item() >= 1 - 1e-5, cosine


def test_without_modules_json_sentence_bert_config_is_not_read(tiny_bert, tmp_path) -> None:
    """pass80: without modules.json sentence-transformers builds a plain Transformer, which cuts texts at the
    tokenizer's limit; the encoder read sentence_bert_config.json's (a cosine of 0.89 on a text between the two)."""
    path = st_dir(tiny_bert, tmp_path / "st", [])
    (path / "modules.json").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 40}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    encoder = load_encoder(path, torch.float32, "cpu")
    assert encoder.config.max_seq_len == 40
    cosine = F.cosine_similarity(encoder.encode(TEXTS), st_vectors(path), dim=-1)
    assert cosine.min().item() >= 1 - 1e-5, cosine


def test_the_tokenizers_max_length_cuts_texts_where_sentence_bert_config_sets_none(tiny_bert, tmp_path) -> None:
    """stranger72: sentence-transformers 6 saves max_seq_length as the tokenizer's model_max_length; the encoder read
    the model's positions (64 here) and its vectors of texts past the limit drifted (cosine 0.997)."""
    path = st_dir(tiny_bert, tmp_path / "st", ["Transformer", "Pooling", "Normalize"])
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 16}))
    encoder = load_encoder(path, torch.float32, "cpu")
    assert encoder.config.max_seq_len == 16
    cosine = F.cosine_similarity(encoder.encode(TEXTS), st_vectors(path), dim=-1)
    assert cosine.min().item() >= 1 - 1e-5, cosine
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))  # set there: it wins
    assert read_encoder_config(path).max_seq_len == 32


def test_embed_prints_cosines_of_vectors_of_any_length(tiny_bert, tmp_path, capsys) -> None:
    """stranger72: without a Normalize module the printed "cosine similarity" was the dot product (38.95)."""
    path = st_dir(tiny_bert, tmp_path / "st", ["Transformer", "Pooling"])
    assert cli.main(["embed", "--model", str(path), "--threads", "1", *TEXTS]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "..." in line]
    values = [[float(x) for x in re.findall(r"[-+]?\d+\.\d+", row.split("...]")[1])] for row in rows]
    vectors = st_vectors(path)
    want = F.cosine_similarity(vectors[:, None], vectors[None], dim=-1)
    assert values[0][0] == values[1][1] == 1.0
    assert torch.allclose(torch.tensor(values), want, atol=0.006), (values, want)


def test_a_transformer_module_read_from_a_folder_or_two_modules_of_one_name_are_refused(tiny_bert, tmp_path) -> None:
    """pass83: sentence-transformers loads the Transformer from its module's path (the encoder read the directory's
    own weights: a cosine of -0.1 from sentence-transformers' vectors), and keeps the last of two modules of one name
    (the encoder served a directory sentence-transformers cannot run)."""
    path = st_dir(tiny_bert, tmp_path / "st", ["Transformer", "Pooling", "Normalize"])
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps([{**modules[0], "path": "0_Transformer"}, *modules[1:]]))
    with pytest.raises(ModelLoadError, match=r"modules\.json: the Transformer module reads from '0_Transformer': "
                                             r"asyncinfer reads the encoder from the directory itself"):
        read_encoder_config(path)
    (path / "modules.json").write_text(json.dumps([*modules[:2], {**modules[2], "name": "1"}]))
    with pytest.raises(ModelLoadError, match=r"modules\.json names two modules alike: \['0', '1', '1'\]$"):
        read_encoder_config(path)


def test_do_lower_case_lowercases_as_sentence_transformers_does(tmp_path) -> None:
    """pass84: sentence_bert_config.json's do_lower_case was not read, and a cased vocabulary's vectors differed from
    sentence-transformers' (cosine 0.92-0.95)."""
    cased = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Hello", "hello", "World", "world", "The", "the", "Cat", "cat"]
    src = tmp_path / "bert"
    src.mkdir()
    save_tiny_bert(src, cased)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "do_lower_case": False}))
    path = st_dir(src, tmp_path / "st", ["Transformer", "Pooling"])
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": True}))
    encoder = load_encoder(path, torch.float32, "cpu")
    texts = ["Hello World", "The Cat"]
    assert encoder.tokenize(texts) == encoder.tokenize([t.lower() for t in texts])
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = torch.tensor(SentenceTransformer(str(path), device="cpu").encode(texts))
    cosine = F.cosine_similarity(encoder.encode(texts), want, dim=-1)
    assert cosine.min().item() >= 1 - 1e-5, cosine
    (path / "sentence_bert_config.json").write_text(json.dumps({"do_lower_case": "yes"}))
    with pytest.raises(ModelLoadError, match=r"do_lower_case = 'yes' must be true or false$"):
        read_encoder_config(path)
