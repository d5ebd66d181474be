"""A fourth stranger's first hour: what failed with a traceback or misled, each held to its fix."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"stranger4_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ray_serve_without_a_cluster_at_address_is_one_line(monkeypatch, capsys) -> None:
    pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    example = load_example("ray_serve")

    def init(**kwargs):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(example.ray, "init", init)
    monkeypatch.setattr("sys.argv", ["ray_serve.py", "--address", "auto"])
    with pytest.raises(SystemExit) as exit_:
        example.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == ("ray_serve.py: error: cannot connect to Ray at --address auto: "
                   "Could not find any running Ray instance.\n")


def test_ray_serve_serves_the_model_under_the_name_serve_gives_it(monkeypatch, capsys) -> None:
    """The example served the model as ``default`` while the README's client asks for SmolLM2-135M-Instruct (a 404);
    without --name it now takes the name ``asyncinfer serve`` gives the same model."""
    pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    example = load_example("ray_serve")
    deployed = []
    monkeypatch.setattr(example.ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(example.serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(example.serve, "run", lambda app, **kwargs: None)
    monkeypatch.setattr(example, "openai_app", lambda spec, **kwargs: deployed.append(spec))

    def stop(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(example.time, "sleep", stop)
    monkeypatch.setattr(example.serve, "shutdown", lambda: None)
    monkeypatch.setattr(example.ray, "shutdown", lambda: None)
    for argv, name in ((["ray_serve.py"], "SmolLM2-135M-Instruct"), (["ray_serve.py", "--model", "/m/llama.gguf"], "llama"),
                       (["ray_serve.py", "--name", "mine"], "mine")):
        monkeypatch.setattr("sys.argv", argv)
        example.main()
        assert deployed.pop().name == name
        assert f"serving {name} on " in capsys.readouterr().out


def test_embed_takes_threads_as_the_readme_advises_on_a_shared_machine(minilm_dir, monkeypatch, capsys) -> None:
    """The README: "On a busy or shared machine, pass --threads 1"; ``asyncinfer embed`` refused the flag.
    Its errors name the flags (``--threads 0``, ``--dtype 'foo'``), not the options (``num_threads=0``)."""
    import json

    from asyncinfer import AsyncEngine, cli

    loads: list[dict] = []
    load = AsyncEngine.load.__func__

    async def recorded(cls, model=None, **options):
        loads.append(options)
        return await load(cls, model, **options)

    monkeypatch.setattr(AsyncEngine, "load", classmethod(recorded))
    assert cli.main(["embed", "--model", str(minilm_dir), "--device", "cpu", "--threads", "1", "--json", "hi"]) == 0
    assert loads[0]["num_threads"] == 1
    assert len(json.loads(capsys.readouterr().out)["embeddings"][0]) == 384
    assert cli.main(["embed", "--model", str(minilm_dir), "--threads", "0", "hi"]) == 2
    assert capsys.readouterr().err == "asyncinfer: error: --threads 0 is invalid: allowed an integer in [1, 4096]\n"
    assert cli.main(["embed", "--model", str(minilm_dir), "--dtype", "foo", "hi"]) == 2
    assert capsys.readouterr().err.startswith("asyncinfer: error: --dtype 'foo' is invalid: allowed ")


def test_plan_for_cuda_without_cuda_asks_for_device_memory_not_none(capsys) -> None:
    """`asyncinfer plan --device cuda` here said "--device-memory None is invalid", a flag never given."""
    import torch

    from asyncinfer import cli

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the plan measures its memory")
    assert cli.main(["plan", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == ("asyncinfer: error: --device-memory is needed: a size such as 80GB for a CUDA plan "
                   "(no CUDA device here to measure)\n")


def test_hot_swap_example_to_a_missing_path_keeps_serving(real_gguf, tmp_path, monkeypatch, capsys) -> None:
    """`python examples/hot_swap.py /nope` ended in a SwapError traceback and three "Task exception was
    never retrieved" (its clients met the closing engine); the docs promise the old version serves on."""
    import asyncio

    monkeypatch.setenv("ASYNCINFER_MODEL", str(real_gguf))
    example = load_example("hot_swap")
    asyncio.run(example.main(str(tmp_path / "no-such-model")))
    out = capsys.readouterr().out
    assert "swap failed, the serving version goes on: cannot load " in out
    assert "requests served, none failed:" in out
    assert "[after] live versions: v0 current (0 in flight)" in out


def test_plan_of_a_sentence_encoder_points_to_info(minilm_dir, capsys) -> None:
    """`asyncinfer plan all-MiniLM-L6-v2` said "unsupported model_type 'bert'", though the engine serves it."""
    from asyncinfer import cli

    assert cli.main(["plan", str(minilm_dir)]) == 2
    assert capsys.readouterr().err == (f"asyncinfer: error: {str(minilm_dir)!r} is a sentence encoder: asyncinfer plan "
                                       "budgets generators (KV cache, batch, length); asyncinfer info prints an "
                                       "encoder's memory plan\n")


@pytest.mark.parametrize("command", [["chat", "Hi", "--model"], ["generate", "--prompt", "Hi", "--model"],
                                     ["bench", "--model"]])
def test_a_sentence_encoder_is_refused_by_the_generating_commands(command, minilm_dir, monkeypatch, capsys) -> None:
    """`asyncinfer chat --model all-MiniLM-L6-v2` loaded the encoder, then failed with the library's "no model
    was named and this engine holds no generator to default to: add a generator with add_model()"."""
    from asyncinfer import AsyncEngine, cli

    def no_load(*args, **kwargs):
        raise AssertionError("the encoder was loaded")

    monkeypatch.setattr(AsyncEngine, "load", no_load)
    assert cli.main([*command, str(minilm_dir)]) == 2
    assert capsys.readouterr().err == (f"asyncinfer: error: --model {str(minilm_dir)!r} is a sentence encoder, not a "
                                       f"generator (a text generation model): asyncinfer {command[0]} needs a "
                                       "generator; asyncinfer embed takes encoders\n")
