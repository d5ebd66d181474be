"""One API key's flood of large embedding bodies against another key's plain calls, over HTTP.

A server holds the default generator ("smol") and all-MiniLM-L6-v2 ("minilm") behind two API keys. The victim
(key B) makes one short completion at a time (8 greedy tokens) and records each call's latency, first alone,
then while the flooder (key A) keeps ``--flooders`` connections busy, each sending ``/v1/embeddings`` bodies of
about ``--body-kib`` KiB of text and leaving (``--give-up`` seconds later, or at once once answered) to send the
next: the disconnect flood that shows what a caller's abandoned work costs the others.

Three settings, a fresh server each, in interleaved rounds:

- ``served``: as served: each tenant's (key's) off-loop work at most ``asyncinfer.threads.WORK_THREADS_PER_PARTY``
  worker threads at once, those threads ``WORK_THREAD_NICE`` (10) below the engine's OS priority;
- ``same_priority``: those shares, the threads at the engine's priority (``WORK_THREAD_NICE = 0``);
- ``pool``: no shares either (``WORK_THREADS_PER_PARTY`` = 1,000,000): all callers' work in one pool of 40 threads,
  first come first served, at the engine's priority: as before both.

The victim streams its answer: its time to the first token, its time per token after it, and its whole call.

    python benchmarks/body_flood.py --json benchmarks/results/body_flood.json
    TOKENIZERS_PARALLELISM=false python benchmarks/body_flood.py --settings served same_priority \
        --json benchmarks/results/body_flood_serial_tokenizer.json

The tokenizers' own pool of threads (``encode_batch``'s parallelism, at the process's priority and in no tenant's
share) tokenizes a flood's texts beside the engine unless ``TOKENIZERS_PARALLELISM=false``; the second run measures
that deployment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from common import git_commit, machine_info, percentile

import asyncinfer.threads
from asyncinfer.model_source import default_model_path, resolve_model
from asyncinfer.server import ModelSpec, ServerSettings, create_app, server_config

KEYS = ("sk-flooder", "sk-victim")
SERVED_PER_PARTY = asyncinfer.threads.WORK_THREADS_PER_PARTY
#: WORK_THREADS_PER_PARTY (None: as served) and WORK_THREAD_NICE of each setting
SETTINGS = {"served": (None, 10), "same_priority": (None, 0), "pool": (1_000_000, 0)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=12, help="the victim's calls alone and under the flood, each round")
    p.add_argument("--flooders", type=int, default=32, help="the flooder's connections")
    p.add_argument("--body-kib", type=int, default=960, help="the size of each flood body")
    p.add_argument("--give-up", type=float, default=0.5, help="seconds a flood call waits before it leaves")
    p.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


class Server:
    """The app on a loopback port, uvicorn in a thread."""

    def __init__(self, app: Any, settings: ServerSettings) -> None:
        import uvicorn

        self.server = uvicorn.Server(server_config(app, settings, host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 300
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(120)


def victim_calls(url: str, calls: int) -> list[dict[str, float]]:
    """The victim's calls, one at a time, each streamed: its first token's time, its time per token after it, and its
    whole call (seconds)."""
    body = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True}
    took = []
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEYS[1]}"}, timeout=300) as client:
        for _ in range(calls):
            start = time.perf_counter()
            marks = []
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        marks.append(time.perf_counter() - start)
            end = time.perf_counter() - start
            took.append({"ttft_s": marks[0], "tpot_s": (marks[-1] - marks[0]) / max(1, len(marks) - 1), "total_s": end})
    return took


def flood(url: str, body: bytes, give_up: float, stop: threading.Event, sent: list[int]) -> None:
    headers = {"authorization": f"Bearer {KEYS[0]}", "content-type": "application/json"}
    while not stop.is_set():
        try:
            with httpx.Client(base_url=url, timeout=give_up) as client:  # a new connection each: the old one is left
                client.post("/v1/embeddings", content=body, headers=headers)
        except httpx.HTTPError:
            pass
        sent[0] += 1


def one_round(setting: str, args: argparse.Namespace, generator: Path, embedder: Path) -> dict[str, Any]:
    per_party, nice = SETTINGS[setting]
    asyncinfer.threads.WORK_THREADS_PER_PARTY = per_party or SERVED_PER_PARTY
    asyncinfer.threads.WORK_THREAD_NICE = nice
    asyncinfer.threads.close_work_executor()  # made again with this nice
    settings = ServerSettings(api_keys=KEYS)
    app = create_app([ModelSpec(str(generator), "smol", {"max_model_len": 1024}), ModelSpec(str(embedder), "minilm")],
                     settings)
    text = "The quick brown fox jumps over the lazy dog. " * 20  # 900 characters
    texts = [text] * max(1, args.body_kib * 1024 // (len(text) + 3))
    body = json.dumps({"model": "minilm", "input": texts}).encode()
    with Server(app, settings) as url:
        victim_calls(url, 2)  # warm
        alone = victim_calls(url, args.calls)
        stop, sent = threading.Event(), [0]
        flooders = [threading.Thread(target=flood, args=(url, body, args.give_up, stop, sent), daemon=True)
                    for _ in range(args.flooders)]
        for t in flooders:
            t.start()
        time.sleep(2.0)
        try:
            under = victim_calls(url, args.calls)
        finally:
            stop.set()
            for t in flooders:
                t.join(300)
    return {"setting": setting, "alone": alone, "under_flood": under, "flood_calls": sent[0],
            "alone_median": medians(alone), "under_median": medians(under), "body_bytes": len(body),
            "texts_per_body": len(texts)}


def medians(calls: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(call[key] for call in calls) for key in ("ttft_s", "tpot_s", "total_s")}


def ms(figures: dict[str, float]) -> str:
    return " ".join(f"{key[:-2]} {figures[key] * 1000:6.0f}" for key in ("ttft_s", "tpot_s", "total_s"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    generator = default_model_path(quiet=True)
    embedder = resolve_model("all-MiniLM-L6-v2")
    load_start = os.getloadavg()
    rounds = []
    for r in range(args.rounds):
        order = args.settings if r % 2 == 0 else list(reversed(args.settings))
        for setting in order:
            result = one_round(setting, args, generator, embedder)
            rounds.append(result)
            print(f"round {r + 1} {setting:13s} victim alone (ms) {ms(result['alone_median'])} | under the flood "
                  f"{ms(result['under_median'])} ({result['flood_calls']} flood calls)", flush=True)
    summary = {}
    for setting in args.settings:
        mine = [x for x in rounds if x["setting"] == setting]
        summary[setting] = {"alone_median": medians([c for x in mine for c in x["alone"]]),
                            "under_median": medians([c for x in mine for c in x["under_flood"]]),
                            "under_total_p90_s": percentile([c["total_s"] for x in mine for c in x["under_flood"]], 90)}
    print(json.dumps(summary, indent=1))
    if args.json:
        record = {"command": "python benchmarks/body_flood.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
                  "settings": vars(args) | {"json": str(args.json)}, "load_average_start": load_start,
                  "load_average_end": os.getloadavg(), "rounds": rounds, "summary": summary,
                  # the tokenizers' own thread pool (Rust's rayon, at the process's priority), on unless set "false"
                  "environment": {"TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM")}}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
