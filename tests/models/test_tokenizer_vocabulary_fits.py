"""A model directory's ``tokenizer.json`` of more tokens than the model embeds is refused before it is built
(pass70): the refusal came only once transformers had built it, and 600,000 added tokens in an 82 MB file took
25 s and 2 GB to be refused (a file at the 1 GiB limit some 20 GB: a swap to it could take the server down)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from asyncinfer import AsyncEngine, ModelLoadError
from asyncinfer.models.checkpoint import (
    MAX_VOCAB_BYTES_PER_TOKEN,
    MERGE_SPLIT_WORK,
    VOCABULARY_FILE_SLACK,
    _FieldsPastModel,
    _sentencepiece_pieces,
    load_hf_tokenizer,
)

VOCAB = 320  # tiny_models' vocab_size


def model_dir(tiny_models, where: Path, tokens: list[str], added: int = 0) -> Path:
    """tiny_models' llama weights beside a WordLevel tokenizer of ``tokens`` and ``added`` added tokens."""
    where.mkdir()
    src = tiny_models["llama"][0]
    for item in src.iterdir():
        (where / item.name).symlink_to(item)
    tokenizer = Tokenizer(WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(where / "tokenizer.json"))
    if added:
        data = json.loads((where / "tokenizer.json").read_text())
        data["added_tokens"] = [{"id": len(tokens) + i, "content": f"<x{i}>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True} for i in range(added)]
        (where / "tokenizer.json").write_text(json.dumps(data))
    (where / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return where


def weights_dir(tiny_models, where: Path, but: str | None = None) -> Path:
    """tiny_models' llama files (but ``but``) linked into ``where``, no tokenizer beside them."""
    where.mkdir()
    for item in tiny_models["llama"][0].iterdir():
        if item.name != but:
            (where / item.name).symlink_to(item)
    return where


@pytest.fixture
def never_built(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer was built before its size was checked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def words(n: int, width: int = 1) -> list[str]:
    return [f"w{i}".ljust(width, "x") for i in range(n)]


def test_a_tokenizer_within_the_vocabulary_loads(tiny_models, tmp_path) -> None:
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB - 20), added=20)
    assert len(load_hf_tokenizer(path, VOCAB)) == VOCAB


def test_added_tokens_past_the_vocabulary_are_refused_before_the_build(tiny_models, tmp_path, never_built) -> None:
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB), added=2_000)
    with pytest.raises(ModelLoadError) as refused:
        AsyncEngine.from_pretrained(path, dtype="float32", device="cpu", num_threads=1)
    assert str(refused.value).endswith(f"the tokenizer has {VOCAB + 2_000} tokens (counted in tokenizer.json, "
                                       f"tokenizer_config.json of {path}) but the model embeds only {VOCAB}: is it "
                                       "another model's tokenizer? Copy this model's own tokenizer files beside its "
                                       "config.json")


