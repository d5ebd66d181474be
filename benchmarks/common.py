"""Shared pieces of the benchmarks: model path, workload, reference model, statistics.

Nothing here runs a benchmark; ``throughput.py`` composes these helpers.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------- workload

#: Varied chat questions; the workload draws from them with a seeded generator.
#: Lengths differ on purpose (one line to a short paragraph) so prompts differ too.
QUESTIONS: tuple[str, ...] = (
    "What is the capital of Australia?",
    "Explain photosynthesis in simple words.",
    "Write a short poem about autumn leaves.",
    "How do I reverse a list in Python?",
    "What are three tips for sleeping better?",
    "Why is the sky blue?",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "What is the difference between weather and climate?",
    "Summarise the plot of a detective story in which the butler is innocent.",
    "How many legs does a spider have, and why?",
    "Suggest a name for a small bakery that sells mostly bread.",
    "Explain what a hash table is to a new programmer.",
    "What should I pack for a two-day hiking trip in the mountains?",
    "Translate 'good morning, how are you?' into French and explain each word.",
    "Write a friendly email asking a colleague to review my report by Friday.",
    "What causes the seasons on Earth?",
    "List five fruits that are high in vitamin C.",
    "How does a bicycle stay upright when it moves?",
    ("I keep forgetting to drink water during the day. Can you suggest a few habits "
     "that would help me remember, without needing an app?"),
    "Describe the water cycle step by step.",
    "What is a prime number? Give a few examples.",
    ("My tomato plants have yellow leaves at the bottom. What could be wrong, and "
     "what can I try this week to fix it?"),
    "Tell me a fun fact about octopuses.",
    "Explain the difference between a virus and a bacterium.",
    "How can I make my morning routine less rushed?",
    "Write a two-sentence horror story set in a library.",
    "What is the Pythagorean theorem used for in everyday life?",
    "Give me three ideas for a rainy-day activity with children aged six to eight.",
    "Why do we have leap years?",
    "What are the main parts of a computer and what does each do?",
    ("I am preparing a five-minute talk for my team about why code review matters. "
     "Can you outline the main points I should cover, in a sensible order?"),
    "How do bees make honey?",
    "What is the best way to learn a new language as an adult?",
    "Explain recursion with a simple example.",
    "Write a haiku about the sea at night.",
    "What are the benefits of walking every day?",
    "How does a refrigerator keep food cold?",
    "Compare trains and planes for a 500 km trip: cost, time and comfort.",
    "What is inflation, and why does it matter to savers?",
    "Give me a short motivational message for someone starting a new job.",
    ("Here is a sentence with a mistake: 'Their going to the park tomorrow.' "
     "Correct it and explain the rule so I remember it next time."),
    "Why do cats purr?",
    "What is the difference between a list and a tuple in Python?",
    "Plan a simple three-course dinner for four people on a small budget.",
    "How do noise-cancelling headphones work?",
    "Explain what DNS does when I type a web address into a browser.",
    "Describe a sunrise to someone who has never seen one.",
    "What is a black hole?",
)


@dataclass(frozen=True)
class Workload:
    """A fixed list of chat requests: prompt token ids and exact output lengths (all arrive at t=0)."""

    questions: tuple[str, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    max_new_tokens: tuple[int, ...]
    seed: int

    @property
    def num_requests(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompt_ids]

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.max_new_tokens)

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + output of any request."""
        return max(len(p) + n for p, n in zip(self.prompt_ids, self.max_new_tokens))

    def head(self, k: int) -> Workload:
        """The first ``k`` requests, in arrival order."""
        return Workload(self.questions[:k], self.prompt_ids[:k], self.max_new_tokens[:k], self.seed)

    def summary(self) -> dict[str, Any]:
        lens = self.prompt_lens
        return {
            "num_requests": self.num_requests,
            "seed": self.seed,
            "prompt_tokens_total": self.total_prompt_tokens,
            "prompt_tokens_min": min(lens),
            "prompt_tokens_mean": statistics.fmean(lens),
            "prompt_tokens_max": max(lens),
            "output_tokens_total": self.total_output_tokens,
            "output_tokens_min": min(self.max_new_tokens),
            "output_tokens_mean": statistics.fmean(self.max_new_tokens),
            "output_tokens_max": max(self.max_new_tokens),
        }


def render_chat_prompt(tokenizer: Any, question: str) -> list[int]:
    """Token ids of one user turn rendered with the tokenizer's chat template (assistant turn opened); a tokenizer
    without one (a random-weight file of ``make_gguf.py``) encodes the question as plain text, its BOS first."""
    if tokenizer.chat_template is None:
        return list(tokenizer(question)["input_ids"])
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    # The template already holds the special tokens; do not add a second BOS.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_workload(
    tokenizer: Any, num_requests: int, seed: int, min_new_tokens: int = 16, max_new_tokens: int = 256
) -> Workload:
    """Draw ``num_requests`` questions and output lengths (uniform integers in [min, max]) from ``seed``.

    Token ids are computed once here and handed to every system, so all see identical inputs.
    """
    if not 1 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"need 1 <= min_new_tokens ({min_new_tokens}) <= max_new_tokens ({max_new_tokens})")
    rng = random.Random(seed)
    questions = tuple(rng.choice(QUESTIONS) for _ in range(num_requests))
    lengths = tuple(rng.randint(min_new_tokens, max_new_tokens) for _ in range(num_requests))
    prompts = tuple(tuple(render_chat_prompt(tokenizer, q)) for q in questions)
    return Workload(questions, prompts, lengths, seed)


