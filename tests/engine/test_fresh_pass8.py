"""Adversarial pass 8 (in-process side): faults a hostile or careless caller, plugin or file could cause, found
and fixed."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from asyncinfer import AsyncEngine, ModelLoadError, RequestFailedError, SamplingParams
from asyncinfer.core import SchedulerPlanError
from asyncinfer.schedulers import FIFOScheduler

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu", "block_size": 4}
GOOD = [(29 * j) % 300 + 7 for j in range(9)]


class _PosingCount(int):
    """A token count that compares as within any range and adds as 1: it passes ``1 <= n <= uncomputed`` and the
    slots check whatever it holds."""

    def __le__(self, other: object) -> bool:
        return True

    def __ge__(self, other: object) -> bool:
        return True

    def __lt__(self, other: object) -> bool:
        return False

    def __gt__(self, other: object) -> bool:
        return False

    def __add__(self, other: object) -> int:
        return 1

    __radd__ = __add__


class _PosingPlan(FIFOScheduler):
    """FIFO, but the request whose id starts with "bad" is planned 3 tokens more than it lacks, as a count that
    poses as in range."""

    def schedule(self):  # type: ignore[no-untyped-def]
        out = super().schedule()
        entries = out.num_scheduled_tokens
        for rid, n in list(entries.items()):
            if rid.startswith("bad"):
                entries[rid] = _PosingCount(n + 3)
        return out


async def test_a_planned_count_that_poses_as_in_range_fails_its_request_alone(tiny_models, hf_greedy) -> None:
    """The plan check read a plugin's count as it came: an ``int`` subclass whose comparisons said "in range"
    (and whose sum said 1) passed ``1 <= n <= uncomputed`` and the slots check, and the forward pass ran its
    real count (3 tokens past what the request had): the step raised, and every neighbour in it failed with
    RequestFailedError. The plan is now read once, as the plain ids and ints it holds: that request fails alone
    with a SchedulerPlanError, and no step fails."""
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 6)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    async with AsyncEngine.from_pretrained(path, **BASE, scheduler=_PosingPlan) as engine:
        neighbours = [asyncio.create_task(engine.generate(GOOD, greedy)) for _ in range(2)]
        bad = asyncio.create_task(engine.generate([5, 6, 7, 8, 9], greedy, request_id="bad"))
        results = await asyncio.gather(*neighbours, bad, return_exceptions=True)
        assert [getattr(r, "token_ids", r) for r in results[:2]] == [expected, expected]
        assert isinstance(results[2], RequestFailedError) and "'bad'" in str(results[2])
        assert isinstance(results[2].__cause__, SchedulerPlanError)
        assert engine.step_stats().failed_steps == 0
    assert engine.kv_stats().used_blocks == 0 and engine.kv_manager.request_ids() == []



@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory) -> Path:
    from tests.helpers import tiny_hf_model

    path = tmp_path_factory.mktemp("tiny-gemma2")
    tiny_hf_model("gemma2", 2, vocab_size=320).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping", "rms_norm_eps"])
@pytest.mark.parametrize("value", ["Infinity", "1e300", "1e-50"])
def test_a_config_value_float32_cannot_hold_is_refused_by_name(tiny_gemma2, tmp_path, key, value) -> None:
    """A config's soft-caps and eps were held to ``> 0`` only: ``Infinity`` (which Python's json reads) or
    ``1e300`` loaded, became float32's inf, and every logit the model gave was NaN (its greedy reply token 0,
    logprobs NaN); ``1e-50`` became 0. Each must now be a positive number float32 holds, refused by name at the
    load."""
    from asyncinfer.models.loader import read_model_config

    path = tmp_path / "model"
    shutil.copytree(tiny_gemma2, path)
    config = json.loads((path / "config.json").read_text())
    config[key] = "@value@"
    (path / "config.json").write_text(json.dumps(config).replace('"@value@"', value))
    with pytest.raises(ModelLoadError, match=rf"{key}=.* must be .*a positive number that float32 holds"):
        read_model_config(path)
    assert read_model_config(tiny_gemma2).attn_logit_softcapping == 2.0


async def test_two_profiles_asked_at_once_never_leave_one_waiting_forever(tiny_models, tmp_path) -> None:
    """``profile()`` checked that no profile was armed, then checked its path in a worker thread, then armed its
    own: two calls made together both passed the check, the second armed over the first, and the first waited
    for steps that were never counted for it (until the engine stopped). The second is now refused, as a call
    made while a profile runs is."""
    from asyncinfer import InvalidParameterError

    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE) as engine:
        first = asyncio.ensure_future(engine.profile(steps=2, path=tmp_path / "a"))
        second = asyncio.ensure_future(engine.profile(steps=2, path=tmp_path / "b"))
        # No traffic yet: the one armed waits for steps, so the other ends first, refused. (With traffic from the
        # start, a loaded machine could finish the first's two steps before the second's check: both ran.)
        ended, _ = await asyncio.wait({first, second}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        assert len(ended) == 1

        async def traffic() -> None:
            while not (first.done() and second.done()):
                await engine.generate(GOOD, SamplingParams(max_tokens=2, ignore_eos=True))

        feeder = asyncio.ensure_future(traffic())
        try:
            done = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), 20)
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
        refused = [r for r in done if isinstance(r, InvalidParameterError)]
        assert len(refused) == 1 and refused[0].parameter == "profile"
        assert [r.steps for r in done if not isinstance(r, BaseException)] == [2]


def _with_tokenizer(model_dir: Path, where: Path, *, far_word: bool, far_bos: bool) -> Path:
    """``model_dir`` with a word-level tokenizer of 200 words ("w1" .. "w199") beside it: ``far_word`` adds a
    word "far" of id 100000 (a sparse vocabulary of 201 tokens), ``far_bos`` a post-processor that puts a
    "<s>" of id 100000 before every text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    shutil.copytree(model_dir, where)
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 200)}, **({"far": 100_000} if far_word else {})}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if far_bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 100_000)])
    tokenizer.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "unk_token": "[UNK]"}))
    return where


