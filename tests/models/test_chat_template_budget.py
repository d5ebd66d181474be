"""A hostile chat template (the model file's code, run by every chat request) is refused on a budget, quickly, with
a typed error, on both render paths (a GGUF's cached tokenizer and a transformers tokenizer); real templates render
as transformers renders them; an engine whose template is hostile refuses chats and serves text."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.prompts import chat_token_ids
from tests.models.test_tokenizer import TEMPLATE, write_tokenizer_gguf

# Each refused quickly on either path (the 10**10 loop, the 10 GB string, the widths, the doublings...).
HOSTILE = {
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "string times 10**10": "{{ 'x' * 10**10 }}",
    "ljust": "{{ 'x'.ljust(10**10) }}",
    "center method": "{{ 'x'.center(10**10) }}",
    "rjust": "{{ 'x'.rjust(9999999999) }}",
    "zfill": "{{ 'x'.zfill(10**10) }}",
    "expandtabs": "{{ ('\t' * 1000).expandtabs(10**8) }}",
    "format width": "{{ '{:>9999999999}'.format(1) }}",
    "nested format width": "{{ '{:>{}}'.format(1, 9999999999) }}",
    "format_map width": "{{ '{x:>9999999999}'.format_map({'x': 1}) }}",
    "percent width": "{{ '%9999999999s' % 'x' }}",
    "percent star width": "{{ '%*s' % (9999999999, 'x') }}",
    "center filter": "{{ 'x' | center(9999999999) }}",
    "indent filter": "{{ 'a\nb' | indent(9999999999) }}",
    "wordwrap filter": "{{ ('x ' * 1000000) | wordwrap(1, wrapstring='y' * 1000) }}",
    "format filter": "{{ '%9999999999s' | format('x') }}",
    "truncate filter": "{{ ('x' * 100) | truncate(10, end='y' * 10**10) }}",
    "replace filter": "{{ 'abc' | replace('', 'y' * 100000) | replace('', 'y' * 100000) }}",
    "tojson indent": "{{ {'a': [1, {'b': 2}]} | tojson(indent=10**9) }}",
    "lipsum": "{{ lipsum(10**8) }}",
    "batch filter": "{{ [1] | batch(10**10, 'x') | list }}",
    "replace chain": "{% set s = 'abc'.replace('', 'y' * 100000) %}{{ s.replace('', 'y' * 100000) | length }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s | length }}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}{{ ns.s | length }}",
    "power": "{{ 2 ** 100000000 }}",
    "power chain": "{% set ns = namespace(n=2) %}{% for i in range(40) %}{% set ns.n = ns.n ** 2 %}{% endfor %}"
                   "{{ ns.n > 1 }}",
    "list times 10**10": "{{ [1, 2] * 10**10 }}",
    "macro recursion": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "compare in a loop": "{% set s = 'x' * 4000000 %}{% for i in range(100000) %}{% for j in range(100000) %}"
                         "{% if s == s %}{% endif %}{% endfor %}{% endfor %}",
    "join separator": "{{ range(100000) | join('x' * 100000) }}",
    "list written out": "{{ ['x' * 4000000] * 1000 }}",
    "macro buffer": "{% macro m() %}{% for i in range(100000) %}{{ 'x' * 4000000 }}{% endfor %}{% endmacro %}"
                    "{{ m() | length }}",
    "output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    # Work in Python a character at a time, on values within the size limits, again and again.
    "urlize in a loop": "{% set s = 'ab ' * 1000000 %}{% for i in range(100) %}{{ s | urlize | length }}{% endfor %}",
    "format fields in a loop": "{% set s = '{0}' * 1000000 %}{% for i in range(100) %}{{ s.format(1) | length }}"
                               "{% endfor %}",
    # A block's body run again through self (its nodes each time), and sums of lists (each addition a copy).
    "block in a loop": "{% block b %}" + "{% if x %}{% endif %}" * 3000 + "{% endblock %}{% for i in range(100000) %}"
                       "{% for j in range(100000) %}{{ self.b() }}{% endfor %}{% endfor %}",
    "sum of lists": "{{ ([[1] * 4000000] * 100) | sum(start=[]) | length }}",
    # What a namespace or a list holds, written out or kept.
    "namespace written out": "{% set s = 'x' * 4000000 %}{% set ns = namespace() %}"
                             + "".join(f"{{% set ns.a{i} = s %}}" for i in range(300)) + "{{ ns }}",
    "lists kept": "{% set ns = namespace(x=[]) %}{% for i in range(100) %}{% set ns.x = ns.x + [[1] * 4000000] %}"
                  "{% endfor %}{{ ns.x | length }}",
    "sum of reversed lists": "{{ ([[1] * 4000000] * 100) | reverse | sum(start=[]) | length }}",
}
QUICK_S = 10  # per render: a generous bound for "quickly" on a loaded 2-core machine (they take 1.5 s at most)
TIME_LIMIT_S = 30  # a render still running then is stopped (and fails the test)
MESSAGES = [{"role": "user", "content": "hi"}]

# Run in a child with its memory capped (a render that allocates a gigabyte fails there, with MemoryError, not on the
# machine) and an alarm per render (a render that hangs is stopped and reported, and the next one runs).
_CHILD = r"""
import json, resource, signal, sys, time, types
from pathlib import Path
from transformers import AutoTokenizer
from asyncinfer.models.loader import gguf_tokenizer
from asyncinfer.models.tokenizer import CachedTokenizer, compile_chat_template
from asyncinfer.prompts import chat_token_ids

