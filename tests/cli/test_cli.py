"""The ``asyncinfer`` command: --help and --version everywhere, library defaults, one-line errors,
``generate``, ``bench``, ``info`` and ``lab`` (in-process; ``chat`` as a process is test_chat.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import asyncinfer
from asyncinfer import AsyncEngine, SamplingParams, cli
from tests.helpers import sigint_not_ignored

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["chat", "generate", "bench", "info", "plan", "embed", "lab", "serve"]


@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]])
def test_every_command_has_help(command, capsys) -> None:
    with pytest.raises(SystemExit) as end:
        cli.main([*command, "--help"])
    assert end.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: asyncinfer") and "--help" in out
    if command == []:
        assert all(c in out for c in COMMANDS)
    if command == ["plan"]:  # its exit status when the plan does not fit
        assert "Exit status 0 when the plan fits the device memory, 1 when it does not" in out


def test_version_and_python_dash_m() -> None:
    result = subprocess.run([sys.executable, "-m", "asyncinfer", "--version"], capture_output=True, text=True,
                            check=True, cwd=ROOT)
    assert result.stdout.startswith(f"asyncinfer {asyncinfer.__version__} (torch ")


def test_no_flag_means_the_library_default() -> None:
    parser = cli.build_parser()
    for command in (["chat"], ["generate", "--prompt", "x"], ["bench"], ["info"], ["serve"]):
        assert cli._engine_options(parser.parse_args(command)) == {}, command
    args = parser.parse_args(["chat"])
    assert cli._sampling_params(args) == SamplingParams()
    args = parser.parse_args(["chat", "--max-model-len", "512", "--scheduler", "aging-priority", "--threads", "2",
                              "--quantization", "int8", "--scheduler-option", "aging_rate=0.5", "--temperature",
                              "0.7", "--top-k", "5", "--stop", "END", "--stop", "\n\n", "--seed", "3",
                              "--torch-compile"])
    assert cli._engine_options(args) == {"max_model_len": 512, "scheduler": "aging-priority", "num_threads": 2,
                                         "quantization": "int8", "scheduler_options": {"aging_rate": 0.5},
                                         "torch_compile": True}
    assert cli._sampling_params(args) == SamplingParams(temperature=0.7, top_k=5, stop=["END", "\n\n"], seed=3)
    assert cli._engine_options(parser.parse_args(["chat", "--quantization", "none"])) == {"quantization": None}


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_errors_are_one_line(tmp_path, capsys, monkeypatch) -> None:
    assert cli.main(["info", str(tmp_path / "missing")]) == 2
    assert one_line_error(capsys).startswith("asyncinfer: error: model path")
    assert cli.main(["chat", "hi", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in one_line_error(capsys)
    bad = tmp_path / "bad.jsonl"
    for line, message in (('{"prompt": "x"}\nnot json\n', "line 2: not JSON"),
                          ('{"prompt": "x", "max_tokens": 0}\n', "line 1: max_tokens=0 is invalid"),
                          ('{"prompt": "x", "maxtokens": 3}\n', "line 1: unknown key(s) \"maxtokens\""),
                          ('{"promt": "y"}\n', "line 1: unknown key(s) \"promt\""),
                          ('{"text": "x"}\n', "line 1: unknown key(s) \"text\": the keys are prompt, messages"),
                          ('{"id": "x"}\n', "line 1: expected an object with 'prompt' or 'messages'")):
        bad.write_text(line)
        assert cli.main(["generate", "--file", str(bad)]) == 2
        assert message in one_line_error(capsys)
    assert cli.main(["generate", "--file", str(tmp_path / "none.jsonl")]) == 2
    assert one_line_error(capsys) == f"asyncinfer: error: --file {tmp_path / 'none.jsonl'}: No such file or directory\n"
    bad.write_text('{"prompt": "x"}\n')
    out = tmp_path / "no-dir" / "out.jsonl"
    assert cli.main(["generate", "--file", str(bad), "--output", str(out)]) == 2
    assert one_line_error(capsys) == f"asyncinfer: error: --output {out}: No such file or directory\n"
    assert cli.main(["bench", "--concurrency", "0,2"]) == 2
    assert "--concurrency" in one_line_error(capsys)

    def broken(args):
        raise RuntimeError("something unexpected")

    monkeypatch.setattr(cli, "_info", broken)
    assert cli.main(["info"]) == 1
    assert one_line_error(capsys) == ("asyncinfer: internal error: RuntimeError: something unexpected "
                                      "(ASYNCINFER_DEBUG=1 shows the traceback)\n")
    monkeypatch.setenv("ASYNCINFER_DEBUG", "1")
    with pytest.raises(RuntimeError):
        cli.main(["info"])


def test_the_default_model_is_named_when_its_load_fails(tmp_path, capsys, monkeypatch) -> None:
    """A command without a model loads the default one: a failure names it (and its file), never 'None'."""
    missing = tmp_path / "gone.gguf"
    monkeypatch.setenv("ASYNCINFER_MODEL", str(missing))
    assert cli.main(["chat", "hi", "--max-tokens", "1"]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"asyncinfer: error: loading the default model ({missing}) failed: ") and "None" not in err


def cli_processes(*runs: tuple[tuple[str, ...], dict[str, str]]) -> list[subprocess.CompletedProcess]:
    """``python -m asyncinfer ARGS`` for each (ARGS, environment additions) of ``runs``, all started at once (each
    spends seconds importing torch: side by side they share the cores), in order of ``runs``."""
    procs = []
    for args, env in runs:
        full = {**os.environ, "ASYNCINFER_DISABLE_KERNELS": "0", **env}
        procs.append(subprocess.Popen([sys.executable, "-m", "asyncinfer", *args], env=full, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def test_a_bad_kernel_isa_is_the_users_error_on_every_command(tiny_models) -> None:
    """ASYNCINFER_KERNEL_ISA naming no variant (or one this CPU lacks): a block format is refused in one line
    naming the parameter and the variable (status 2, as for any other user error); info says why the kernels
    cannot run and plans the fallback weight format."""
    from asyncinfer import kernels

    path = str(tiny_models["llama"][0])
    lacking = [isa for isa in ("avx512vnni", "avx512", "avx2") if isa not in kernels.supported_isas()]
    values = ["bogus", *lacking[:1]]
    *refused, chat, info = cli_processes(
        *[(("info", path, "--quantization", "q8_0"), {"ASYNCINFER_KERNEL_ISA": value}) for value in values],
        (("chat", "hi", "--model", path, "--quantization", "q4_1"), {"ASYNCINFER_KERNEL_ISA": "bogus"}),
        (("info", path), {"ASYNCINFER_KERNEL_ISA": "bogus"}),
    )
    for value, proc in zip(values, refused, strict=True):
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("asyncinfer: error: --quantization 'q8_0' is invalid") and \
            f"ASYNCINFER_KERNEL_ISA={value!r}" in proc.stderr, proc.stderr
    assert chat.returncode == 2 and chat.stderr.count("\n") == 1, chat.stderr
    assert "--quantization 'q4_1'" in chat.stderr and "ASYNCINFER_KERNEL_ISA='bogus'" in chat.stderr, chat.stderr
    assert info.returncode == 0, info.stderr
    assert "kernels: unavailable (ASYNCINFER_KERNEL_ISA='bogus' names no kernel variant" in info.stdout, info.stdout


def test_a_kernel_isa_error_reaching_the_command_is_a_user_error(capsys, monkeypatch) -> None:
    """kernels.KernelISAError, raised or the cause of another error, is one line and status 2, not an internal
    error."""
    from asyncinfer.kernels import KernelISAError

    def bad_variant(args):
        raise KernelISAError("variant 'avx512': this CPU runs only scalar, avx2")

    def wrapped(args):
        try:
            bad_variant(args)
        except KernelISAError as exc:
            raise RuntimeError("asyncinfer's kernels cannot run here") from exc

    for broken in (bad_variant, wrapped):
        monkeypatch.setattr(cli, "_info", broken)
        assert cli.main(["info"]) == 2
        err = one_line_error(capsys)
        assert err.startswith("asyncinfer: error: ") and "internal error" not in err, err


def test_info_of_a_model_that_does_not_fit_shows_its_shapes_and_why(tmp_path, capsys) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["info", str(tmp_path), "--device", "cpu"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "architecture: llama, 80 layers, hidden 8192, heads 64/8 kv, vocab 128256, context 8192"
    assert out[2].startswith("memory plan: the model does not fit: its weights need 133.4 GiB (float16 weights) but ")
    assert out[2].endswith(f"(asyncinfer plan {tmp_path} shows the whole budget)")


MESSAGES_ERROR = "'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} dicts (strings)"


@pytest.mark.parametrize("line, message", [
    ('{"messages": [], "max_tokens": 2}', f"line 1: {MESSAGES_ERROR}, not []"),
    ('{"messages": "hello"}', f"line 1: {MESSAGES_ERROR}, not \"hello\""),
    ('{"messages": ["hi"]}', f"line 1: {MESSAGES_ERROR}, not [\"hi\"]"),
    ('{"messages": [{"role": "user"}]}', f"line 1: {MESSAGES_ERROR}, not [{{\"role\": \"user\"}}]"),
    ('{"messages": [{"role": "user", "content": 3}]}', "line 1: 'messages' must be"),
    ('{"prompt": "x", "id": NaN}', "line 1: not JSON (NaN is not a JSON number)"),
    ('{"prompt": "x", "id": -Infinity}', "line 1: not JSON (-Infinity is not a JSON number)"),
    ('{"prompt": "x", "id": 1e400}', "line 1: not JSON (1e400 is out of a float's range)"),
    ('{"prompt": "x", "id": 1.5}', "line 1: 'id' must be a string or an integer, not 1.5"),
    ('{"prompt": "x", "id": true}', "line 1: 'id' must be a string or an integer, not true"),
    ('{"prompt": "x", "id": null}', "line 1: 'id' must be a string or an integer, not null"),
    ('{"prompt": "x", "id": ["a"]}', "line 1: 'id' must be a string or an integer, not [\"a\"]"),
])
def test_generate_refuses_a_bad_line_before_loading_the_model(line, message, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    assert cli.main(["generate", str(tmp_path / "no-model"), "--file", str(bad)]) == 2
    assert one_line_error(capsys).startswith(f"asyncinfer: error: {bad} {message}")


def test_generate_refuses_a_file_that_is_not_utf8(tmp_path, capsys) -> None:
    bad = tmp_path / "latin.jsonl"
    bad.write_bytes(b'{"prompt": "x"}\n\xff\xfe{"prompt": "x"}\n')
    assert cli.main(["generate", str(tmp_path / "no-model"), "--file", str(bad)]) == 2
    assert one_line_error(capsys) == (f"asyncinfer: error: {bad}: not UTF-8 text (invalid start byte 0xff); "
                                      "save it as UTF-8\n")


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(("flags", "message"), [
    (["--max-tokens", "-3"], "--max-tokens -3 is invalid: allowed an integer >= 1"),
    (["--temperature", "-1"], "--temperature -1 is invalid: allowed a number in [0, 10000] (0 = greedy)"),
    (["--top-p", "2"], "--top-p 2 is invalid: allowed a number in (0, 1]"),
    (["--stop", "a", "--stop", ""], "--stop '' is invalid: allowed a non-empty string"),
])
def test_a_bad_sampling_flag_is_named_by_its_flag(command, flags, message, tmp_path, capsys) -> None:
    argv = ["generate", "--prompt", "hi"] if command == "generate" else ["chat", "hi"]
    assert cli.main([*argv, "--model", str(tmp_path / "no-model"), *flags]) == 2
    assert one_line_error(capsys) == f"asyncinfer: error: {message}\n"


def test_bench_concurrency_is_repeatable() -> None:
    from asyncinfer.commands.bench import _levels

    def levels(*argv: str) -> list[int]:
        return _levels(cli.build_parser().parse_args(["bench", *argv]).concurrency)

    assert levels() == [1, 4, 16]
    assert levels("--concurrency", "1", "--concurrency", "2,4") == [1, 2, 4]
    assert levels("--concurrency", "4,1", "--concurrency", "1,8") == [4, 1, 8]


def test_embed_given_a_generator_names_the_flag(tiny_models, capsys, monkeypatch) -> None:
    """Refused from the model's config, before any weight is read (the generator was loaded whole, then refused)."""
    async def no_load(*args, **kwargs):
        raise AssertionError("the generator was loaded before it was refused")

    monkeypatch.setattr(AsyncEngine, "load", no_load)
    path = str(tiny_models["llama"][0])
    assert cli.main(["embed", "--model", path, "--device", "cpu", "hi"]) == 2
    assert one_line_error(capsys) == (f"asyncinfer: error: --model {path!r} is a generator (a text generation "
                                      "model), not a sentence encoder: give --model a sentence encoder, e.g. "
                                      "all-MiniLM-L6-v2 (the default)\n")


