"""``asyncinfer serve`` before it serves: a port in use is refused before any model is touched, and the start
prints what will be served (URL, model name, path, weight format, context, KV budget, scheduler, API keys),
figures that equal the engine's own plan."""

from __future__ import annotations

import socket

import pytest

import asyncinfer.server
from asyncinfer import AsyncEngine, cli
from asyncinfer.memory import format_bytes


def test_a_port_in_use_is_refused_before_the_model_is_touched(tmp_path, capsys, monkeypatch) -> None:
    def no_model(*args, **kwargs):
        raise AssertionError("the model was read before the port was checked")

    monkeypatch.setattr(AsyncEngine, "plan_memory", no_model)
    monkeypatch.setattr(AsyncEngine, "from_pretrained", no_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", str(tmp_path / "no-such-model"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == (f"asyncinfer: error: port {port} on 127.0.0.1 is in use (another server listens on "
                   f"127.0.0.1:{port}?): stop it, or choose another with --port\n")


def test_a_bad_host_or_port_is_one_line(tmp_path, capsys) -> None:
    assert cli.main(["serve", str(tmp_path / "m"), "--port", "70000"]) == 2
    assert capsys.readouterr().err == "asyncinfer: error: --port 70000 is not a TCP port (0 to 65535)\n"
    assert cli.main(["serve", str(tmp_path / "m"), "--host", "no-such-host.invalid", "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith("asyncinfer: error: --host 'no-such-host.invalid' is not an address")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_start_says_what_it_serves(tiny_models, capsys, monkeypatch) -> None:
    served = []
    monkeypatch.setattr(asyncinfer.server, "run_server", lambda app, host, port, level, settings=None, sock=None: served.append((host, port)))
    monkeypatch.delenv("ASYNCINFER_API_KEY", raising=False)
    monkeypatch.delenv("ASYNCINFER_METRICS_KEY", raising=False)
    path = tiny_models["llama"][0]
    port = free_port()
    options = ["--max-model-len", "64", "--kv-cache-memory", "1MiB", "--device", "cpu", "--scheduler", "pd-split",
               "--scheduler-option", "prefill_budget=32", "--max-waiting-requests", "4"]
    assert cli.main(["serve", str(path), "--port", str(port), "--served-model-name", "tiny", *options,
                     "--api-key", "k1", "--api-key", "k2"]) == 0
    assert served == [("127.0.0.1", port)]
    plan = AsyncEngine.plan_memory(path, max_model_len=64, kv_cache_memory=1 << 20, device="cpu")
    assert capsys.readouterr().out.splitlines() == [
        (f"asyncinfer serve: loading, then serving the OpenAI API at http://127.0.0.1:{port}/v1 (also "
         f"http://127.0.0.1:{port}/health)"),  # no /metrics: with API keys and no metrics key it is off
        f"  model 'tiny': {path}",
        f"    weights: float16, {format_bytes(plan.weight_bytes)} (float32 on cpu)",
        "    context: 64 tokens per request (prompt + output)",
        (f"    KV cache: {format_bytes(plan.kv_bytes)}, {plan.kv_token_capacity} tokens ({plan.num_blocks} blocks of 16), "
         "memory committed as it is used"),
        "    scheduler: pd-split {'prefill_budget': 32}",
        "  structured output: on (llguidance)",  # llguidance is installed here ([dev])
        "  API keys: on (2 accepted)",
        "  /metrics: off (API keys are on and no --metrics-key names an operator's key)",
    ]
    assert plan.kv_bytes == 1 << 20 and plan.max_model_len == 64
    assert cli.main(["serve", str(path), "--port", str(port), "--dtype", "float32", "--max-model-len", "64",
                     "--kv-cache-memory", "1MiB"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(f"(also http://127.0.0.1:{port}/health, http://127.0.0.1:{port}/metrics)")  # open
    assert out[1] == f"  model '{path.name}': {path}"  # the directory's name, as /v1/models lists it
    assert out[2].startswith("    weights: float32 (the dtype), ")
    assert out[-3:] == ["    scheduler: fifo", "  structured output: on (llguidance)",
                        "  API keys: off (anyone who reaches the port may call it; --api-key or ASYNCINFER_API_KEY)"]
    for keys in (["--api-key", "k1"], []):
        assert cli.main(["serve", str(path), "--port", str(port), "--dtype", "float32", "--max-model-len", "64",
                         "--kv-cache-memory", "1MiB", *keys, "--metrics-key", "ops-secret-7f3"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].endswith(f"(also http://127.0.0.1:{port}/health, http://127.0.0.1:{port}/metrics)")
        assert out[-1] == "  /metrics: with a metrics key (1 accepted)" and "ops-secret-7f3" not in "\n".join(out)


@pytest.mark.real_model
def test_the_start_names_the_default_model_s_file_and_format(real_gguf, capsys, monkeypatch) -> None:
    monkeypatch.setattr(asyncinfer.server, "run_server", lambda *args, **kwargs: None)
    monkeypatch.setenv("ASYNCINFER_MODEL", str(real_gguf))
    assert cli.main(["serve", "--port", str(free_port()), "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"  model 'SmolLM2-135M-Instruct': {real_gguf}"
    from asyncinfer import kernels

    if kernels.auto_reason() is None:  # the file's own format where the kernels run (else float16)
        assert out[2].startswith("    weights: q4_1, 92.1 MiB (float32 on cpu)"), out[2]
    assert cli.main(["serve", "--port", str(free_port()), "--max-model-len", "256", "--activation-dtype", "int8"]) == 0
    out = capsys.readouterr().out.splitlines()
    if kernels.auto_reason() is None:  # activation_dtype is named where a block format takes it
        assert out[2].startswith("    weights: q4_1, int8 activations, 92.1 MiB (float32 on cpu)"), out[2]


@pytest.mark.parametrize(("flags", "said"), [
    (["--scheduler", "nosuch"], "asyncinfer: error: --scheduler 'nosuch' is invalid: allowed one of "),
    (["--scheduler", "pd-split", "--scheduler-option", "bogus=1"],
     ("asyncinfer: error: --scheduler-option bogus=1 is invalid: allowed keywords scheduler pd-split takes: "
      "prefill_budget (")),
    (["--scheduler-option", "prefill_budget=64"],
     ("asyncinfer: error: --scheduler-option prefill_budget=64 is invalid: allowed keywords scheduler fifo takes: "
      "none (")),
])
@pytest.mark.parametrize("command", ["serve", "chat", "generate", "bench", "info"])
def test_a_bad_scheduler_is_refused_before_the_model_is_loaded(command, flags, said, tiny_models, capsys,
                                                               monkeypatch, tmp_path) -> None:
    import asyncinfer.loading

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the scheduler was checked")

    monkeypatch.setattr(asyncinfer.loading, "load_generator", no_load)
    monkeypatch.setattr(asyncinfer.loading, "plan_memory", no_load)
    monkeypatch.setattr(asyncinfer.server, "run_server", no_load)
    path = str(tiny_models["llama"][0])
    extra = {"serve": ["--port", str(free_port())], "chat": ["hi"], "info": [],
             "generate": ["--prompt", "hi"], "bench": []}[command]
    argv = [command, "--model", path, *flags, *extra] if command in ("chat", "generate") else \
        [command, path, *flags, *extra]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(said) and captured.err.count("\n") == 1, captured.err
    assert "loading" not in captured.out  # serve says nothing of what it would serve
    if command == "info":  # no "model:" or "architecture:" line before the error
        assert captured.out == ""


def test_a_second_serve_on_the_port_fails_at_once_while_the_first_loads(tiny_models, capsys, monkeypatch) -> None:
    """The first serve holds its port (bound, listening) from before its load to the end; a second one started
    during that load is refused with the port's one line, before it reads any model."""
    path = str(tiny_models["llama"][0])
    options = ["--max-model-len", "64", "--kv-cache-memory", "1MiB", "--device", "cpu", "--dtype", "float32"]
    port = free_port()
    second: list[tuple[int, str, int]] = []
    plans: list[object] = []
    real_plan = AsyncEngine.plan_memory

    def plan_memory(*args, **kwargs):
        plans.append(args)
        return real_plan(*args, **kwargs)

    def first_serves(app, host, port_, level, settings=None, sock=None):
        # The app's start-up (the model's load) runs in here, before uvicorn would bind: start the second now.
        assert sock is not None and sock.getsockname() == ("127.0.0.1", port) and port_ == port
        capsys.readouterr()
        loaded = len(plans)
        status = cli.main(["serve", path, "--port", str(port), *options])
        second.append((status, capsys.readouterr().err, len(plans) - loaded))
        return False

    monkeypatch.setattr(AsyncEngine, "plan_memory", plan_memory)
    monkeypatch.setattr(asyncinfer.server, "run_server", first_serves)
    assert cli.main(["serve", path, "--port", str(port), *options]) == 0
    refused = (f"asyncinfer: error: port {port} on 127.0.0.1 is in use (another server listens on 127.0.0.1:{port}?): "
               "stop it, or choose another with --port\n")
    assert second == [(2, refused, 0)]
    with socket.socket() as again:  # released when serve ends
        again.bind(("127.0.0.1", port))


def test_errors_name_the_flags_not_the_fields(tiny_models, capsys, monkeypatch) -> None:
    """A serve setting or an engine option given as a flag is named by its flag, in the one line."""
    def no_load(*args, **kwargs):
        raise AssertionError("served")

    monkeypatch.setattr(asyncinfer.server, "run_server", no_load)
    monkeypatch.delenv("ASYNCINFER_API_KEY", raising=False)
    path = str(tiny_models["llama"][0])
    assert cli.main(["serve", path, "--port", str(free_port()), "--api-key", ""]) == 2
    assert capsys.readouterr().err == "asyncinfer: error: --api-key '' is invalid: allowed a non-empty key\n"
    assert cli.main(["serve", path, "--port", str(free_port()), "--max-connections", "0"]) == 2
    assert capsys.readouterr().err == "asyncinfer: error: --max-connections 0 is invalid: allowed an integer >= 1\n"
    for command in (["serve", path, "--port", str(free_port())], ["chat", "--model", path, "hi"]):
        assert cli.main([*command, "--kv-cache-memory", "1KiB", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("asyncinfer: error: the KV cache holds 0 blocks") and err.count("\n") == 1, err
        assert "one request of --max-model-len=" in err
        assert err.endswith("Raise --kv-cache-memory / --kv-cache-fraction or lower --max-model-len.\n")
    assert cli.main(["info", path, "--kv-cache-memory", "1KiB", "--device", "cpu"]) == 1
    assert "Raise --kv-cache-memory / --kv-cache-fraction or lower --max-model-len." in capsys.readouterr().out


def test_the_banner_says_when_structured_output_is_off(monkeypatch) -> None:
    """Without llguidance the start-up lines say so (each structured request is then a 501)."""
    import asyncinfer.grammar
    from asyncinfer.commands.serve import structured_line

    monkeypatch.setattr(asyncinfer.grammar, "library_missing", lambda: "structured output needs llguidance: gone")
    assert structured_line() == ("  structured output: off (llguidance is not installed: pip install "
                                 "'asyncinfer[structured]'; such requests get a 501)")


def test_the_embedding_model_must_be_an_encoder_of_its_own_name(tiny_models, minilm_dir, capsys, monkeypatch) -> None:
    """A generator given to --embedding-model was loaded as a second chat model; one served under the main
    model's name failed the start-up with a traceback (exit status 3) after the first model had loaded.
    Both are refused in one line before anything loads."""
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(asyncinfer.server, "create_app", no_load)
    generator = str(tiny_models["llama"][0])
    assert cli.main(["serve", generator, "--port", "0", "--embedding-model", generator]) == 2
    assert capsys.readouterr().err == (f"asyncinfer: error: --embedding-model {generator!r} is a generator (a text "
                                       "generation model), not a sentence encoder: give it a sentence encoder, "
                                       "e.g. all-MiniLM-L6-v2\n")
    encoder = str(minilm_dir)
    name = asyncinfer.server.ModelSpec.served_name(encoder)
    assert cli.main(["serve", generator, "--port", "0", "--embedding-model", encoder,
                     "--served-model-name", name]) == 2
    assert capsys.readouterr().err.startswith(f"asyncinfer: error: --embedding-model {encoder!r} would be served as "
                                              f"{name!r}, the name of the model served")


def test_max_body_bytes_takes_a_size_as_the_other_size_flags_do() -> None:
    """``--max-body-bytes 8MiB`` reads as ``--kv-cache-memory 8MiB`` does (it was "invalid int value: '8MiB'")."""
    parser = cli.build_parser()
    assert parser.parse_args(["serve", "--max-body-bytes", "8MiB"]).max_body_bytes == 8 * 1024 * 1024
    assert parser.parse_args(["serve", "--max-body-bytes", "65536"]).max_body_bytes == 65536
    assert parser.parse_args(["serve"]).max_body_bytes == 4 * 1024 * 1024


def test_max_body_bytes_refuses_a_non_size_in_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--max-body-bytes", "lots", "--port", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--max-body-bytes" in err and "'lots' is not a size" in err and err.count("\n") == 1, err


def test_serve_setting_errors_name_flags_inside_the_message_too(capsys, monkeypatch) -> None:
    """The allowed values and the shown value speak of ``--api-key``, not of the ``api_keys`` field (the line
    said "allowed 'off' or 'header' when no api_keys are set", a name a command-line user never sees)."""
    monkeypatch.delenv("ASYNCINFER_API_KEY", raising=False)
    monkeypatch.delenv("ASYNCINFER_METRICS_KEY", raising=False)
    assert cli.main(["serve", "--port", "0", "--cache-isolation", "api-key"]) == 2
    err = capsys.readouterr().err
    assert err == ("asyncinfer: error: --cache-isolation 'api-key' is invalid: allowed 'off' or 'header' when no "
                   "--api-key / --tenant (or ASYNCINFER_API_KEY) is given\n"), err
    assert cli.main(["serve", "--port", "0", "--api-key", "k", "--metrics-key", "k"]) == 2
    err = capsys.readouterr().err
    assert "api_keys" not in err and "tenants" not in err and "--api-key" in err, err


@pytest.mark.parametrize(("level", "shown"), [(None, True), ("debug", True), ("warning", False)])
def test_serve_prints_the_per_request_log_lines_at_info(level, shown, tiny_models, capsys, monkeypatch) -> None:
    """The ``asyncinfer.requests`` line of each finished request (tokens, time to first token, latency, and the
    texts at ``--log-request-text-rate``) is printed at ``--log-level info`` (the default) and below. Before,
    serve configured no handler for it: ``--log-request-text-rate 1`` changed nothing anyone could see."""
    import logging

    def run_server(app, host, port, level, settings=None, sock=None):
        logging.getLogger("asyncinfer.requests").info("request finished id=r-1 finish_reason=length")
        return False

    monkeypatch.setattr(asyncinfer.server, "run_server", run_server)
    monkeypatch.delenv("ASYNCINFER_API_KEY", raising=False)
    flags = [] if level is None else ["--log-level", level]
    logger = logging.getLogger("asyncinfer.requests")
    handlers, level = list(logger.handlers), logger.level
    assert cli.main(["serve", str(tiny_models["llama"][0]), "--port", str(free_port()), "--max-model-len", "64",
                     "--kv-cache-memory", "1MiB", "--device", "cpu", "--log-request-text-rate", "1", *flags]) == 0
    err = capsys.readouterr().err
    assert ("INFO:     request finished id=r-1 finish_reason=length\n" in err) is shown, err
    assert (logger.handlers, logger.level) == (handlers, level)  # left as it was once the server stops


def test_tenant_flag_gives_a_key_its_tenant_and_priority(tiny_models, capsys, monkeypatch) -> None:
    """``--tenant KEY=NAME[:PRIORITY]`` is ``ServerSettings.tenants`` on the command line: with the default
    ``--tenant-from api-key`` it was the only source of a tenant, and only Python could set it."""
    from asyncinfer.server import Tenant

    got = []
    monkeypatch.setattr(asyncinfer.server, "run_server",
                        lambda app, host, port, level, settings=None, sock=None: got.append(settings))
    monkeypatch.delenv("ASYNCINFER_API_KEY", raising=False)
    monkeypatch.delenv("ASYNCINFER_METRICS_KEY", raising=False)
    assert cli.main(["serve", str(tiny_models["llama"][0]), "--port", str(free_port()), "--max-model-len", "64",
                     "--kv-cache-memory", "1MiB", "--device", "cpu", "--api-key", "sk-plain",
                     "--tenant", "sk-acme=acme", "--tenant", "sk-vip=vip:-5", "--tenant", "sk-b64==team:a"]) == 0
    (settings,) = got
    assert settings.tenants == {"sk-acme": Tenant("acme"), "sk-vip": Tenant("vip", -5), "sk-b64=": Tenant("team:a")}
    assert set(settings.accepted_keys) == {"sk-plain", "sk-acme", "sk-vip", "sk-b64="}
    assert "  API keys: on (4 accepted, 3 with a tenant)" in capsys.readouterr().out.splitlines()
    for bad in ("sk-x", "=acme", "sk-x=", "sk-x=acme:99999999999"):
        with pytest.raises(SystemExit) as exited:
            cli.main(["serve", "--port", "0", "--tenant", bad])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("asyncinfer: error: argument --tenant: ") and err.count("\n") == 1, err
        assert bad.split("=")[0] not in err or not bad.split("=")[0], err  # the key is never echoed


def test_an_empty_served_model_name_is_refused_not_ignored(tmp_path, capsys, monkeypatch) -> None:
    """``--served-model-name ''`` served the model under its default name, as if the flag were not given."""
    def no_model(*args, **kwargs):
        raise AssertionError("the model was read")

    monkeypatch.setattr(AsyncEngine, "plan_memory", no_model)
    assert cli.main(["serve", str(tmp_path / "m"), "--port", "0", "--served-model-name", ""]) == 2
    assert capsys.readouterr().err == ("asyncinfer: error: --served-model-name '' is invalid: allowed a non-empty "
                                       "string of at most 200 characters\n")
