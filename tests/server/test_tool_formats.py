"""Tool-call formats native to each family's chat template (issue 26): Llama 3.x's JSON calls, Mistral's
``[TOOL_CALLS]``, and Hermes for the rest.

Tiny random Llama and Mistral models (``tests.helpers.tiny_hf_model``, with a 1,024-token vocabulary and 4,096
positions so that a prompt describing tools fits) get small byte-level tokenizers whose special
tokens are their families' (``<|python_tag|>``, ``[TOOL_CALLS]``, ...: special, so left out of a reply's text
as in the real vocabularies) and the families' chat templates, written here in the public templates'
format: Llama 3.1's (tools described in the first user message, a call as ``{"name": ..., "parameters": ...}``,
results under the ``ipython`` role) and Mistral v0.3's (``[AVAILABLE_TOOLS]`` before the last user message,
``[TOOL_CALLS]`` lists, ``[TOOL_RESULTS]``, call ids of 9 letters or digits), with Llama 3.2's dated and
Mistral Nemo's unspaced variants. The prompts a tools request and a
history of calls and results render to are asserted text for text; replies in each syntax are read (one call,
several, text then a call, malformed ones as content), streamed pieces gather to the whole reply's reading,
and a forced call (``tool_choice`` "required" or named) is a call in the family's syntax whose arguments
validate against the tool's schema.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from asyncinfer.server import ModelSpec, create_app
from asyncinfer.server.protocol import chat_history, parse_chat
from asyncinfer.server.tool_formats import (
    Llama3JsonFormat,
    MistralFormat,
    as_mistral_id,
    render_chat_text,
    tool_format,
)
from asyncinfer.server.tools import HERMES, parse_tool_use, read_calls
from tests.helpers import gather_tool_deltas, tiny_hf_model

from .conftest import CHAT_TEMPLATE, LiveServer

pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")

# ---- the families' chat templates, in the public templates' format -------------------------------------
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL_TEMPLATE = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""
LLAMA_SPECIALS = ["<unk>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|python_tag|>", "<|eom_id|>"]
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
ROLL = {"type": "function", "function": {
    "name": "roll_dice", "description": "Roll dice.",
    "parameters": {"type": "object", "properties": {
        "count": {"type": "integer", "minimum": 1, "maximum": 10},
        "sides": {"type": "integer", "enum": [4, 6, 8, 10, 12, 20]}},
        "required": ["count", "sides"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
SCHEMAS = {"roll_dice": ROLL["function"]["parameters"], "get_weather": WEATHER["function"]["parameters"]}
DICE = [{"role": "user", "content": "Roll two dice."}]
# What the tokenizers are trained on: the tools as the templates write them, so that prompts stay short.
CORPUS = [json.dumps(ROLL, indent=4), json.dumps(WEATHER, indent=4), json.dumps([ROLL, WEATHER]),
          ("Given the following functions, please respond with a JSON for a function call with its proper arguments "
           'that best answers the given prompt. Respond in the format {"name": function name, "parameters": '
           "dictionary of argument name and its value}.Do not use variables. Environment: ipython Cutting Knowledge "
           "Date: December 2023 Today Date: 26 Jul 2024"), "What is the weather in Oslo? Roll two dice. Be brief.",
          '[{"name": "get_weather", "arguments": {"city": "Paris"}}] {"content": [3, 5], "call_id": "a1B2c3D4e"}'] * 5
VOCAB = 1024  # the tiny models' vocabulary (and the tokenizers' largest size)
OPTIONS = {"kv_cache_memory": 8 * 1024 * 1024, "max_model_len": 4096, "dtype": "float32", "device": "cpu"}


def _tokenizer(specials: list[str], bos: str, eos: str, template: str):
    """A byte-level BPE trained in memory (ids below the tiny models' 320), the family's special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token=bos, eos_token=eos)
    fast.chat_template = template
    assert fast.eos_token_id == 2 and len(fast) <= VOCAB
    return fast


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama with a Llama 3.1 tokenizer and template; a tiny Mistral with a v0.3 one."""
    dirs = {}
    for kind, seed, specials, bos, eos, template in (
            ("llama", 0, LLAMA_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", LLAMA31_TEMPLATE),
            ("mistral", 2, MISTRAL_SPECIALS, "<s>", "</s>", MISTRAL_TEMPLATE)):
        path = dirs[kind] = tmp_path_factory.mktemp(f"tiny-{kind}-tools")
        model = tiny_hf_model(kind, seed, vocab_size=VOCAB, max_position_embeddings=4096)
        model.generation_config.eos_token_id = None
        model.save_pretrained(path, safe_serialization=True)
        _tokenizer(specials, bos, eos, template).save_pretrained(path)
    return dirs


@pytest.fixture(scope="module")
def tokenizers(family_dirs):
    from transformers import AutoTokenizer

    return {kind: AutoTokenizer.from_pretrained(path) for kind, path in family_dirs.items()}


@pytest.fixture(scope="module")
def live(family_dirs):
    app = create_app([ModelSpec(str(family_dirs["llama"]), "llama", OPTIONS),
                      ModelSpec(str(family_dirs["mistral"]), "mistral", OPTIONS)])
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c




def _history(call_id: str) -> list[dict]:
    return [*DICE, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "roll_dice", "arguments": '{"count": 2, "sides": 6}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "[3, 5]"}]


def _signature(tool: dict) -> str:
    return json.dumps(tool, indent=4)


# ---- which format each family gets --------------------------------------------------------------------------
class _Template:
    """Just a chat template (all tool_format reads of a tokenizer whose template is no tool family's)."""

    def __init__(self, template: str | None) -> None:
        self.chat_template = template


QWEN_LIKE = ("{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- tool | tojson }}"
             "{%- endfor %}{{- '</tools><|im_end|>' }}{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m.role + "
             "'\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}")
# Llama 3.2's template takes today's date where the renderer gives strftime_now; the rest is 3.1's.
LLAMA32_TEMPLATE = LLAMA31_TEMPLATE.replace(
    '{%- if not date_string is defined %}\n    {%- set date_string = "26 Jul 2024" %}\n{%- endif %}',
    '{%- if not date_string is defined %}\n    {%- if strftime_now is defined %}\n        {%- set date_string = '
    'strftime_now("%d %b %Y") %}\n    {%- else %}\n        {%- set date_string = "26 Jul 2024" %}\n    {%- endif %}\n'
    "{%- endif %}")


def test_each_family_gets_its_own_format(tokenizers) -> None:
    assert type(tool_format(tokenizers["llama"])) is Llama3JsonFormat
    mistral = tool_format(tokenizers["mistral"])
    assert type(mistral) is MistralFormat
    assert mistral.marker_token == tokenizers["mistral"].convert_tokens_to_ids("[TOOL_CALLS]")  # written as its token
    assert LLAMA32_TEMPLATE != LLAMA31_TEMPLATE and type(tool_format(_Template(LLAMA32_TEMPLATE))) is Llama3JsonFormat
    for other in (CHAT_TEMPLATE, QWEN_LIKE, None):  # ChatML without tools, Qwen's <tools>, no template at all
        assert tool_format(_Template(other)) is HERMES
    assert tool_format(None) is HERMES  # a model without a tokenizer


# ---- the prompts, text for text -----------------------------------------------------------------------------
LLAMA_TOOLS_PROMPT = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: "
    "December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
    'best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.Do not use variables.\n\n" + _signature(ROLL) + "\n\n" + _signature(WEATHER)
    + "\n\nRoll two dice.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
MISTRAL_TOOLS_PROMPT = (
    '<s>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "roll_dice", "description": "Roll dice.", '
    '"parameters": ' + json.dumps(ROLL["function"]["parameters"]) + '}}, {"type": "function", "function": {"name": '
    '"get_weather", "description": "The weather in a city.", "parameters": '
    + json.dumps(WEATHER["function"]["parameters"]) + "}}][/AVAILABLE_TOOLS][INST] Be brief.\n\nRoll two dice.[/INST]")
TOOLS_PROMPTS = {"llama": LLAMA_TOOLS_PROMPT, "mistral": MISTRAL_TOOLS_PROMPT}
BRIEF = [{"role": "system", "content": "Be brief."}, *DICE]


def _history_prompt(kind: str, call_id: str) -> str:
    if kind == "llama":  # (Llama 3.1's template writes a tool's result as JSON: a text quoted)
        return ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nRoll two dice."
                "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
                '{"name": "roll_dice", "parameters": {"count": 2, "sides": 6}}<|eot_id|>'
                '<|start_header_id|>ipython<|end_header_id|>\n\n"[3, 5]"<|eot_id|>'
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    return ('<s>[INST] Roll two dice.[/INST][TOOL_CALLS] [{"name": "roll_dice", "arguments": {"count": 2, "sides": 6}, '
            f'"id": "{call_id}"}}]</s>[TOOL_RESULTS] {{"content": [3, 5], "call_id": "{call_id}"}}[/TOOL_RESULTS]')


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_tools_request_is_rendered_by_the_familys_template(tokenizers, live, client, kind) -> None:
    tokenizer = tokenizers[kind]
    fmt = tool_format(tokenizer)
    use = parse_tool_use([ROLL, WEATHER], "auto", None).bound(fmt)
    assert render_chat_text(tokenizer, fmt, chat_history(BRIEF), use) == TOOLS_PROMPTS[kind]
    got = client.chat.completions.create(model=kind, messages=BRIEF, tools=[ROLL, WEATHER], max_tokens=1)
    assert got.usage.prompt_tokens == len(tokenizer.encode(TOOLS_PROMPTS[kind], add_special_tokens=False))
    # tool_choice "none": no tool is described, the messages are the family's plain chat
    plain = client.chat.completions.create(model=kind, messages=BRIEF, tools=[ROLL], tool_choice="none", max_tokens=1)
    assert plain.usage.prompt_tokens == len(live.engine.apply_chat_template(BRIEF, model=kind))


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_history_of_calls_and_results_is_rendered_by_the_familys_template(tokenizers, client, kind) -> None:
    """Mistral's template takes call ids of 9 letters or digits: one the client sends is kept, any other is
    mapped to 9 of them, the same for the call and for its result."""
    tokenizer = tokenizers[kind]
    fmt = tool_format(tokenizer)
    for sent, shown in (("a1B2c3D4e", "a1B2c3D4e"), ("call_0123456789abcdef01234567", as_mistral_id("call_0123456789abcdef01234567"))):
        want = _history_prompt(kind, shown)
        assert render_chat_text(tokenizer, fmt, chat_history(_history(sent)), None) == want
        got = client.chat.completions.create(model=kind, messages=_history(sent), max_tokens=1)
        assert got.usage.prompt_tokens == len(tokenizer.encode(want, add_special_tokens=False))
    mapped = as_mistral_id("call_0123456789abcdef01234567")
    assert len(mapped) == 9 and mapped.isalnum() and mapped == as_mistral_id("call_0123456789abcdef01234567")


def test_what_a_template_refuses_is_a_400_naming_messages(live) -> None:
    """Llama 3.1's template holds one call per assistant message; Mistral's wants user and assistant to alternate."""
    two = [*DICE, {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "roll_dice", "arguments": "{}"}} for i in range(2)]}]
    for kind, messages in (("llama", two), ("mistral", [*DICE, *DICE])):
        r = httpx.post(live.url + "/v1/chat/completions", json={"model": kind, "messages": messages, "tools": [ROLL],
                                                                "max_tokens": 1})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and "chat template" in error["message"], error
        assert "Traceback" not in error["message"]
        assert httpx.post(live.url + "/v1/chat/completions",
                          json={"model": kind, "messages": DICE, "max_tokens": 1}).status_code == 200


