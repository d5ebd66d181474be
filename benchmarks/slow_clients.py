"""Slow clients against a running server: many connections that send a request a byte at a time.

Each connection sends its request's headers (``--mode headers``), or whole headers and then its
body (``--mode body``), one byte every ``--interval`` seconds, for ever, until the server closes
it; meanwhile one ordinary ``GET /health`` is timed. A server with a header and a body deadline
(``asyncinfer serve --header-timeout --body-timeout``) closes every one of them on time, with a
408, and still answers; one over its ``--max-connections`` answers the surplus 503 at once. A
server without them holds every connection until ``--give-up``. On a server with API keys, give one
(``--api-key``): without it every request is refused (401) as soon as its headers are in, and ``--mode
body`` would measure that refusal, not the body deadline.

    asyncinfer serve --header-timeout 2 --body-timeout 2 &
    python benchmarks/slow_clients.py --url http://127.0.0.1:8000 --connections 300 --mode headers
    python benchmarks/slow_clients.py --connections 300 --mode body --json slow.json
    python benchmarks/slow_clients.py --connections 300 --mode body --api-key "$KEY"   # a server with keys

It prints how many the server closed, how soon, and with which status; ``--json`` writes that
too. It exits 1 when a connection outlived ``--give-up`` or the ordinary request was not
answered. Plain asyncio and the standard library: no model, no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.parse
from dataclasses import dataclass

HEAD = "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"


@dataclass
class Outcome:
    closed_after: float | None  # seconds from connecting until the server closed it (None: it never did)
    answer: bytes  # everything the server sent

    @property
    def status(self) -> int | None:
        """The status of the server's answer, if it sent one."""
        code = self.answer[9:12]
        return int(code) if self.answer.startswith(b"HTTP/1.1 ") and code.isdigit() else None


async def dribble(host: str, port: int, at_once: bytes, slowly: bytes, interval: float, give_up: float) -> Outcome:
    """Connect, send ``at_once``, then ``slowly`` a byte every ``interval`` seconds (over again), until
    the server closes the connection or ``give_up`` seconds pass."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    answer = bytearray()

    async def read() -> None:
        try:
            while chunk := await reader.read(65536):
                answer.extend(chunk)
        except ConnectionError:
            pass

    reading = asyncio.ensure_future(read())
    try:
        writer.write(at_once)
        i = 0
        while not reading.done() and time.monotonic() - start < give_up:
            writer.write(slowly[i % len(slowly):i % len(slowly) + 1])
            i += 1
            await asyncio.wait((reading,), timeout=interval)
    except ConnectionError:
        await asyncio.wait((reading,), timeout=1.0)
    closed = reading.done()
    reading.cancel()
    writer.close()
    return Outcome(time.monotonic() - start if closed else None, bytes(answer))


async def ordinary_request(host: str, port: int, timeout: float) -> tuple[float | None, int | None]:
    """A plain ``GET /health`` while the slow connections are held: its seconds (None: not answered 200) and
    the status it was answered (None: no answer; a 503 where the slow connections took every place of the
    server's ``--max-connections``)."""
    start = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        answer = await asyncio.wait_for(reader.read(65536), timeout)
        writer.close()
    except (OSError, asyncio.TimeoutError):
        return None, None
    status = Outcome(None, answer).status
    return (time.monotonic() - start if status == 200 else None), status


async def run(args: argparse.Namespace) -> dict:
    url = urllib.parse.urlsplit(args.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    head = HEAD.format(host=host).encode()
    if args.api_key is not None:
        head += f"Authorization: Bearer {args.api_key}\r\n".encode()
    if args.mode == "headers":
        at_once, slowly = b"", head + b"X-Padding: " + b"a" * 8192
    else:
        at_once, slowly = head + b"Content-Length: 65536\r\n\r\n", b" " * 65536
    crowd = asyncio.gather(*(dribble(host, port, at_once, slowly, args.interval, args.give_up)
                             for _ in range(args.connections)))
    await asyncio.sleep(min(1.0, args.give_up / 4))  # they are all dribbling now
    meanwhile, meanwhile_status = await ordinary_request(host, port, args.give_up)
    outcomes = await crowd
    closed = [o.closed_after for o in outcomes if o.closed_after is not None]
    statuses: dict[str, int] = {}
    for o in outcomes:
        statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
    return {
        "url": args.url, "mode": args.mode, "connections": args.connections, "interval": args.interval,
        "give_up": args.give_up, "closed": len(closed), "held_until_give_up": args.connections - len(closed),
        "closed_after_s": {"min": min(closed), "median": statistics.median(closed), "max": max(closed)}
        if closed else None,
        "statuses": statuses, "ordinary_request_s": meanwhile, "ordinary_request_status": meanwhile_status,
        "outcomes": [{"closed_after": o.closed_after, "status": o.status} for o in outcomes] if args.every else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    parser.add_argument("--connections", type=int, default=300, help="slow connections at once (default 300)")
    parser.add_argument("--mode", choices=("headers", "body"), default="headers",
                        help="send the headers slowly, or whole headers and then the body slowly (default headers)")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between two bytes (default 0.1)")
    parser.add_argument("--give-up", type=float, default=60.0,
                        help="seconds after which a connection still open counts as held (default 60)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="the server's API key, sent with each slow request (a server with keys refuses a "
                             "request without one as soon as its headers are in)")
    parser.add_argument("--every", action="store_true", help="list every connection's outcome in --json")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    if args.api_key is not None and (not args.api_key or not args.api_key.isprintable() or args.api_key != args.api_key.strip()):
        parser.error("--api-key must be a non-empty key of printable characters without spaces around it")
    result = asyncio.run(run(args))
    times = result["closed_after_s"]
    print(f"{result['closed']} of {args.connections} connections closed by the server"
          + (f" after {times['min']:.2f}-{times['max']:.2f} s (median {times['median']:.2f})" if times else ""))
    meanwhile, status = result["ordinary_request_s"], result["ordinary_request_status"]
    print(f"statuses: {result['statuses']}; an ordinary request meanwhile: "
          + (f"{meanwhile:.3f} s" if meanwhile is not None else "no answer" if status is None
             else f"answered {status}" + (" (the connection cap: --connections over the server's --max-connections)"
                                          if status == 503 else "")))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0 if result["held_until_give_up"] == 0 and result["ordinary_request_s"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
