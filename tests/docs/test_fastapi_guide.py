"""docs/guides/fastapi.md's app under a real uvicorn server: a client that goes away while a whole answer is
being generated gets its request aborted by the guide's abortable route (the guide's `/ask` runs on to
`max_tokens` for no one, as FastAPI does not cancel a route whose client left; the guide said nothing of it)."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "fastapi.md"


def guide_app_code() -> str:
    """The guide's app and its abortable route: its Python blocks but the last (the TestClient demo)."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.DOTALL)
    assert len(blocks) == 3 and "TestClient" in blocks[-1] and "/ask/abortable" in blocks[1]
    return "".join(blocks[:-1])


@pytest.mark.real_model
async def test_the_guide_s_abortable_route_aborts_the_request_of_a_client_that_went_away(real_gguf,
                                                                                         monkeypatch) -> None:
    import uvicorn

    monkeypatch.setenv("ASYNCINFER_MODEL", str(real_gguf))
    namespace: dict = {"__name__": "fastapi_guide"}
    exec(compile(guide_app_code(), str(GUIDE), "exec"), namespace)  # noqa: S102 - the guide's own code
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(namespace["app"], host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        for _ in range(1200):
            if server.started or serving.done():
                break
            await asyncio.sleep(0.05)
        assert server.started
        engine = namespace["engine"]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            r = await http.post("/ask/abortable", json={"question": "What is the capital of France?", "max_tokens": 12},
                                timeout=120)
            assert r.status_code == 200 and r.json()["finish_reason"] in ("stop", "length"), r.text
            with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 1500 tokens
                await http.post("/ask/abortable", json={"question": "Write a very long story about a dragon.",
                                                        "max_tokens": 1500}, timeout=1.0)
        for _ in range(200):
            if engine.num_unfinished_requests == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.num_unfinished_requests == 0 and engine.kv_stats().used_blocks == 0
        assert engine.metrics.snapshot().models["default"].requests["abort"] == 1
    finally:
        server.should_exit = True
        await serving
