"""Incremental (streaming) detokenization with stop strings.

Decoding token by token is wrong for byte-level BPE: one emoji or CJK character
is often split over several tokens, and decoding a token alone yields U+FFFD.
SentencePiece tokenizers additionally drop the leading space of the first
decoded token. :class:`IncrementalDetokenizer` therefore keeps two offsets into
the output ids (the *prefix/read offset* technique):

* ``prefix_offset .. read_offset``: tokens already turned into text, kept as
  left context so the next token decodes as it would inside the full sequence;
* ``read_offset .. end``: tokens not yet turned into text.

Each step decodes ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]``
and emits the difference, but only once it does not end in U+FFFD (an
incomplete UTF-8 sequence); otherwise the tokens wait for the next one.

**Invariant.** Without a stop string hit, the concatenation of everything
``add`` returned plus ``flush()`` equals
``tokenizer.decode(output_ids, skip_special_tokens=params.skip_special_tokens)``
less any U+FFFD at its very end (with ``clean_up_tokenization_spaces=False`` for
the rare tokenizers that enable it by default: that clean-up cannot be applied
incrementally). The text is decoded from the *output ids alone*, so a leading
space is kept or dropped exactly as ``decode(output_ids)`` does; the prompt is
not used as left context.

**A character cut at the end.** When generation ends (``max_tokens``, a stop
token, EOS, an abort) in the middle of a multi-byte character, its bytes can
never be completed: :meth:`flush` drops them, so a reply never ends in U+FFFD.
Their token ids stay in the output's ``token_ids``. (A reply whose last real
character is U+FFFD itself loses it too: the decoded text cannot tell the two apart.)

**Stop strings.** Text that could still be the beginning of a stop string (a
suffix of at most ``max(len(stop)) - 1`` characters that is a prefix of one of
them) is held back, so a partial stop string is never shown. The stop strings are
one :class:`StopMatcher` (an Aho-Corasick automaton, built once per request and
shared by its ``n`` samples): each new character of text is one transition
(amortised), and the automaton's state is the longest suffix of the text that
could start a stop string, so neither the search nor the hold-back looks at the
stop list again; a token costs the same whether the list holds one string or
:data:`~asyncinfer.sampling_params.MAX_STOP_STRINGS`. When a stop string appears (possibly spanning tokens) the text is cut before it
(after it with ``include_stop_str_in_output``), ``add`` returns ``stop=True``
and :attr:`stop_reason` holds the matched string. With several stop strings the
one that *completes* first wins (ties: the one starting first), which makes the
result independent of how the text is split into tokens. As in vLLM, stop
strings are only looked for once ``params.min_tokens`` tokens have been added.
With ``include_stop_str_in_output`` nothing is held back (the text up to and
including a stop string is shown anyway).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from typing import Any

from asyncinfer.models.tokenizer import CachedTokenizer
from asyncinfer.sampling_params import SamplingParams

__all__ = ["IncrementalDetokenizer", "StopMatcher"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams one request's output text; feed it every output token in order.

    ``tokenizer`` is a Hugging Face tokenizer (anything with
    ``decode(ids, skip_special_tokens=...)``). ``prompt_token_ids`` is accepted for
    the engine's convenience but not used (see the module docstring). ``stops``: a
    :class:`StopMatcher` of ``params``' stop strings to share (the samples of one request
    do); None builds one.

    Feed the EOS / stop token only if its text is wanted: with
    ``skip_special_tokens=False`` a special token's text is part of the output.
    After a stop hit or :meth:`flush`, further :meth:`add` calls are ignored and
    return ``("", stopped)``.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams, *, stops: StopMatcher | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_token_ids: list[int] = []
        #: the stop string that ended generation, or None.
        self.stop_reason: str | None = None

        self._decode_kwargs: dict[str, Any] = {"skip_special_tokens": params.skip_special_tokens}
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode_kwargs["clean_up_tokenization_spaces"] = False
        self._backend = _backend_tokenizer(tokenizer)

        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        # The text is kept in pieces so that a long output costs O(1) per token:
        self._done: list[str] = []  # text already handed out
        self._pending = ""  # decoded text not handed out yet (held back)
        self._finished = False

        #: the request's stop strings as an automaton (``stops``: one built for the same strings, to share it).
        self.stops = stops if stops is not None else StopMatcher(params.stop_strings)
        self._state = 0  # the automaton's state after the whole text
        self._hold = 0 if params.include_stop_str_in_output else max(self.stops.max_len - 1, 0)

    # ------------------------------------------------------------------ public

    @property
    def text(self) -> str:
        """Output text so far: what was emitted plus what is held back.

        Excludes the stop string after a hit (unless ``include_stop_str_in_output``)
        and tokens still waiting to complete a character (until :meth:`flush`).
        """
        if len(self._done) > 1:
            self._done = ["".join(self._done)]
        return (self._done[0] if self._done else "") + self._pending

    @property
    def stopped(self) -> bool:
        """True once a stop string was hit."""
        return self.stop_reason is not None

    @property
    def finished(self) -> bool:
        """True after a stop hit or :meth:`flush`."""
        return self._finished

    def add(self, token_id: int) -> tuple[str, bool]:
        """Add one output token; return ``(newly printable text, stop_string_hit)``."""
        if self._finished:
            return "", self.stopped
        self.output_token_ids.append(token_id)
        chunk = self._decode_new()
        if chunk and self._append(chunk):
            return self._release(len(self._pending)), True
        return self._release(self._safe_end()), False

    def flush(self) -> str:
        """Finish: return all text still held back (never part of a hit stop string).

        Tokens still waiting for the rest of a UTF-8 sequence that will never come
        are dropped: the text never ends in U+FFFD (see the module docstring).
        """
        if self._finished:
            return ""
        self._finished = True
        if self._read_offset < len(self.output_token_ids):
            new_text = self._decode(self.output_token_ids[self._prefix_offset :]).rstrip(_REPLACEMENT)
            if len(new_text) > len(self._prefix_text):
                chunk = new_text[len(self._prefix_text) :]
                self._prefix_offset = self._read_offset = len(self.output_token_ids)
                self._prefix_text = ""
                self._append(chunk)
        return self._release(len(self._pending))

    # ------------------------------------------------------------------ internals

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        return self.tokenizer.decode(ids, **self._decode_kwargs)

    def _decode_new(self) -> str:
        """Advance the offsets if the pending tokens decode to stable text; return it."""
        ids = self.output_token_ids
        prefix_text = self._prefix_text
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or an incomplete multi-byte character
        chunk = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        return chunk

    def _append(self, chunk: str) -> bool:
        """Append ``chunk`` to the text; on a stop string, cut there and return True.

        The automaton reads each character of ``chunk`` once; the first stop string it
        completes wins (the longest one ending there: the one starting first). Stops are
        reported only once ``min_tokens`` tokens were added, as before. A stop string
        never starts in text already handed out: that text was released because no
        suffix of it could start one.
        """
        stops = self.stops
        if not stops:
            self._pending += chunk
            return False
        report = len(self.output_token_ids) >= self.params.min_tokens
        state, end, hit = stops.scan(self._state, chunk, report)
        if hit is None:
            self._state = state
            self._pending += chunk
            return False
        text = self._pending + chunk[:end]
        cut = len(text) if self.params.include_stop_str_in_output else len(text) - len(hit)
        self._pending = text[: max(cut, 0)]
        self.stop_reason = hit
        self._finished = True
        return True

    def _safe_end(self) -> int:
        """How much of the pending text can be shown: up to the longest suffix that may start a stop string."""
        n = len(self._pending)
        if not self._hold:
            return n
        return n - self.stops.prefix_len(self._state, min(self._hold, n))

    def _release(self, end: int) -> str:
        out = self._pending[:end]
        if out:
            self._pending = self._pending[end:]
            self._done.append(out)
        return out


class StopMatcher:
    """Stop strings as an Aho-Corasick automaton: find them in a growing text at a cost per
    character that does not depend on how many there are.

    Immutable once built (the state of a scan is the caller's int), so the samples of one
    request share it. Built in time linear in the strings' total length, which
    :class:`~asyncinfer.sampling_params.SamplingParams` bounds (``MAX_STOP_CHARS``).
    State 0 is the empty string; every state is a prefix of some stop string.
    """

    __slots__ = ("_depth", "_fail", "_goto", "_match", "max_len", "strings")

    def __init__(self, strings: Sequence[str]) -> None:
        self.strings = tuple(dict.fromkeys(strings))
        self.max_len = max((len(s) for s in self.strings), default=0)
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        word: list[str | None] = [None]
        for string in self.strings:
            node = 0
            for ch in string:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    word.append(None)
                node = nxt
            word[node] = string
        fail = [0] * len(goto)
        # match[s]: the longest stop string that is a suffix of state s's string (its own, else its fail's).
        match = list(word)
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0) if node else 0
                if match[child] is None:
                    match[child] = match[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._depth, self._match = goto, fail, depth, match

    def __bool__(self) -> bool:
        return bool(self.strings)

    def scan(self, state: int, text: str, report: bool = True) -> tuple[int, int, str | None]:
        """Read ``text`` from ``state``: ``(state after it, end, None)``, or, with ``report``, at the first
        stop string completed, ``(its state, end, the string)`` where ``text[:end]`` ends with it."""
        goto, fail, match = self._goto, self._fail, self._match
        for i, ch in enumerate(text):
            while True:
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if not state:
                    break
                state = fail[state]
            if report and match[state] is not None:
                return state, i + 1, match[state]
        return state, len(text), None

    def prefix_len(self, state: int, limit: int) -> int:
        """The length of the longest suffix of the text read into ``state``, at most ``limit``
        characters long, that is the beginning of a stop string."""
        depth, fail = self._depth, self._fail
        while depth[state] > limit:
            state = fail[state]
        return depth[state]


def _backend_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a fast Hugging Face tokenizer whose ``decode`` only wraps it
    (neither ``decode`` nor ``_decode`` overridden; the detokenizer turns the clean-up off), else None.
    Decoding with it gives the same text without transformers' per-call Python, which a decode step
    pays once per request per token."""
    if isinstance(tokenizer, CachedTokenizer):  # its decode is the backend's
        return tokenizer.backend_tokenizer
    transformers = sys.modules.get("transformers")  # not loaded: the tokenizer is not one of its classes
    if transformers is None:
        return None
    PreTrainedTokenizerFast = transformers.PreTrainedTokenizerFast
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or cls.decode is not PreTrainedTokenizerFast.decode or (
            cls._decode is not PreTrainedTokenizerFast._decode) or {"decode", "_decode"} & vars(tokenizer).keys():
        return None  # (a decode of its own, on the class or on this object)
    return getattr(tokenizer, "backend_tokenizer", None)
