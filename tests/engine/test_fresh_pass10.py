"""Adversarial pass 10 (in-process side): faults a hostile or careless caller sharing one engine could cause, found
and fixed."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncinfer import AsyncEngine, EngineClosedError, InvalidParameterError, RequestFailedError, SamplingParams
from asyncinfer.schedulers import FIFOScheduler

BASE = {
    "kv_cache_memory": 4 * 1024 * 1024,
    "max_model_len": 512,
    "dtype": "float32",
    "device": "cpu",
    "block_size": 4,
    "num_threads": 1,
}
GOOD = [(29 * j) % 300 + 7 for j in range(9)]
#: A chat template that renders each message's ``name`` and ``tool_calls`` besides its role and content, as many
#: models' templates do.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m.get('name', '') }} {{ m['content'] }}"
    "{% for call in m.get('tool_calls', []) %} {{ call['arguments'] }}{% endfor %} {% endfor %}"
)


def _with_chat_tokenizer(model_dir: Path, where: Path) -> Path:
    """``model_dir`` with a word-level tokenizer of 200 words ("w1" .. "w199") and :data:`TEMPLATE` beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copytree(model_dir, where)
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 200)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "chat_template": TEMPLATE})
    )
    return where


@pytest.fixture(scope="module")
def chat_model(tiny_models, tmp_path_factory) -> Path:
    return _with_chat_tokenizer(tiny_models["llama"][0], tmp_path_factory.mktemp("chat") / "model")


# ----------------------------------------------------------------- a chat's cost counts every key it holds
@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": "w1", "name": "w5" + " " * 5000 + "w6"},
        {"role": "user", "content": "w1", "tool_calls": [{"arguments": "w5" + " " * 5000 + "w6"}]},
    ],
    ids=["name", "tool_calls"],
)
async def test_a_chat_whose_bulk_is_in_another_key_than_its_content_is_rendered_off_the_loop(
    chat_model, monkeypatch, message
) -> None:
    """A chat's cost (what decides whether it is rendered and tokenized on the event loop) counted each message's
    role and content only, but a template renders any key (a ``name``, tool calls): a message whose ``name`` held a
    million characters was rendered and tokenized on the loop, every other caller waiting (1.2 s on the tiny
    word-level tokenizer). Every key and value a message holds is counted now, nested ones too."""
    from asyncinfer.models import tokenizer as tokenizer_module

    rendered_on: list[threading.Thread] = []
    render = tokenizer_module.render_chat

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        rendered_on.append(threading.current_thread())
        return render(*args, **kwargs)

    monkeypatch.setattr(tokenizer_module, "render_chat", spy)
    async with await AsyncEngine.load(chat_model, **BASE) as engine:
        out = await engine.generate([message], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out.token_ids) == 2 and sorted(out.prompt_token_ids) == [0, 1, 5, 6]  # role (unknown), 3 words
        assert rendered_on and threading.main_thread() not in rendered_on
        rendered_on.clear()
        small = {"role": "user", "content": "w1", "name": "w5", "tool_calls": [{"arguments": "w6"}]}
        assert len((await engine.generate([small], SamplingParams(max_tokens=1))).token_ids) == 1
        assert rendered_on == [threading.main_thread()]  # a small chat is still rendered on the loop


def test_a_chats_cost_counts_every_key_nested_values_and_unknown_objects() -> None:
    from asyncinfer.prompts import OFF_LOOP_CHARS, prompt_cost

    plain = [{"role": "user", "content": "x" * 100}]
    assert prompt_cost(plain) == 64 + 4 + 4 + 7 + 100 + 3  # a message, its keys and values, the dict, its 2 pairs
    assert prompt_cost([{"role": "user", "content": "x", "name": "y" * 10_000}]) > OFF_LOOP_CHARS
    assert prompt_cost([{"role": "user", "content": "x", "extra": [["y" * 3000], {"k": "z" * 3000}]}]) > OFF_LOOP_CHARS
    assert prompt_cost([{"role": "user", "content": "x", "extra": object()}]) > OFF_LOOP_CHARS  # its text is unknown
    endless = [{"role": "user", "content": "x", "extra": [""] * 10_000_000}]
    assert prompt_cost(endless) == OFF_LOOP_CHARS + 1  # counted up to the limit, not read whole


