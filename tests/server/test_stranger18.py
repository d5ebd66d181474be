"""A newcomer's first hour (stranger 18): Ray Serve's builder checks its arguments before deploying."""

from __future__ import annotations

import pytest

from asyncinfer import InvalidParameterError
from asyncinfer.serve_ray import BUILD_ARGS, build


@pytest.mark.parametrize(("args", "parameter", "allowed"), [
    # A typo was dropped: num_replica=2 deployed one replica.
    ({"model": "/models/llama", "num_replica": "2"}, "num_replica",
     f"an argument of asyncinfer.serve_ray:build: {list(BUILD_ARGS)} (engine options go in options, a mapping)"),
    # A mapping given as text (serve run's KEY=VALUE) was Python's "dictionary update sequence element" ValueError.
    ({"model": "/models/llama", "options": "{}"}, "options",
     "a mapping, as a config file's YAML gives it (serve run's KEY=VALUE arguments give text: use a config file for it)"),
    ({"model": "/models/llama", "ray_actor_options": "num_cpus=2"}, "ray_actor_options",
     "a mapping, as a config file's YAML gives it (serve run's KEY=VALUE arguments give text: use a config file for it)"),
    # Ray's own ValueError / pydantic's ValidationError, neither naming asyncinfer's builder.
    ({"model": "/models/llama", "num_replicas": "0"}, "num_replicas",
     "an integer >= 1 (or its digits as text), or 'auto' with autoscaling_config"),
    ({"model": "/models/llama", "num_replicas": "two"}, "num_replicas",
     "an integer >= 1 (or its digits as text), or 'auto' with autoscaling_config"),
    ({"model": "/models/llama", "num_replicas": True}, "num_replicas",
     "an integer >= 1 (or its digits as text), or 'auto' with autoscaling_config"),
    ({"model": "/models/llama", "max_ongoing_requests": "-1"}, "max_ongoing_requests",
     "an integer >= 1 (or its digits as text)"),
])
def test_build_refuses_a_bad_argument_by_name(args, parameter, allowed) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        build(args)
    assert caught.value.parameter == parameter
    assert caught.value.allowed == allowed


def test_build_refuses_an_unknown_engine_option_before_deploying() -> None:
    """``options: {max_model_lenn: 512}`` was deployed and failed in every replica, in Ray's tracebacks."""
    with pytest.raises(InvalidParameterError) as caught:
        build({"model": "/models/llama", "options": {"max_model_lenn": 512}})
    assert caught.value.parameter == "options.max_model_lenn" and caught.value.value == 512
    assert "'max_model_len'" in caught.value.allowed and "'max_batch_size'" in caught.value.allowed


def test_build_takes_what_the_docs_show() -> None:
    """docs/scale_out.md's config file args, serve run's text, and an embedding model's option."""
    app = build({"model": "/models/llama", "name": "llama", "num_replicas": 8,
                 "options": {"kv_cache_memory": 4294967296, "num_threads": 16},
                 "ray_actor_options": {"num_cpus": 16}, "api_keys": ["sk-one"]})
    assert app._bound_deployment._deployment_config.num_replicas == 8
    app = build({"model": "/models/llama", "num_replicas": "2", "max_ongoing_requests": "32",
                 "api_keys": "sk-one,sk-two"})
    config = app._bound_deployment._deployment_config
    assert (config.num_replicas, config.max_ongoing_requests) == (2, 32)
    build({"model": "all-MiniLM-L6-v2", "options": {"max_batch_size": 8}})


def test_create_app_refuses_what_is_no_model_spec_by_name() -> None:
    """``create_app(5)`` was Python's ``TypeError: 'int' object is not iterable``."""
    from asyncinfer.server import create_app

    with pytest.raises(InvalidParameterError) as caught:
        create_app(5)
    assert str(caught.value) == ("models=5 is invalid: allowed an AsyncEngine, a ModelSpec or a non-empty list of "
                                 "ModelSpecs")


def test_a_second_start_up_of_an_app_over_a_closed_engine_fails_loudly(tiny_models) -> None:
    """The app closes the engine it started at shutdown; a second ``with TestClient(app)`` started up over the closed
    engine and answered every request 503."""
    from fastapi.testclient import TestClient

    from asyncinfer import AsyncEngine, EngineClosedError
    from asyncinfer.server import create_app

    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], max_model_len=64, num_threads=1)
    app = create_app(engine)
    body = {"model": "default", "prompt": [1, 2, 3], "max_tokens": 2}
    with TestClient(app) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
    with pytest.raises(EngineClosedError) as caught, TestClient(app):
        pass
    assert str(caught.value).startswith("the engine given to create_app is closed (an app closes the engine it "
                                        "started at shutdown, so a second start-up of the same app")