def test_info_plans_from_the_config(tiny_models, capsys) -> None:
    path = tiny_models["llama"][0]
    assert cli.main(["info", str(path), "--max-model-len", "64", "--kv-cache-memory", str(1 << 20)]) == 0
    out = capsys.readouterr().out
    plan = AsyncEngine.plan_memory(path, max_model_len=64, kv_cache_memory=1 << 20)
    assert f"memory plan: {plan.describe()}" in out and "no weight read" in out
    # stranger68: "needs X in all" left out torch and Python, 25-33% under the peak measured at the same flags
    from asyncinfer.memory import format_bytes
    from asyncinfer.planner import OVERHEAD_BYTES

    engine_bytes = plan.weight_bytes + plan.kv_bytes + plan.activation_reserve
    assert (f"needs {format_bytes(engine_bytes + OVERHEAD_BYTES['cpu'])} in all: {format_bytes(engine_bytes)} for the "
            f"weights, KV cache and activation reserve, and an estimated {format_bytes(OVERHEAD_BYTES['cpu'])} for "
            "torch, Python, the tokenizer and a server") in out, out
    assert "architecture: llama, 2 layers, hidden 64, heads 4/2 kv, vocab 320, context 512" in out
    assert "dtype float32 on cpu, weight format: float16" in out  # the CPU default for a safetensors model
    from asyncinfer import kernels

    if kernels.available():  # the variant and where its library came from
        info = kernels.build_info()
        where = "installed" if info["source"] == "installed" else f"run-time build, {info['path']}"
        assert f"kernels: {kernels.isa()} ({where})" in out, out
    else:
        assert f"kernels: unavailable ({kernels.unavailable_reason()})" in out, out
    assert cli.main(["info", str(path), "--dtype", "float32", "--max-model-len", "64"]) == 0
    assert "weight format: the dtype" in capsys.readouterr().out