# Mistral Nemo's template is v0.3's without the spaces after the control tokens.
NEMO_TEMPLATE = (MISTRAL_TEMPLATE.replace('"[AVAILABLE_TOOLS] ["', '"[AVAILABLE_TOOLS]["').replace('"[INST] "', '"[INST]"')
                 .replace('"[TOOL_CALLS] ["', '"[TOOL_CALLS]["').replace("'[TOOL_RESULTS] {", "'[TOOL_RESULTS]{")
                 .replace('{{- " " + message["content"]|trim + eos_token}}', '{{- message["content"] + eos_token}}'))


def test_a_mistral_template_without_the_marker_token_gets_hermes() -> None:
    """[TOOL_CALLS] in several pieces of the vocabulary: the model was not trained on Mistral's calls."""
    plain = _tokenizer([s for s in MISTRAL_SPECIALS if s != "[TOOL_CALLS]"], "<s>", "</s>", MISTRAL_TEMPLATE)
    assert len(plain.encode("[TOOL_CALLS]", add_special_tokens=False)) > 1
    assert tool_format(plain) is HERMES
    whole = _tokenizer(MISTRAL_SPECIALS, "<s>", "</s>", MISTRAL_TEMPLATE)
    assert type(tool_format(whole)) is MistralFormat


def test_llama32_and_mistral_nemo_templates_render_the_same_way() -> None:
    """Llama 3.2's template dates its system turn today; Nemo's writes no space after its control tokens."""
    from datetime import datetime

    llama32 = _tokenizer(LLAMA_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", LLAMA32_TEMPLATE)
    fmt = tool_format(llama32)
    days = {datetime.now().strftime("%d %b %Y")}
    text = render_chat_text(llama32, fmt, chat_history(BRIEF), parse_tool_use([ROLL, WEATHER], "auto", None).bound(fmt))
    days.add(datetime.now().strftime("%d %b %Y"))  # (a test run across midnight)
    assert text in {LLAMA_TOOLS_PROMPT.replace("Today Date: 26 Jul 2024", f"Today Date: {day}") for day in days}
    nemo = _tokenizer(MISTRAL_SPECIALS, "<s>", "</s>", NEMO_TEMPLATE)
    fmt = tool_format(nemo)
    assert type(fmt) is MistralFormat and fmt.marker_token == nemo.convert_tokens_to_ids("[TOOL_CALLS]")
    use = parse_tool_use([ROLL, WEATHER], "auto", None).bound(fmt)
    assert render_chat_text(nemo, fmt, chat_history(BRIEF), use) == MISTRAL_TOOLS_PROMPT.replace(
        "[AVAILABLE_TOOLS] [", "[AVAILABLE_TOOLS][").replace("[INST] ", "[INST]")
    assert render_chat_text(nemo, fmt, chat_history(_history("a1B2c3D4e")), None) == _history_prompt(
        "mistral", "a1B2c3D4e").replace("[INST] ", "[INST]").replace("[TOOL_CALLS] [", "[TOOL_CALLS][").replace(
        "[TOOL_RESULTS] {", "[TOOL_RESULTS]{")
    nemo_reply = f"[TOOL_CALLS][{MISTRAL_DICE}]"  # what a Nemo model writes (the marker as text, or left out)
    for text in (nemo_reply, nemo_reply.removeprefix("[TOOL_CALLS]")):
        calls = read_calls(text, use)[1]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [DICE_CALL]


# ---- replies, read -------------------------------------------------------------------------------------------
LLAMA_DICE = '{"name": "roll_dice", "parameters": {"count": 2, "sides": 6}}'
LLAMA_OSLO = '{"name": "get_weather", "parameters": {"city": "Oslo}"}}'  # (a brace inside a string)
MISTRAL_DICE = '{"name": "roll_dice", "arguments": {"count": 2, "sides": 6}}'
MISTRAL_OSLO = '{"name": "get_weather", "arguments": {"city": "]Oslo"}}'
DICE_CALL = ("roll_dice", {"count": 2, "sides": 6})
OSLO_CALLS = {"llama": ("get_weather", {"city": "Oslo}"}), "mistral": ("get_weather", {"city": "]Oslo"})}
# (family, reply text, content, calls)
REPLIES = [
    ("llama", LLAMA_DICE, None, [DICE_CALL]),  # <|python_tag|> left out of the text, as a special token is
    ("llama", "<|python_tag|>" + LLAMA_DICE, None, [DICE_CALL]),
    ("llama", f"{LLAMA_DICE}; {LLAMA_OSLO}", None, [DICE_CALL, OSLO_CALLS["llama"]]),
    ("llama", "Let me roll. <|python_tag|>" + LLAMA_DICE, "Let me roll. ", [DICE_CALL]),
    ("llama", LLAMA_DICE + " and some words", None, [DICE_CALL]),  # (after the calls: dropped)
    ("llama", "The answer is 4.", "The answer is 4.", []),
    ("llama", LLAMA_DICE[:30], LLAMA_DICE[:30], []),  # cut
    ("llama", '{"name": "rm_rf", "parameters": {}}', '{"name": "rm_rf", "parameters": {}}', []),
    ("llama", '{"name": "roll_dice", "parameters": [2]}', '{"name": "roll_dice", "parameters": [2]}', []),
    ("llama", '  {"answer": 4}', '  {"answer": 4}', []),
    ("llama", "{oops} " + LLAMA_DICE, "{oops} " + LLAMA_DICE, []),
    ("mistral", f" [{MISTRAL_DICE}]", None, [DICE_CALL]),  # [TOOL_CALLS] left out of the text
    ("mistral", f"[TOOL_CALLS] [{MISTRAL_DICE}]", None, [DICE_CALL]),
    ("mistral", f"[TOOL_CALLS][{MISTRAL_DICE}, {MISTRAL_OSLO}]", None, [DICE_CALL, OSLO_CALLS["mistral"]]),
    ("mistral", f"Let me roll.[TOOL_CALLS] [{MISTRAL_DICE}]", "Let me roll.", [DICE_CALL]),
    ("mistral", f"[TOOL_CALLS] [{MISTRAL_DICE}, 7]", None, [DICE_CALL]),  # the calls end at one that is none
    ("mistral", "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
    ("mistral", f"[TOOL_CALLS] [{MISTRAL_DICE[:25]}", f"[TOOL_CALLS] [{MISTRAL_DICE[:25]}", []),  # cut
    ("mistral", '[TOOL_CALLS] [{"name": "roll_dice", "arguments": 5}]',
     '[TOOL_CALLS] [{"name": "roll_dice", "arguments": 5}]', []),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
]


def _use(kind: str, tokenizers, choice="auto", parallel=None, tools=(ROLL, WEATHER)):
    return parse_tool_use(list(tools), choice, parallel).bound(tool_format(tokenizers[kind]))


@pytest.mark.parametrize(("kind", "text", "content", "calls"), REPLIES)
def test_a_reply_is_read_in_its_familys_syntax(tokenizers, kind, text, content, calls) -> None:
    got_content, got_calls, cut = read_calls(text, _use(kind, tokenizers))
    assert (got_content, cut) == (content, False)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["type"] == "function" for c in got_calls) and len({c["id"] for c in got_calls}) == len(got_calls)
    for call in got_calls:  # ids as each family's templates take them back
        assert (len(call["id"]) == 9 and call["id"].isalnum()) if kind == "mistral" else call["id"].startswith("call_")
    if len(calls) > 1:  # without parallel_tool_calls, the first only
        assert len(read_calls(text, _use(kind, tokenizers, parallel=False))[1]) == 1


FORCED = [("llama", LLAMA_DICE), ("llama", LLAMA_DICE[:45]), ("llama", LLAMA_DICE[:12]),
          ("mistral", f" [{MISTRAL_DICE}, {MISTRAL_OSLO}]"), ("mistral", f" [{MISTRAL_DICE[:50]}")]


@pytest.mark.parametrize(("choice", "kind", "text"),
                         [("auto", k, t) for k, t, _c, _calls in REPLIES] + [("required", k, t) for k, t in FORCED])
def test_streamed_pieces_gather_to_the_whole_reply_whatever_their_sizes(tokenizers, choice, kind, text) -> None:
    use = _use(kind, tokenizers, choice)
    content, calls, _cut = read_calls(text, use)
    for size in (1, 2, 3, 5, 13, len(text)):
        stream = use.stream()
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])] + stream.finish()
        got_content, got_calls = gather_tool_deltas(deltas)
        assert [c["function"] for c in got_calls] == [c["function"] for c in calls], size
        assert (got_content.strip() or None) == (content.strip() or None if content else None), size
        if not calls:  # (a forced reply cut before its call's name: the grammar's opening, no content)
            assert got_content == ("" if use.forced else text), size