@pytest.mark.parametrize("kind", ["sparse vocabulary", "post-processor"])
async def test_a_tokenizer_that_gives_ids_past_the_vocabulary_fails_no_step(tiny_models, tmp_path, kind) -> None:
    """The load checks that the tokenizer holds no more tokens than the model embeds (``len(tokenizer)``); a
    tokenizer file whose ids lie past its count (a word of id 100000 in a vocabulary of 201, or a post-processor
    that adds one) passed, a text prompt encoded with that id reached the forward pass, and the step raised
    IndexError: every neighbour batched with it failed, and three such prompts in a row would end the engine. A
    text's ids are now held to the vocabulary at the call, as token ids are: InvalidParameterError on
    ``prompt``, nothing queued."""
    from asyncinfer import InvalidParameterError

    path = _with_tokenizer(tiny_models["llama"][0], tmp_path / "model", far_word=kind == "sparse vocabulary",
                           far_bos=kind == "post-processor")
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    async with AsyncEngine.from_pretrained(path, **BASE) as engine:
        neighbour = asyncio.ensure_future(engine.generate(GOOD, greedy))
        with pytest.raises(InvalidParameterError, match="100000") as err:
            await engine.generate("w1 far w2", greedy)
        assert err.value.parameter == "prompt"
        with pytest.raises(InvalidParameterError, match="100000"):
            engine.tokenize("w1 far w2")
        assert len((await neighbour).token_ids) == 4
        if kind == "sparse vocabulary":
            assert len((await engine.generate("w1 w2 w3", greedy)).token_ids) == 4
        assert engine.step_stats().failed_steps == 0


async def test_an_encoder_tokenizer_that_gives_ids_past_the_vocabulary_fails_only_its_call(minilm_dir, tmp_path) -> None:
    """The same for an embedding model: a tokenizer.json of as many tokens as the encoder embeds, one of them of
    id 100000, passed the load's count check, and a text with that token failed the whole batch: every caller's
    texts embedded with it (RequestAbortedError). The call's texts are now held to the vocabulary as they are
    tokenized: that call is refused by name, its neighbours are embedded."""
    from asyncinfer import InvalidParameterError

    path = tmp_path / "encoder"
    shutil.copytree(minilm_dir, path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    del vocab["[unused0]"]
    vocab["zzzfar"] = 100_000
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    async with await AsyncEngine.load(path, device="cpu", dtype="float32") as engine:
        good, bad = await asyncio.gather(engine.embed(["hello world"]), engine.embed(["hello zzzfar"]),
                                         return_exceptions=True)
        assert tuple(good.shape) == (1, 384)  # type: ignore[union-attr]
        assert isinstance(bad, InvalidParameterError) and bad.parameter == "texts[0]" and "100000" in str(bad)


async def test_a_profile_step_count_that_poses_as_in_range_is_refused(tiny_models, tmp_path) -> None:
    """``profile(steps=)`` took an ``int`` subclass as it came: one holding 10**12 that compares as in range
    passed the check, and the profile would have kept every step's ops in memory for as long as traffic came
    (its own comparisons decide when it ends). It is read as the int it holds, and refused by name."""
    from asyncinfer import InvalidParameterError

    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE) as engine:
        with pytest.raises(InvalidParameterError) as err:
            await asyncio.wait_for(engine.profile(steps=_PosingCount(10**12), path=tmp_path), 5)
        assert err.value.parameter == "steps" and err.value.value == 10**12