gguf_path, limit_s, cases = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
cached = gguf_tokenizer(gguf_path)
assert isinstance(cached, CachedTokenizer)
reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))  # a render may hold < 1 GiB

class Timeout(BaseException):
    pass

def alarm(*_):
    raise Timeout

signal.signal(signal.SIGALRM, alarm)
messages = [{"role": "user", "content": "hi"}]

def compiled(source):
    return compile_chat_template(source).render(messages=[])

def via_cached(source):
    tok = CachedTokenizer(cached.backend_tokenizer, cached.special_tokens_map, source)
    return chat_token_ids(types.SimpleNamespace(tokenizer=tok), messages)

def via_transformers(source):
    reference.chat_template = source
    return chat_token_ids(types.SimpleNamespace(tokenizer=reference), messages)

for name, source in cases.items():
    for path, render in (("compile", compiled), ("cached", via_cached), ("transformers", via_transformers)):
        start = time.perf_counter()
        signal.alarm(limit_s)
        try:
            render(source)
            outcome = {"error": None}
        except Timeout:
            outcome = {"error": "Timeout"}
        except BaseException as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc)[:500],
                       "parameter": getattr(exc, "parameter", None)}
        finally:
            signal.alarm(0)
        outcome.update(name=name, path=path, seconds=time.perf_counter() - start)
        print(json.dumps(outcome), flush=True)
"""


@pytest.fixture(scope="module")
def template_gguf(tmp_path_factory) -> Path:
    """A tiny GGUF with a vocabulary and a benign template (tests.models.test_tokenizer's), its cache beside it."""
    return write_tokenizer_gguf(tmp_path_factory.mktemp("budget") / "tok.gguf", TEMPLATE)


@pytest.fixture(scope="module")
def outcomes(template_gguf, monkeypatch_module) -> dict[tuple[str, str], dict]:
    """Every hostile template rendered on each path, in one child process: ``{(name, path): outcome}``."""
    monkeypatch_module.setenv("ASYNCINFER_CACHE_DIR", str(template_gguf.parent / "cache"))
    root = Path(__file__).resolve().parents[2]
    env = {**__import__("os").environ, "PYTHONPATH": f"{root / 'src'}:{root}"}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(template_gguf), str(TIME_LIMIT_S), json.dumps(HOSTILE)],
                          capture_output=True, text=True, env=env, timeout=3 * len(HOSTILE) * TIME_LIMIT_S + 300,
                          check=False)
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            outcome = json.loads(line)
            found[outcome["name"], outcome["path"]] = outcome
    assert found, done.stderr[-3000:]
    return found


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.parametrize("path", ["compile", "cached", "transformers"])
def test_a_hostile_template_is_refused_quickly_with_a_typed_error(outcomes, name, path) -> None:
    outcome = outcomes[name, path]
    assert outcome["seconds"] < QUICK_S, outcome
    if path == "compile":  # compile_chat_template(...).render(): the budget's own error, naming its limit
        assert outcome["error"] == "ChatTemplateLimitError", outcome
    else:  # a chat's messages on either tokenizer: InvalidParameterError on the prompt, as any template failure
        assert outcome["error"] == "InvalidParameterError" and outcome["parameter"] == "prompt", outcome
        assert "chat template" in outcome["message"], outcome
    assert "MAX_TEMPLATE_" in outcome["message"] or "MAX_RENDERED_CHARS" in outcome["message"] \
        or "MAX_TOJSON_INDENT" in outcome["message"], outcome