def test_a_forced_call_streams_its_arguments_as_they_are_written(tokenizers) -> None:
    """The grammar writes the call, so it opens once its name is whole and its arguments go out in pieces; a
    reply cut inside them keeps them so far and says so."""
    for kind, text in (("llama", LLAMA_DICE), ("mistral", f" [{MISTRAL_DICE}]")):
        use = _use(kind, tokenizers, "required", False)
        stream = use.stream()
        head = text.index("{\"count")
        assert stream.feed(text[:head - 3]) == []
        opened, first = stream.feed(text[head - 3:head + 5])
        assert opened["tool_calls"][0]["function"] == {"name": "roll_dice", "arguments": ""}
        assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"cou'}}]}
        assert stream.in_call and stream.feed(text[head + 5:head + 10]) == [
            {"tool_calls": [{"index": 0, "function": {"arguments": 'nt": '}}]}]
        cut = read_calls(text[:head + 10], use)
        assert cut[1][0]["function"]["arguments"] == '{"count": ' and cut[2] is True
        assert read_calls(text, use)[2] is False


# ---- forced calls, generated ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_call_is_written_in_the_familys_syntax_and_validates(tokenizers, live, client, kind, choice) -> None:
    tokenizer = tokenizers[kind]
    got = client.chat.completions.create(model=kind, messages=DICE, tools=[ROLL, WEATHER], tool_choice=choice,
                                         parallel_tool_calls=False, max_tokens=200, temperature=0)
    (reply,) = got.choices
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    (call,) = reply.message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    assert (len(call.id) == 9 and call.id.isalnum()) if kind == "mistral" else call.id.startswith("call_")

    # what the model wrote, asked of the engine with the request's own prompt and grammar: the family's syntax
    body = parse_chat({"model": kind, "messages": DICE, "tools": [ROLL, WEATHER], "tool_choice": choice,
                       "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}).in_format(tool_format(tokenizer))
    prompt = render_chat_text(tokenizer, body.tool_use.format, body.history, body.tool_use)
    out = live.call(live.engine.generate(tokenizer.encode(prompt, add_special_tokens=False),
                                         body.sampling_params(4096), model=kind))
    written = {"name": call.function.name, ("parameters" if kind == "llama" else "arguments"): arguments}
    if kind == "llama":
        assert json.loads(out.text) == written and out.text.startswith('{"name": ')
    else:  # [TOOL_CALLS] as its token (a special token, out of the text), then the list
        assert out.outputs[0].token_ids[0] == tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
        assert json.loads(out.text) == [written]

    # streamed: the same call, its arguments in pieces
    chunks = list(client.chat.completions.create(model=kind, messages=DICE, tools=[ROLL, WEATHER], tool_choice=choice,
                                                 parallel_tool_calls=False, max_tokens=200, temperature=0, stream=True))
    pieces = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    # the name first, then the arguments: in one piece or several (a reader slower than the engine gets several
    # tokens' text in one chunk), joined below into the same call
    assert pieces[0].function.name == call.function.name and not pieces[0].function.arguments and len(pieces) >= 2
    assert all(p.function.name is None for p in pieces[1:])
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (call.function.name, call.function.arguments)]

    # the call and its result back in the history: rendered by the template, the id as the family takes it
    history = [*DICE, reply.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(model=kind, messages=history, max_tokens=1)
    want = render_chat_text(tokenizer, tool_format(tokenizer), chat_history(history), None)
    assert call.id in want if kind == "mistral" else json.dumps(written, ensure_ascii=False) in want
    assert again.usage.prompt_tokens == len(tokenizer.encode(want, add_special_tokens=False))


def test_parallel_forced_mistral_calls_are_each_valid(client) -> None:
    got = client.chat.completions.create(model="mistral", messages=DICE, tools=[ROLL, WEATHER], tool_choice="required",
                                         max_tokens=300, temperature=0.8, seed=5)
    (reply,) = got.choices
    assert reply.message.tool_calls
    if reply.finish_reason == "tool_calls":
        for call in reply.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    else:  # a list of calls may run to max_tokens: then it says so
        assert reply.finish_reason == "length"


# ---- bad input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": 7, "type": "function", "function": {
        "name": "roll_dice", "arguments": "{}"}}]}], "messages.[0].tool_calls.[0].id"),
    ([{"role": "tool", "tool_call_id": ["x"], "content": "4"}], "messages.[0].tool_call_id"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
     "messages.[0].tool_calls.[0].function.arguments"),
])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_malformed_history_is_a_400_naming_its_field_whatever_the_family(live, kind, messages, param) -> None:
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": kind, "messages": messages, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.post(live.url + "/v1/chat/completions",
                      json={"model": kind, "messages": DICE, "max_tokens": 1}).status_code == 200