@pytest.mark.real_model
def test_info_and_plan_name_the_gguf_s_own_format(real_gguf, capsys) -> None:
    """The default model's file holds Q4_1 blocks: "auto" is q4_1 there, in what info says and in what plan
    accepts and counts (the same bytes as the engine's plan)."""
    assert cli.main(["info", str(real_gguf), "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "weight format: q4_1" in out and "weights 92.1 MiB" in out  # no float32 embedding beside the head
    for fmt, size in (("q4_1", "92.1 MiB"), ("q8_0", "136.4 MiB")):
        assert cli.main(["plan", str(real_gguf), "--quantization", fmt, "--seq-len", "256",
                         "--device-memory", "8GiB"]) == 0
        assert size in capsys.readouterr().out


@pytest.mark.real_model
def test_generate_writes_every_result_in_input_order(real_gguf, tmp_path, capsys) -> None:
    chat = [{"role": "user", "content": "Say hi."}]
    lines = [{"prompt": "The capital of France is", "max_tokens": 6}, {"messages": chat, "id": "chat-1"},
             "Once upon a time", {"prompt": [1, 2, 3], "max_tokens": 5000}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(item) for item in lines) + "\n\n")
    out = tmp_path / "out.jsonl"
    code = cli.main(["generate", str(real_gguf), "--file", str(prompts), "--output", str(out), "--max-tokens", "10",
                     "--max-model-len", "1024"])
    assert code == 1  # one request refused, the others done
    assert "3 of 4 requests done" in capsys.readouterr().err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [0, "chat-1", 2, 3]
    assert "max_tokens=5000 is invalid" in records[3]["error"]

    async def expected():
        async with await AsyncEngine.load(real_gguf, max_model_len=1024) as engine:
            return [await engine.generate(p, SamplingParams(max_tokens=n))
                    for p, n in (("The capital of France is", 6), (chat, 10), ("Once upon a time", 10))]

    for record, want in zip(records, asyncio.run(expected())):
        assert record["text"] == want.text and record["finish_reason"] == want.finish_reason
        assert (record["prompt_tokens"], record["completion_tokens"]) == (len(want.prompt_token_ids),
                                                                          len(want.token_ids))


def test_bench_measures_and_compares_with_transformers(tiny_models, tmp_path, capsys) -> None:
    figures, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert cli.main(["bench", str(tiny_models["llama"][0]), "--num-requests", "3", "--input-len", "8",
                     "--output-len", "5", "--concurrency", "1,2", "--compare-transformers", "--json", str(figures),
                     "--plot", str(png), "--max-model-len", "64", "--kv-cache-memory", str(1 << 20)]) == 0
    out = capsys.readouterr().out
    assert "TTFT p50" in out and "transformers" in out
    rows = json.loads(figures.read_text())["rows"]
    assert [(r["system"], r["concurrency"]) for r in rows] == [
        ("asyncinfer", 1), ("asyncinfer", 2), ("transformers", 1), ("transformers", 2)]
    assert all(r["requests"] == 3 and r["output_tokens_per_s"] > 0 for r in rows)
    assert [r["same_tokens"] for r in rows[2:]] == ["3/3", "3/3"]  # greedy fp32: the same tokens
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_profile_writes_a_trace_and_the_top_ops(tiny_models, tmp_path, capsys) -> None:
    where = tmp_path / "prof"
    assert cli.main(["bench", str(tiny_models["llama"][0]), "--num-requests", "2", "--input-len", "8",
                     "--output-len", "4", "--concurrency", "2", "--profile", str(where), "--profile-steps", "6",
                     "--max-model-len", "64", "--kv-cache-memory", str(1 << 20)]) == 0
    out = capsys.readouterr().out
    assert f"profile of 6 steps at concurrency 2: {where / 'trace.json'}" in out
    assert out.index("TTFT p50") < out.index("profile of 6 steps")  # after the table, as --help says
    assert "(latencies in ms)" in out  # no transformers rows, no note about them
    assert json.loads((where / "trace.json").read_text())["traceEvents"]
    assert "Self CPU" in (where / "top_ops.txt").read_text() and "Self CPU" in out
    assert cli.main(["bench", "--profile-steps", "0"]) == 2
    assert cli.main(["bench", "--profile-steps", "10001"]) == 2  # refused before the benchmark, named
    assert "--profile-steps" in capsys.readouterr().err


def test_lab_writes_no_png_unless_asked_and_sees_plugins(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["lab", "--synthetic", "5", "--schedulers", "fifo"]) == 0
    assert list(tmp_path.iterdir()) == []
    plugin = tmp_path / "plugins" / "my_policies.py"
    plugin.parent.mkdir()
    plugin.write_text((ROOT / "examples" / "custom_scheduler.py").read_text())
    monkeypatch.syspath_prepend(str(plugin.parent))
    from importlib import metadata

    fake = metadata.EntryPoint("from-a-package", "asyncinfer.schedulers.fifo:FIFOScheduler", "asyncinfer.schedulers")
    real = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points",
                        lambda **kw: [fake] if kw.get("group") == "asyncinfer.schedulers" else real(**kw))
    capsys.readouterr()
    assert cli.main(["lab", "--plugin", "my_policies", "--list-schedulers"]) == 0
    names = capsys.readouterr().out.split()
    assert names[:4] == ["fifo", "length-bucket", "aging-priority", "pd-split"]
    assert {"fair-share", "from-a-package"} <= set(names[4:])
    # Again, the module already imported (its names registered before this call): still listed.
    assert cli.main(["lab", "--plugin", "my_policies", "--list-schedulers"]) == 0
    assert "fair-share" in capsys.readouterr().out.split()
    assert cli.main(["lab", "--plugin", "no_such_module"]) == 2
    assert "--plugin 'no_such_module'" in one_line_error(capsys)


