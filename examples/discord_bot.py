"""A Discord chat bot on asyncinfer: streamed replies, per-channel memory, fair to every user.

    pip install -e '.[discord]'            # discord.py
    DISCORD_TOKEN=... python examples/discord_bot.py [--model PATH]

Enable the "Message Content" intent for the bot in the Discord developer portal.
The bot answers every message that mentions it (and every message in a DM):

- the reply streams in: the bot posts "…" at once and edits it as tokens arrive,
  at most once per ``edit_interval`` seconds (Discord rate-limits edits);
- each channel has its own history, trimmed to what fits the model
  (``trim_messages``: oldest turns first, the system prompt kept);
- ``!reset`` forgets the channel's history; ``!stop`` stops your replies being
  written (the engine aborts them and frees their memory at once);
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
import os
import time
from typing import Any

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams, trim_messages

DISCORD_LIMIT = 2000  # characters in one Discord message
SYSTEM_PROMPT = "You are a friendly assistant in a Discord chat. Keep answers short."


class ChatBot:
    """The bot's logic: commands, per-channel histories, streamed replies, per-user priorities."""

    def __init__(self, engine: AsyncEngine, *, params: SamplingParams | None = None, edit_interval: float = 1.0,
                 system_prompt: str = SYSTEM_PROMPT, history_budget: int | None = None) -> None:
        self.engine = engine
        self.params = params or SamplingParams(max_tokens=200, temperature=0.7, top_p=0.9)
        self.edit_interval = edit_interval
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        # Tokens of history a prompt may take: what leaves room for the longest reply.
        self.history_budget = history_budget or engine.max_model_len - self.params.max_tokens
        self.histories: dict[Any, list[dict[str, str]]] = collections.defaultdict(list)
        self.in_flight: dict[Any, set[asyncio.Task[None]]] = collections.defaultdict(set)
        self._ids = 0

    async def on_message(self, message: Any, content: str | None = None) -> None:
        """Handle one message meant for the bot; ``content``: its text if not ``message.content``
        (the gateway passes it with the bot's mention taken out)."""
        if message.author.bot:
            return
        text = (message.content if content is None else content).strip()
        if text == "!reset":
            self.histories.pop(message.channel.id, None)
            await message.reply("History cleared.")
        elif text == "!stop":
            for task in list(self.in_flight.get(message.author.id, ())):
                task.cancel()
        elif text:
            # Priority at arrival: how many of this user's requests are already in flight.
            task = asyncio.create_task(self._answer(message, text, self.priority(message.author.id)))
            self.in_flight[message.author.id].add(task)
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():  # our own handler was cancelled, not just the reply
                    raise
            finally:
                self.in_flight[message.author.id].discard(task)

    def priority(self, user_id: Any) -> int:
        """Lower is more urgent: each request a user already has in flight pushes the next one back."""
        return len(self.in_flight.get(user_id, ()))

    def prompt_for(self, channel_id: Any) -> list[dict[str, str]]:
        """The system prompt and the channel's history, trimmed to the token budget."""
        history = self.histories[channel_id]
        kept = trim_messages(self.system + history, self.history_budget, self.engine.count_tokens)
        self.histories[channel_id] = kept[len(self.system):]  # forget what no longer fits
        return kept

    async def _answer(self, message: Any, text: str, priority: int) -> None:
        channel = message.channel.id
        self.histories[channel].append({"role": "user", "content": f"{message.author.display_name}: {text}"})
        try:
            prompt = self.prompt_for(channel)
        except InvalidParameterError:
            self.histories[channel].pop()
            await message.reply("That message is too long for me, sorry.")
            return
        reply = await message.reply("…")
        self._ids += 1
        request_id = f"{message.author.id}/{self._ids}"  # the user as the request's tenant
        edits = _Edits(reply, self.edit_interval)
        try:
            async for delta in self.engine.stream(prompt, self.params, request_id=request_id, priority=priority):
                await edits.add(delta.text)
        except asyncio.CancelledError:
            await edits.finish(" [stopped]")
            raise
        finally:
            if edits.text:
                self.histories[channel].append({"role": "assistant", "content": edits.text})
        await edits.finish()


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

    async def _show(self, content: str) -> None:
        content = content if len(content) <= DISCORD_LIMIT else content[:DISCORD_LIMIT - 1] + "…"
        if content != self.shown:
            await self.message.edit(content=content)
            self.shown = content
            self.last = time.monotonic()


def main() -> None:  # pragma: no cover - needs a Discord token and the network
    import discord

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path or name (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    token = os.environ.get("DISCORD_TOKEN")
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
    Client(intents=intents).run(token)


if __name__ == "__main__":
    main()