def test_tools_too_big_for_a_familys_grammar_are_a_400_on_tools(live) -> None:
    params = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 400}
                                               for i in range(20)}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": params}} for i in range(16)]
    for kind in ("llama", "mistral"):
        r = httpx.post(live.url + "/v1/chat/completions", json={"model": kind, "messages": DICE, "tools": tools,
                                                                "tool_choice": "required", "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_swap_while_a_tool_chat_is_rendered_serves_it_in_the_new_versions_format(
        family_dirs, tokenizers, monkeypatch, stream) -> None:
    """The router renders a tools chat with the model's template itself (off the loop when long): a swap of the
    model that lands meanwhile, here from a Llama to a Mistral under the same name, must not hand the new
    version the old template's token ids (the same vocabulary size, so nothing refused them: the Mistral model
    ran on a Llama prompt, its reply read as Llama's). The prompt is rendered again for the version that serves."""
    import threading

    from asyncinfer.server import router

    monkeypatch.setattr(router, "OFF_LOOP_CHARS", 0)  # every render in a worker thread, where the swap can land
    rendering, swapped = threading.Event(), threading.Event()
    rendered_with = []
    real = router.render_chat

    def slow_render(tokenizer, fmt, history, use):
        ids = real(tokenizer, fmt, history, use)
        rendered_with.append(fmt.name)
        if len(rendered_with) == 1:  # the first render: the swap lands before it returns
            rendering.set()
            assert swapped.wait(120)
        return ids

    monkeypatch.setattr(router, "render_chat", slow_render)
    app = create_app([ModelSpec(str(family_dirs["llama"]), "m", OPTIONS)])
    with LiveServer(app) as live:
        body = {"model": "m", "messages": DICE, "tools": [ROLL], "max_tokens": 1, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        answer: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answer.append(
            httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120)))
        sender.start()
        assert rendering.wait(120)
        live.call(live.engine.swap_model(str(family_dirs["mistral"]), name="m", **OPTIONS))
        swapped.set()
        sender.join(120)
        assert answer and answer[0].status_code == 200, answer and answer[0].text
        if stream:
            events = [json.loads(line[6:]) for line in answer[0].text.splitlines()
                      if line.startswith("data: {")]
            usage = next(e["usage"] for e in events if e.get("usage"))
        else:
            usage = answer[0].json()["usage"]
    mistral = tokenizers["mistral"]
    fmt = tool_format(mistral)
    want = render_chat_text(mistral, fmt, chat_history(DICE), parse_tool_use([ROLL], "auto", None).bound(fmt))
    assert rendered_with == ["llama3_json", "mistral"]
    assert usage["prompt_tokens"] == len(mistral.encode(want, add_special_tokens=False))


