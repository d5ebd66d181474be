"""A from-scratch BERT-family sentence encoder (e.g. all-MiniLM-L6-v2).

The layout is the one sentence-transformers saves: a Hugging Face ``BertModel``
directory (config.json, model.safetensors, tokenizer files), plus
``modules.json`` / ``1_Pooling/config.json`` / ``sentence_bert_config.json``
that say how token states become one sentence vector (mean, CLS or max pooling,
then optionally L2-normalised) and how many tokens the encoder reads.

A batch is right-padded to its longest text, but only the attention sees the
padded layout: the projections, the MLP and the norms, most of the work, run on
the real tokens alone, packed into one ``[tokens, hidden]`` matrix (texts of
mixed lengths waste no compute on padding). The attention mask keeps padding
out of the attention and the pooling, so a text's embedding does not depend on
what it was batched with (up to float rounding).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncinfer.errors import InvalidParameterError, ModelLoadError, native_panics_as
from asyncinfer.models.checkpoint import (
    iter_safetensors,
    load_hf_tokenizer,
    path_inside,
    read_json,
    safetensors_files,
    tensor_names,
    tensor_shape,
)
from asyncinfer.models.config import POSITIVE_FLOAT32, check_config_size, check_config_sizes, positive_float32

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ENCODER_ARCHITECTURES = ("bert",)
POOLING_MODES = ("mean", "cls", "max")
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class EncoderConfig:
    """Shape, numerics and pooling of a BERT-family sentence encoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pooling: str = "mean"
    normalize: bool = True
    max_seq_len: int = 512  # tokens read per text, [CLS] and [SEP] included; longer texts are truncated
    lower_case: bool = False  # sentence_bert_config.json's do_lower_case: texts lowercased before the tokenizer's own

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:  # num_heads=0: ZeroDivisionError
                raise ModelLoadError(f"encoder config: {name}={value!r} must be a positive int")
            if name != "num_layers":  # held to the layers the shards hold (load_encoder)
                check_config_size(name, value, "encoder config")
        if self.architecture not in ENCODER_ARCHITECTURES:
            raise ModelLoadError(f"unsupported encoder architecture {self.architecture!r}; supported: bert")
        if self.hidden_act not in _ACTIVATIONS:
            raise ModelLoadError(f"unsupported hidden_act {self.hidden_act!r}; supported: {sorted(_ACTIVATIONS)}")
        if not positive_float32(self.layer_norm_eps):  # a negative eps made every embedding NaN
            raise ModelLoadError(f"encoder config: layer_norm_eps={self.layer_norm_eps!r} must be {POSITIVE_FLOAT32}")
        if self.pooling not in POOLING_MODES:
            raise ModelLoadError(f"unsupported pooling {self.pooling!r}; supported: {', '.join(POOLING_MODES)}")
        if self.hidden_size % self.num_heads:
            raise ModelLoadError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if not 2 <= self.max_seq_len <= self.max_position_embeddings:
            raise ModelLoadError(
                f"max_seq_len {self.max_seq_len} is outside [2, max_position_embeddings={self.max_position_embeddings}]"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        """Parameters that are loaded (the unused pooler head is skipped)."""
        h, i = self.hidden_size, self.intermediate_size
        embeddings = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size) * h + 2 * h
        layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h
        return embeddings + self.num_layers * layer

    def activation_bytes(self, batch_size: int, seq_len: int, dtype_bytes: int) -> int:
        """Peak activation memory of one forward pass of ``batch_size`` texts of ``seq_len`` tokens
        (hidden states in and out, the MLP's inner states, one layer's attention scores)."""
        tokens = batch_size * seq_len
        hidden = 4 * tokens * self.hidden_size
        mlp = 2 * tokens * self.intermediate_size
        scores = 2 * batch_size * self.num_heads * seq_len * seq_len
        return (hidden + mlp + scores) * dtype_bytes


