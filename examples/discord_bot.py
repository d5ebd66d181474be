"""A Discord chat bot on asyncinfer: streamed replies, per-channel memory, fair to every user.

    pip install -e '.[discord]'            # discord.py
    DISCORD_TOKEN=... python examples/discord_bot.py [--model PATH]

Enable the "Message Content" intent for the bot in the Discord developer portal.
The bot answers every message that mentions it (and every message in a DM):

- the reply streams in: the bot posts "…" at once and edits it as tokens arrive,
  at most once per ``edit_interval`` seconds (Discord rate-limits edits);
- each channel has its own history, trimmed to what fits the model
  (``trim_messages``: oldest turns first, the system prompt kept); a message
  enters it as the user's turn of the chat template, its text as written (the
  author's name in the message's ``name`` field);
- a channel is one conversation, answered in turn: messages that arrive while a
  reply is being written get their "…" at once and are answered one after the
  other, in arrival order, each seeing the exchanges before it (the history
  stays user/assistant pairs in order); different channels are answered at once;
- ``!roll <words>`` rolls dice by a tool call: the model turns the words ("two
  twenty-sided dice plus 3") into a call of the ``roll_dice`` tool, its decoding
  constrained to the call's JSON schema (``StructuredOutput``, docs/structured_output.md)
  so the call always parses and its arguments are in range, and the bot runs the
  tool: "🎲 2d20+3: 7 + 15 + 3 = 25". A valid call is not a right one: the default
  135M model reads few such words right (it made "two twenty-sided dice plus 3"
  2d2+3, and "2d6-1" 2d2+2); the constraint holds any model to the tool's schema,
  a bigger one also reads the words. (Over HTTP, the same is ``tools`` with
  ``tool_choice``; docs/serving.md.) Rolls stay out of the history;
- ``!reset`` forgets the channel's history: replies under way (or queued) still
  finish, but nothing of a message sent before the reset enters the new history;
  ``!stop`` stops your replies being written (the engine aborts them and frees
  their memory at once; queued ones never start);
- when the engine refuses or fails a request (overloaded, say), the "…" becomes
  a short apology and the exchange is left out of the history;
- fairness: the engine runs the ``aging-priority`` scheduler and a user's request
  gets priority = how many of their requests are already in flight, so someone
  sending ten messages cannot hold everyone else back, and their own requests
  still age into service.

The model loads with ``await AsyncEngine.load()`` in ``setup_hook``: the event
loop keeps running, so the gateway heartbeat is never missed during the load.
:class:`ChatBot` holds all the logic and touches only ``message.content``,
``message.author`` (``.id``, ``.bot``, ``.display_name``), ``message.channel.id``
and ``await message.reply(text)`` -> a message with ``await .edit(content=...)``,
so tests drive it with plain fake objects and no network
(tests/examples/test_discord_bot.py).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import random
import time
from typing import Any

from asyncinfer import (
    AsyncEngine,
    AsyncInferError,
    EngineOverloadedError,
    InvalidParameterError,
    SamplingParams,
    StructuredOutput,
    trim_messages,
)

log = logging.getLogger("discord_bot")

DISCORD_LIMIT = 2000  # characters in one Discord message
SYSTEM_PROMPT = "You are a friendly assistant in a Discord chat. Keep answers short."

#: The tool ``!roll`` calls: its name, description and JSON-schema parameters (OpenAI's function-tool shape).
ROLL_TOOL = {
    "name": "roll_dice",
    "description": "Roll dice: `count` dice with `sides` sides each, then add `modifier`.",
    "parameters": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 1, "maximum": 20},
            "sides": {"type": "integer", "enum": [2, 4, 6, 8, 10, 12, 20, 100]},
            "modifier": {"type": "integer", "minimum": -100, "maximum": 100},
        },
        "required": ["count", "sides", "modifier"],
        "additionalProperties": False,
    },
}
#: What the model may write for ``!roll``: exactly one call of ROLL_TOOL, ``{"name": ..., "arguments": {...}}``.
ROLL_CALL = StructuredOutput.json_schema({
    "type": "object",
    "properties": {"name": {"const": ROLL_TOOL["name"]}, "arguments": ROLL_TOOL["parameters"]},
    "required": ["name", "arguments"],
    "additionalProperties": False,
})
ROLL_PROMPT = ("You call tools. The tool you have, as JSON:\n" + json.dumps(ROLL_TOOL) + "\nAnswer the user's request "
               'with one call of it: {"name": "roll_dice", "arguments": {...}}.')
ROLL_PARAMS = SamplingParams(max_tokens=64, structured=ROLL_CALL)  # greedy: the same words, the same call


class ChatBot:
    """The bot's logic: commands, per-channel histories, streamed replies, per-user priorities."""

    def __init__(self, engine: AsyncEngine, *, params: SamplingParams | None = None, edit_interval: float = 1.0,
                 system_prompt: str = SYSTEM_PROMPT, history_budget: int | None = None,
                 dice: random.Random | None = None) -> None:
        self.engine = engine
        self.dice = dice or random.Random()
        self.params = params or SamplingParams(max_tokens=200, temperature=0.7, top_p=0.9)
        self.edit_interval = edit_interval
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        # Tokens of history a prompt may take: what leaves room for the longest reply.
        self.history_budget = history_budget or engine.max_model_len - self.params.max_tokens
        if self.history_budget < 1:  # else every message was answered "too long for me"
            raise InvalidParameterError("params.max_tokens", self.params.max_tokens,
                                        f"less than the engine's max_model_len ({engine.max_model_len}), to leave "
                                        "room for the history")
        self.histories: dict[Any, list[dict[str, str]]] = collections.defaultdict(list)
        self.in_flight: dict[Any, set[asyncio.Task[None]]] = collections.defaultdict(set)
        self.resets: dict[Any, int] = collections.defaultdict(int)  # !reset count per channel
        self._last_turn: dict[Any, asyncio.Future[None]] = {}  # per channel: done when its last reply is
        self._ids = 0

    async def on_message(self, message: Any, content: str | None = None) -> None:
        """Handle one message meant for the bot; ``content``: its text if not ``message.content``
        (the gateway passes it with the bot's mention taken out)."""
        if message.author.bot:
            return
        text = (message.content if content is None else content).strip()
        if text == "!reset":
            self.histories.pop(message.channel.id, None)
            self.resets[message.channel.id] += 1
            await message.reply("History cleared.")
        elif text == "!stop":
            for task in list(self.in_flight.get(message.author.id, ())):
                task.cancel()
        elif text.startswith("!roll"):
            await message.reply(await self.roll(text.removeprefix("!roll").strip() or "one six-sided die",
                                                self.priority(message.author.id)))
        elif text:
            # Taken now, in arrival order: the channel's turn and the priority (how many of this
            # user's requests are already in flight).
            task = asyncio.create_task(self._answer(message, text, self._take_turn(message)))
            self.in_flight[message.author.id].add(task)
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():  # our own handler was cancelled, not just the reply
                    raise
            finally:
                self.in_flight[message.author.id].discard(task)

    async def roll(self, words: str, priority: int = 0) -> str:
        """``words`` ("two d20 plus 3") as a call of the ``roll_dice`` tool, run: the reply's text."""
        prompt = [{"role": "system", "content": ROLL_PROMPT}, {"role": "user", "content": words}]
        try:
            out = await self.engine.generate(prompt, ROLL_PARAMS, priority=priority)
        except Exception as exc:  # refused or failed, as for a chat reply
            log.warning("roll failed: %s: %s", type(exc).__name__, exc, exc_info=not isinstance(exc, AsyncInferError))
            return _apology(exc)
        if out.finish_reason != "stop":  # cut by max_tokens: no complete call to run
            return "Sorry, I could not read that roll."
        args = json.loads(out.text)["arguments"]  # always parses: the decoding was held to ROLL_CALL
        return roll_dice(self.dice, args["count"], args["sides"], args["modifier"])

    def priority(self, user_id: Any) -> int:
        """Lower is more urgent: each request a user already has in flight pushes the next one back."""
        return len(self.in_flight.get(user_id, ()))

    def prompt_for(self, channel_id: Any, turn: dict[str, str] | None = None) -> list[dict[str, str]]:
        """The system prompt, the channel's history and ``turn`` (the new message), trimmed to the
        token budget (InvalidParameterError if ``turn`` alone does not fit)."""
        new = [turn] if turn else []
        kept = trim_messages(self.system + self.histories[channel_id] + new, self.history_budget,
                             self.engine.count_tokens)
        self.histories[channel_id] = kept[len(self.system):len(kept) - len(new)]  # forget what no longer fits
        return kept

    def _take_turn(self, message: Any) -> _Turn:
        channel = message.channel.id
        self._ids += 1
        before = self._last_turn.get(channel)
        mine = asyncio.get_running_loop().create_future()
        self._last_turn[channel] = mine
        return _Turn(request_id=f"{message.author.id}/{self._ids}",  # the user as the request's tenant
                     priority=self.priority(message.author.id), resets=self.resets[channel],
                     before=None if before is None or before.done() else before, mine=mine)

    async def _answer(self, message: Any, text: str, turn: _Turn) -> None:
        try:
            edits = _Edits(await message.reply("…"), self.edit_interval)
            try:
                if turn.before is not None:
                    await asyncio.shield(turn.before)  # the channel's earlier messages are answered first
                await self._reply(message, text, turn, edits)
            except asyncio.CancelledError:
                await edits.finish(" [stopped]")
                raise
        finally:
            turn.pass_on()

    async def _reply(self, message: Any, text: str, turn: _Turn, edits: _Edits) -> None:
        channel = message.channel.id
        # The text alone, in the user's role: the chat template marks who speaks. (Written into the
        # text, "name: text" lines read as a transcript to continue, and the model echoed them.) The
        # speaker's name rides along in OpenAI's optional "name" field, for templates that show it.
        said = {"role": "user", "content": text, "name": message.author.display_name}
        try:
            prompt = self.prompt_for(channel, said)
        except InvalidParameterError:
            await edits.replace("That message is too long for me, sorry.")
            return
        try:
            async for delta in self.engine.stream(prompt, self.params, request_id=turn.request_id,
                                                  priority=turn.priority):
                await edits.add(delta.text)
        except asyncio.CancelledError:  # !stop: what was written stays, in the history too
            self._record(channel, turn, said, edits.text)
            raise
        except Exception as exc:  # refused or failed: say so in the reply, keep no trace of it
            log.warning("request %s failed: %s: %s", turn.request_id, type(exc).__name__, exc,
                        exc_info=not isinstance(exc, AsyncInferError))  # a bug's traceback, for the log
            sorry = _apology(exc)
            await edits.replace(f"{edits.text} [{sorry}]" if edits.text else sorry)
            return
        self._record(channel, turn, said, edits.text)
        await edits.finish()

    def _record(self, channel: Any, turn: _Turn, said: dict[str, str], answer: str) -> None:
        """The exchange enters the history as a pair, unless the channel was reset since it was sent."""
        if answer and self.resets[channel] == turn.resets:
            self.histories[channel] += [said, {"role": "assistant", "content": answer}]