def test_a_chat_swapped_under_it_more_than_max_rebinds_times_is_a_503_to_retry() -> None:
    from asyncinfer import ModelChangedError
    from asyncinfer.server.errors import from_exception

    error = from_exception(ModelChangedError("swapped", 1, 4), "req-1")
    assert (error.status, error.type, error.code) == (503, "server_error", "unavailable")
    assert error.headers == {"retry-after": "1"}



def test_a_burst_of_tool_chats_renders_at_most_the_loops_share_on_it_per_turn(live, monkeypatch) -> None:
    """The router renders a Llama/Mistral tools chat itself: each one within OFF_LOOP_CHARS was rendered on the
    event loop, so a burst of them arriving together held it for their sum (every other caller waiting). Now
    what the server renders on the loop in one turn of it is at most OFF_LOOP_CHARS of cost, all calls
    together (the rest in worker threads), and every call is answered."""
    import asyncio
    import threading

    from asyncinfer.prompts import OFF_LOOP_CHARS
    from asyncinfer.server import router

    loop = live.engine.loop
    turn, done = [0], threading.Event()

    def tick() -> None:  # runs once per turn of the loop: the turn's number
        turn[0] += 1
        if not done.is_set():
            loop.call_soon(tick)

    seen: list[tuple[int, bool]] = []  # (the turn, on the loop's thread) of each render
    real = router.render_chat

    def spy(tokenizer, fmt, history, use):
        seen.append((turn[0], threading.current_thread() is loop_thread[0]))
        return real(tokenizer, fmt, history, use)

    monkeypatch.setattr(router, "render_chat", spy)
    loop_thread: list[threading.Thread] = []
    text = "Roll two dice. " * 100  # a chat of about 1,500 characters of cost: 2 fit in the loop's share
    assert 2 * len(text) < OFF_LOOP_CHARS < 3 * len(text)

    async def burst() -> list[int]:  # sent from the server's own loop: the calls arrive together
        loop_thread.append(threading.current_thread())
        loop.call_soon(tick)
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as http:
            bodies = [{"model": "llama", "tools": [ROLL], "max_tokens": 1,
                       "messages": [{"role": "user", "content": f"{i} {text}"}]} for i in range(8)]
            answers = await asyncio.gather(*[http.post("/v1/chat/completions", json=b) for b in bodies])
        done.set()
        return [a.status_code for a in answers]

    assert live.call(burst()) == [200] * 8
    assert len(seen) == 8
    on_loop = [t for t, here in seen if here]
    assert all(on_loop.count(t) <= 2 for t in on_loop), seen
    assert len(on_loop) < 8, seen