def is_encoder_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a BERT-family encoder (by its config.json)."""
    config_file = Path(path) / "config.json"
    try:
        raw = read_json(config_file)
    except ModelLoadError:  # absent, no regular file, too large or no JSON: the generator's load says which
        return False
    return isinstance(raw, dict) and raw.get("model_type") in ENCODER_ARCHITECTURES


def read_encoder_config(path: str | Path) -> EncoderConfig:
    """The encoder's config from config.json and the sentence-transformers files beside it.

    Every file is read as the shape sentence-transformers writes (a JSON object; ``modules.json`` a list of
    them) and every value as the type it holds there: anything else is a :class:`ModelLoadError` naming the
    file and the key. A module's ``path`` in ``modules.json`` must lead inside the directory (no ``..``, no
    absolute path): nothing outside it is opened.
    """
    path = Path(path)
    config_file = path / "config.json"
    raw = _json_object(config_file)
    check_config_sizes(raw, _ENCODER_SIZE_KEYS, str(config_file))  # before any is built from
    pooling, normalize = "mean", True
    modules = _modules(path)
    kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]  # a type's class name
    for module, kind in zip(modules, kinds, strict=True):  # what else sentence-transformers would apply to every vector
        # sentence-transformers' own classes only: another package's Pooling is that package's code
        if kind not in _MODULE_KINDS or not str(module.get("type", "")).startswith("sentence_transformers."):
            raise ModelLoadError(f"{path / 'modules.json'}: module {module.get('name', module.get('idx'))!r} of type "
                                 f"{module.get('type')!r} is not supported: asyncinfer runs "
                                 f"{', '.join(_MODULE_KINDS)} modules, and sentence-transformers would apply this "
                                 "one to every vector")
    if modules and kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        # sentence-transformers runs the modules in order: no Pooling gives the tokens' vectors, a second one
        # pools again, a Normalize before the Pooling leaves the sentence's vector at its length
        raise ModelLoadError(f"{path / 'modules.json'} lists the modules {', '.join(kinds)}: asyncinfer embeds "
                             "sentences as Transformer, Pooling and optionally Normalize, in that order")
    if modules and str(modules[0].get("path", "")) not in ("", "."):  # sentence-transformers loads it from there
        raise ModelLoadError(f"{path / 'modules.json'}: the Transformer module reads from {modules[0].get('path')!r}: "
                             "asyncinfer reads the encoder from the directory itself (a path of '')")
    names = [module.get("name") for module in modules]
    if len(set(map(str, names))) != len(names):  # sentence-transformers keeps the last module of a name
        raise ModelLoadError(f"{path / 'modules.json'} names two modules alike: {names}")
    pooling_file = _pooling_config_file(path, modules)
    if pooling_file is not None:
        pool = _json_object(pooling_file)
        if "pooling_mode" in pool:  # sentence-transformers 6's form: a mode's name (or a list of them)
            mode = pool["pooling_mode"]
            modes = mode if isinstance(mode, list) else [mode]
            if len(modes) != 1 or modes[0] not in POOLING_MODES:
                raise ModelLoadError(f"{pooling_file}: pooling_mode {mode!r} is not supported: one of "
                                     f"{', '.join(POOLING_MODES)}")
        else:  # the earlier form, read as sentence-transformers reads it: every mode whose key is on, mean if none
            modes = [m for key, m in _POOLING_KEYS.items() if pool.get(key)] or ["mean"]
            if len(modes) != 1 or modes[0] not in POOLING_MODES:
                keys = " and ".join(key for key, m in _POOLING_KEYS.items() if m in modes)
                what = (f"pooling {modes[0]!r} is" if len(modes) == 1 else
                        f"pooling {' + '.join(modes)} (the modes' vectors side by side, as sentence-transformers "
                        f"joins them) is")
                raise ModelLoadError(f"{pooling_file}: {keys} on: {what} not supported: one of "
                                     f"{', '.join(POOLING_MODES)}")
        pooling = modes[0]
        normalize = "Normalize" in kinds
    max_pos = _int(config_file, raw, "max_position_embeddings", 512)
    # sentence_bert_config.json is the Transformer module's config: read with modules.json, as sentence-transformers
    # reads it (without one it builds a plain Transformer)
    st_file = path / "sentence_bert_config.json"
    st = _json_object(st_file) if modules and st_file.exists() else {}
    given = _int_field(st_file, st, "max_seq_length", None)
    lower_case = st.get("do_lower_case", False)
    if not isinstance(lower_case, bool):
        raise ModelLoadError(f"{st_file}: do_lower_case = {lower_case!r} must be true or false")
    # none given there: the tokenizer's limit, as sentence-transformers takes it (version 6 saves it there)
    max_seq_len = given or min(max_pos, _tokenizer_max_length(path) or max_pos)
    missing = next((key for key in _ENCODER_REQUIRED_KEYS if key not in raw), None)
    if missing is not None:
        raise ModelLoadError(f"{config_file} lacks {missing!r}")
    return EncoderConfig(
        architecture=str(raw.get("model_type")),
        vocab_size=_int(config_file, raw, "vocab_size"),
        hidden_size=_int(config_file, raw, "hidden_size"),
        intermediate_size=_int(config_file, raw, "intermediate_size"),
        num_layers=_int(config_file, raw, "num_hidden_layers"),
        num_heads=_int(config_file, raw, "num_attention_heads"),
        max_position_embeddings=max_pos,
        type_vocab_size=_int(config_file, raw, "type_vocab_size", 2),
        layer_norm_eps=_float_field(config_file, raw, "layer_norm_eps", 1e-12),
        hidden_act=str(raw.get("hidden_act", "gelu")),
        pooling=pooling,
        normalize=normalize,
        max_seq_len=min(max_seq_len, max_pos),
        lower_case=lower_case,
    )


# config.json's sizes held to MAX_CONFIG_SIZE as it is read; num_hidden_layers is held to the layers the shards
# hold, a tighter bound, before any layer is built (load_encoder).
_ENCODER_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                      "max_position_embeddings", "type_vocab_size")
_ENCODER_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads")
#: The sentence-transformers modules the encoder runs (a module's type, past its package path).
_MODULE_KINDS = ("Transformer", "Pooling", "Normalize")
#: The earlier form's keys and the modes they turn on: every key sentence-transformers reads, in its order.
_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def _json_object(file: Path) -> dict[str, Any]:
    """``file`` read as the JSON object sentence-transformers and transformers write (ModelLoadError if not)."""
    data = read_json(file)
    if not isinstance(data, dict):
        raise ModelLoadError(f"cannot read {file}: a JSON object was expected, not a {type(data).__name__}")
    return data


def _int_field(file: Path, data: dict[str, Any], key: str, default: int | None = 0) -> int | None:
    """``data[key]`` as the int it holds (``default`` when absent or null); a value of another type (text, a
    fraction, a list) is a ModelLoadError naming the file and the key."""
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{file}: {key} = {_shown(value)} must be an integer")
    return value


def _int(file: Path, data: dict[str, Any], key: str, default: int = 0) -> int:
    """:func:`_int_field` of a key that is present (``_ENCODER_REQUIRED_KEYS``) or has a default."""
    value = _int_field(file, data, key, default)
    assert value is not None
    return value


def _float_field(file: Path, data: dict[str, Any], key: str, default: float) -> float:
    """``data[key]`` as a positive float32 (``default`` when absent or null): an eps of another type, or one that
    is not positive and finite in float32 (a negative one made every embedding NaN), is a ModelLoadError."""
    value = data.get(key)
    if value is None:
        return default
    if not positive_float32(value):
        raise ModelLoadError(f"{file}: {key} = {_shown(value)} must be {POSITIVE_FLOAT32}")
    return float(value)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _modules(path: Path) -> list[dict[str, Any]]:
    """``modules.json``'s modules (none when it is absent), each a JSON object whose ``type`` (if any) is a
    string; ModelLoadError naming the file otherwise."""
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return []
    modules = read_json(modules_file)
    if not isinstance(modules, list) or not all(
            isinstance(m, dict) and isinstance(m.get("type", ""), str) for m in modules):
        raise ModelLoadError(f"cannot read {modules_file}: a JSON list of modules (objects with a string 'type' "
                             "and 'path') was expected")
    return modules


def _pooling_config_file(path: Path, modules: list[dict[str, Any]]) -> Path | None:
    """The Pooling module's config file that ``modules.json`` names; None without one (sentence-transformers then
    pools by the mean, whatever a ``1_Pooling`` folder says)."""
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            folder = path_inside(path, path / "modules.json", module.get("path", ""), "the Pooling module's path")
            return folder / "config.json"
    return None


def _tokenizer_max_length(path: Path) -> int | None:
    """``tokenizer_config.json``'s ``model_max_length`` (the tokens the tokenizer truncates a text to) where it is a
    whole number of at least 2; None otherwise (transformers then takes no limit)."""
    file = path / "tokenizer_config.json"
    if not file.is_file():
        return None
    value = _json_object(file).get("model_max_length")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 2:
        return None
    return int(value)


# ---------------------------------------------------------------------------- the network


class _Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        x = x + self.token_type_embeddings.weight[0]  # single-segment input: token type 0 everywhere
        return self.LayerNorm(x)


class _Layer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(h, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, real: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``x``: the real tokens packed, ``[tokens, hidden]``; ``real``: ``[batch, seq]`` bool,
        where they sit in the padded layout; ``keep``: the attention mask, ``[batch, 1, 1, seq]``."""
        b, t = real.shape
        h = x.shape[-1]
        heads = self.num_heads

        def padded_heads(y: torch.Tensor) -> torch.Tensor:
            out = y.new_zeros(b, t, h)
            out[real] = y
            return out.view(b, t, heads, h // heads).transpose(1, 2)

        q, k, v = padded_heads(self.query(x)), padded_heads(self.key(x)), padded_heads(self.value(x))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        attn = attn.transpose(1, 2).reshape(b, t, h)[real]
        x = self.attn_norm(x + self.attn_out(attn))  # post-norm, as BERT
        return self.out_norm(x + self.down(self.act(self.up(x))))


class SentenceEncoder(nn.Module):
    """Token ids -> one pooled (and, if configured, unit-length) vector per text."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = _Embeddings(cfg)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))

    def token_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last-layer hidden states, ``[batch, seq, hidden]``; ``attention_mask`` is 1 on real tokens."""
        real = attention_mask.bool()
        keep = real[:, None, None, :]  # [b, 1, 1, t]: which keys each query may see
        x = self.embeddings(input_ids)[real]  # [tokens, hidden]: padding dropped
        for layer in self.layers:
            x = layer(x, real, keep)
        states = x.new_zeros(*real.shape, x.shape[-1])
        states[real] = x
        return states

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.token_states(input_ids, attention_mask)
        mask = attention_mask.to(states.dtype)[:, :, None]
        cfg = self.config
        if cfg.pooling == "mean":
            pooled = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        elif cfg.pooling == "cls":
            pooled = states[:, 0]
        else:  # max
            pooled = states.masked_fill(mask == 0, -math.inf).amax(dim=1)
        if cfg.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled


# Checkpoint names (after dropping a "bert." prefix) -> parameter names.
_LAYER_NAMES = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "out_norm",
}
_SKIPPED = ("pooler.", "embeddings.position_ids")