def console_script(tmp_path: Path) -> Path:
    """The ``asyncinfer`` script pip writes for pyproject.toml's entry point (its template)."""
    import tomllib

    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["asyncinfer"]
    module, func = entry.split(":")
    script = tmp_path / "asyncinfer"
    script.write_text(f"import re\nimport sys\nfrom {module} import {func}\nif __name__ == '__main__':\n"
                      f"    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      f"    sys.exit({func}())\n")
    return script


@pytest.mark.parametrize("how", ["python -m", "console script"])
def test_ctrl_c_at_any_moment_is_one_line_and_status_130(how, tmp_path) -> None:
    """SIGINT during the imports (torch's: seconds), the parser's construction or the job (it waits
    for its input's end): status 130, nothing on stdout, at most one line on stderr, no traceback."""
    start = ["-m", "asyncinfer"] if how == "python -m" else [str(console_script(tmp_path))]
    # faulthandler: a process still running long after the signal is sent SIGABRT, and its threads' stacks say where
    # it waits
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "PYTHONFAULTHANDLER": "1"}
    for delay in (0.3, 0.6, 1.0, 1.5, 2.5, 4.0):
        read, write = os.pipe()  # the job's stdin, held open: it waits
        try:
            # SIGINT's disposition as a terminal gives it (default): a test run's worker may have it ignored, and a
            # child then inherits SIG_IGN, which Python (and this command) keeps, as POSIX has a background job do
            with sigint_not_ignored():
                proc = subprocess.Popen([sys.executable, *start, "generate", "--file", "-"], stdin=read,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            try:
                out, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)
                err = proc.communicate(timeout=60)[1]
                pytest.fail(f"still running 120 s after SIGINT at {delay} s; its stacks:\n{err[-8000:]}")
        finally:
            os.close(read)
            os.close(write)
        assert (proc.returncode, out) == (130, ""), (delay, err)
        assert "Traceback" not in err and err.count("\n") <= 1, (delay, err)


