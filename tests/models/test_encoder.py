"""The from-scratch sentence encoder against transformers' BertModel and sentence-transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from asyncinfer import ModelLoadError
from asyncinfer.models.encoder import is_encoder_dir, load_encoder, parameter_name, read_encoder_config
from tests.helpers import save_tiny_bert

SENTENCES = [
    "The cat sat on the mat.",
    "A man is playing a guitar on stage.",
    "hello world",
    "Stocks fell sharply after the central bank raised interest rates.",
    "Ünïcödé, 文字 and emoji 🙂 in one sentence",
    "x",
    "",
    "How do I reset my password?",
    "   leading and trailing spaces   ",
    "word " * 400,  # longer than max_seq_len (256): truncated, as sentence-transformers does
]

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory):
    """A random 2-layer BERT saved as a sentence-transformers directory, and transformers' model."""
    path = tmp_path_factory.mktemp("tiny-bert")
    return path, save_tiny_bert(path, VOCAB, pooling_layer=True)


def _hf_states(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


def _batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(map(len, rows))
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def test_token_states_match_transformers_bert_with_padding(tiny_bert) -> None:
    path, hf = tiny_bert
    enc = load_encoder(path, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    rows = [[2, *torch.randint(5, len(VOCAB), (n,), generator=g).tolist(), 3] for n in (3, 17, 40, 1)]
    ids, mask = _batch(rows)
    ours = enc.model.token_states(ids, mask)
    ref = _hf_states(hf, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
@pytest.mark.parametrize("form", ["keys", "sentence-transformers"])
def test_pooling_modes_match_a_manual_pooling_of_transformers_states(tiny_bert, tmp_path, pooling, form) -> None:
    """Both forms of the Pooling module's config: a boolean key a mode, and the ``pooling_mode`` the installed
    sentence-transformers writes (stranger70: an encoder it saved was refused, "got []")."""
    src, hf = tiny_bert
    path = tmp_path / "st"
    shutil.copytree(src, path)
    (path / "1_Pooling").mkdir()
    keys = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens"}
    if form == "keys":
        pool = {k: k == keys[pooling] for k in keys.values()}
    else:
        from sentence_transformers.models import Pooling

        pool = Pooling(hf.config.hidden_size, pooling_mode=pooling).get_config_dict()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    enc = load_encoder(path, torch.float32, "cpu")
    assert enc.config.pooling == pooling and enc.config.normalize
    rows = [[2, 7, 8, 9, 3], [2, 10, 3], [2, *range(5, 30), 3]]
    ids, mask = _batch(rows)
    states = _hf_states(hf, ids, mask)
    ref = []
    for i, r in enumerate(rows):
        s = states[i, : len(r)]
        ref.append({"mean": s.mean(0), "cls": s[0], "max": s.amax(0)}[pooling])
    expected = F.normalize(torch.stack(ref), dim=-1)
    torch.testing.assert_close(enc.encode_ids(rows), expected, atol=1e-5, rtol=1e-5)


def test_plain_bert_dir_defaults_to_mean_pooling_normalised(tiny_bert) -> None:
    cfg = read_encoder_config(tiny_bert[0])
    assert (cfg.pooling, cfg.normalize, cfg.max_seq_len) == ("mean", True, 64)
    assert is_encoder_dir(tiny_bert[0])


def test_parameter_count_matches_the_loaded_module(tiny_bert) -> None:
    path, hf = tiny_bert
    enc = load_encoder(path, torch.float32, "cpu")
    # transformers' BertModel, less the pooler the sentence encoder does not use.
    reference = sum(p.numel() for name, p in hf.named_parameters() if not name.startswith("pooler."))
    assert enc.config.num_params == sum(p.numel() for p in enc.model.parameters()) == reference
    assert enc.weight_bytes == reference * 4


@pytest.mark.parametrize(
    "case, message",
    [
        # encoder.layer.1.output.dense.weight is the encoder's layers.1.down.weight
        ("missing", r"lacks 1 encoder tensors, e\.g\. \['layers\.1\.down\.weight'\]"),
        ("unexpected", r"unexpected tensor 'encoder\.layer\.0\.attention\.self\.rotary\.weight'"),
        ("no place", r"tensor 'encoder\.layer\.2\.output\.dense\.weight' has no place"),  # 2 layers: 0 and 1
        ("shape", r"tensor 'embeddings\.word_embeddings\.weight' has shape \(3, 32\), the encoder expects \(64, 32\)"),
    ],
)
def test_missing_and_unexpected_tensors_are_refused_by_name(tiny_bert, tmp_path, case: str, message: str) -> None:
    src = tiny_bert[0]
    broken = load_file(src / "model.safetensors")
    if case == "missing":
        del broken["encoder.layer.1.output.dense.weight"]
    elif case == "unexpected":
        broken["encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(2)
    elif case == "no place":
        broken["encoder.layer.2.output.dense.weight"] = broken["encoder.layer.1.output.dense.weight"].clone()
    else:
        broken["embeddings.word_embeddings.weight"] = torch.zeros(3, 32)
    path = tmp_path / "broken"
    shutil.copytree(src, path)
    save_file(broken, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=message):
        load_encoder(path, torch.float32, "cpu")


def test_checkpoint_names_map_onto_the_encoder() -> None:
    assert parameter_name("bert.encoder.layer.3.attention.self.query.weight") == "layers.3.query.weight"
    assert parameter_name("encoder.layer.0.output.LayerNorm.bias") == "layers.0.out_norm.bias"
    assert parameter_name("pooler.dense.weight") is None
    assert parameter_name("embeddings.position_ids") is None
    with pytest.raises(ModelLoadError, match="unexpected tensor 'decoder.weight'"):
        parameter_name("decoder.weight")


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def st_reference(minilm_dir: Path):
    from sentence_transformers import SentenceTransformer  # a dev dependency: no silent skip

    model = SentenceTransformer(str(minilm_dir), device="cpu")
    return torch.tensor(model.encode(SENTENCES, normalize_embeddings=False, batch_size=4))


def test_minilm_matches_sentence_transformers(minilm_dir: Path, st_reference: torch.Tensor) -> None:
    enc = load_encoder(minilm_dir, torch.float32, "cpu")
    assert enc.config.max_seq_len == 256 and enc.dimension == 384
    ours = enc.encode(SENTENCES)
    cosine = F.cosine_similarity(ours, st_reference, dim=-1)
    assert cosine.min().item() >= 1 - 1e-5, cosine
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5, rtol=0)
    # One text at a time gives the same vectors as the padded batch.
    solo = torch.cat([enc.encode([s]) for s in SENTENCES])
    assert F.cosine_similarity(solo, st_reference, dim=-1).min().item() >= 1 - 1e-5
    # The truncated text read exactly max_seq_len tokens.
    assert len(enc.tokenize([SENTENCES[-1]])[0]) == 256


LEGACY_CASES = [{}, {"pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False},
                {"pooling_mode_mean_tokens": True, "pooling_mode_weightedmean_tokens": True},
                {"pooling_mode_cls_token": True, "pooling_mode_lasttoken": True},
                {"pooling_mode_lasttoken": True}, {"pooling_mode_mean_sqrt_len_tokens": 1},
                {"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}]


@pytest.mark.parametrize("legacy", LEGACY_CASES)
def test_the_earlier_pooling_keys_are_read_as_sentence_transformers_reads_them(tiny_bert, tmp_path, legacy) -> None:
    """pass78: two keys on (mean and weightedmean, whose vectors sentence-transformers joins side by side) loaded as
    mean alone, the keys it did not know ignored; all off (sentence-transformers' mean) was refused. The mode
    sentence-transformers makes of the keys is the one run, or the load is refused naming the keys."""
    import warnings

    from sentence_transformers.models import Pooling

    src, hf = tiny_bert
    path = tmp_path / "st"
    shutil.copytree(src, path)
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **legacy}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mode = Pooling(hf.config.hidden_size, **legacy).pooling_mode
    if mode in ("mean", "cls", "max"):
        assert read_encoder_config(path).pooling == mode
    else:
        on = " and ".join(key for key, value in legacy.items() if value)
        with pytest.raises(ModelLoadError, match=rf"config\.json: {on} on: pooling .* not supported: one of mean, "
                                                 r"cls, max$"):
            read_encoder_config(path)


def test_a_pooling_mode_it_does_not_run_is_refused_by_name(tiny_bert, tmp_path) -> None:
    src, _ = tiny_bert
    path = tmp_path / "st"
    shutil.copytree(src, path)
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 32, "pooling_mode": "lasttoken"}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    with pytest.raises(ModelLoadError, match=r"config\.json: pooling_mode 'lasttoken' is not supported: one of mean, "
                                             r"cls, max$"):
        load_encoder(path, torch.float32, "cpu")


def test_a_vocab_size_its_weights_do_not_hold_is_refused_before_the_tokenizer_is_built(tiny_bert, tmp_path,
                                                                                      monkeypatch) -> None:
    """The tokenizer's bounded build takes its bounds from vocab_size: config.json's 2**31 - 1 gave it 16 TiB and 25
    days of CPU before any weight was read (pass90). The word embeddings' rows are read from the headers first."""
    from asyncinfer.models import tokenizer_build
    from asyncinfer.models.encoder import load_encoder

    path = tmp_path / "wide"
    shutil.copytree(tiny_bert[0], path)
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] = 2**31 - 1
    (path / "config.json").write_text(json.dumps(config))

    def never(*args, **kwargs):
        raise AssertionError("the tokenizer was built")

    monkeypatch.setattr(tokenizer_build, "check_build", never)
    with pytest.raises(ModelLoadError, match=rf"^checkpoint tensor 'embeddings\.word_embeddings\.weight' has shape "
                                             rf"\(64, 32\), the encoder expects \({2**31 - 1}, 32\) \(config\.json's "
                                             rf"vocab_size and hidden_size\)$"):
        load_encoder(path, torch.float32, "cpu")
