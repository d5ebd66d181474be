"""stranger30: the less common calls of docs/api.md, followed as a stranger would."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, trim_messages
from asyncinfer.prompts import MAX_CHAT_MESSAGES


async def test_trim_messages_drops_old_turns_that_count_tokens_refuses_by_size(real_gguf: Path) -> None:
    """A history whose old turns are over the characters (or messages) any prompt may have, a pasted log of a
    megabyte, made ``trim_messages(history, budget, engine.count_tokens)`` raise count_tokens' refusal
    (``prompt='<1000035 characters>' is invalid``) instead of dropping those turns, which is what it is for."""
    engine = await AsyncEngine.load(real_gguf, num_threads=1, max_model_len=512)
    async with engine:
        system = {"role": "system", "content": "be brief"}
        last = {"role": "user", "content": "hi"}
        pasted = [{"role": "user", "content": "word " * 200_000}, {"role": "assistant", "content": "ok"}]
        assert trim_messages([system, *pasted, last], 400, engine.count_tokens) == [system, last]
        chatter = [{"role": r, "content": "x"} for r in ("user", "assistant") * (MAX_CHAT_MESSAGES // 2 + 1)]
        kept = trim_messages([system, *chatter, last], 400, engine.count_tokens)
        assert kept[0] == system and kept[-1] == last and engine.count_tokens(kept) <= 400
        # the last turn itself too long is still refused, by count_tokens' own words
        with pytest.raises(InvalidParameterError, match="characters"):
            trim_messages([system, pasted[0]], 400, engine.count_tokens)
