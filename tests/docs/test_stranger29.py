"""The last stranger's first hour, embedding the engine in a service of their own from the guides and
docs/api.md.

docs/guides/fastapi.md's streamed route said "a bad argument raises here, before the 200" of
``engine.stream(...)``; but a prompt of more than 4096 characters is tokenized off the event loop and its
length checked at the first delta (docs/reliability.md, "Errors"), so the route, as written, answered a long
question with a ``max_tokens`` it left no room for with a 200 and an empty body, the
``InvalidParameterError`` raised inside the response (the whole-answer route gave the 422). The guide's route
now awaits the first delta before it returns the response."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "fastapi.md"


def guide_app_code() -> str:
    """The guide's app and its abortable route: its Python blocks but the last (the TestClient demo)."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.DOTALL)
    assert "TestClient" in blocks[-1] and "/ask/stream" in blocks[0]
    return "".join(blocks[:-1])


@pytest.mark.real_model
def test_the_guide_s_streamed_route_refuses_a_long_prompt_s_max_tokens_before_the_200(real_gguf, monkeypatch) -> None:
    from fastapi.testclient import TestClient

    monkeypatch.setenv("ASYNCINFER_MODEL", str(real_gguf))
    namespace: dict = {"__name__": "fastapi_guide"}
    exec(compile(guide_app_code(), str(GUIDE), "exec"), namespace)  # noqa: S102 - the guide's own code
    long_question = "hello " * 1000  # 6,000 characters: tokenized off the loop, about 1,000 tokens
    with TestClient(namespace["app"], raise_server_exceptions=False) as client:
        whole = client.post("/ask", json={"question": long_question, "max_tokens": 1500})
        assert whole.status_code == 422 and whole.json()["detail"]["parameter"] == "max_tokens", whole.text
        streamed = client.post("/ask/stream", json={"question": long_question, "max_tokens": 1500})
        assert streamed.status_code == 422, (streamed.status_code, streamed.text)
        assert streamed.json()["detail"]["parameter"] == "max_tokens"
        # what fits still streams, the first delta's text included (greedy: the whole answer's text)
        for question in (long_question, "Count to three."):
            answer = client.post("/ask", json={"question": question, "max_tokens": 12}).json()
            streamed = client.post("/ask/stream", json={"question": question, "max_tokens": 12})
            assert streamed.status_code == 200 and streamed.text == answer["answer"], (streamed.text, answer)
        assert streamed.text
        engine = namespace["engine"]
        assert engine.num_unfinished_requests == 0 and engine.kv_stats().used_blocks == 0