@pytest.mark.parametrize("where", ["decode_attention", "DecodeLayer", "DecodeStack"])
def test_a_soft_cap_float32_rounds_to_zero_is_refused_by_name(where) -> None:
    """The kernels' soft-caps were held to ``0 < cap < 3.4e38`` as Python floats: ``1e-46`` passed, reached the
    kernels as the float32 0.0, which they read as no cap at all, and the scores ran uncapped (decode_attention
    gave another output than the cap asked for, without a word). A cap float32 cannot hold is refused."""
    from asyncinfer import kernels
    from tests.models.kernel_cases import HIDDEN, VOCAB, blocks, layer_args

    if where == "decode_attention":
        q, cache = torch.randn(1, 2, 16), torch.randn(2, 4, 1, 16)
        call = lambda cap: kernels.decode_attention(q, cache, cache.clone(), torch.tensor([[0, 1]]),  # noqa: E731
                                                    torch.tensor([5]), 0.25, softcap=cap)
        name = "softcap"
    elif where == "DecodeLayer":
        call = lambda cap: kernels.DecodeLayer(**layer_args(), attn_softcap=cap)  # noqa: E731
        name = "attn_softcap"
    else:
        call = lambda cap: kernels.DecodeStack([kernels.DecodeLayer(**layer_args())], torch.ones(HIDDEN),  # noqa: E731
                                               1e-5, ("q8_0", blocks(VOCAB, HIDDEN, "q8_0", 99), VOCAB),
                                               logit_softcap=cap)
        name = "logit_softcap"
    call(1e-40)  # a subnormal float32 is a positive float32
    for cap in (1e-46, 5e-324):
        with pytest.raises(ValueError, match=f"{name} must be None or a positive finite float32"):
            call(cap)


async def test_a_drain_swap_cancelled_in_its_drain_still_leaves_a_version_serving(tiny_models) -> None:
    """A drain-mode ``swap_model`` stops binding requests to the serving version, waits for its requests to end,
    then loads the new one. Cancelled while it waited (``asyncio.wait_for`` on the swap, a request in flight),
    it left the model with no version at all: the old one drained and was dropped, no new one was loaded, and
    every later request was refused with EngineClosedError ("a drain-mode swap is loading the next one"), for
    good. Once it has begun to drain, the swap now runs to its end and then raises the cancellation."""
    path = tiny_models["llama"][0]
    async with AsyncEngine.from_pretrained(path, **BASE) as engine:
        long = asyncio.ensure_future(engine.generate(GOOD, SamplingParams(max_tokens=100, ignore_eos=True)))
        while engine.step_stats().steps < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.swap_model(path, mode="drain"), 0.05)
        assert len((await long).token_ids) == 100
        out = await asyncio.wait_for(engine.generate(GOOD, SamplingParams(max_tokens=3, ignore_eos=True)), 30)
        assert len(out.token_ids) == 3
        assert [info.state for info in engine.model_info()] == ["current"]


async def test_a_removal_cancelled_in_its_drain_still_stops_the_model_being_stepped(tiny_models) -> None:
    """``remove_model`` cancelled while the model's requests drained left its holder among those the engine
    thread steps (the removal never told the thread), though the model was gone from the engine."""
    path = tiny_models["llama"][0]
    async with AsyncEngine.from_pretrained(path, **BASE) as engine:
        await engine.add_model("second", path, **BASE)
        long = asyncio.ensure_future(engine.generate(GOOD, SamplingParams(max_tokens=100, ignore_eos=True),
                                                     model="second"))
        while engine.step_stats("second").steps < 2:
            await asyncio.sleep(0.01)
        holders = engine._link.thread._holders
        assert len(holders) == 2
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.remove_model("second"), 0.05)
        assert len((await long).token_ids) == 100
        for _ in range(200):
            if len(holders) == 1:
                break
            await asyncio.sleep(0.01)
        assert len(holders) == 1


