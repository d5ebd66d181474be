"""pass29: a hostile tenant's costly features (structured output, logprobs, ``n``, stop lists, seeds) on a shared
server. What broke: a completions stream's ``text_offset`` counted from the text streamed so far, which a piece of
a character or a possible stop string holds back (and a stop string's tokens never add to), while the whole answer
counted its tokens' own characters, so the same seeded request's logprobs differed streamed and whole. And one
request's grammar, within the size limits, whose rules nest through one another, took the whole server down: the
grammar library walks rules recursively as it builds them and ran past the compiling thread's 8 MiB stack (a
segfault), so specs are compiled on a thread of a larger stack (``grammar.COMPILE_STACK_BYTES``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

import asyncinfer

# Seeded completions whose samples draw pieces of characters ("\ufffd" tokens) or stop at a stop string: found by
# a randomized comparison of whole and streamed answers on the tiny model (temperature 2 draws bytes freely).
BODIES = [
    {"max_tokens": 8, "seed": 88, "temperature": 2.0, "n": 2, "prompt": "y4j<\u20ac<", "logprobs": 2},
    {"max_tokens": 8, "seed": 205, "temperature": 2.0, "n": 2, "stop": ["a", "o"], "prompt": "ak\t8", "logprobs": 2},
    {"max_tokens": 30, "seed": 504, "temperature": 1.0, "n": 1, "prompt": "3[", "logprobs": 0},
    {"max_tokens": 8, "seed": 382, "temperature": 2.0, "n": 2, "stop": ["\u00e9", "e"], "prompt": ["ab", "cd"],
     "logprobs": 0},
]


def _streamed(http: httpx.Client, body: dict[str, Any]) -> dict[int, dict[str, list[Any]]]:
    """Each choice's logprobs, its chunks' lists joined."""
    joined: dict[int, dict[str, list[Any]]] = {}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                if choice["logprobs"]:
                    into = joined.setdefault(choice["index"], {key: [] for key in choice["logprobs"]})
                    for key, values in choice["logprobs"].items():
                        into[key] += values
    return joined


@pytest.mark.parametrize("body", BODIES, ids=lambda body: f"seed{body['seed']}")
def test_text_offsets_are_the_same_streamed_and_whole(server, body):
    body = {"model": "tiny", **body}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        whole = http.post("/v1/completions", json=body)
        assert whole.status_code == 200
        streamed = _streamed(http, body)
    for choice in whole.json()["choices"]:
        logprobs = choice["logprobs"]
        tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
        # Each offset counts the characters of the tokens before it, as `tokens` reads them.
        assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
        assert streamed[choice["index"]]["tokens"] == tokens
        assert streamed[choice["index"]]["text_offset"] == offsets


#: Compiles the grammar of 1,300 rules (57 KB, within ``MAX_SPEC_CHARS``) for the tiny chat model's vocabulary in a
#: child interpreter, from a thread of the default stack, as the engine's compile workers are: the child died of a
#: segfault (the test process would have too), with the default stacks of the main thread and of worker threads.
_COMPILE = """
import sys, threading
from transformers import AutoTokenizer
from asyncinfer import InvalidParameterError, StructuredOutput
from asyncinfer.grammar import GrammarCompiler
n = 1300
grammar = "root ::= " + " | ".join(f"r{i}" for i in range(n)) + "\\n" + "\\n".join(
    f'r{i} ::= "z{i}" ( "a" | "b" r{(i + 1) % n} )?' for i in range(n))
compiler = GrammarCompiler(AutoTokenizer.from_pretrained(sys.argv[1]), 320, [2])
def compile():
    try:
        compiler.compile(StructuredOutput.grammar(grammar))
        print("compiled")
    except InvalidParameterError as exc:
        print("refused", exc.param)
thread = threading.Thread(target=compile)
thread.start()
thread.join()
"""


def test_a_grammar_of_rules_nested_through_each_other_does_not_crash_the_process(tiny_chat_model):
    pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")
    src = str(Path(asyncinfer.__file__).parents[1])  # this checkout's package, whatever the child's path holds
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-c", _COMPILE, str(tiny_chat_model)], check=False,
                           capture_output=True, text=True, timeout=300, env=env)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.split()[0] in ("compiled", "refused")


def test_the_server_serves_on_after_such_a_grammar(server):
    n = 1300
    grammar = "root ::= " + " | ".join(f"r{i}" for i in range(n)) + "\n" + "\n".join(
        f'r{i} ::= "z{i}" ( "a" | "b" r{(i + 1) % n} )?' for i in range(n))
    with httpx.Client(base_url=server.url, timeout=120) as http:
        reply = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                                   "guided_grammar": grammar})
        assert reply.status_code in (200, 400) and "x-request-id" in reply.headers
        assert http.get("/health").status_code == 200
