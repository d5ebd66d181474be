"""``asyncinfer generate`` with a request the engine fails alone as it runs (docs/getting_started.md): that request's
``error`` line, and the job goes on. A ``RequestFailedError`` (a structured constraint past the grammar library's
limits, a scheduler hook that raised for the request) ended the whole job with exit status 2, the lines after it
never written, though the engine had failed that request alone and served on."""

from __future__ import annotations

import json

from asyncinfer import cli
from asyncinfer.request import Request
from asyncinfer.schedulers import FIFOScheduler


class FailsOne(FIFOScheduler):
    """A plugin whose ``finish_requests`` raises for one request: the engine fails that request alone."""

    api_version = 1

    def finish_requests(self, requests: list[Request]) -> None:
        if any(request.request_id == "generate-1" for request in requests):
            raise RuntimeError("bookkeeping bug")
        super().finish_requests(requests)


def test_a_request_failed_alone_is_its_error_line_and_the_job_goes_on(tiny_models, tmp_path, capsys) -> None:
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [5 + i, 6, 7, 8], "id": f"q{i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", str(tiny_models["llama"][0]), "--file", str(prompts), "--max-tokens", "3",
                     "--ignore-eos", "--max-num-seqs", "1", "--kv-cache-memory", "4MiB", "--threads", "1",
                     "--dtype", "float32", "--no-progress", "--scheduler", f"{__name__}:FailsOne",
                     "--output", str(out)]) == 1
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r.get("completion_tokens")) for r in records] == [("q0", 3), ("q1", None), ("q2", 3)]
    assert records[1] == {"id": "q1", "error": "request 'generate-1' failed: the scheduler (FailsOne) in "
                                               "finish_requests raised RuntimeError: bookkeeping bug"}
    assert "2 of 3 requests done" in capsys.readouterr().err
