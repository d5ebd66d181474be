"""A stranger's first hour (stranger36): the README's OpenAI client snippet, run as written against
``asyncinfer serve``.

Its chat sent ``"Hi!"`` without ``max_tokens``, so the server, as OpenAI's chat does, let the reply run up to the
model's context, sampled at temperature 1: the default model answered after 405 s and 8,160 tokens on a 2-core
machine (5 of 64 seeded answers to ``"Hi!"`` ran past 600 tokens), and the snippet seemed to hang. The docs' own
test ran it only against a server whose context it had cut to 512 tokens (tests/docs/test_docs.py, ``Servers``).
Every chat call of the pages' OpenAI client snippets sends ``max_tokens`` (or ``max_completion_tokens``) now.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.docs.test_docs import DOCS, blocks

LIMITS = {"max_tokens", "max_completion_tokens"}


def chat_calls() -> list[tuple[str, int, ast.Call]]:
    """Every ``*.chat.completions.create(...)`` / ``.parse(...)`` call of the pages' Python blocks."""
    found = []
    for path in DOCS:
        for block in blocks(path):
            if block.lang != "python" or ".chat.completions." not in block.code:
                continue
            for node in ast.walk(ast.parse(block.code)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("create", "parse") and ast.unparse(node.func.value).endswith(
                            "chat.completions")):
                    found.append((Path(path).name, block.line + node.lineno, node))
    return found


def test_the_pages_have_client_chat_calls() -> None:
    assert {name for name, _, _ in chat_calls()} >= {"README.md", "serving.md", "structured_output.md"}


def test_every_client_chat_call_of_the_pages_bounds_its_reply() -> None:
    unbounded = [f"{name}:{line}" for name, line, call in chat_calls()
                 if not LIMITS & {keyword.arg for keyword in call.keywords}]
    assert unbounded == []