@pytest.mark.parametrize("where", ["added_tokens.json", "tokenizer_config.json"])
def test_tokens_added_by_the_other_files_count_too(tiny_models, tmp_path, never_built, where) -> None:
    """pass71: the count read tokenizer.json alone; 600,000 tokens in added_tokens.json were built (25 s, 1.7 GB)."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    added = {f"<y{i}>": VOCAB + i for i in range(10_000)}
    if where == "added_tokens.json":
        (path / where).write_text(json.dumps(added))
    else:
        decoder = {str(i): {"content": t, "special": True} for t, i in added.items()}
        (path / where).write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                              "added_tokens_decoder": decoder}))
    # added_tokens_decoder's ids past the vocabulary are refused first (pass84), its tokens counted otherwise
    said = (rf"^the tokenizer has {VOCAB + 10_000} tokens \(counted in .*{where}" if where == "added_tokens.json" else
            rf"added_tokens_decoder holds the id '{VOCAB}', not one of the model's")
    with pytest.raises(ModelLoadError, match=said):
        load_hf_tokenizer(path, VOCAB)


def test_a_list_past_its_bytes_a_token_is_refused_before_it_is_decoded(tiny_models, tmp_path, never_built) -> None:
    """pass71: added_tokens were decoded whole, 6x the file's bytes, whatever the model's size."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    data = json.loads((path / "tokenizer.json").read_text())
    data["added_tokens"] = [{"id": 0, "content": "a"}] * 200_000
    (path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json's added_tokens takes \d+ bytes, more than "):
        load_hf_tokenizer(path, VOCAB)
    (path / "added_tokens.json").write_text(json.dumps({f"<z{i}>": i for i in range(100_000)}))
    data["added_tokens"] = []
    (path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=r"added_tokens\.json takes \d+ bytes, more than "):
        load_hf_tokenizer(path, VOCAB)


def test_a_vocabulary_past_its_bytes_a_token_is_refused_unread(tiny_models, tmp_path, never_built) -> None:
    bound = VOCAB * MAX_VOCAB_BYTES_PER_TOKEN + 2**20
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB // 2, width=bound // (VOCAB // 2) + 1))
    with pytest.raises(ModelLoadError, match=rf"tokenizer\.json's model\.vocab takes \d+ bytes, more than {bound} "):
        load_hf_tokenizer(path, VOCAB)


@pytest.mark.parametrize(("where", "key"), [("tokenizer_config.json", "additional_special_tokens"),
                                            ("tokenizer_config.json", "extra_special_tokens"),
                                            ("special_tokens_map.json", "additional_special_tokens")])
def test_special_tokens_count_too(tiny_models, tmp_path, never_built, where, key) -> None:
    """pass72: additional_special_tokens were counted nowhere: 80,000 of them took 30 s to be refused once built, and
    300,000 (a file of 3.6 MB) more than 300 s."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    tokens = [f"<s{i}>" for i in range(5_000)]
    value = {f"t{i}": t for i, t in enumerate(tokens)} if key == "extra_special_tokens" else tokens
    base = json.loads((path / where).read_text()) if (path / where).exists() else {}
    (path / where).write_text(json.dumps({**base, key: value}))
    with pytest.raises(ModelLoadError, match=rf"^the tokenizer has {VOCAB + 5_000} tokens \(counted in .*{where}"):
        load_hf_tokenizer(path, VOCAB)


def test_a_link_to_nothing_or_a_socket_beside_the_tokenizer_is_left_alone(tiny_models, tmp_path) -> None:
    """pass72: the check of every file beside the tokenizer refused a Hugging Face snapshot whose README blob was
    deleted (a link to nothing) and a lock socket, which transformers never reads and loads beside."""
    import socket

    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "README.md").symlink_to(tmp_path / "deleted-blob")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path / ".lock"))
        assert len(load_hf_tokenizer(path, VOCAB)) == VOCAB


@pytest.mark.parametrize(("where", "odd"), [("tokenizer_config.json", "NaN"), ("special_tokens_map.json", "-Infinity"),
                                            ("tokenizer_config.json", '"\\ud800"'), ("added_tokens.json", "NaN")])
def test_a_file_msgspec_refuses_but_transformers_reads_is_counted_too(tiny_models, tmp_path, never_built, where,
                                                                      odd) -> None:
    """pass73: a NaN, an Infinity or a lone surrogate's escape anywhere in the file made msgspec refuse it and the
    count skip it, while Python's json (transformers') read it: the build ran in full (80,000 special tokens: 38 s)."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    tokens = [f"<s{i}>" for i in range(5_000)]
    if where == "added_tokens.json":
        body = json.dumps({t: VOCAB + i for i, t in enumerate(tokens)})
    else:
        base = json.loads((path / where).read_text()) if (path / where).exists() else {}
        body = json.dumps({**base, "additional_special_tokens": tokens})
    (path / where).write_text(body[:-1] + f', "x": {odd}}}')
    counted = VOCAB + 5_000 + (where == "added_tokens.json")  # ("x" is a token's name there)
    with pytest.raises(ModelLoadError, match=rf"^the tokenizer has {counted} tokens "):
        load_hf_tokenizer(path, VOCAB)


def bert_dir(tiny_models, where: Path, lines: list[str]) -> Path:
    """tiny_models' llama weights beside a slow BertTokenizer's ``vocab.txt`` of ``lines`` (no tokenizer.json:
    transformers builds its tokenizer from the text file)."""
    where.mkdir()
    for item in tiny_models["llama"][0].iterdir():
        (where / item.name).symlink_to(item)
    (where / "vocab.txt").write_text("".join(f"{line}\n" for line in lines))
    (where / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    return where


def test_a_vocab_txt_within_the_vocabulary_loads(tiny_models, tmp_path) -> None:
    lines = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words(VOCAB - 5)]
    assert len(load_hf_tokenizer(bert_dir(tiny_models, tmp_path / "m", lines), VOCAB)) == VOCAB


def test_a_vocab_txt_past_the_vocabulary_is_refused_before_the_build(tiny_models, tmp_path, never_built) -> None:
    """pass74: vocab.txt was counted nowhere: one of 6,000,000 lines was built (7 s, 1.3 GB) before its size was
    refused, and one at the 1 GiB limit would take some 20 GB."""
    path = bert_dir(tiny_models, tmp_path / "m", ["[UNK]", *words(VOCAB + VOCABULARY_FILE_SLACK)])
    with pytest.raises(ModelLoadError, match=rf"^cannot load the tokenizer in .*: vocab\.txt holds "
                                             rf"{VOCAB + VOCABULARY_FILE_SLACK + 1} lines, more than the model's "
                                             rf"vocab_size {VOCAB} \(and {VOCABULARY_FILE_SLACK} more, for a header "
                                             rf"and special tokens\) allows: is it another model's\? Copy this "
                                             rf"model's own tokenizer files, or remove it$"):
        load_hf_tokenizer(path, VOCAB)


