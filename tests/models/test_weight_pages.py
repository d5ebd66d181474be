"""kernels.weight_buffer: the kernels' weight copies in transparent huge pages where Linux grants them
(asyncinfer.kernels.pages), and in plain memory where it does not; the same bytes either way."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncinfer import kernels
from asyncinfer.kernels import pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages and /proc are Linux's")


@pytest.fixture
def thp_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in for /sys/kernel/mm/transparent_hugepage/enabled; huge_pages() reads it afresh."""
    mode = tmp_path / "enabled"
    monkeypatch.setattr(pages, "_THP_ENABLED", mode)
    pages.huge_pages.cache_clear()
    yield mode
    pages.huge_pages.cache_clear()


def vm_flags(t: torch.Tensor) -> list[str]:
    """The VmFlags of the mapping holding t's first byte (/proc/self/smaps)."""
    addr = t.data_ptr()
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= addr < hi:
                flags = next(x for x in lines[i + 1:] if x.startswith("VmFlags:"))
                return flags.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize(("text", "expected"), [
    ("always [madvise] never\n", True),
    ("[always] madvise never\n", True),
    ("always madvise [never]\n", False),
])
def test_huge_pages_reads_the_kernel_s_mode(thp_mode: Path, text: str, expected: bool) -> None:
    thp_mode.write_text(text)
    assert pages.huge_pages() is expected


def test_huge_pages_is_false_without_the_file(thp_mode: Path) -> None:
    assert not thp_mode.exists()
    assert pages.huge_pages() is False


@linux
def test_a_buffer_asks_for_huge_pages_and_starts_on_one(thp_mode: Path) -> None:
    thp_mode.write_text("always [madvise] never\n")
    n = 3 * pages.HUGE_PAGE + 12345
    buf = kernels.weight_buffer(n)
    assert buf.dtype == torch.uint8 and buf.shape == (n,) and buf.is_contiguous()
    assert buf.data_ptr() % pages.HUGE_PAGE == 0
    assert "hg" in vm_flags(buf)  # MADV_HUGEPAGE took, on its whole huge pages
    assert "hg" in vm_flags(buf[3 * pages.HUGE_PAGE - 1:]) and "hg" not in vm_flags(buf[3 * pages.HUGE_PAGE:])
    buf.fill_(7)  # every byte is ours to write
    assert int(buf[-1]) == 7 and int(buf.sum()) == 7 * n


@linux
def test_without_huge_pages_or_below_one_a_buffer_is_plain_memory(thp_mode: Path) -> None:
    thp_mode.write_text("always madvise [never]\n")
    big = kernels.weight_buffer(3 * pages.HUGE_PAGE)
    assert big.shape == (3 * pages.HUGE_PAGE,) and "hg" not in vm_flags(big)
    thp_mode.write_text("always [madvise] never\n")
    pages.huge_pages.cache_clear()
    small = kernels.weight_buffer(pages.HUGE_PAGE - 1)
    assert small.shape == (pages.HUGE_PAGE - 1,) and "hg" not in vm_flags(small)
    assert kernels.weight_buffer(0).shape == (0,)


def test_a_negative_size_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        kernels.weight_buffer(-1)


@linux
@pytest.mark.parametrize("mode", ["always [madvise] never\n", "always madvise [never]\n"])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_pack_makes_its_copy_in_a_weight_buffer_with_the_same_bytes(thp_mode: Path, mode: str, fmt: str) -> None:
    """The regrouped formats' layout in huge pages where granted; unpack gives the ggml blocks back either way."""
    thp_mode.write_text(mode)
    w = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(3)) * 0.02  # 2.5 MiB of Q4_1 blocks
    blocks = kernels.quantize(w, fmt)
    packed = kernels.pack(blocks, fmt)
    assert packed.shape == blocks.shape and packed.dtype == torch.uint8
    assert ("hg" in vm_flags(packed)) == mode.startswith("always [madvise]")
    assert torch.equal(kernels.unpack(packed, fmt), blocks)
    assert torch.equal(kernels.gemm(w[:3], packed, fmt, 4096), kernels.gemm(w[:3], packed.clone(), fmt, 4096))


@linux
def test_pack_leaves_ggml_layout_blocks_in_place_and_copies_a_strided_view(thp_mode: Path) -> None:
    thp_mode.write_text("always [madvise] never\n")
    blocks = kernels.quantize(torch.randn(4096, 1024) * 0.02, "q4_0")  # 4096 x 576 bytes: 2.25 MiB
    assert kernels.pack(blocks, "q4_0").data_ptr() == blocks.data_ptr()
    view = torch.cat([blocks, blocks], dim=1)[:, 576:]  # the same blocks, not contiguous
    packed = kernels.pack(view, "q4_0")
    assert packed.is_contiguous() and torch.equal(packed, blocks) and "hg" in vm_flags(packed)


@linux
@pytest.mark.parametrize("mode", ["always [madvise] never\n", "always madvise [never]\n"])
def test_a_lone_gguf_tensor_leaves_the_map_for_huge_pages_where_granted(tmp_path: Path, thp_mode: Path,
                                                                         mode: str) -> None:
    """loader.off_the_map: a projection's blocks read from the file's map are copied into huge pages where Linux
    grants them (the same bytes), else used in place; blocks under one huge page, and formats the kernels copy
    themselves (Q4_1 / Q8_0 regrouped, Q4_0 / Q4_1 in lanes), stay in place either way."""
    import gguf

    from asyncinfer.models.gguf_file import GGUFFile
    from asyncinfer.models.loader import off_the_map

    thp_mode.write_text(mode)
    big = kernels.quantize(torch.randn(4096, 1024, generator=torch.Generator().manual_seed(5)) * 0.02, "q4_k")
    small = kernels.quantize(torch.randn(256, 256, generator=torch.Generator().manual_seed(6)) * 0.02, "q4_k")
    path = tmp_path / "w.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, blocks in (("big.weight", big), ("small.weight", small)):  # raw_shape: rows, bytes a row
        writer.add_tensor(name, blocks.numpy(), raw_shape=tuple(blocks.shape), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = GGUFFile(path)
    by_name = {t.name: t for t in reader.tensors}
    mapped = reader.blocks(by_name["big.weight"])
    assert big.numel() >= pages.HUGE_PAGE and torch.equal(mapped, big)
    held = off_the_map(mapped, "q4_k")
    granted = mode.startswith("always [madvise]")
    assert torch.equal(held, big) and (held.data_ptr() != mapped.data_ptr()) == granted
    assert ("hg" in vm_flags(held)) == granted
    lone = reader.blocks(by_name["small.weight"])
    assert off_the_map(lone, "q4_k").data_ptr() == lone.data_ptr()
    for repacked in ("q8_0", "q4_1", "q4_0"):  # regrouped by kernels.pack, or laid out in lanes: copied once, there
        assert off_the_map(mapped, repacked).data_ptr() == mapped.data_ptr()