# ----------------------------------------------------------------- closing while a prompt is made off the loop
async def test_a_request_whose_prompt_is_made_off_the_loop_while_the_engine_closes_is_refused_not_left_waiting(
    chat_model,
) -> None:
    """A prompt costlier than the loop's share is made (rendered, tokenized) in a worker thread; an ``aclose()``
    meanwhile stopped the engine thread, and the request, bound and posted after it, was never taken by anyone:
    its caller waited forever. The engine's state is checked again once the prompt is made: EngineClosedError."""
    engine = await AsyncEngine.load(chat_model, **BASE)
    await engine.start()
    chat = [{"role": "user", "content": "w1"}] * 65  # 65 messages: past the loop's share, made off the loop
    call = asyncio.ensure_future(engine.generate(chat, SamplingParams(max_tokens=3)))
    await asyncio.sleep(0)  # the call is in its worker thread
    await engine.aclose()
    with pytest.raises(EngineClosedError):
        await asyncio.wait_for(call, 10)
    assert engine.num_unfinished_requests == 0


# ----------------------------------------------------------------- a profile asked as the engine closes
async def test_a_profile_asked_as_the_engine_closes_is_refused_not_left_waiting(tiny_models, tmp_path) -> None:
    """``profile()`` checks its path in a worker thread before it waits for the engine's steps; an ``aclose()``
    meanwhile had already failed every waiter, and the profile's wait, begun after, waited forever for steps that
    no thread would run. A wait begun once the thread has stopped fails at once: EngineClosedError."""
    engine = await AsyncEngine.load(tiny_models["llama"][0], **BASE)
    await engine.start()
    call = asyncio.ensure_future(engine.profile(2, tmp_path / "profile"))
    await asyncio.sleep(0)  # the call checks its path in a worker thread
    await engine.aclose()
    with pytest.raises(EngineClosedError):
        await asyncio.wait_for(call, 10)
    assert engine.metrics.profiler is None


# ----------------------------------------------------------------- more samples than can ever run together
async def test_more_samples_than_max_num_seqs_are_refused_at_the_stream_call(tiny_models) -> None:
    """``n`` past ``max_num_seqs`` was refused by the core only, once the request was posted: ``stream()`` took
    the call and raised at its first delta (the docs promise a bad argument at the call, nothing queued). It is
    refused at the call now, naming ``n`` and the limit; the engine ran no step for it."""
    async with await AsyncEngine.load(tiny_models["llama"][0], **{**BASE, "max_num_seqs": 4}) as engine:
        with pytest.raises(InvalidParameterError, match="max_num_seqs=4") as err:
            engine.stream(GOOD, SamplingParams(n=5, max_tokens=2))
        assert err.value.parameter == "n" and err.value.value == 5
        with pytest.raises(InvalidParameterError, match="max_num_seqs=4"):
            await engine.generate(GOOD, SamplingParams(n=5, max_tokens=2))
        out = await engine.generate(GOOD, SamplingParams(n=4, max_tokens=2, temperature=1.0, seed=1))
        assert [len(o.token_ids) for o in out.outputs] == [2, 2, 2, 2]
        assert engine.step_stats().steps == 2  # the refused calls ran nothing