def test_a_template_source_past_the_limit_fails_its_chats_not_the_load(template_gguf, monkeypatch) -> None:
    from asyncinfer.models.loader import gguf_tokenizer
    from asyncinfer.models.template_budget import MAX_TEMPLATE_SOURCE_CHARS, ChatTemplateLimitError
    from asyncinfer.models.tokenizer import CachedTokenizer

    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(template_gguf.parent / "cache"))
    base = gguf_tokenizer(template_gguf)
    huge = CachedTokenizer(base.backend_tokenizer, base.special_tokens_map, "x" * (MAX_TEMPLATE_SOURCE_CHARS + 1))
    assert huge.encode("the capital")
    start = time.perf_counter()
    with pytest.raises(ChatTemplateLimitError, match="MAX_TEMPLATE_SOURCE_CHARS"):
        huge.apply_chat_template(MESSAGES, tokenize=False)
    assert time.perf_counter() - start < 1


def test_a_transformers_template_is_compiled_once_even_when_it_fails(template_gguf, monkeypatch) -> None:
    """A template that does not compile fails each chat with what compiling it raised, compiled once (a long
    template takes seconds to compile: not again for every chat)."""
    from transformers import AutoTokenizer

    import asyncinfer.models.tokenizer as tokenizer_module

    compiled = []

    def counting(source):
        compiled.append(source)
        return real(source)

    real = tokenizer_module.compile_chat_template
    monkeypatch.setattr(tokenizer_module, "compile_chat_template", counting)
    reference = AutoTokenizer.from_pretrained(template_gguf.parent, gguf_file=template_gguf.name)
    reference.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if %}"  # a syntax error
    for _ in range(3):
        with pytest.raises(ValueError, match="cannot be compiled"):
            tokenizer_module.render_chat(reference, MESSAGES, add_generation_prompt=True)
    reference.chat_template = "{{ 'x' * 10**10 }}{# another #}"
    for _ in range(2):
        with pytest.raises(InvalidParameterError, match="MAX_TEMPLATE_VALUE_CHARS"):
            chat_token_ids(types.SimpleNamespace(tokenizer=reference), MESSAGES)
    assert len(compiled) == 2


def test_what_the_budget_lets_through() -> None:
    """Within the limits a template renders: ranges (lazy: no memory), a loop cut short, values near the limit."""
    from asyncinfer.models.tokenizer import compile_chat_template

    loops = "{% for k in range(400) %}{% for i in range(100000) %}{% break %}{% endfor %}{% endfor %}ok"
    assert compile_chat_template(loops).render(messages=[]) == "ok"
    big = "{% set s = 'x' * 4000000 %}{{ (s ~ s[:100000]) | length }} {{ '%-10s|' % 'a' }}{{ '{:>5}'.format(7) }}"
    assert compile_chat_template(big).render(messages=[]) == "4100000 a         |    7"