@pytest.mark.parametrize(("tokenizer_class", "name"), [("ProphetNetTokenizer", "prophetnet.tokenizer"),
                                                       ("PhobertTokenizer", "bpe.codes"),
                                                       ("BertJapaneseTokenizer", "vocab.txt")])
def test_the_files_a_slow_tokenizers_class_names_are_held_to_the_vocabulary(tiny_models, tmp_path, never_built,
                                                                            tokenizer_class, name) -> None:
    """pass75: the count knew the usual names alone: ProphetNet's prophetnet.tokenizer of 3,000,000 lines was built
    (8.6 s, 1.6 GB) before it was refused, PhoBERT's bpe.codes of 4,000,000 merges loaded; and BertJapanese reads its
    vocab.txt beside a tokenizer.json, where the count had taken the tokenizer.json to mean no slow file is read."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class}))
    (path / name).write_text("".join(f"t{i} x\n" for i in range(VOCAB + VOCABULARY_FILE_SLACK + 1)))
    with pytest.raises(ModelLoadError, match=rf": {re.escape(name)} holds {VOCAB + VOCABULARY_FILE_SLACK + 1} lines, "):
        load_hf_tokenizer(path, VOCAB)


def test_a_slow_tokenizers_class_comes_from_the_model_type_too(tiny_models, tmp_path, never_built) -> None:
    path = weights_dir(tiny_models, tmp_path / "m", but="config.json")
    config = json.loads((tiny_models["llama"][0] / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "prophetnet"}))
    (path / "tokenizer_config.json").write_text("{}")
    (path / "prophetnet.tokenizer").write_text("".join(f"t{i}\n" for i in range(VOCAB + VOCABULARY_FILE_SLACK + 1)))
    with pytest.raises(ModelLoadError, match=r": prophetnet\.tokenizer holds "):
        load_hf_tokenizer(path, VOCAB)


@pytest.mark.parametrize("name", ["merges.txt", "vocab.txt", "tokenizer.model", "spiece.model"])
def test_a_slow_tokenizers_file_past_its_bytes_a_token_is_refused_unread(tiny_models, tmp_path, never_built,
                                                                        name) -> None:
    """pass74: a merges.txt of 5,000,000 merges for a vocabulary of three tokens loaded (3.4 s, 950 MB): the slow
    tokenizers' files are held to the bytes a token the JSON lists are."""
    bound = VOCAB * MAX_VOCAB_BYTES_PER_TOKEN + 2**20
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    with (path / name).open("wb") as f:
        f.truncate(bound + 1)  # sparse: nothing is written
    with pytest.raises(ModelLoadError, match=rf": {name} takes {bound + 1} bytes, more than {bound} "):
        load_hf_tokenizer(path, VOCAB)


def sentencepiece_model(pieces: int, group: bool = False) -> bytes:
    """A SentencePiece ``ModelProto`` of ``pieces`` pieces, written by transformers' own protobuf schema (after an
    empty group of an unknown field, which protocol buffers readers skip, with ``group``)."""
    from transformers.utils import sentencepiece_model_pb2_new as schema

    model = schema.ModelProto()
    for i in range(pieces):
        piece = model.pieces.add()
        piece.piece, piece.score = f"\u2581p{i}", -float(i)
    model.trainer_spec.model_type, model.trainer_spec.vocab_size = 2, pieces
    model.normalizer_spec.name = "identity"
    return (bytes([0xA3, 0x06, 0xA4, 0x06]) if group else b"") + model.SerializeToString()  # field 100's start, end


def test_a_sentencepiece_models_pieces_are_counted() -> None:
    from asyncinfer.models.checkpoint import _sentencepiece_pieces

    assert _sentencepiece_pieces(sentencepiece_model(1_000), stop=10_000)[0] == 1_000
    assert _sentencepiece_pieces(sentencepiece_model(1_000, group=True), stop=10_000)[0] == 1_000  # pass75: was None
    assert _sentencepiece_pieces(sentencepiece_model(1_000), stop=300)[0] == 300  # no further than the bound needs
    assert _sentencepiece_pieces(sentencepiece_model(10)[:-3], stop=100) is None  # cut within a field