def roll_dice(dice: random.Random, count: int, sides: int, modifier: int) -> str:
    """The ``roll_dice`` tool itself: "🎲 2d20+3: 7 + 15 + 3 = 25"."""
    faces = [dice.randint(1, sides) for _ in range(count)]
    terms = " + ".join(map(str, faces)) + (f" {'+' if modifier > 0 else '-'} {abs(modifier)}" if modifier else "")
    return f"🎲 {count}d{sides}{modifier:+d}: {terms} = {sum(faces) + modifier}" if modifier else (
        f"🎲 {count}d{sides}: {terms} = {sum(faces)}")


def _apology(exc: Exception) -> str:
    if isinstance(exc, EngineOverloadedError):
        return "I'm busy right now, please try again in a moment."
    return "Sorry, I could not answer that."


class _Turn:
    """A message's place in its channel: it is answered once ``before`` (the previous message's
    turn) is done, and ``mine`` is done once it is answered (or stopped) and ``before`` is done.
    (A plain class: the tests load this file without registering it as a module, which
    dataclasses need.)"""

    def __init__(self, request_id: str, priority: int, resets: int, before: asyncio.Future[None] | None,
                 mine: asyncio.Future[None]) -> None:
        self.request_id = request_id
        self.priority = priority
        self.resets = resets  # the channel's !reset count when the message arrived
        self.before = before
        self.mine = mine

    def pass_on(self) -> None:
        if self.before is None or self.before.done():
            self._done()
        else:  # stopped while waiting: the next one still waits for the one before
            self.before.add_done_callback(lambda _: self._done())

    def _done(self) -> None:
        if not self.mine.done():
            self.mine.set_result(None)


