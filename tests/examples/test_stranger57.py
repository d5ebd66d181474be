"""examples/openai_server.py's curl line (its docstring) sent a chat without ``max_tokens``, which the README warns
may write up to the model's context, minutes on a CPU (stranger 57)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_examples_curl_chats_bound_their_reply() -> None:
    """Every curl chat of the examples' docstrings sends ``max_tokens``, as the pages' client calls do
    (tests/docs/test_stranger36.py)."""
    bodies = []
    for path in sorted((ROOT / "examples").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        for command in re.findall(r"curl [^\n]*(?:\\\n[^\n]*)*", doc):
            bodies += [(path.name, body) for body in re.findall(r"-d '([^']*)'", command) if '"messages"' in body]
    assert bodies, "no curl chat in the examples"
    assert [name for name, body in bodies if '"max_tokens"' not in body] == []