@pytest.mark.parametrize("name", ["tokenizer.model", "spiece.model", "sentencepiece.bpe.model"])
@pytest.mark.parametrize("group", [False, True])
def test_a_sentencepiece_model_past_the_vocabulary_is_refused_before_the_build(tiny_models, tmp_path, never_built,
                                                                               name, group) -> None:
    path = weights_dir(tiny_models, tmp_path / "m")
    too_many = VOCAB + VOCABULARY_FILE_SLACK + 1
    (path / name).write_bytes(sentencepiece_model(too_many, group))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(ModelLoadError, match=rf": {name} holds {too_many} SentencePiece pieces, more than "):
        load_hf_tokenizer(path, VOCAB)


def test_a_gpt2_vocab_json_past_the_vocabulary_is_refused_before_the_build(tiny_models, tmp_path, never_built) -> None:
    path = weights_dir(tiny_models, tmp_path / "m")
    (path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(words(VOCAB + VOCABULARY_FILE_SLACK + 1))}))
    (path / "merges.txt").write_text("#version: 0.2\n")
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    with pytest.raises(ModelLoadError, match=rf": vocab\.json holds {VOCAB + VOCABULARY_FILE_SLACK + 1} tokens, "):
        load_hf_tokenizer(path, VOCAB)


def test_slow_vocabularies_are_each_held_to_the_model_not_merged_into_the_count(tiny_models, tmp_path) -> None:
    """transformers builds one vocabulary, from tokenizer.json where there is one: a BERT directory whose
    tokenizer.json renamed a token (30,523 distinct tokens counted over both files, for 30,522 embedded) was refused,
    and so was a GPT-2 directory beside a stray vocab.txt (pass75)."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "vocab.txt").write_text("".join(f"{t}\n" for t in ["renamed", *words(VOCAB)[1:]]))
    (path / "vocab.json").write_text(json.dumps({f"other{i}": i for i in range(VOCAB)}))
    assert len(load_hf_tokenizer(path, VOCAB)) == VOCAB


@pytest.mark.parametrize("form", ["keys", "model_specific_special_tokens"])
def test_special_tokens_of_keys_of_their_own_count_too(tiny_models, tmp_path, never_built, form) -> None:
    """pass76: every ``*_token`` key of tokenizer_config.json (and ``model_specific_special_tokens``'s) is a special
    token of transformers': 50,000 of them were built in 20 s (100,000: 108 s) before their count was refused."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    keys = {f"k{i}_token": f"<t{i}>" for i in range(2_000)}
    body = keys if form == "keys" else {"model_specific_special_tokens": keys}
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **body}))
    with pytest.raises(ModelLoadError, match=rf"^the tokenizer has {VOCAB + 2_000} tokens "):
        load_hf_tokenizer(path, VOCAB)


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json with a NaN"])
def test_the_class_is_found_where_transformers_finds_it(tiny_models, tmp_path, never_built, where) -> None:
    """pass76: the class named by config.json's tokenizer_class, or by a tokenizer_config.json msgspec refuses (a NaN
    Python's json reads), was not looked up: its prophetnet.tokenizer of 1,500,000 lines was built (4.5 s, 1 GB)."""
    path = weights_dir(tiny_models, tmp_path / "m", but="config.json")
    config = json.loads((tiny_models["llama"][0] / "config.json").read_text())
    if where == "config.json":
        (path / "config.json").write_text(json.dumps({**config, "tokenizer_class": "ProphetNetTokenizer"}))
        (path / "tokenizer_config.json").write_text('{"tokenizer_class": null}')
    else:
        (path / "config.json").write_text(json.dumps(config))
        (path / "tokenizer_config.json").write_text('{"tokenizer_class": "ProphetNetTokenizer", "x": NaN}')
    (path / "prophetnet.tokenizer").write_text("".join(f"t{i}\n" for i in range(VOCAB + VOCABULARY_FILE_SLACK + 1)))
    with pytest.raises(ModelLoadError, match=r": prophetnet\.tokenizer holds "):
        load_hf_tokenizer(path, VOCAB)