# ----------------------------------------------------------------- the min_tokens mask's cost per step
def test_the_min_tokens_mask_reads_a_rows_stop_ids_once_not_at_every_step(monkeypatch) -> None:
    """A row below its ``min_tokens`` has EOS and its stop token ids masked at every step. Their list (4096 ids
    at the limit) was turned into index tensors again at every step, with one Python int per id and row: 2.7 ms
    a row on the default model's vocabulary (as much as sampling the row), 64 times that for ``n = 64``, in
    every step the request shared with its neighbours. The columns are a tensor built once per row now; a later
    step reads no id as a Python int, and the mask is the same."""
    import torch

    from asyncinfer.sampler import Sampler, SamplingState

    vocab = 8192
    stops = list(range(100, 4196))
    params = SamplingParams(max_tokens=50, min_tokens=50, stop_token_ids=stops, temperature=1.0, seed=7)
    states = [SamplingState(params=params.for_sample(i), prompt_token_ids=[1, 2, 3]) for i in range(64)]
    sampler = Sampler(vocab, "cpu", (2,))
    logits = torch.zeros(64, vocab)
    logits[:, 100:4196] = 50.0  # the stop ids are by far the likeliest: sampled unless masked
    logits[:, 2] = 50.0  # and EOS
    first = sampler(logits.clone(), states)
    assert not {2, *stops} & set(first.token_ids)
    for state, token in zip(states, first.token_ids):
        state.output_token_ids.append(token)

    read = [0]
    real_tensor = torch.tensor

    def counting(data, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(data, list):
            read[0] += len(data)
        return real_tensor(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    second = sampler(logits.clone(), states)
    assert not {2, *stops} & set(second.token_ids)
    assert read[0] <= 2 * 64  # the rows' temperatures and such, not 64 * 4097 ids


# ----------------------------------------------------------------- a cache salt outlives its request
async def test_a_cache_salt_is_held_to_a_length_as_the_prefix_cache_keeps_it_past_its_request(tiny_models) -> None:
    """The prefix cache keeps a request's ``cache_salt`` in the root link of its first cached block, after the
    request has ended, until the block is evicted (and the grammar cache keeps it in its keys): a caller sending
    requests with distinct salts of 100 MB each grew the process by 100 MB a request, up to one per KV block, with
    no request in flight. A salt is at most ``MAX_CACHE_SALT_CHARS`` (512) characters, refused by name beyond."""
    from asyncinfer.prompts import MAX_CACHE_SALT_CHARS

    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    async with await AsyncEngine.load(tiny_models["llama"][0], **BASE) as engine:
        with pytest.raises(InvalidParameterError, match="at most 512 characters") as err:
            await engine.generate(GOOD, greedy, cache_salt="s" * 1_000_000)
        assert err.value.parameter == "cache_salt" and err.value.value == "<1000000 chars>"
        with pytest.raises(InvalidParameterError):
            engine.stream(GOOD, greedy, cache_salt="s" * (MAX_CACHE_SALT_CHARS + 1))
        salt = "t" * MAX_CACHE_SALT_CHARS
        first = await engine.generate(GOOD, greedy, cache_salt=salt)
        assert engine.num_unfinished_requests == 0
        kept = [b.parent for b in engine.kv_manager.pool.blocks if b.is_cached and isinstance(b.parent, tuple)]
        assert any(salt in link for link in kept)  # what the limit bounds: the salt outlives its request
        again = await engine.generate(GOOD, greedy, cache_salt=salt)
        assert again.token_ids == first.token_ids and engine.kv_stats().prefix_hits > 0


# ----------------------------------------------------------------- a plugin that keeps its finished requests
class _KeepsFinished(FIFOScheduler):
    """FIFO whose ``finish_requests`` forgets the requests whose id starts with "bad" (an override without
    ``super()`` for them), and whose plan leaves out requests that have finished."""

    def finish_requests(self, requests):  # type: ignore[no-untyped-def]
        super().finish_requests([r for r in requests if not r.request_id.startswith("bad")])

    def schedule(self):  # type: ignore[no-untyped-def]
        out = super().schedule()
        for rid in [rid for rid in out.num_scheduled_tokens if self.requests[rid].status.finished]:
            del out.num_scheduled_tokens[rid]
        return out


async def test_a_plugin_whose_finish_requests_keeps_a_request_leaks_no_block(tiny_models, caplog) -> None:
    """A plugin's ``finish_requests`` that returned with a finished request still queued (an override without
    ``super()``) left it there for good: its blocks were never freed (each such request leaked its own, until the
    pool held none for anybody and the neighbours stalled), its id stayed taken (the same caller's next request
    with it was refused), and the engine thread stepped an engine with nothing to do. The engine now takes such a
    request out of the base queues and frees its blocks itself, logged, as it does for ``abort_request``."""
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    async with await AsyncEngine.load(tiny_models["llama"][0], scheduler=_KeepsFinished, **BASE) as engine:
        first = await engine.generate(GOOD, greedy, request_id="bad1")
        assert len(first.token_ids) == 4
        await asyncio.sleep(0.2)
        assert engine.kv_stats().used_blocks == 0
        assert not engine.core.scheduler.requests and not engine.core.scheduler.running
        again = await asyncio.wait_for(engine.generate(GOOD, greedy, request_id="bad1"), 10)  # its id is free
        assert again.token_ids == first.token_ids
        assert (await engine.generate(GOOD, greedy)).token_ids == first.token_ids
        assert engine.kv_stats().used_blocks == 0 and engine.step_stats().idle_steps == 0
    assert "kept finished request 'bad1' after finish_requests" in caplog.text


# ----------------------------------------------------------------- a long text to embed is read only as far as it counts
def test_a_long_text_to_embed_is_tokenized_only_as_far_as_its_first_tokens_reach(minilm_dir) -> None:
    """The encoder's tokenizer truncates a text to ``max_seq_len`` tokens only once it has tokenized all of it: a
    text of 24 M characters took 44 s of a worker thread and grew the process by 2.9 GB (120 times the text; a
    few such calls ended the process, every caller with it). A text is read up to a word end past its first
    ``max_seq_len`` tokens now, in windows of at most 512 characters a token, with the same tokens."""
    from asyncinfer.models.encoder import READ_CHARS_PER_TOKEN, READ_WINDOWS, load_encoder

    encoder = load_encoder(minilm_dir, device="cpu", dtype=torch.float32)
    max_len = encoder.config.max_seq_len
    last_window = READ_CHARS_PER_TOKEN * max_len * 2 ** (READ_WINDOWS - 1)
    tokenizer = encoder.tokenizer

    def whole(text: str) -> list[int]:
        return list(tokenizer(text, truncation=True, max_length=max_len, add_special_tokens=True)["input_ids"])

    same = [
        "The quick brown fox jumps over the lazy dog. " * 2000,
        "word   \n\t  " * 3000 + "last words here",
        "naïve café, déjà vu! " * 3000,
        "中文字符测试" * 30000,  # no space: cut at the window, each character a word
        "abc,def;" * 40000,  # no space: cut at the window, far past the first tokens
        "short text",
    ]
    for text in same:
        assert encoder.tokenize([text]) == [whole(text)]
    spaced = " " * 200_000 + "hello world"  # the documented limit: nothing past the last window is read
    assert encoder.tokenize([spaced]) == [whole(spaced[:last_window])]

    read: list[int] = []

    class Spy:
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(tokenizer, name)

        def __call__(self, texts, *args, **kwargs):  # type: ignore[no-untyped-def]
            read.append(sum(map(len, [texts] if isinstance(texts, str) else texts)))
            return tokenizer(texts, *args, **kwargs)

    encoder.tokenizer = Spy()  # type: ignore[assignment]
    huge = "hello world " * 2_000_000  # 24 M characters
    start = time.perf_counter()
    assert encoder.tokenize([huge]) == [whole("hello world " * 1000)]
    assert max(read) <= READ_CHARS_PER_TOKEN * max_len and time.perf_counter() - start < 5


# ----------------------------------------------------------------- an abort of a request still being bound
async def test_an_abort_of_a_request_waiting_to_be_bound_ends_it_as_an_abort(tiny_models) -> None:
    """A request waits before the engine thread knows its id while its prompt is made off the loop, its grammar
    compiled, or a drain-mode swap holds admission; ``abort(id)`` then went to the engine thread, which did not
    know the id and ignored it, and the request ran to its end once bound. It ends as an abort now, its id free."""
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    async with await AsyncEngine.load(tiny_models["llama"][0], **BASE) as engine:
        # `old` runs long enough (480 tokens, ~0.4 s on a fast machine) to be running still at the check below.
        old = asyncio.ensure_future(engine.generate(GOOD, SamplingParams(max_tokens=480, ignore_eos=True)))
        while engine.step_stats().steps == 0:
            await asyncio.sleep(0.005)
        swap = asyncio.ensure_future(engine.swap_model(tiny_models["llama"][0], mode="drain"))  # waits for `old`
        while engine.model_info()[0].state != "draining":
            await asyncio.sleep(0.005)
        call = asyncio.ensure_future(engine.generate(GOOD, greedy, request_id="x"))
        await asyncio.sleep(0.05)
        assert not call.done() and engine.num_unfinished_requests == 1  # waiting for admission, not yet posted
        engine.abort("x")
        await swap
        out = await asyncio.wait_for(call, 10)
        assert out.finish_reason == "abort" and out.token_ids == []
        assert len((await old).token_ids) == 480
        assert len((await engine.generate(GOOD, greedy, request_id="x")).token_ids) == 20  # the id is free again
        assert engine.kv_stats().used_blocks == 0


# ----------------------------------------------------------------- a plugin that drops a request from its queues
class _Loses(FIFOScheduler):
    """FIFO that drops the requests whose id starts with "bad" from its queues without ending them: while they wait,
    and (a sample of an ``n > 1`` request too) once they have two tokens."""

    def schedule(self):  # type: ignore[no-untyped-def]
        for request in list(self.waiting):
            if request.request_id.startswith("bad-waiting"):
                self.waiting.remove(request)
                del self.requests[request.request_id]
        for request in list(self.running):
            if request.request_id.startswith("bad-running") and request.num_output_tokens >= 2:
                self.running.remove(request)
                del self.requests[request.request_id]
        return super().schedule()


@pytest.mark.parametrize(("request_id", "n"), [("bad-waiting", 1), ("bad-running", 1), ("bad-running", 3)])
async def test_a_request_a_plugin_drops_from_its_queues_fails_alone_and_leaves_nobody_waiting(
    tiny_models, hf_greedy, request_id, n
) -> None:
    """A plugin that dropped a request from its queues (``requests``, ``waiting``, ``running``) without the engine
    ending it left its caller waiting forever: the request never ran again and never ended, not even with
    ``aclose(abort=True)`` (the engine ends the requests its scheduler holds), and a running one's blocks were
    never freed. The engine keeps its own count of the requests it handed over and, when the scheduler holds
    fewer, fails each one it lost alone (all its samples; RequestFailedError, the cause a SchedulerHookError),
    its blocks freed; its neighbours are served."""
    from asyncinfer.step import SchedulerHookError

    model = tiny_models["llama"][1]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    async with await AsyncEngine.load(tiny_models["llama"][0], scheduler=_Loses, **BASE) as engine:
        neighbour = asyncio.ensure_future(engine.generate(GOOD, greedy))
        params = greedy if n == 1 else SamplingParams(max_tokens=8, ignore_eos=True, n=n, temperature=1.0, seed=1)
        with pytest.raises(RequestFailedError, match="dropped") as err:
            await asyncio.wait_for(engine.generate(GOOD, params, request_id=request_id), 10)
        assert isinstance(err.value.__cause__, SchedulerHookError)
        assert (await neighbour).token_ids == hf_greedy(model, GOOD, 8)
        assert engine.num_unfinished_requests == 0 and engine.kv_stats().used_blocks == 0
        assert engine.step_stats().failed_steps == 0


class _Unqueues(FIFOScheduler):
    """FIFO that drops the requests whose id starts with "bad" from ``waiting`` but keeps them in ``requests``."""

    def schedule(self):  # type: ignore[no-untyped-def]
        for request in list(self.waiting):
            if request.request_id.startswith("bad"):
                self.waiting.remove(request)
        return super().schedule()


async def test_a_request_a_plugin_keeps_in_requests_but_in_no_queue_fails_alone_at_once(tiny_models, hf_greedy) -> None:
    """A plugin that dropped a request from ``waiting`` but kept it in ``requests`` was not found (the engine only
    counted ``requests``): never scheduled again, the request waited until the stall timeout, or forever without
    one, while its neighbours ran. The engine now finds a request in ``requests`` but in neither ``running`` nor
    ``waiting`` (and not scheduled) at the step it goes missing, and fails it alone like any other plugin fault:
    RequestFailedError whose cause is a SchedulerHookError naming the plugin."""
    from asyncinfer.step import SchedulerHookError

    model = tiny_models["llama"][1]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    async with await AsyncEngine.load(tiny_models["llama"][0], scheduler=_Unqueues, **BASE) as engine:
        neighbour = asyncio.ensure_future(engine.generate(GOOD, greedy))
        with pytest.raises(RequestFailedError, match=r"_Unqueues\) dropped 'bad' from its queues") as err:
            await asyncio.wait_for(engine.generate(GOOD, greedy, request_id="bad"), 10)
        assert isinstance(err.value.__cause__, SchedulerHookError)
        assert (await neighbour).token_ids == hf_greedy(model, GOOD, 8)
        assert engine.num_unfinished_requests == 0 and engine.kv_stats().used_blocks == 0
        assert engine.step_stats().failed_steps == 0


class _HidesBehindATwin(FIFOScheduler):
    """FIFO that, once a request whose id starts with "bad" waits while another runs, overwrites its place in
    ``waiting`` with the running one: the request is in no queue, the running one in both, the counts equal."""

    hid = False

    def schedule(self):  # type: ignore[no-untyped-def]
        if not self.hid and self.running:
            for i, request in enumerate(self.waiting):
                if request.request_id.startswith("bad"):
                    self.waiting[i] = self.running[0]
                    self.hid = True
                    break
        return super().schedule()


async def test_a_request_hidden_behind_a_twin_in_two_queues_fails_alone(tiny_models, hf_greedy) -> None:
    """pass68: a plugin that dropped a request from its queues while it put a running one in both kept the counts
    equal, which was all the engine compared: the dropped one was never found, waiting behind everybody's traffic
    (for ever while the engine stayed busy; the stall timeout runs only when nothing is planned). The queues are
    compared one by one once a second whatever the counts: it fails alone, its neighbour exact; and the copy of the
    neighbour left in ``waiting`` once it ended (which kept the engine busy for good: ``aclose()`` never returned)
    is taken out by the same scan."""
    from asyncinfer.step import SchedulerHookError

    model = tiny_models["llama"][1]
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    async with await AsyncEngine.load(tiny_models["llama"][0], scheduler=_HidesBehindATwin,
                                      **{**BASE, "max_num_seqs": 1}) as engine:
        neighbour = asyncio.ensure_future(engine.generate(GOOD, long))
        while engine.num_unfinished_requests < 1:
            await asyncio.sleep(0.001)
        started = time.monotonic()
        with pytest.raises(RequestFailedError, match=r"_HidesBehindATwin\) dropped 'bad' from its queues") as err:
            await asyncio.wait_for(engine.generate(GOOD, SamplingParams(max_tokens=4), request_id="bad"), 15)
        assert time.monotonic() - started < 6  # the scan's second, and a loaded machine's steps
        assert isinstance(err.value.__cause__, SchedulerHookError)
        assert (await neighbour).token_ids == hf_greedy(model, GOOD, 200)
        assert engine.num_unfinished_requests == 0 and engine.kv_stats().used_blocks == 0


async def test_the_servers_embedding_usage_count_reads_a_long_text_as_far_as_the_model_does(minilm_dir) -> None:
    """The HTTP server counts an embedding call's tokens for ``usage`` with the model's tokenizer after the vectors
    came back: it tokenized each text whole too (a body's 4 MiB text: about 7 s of a worker thread and 0.5 GB).
    It reads each text as far as the model does now, with the same counts."""
    from asyncinfer.server._engine import embedding_token_counter

    async with await AsyncEngine.load(minilm_dir, device="cpu", dtype="float32", num_threads=1) as engine:
        count = embedding_token_counter(engine, "default")
        assert count(["hello world", "hello world " * 1000]) == [4, 256]
        start = time.perf_counter()
        assert count(["hello world " * 200_000]) == [256]  # 2.4 M characters
        assert time.perf_counter() - start < 1.0
