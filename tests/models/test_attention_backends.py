"""The attention-backend seam: selection per device, registration, the model running through it, padding."""

from __future__ import annotations

import pytest
import torch

from asyncinfer.errors import InvalidParameterError
from asyncinfer.models import AttentionBackend, select_attention_backend
from asyncinfer.models.attention import available_attention_backends, base, register_attention_backend
from asyncinfer.models.attention.sdpa import KernelDecodeSdpaBackend, SdpaBackend
from asyncinfer.models.attention.triton_backend import TritonDecodeBackend
from tests.helpers import PagedRunner


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test stay in that test."""
    monkeypatch.setattr(base, "_REGISTERED", {})
    monkeypatch.setattr(base, "_DEVICE_DEFAULTS", {})


class CountingBackend(SdpaBackend):
    """SDPA, counting the layers it ran."""

    name = "counting"
    calls = 0

    def forward(self, q, k, v, kv_cache, meta, scale):
        type(self).calls += 1
        return super().forward(q, k, v, kv_cache, meta, scale)


class CudaOnlyBackend(SdpaBackend):
    name = "cuda-only"
    device_types = ("cuda",)


def test_sdpa_is_the_default_everywhere_and_triton_opt_in_on_cuda() -> None:
    assert type(select_attention_backend(torch.device("cpu"))) is SdpaBackend
    # Triton imports here (the dev extra) but is CUDA's only by name until a device run confirms it.
    assert type(select_attention_backend("cuda:1")) is SdpaBackend  # selecting touches no device
    assert type(select_attention_backend("cuda:1", "triton")) is TritonDecodeBackend
    assert type(select_attention_backend("cuda:1", "sdpa")) is SdpaBackend
    assert type(select_attention_backend("cpu", "sdpa")) is SdpaBackend
    assert "sdpa" in available_attention_backends()


def test_a_class_or_a_path_selects_too() -> None:
    assert type(select_attention_backend("cpu", CountingBackend)) is CountingBackend
    path = "asyncinfer.models.attention.sdpa:SdpaBackend"
    assert type(select_attention_backend("cpu", path)) is SdpaBackend


@pytest.mark.parametrize("name", ["flash", "no.such.module:Backend", "asyncinfer.models.attention.sdpa:Nope",
                                  "asyncinfer.models.attention.sdpa:SdpaMetadata", int])
def test_bad_names_are_refused_by_parameter(name) -> None:
    with pytest.raises(InvalidParameterError) as info:
        select_attention_backend("cpu", name)
    assert info.value.parameter == "attention_backend"


def test_a_backend_is_refused_on_a_device_it_does_not_run_on() -> None:
    with pytest.raises(InvalidParameterError, match="runs on 'cpu'"):
        select_attention_backend("cpu", CudaOnlyBackend)
    with pytest.raises(InvalidParameterError, match="default_for"):
        register_attention_backend(CudaOnlyBackend, default_for=("cpu",))


def test_registered_backend_by_name_and_as_a_device_default(clean_registry) -> None:
    register_attention_backend(CountingBackend)
    assert "counting" in available_attention_backends()
    assert type(select_attention_backend("cpu", "counting")) is CountingBackend
    assert type(select_attention_backend("cpu")) is SdpaBackend  # not the default until it says so
    register_attention_backend(CountingBackend, default_for=("cpu",))
    assert type(select_attention_backend("cpu")) is CountingBackend
    assert type(select_attention_backend("cuda")) is SdpaBackend  # CUDA keeps its own default
    register_attention_backend(TritonDecodeBackend, default_for=("cuda",))  # how to decode CUDA in Triton
    assert type(select_attention_backend("cuda")) is TritonDecodeBackend
    with pytest.raises(InvalidParameterError):
        register_attention_backend(object)  # type: ignore[arg-type]


def test_the_model_attends_only_through_its_backend(tiny_pair) -> None:
    """Every layer of every step goes through the backend the metadata carries, and the result is the same."""
    _, ours = tiny_pair("llama")
    prompt = list(range(3, 20))
    CountingBackend.calls = 0
    counted = PagedRunner(ours.model, backend=CountingBackend())
    plain = PagedRunner(ours.model)
    for step in ([(0, prompt)], [(0, [7])], [(0, [9])]):
        (a,), (b,) = counted.step(step), plain.step(step)
        assert torch.equal(a, b)
    assert CountingBackend.calls == 3 * ours.config.num_layers


@pytest.mark.parametrize(
    "contexts, block_size, padding",
    [
        ([], 16, 0),
        ([1], 16, 15),  # one decode still reads a whole block
        ([16, 16], 16, 0),
        ([5, 17, 30], 16, 27 + 15 + 2),  # all padded to 32 keys
        ([5, 17, 33], 16, 43 + 31 + 15),  # all padded to 48 keys
        ([5, 17, 30], 1, 25 + 13),  # blocks of one token: only the longest decode counts
    ],
)
def test_sdpa_decode_padding(contexts: list[int], block_size: int, padding: int) -> None:
    assert SdpaBackend.decode_padding(contexts, block_size) == padding
    backend = SdpaBackend()
    assert backend.decode_padding(contexts, block_size) == padding
    # ...which is what the batched decode call really computes: every row spans the mask's width.
    tables = [list(range(-(-c // block_size))) for c in contexts]
    meta = backend.build_metadata(query_lens=[1] * len(contexts), context_lens=contexts, block_tables=tables,
                                  slot_mapping=[c - 1 for c in contexts], block_size=block_size, device="cpu")
    assert meta.decode_mask.numel() - sum(contexts) == padding


def test_the_contract_is_abstract() -> None:
    with pytest.raises(TypeError):
        AttentionBackend()  # type: ignore[abstract]


def test_kernel_decode_metadata_holds_what_the_kernel_reads() -> None:
    """A step of decodes on asyncinfer's kernel gets its slots, context lengths and block tables from one
    tensor, with no masks; the same values as the general path (its tables padded to the widest table)."""
    lists = {"query_lens": [1, 1, 1], "context_lens": [5, 17, 1], "block_tables": [[7, 2], [3, 9, 4, 8, 1], [6]],
             "slot_mapping": [7 * 4 + 0, 8 * 4 + 0, 6 * 4 + 0], "block_size": 4, "device": "cpu"}
    general = SdpaBackend().build_metadata(**lists)
    native_backend = KernelDecodeSdpaBackend()
    assert isinstance(native_backend, SdpaBackend) and native_backend.decodes_in_kernel
    assert not SdpaBackend().decodes_in_kernel
    native = native_backend.build_metadata(**lists)
    assert native.decode_mask is None and native.decode_bias is None and native.num_decodes == 3
    assert native.slot_mapping.tolist() == general.slot_mapping.tolist()
    assert native.decode_context_lens.tolist() == [5, 17, 1]
    assert native.decode_block_tables.tolist() == [[7, 2, 0, 0, 0], [3, 9, 4, 8, 1], [6, 0, 0, 0, 0]]
    assert native.decode_block_tables.tolist() == general.block_tables.tolist()
    assert native.query_start_loc == general.query_start_loc and native.prefill_masks == []
    assert native.num_tokens == 3
    # A step with a prefill chunk takes the general path even on the kernel.
    mixed = native_backend.build_metadata(query_lens=[1, 3], context_lens=[5, 3], block_tables=[[7, 2], [1]],
                                          slot_mapping=[16, 4, 5, 6], block_size=4, device="cpu")
    assert mixed.num_decodes == 1 and len(mixed.prefill_masks) == 1
    with pytest.raises(InvalidParameterError, match="slot_mapping"):
        native_backend.build_metadata(**{**lists, "slot_mapping": [1, 2]})