def parameter_name(checkpoint_name: str) -> str | None:
    """The :class:`SentenceEncoder` parameter a checkpoint tensor fills, or None for unused tensors."""
    name = checkpoint_name.removeprefix("bert.")
    if name.startswith(_SKIPPED) or name.startswith("cls."):
        return None
    if name.startswith("embeddings."):
        return name
    if name.startswith("encoder.layer."):
        index, rest = name.removeprefix("encoder.layer.").split(".", 1)
        module, leaf = rest.rsplit(".", 1)
        if module in _LAYER_NAMES:
            return f"layers.{index}.{_LAYER_NAMES[module]}.{leaf}"
    raise ModelLoadError(f"unexpected tensor {checkpoint_name!r} in the encoder checkpoint")


# ---------------------------------------------------------------------------- loading

#: The characters a token of a text to embed is first read with (:func:`read_part`), and how many
#: times that window is doubled at most: 16 to 512 characters a token (131,072 for a model of 256 tokens).
READ_CHARS_PER_TOKEN = 16
READ_WINDOWS = 6
#: A word's last character before a space: where a long text to embed may be cut without changing its first tokens.
_WORD_END = re.compile(r"\S(?= )")


#: Texts one tokenizer call is given (:func:`tokenize_texts`): a fast tokenizer encodes a batch with the GIL let go,
#: but makes its results Python objects holding it, in one call that no other thread can interrupt; 10,000 texts
#: held it 0.26 s (the event loop of an ``embed()`` call tokenized in a worker thread stalled as long). 64 texts
#: hold it about 2 ms.
TOKENIZE_CHUNK = 64