class _Edits:
    """One reply's text, shown by editing its message at most once per ``interval`` seconds."""

    def __init__(self, message: Any, interval: float) -> None:
        self.message = message
        self.interval = interval
        self.text = ""
        self.shown = "…"
        self.last = time.monotonic()

    async def add(self, piece: str) -> None:
        self.text += piece
        if time.monotonic() - self.last >= self.interval:
            await self._show(self.text + " …")

    async def finish(self, suffix: str = "") -> None:
        await self._show((self.text or "(no answer)") + suffix)

    async def replace(self, content: str) -> None:
        """Show ``content`` instead of the reply (a refusal, an apology)."""
        await self._show(content)

    async def _show(self, content: str) -> None:
        content = content if len(content) <= DISCORD_LIMIT else content[:DISCORD_LIMIT - 1] + "…"
        if content != self.shown:
            await self.message.edit(content=content)
            self.shown = content
            self.last = time.monotonic()


def main() -> None:  # pragma: no cover - needs a Discord token and the network
    try:
        import aiohttp  # discord.py's HTTP client
        import discord
    except ImportError:
        raise SystemExit("examples/discord_bot.py needs discord.py: pip install 'asyncinfer[discord]'") from None

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path or name (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    token = os.environ.get("DISCORD_TOKEN", "").strip()  # (a token copied with a space or a line break around it)
    if not token:
        raise SystemExit("set DISCORD_TOKEN to the bot's token")

    class Client(discord.Client):
        bot: ChatBot

        async def setup_hook(self) -> None:
            # Off the event loop: the gateway keeps its heartbeat while the model loads.
            engine = await AsyncEngine.load(args.model, scheduler="aging-priority")
            await engine.start()
            self.bot = ChatBot(engine)

        async def on_message(self, message: discord.Message) -> None:
            if self.user in message.mentions or isinstance(message.channel, discord.DMChannel):
                await self.bot.on_message(message, message.content.replace(self.user.mention, ""))

        async def close(self) -> None:
            if hasattr(self, "bot"):
                await self.bot.engine.aclose(abort=True)
            await super().close()

    intents = discord.Intents.default()
    intents.message_content = True
    try:
        Client(intents=intents).run(token)
    except discord.LoginFailure as exc:  # one line, not discord.py's traceback
        raise SystemExit(f"Discord refused DISCORD_TOKEN ({exc}): copy the bot's token from the developer portal") from None
    except aiohttp.ClientConnectionError as exc:
        raise SystemExit(f"cannot reach Discord ({exc}): check the network") from None


if __name__ == "__main__":
    main()