def test_a_lone_carriage_return_ends_a_line_as_python_reads_it(tiny_models, tmp_path, never_built) -> None:
    """pass76: lines split by a lone \\r counted as one (bytes.count(b"\\n")), where the slow tokenizers' readlines
    split them: 150,000 of them were built."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ProphetNetTokenizer"}))
    lines = VOCAB + VOCABULARY_FILE_SLACK + 1
    (path / "prophetnet.tokenizer").write_bytes(b"\r".join(f"t{i}".encode() for i in range(lines)) + b"\r\n")
    with pytest.raises(ModelLoadError, match=rf": prophetnet\.tokenizer holds {lines} lines, "):
        load_hf_tokenizer(path, VOCAB)


def test_the_sentencepiece_walk_gives_up_past_a_models_fields() -> None:
    """pass76: 16 MB of one-byte empty groups took 8 s to walk; a model holds its pieces and a few fields more."""
    import time

    from asyncinfer.models.checkpoint import _sentencepiece_pieces

    start = time.perf_counter()
    with pytest.raises(_FieldsPastModel):  # refused by its caller: no model of 300 pieces has so many fields
        _sentencepiece_pieces(b"\x0b" * 2_000_000, stop=300)
    with pytest.raises(_FieldsPastModel):  # and within a normalizer spec, whose charsmap the walk looks for
        _sentencepiece_pieces(b"\x1a\x80\x89\x7a" + b"\x0b" * 2_000_000, stop=300)
    assert time.perf_counter() - start < 1.0


def test_a_class_name_that_is_no_tokenizer_is_left_to_transformers(tiny_models, tmp_path) -> None:
    """pass76: a tokenizer_class of AutoModel raised a bare AttributeError inside the count (no vocab_files_names)."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "AutoModel"}))
    with pytest.raises(ModelLoadError) as refused:
        load_hf_tokenizer(path, VOCAB)
    assert "vocab_files_names" not in str(refused.value)


@pytest.mark.parametrize("form", [list, dict.fromkeys])
@pytest.mark.parametrize("fault", ["charsmap", "tokens"])
def test_the_fast_tokenizer_file_transformers_picks_is_the_one_checked(tiny_models, tmp_path, never_built,
                                                                       fault, form) -> None:
    """pass77: tokenizer_config.json's fast_tokenizer_files makes transformers build from, say, tokenizer.4.0.json
    beside a harmless tokenizer.json, and the checks read tokenizer.json alone: a charsmap declaring 4 GiB aborted the
    process, and 2,000,000 tokens were built (4 s, 1.4 GB) before their refusal. pass78: given as a JSON object
    (whose keys transformers takes as the names), the file went unchecked and 300,000 tokens were built."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    data = json.loads((path / "tokenizer.json").read_text())
    if fault == "charsmap":
        data["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": "/////w=="}
        said = r"tokenizer\.4\.0\.json's Precompiled normalizer has a precompiled_charsmap of 4 bytes that declares"
    else:
        data["added_tokens"] = [{"id": VOCAB + i, "content": f"<x{i}>", "special": True} for i in range(1_000)]
        said = rf"^the tokenizer has {VOCAB + 1_000} tokens \(counted in tokenizer\.4\.0\.json, "
    (path / "tokenizer.4.0.json").write_text(json.dumps(data))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "fast_tokenizer_files": form(["tokenizer.4.0.json"])}))
    with pytest.raises(ModelLoadError, match=said):
        load_hf_tokenizer(path, VOCAB)


@pytest.mark.parametrize("form", [list, dict.fromkeys])
def test_a_fast_tokenizer_file_out_of_the_directory_is_refused(tiny_models, tmp_path, never_built, form) -> None:
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "tokenizer_config.json").write_text(json.dumps({"fast_tokenizer_files": form(["../tokenizer.4.0.json"])}))
    with pytest.raises(ModelLoadError, match=r"fast_tokenizer_files picks '\.\./tokenizer\.4\.0\.json', which is no "):
        load_hf_tokenizer(path, VOCAB)


def test_a_large_tokenizer_config_still_has_its_fast_tokenizer_file_checked(tiny_models, tmp_path, never_built) -> None:
    """pass78: past 64 MiB, tokenizer_config.json's fast_tokenizer_files went unread, so the file it named went
    unchecked, while a model of over 129,024 tokens lets its token lists (and so the config) take more: 300,000 tokens
    were built for a model of 150,000. Such a config is read for the name; one past what the model's token lists may
    take is refused before transformers reads it whole."""
    vocab = 150_000
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    data = json.loads((path / "tokenizer.json").read_text())
    data["added_tokens"] = [{"id": VOCAB + i, "content": f"<x{i}>", "special": True} for i in range(vocab)]
    (path / "tokenizer.4.0.json").write_text(json.dumps(data))
    config = json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "fast_tokenizer_files": ["tokenizer.4.0.json"]})
    (path / "tokenizer_config.json").write_text(config + " " * (65 * 2**20))
    with pytest.raises(ModelLoadError, match=rf"^the tokenizer has {VOCAB + vocab} tokens \(counted in "
                                             r"tokenizer\.4\.0\.json, "):
        load_hf_tokenizer(path, vocab)
    with pytest.raises(ModelLoadError, match=rf"tokenizer_config\.json is {len(config) + 65 * 2**20} bytes, more than "
                                             rf"the {64 * 2**20} that a tokenizer's settings for this model may take$"):
        load_hf_tokenizer(path, VOCAB)


def test_every_line_end_str_splitlines_knows_ends_a_line(tiny_models, tmp_path, never_built) -> None:
    """pass77: ESM's tokenizer reads vocab.txt with str.splitlines, which ends lines at \\x1c and more: 250,000
    tokens split by \\x1c counted one line and were built."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "EsmTokenizer"}))
    lines = VOCAB + VOCABULARY_FILE_SLACK + 1
    (path / "vocab.txt").write_text("\x1c".join(f"t{i}" for i in range(lines)), newline="")
    with pytest.raises(ModelLoadError, match=rf": vocab\.txt holds {lines} lines, "):
        load_hf_tokenizer(path, VOCAB)


