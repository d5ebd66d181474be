"""Random-weight GGUF files at real model shapes, for the loading and decoding benchmarks.

Writes a Llama- or Qwen2-shaped decoder with random weights (normal, std 0.02; norms 1) in one
tensor type for the projections, the embedding and the head: F16, Q8_0, Q4_0 or Q4_1 (what
``gguf.quants`` can write), with the ``gguf`` package's writer. Tensor by tensor and, inside a
tensor, a chunk of rows at a time: the float32 values of a whole tensor (let alone of the model)
never exist, so an 8B file is written in well under 1 GiB of memory.

    python benchmarks/make_gguf.py /tmp/llama-1b-q4_1.gguf --shape 1b --type q4_1
    python benchmarks/make_gguf.py /tmp/qwen-3b-q8_0.gguf --shape 3b --arch qwen2 --type q8_0
    python benchmarks/make_gguf.py /tmp/llama-8b-q4_0.gguf --shape 8b --type q4_0 --direct-blocks
    python benchmarks/make_gguf.py /tmp/mid.gguf --shape tiny --hidden 1024 --layers 8 --vocab none
    python benchmarks/make_gguf.py /tmp/llama-1b-q4_k_m.gguf --shape 1b --llama-quantize q4_k_m

``--llama-quantize FTYPE`` writes the model in F16 first (beside the output, removed afterwards) and has
llama.cpp's own quantizer (``llama_model_quantize`` from ``llama-cpp-python``) write the output in one of
its file types (``q4_k_m``, ``q5_k_m``, ``q6_k``, ``q8_0``, ``q4_0``, ...: :data:`LLAMA_FTYPES`), with the
mixes it chooses per tensor (a Q4_K_M file: most projections in Q4_K, half the v and down projections and
the head in Q6_K). Both engines then read the same bytes, as users' downloads have them.

Shapes (``--shape``; ``--hidden``, ``--layers``, ``--intermediate``, ``--heads``, ``--kv-heads`` and
``--vocab-size`` override any of them):

    tiny: hidden 256, 2 layers, intermediate 512, 8/4 heads, vocab 1024
    1b:   hidden 2048, 16 layers, intermediate 8192, 32/8 heads, vocab 32000  (1.1 B parameters)
    3b:   hidden 3072, 28 layers, intermediate 8192, 24/8 heads, vocab 128256 (Llama 3.2 3B's shape)
    8b:   hidden 4096, 32 layers, intermediate 14336, 32/8 heads, vocab 128256 (Llama 3.1 8B's shape)

``--vocab spm`` (default) writes a SentencePiece-style vocabulary (special tokens, the 256 byte
tokens, then filler pieces) so that tokenizers can be built from the file; ``--vocab none`` writes
no tokenizer metadata (the file then loads with no tokenizer, which is all a loading benchmark needs).
Qwen2 files carry q/k/v biases and an untied head like their models; Llama files an untied head.
``--head-type`` sets the embedding and head's type apart (llama.cpp's Q4 files keep them in Q8_0 or Q6_K).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

SHAPES = {
    "tiny": {"hidden": 256, "layers": 2, "intermediate": 512, "heads": 8, "kv_heads": 4, "vocab_size": 1024},
    "1b": {"hidden": 2048, "layers": 16, "intermediate": 8192, "heads": 32, "kv_heads": 8, "vocab_size": 32000},
    "3b": {"hidden": 3072, "layers": 28, "intermediate": 8192, "heads": 24, "kv_heads": 8, "vocab_size": 128256},
    "8b": {"hidden": 4096, "layers": 32, "intermediate": 14336, "heads": 32, "kv_heads": 8, "vocab_size": 128256},
}
TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_1")
#: llama.cpp's file types (``--llama-quantize``) -> its ``LLAMA_FTYPE_MOSTLY_*`` name.
LLAMA_FTYPES = {name: f"LLAMA_FTYPE_MOSTLY_{name.upper()}" for name in (
    "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")}
CHUNK_VALUES = 1 << 24  # float32 values made at once (64 MiB)


def tensors(shape: dict[str, int], arch: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape slowest-first)`` of every tensor, in the order llama.cpp's converter writes them."""
    h, f, v = shape["hidden"], shape["intermediate"], shape["vocab_size"]
    head_dim = h // shape["heads"]
    q, kv = shape["heads"] * head_dim, shape["kv_heads"] * head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (v, h))]
    for i in range(shape["layers"]):
        b = f"blk.{i}"
        out += [(f"{b}.attn_norm.weight", (h,)), (f"{b}.attn_q.weight", (q, h)), (f"{b}.attn_k.weight", (kv, h)),
                (f"{b}.attn_v.weight", (kv, h))]
        if arch == "qwen2":
            out += [(f"{b}.attn_q.bias", (q,)), (f"{b}.attn_k.bias", (kv,)), (f"{b}.attn_v.bias", (kv,))]
        out += [(f"{b}.attn_output.weight", (h, q)), (f"{b}.ffn_norm.weight", (h,)),
                (f"{b}.ffn_gate.weight", (f, h)), (f"{b}.ffn_up.weight", (f, h)), (f"{b}.ffn_down.weight", (h, f))]
    out += [("output_norm.weight", (h,)), ("output.weight", (v, h))]
    return out