# --------------------------------------------------------------------------- model

def resolve_model_path(model: str | None) -> Path:
    """``--model`` if given, else asyncinfer's default model (fetched and cached on first use)."""
    if model:
        path = Path(os.path.expanduser(model))  # "~typo/x" left as typed (Path.expanduser raises)
        if not path.exists():
            raise SystemExit(f"--model {model!r} does not exist")
        return path
    try:
        from asyncinfer.model_source import default_model_path
    except ImportError as exc:  # the engine package is broken right now
        raise SystemExit(f"cannot import asyncinfer to find the default model ({exc}); pass --model") from exc
    return default_model_path()


def hf_load_args(path: Path) -> tuple[str, dict[str, Any]]:
    """``(directory, kwargs)`` for ``from_pretrained``: a ``.gguf`` file loads via ``gguf_file=``."""
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return str(path), {}


def load_hf_reference(path: Path, dtype: Any) -> tuple[Any, Any]:
    """The transformers model (``attn_implementation="sdpa"``) and tokenizer for ``path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, kwargs = hf_load_args(path)
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa", **kwargs)
    model.eval()
    return model, tokenizer


# --------------------------------------------------------------------------- statistics

def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (``q`` in [0, 100]) of a non-empty list."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_summary(values: list[float]) -> dict[str, float]:
    """p50 / p99 / mean / max of a list of seconds."""
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "mean": statistics.fmean(values),
        "max": max(values),
    }


def token_agreement(reference: dict[int, list[int]], other: dict[int, list[int]]) -> dict[str, Any]:
    """How far ``other``'s greedy outputs agree with ``reference`` on the requests both ran."""
    from asyncinfer.models.quality import common_prefix

    keys = sorted(set(reference) & set(other))
    if not keys:
        return {"compared": 0}
    identical = sum(reference[k] == other[k] for k in keys)
    fractions = [
        common_prefix(reference[k], other[k]) / max(len(reference[k]), len(other[k]), 1) for k in keys
    ]
    return {"compared": len(keys), "identical": identical, "mean_common_prefix": statistics.fmean(fractions)}


# --------------------------------------------------------------------------- results

@dataclass
class SystemResult:
    """One system's offline-throughput measurement (useful output tokens only)."""

    name: str
    num_requests: int
    output_tokens: int
    wall_s: float
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            **self.notes,
        }


def machine_info() -> dict[str, Any]:
    """CPU model, core count, library versions and the kernels this process loaded, for the JSON record."""
    import torch
    import transformers

    return {
        "cpu": cpu_model(),
        "os_cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "kernels": kernels_info(),
    }


def cpu_model() -> str:
    """The CPU's model name (the package's own reading, which ``asyncinfer calibrate`` records too)."""
    from asyncinfer.lab.calibrate import cpu_name

    return cpu_name()


def git_commit() -> str:
    """The checkout's HEAD commit (its hash; "unknown" outside a git checkout), for a results file."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_record(path: Path, record: dict[str, Any], indent: int = 1) -> None:
    """Write a benchmark's record as JSON to ``path`` (its directory made) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=indent) + "\n")
    print(f"written to {path}")


def kernels_info() -> dict[str, str] | None:
    """asyncinfer's kernels as this process loaded them (``isa``, ``source``: ``"installed"`` or ``"cache"``),
    or None where it has not loaded them (its runs used none, or they cannot run here). Never loads or builds
    them: a process that only drives others (benchmarks/revisions.py) records None."""
    from asyncinfer import kernels

    if not kernels.loaded():
        return None
    info = kernels.build_info()
    return {"isa": info["isa"], "source": info["source"]}


def tiny_model(directory: Path, max_position_embeddings: int = 512) -> Path:
    """A 2-layer random Llama checkpoint (the test suite's shape, no tokenizer: prompts are ids),
    saved as safetensors in ``directory``: a model whose steps cost milliseconds, for bookkeeping benchmarks."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    return directory


async def engine_decode_rate(
    engine: Any, prompt: list[int], new_tokens: int, repeats: int = 3, *, warm_up: bool = True
) -> dict[str, float]:
    """One request's decode tok/s in a running engine, the first token's time taken off:
    ``(n - 1) / (T(n) - T(1))``, each time the median of ``repeats`` runs (after a warm-up run)."""
    import time

    from asyncinfer import SamplingParams

    async def timed(n: int) -> float:
        start = time.perf_counter()
        out = await engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        elapsed = time.perf_counter() - start
        if len(out.token_ids) != n:
            raise RuntimeError(f"asyncinfer made {len(out.token_ids)} tokens, expected {n}")
        return elapsed

    if warm_up:
        await timed(4)
    t1 = statistics.median([await timed(1) for _ in range(repeats)])
    tn = statistics.median([await timed(new_tokens) for _ in range(repeats)])
    return {"t_1_s": t1, "t_n_s": tn, "decode_tokens_per_s": (new_tokens - 1) / (tn - t1)}
