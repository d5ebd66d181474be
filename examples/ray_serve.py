"""Replicas on Ray Serve, each one asyncinfer engine, behind the OpenAI routes.

    python examples/ray_serve.py --model PATH --replicas 2 --port 8000         # a local Ray instance
    python examples/ray_serve.py --model PATH --address auto --replicas 8      # a cluster (`ray start --head`)
    python examples/ray_serve.py --model PATH --autoscale 1:4                  # Ray Serve's autoscaling
    python examples/ray_serve.py --replicas 2 --cpus-per-replica 1 --bench 32  # measure, then stop

``--bench N`` sends N concurrent chat requests through Ray Serve's proxy, then
prints the requests and tokens per replica, the throughput, and each replica's
resident memory (from its /metrics). docs/scale_out.md has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import time
from collections.abc import Callable

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from asyncinfer.server import ModelSpec

try:
    import ray
    from ray import serve

    from asyncinfer.serve_ray import openai_app
except ImportError:
    raise SystemExit("examples/ray_serve.py needs Ray Serve: pip install 'asyncinfer[ray]'") from None


def deploy(args: argparse.Namespace) -> str:
    local = args.address is None
    ray.init(address=args.address, num_cpus=args.num_cpus if local else None, include_dashboard=not local,
             runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}})
    serve.start(http_options={"host": args.host, "port": args.port})
    # Size the KV cache per replica: by default an engine takes a quarter of the memory free when it
    # starts, and replicas sharing a machine would each take that.
    spec = ModelSpec(args.model, args.name, {"num_threads": max(1, int(args.cpus_per_replica)),
                                             "max_model_len": args.max_model_len,
                                             "kv_cache_memory": args.kv_cache_mib * 2**20})
    scaling = None
    if args.autoscale:
        low, high = args.autoscale
        scaling = {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": 16}
    app = openai_app(spec, num_replicas=None if scaling else args.replicas, autoscaling_config=scaling,
                     ray_actor_options={"num_cpus": args.cpus_per_replica})
    serve.run(app, name="asyncinfer", route_prefix="/")
    return f"http://{args.host}:{args.port}"


async def bench(url: str, name: str, clients: int, max_tokens: int) -> None:
    per_replica: collections.Counter[str] = collections.Counter()
    tokens: collections.Counter[str] = collections.Counter()
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600) as client:
        async def one(i: int) -> None:
            raw = await client.chat.completions.with_raw_response.create(
                model=name, messages=[{"role": "user", "content": f"Tell me fact number {i} about the sea."}],
                max_tokens=max_tokens, extra_body={"ignore_eos": True})
            replica = raw.headers["x-asyncinfer-instance"]
            per_replica[replica] += 1
            tokens[replica] += raw.parse().usage.completion_tokens

        await one(-1)  # warm-up
        per_replica.clear(), tokens.clear()
        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(clients)))
        elapsed = time.perf_counter() - start
    print(f"{clients} requests x {max_tokens} tokens in {elapsed:.1f} s: {sum(tokens.values()) / elapsed:.1f} tok/s")
    memory = replica_memory(url, set(per_replica))
    for replica in sorted(per_replica):
        print(f"  replica {replica}: {per_replica[replica]} requests, {tokens[replica]} tokens, "
              f"RSS {memory.get(replica, float('nan')) / 2**20:.0f} MiB")


def replica_memory(url: str, replicas: set[str], tries: int = 50) -> dict[str, float]:
    """Each replica's resident memory: scrape /metrics until every replica has answered once."""
    found: dict[str, float] = {}
    for _ in range(tries):
        r = httpx.get(url + "/metrics")
        for family in text_string_to_metric_families(r.text):
            if family.name == "process_resident_memory_bytes":
                found[r.headers["x-asyncinfer-instance"]] = family.samples[0].value
        if replicas <= found.keys():
            break
    return found


def min_max(text: str) -> tuple[int, int]:
    """``--autoscale MIN:MAX``: two replica counts, 0 <= MIN <= MAX, 1 <= MAX (Ray Serve's autoscaling bounds)."""
    low, sep, high = text.partition(":")
    if not (sep and low.strip().isdigit() and high.strip().isdigit()) or not 0 <= int(low) <= int(high) or int(high) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN:MAX, two replica counts with 0 <= MIN <= MAX and "
                                         "MAX >= 1 (e.g. 1:4)")
    return int(low), int(high)


def positive(kind: type[int | float]) -> Callable[[str], int | float]:
    """An argparse type: a number of ``kind`` above 0."""
    def read(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not above 0")
        return value
    return read


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--name", default=None, help="the model's name in requests (default: as `asyncinfer serve` names it, "
                                                 "SmolLM2-135M-Instruct for the default model, else the file's name)")
    p.add_argument("--replicas", type=positive(int), default=2, metavar="N",
                   help="replicas, one engine each (default: 2; --autoscale replaces it)")
    p.add_argument("--autoscale", type=min_max, default=None, metavar="MIN:MAX",
                   help="let Ray Serve scale the replicas between MIN and MAX (default: none: --replicas)")
    p.add_argument("--cpus-per-replica", type=positive(float), default=1.0, metavar="CPUS",
                   help="CPUs Ray reserves for each replica, also its torch threads (default: 1.0)")
    p.add_argument("--max-model-len", type=positive(int), default=2048, metavar="TOKENS",
                   help="prompt + output tokens per request (default: 2048)")
    p.add_argument("--kv-cache-mib", type=positive(int), default=256, metavar="MIB",
                   help="KV cache per replica, MiB (default: 256)")
    p.add_argument("--address", default=None, help="a running Ray cluster ('auto') (default: start one here)")
    p.add_argument("--num-cpus", type=positive(int), default=None, metavar="N",
                   help="CPUs of the local Ray instance (default: every core here)")
    p.add_argument("--host", default="127.0.0.1", help="address Ray Serve's proxy listens on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port Ray Serve's proxy listens on (default: 8000)")
    p.add_argument("--bench", type=int, default=0, metavar="N",
                   help="send N concurrent requests, print the figures, stop (default: 0: serve until Ctrl-C)")
    p.add_argument("--max-tokens", type=positive(int), default=32, metavar="N",
                   help="output tokens per --bench request (default: 32)")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.name is None:
        args.name = ModelSpec.served_name(args.model)
    try:
        url = deploy(args)
    except ConnectionError as exc:  # no Ray cluster at --address: one line, not Ray's traceback
        p.exit(2, f"{p.prog}: error: cannot connect to Ray at --address {args.address}: {exc}\n")
    try:
        if args.bench:
            asyncio.run(bench(url, args.name, args.bench, args.max_tokens))
            return
        print(f"serving {args.name} on {url}/v1 (Ctrl-C stops)")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