def tokenize_texts(tokenizer: Any, texts: list[str], max_len: int) -> list[list[int]]:
    """Token ids of each text, [CLS] ... [SEP], truncated to ``max_len`` tokens, each text read only as far as
    that reaches (:func:`read_part`); ``tokenizer`` is called on :data:`TOKENIZE_CHUNK` texts at a time, so a
    thread waiting for the GIL (the event loop) gets it between two calls.

    Raises:
        InvalidParameterError: on ``texts``, where the tokenizers library panics on them (a tokenizer file it
            cannot follow): its PanicException derives from ``BaseException`` only.
    """
    ids: list[list[int]] = []
    with native_panics_as(lambda exc: InvalidParameterError(
            "texts", f"<{len(texts)} texts its tokenizer panicked on: {exc}>", "texts this model's tokenizer can encode")):
        for start in range(0, len(texts), TOKENIZE_CHUNK):
            part = [read_part(tokenizer, text, max_len) for text in texts[start:start + TOKENIZE_CHUNK]]
            enc = tokenizer(part, truncation=True, max_length=max_len, add_special_tokens=True)
            ids.extend(list(row) for row in enc["input_ids"])
    return ids


def read_part(tokenizer: Any, text: str, max_len: int) -> str:
    """The start of ``text`` that an embedding of at most ``max_len`` tokens (``tokenizer``'s) reads: a prefix that
    ends where a word ends before a space (the tokenizers split words there, so its tokens are the whole text's
    first ones) and holds more than ``max_len`` tokens, so that the truncated tokens are those of the whole text.
    Looked for in windows of :data:`READ_CHARS_PER_TOKEN` characters a token, doubled up to :data:`READ_WINDOWS`
    times; a text that has no such prefix within them (one of mostly spaces, or with no space at all) is cut at
    the last window's last word end (or at the window, where it has none): what lies past it is not read, words
    included (a text of 200,000 spaces and then words embeds as an empty one). The tokenizer truncates only once
    it has tokenized the whole text: a text of 24 M characters took 44 s and 2.9 GB, 120 times its size."""
    window = READ_CHARS_PER_TOKEN * max_len
    for _ in range(READ_WINDOWS):
        if window >= len(text):
            return text
        end = None
        for end in _WORD_END.finditer(text, 0, window):  # the last one is wanted
            pass
        part = text[: end.end()] if end is not None else text[:window]
        if end is not None:
            ids = tokenizer(part, truncation=True, max_length=max_len + 1, add_special_tokens=True)["input_ids"]
            if len(ids) > max_len:  # cut by the truncation: the whole text's first tokens
                return part
        window *= 2
    return part