def test_a_plugin_in_the_working_directory_imports_from_the_console_script(tmp_path) -> None:
    """As under ``python -m``: ``asyncinfer lab --plugin examples.custom_scheduler`` from the repository root."""
    script = console_script(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(script), "lab", "--plugin", "examples.custom_scheduler",
                             "--list-schedulers"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "fair-share" in result.stdout.split()


def test_plan_takes_every_format_the_engine_takes(tiny_models, capsys) -> None:
    """--quantization has no list of its own: every engine format plans, anything else is named by the flag."""
    from asyncinfer.models.quant import CPU_FORMATS, check_quantization

    path = str(tiny_models["llama"][0])
    for fmt in CPU_FORMATS:
        try:
            check_quantization(fmt, __import__("torch").device("cpu"), __import__("torch").float32)
        except asyncinfer.InvalidParameterError:
            continue  # a block format whose kernel cannot run on this machine: the engine refuses it too
        assert cli.main(["plan", path, "--quantization", fmt, "--seq-len", "64", "--device-memory", "1GiB"]) == 0, fmt
        assert f"quantization={fmt!r}" in capsys.readouterr().out
    assert cli.main(["plan", path, "--quantization", "q9_9"]) == 2
    assert one_line_error(capsys).startswith("asyncinfer: error: --quantization 'q9_9' is invalid: allowed 'auto'")


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch 0 is invalid: allowed an integer >= 1"),
    (["--seq-len", "100000"], "--seq-len 100000 is invalid: allowed an integer >= 2 and <= 512"),
    # the engine's flag and its aliases, as typed (stranger60: --max-model-len was refused as --seq-len)
    (["--max-model-len", "100000"], "--max-model-len 100000 is invalid: allowed an integer >= 2 and <= 512"),
    (["-c", "100000"], "-c 100000 is invalid: allowed an integer >= 2 and <= 512"),
    (["--ctx-size", "600", "--seq-len", "100000"], "--seq-len 100000 is invalid"),  # the last one given
    (["--device-memory", "lots"], "--device-memory 'lots' is invalid: allowed a size such as 24GiB"),
    (["--block-size", "0"], "--block-size 0 is invalid"),
])
def test_plan_names_its_flags_in_errors(argv, message, tiny_models, capsys) -> None:
    assert cli.main(["plan", str(tiny_models["llama"][0]), *argv]) == 2
    assert one_line_error(capsys).startswith(f"asyncinfer: error: {message}")