def tekken_dir(tiny_models, where: Path, tokens: int, fillers: int | None = None) -> Path:
    """tiny_models' llama weights beside a Mistral tekken.json of the 256 bytes and ``tokens`` more, one special token
    and (``fillers``) a default_num_special_tokens; no tokenizer.json, so transformers builds from tekken.json."""
    path = model_dir(tiny_models, where, words(VOCAB))
    (path / "tokenizer.json").unlink()
    vocab = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode()} for i in range(256)]
    vocab += [{"rank": 256 + i, "token_bytes": base64.b64encode(i.to_bytes(3, "big")).decode()} for i in range(tokens)]
    config = {"pattern": r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+", "default_vocab_size": None}
    if fillers is not None:
        config["default_num_special_tokens"] = fillers
    (path / "tekken.json").write_text(json.dumps({"config": config, "vocab": vocab, "special_tokens": [
        {"rank": 0, "token_str": "<unk>", "is_control": True}]}))
    return path


def test_a_tekken_json_within_the_vocabulary_loads(tiny_models, tmp_path) -> None:
    tokenizer = load_hf_tokenizer(tekken_dir(tiny_models, tmp_path / "m", 10, fillers=4), VOCAB)
    assert tokenizer is not None and len(tokenizer) == 256 + 10 + 4


@pytest.mark.parametrize(("tokens", "fillers"), [(0, 1_000_000), (VOCAB, None)])
def test_a_tekken_json_past_the_vocabulary_is_refused_before_the_build(tiny_models, tmp_path, never_built, tokens,
                                                                      fillers) -> None:
    """pass79: where the fast tokenizer's file is missing, transformers builds from a tekken.json it finds, which no
    check read: its default_num_special_tokens of 1,000,000 (a file of 10 KB) were built in 27 s and 1.9 GB, and more
    aborted the process."""
    path = tekken_dir(tiny_models, tmp_path / "m", tokens, fillers)
    want = 256 + tokens + (fillers or 1)
    with pytest.raises(ModelLoadError, match=rf"tekken\.json holds {want} tokens \(its vocabulary and special tokens\), "
                                             rf"more than the model's vocab_size {VOCAB} \(and {VOCABULARY_FILE_SLACK} more"):
        load_hf_tokenizer(path, VOCAB)


@pytest.mark.parametrize("name", ["tiktoken.model", "tokenizer.model."])
def test_the_other_files_transformers_falls_back_to_are_held_to_the_vocabulary(tiny_models, tmp_path, never_built,
                                                                              name) -> None:
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    lines = VOCAB + VOCABULARY_FILE_SLACK + 1
    (path / name).write_text("".join(f"{base64.b64encode(str(i).encode()).decode()} {i}\n" for i in range(lines)))
    with pytest.raises(ModelLoadError, match=rf"{re.escape(name)} holds {lines} lines, more than"):
        load_hf_tokenizer(path, VOCAB)


def test_a_tekken_json_whose_merges_would_take_the_square_of_its_lengths_is_refused(tiny_models, tmp_path,
                                                                                   never_built) -> None:
    """pass80: transformers derives a tekken.json's merges by splitting each token at every byte: the tokens a, aa,
    ... up to 1,200 a's (a file of 1 MB, far within the count) took 35 s and 3 GiB. The sum of the squared lengths
    is held to MERGE_SPLIT_WORK a token of the model's vocabulary."""
    path = tekken_dir(tiny_models, tmp_path / "m", 0, fillers=4)
    data = json.loads((path / "tekken.json").read_text())
    longest = 100  # 256 + 99 tokens, within the count of 320 + 256; squares ~ 100**3 / 3 > 320 * 1024
    data["vocab"] += [{"rank": 255 + n, "token_bytes": base64.b64encode(b"a" * n).decode()} for n in range(2, longest + 1)]
    (path / "tekken.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=rf"tekken\.json's tokens' byte lengths, squared, sum to \d+, more than "
                                             rf"{VOCAB * MERGE_SPLIT_WORK} \({MERGE_SPLIT_WORK} a token of the model's "
                                             rf"vocab_size {VOCAB}\): transformers derives a tokenizer's merges from such a vocabulary by "):
        load_hf_tokenizer(path, VOCAB)


@pytest.mark.parametrize("name", ["tokenizer.model", "tiktoken.model"])
def test_a_sentencepiece_or_tiktoken_file_whose_merges_would_take_the_square_of_its_lengths_is_refused(
        tiny_models, tmp_path, never_built, name) -> None:
    """pass81: transformers derives the merges of a SentencePiece BPE model and of a tiktoken file as it does a
    tekken.json's: the pieces a, aa, ... up to 1,200 a's (736 KB) took 6.9 s and 1.7 GB with sentencepiece installed,
    the same tiktoken.model 48 s and 2.4 GB."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "tokenizer.json").unlink()
    runs = [b"a" * k for k in range(1, 121)]  # 120 tokens, within the count; squares ~ 120**3 / 3 > 320 * 1024
    if name == "tokenizer.model":
        from transformers.utils import sentencepiece_model_pb2_new as schema

        model = schema.ModelProto()
        for run in runs:
            piece = model.pieces.add()
            piece.piece, piece.score = run.decode(), 0.0
        model.trainer_spec.model_type, model.trainer_spec.vocab_size = 2, len(runs)
        (path / name).write_bytes(model.SerializeToString())
        pieces, squares, _ = _sentencepiece_pieces(model.SerializeToString(), stop=1_000)
        assert pieces == 120 and squares >= sum(len(r) ** 2 for r in runs)  # each piece's whole entry: its text and more
    else:
        (path / name).write_text("".join(f"{base64.b64encode(run).decode()} {i}\n" for i, run in enumerate(runs)))
    with pytest.raises(ModelLoadError, match=rf"{re.escape(name)}'s tokens' byte lengths, squared, sum to \d+, more than "
                                             rf"{VOCAB * MERGE_SPLIT_WORK} "):
        load_hf_tokenizer(path, VOCAB)


def test_a_sentencepiece_piece_whose_text_is_written_twice_is_held_by_its_longer(tiny_models, tmp_path,
                                                                                never_built) -> None:
    """pass82: each piece written as a one-byte text, then its long one (protobuf keeps the last): the squares were
    summed over the first, and a 403 KB file was built in 11 s and 1.3 GB for a model of 32,000 tokens."""
    def varint(n: int) -> bytes:
        return bytes([n]) if n < 0x80 else bytes([n & 0x7F | 0x80, n >> 7])

    entries = b""
    for k in range(1, 121):
        inner = b"\x0a\x01a" + b"\x0a" + varint(k) + b"a" * k + b"\x15\x00\x00\x00\x00"
        entries += b"\x0a" + varint(len(inner)) + inner
    assert _sentencepiece_pieces(entries, stop=1_000)[1] >= sum(k * k for k in range(1, 121))
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "tokenizer.json").unlink()
    (path / "tokenizer.model").write_bytes(entries)
    with pytest.raises(ModelLoadError, match=r"tokenizer\.model's tokens' byte lengths, squared, sum to \d+, more than "):
        load_hf_tokenizer(path, VOCAB)


@pytest.mark.parametrize("values", [int, str])
@pytest.mark.parametrize("fault", ["count", "squares"])
def test_a_vocab_given_in_tokenizer_config_is_counted_and_held(tiny_models, tmp_path, never_built, fault,
                                                               values) -> None:
    """pass82: tokenizer_config.json's keys go to the tokenizer's class, and a GPT-2 class given a vocab and no merges
    derives them from it: 1,000 tokens were built for a model of 320, and a, aa, ... up to 1,200 a's (731 KB) took
    5.5 s and 1.7 GB."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "tokenizer.json").unlink()
    # pass86: values that are text (transformers splits the keys whatever the values) counted as one token
    vocab = {f"t{i}": i for i in range(VOCAB + 10)} if fault == "count" else {"a" * k: k - 1 for k in range(1, 121)}
    vocab = {token: values(i) if values is int else "x" for token, i in vocab.items()}
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", "vocab": vocab}))
    said = (rf"^the tokenizer has {VOCAB + 10} tokens \(counted in tokenizer_config\.json" if fault == "count" else
            r"tokenizer_config\.json's vocab's tokens' byte lengths, squared, sum to \d+, more than ")
    with pytest.raises(ModelLoadError, match=said):
        load_hf_tokenizer(path, VOCAB)


@pytest.mark.parametrize("trick", ["protobuf prefix", "unknown fields"])
def test_a_model_file_is_held_by_both_readings(tiny_models, tmp_path, never_built, trick) -> None:
    """pass83: a .model file was read as a SentencePiece model wherever the walk found a piece, else as lines: a
    tiktoken text behind two bytes of one empty piece (which tiktoken skips) counted 1 piece and was built, 1,200 a's
    in 42 s and 2.5 GB; a SentencePiece model behind 40,000 unknown fields gave the walk up, and the lines' reading
    let its merges abort the process."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "tokenizer.json").unlink()
    runs = [b"a" * k for k in range(1, 121)]
    if trick == "protobuf prefix":
        rest = b"\x00" + b"".join(base64.b64encode(run) + f" {i}\n".encode() for i, run in enumerate(runs))
        raw = b"\n\x00" + b"\x12" + bytes([len(rest) & 0x7F | 0x80, len(rest) >> 7 & 0x7F | 0x80, len(rest) >> 14]) + rest
        said = r"tokenizer\.model's tokens' byte lengths, squared, sum to \d+, more than "
    else:
        raw = b"\x98\x06\x20" * 40_000 + sentencepiece_model(10)
        said = r"tokenizer\.model holds more than \d+ fields, more than a SentencePiece model of the model's vocab_size has"
    (path / "tokenizer.model").write_bytes(raw)
    with pytest.raises(ModelLoadError, match=said):
        load_hf_tokenizer(path, VOCAB)


def test_an_added_token_id_past_the_vocabulary_is_refused(tiny_models, tmp_path, never_built) -> None:
    """pass84: a tiktoken file's conversion fills every id up to added_tokens_decoder's last with a placeholder: one
    entry of id 500,000 (a config of 120 bytes) built 500,001 tokens in 14 s and 1 GB, 3,000,000 aborted the process."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "added_tokens_decoder": {"500000": {"content": "<|x|>"}}}))
    with pytest.raises(ModelLoadError, match=rf"tokenizer_config\.json's added_tokens_decoder holds the id '500000', not "
                                             rf"one of the model's 0\.\.{VOCAB - 1} \(the tokenizer would make tokens up "):
        load_hf_tokenizer(path, VOCAB)


@pytest.mark.parametrize("name", ["tokenizer.model", "spiece.model"])
def test_a_sentencepiece_models_charsmap_is_checked_as_a_tokenizer_jsons(tiny_models, tmp_path, never_built,
                                                                        name) -> None:
    """pass85: a SentencePiece model's normalizer_spec.precompiled_charsmap goes to the same Precompiled normalizer
    without a tokenizer.json, unchecked: 0xFFFFFFFF declared, 8 GiB asked and the process aborted (a serving engine
    swapping to it too). pass85 (b): an added_tokens_decoder key of a digit that is no ASCII one raised a bare
    ValueError."""
    from transformers.utils import sentencepiece_model_pb2_new as schema

    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "tokenizer.json").unlink()
    model = schema.ModelProto()
    for text in ("<unk>", "a", "b"):
        model.pieces.add().piece = text
    model.normalizer_spec.name = "nmt_nfkc"
    model.normalizer_spec.precompiled_charsmap = bytes.fromhex("ffffffff00000000")
    (path / name).write_bytes(model.SerializeToString())
    assert _sentencepiece_pieces(model.SerializeToString(), stop=100).charsmaps == (bytes.fromhex("ffffffff00000000"),)
    with pytest.raises(ModelLoadError, match=rf"{re.escape(name)}'s Precompiled normalizer has a precompiled_charsmap of 8 "
                                             r"bytes that declares a trie of 4294967295 bytes$"):
        load_hf_tokenizer(path, VOCAB)
    (path / name).unlink()
    (path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"\u00b2": {"content": "x"}}}))
    with pytest.raises(ModelLoadError, match=r"added_tokens_decoder holds the id '\u00b2', not one of the model's"):
        load_hf_tokenizer(path, VOCAB)


def test_a_gguf_file_named_in_tokenizer_config_is_refused(tiny_models, tmp_path, never_built) -> None:
    """pass87: transformers builds the tokenizer from tokenizer_config.json's gguf_file, a path it opens relative to
    the directory (.. included), with no check: 1,000,000 tokens of a GGUF outside the directory were built (8.5 s,
    1 GB) before their refusal."""
    path = model_dir(tiny_models, tmp_path / "m", words(VOCAB))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "gguf_file": "../big.gguf"}))
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json names a gguf_file \('\.\./big\.gguf'\): load the "
                                             r"GGUF file itself as the model"):
        load_hf_tokenizer(path, VOCAB)