@dataclass
class LoadedEncoder:
    """What :func:`load_encoder` returns."""

    model: SentenceEncoder
    config: EncoderConfig
    tokenizer: PreTrainedTokenizerBase
    source: str  # "safetensors:<dir>"
    device: torch.device
    dtype: torch.dtype

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def dimension(self) -> int:
        return self.config.hidden_size

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text, [CLS] ... [SEP], truncated to ``config.max_seq_len`` tokens.

        A long text is tokenized only as far as its first ``max_seq_len`` tokens reach (:func:`read_part`): the
        tokenizer truncates only once it has tokenized the whole text, and a text of 24 M characters took 44 s of
        a worker thread and 2.9 GB (120 times the text: a few times that ended the process)."""
        batch = tokenize_texts(self.tokenizer, texts, self.config.max_seq_len)
        vocab = self.config.vocab_size
        for i, ids in enumerate(batch):  # a tokenizer file's ids may lie past its count, which the load checks
            if ids and not (0 <= min(ids) and max(ids) < vocab):
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise InvalidParameterError(f"texts[{i}]", f"<a text its tokenizer encodes with id {bad}>",
                                            f"a text whose tokens are ids of the encoder's vocabulary [0, {vocab - 1}]")
        return batch

    @torch.inference_mode()
    def encode_ids(self, batch: list[list[int]]) -> torch.Tensor:
        """Embeddings of already tokenized texts, ``[len(batch), dimension]`` float32 on the CPU."""
        longest = max(len(ids) for ids in batch)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        out = self.model(input_ids.to(self.device), mask.to(self.device))
        return out.float().cpu()

    def encode_each(self, batch: list[list[int]]) -> torch.Tensor:
        """As :meth:`encode_ids`, each text in a pass of its own, unpadded: a text's vector is then a function of
        the text alone, bit for bit (in one pass, the matrix products' blocking follows the batch's token count, and
        the attention's and the pooling's sums its longest text)."""
        return torch.cat([self.encode_ids([ids]) for ids in batch])

    def encode(self, texts: list[str]) -> torch.Tensor:
        """Tokenize and embed ``texts`` in one batch (no engine, no batching across calls)."""
        return self.encode_ids(self.tokenize(texts))


_LAYER = re.compile(r"(?:bert\.)?encoder\.layer\.(\d+)\.")  # a checkpoint tensor of layer N (parameter_name's)


def load_encoder(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> LoadedEncoder:
    """Load a sentence encoder from a sentence-transformers / Hugging Face BERT directory."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"an encoder model must be a directory with config.json and *.safetensors: {path}")
    device = torch.device(device)
    cfg = read_encoder_config(path)
    files = safetensors_files(path)
    # the tokenizer's bounds follow vocab_size: held to the word embeddings' rows first (from the headers alone), or
    # config.json's word sets them (2**31 - 1 gave a build 16 TiB and 25 days of CPU, before any weight was read)
    names = [name for name in tensor_names(files) if name.removeprefix("bert.") == "embeddings.word_embeddings.weight"]
    if not names:
        raise ModelLoadError(f"the checkpoint in {path} lacks the encoder's word embeddings "
                             "(embeddings.word_embeddings.weight)")
    shape = tuple(tensor_shape(files, names[0]) or ())
    if shape != (cfg.vocab_size, cfg.hidden_size):
        raise ModelLoadError(f"checkpoint tensor {names[0]!r} has shape {shape}, the encoder expects "
                             f"{(cfg.vocab_size, cfg.hidden_size)} (config.json's vocab_size and hidden_size)")
    tokenizer = load_hf_tokenizer(path, cfg.vocab_size)
    if tokenizer is None:
        raise ModelLoadError(f"no tokenizer files in {path}: an embedding model needs its tokenizer")
    if len(tokenizer) > cfg.vocab_size:
        raise ModelLoadError(f"the tokenizer has {len(tokenizer)} tokens but the encoder embeds only {cfg.vocab_size}")
    if cfg.lower_case and not tokenizer.is_fast:
        raise ModelLoadError(f"{path / 'sentence_bert_config.json'}: do_lower_case needs a fast tokenizer (a "
                             "tokenizer.json), whose normalizer takes the lowercasing")
    if cfg.lower_case:  # as sentence-transformers does: a Lowercase step before the tokenizer's own normalizer
        from tokenizers.normalizers import Lowercase
        from tokenizers.normalizers import Sequence as Normalizers

        backend = tokenizer.backend_tokenizer
        steps = list(backend.normalizer) if isinstance(backend.normalizer, Normalizers) else \
            [backend.normalizer] if backend.normalizer is not None else []
        if not any(isinstance(step, Lowercase) for step in steps):
            backend.normalizer = Normalizers([Lowercase(), *steps])
    # The layers are built one module each (on meta): a count the shards' headers do not hold is refused first
    # (config.json's num_hidden_layers of 10**10 built modules until the memory ran out).
    held = max((int(m.group(1)) + 1 for name in tensor_names(files) if (m := _LAYER.match(name))), default=0)
    if cfg.num_layers > held:
        raise ModelLoadError(f"{path / 'config.json'}: num_hidden_layers = {cfg.num_layers}, but its weights hold "
                             f"{held} layer(s)")
    with torch.device("meta"):
        model = SentenceEncoder(cfg)
    params = dict(model.named_parameters())
    filled: dict[str, torch.Tensor] = {}
    for ckpt_name, tensor in iter_safetensors(files):
        name = parameter_name(ckpt_name)
        if name is None:
            continue
        if name not in params:
            raise ModelLoadError(f"checkpoint tensor {ckpt_name!r} has no place in the encoder")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ModelLoadError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                f"the encoder expects {tuple(params[name].shape)}"
            )
        filled[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(params) - set(filled))
    if missing:
        raise ModelLoadError(f"the checkpoint in {path} lacks {len(missing)} encoder tensors, e.g. {missing[:4]}")
    model.load_state_dict(filled, assign=True)
    model.eval()
    return LoadedEncoder(model, cfg, tokenizer, f"safetensors:{path.resolve()}", device, dtype)