def test_lab_reports_a_plugin_s_broken_contract_as_the_plugin_s_fault(tmp_path, monkeypatch, capsys) -> None:
    """A scheduler that schedules nothing breaks the contract: named as the plugin's fault, not an internal error."""
    (tmp_path / "lazy_policies.py").write_text(
        "from asyncinfer.schedulers import Scheduler, SchedulerOutput\n\n"
        "class Lazy(Scheduler):\n    api_version = 1\n    uses_priority = False\n    starvation_free = False\n\n"
        "    def schedule(self):\n        return SchedulerOutput()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main(["lab", "--synthetic", "3", "--schedulers", "lazy_policies:Lazy"]) == 2
    err = one_line_error(capsys)
    assert err.startswith("asyncinfer: error: scheduler Lazy broke the scheduler contract (docs/schedulers.md): "
                          "at step 0"), err
    assert "scheduled nothing" in err and "internal error" not in err


def test_debug_shows_the_traceback_on_every_error_path(tmp_path, capsys, monkeypatch) -> None:
    """``ASYNCINFER_DEBUG=1`` (``asyncinfer --help``, docs/getting_started.md) shows the traceback of a user's
    error too, then the same one line; without it, the one line alone."""
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    missing_server = {"asyncinfer.server": None}  # the import of the server package fails: no fastapi
    cases = ((["info", str(tmp_path / "nope.gguf")], {}), (["info", str(junk)], {}),
             (["chat", "--model", str(tmp_path / "nope"), "hi"], {}),
             (["serve", "--port", "0"], missing_server))
    for argv, modules in cases:
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.delenv("ASYNCINFER_DEBUG", raising=False)
        assert cli.main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == ""  # nothing on stdout before the error (info's "model:" line)
        line = captured.err
        assert line.count("\n") == 1 and "Traceback" not in line, line
        assert line.startswith("asyncinfer: error: "), line
        monkeypatch.setenv("ASYNCINFER_DEBUG", "1")
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("Traceback (most recent call last):") and err.endswith(line), (argv, err)
        for name in modules:
            monkeypatch.delitem(sys.modules, name)
    assert line == "asyncinfer: error: asyncinfer.server is missing: pip install 'asyncinfer[server]'\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["chat", "--kv-cache-memory", "12XB", "hi"],
     "argument --kv-cache-memory: '12XB' is not a size (a byte count up to 2**63 - 1, or e.g. 512MiB, 2GiB, 4GB)"),
    (["chat", "--temperature", "abc", "hi"], ("argument --temperature: 'abc' is not a number: allowed a number in [0, 10000] "
                                              "(0 = greedy)")),
    (["chat", "--maxtokens", "3", "hi"], "unrecognized arguments: --maxtokens; did you mean --max-tokens?"),
    (["serve", "--max-conections", "3"], "unrecognized arguments: --max-conections; did you mean --max-connections?"),
    (["info", "--xyzzy"], "unrecognized arguments: --xyzzy (asyncinfer info --help lists the flags)"),
    (["nope"], ("'nope' is not a command of asyncinfer: the commands are chat, generate, bench, info, plan, embed, "
               "lab, serve")),
])
def test_argparse_errors_are_one_line_like_every_error(argv, message, capsys) -> None:
    """A value argparse's own type check refuses, or a flag the command lacks: one line with the prefix of
    every other error (not the usage), status 2; a misspelt flag gets the near one."""
    with pytest.raises(SystemExit) as end:
        cli.main(argv)
    assert end.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"asyncinfer: error: {message}\n"
