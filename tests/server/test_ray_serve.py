"""Two Ray Serve replicas of a tiny model on a local Ray instance (2 CPUs, loopback), driven by the openai client."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import openai
import pytest

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.server import ModelSpec

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from asyncinfer.serve_ray import openai_app  # noqa: E402  (needs ray)

SRC = Path(__file__).resolve().parents[2] / "src"
OPTIONS = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 256, "dtype": "float32", "device": "cpu",
           "num_threads": 1}
PROMPTS = [[5 + i, 17, 42 + 3 * i, 99, 7 + i] for i in range(12)]


@pytest.fixture(scope="module")
def ray_port():
    """A local Ray instance with 2 CPUs and Serve's proxy on a loopback port; shut down afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The replicas import this checkout's asyncinfer, like the test does.
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def single_engine_tokens(path: Path) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with AsyncEngine.from_pretrained(path, **OPTIONS) as engine:
            outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=8, ignore_eos=True))
                                          for p in PROMPTS))
        return [o.token_ids for o in outs]
    return asyncio.run(run())


async def ask_all(port: int) -> list[tuple[list[int], str]]:
    """Every prompt at once, through Ray Serve's proxy: (tokens, the replica that answered)."""
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as client:
        async def one(prompt: list[int]) -> tuple[list[int], str]:
            raw = await client.completions.with_raw_response.create(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
            tokens = raw.parse().choices[0].logprobs.tokens
            return [int(t.removeprefix("token_id:")) for t in tokens], raw.headers["x-asyncinfer-instance"]
        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


def test_two_replicas_serve_and_answer_as_one_engine(ray_port, tiny_models) -> None:
    llama = tiny_models["llama"][0]
    app = openai_app(ModelSpec(str(llama), "tiny", OPTIONS), num_replicas=2, ray_actor_options={"num_cpus": 0.5})
    serve.run(app, name="asyncinfer", route_prefix="/")
    try:
        want = single_engine_tokens(llama)
        served: set[str] = set()
        # Both replicas serve: Ray's router picks among the replicas it has seen ready, so a round of 12 requests
        # can all go to one on a loaded machine (seen with two test workers): a few rounds, each answer exact.
        for _ in range(5):
            answers = asyncio.run(ask_all(ray_port))
            assert [tokens for tokens, _ in answers] == want
            served |= {replica for _, replica in answers}
            if len(served) == 2:
                break
        assert len(served) == 2  # both replicas served
    finally:
        serve.delete("asyncinfer")


def test_a_user_config_change_swaps_the_model_in_place_replica_by_replica(ray_port, tiny_models) -> None:
    """Deployed from a config (as ``serve deploy`` does), a change of ``user_config`` alone makes Ray
    reconfigure the running replicas a bounded number at a time; each swaps its engine's model hot."""
    from ray.serve.context import _get_global_client  # what `serve deploy` reaches through the dashboard
    from ray.serve.schema import ServeDeploySchema

    llama, qwen = tiny_models["llama"][0], tiny_models["qwen2"][0]

    def config(user_config: dict) -> ServeDeploySchema:
        return ServeDeploySchema(applications=[{
            "name": "asyncinfer", "route_prefix": "/", "import_path": "asyncinfer.serve_ray:build",
            "args": {"model": str(llama), "name": "tiny", "options": OPTIONS, "num_replicas": 2,
                     "ray_actor_options": {"num_cpus": 0.5}},
            "deployments": [{"name": "asyncinfer", "user_config": user_config}],
        }])

    client = _get_global_client()
    client.deploy_apps(config({}), _blocking=True)
    try:
        before = asyncio.run(ask_all(ray_port))
        assert [tokens for tokens, _ in before] == single_engine_tokens(llama)
        replicas = {replica for _, replica in before}
        for _ in range(20):  # Ray's router may send one round to one replica: both are named before the swap
            if len(replicas) == 2:
                break
            replicas |= {replica for _, replica in asyncio.run(ask_all(ray_port))}
        client.deploy_apps(config({"model": str(qwen)}), _blocking=True)
        want = single_engine_tokens(qwen)
        deadline = time.monotonic() + 60
        while True:
            after = asyncio.run(ask_all(ray_port))
            if [tokens for tokens, _ in after] == want:
                break
            assert time.monotonic() < deadline, "the replicas did not all swap to the new model"
            time.sleep(0.2)
        assert {replica for _, replica in after} == replicas  # the same replicas: swapped, not restarted
    finally:
        serve.delete("asyncinfer")