# ------------------------------------------------------------------ real templates: as transformers renders them
def _real_templates() -> dict[str, str]:
    from tests.engine.test_sliding_window import GEMMA_TEMPLATE
    from tests.models.test_families import PHI3_TEMPLATE, QWEN3_TEMPLATE
    from tests.server.conftest import CHAT_TEMPLATE
    from tests.server.test_tool_formats import LLAMA31_TEMPLATE, LLAMA32_TEMPLATE, MISTRAL_TEMPLATE

    return {"test": TEMPLATE, "qwen3": QWEN3_TEMPLATE, "phi3": PHI3_TEMPLATE, "gemma": GEMMA_TEMPLATE,
            "server": CHAT_TEMPLATE, "llama31": LLAMA31_TEMPLATE, "llama32": LLAMA32_TEMPLATE,
            "mistral": MISTRAL_TEMPLATE}


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Émoji 🤖 and 中文"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "And of Italy? " * 50}],
]
TOOLS = [{"type": "function", "function": {"name": "météo", "description": "the weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def _assert_renders_as_transformers(reference, source: str) -> None:
    from asyncinfer.models.tokenizer import CachedTokenizer, render_chat

    reference.chat_template = source
    cached = CachedTokenizer(reference.backend_tokenizer, reference.special_tokens_map, source)
    for chat in CHATS:
        for prompt in (True, False):
            for tools in (None, TOOLS):
                want = reference.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False, tools=tools)
                assert render_chat(reference, chat, add_generation_prompt=prompt, tools=tools) == want
                assert render_chat(cached, chat, add_generation_prompt=prompt, tools=tools) == want


@pytest.mark.parametrize("kind", list(_real_templates()))
def test_real_templates_render_as_transformers_renders_them(template_gguf, kind) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(template_gguf.parent, gguf_file=template_gguf.name)
    _assert_renders_as_transformers(reference, _real_templates()[kind])


@pytest.mark.real_model
def test_the_default_models_template_renders_as_transformers_renders_it(real_gguf, real_hf_reference) -> None:
    from asyncinfer.models.loader import gguf_tokenizer
    from asyncinfer.models.tokenizer import render_chat

    reference = real_hf_reference[1]
    _assert_renders_as_transformers(reference, reference.chat_template)
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 100} for i in range(4096)]
    want = reference.apply_chat_template(many, add_generation_prompt=True, tokenize=False)
    assert render_chat(gguf_tokenizer(real_gguf), many, add_generation_prompt=True) == want  # within the budget


# ------------------------------------------------------------------ an engine whose model's template is hostile
# Finite (about 10**8 loop iterations: seconds without the budget, refused on it at once) so that it ends either way.
SPINNING = ("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
            "{% for m in messages %}{{ m.content }}{% endfor %}")


@pytest.fixture
def hostile_chat_model(tiny_models, tmp_path) -> Path:
    """The suite's tiny Llama with a transformers tokenizer whose chat template spins."""
    from tests.helpers import with_chat_template

    return with_chat_template(tiny_models["llama"][0], tmp_path / "hostile", SPINNING)


async def test_an_engine_refuses_chats_on_a_hostile_template_and_serves_text(hostile_chat_model) -> None:
    engine = AsyncEngine.from_pretrained(hostile_chat_model, kv_cache_memory=4 << 20, max_model_len=256,
                                         dtype="float32", device="cpu")
    async with engine:
        for _ in range(2):  # again: the engine serves on
            start = time.perf_counter()
            with pytest.raises(InvalidParameterError) as err:
                await asyncio.wait_for(engine.generate(MESSAGES, SamplingParams(max_tokens=2)), TIME_LIMIT_S)
            assert err.value.parameter == "prompt" and "MAX_TEMPLATE_WORK" in str(err.value)
            assert time.perf_counter() - start < QUICK_S
        out = await engine.generate("Hello world", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == 3


def test_the_servers_tools_chat_is_refused_on_a_hostile_template() -> None:
    """The HTTP server renders a tools chat itself (``render_chat_text``): on the same budget."""
    from asyncinfer.server.protocol import chat_history
    from asyncinfer.server.tool_formats import Llama3JsonFormat, render_chat_text, tool_format
    from asyncinfer.server.tools import parse_tool_use
    from tests.server.test_tool_formats import BRIEF, LLAMA31_TEMPLATE, LLAMA_SPECIALS, ROLL, WEATHER, _tokenizer

    spinning = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}" + LLAMA31_TEMPLATE
    tokenizer = _tokenizer(LLAMA_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", spinning)
    fmt = tool_format(tokenizer)
    assert isinstance(fmt, Llama3JsonFormat)
    use = parse_tool_use([ROLL, WEATHER], "auto", None).bound(fmt)
    start = time.perf_counter()
    with pytest.raises(InvalidParameterError) as err:
        render_chat_text(tokenizer, fmt, chat_history(BRIEF), use)
    assert err.value.parameter == "prompt" and "MAX_TEMPLATE_WORK" in str(err.value)
    assert time.perf_counter() - start < QUICK_S
