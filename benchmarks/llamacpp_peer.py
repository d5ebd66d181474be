"""llama.cpp as a peer in the throughput benchmark, through llama-cpp-python's low-level API.

Optional: used when ``import llama_cpp`` works (``pip install llama-cpp-python``, which
compiles llama.cpp). The same GGUF file asyncinfer loads is run by llama.cpp with its own
kernels for the file's quantization (Q4_1 for the default model), so its greedy tokens are
not expected to equal asyncinfer's fp32 ones; the benchmark reports the agreement anyway.

:class:`LlamaCppPeer` runs a workload the way llama.cpp's own parallel server does: up to
``n_parallel`` sequences share one context (one KV cache of ``n_parallel * n_ctx_per_seq``
cells); every step is one ``llama_decode`` over a batch holding the whole prompt of each
newly admitted sequence and one token of each running one; sequences are admitted as
others finish (continuous batching). Greedy sampling, EOS ignored, each request producing
exactly its own number of tokens, as in the asyncinfer and transformers runs.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


def available() -> str | None:
    """None when llama-cpp-python imports, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken shared library
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass
class _Seq:
    index: int  # the request's index in the workload
    length: int  # tokens to generate
    pos: int = 0  # next position in this sequence
    tokens: list[int] = field(default_factory=list)


class LlamaCppPeer:
    """One llama.cpp model and context for ``n_parallel`` sequences of up to ``n_ctx_per_seq`` tokens."""

    def __init__(self, gguf: Path, threads: int, n_parallel: int, n_ctx_per_seq: int, n_batch: int = 2048) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_silent_log, ctypes.c_void_p())
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_parallel * n_ctx_per_seq
        params.n_batch = n_batch
        params.n_ubatch = min(512, n_batch)
        params.n_seq_max = n_parallel
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_parallel, self.n_batch = n_parallel, n_batch
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.threads = threads

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def run(self, prompts: list[list[int]], lengths: list[int]) -> tuple[dict[int, list[int]], float, int]:
        """Every request at t=0 with at most ``n_parallel`` in flight: (tokens by index, wall seconds, steps)."""
        memory = self.lib.llama_get_memory(self.ctx)
        self.lib.llama_memory_clear(memory, True)
        pending = deque(range(len(prompts)))
        free = list(range(self.n_parallel))
        running: dict[int, _Seq] = {}
        done: dict[int, list[int]] = {}
        steps = 0
        start = time.perf_counter()
        while pending or running:
            entries: list[tuple[int, int, int, bool]] = []  # (token, pos, seq id, wants logits)
            for seq_id, seq in running.items():
                entries.append((seq.tokens[-1], seq.pos, seq_id, True))
            while pending and free and len(entries) + len(prompts[pending[0]]) <= self.n_batch:
                index = pending.popleft()
                seq_id = free.pop()
                prompt = prompts[index]
                entries += [(t, p, seq_id, p == len(prompt) - 1) for p, t in enumerate(prompt)]
                running[seq_id] = _Seq(index, lengths[index], pos=0)
            logits_rows = self._decode(entries)
            steps += 1
            for seq_id, row in logits_rows:
                seq = running[seq_id]
                seq.pos = seq.pos + 1 if seq.tokens else len(prompts[seq.index])
                seq.tokens.append(int(np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row),
                                                            shape=(self.n_vocab,)).argmax()))
                if len(seq.tokens) == seq.length:
                    done[seq.index] = seq.tokens
                    del running[seq_id]
                    self.lib.llama_memory_seq_rm(memory, seq_id, -1, -1)
                    free.append(seq_id)
        return done, time.perf_counter() - start, steps

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[tuple[int, int]]:
        """One llama_decode of ``entries``; returns (seq id, batch row) of the rows with logits."""
        b = self.batch
        rows = []
        for i, (token, pos, seq_id, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq_id
            b.logits[i] = logits
            if logits:
                rows.append((seq_id, i))
        b.n_tokens = len(entries)
        code = self.lib.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} for a batch of {len(entries)} tokens")
        return rows

    def single_decode_rate(self, prompt: list[int], new_tokens: int, repeats: int) -> dict[str, Any]:
        """Decode tok/s of one request, ``(n - 1) / (T(n) - T(1))`` (prefill cancelled out), medians."""
        def timed(n: int) -> float:
            return self.run([prompt], [n])[1]

        timed(4)  # warm-up
        t1 = statistics.median(timed(1) for _ in range(repeats))
        tn = statistics.median(timed(new_tokens) for _ in range(repeats))
        return {"t_1_s": t1, "t_n_s": tn, "decode_tokens_per_s": (new_tokens - 1) / (tn - t1)}


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _silent_log(level: int, text: bytes, user_data: Any) -> None:
    """llama.cpp's log callback: drop its load-time chatter."""
