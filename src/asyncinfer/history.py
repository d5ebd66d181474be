"""Keeping a chat history within a token budget.

A conversation grows until its prompt no longer leaves room for the reply
(prompt + ``max_tokens`` must fit ``max_model_len``). :func:`trim_messages` drops
the oldest turns, keeping the system message(s) at the start and the latest
turn, until the rendered prompt fits::

    budget = engine.max_model_len - params.max_tokens
    history = trim_messages(history, budget, engine.count_tokens)
    reply = await engine.generate(history, params)

Whole turns are dropped (a user message and the replies after it), never half of
one, so the history still alternates user/assistant as strict chat templates require.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncinfer.errors import InvalidParameterError, PromptTooLongError
from asyncinfer.plain import plain_value
from asyncinfer.prompts import plain_list

__all__ = ["trim_messages"]

Message = dict[str, str]

#: What ``trim_messages``' ``count_tokens`` must be.
COUNT_TOKENS_ALLOWED = "a function of a message list that returns its token count (an int >= 0): engine.count_tokens"


def _count(count_tokens: Callable[[list[Message]], int], messages: list[Message]) -> int:
    """``count_tokens(messages)``, held to an int >= 0 (a list of ids, from ``engine.tokenize``, failed a comparison
    with Python's bare ``TypeError: '>' not supported between instances of 'list' and 'int'``)."""
    count = plain_value(count_tokens(messages))
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        if isinstance(count, (list, tuple)):  # engine.tokenize passed for engine.count_tokens
            shown = f"a {type(count).__name__} of {len(count)} items; engine.tokenize returns the ids themselves"
        else:
            shown = repr(count) if len(repr(count)) <= 80 else f"a {type(count).__name__}"
        raise InvalidParameterError("count_tokens", count_tokens, f"{COUNT_TOKENS_ALLOWED} (it returned {shown})")
    return count


def _fits(count_tokens: Callable[[list[Message]], int], messages: list[Message], budget: int) -> bool:
    """Whether ``messages`` take at most ``budget`` tokens; a list that ``engine.count_tokens`` refuses by its size
    alone (more characters or messages than any prompt may have) does not fit: old turns of a history kept
    whole, a pasted log of a megabyte say, made trim_messages raise instead of dropping them."""
    try:
        return _count(count_tokens, messages) <= budget
    except PromptTooLongError:
        return False


def trim_messages(
    messages: Sequence[Message], budget: int, count_tokens: Callable[[list[Message]], int]
) -> list[Message]:
    """The longest suffix of whole turns of ``messages`` (after the leading system messages,
    which are always kept) whose rendered prompt takes at most ``budget`` tokens.

    ``count_tokens``: how many tokens a message list renders to, usually
    ``engine.count_tokens`` (the chat template applied, the generation prompt
    included). It is called O(log turns) times (a binary search), so a long
    history costs a few renderings, not one per turn; a list it refuses by its size alone (``engine.count_tokens``
    on more characters or messages than any prompt may have) is over the budget. ``messages`` is not changed; a sequence other than a list
    or tuple is read for at most ``prompts.MAX_SEQUENCE_ITEMS`` items, as the engine's calls read a prompt.

    Raises:
        InvalidParameterError: ``budget`` is not a positive int, ``messages`` is not a list of
            message dicts (a string, say) or is empty, or
            even the system messages and the last turn alone take more than ``budget`` tokens
            (``parameter`` is "messages"; ``allowed`` says how many tokens they take, or that ``count_tokens`` refused
            them by their size alone, longer than any prompt may be); ``count_tokens`` is not
            callable, or returns anything but an int >= 0 (``engine.tokenize``, which returns the ids, say).
    """
    budget = plain_value(budget)  # the int it holds: a subclass's comparisons may lie
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InvalidParameterError("budget", budget, "an int >= 1 (tokens)")
    # its items, read at most MAX_SEQUENCE_ITEMS deep: a sequence whose __getitem__ never raises IndexError was
    # read for ever (and a list subclass is read for what it holds, not what its __iter__ says)
    items = None if isinstance(messages, dict) else plain_list(messages, "messages")
    if items is None or not all(isinstance(m, dict) for m in items):
        shown = messages if items is None or len(items) <= 8 else f"<a {type(messages).__name__} of {len(items)} items>"
        raise InvalidParameterError("messages", shown, "a list of {'role': ..., 'content': ...} dicts")
    if not callable(count_tokens):
        raise InvalidParameterError("count_tokens", count_tokens, COUNT_TOKENS_ALLOWED)
    messages = items
    if not messages:
        raise InvalidParameterError("messages", messages, "at least one message")
    head = 0
    while head < len(messages) and messages[head].get("role") == "system":
        head += 1
    system, rest = messages[:head], messages[head:]
    starts = [i for i, m in enumerate(rest) if m.get("role") == "user"] or [0]
    if starts[0] != 0:
        starts.insert(0, 0)  # replies before the first user message form a turn of their own
    # Keeping turns from starts[k] on: fits(k) is monotonic (fewer turns, fewer tokens).
    lo, hi = 0, len(starts) - 1
    try:
        need = _count(count_tokens, system + rest[starts[hi]:])
    except PromptTooLongError as exc:  # the system messages and last turn, refused by their size alone
        raise InvalidParameterError(
            "messages", f"<{len(messages)} messages>",
            f"a system prompt and last turn within {budget} tokens (they are longer than any prompt of the model "
            f"may be: {exc.allowed})",
        ) from exc
    if need > budget:
        raise InvalidParameterError(
            "messages", f"<{len(messages)} messages>",
            f"a system prompt and last turn within {budget} tokens (they take {need})",
        )
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(count_tokens, system + rest[starts[mid]:], budget):
            hi = mid
        else:
            lo = mid + 1
    return system + rest[starts[lo]:]
