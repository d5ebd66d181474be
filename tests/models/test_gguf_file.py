"""The one-pass GGUF reader: metadata, tensor index and dequantised values equal gguf's own reader's."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from asyncinfer import ModelLoadError
from asyncinfer.models.gguf_file import GGUFFile

Q = gguf.GGMLQuantizationType


def _reference(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))


@pytest.fixture
def synthetic(tmp_path):
    """One tensor of each type the reader handles itself, plus one it hands to gguf (Q5_1), and every value type."""
    rng = np.random.default_rng(0)
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.u32", 7)
    writer.add_int64("test.i64", -5)
    writer.add_float32("test.f32", 0.5)
    writer.add_bool("test.flag", True)
    writer.add_string("test.text", "héllo")
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_array("test.words", ["a", "bc", ""])
    for name, qtype in (("q4_0", Q.Q4_0), ("q4_1", Q.Q4_1), ("q8_0", Q.Q8_0), ("q5_1", Q.Q5_1)):
        w = rng.standard_normal((8, 256), dtype=np.float32)
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.add_tensor("f16", rng.standard_normal((3, 5)).astype(np.float16))
    writer.add_tensor("f32", rng.standard_normal((4,)).astype(np.float32))
    bf16 = (rng.standard_normal((2, 6)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    writer.add_tensor("bf16", bf16.view(np.uint8), raw_dtype=Q.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_and_tensor_type_reads_as_gguf_reads_it(synthetic) -> None:
    ours, reference = GGUFFile(synthetic), gguf.GGUFReader(str(synthetic))
    assert ours.fields["test.u32"] == 7 and ours.fields["test.i64"] == -5 and ours.fields["test.f32"] == 0.5
    assert ours.fields["test.flag"] is True and ours.fields["test.text"] == "héllo"
    assert ours.fields["test.ints"] == [1, 2, 3] and ours.fields["test.words"] == ["a", "bc", ""]
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for tensor in ours.tensors:
        expected = _reference(reference, tensor.name).astype(np.float32)
        got = ours.dequantize(tensor).numpy()
        assert got.shape == expected.shape, tensor.name
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), tensor.name  # bit for bit


@pytest.mark.real_model
def test_the_default_model_reads_bit_identically(real_gguf) -> None:
    ours, reference = GGUFFile(real_gguf), gguf.GGUFReader(str(real_gguf))
    for key, field in reference.fields.items():
        if not key.startswith("GGUF."):
            assert ours.fields[key] == pytest.approx(field.contents()), key
    assert {t.type_name for t in ours.tensors} == {"Q4_1", "Q8_0", "F32"}
    for tensor in ours.tensors:
        got = ours.dequantize(tensor).numpy()
        assert np.array_equal(got.view(np.uint32), _reference(reference, tensor.name).view(np.uint32)), tensor.name


def test_bad_files_are_refused_with_the_reason(tmp_path, synthetic) -> None:
    (tmp_path / "text.gguf").write_bytes(b"definitely not a gguf file")
    with pytest.raises(ModelLoadError, match="bad magic"):
        GGUFFile(tmp_path / "text.gguf")
    data = synthetic.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])
    with pytest.raises(ModelLoadError, match="truncated|past the end"):
        GGUFFile(tmp_path / "cut.gguf")
    (tmp_path / "short.gguf").write_bytes(data[:-64])  # the header is whole, the last tensor is not
    with pytest.raises(ModelLoadError, match="past the end of the file"):
        GGUFFile(tmp_path / "short.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        GGUFFile(tmp_path / "empty.gguf")



@pytest.mark.parametrize("version", [1, 4, 9])
def test_a_gguf_version_other_than_2_or_3_is_refused_from_its_header(tmp_path, synthetic, capsys, version) -> None:
    """A later version's header is laid out as this reader cannot know (v1's counts are 32-bit): it was read as
    v3's, so `plan` and `info` planned a version-9 file and only the tokenizer's reader refused it at load."""
    from asyncinfer import cli

    data = bytearray(synthetic.read_bytes())
    data[4:8] = version.to_bytes(4, "little")
    path = tmp_path / f"v{version}.gguf"
    path.write_bytes(bytes(data))
    expected = f"cannot read GGUF file {path}: GGUF version {version} is not supported (this reader reads versions 2 and 3)"
    with pytest.raises(ModelLoadError) as refused:
        GGUFFile(path)
    assert str(refused.value) == expected
    for command in ("plan", "info"):
        assert cli.main([command, str(path)]) == 2
        assert capsys.readouterr().err == f"asyncinfer: error: {expected}\n"

def test_building_a_model_on_meta_neither_initialises_nor_imports_dynamo() -> None:
    """Random init on meta imports torch._dynamo (seconds); build_on_meta skips it, in its thread only."""
    code = (
        "import sys, torch\n"
        "from asyncinfer.models.meta import build_on_meta\n"
        "from tests.cache.test_memory import SMOLLM2\n"
        "m = build_on_meta(SMOLLM2)\n"
        "assert m.embed_tokens.weight.is_meta\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "torch.empty(3, device='meta').normal_()  # outside it, init runs as usual\n"
        "assert 'torch._dynamo' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=__file__.rsplit("/tests/", 1)[0])


def test_the_type_table_is_ggmls() -> None:
    """The reader's own table of ggml types (it parses a header without importing gguf) agrees with gguf's."""
    from asyncinfer.models.gguf_file import _GGML_TYPES, tensor_format

    for kind, (name, block, size) in _GGML_TYPES.items():
        assert Q(kind).name == name and gguf.GGML_QUANT_SIZES[Q(kind)] == (block, size), kind
    known = {int(k) for k in gguf.GGML_QUANT_SIZES}
    assert set(_GGML_TYPES) <= known and {int(Q[n]) for n in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "BF16")} <= set(_GGML_TYPES)
    assert tensor_format(int(Q.Q6_K)) == "q6_k" and tensor_format(int(Q.F16)) == "float16"
    assert tensor_format(9999) == "ggml type 9999"


def test_a_string_array_past_the_end_is_refused(tmp_path) -> None:
    path = tmp_path / "words.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.words", ["alpha", "beta", "gamma"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert GGUFFile(path).fields["test.words"] == ["alpha", "beta", "gamma"]
    data = bytearray(path.read_bytes())
    at = data.index(b"gamma") - 8  # the last string's length: now far past the end
    data[at:at + 8] = (10**6).to_bytes(8, "little")
    (tmp_path / "long.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="test.words.*past the end"):
        GGUFFile(tmp_path / "long.gguf")


def test_parsing_a_k_quant_header_imports_no_gguf(tmp_path) -> None:
    """A header of k-quant tensors is parsed and checked without the gguf package (~0.5 s of CPU to import)."""
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("q6", np.zeros((2, 210), dtype=np.uint8), raw_dtype=Q.Q6_K)  # two rows of one block
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code = (
        "import sys\n"
        "from asyncinfer.models.gguf_file import GGUFFile\n"
        f"(t,) = GGUFFile({str(path)!r}).tensors\n"
        "assert (t.format, t.type_name, t.nbytes) == ('q6_k', 'Q6_K', 2 * 210), (t.format, t.type_name, t.nbytes)\n"
        "assert 'gguf' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=__file__.rsplit("/tests/", 1)[0])
