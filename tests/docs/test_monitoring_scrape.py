"""docs/monitoring/README.md's Prometheus scrape config gets the metrics of a server with API keys on:
its request, made as Prometheus makes it from that config with the server's metrics key, is answered 200
(without a key, or with a tenant's API key: 401)."""

from __future__ import annotations

from pathlib import Path

import yaml

from asyncinfer import AsyncEngine

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "monitoring" / "README.md"


def scrape_job() -> dict:
    """The documented ``scrape_configs`` job (the YAML block that has one)."""
    text = DOC.read_text(encoding="utf-8")
    for block in text.split("```yaml\n")[1:]:
        config = yaml.safe_load(block.split("```", 1)[0])
        if isinstance(config, dict) and "scrape_configs" in config:
            (job,) = config["scrape_configs"]
            return job
    raise AssertionError("no scrape config in docs/monitoring/README.md")


def prometheus_headers(job: dict, files: dict[str, str]) -> dict[str, str]:
    """The Authorization header Prometheus sends for ``job`` (its ``authorization`` block: ``type``, default
    Bearer, and ``credentials`` or ``credentials_file``, whose content it trims); ``files``: path -> content."""
    auth = job.get("authorization")
    if auth is None:
        return {}
    secret = auth["credentials"] if "credentials" in auth else files[auth["credentials_file"]].strip()
    return {"Authorization": f"{auth.get('type', 'Bearer')} {secret}"}


def test_the_documented_scrape_config_gets_the_metrics_with_api_keys_on(tiny_models) -> None:
    from fastapi.testclient import TestClient

    from asyncinfer.server import ServerSettings, create_app

    job = scrape_job()
    key = "sk-prometheus"
    files = {path: f"{key}\n" for path in [job.get("authorization", {}).get("credentials_file")] if path}
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], kv_cache_memory=1 << 20, max_model_len=64,
                                         device="cpu", memory_bandwidth=1e10)
    app = create_app(engine, ServerSettings(api_keys=("sk-tenant",), metrics_keys=(key,)))
    path = job.get("metrics_path", "/metrics")
    with TestClient(app) as client:
        scraped = client.get(path, headers=prometheus_headers(job, files))
        refused = client.get(path)
        tenant = client.get(path, headers={"Authorization": "Bearer sk-tenant"})  # an API key is not a metrics key
    assert scraped.status_code == 200, scraped.text
    assert "asyncinfer_requests_in_flight" in scraped.text
    assert refused.status_code == 401
    assert tenant.status_code == 401, tenant.text