class _ForgetfulAbort(FIFOScheduler):
    """FIFO whose ``abort_request`` override forgets to call the base class's: the request stays queued."""

    def abort_request(self, request_id):  # type: ignore[no-untyped-def]
        return None


async def test_a_plugin_whose_abort_request_keeps_the_request_queued_ends_no_engine(tiny_models, hf_greedy) -> None:
    """The engine freed a cancelled request's blocks after the plugin's ``abort_request``, trusting it had taken
    the request out of its queues. One that did not (an override that forgot ``super()``) scheduled it again with
    no blocks: the plan check failed it once more, but it stayed in the plan, the step raised IndexError for every
    request in it, and after three such steps the engine was dead (EngineDeadError for everyone). The request is
    now taken out of the base class's queues all the same (logged), and the engine serves on."""
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 30)
    async with AsyncEngine.from_pretrained(path, **BASE, scheduler=_ForgetfulAbort) as engine:
        neighbour = asyncio.ensure_future(engine.generate(GOOD, SamplingParams(max_tokens=30, ignore_eos=True)))
        for _ in range(4):
            gone = asyncio.ensure_future(engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=100, ignore_eos=True)))
            await asyncio.sleep(0.03)
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
        assert (await neighbour).token_ids == expected
        assert len((await engine.generate(GOOD, SamplingParams(max_tokens=3, ignore_eos=True))).token_ids) == 3
        assert engine.step_stats().failed_steps == 0
        sched = engine.core.scheduler
        assert not sched.requests and not sched.running and not sched.waiting
    assert engine.kv_stats().used_blocks == 0 and engine.kv_manager.request_ids() == []


def _dropping(hook: str) -> type[FIFOScheduler]:
    """FIFO whose ``hook`` override returns without calling the base class's for a request whose prompt ends in 9
    (``add_request``) or for every forked sample (``add_forked``)."""

    class Dropping(FIFOScheduler):
        def add_request(self, request):  # type: ignore[no-untyped-def]
            if hook == "add_request" and request.prompt_token_ids[-1] == 9:
                return None
            return super().add_request(request)

        def add_forked(self, request):  # type: ignore[no-untyped-def]
            if hook == "add_forked":
                return None
            return super().add_forked(request)

    return Dropping


@pytest.mark.parametrize("hook", ["add_request", "add_forked"])
async def test_a_plugin_hook_that_does_not_queue_its_request_leaves_no_caller_waiting(tiny_models, hook) -> None:
    """A plugin whose ``add_request`` (or ``add_forked``) returned without adding the request (a forked sample) to
    its ``requests`` left it in no queue: it never ran, the stall check saw nothing waiting, and the caller waited
    forever. The engine now checks that the hook did add it, and fails that request alone (RequestFailedError,
    the cause a SchedulerHookError naming the hook); the others are served."""
    from asyncinfer.step import SchedulerHookError

    params = SamplingParams(max_tokens=5, ignore_eos=True, n=2 if hook == "add_forked" else 1)
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, scheduler=_dropping(hook)) as engine:
        good = asyncio.ensure_future(engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=5, ignore_eos=True)))
        with pytest.raises(RequestFailedError) as err:
            await asyncio.wait_for(engine.generate([5, 6, 7, 9], params), 10)
        assert isinstance(err.value.__cause__, SchedulerHookError) and hook in str(err.value.__cause__)
        assert len((await good).token_ids) == 5
        assert engine.step_stats().failed_steps == 0
    assert engine.kv_stats().used_blocks == 0 and engine.kv_manager.request_ids() == []


async def test_an_admission_count_that_poses_as_in_range_is_read_as_the_int_it_holds(tiny_models) -> None:
    """``check_admission(count=)`` compared an ``int`` subclass by its own methods: one holding 10**12 that
    compares as in range passed, and the room check answered for a count nobody asked. It is read as the int it
    holds, and refused by name."""
    from asyncinfer import InvalidParameterError

    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE) as engine:
        with pytest.raises(InvalidParameterError) as err:
            engine.check_admission(_PosingCount(10**12))
        assert err.value.parameter == "count" and err.value.value == 10**12
        engine.check_admission(1)  # room for one: no error