def encode(rng: np.random.Generator, name: str, dims: tuple[int, ...], kind: str, direct: bool = False) -> np.ndarray:
    """The tensor's bytes as the file stores them: random values, quantised a chunk of rows at a time
    (``direct``: random blocks made as bytes, see :func:`random_blocks`)."""
    import gguf

    if len(dims) == 1:  # norms and biases: float32, as every converter writes them
        return (np.ones(dims, np.float32) if name.endswith("norm.weight")
                else rng.standard_normal(dims, np.float32) * np.float32(0.02))
    rows, cols = dims
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    if kind == "f16":
        out = np.empty((rows, cols), np.float16)
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        if direct and kind != "bf16":
            return random_blocks(rng, rows, cols // block, kind)
        out = np.empty((rows, cols // block * size), np.uint8)
    step = max(1, CHUNK_VALUES // cols)
    for start in range(0, rows, step):
        values = rng.standard_normal((min(step, rows - start), cols), np.float32)
        values *= np.float32(0.02)
        out[start : start + len(values)] = values if kind == "f16" else _quantize(values, kind, qtype)
    return out


def _quantize(values: np.ndarray, kind: str, qtype: object) -> np.ndarray:
    """ggml blocks of ``values`` [rows, cols]: gguf's own quantiser, or asyncinfer's for the k-quants (which gguf's
    Python package cannot quantise)."""
    import gguf

    if kind in ("q4_k", "q5_k", "q6_k"):
        import torch

        from asyncinfer import kernels

        return kernels.quantize(torch.from_numpy(values), kind).numpy()
    return gguf.quants.quantize(values, qtype)


def random_blocks(rng: np.random.Generator, rows: int, blocks: int, kind: str) -> np.ndarray:
    """Random Q8_0 / Q4_0 / Q4_1 blocks written as bytes (uniform quants, scale 0.002; Q4_1's minimum -0.015):
    random weights like the quantised ones, made 50x faster (for tests and the 8B shape)."""
    head = {"q8_0": 2, "q4_0": 2, "q4_1": 4}[kind]
    size = head + (32 if kind == "q8_0" else 16)
    out = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    if kind == "q8_0":
        quants = out[..., 2:]
        quants[quants == 128] = 129  # int8 -128 is no quant ggml writes
    out[..., 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    if kind == "q4_1":
        out[..., 2:4] = np.frombuffer(np.float16(-0.015).tobytes(), np.uint8)
    return out.reshape(rows, blocks * size)


def write(path: Path, shape: dict[str, int], arch: str, kind: str, head_kind: str, vocab: str, seed: int, *,
          direct: bool = False, block_count: int | None = None,
          layout: list[tuple[str, tuple[int, ...]]] | None = None, types: dict[str, str] | None = None) -> int:
    """Write the file; its size in bytes. ``direct``: random blocks made as bytes (:func:`random_blocks`).
    ``block_count`` and ``layout`` (the tensors, :func:`tensors`'s by default) may disagree with ``shape``:
    the tests write bad files with them. ``types``: tensor name -> its type, where it differs from ``kind``."""
    import gguf

    rng = np.random.default_rng(seed)
    h = shape["hidden"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"random {arch} {kind}")
    writer.add_context_length(4096)
    writer.add_embedding_length(h)
    writer.add_block_count(shape["layers"] if block_count is None else block_count)
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    writer.add_rope_dimension_count(h // shape["heads"])
    writer.add_vocab_size(shape["vocab_size"])
    if vocab == "spm":
        add_spm_vocab(writer, shape["vocab_size"])
    layout = tensors(shape, arch) if layout is None else layout
    kinds = {name: head_kind if name in ("token_embd.weight", "output.weight") else kind for name, _ in layout}
    kinds.update(types or {})
    for name, dims in layout:
        if len(dims) == 1:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
            continue
        qtype = gguf.GGMLQuantizationType[kinds[name].upper()]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        if kinds[name] == "f16":
            writer.add_tensor_info(name, dims, np.dtype(np.float16), 2 * dims[0] * dims[1])
        else:
            byte_shape = (dims[0], dims[1] // block * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                                   raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in layout:
        writer.write_tensor_data(encode(rng, name, dims, kinds[name], direct))
    writer.close()
    return path.stat().st_size


def _llama_cpp() -> object:
    """llama-cpp-python's module; SystemExit saying so when it does not import."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise SystemExit(f"--llama-quantize needs llama-cpp-python (pip install llama-cpp-python): {exc}") from None
    return llama_cpp


def llama_quantize(source: Path, out: Path, ftype: str, threads: int | None = None) -> int:
    """``source`` (an F16/F32 GGUF) quantized by llama.cpp's own quantizer into ``out`` as its file type ``ftype``
    (a key of :data:`LLAMA_FTYPES`); the output's size in bytes. SystemExit when llama-cpp-python is missing or
    the quantizer fails."""
    llama_cpp: Any = _llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMA_FTYPES[ftype])
    params.nthread = threads or 0  # 0: llama.cpp's own choice (the machine's threads)
    llama_cpp.llama_backend_init()
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({source} -> {out}, {ftype}) failed with {rc}")
    return out.stat().st_size


def add_spm_vocab(writer: object, size: int) -> None:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, the 256 byte tokens, then filler pieces."""
    import gguf

    if size < 259 + 1:
        raise SystemExit(f"--vocab spm needs a vocabulary of at least 260 tokens, got {size}")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"\u2581t{i}" for i in range(size - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (size - 259)
    writer.add_tokenizer_model("llama")  # type: ignore[attr-defined]
    writer.add_token_list(tokens)  # type: ignore[attr-defined]
    writer.add_token_scores([-float(i) for i in range(size)])  # type: ignore[attr-defined]
    writer.add_token_types([int(t) for t in types])  # type: ignore[attr-defined]
    writer.add_bos_token_id(1)  # type: ignore[attr-defined]
    writer.add_eos_token_id(2)  # type: ignore[attr-defined]
    writer.add_unk_token_id(0)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the .gguf file to write")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    p.add_argument("--type", dest="kind", choices=TYPES, default="q4_1", help="the projections' tensor type")
    p.add_argument("--head-type", choices=TYPES, default=None, help="the embedding and head's (default: --type)")
    p.add_argument("--vocab", choices=("spm", "none"), default="spm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-quantize", choices=sorted(LLAMA_FTYPES), default=None, metavar="FTYPE",
                   help=f"write F16, then quantize with llama.cpp's own quantizer to FTYPE ({', '.join(LLAMA_FTYPES)})")
    p.add_argument("--direct-blocks", action="store_true",
                   help="make Q8_0/Q4_0/Q4_1 blocks as random bytes instead of quantising random floats (50x faster)")
    for key in SHAPES["tiny"]:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"override the shape's {key}")
    args = p.parse_args(argv)
    given = {key: getattr(args, key) for key in SHAPES[args.shape]}
    shape = {key: value if given[key] is None else given[key] for key, value in SHAPES[args.shape].items()}
    for key, value in shape.items():
        if value <= 0:
            raise SystemExit(f"--{key.replace('_', '-')} must be positive, got {value}")
    if shape["hidden"] % shape["heads"] or shape["heads"] % shape["kv_heads"]:
        raise SystemExit("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    for name, value in (("hidden", shape["hidden"]), ("intermediate", shape["intermediate"])):
        if value % 32:
            raise SystemExit(f"--{name} must be a multiple of 32 (the block size), got {value}")
    params = sum(int(np.prod(dims)) for _, dims in tensors(shape, args.arch))
    if args.llama_quantize:
        _llama_cpp()  # before writing the F16 model (16 GB at the 8B shape)
        source = args.out.with_name(args.out.name + ".f16.tmp")
        try:
            write(source, shape, args.arch, "f16", "f16", args.vocab, args.seed)
            size = llama_quantize(source, args.out, args.llama_quantize)
        finally:
            source.unlink(missing_ok=True)
        print(f"wrote {args.out}: {args.arch} {shape}, llama.cpp {args.llama_quantize}, "
              f"{params / 1e9:.3f} B parameters, {size / 2**20:.1f} MiB")
        return 0
    size = write(args.out, shape, args.arch, args.kind, args.head_type or args.kind, args.vocab, args.seed,
                 direct=args.direct_blocks)
    print(f"wrote {args.out}: {args.arch} {shape}, {args.kind} (head {args.head_type or args.kind}), "
          f"{params / 1e9:.3f} B parameters, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
