"""What ``asyncinfer serve`` checks and says before it loads anything: the port is its own (bound and
listening, held through the load), and what it will serve (URL, model, weight format and path, context length, KV budget, scheduler, API keys).

Everything said is planned from the model's config with the options given, as the engine plans
its load (``AsyncEngine.plan_memory`` makes the engine's own plan), so it is printed at once,
before the weights are read; uvicorn's "Application startup complete." line follows once it serves (no "Uvicorn running on ..."
line: uvicorn prints none for a socket handed to it).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from asyncinfer.commands import CommandError


class Served(Protocol):
    """A model the server loads (``asyncinfer.server.ModelSpec``)."""

    model: str | None
    name: str
    options: Mapping[str, Any]


def check_port_free(host: str, port: int) -> None:
    """Refuse, before any model is loaded, a port that the server could not listen on (and let it go).

    Raises:
        CommandError: as :func:`listening_socket`.
    """
    listening_socket(host, port).close()


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The server's socket, bound and listening on ``host:port`` before any model is loaded.

    ``asyncinfer serve`` holds it through the load and hands it to uvicorn, so a second server
    started on the same port a moment later is refused at once, not after loading its model
    (uvicorn binds only once the app has started). Bound as uvicorn binds (``SO_REUSEADDR``,
    IPv6 for an address with a colon); connections made during the load wait in ``backlog``
    (uvicorn's default) until the server serves. Port 0 takes a free port (``getsockname()``).

    Raises:
        CommandError: the port is in use, not ours to take, or ``host`` is no address of this machine.
    """
    if not 0 <= port <= 65535:
        raise CommandError(f"--port {port} is not a TCP port (0 to 65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)  # listening: a second bind of the port fails even with SO_REUSEADDR
    except socket.gaierror as exc:
        sock.close()
        raise CommandError(f"--host {host!r} is not an address of this machine ({exc.strerror})") from None
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise CommandError(f"port {port} on {host} is in use (another server listens on {where}?): stop it, "
                               "or choose another with --port") from None
        if exc.errno == errno.EACCES:
            raise CommandError(f"cannot listen on {where}: permission denied (ports below 1024 need privileges): "
                               "choose another with --port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise CommandError(f"--host {host!r} is not an address of this machine") from None
        raise CommandError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    return sock


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def describe_serving(specs: Sequence[Served], plans: Sequence[Any], *, host: str, port: int, api_keys: int,
                     metrics_keys: int = 0, tenants: int = 0) -> str:
    """The lines ``asyncinfer serve`` prints before it loads: one model per spec, with its plan.
    ``api_keys``: every accepted key, ``tenants`` of them with a tenant (``--tenant``).
    ``/metrics`` is listed only where it is served: without API keys, or with a metrics key."""
    from asyncinfer.memory import MemoryPlan, format_bytes

    base = url(host, port)
    metrics_on = metrics_keys > 0 or api_keys == 0
    also = f"{base}/health" + (f", {base}/metrics" if metrics_on else "")
    lines = [f"asyncinfer serve: loading, then serving the OpenAI API at {base}/v1 (also {also})"]
    for spec, plan in zip(specs, plans):
        path = _path(spec.model)
        if isinstance(plan, MemoryPlan):
            dtype, device, fmt = weight_format(path, dict(spec.options))
            options = dict(spec.options)
            scheduler = options.get("scheduler", "fifo")
            extra = options.get("scheduler_options")
            lines += [
                f"  model {spec.name!r}: {path}",
                f"    weights: {fmt}, {format_bytes(plan.weight_bytes)} ({dtype} on {device})",
                f"    context: {plan.max_model_len} tokens per request (prompt + output)",
                (f"    KV cache: {format_bytes(plan.kv_bytes)}, {plan.kv_token_capacity} tokens ({plan.num_blocks} "
                 f"blocks of {plan.block_size})" + (", memory committed as it is used" if device == "cpu" else "")),
                f"    scheduler: {scheduler}" + (f" {extra}" if extra else ""),
            ]
        else:
            lines += [f"  embedding model {spec.name!r}: {path}", f"    {plan.describe()}"]
    lines.append(structured_line())
    with_tenant = f", {tenants} with a tenant" if tenants else ""
    lines.append(f"  API keys: on ({api_keys} accepted{with_tenant})" if api_keys else
                 "  API keys: off (anyone who reaches the port may call it; --api-key or ASYNCINFER_API_KEY)")
    if metrics_keys:
        lines.append(f"  /metrics: with a metrics key ({metrics_keys} accepted)")
    elif not metrics_on:
        lines.append("  /metrics: off (API keys are on and no --metrics-key names an operator's key)")
    if metrics_on and specs and dict(specs[0].options).get("enable_metrics") is False:  # the engine's option: its first
        lines.append("  engine metrics: off (--no-enable-metrics: /metrics has gauges and HTTP answers, no request, "
                     "token or latency figures)")
    return "\n".join(lines)


def structured_line() -> str:
    """Whether structured output (``response_format``, ``guided_*``, constrained tool calls) can run here:
    it needs the grammar library, llguidance; without it such requests get a 501 ``not_implemented``.

    Its import (transformers, seconds) holds Ctrl-C back until it is done: a ``KeyboardInterrupt`` raised in
    one of its modules' finalizers (``regex``'s) is swallowed there, and the server went on to serve.
    """
    from asyncinfer._interrupts import deferred_interrupts
    from asyncinfer.grammar import library_missing

    with deferred_interrupts():
        missing = library_missing()
    if missing is None:
        return "  structured output: on (llguidance)"
    return ("  structured output: off (llguidance is not installed: pip install 'asyncinfer[structured]'; "
            "such requests get a 501)")


def _path(model: str | None) -> Path:
    from asyncinfer.model_source import resolve_model

    return resolve_model(model)


def weight_format(path: Path, options: dict[str, Any]) -> tuple[str, str, str]:
    """``(dtype, device, weight format)`` of a generator loaded from ``path`` with ``options``, from its
    config alone: ``quantization="auto"`` made concrete for the file as the load makes it."""
    from asyncinfer.config import EngineConfig, for_model
    from asyncinfer.models.loader import read_model_config

    config = for_model(EngineConfig.from_options(options), options, read_model_config(path), warn=False)
    dtype = str(config.dtype).removeprefix("torch.")
    fmt = config.quantization or f"{dtype} (the dtype)"
    if config.activation_dtype != "int16" and config.quantization not in (None, "float16", "bfloat16", "int8"):
        fmt += f", {config.activation_dtype} activations"  # the block formats' kernels round them so
    return dtype, str(config.device), fmt
