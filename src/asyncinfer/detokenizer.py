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

**A run that gives no text.** Tokens wait for their text only while they may still complete a
character: more than :data:`MAX_WAITING_TOKENS` waiting (a run of special tokens the decode skips,
or of bytes that are no UTF-8, which a caller can make a model write) are settled, so that a token's
decode reads a window of a few tokens however long the run (each token used to decode the whole run
again: a cost per token that grew with the reply, paid on the engine thread in every step its
neighbours shared). The text is unchanged.

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
#: The most tokens that wait for their text (an incomplete character) before they are taken as a run that
#: gives none (:meth:`IncrementalDetokenizer._settle_run`): a character is at most 4 bytes.
MAX_WAITING_TOKENS = 16
_CONTEXT_TOKENS = 4  # tokens of left context kept in the window after a run is settled


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

        # the ids the offsets index: the output's, less a run of tokens that added no text (_settle_run)
        self._window: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(window[prefix_offset:read_offset])
        self._held_replacements = 0  # U+FFFDs a settled run ended with (_settle_run): text once a character follows
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
        self._window.append(token_id)
        chunk = self._after_held(self._decode_new())
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
        window = self._window
        if self._read_offset < len(window):
            new_text = self._decode(window[self._prefix_offset :]).rstrip(_REPLACEMENT)
            if len(new_text) > len(self._prefix_text):
                chunk = new_text[len(self._prefix_text) :]
                self._prefix_offset = self._read_offset = len(window)
                self._prefix_text = ""
                self._append(self._after_held(chunk))
        return self._release(len(self._pending))  # U+FFFDs still held end the text: dropped with it

    # ------------------------------------------------------------------ internals

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        return self.tokenizer.decode(ids, **self._decode_kwargs)

    def _decode_new(self) -> str:
        """Advance the offsets if the pending tokens decode to stable text; return it."""
        ids = self._window
        prefix_text = self._prefix_text
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # nothing new yet, or an incomplete multi-byte character: the tokens wait, unless they are a run
            # no character can take (_settle_run)
            return "" if len(ids) - self._read_offset <= MAX_WAITING_TOKENS else self._settle_run(new_text)
        chunk = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        return chunk

    def _settle_run(self, new_text: str) -> str:
        """More than :data:`MAX_WAITING_TOKENS` tokens wait without text: more than any character needs (an
        incomplete one ends in at most 3 bytes). They are a run that gives no text, such as special tokens
        the decode skips, or that gives only U+FFFDs, such as bytes that are no UTF-8. Each token decoded the
        whole run again: a reply of such tokens cost the engine thread time in the square of its length
        (8,000 of them: 0.75 ms a token, 3.6 s in all). So the run is settled and the window is back to a few
        tokens: tokens that add no text leave it (where the text without them is the same); then the text up
        to the last token at which the decoded text splits cleanly (it is a prefix of the whole, and the tokens
        after add characters: only the last character of a decode can still change) is settled, and its
        trailing U+FFFDs are held, as a count, until a character follows (:meth:`_after_held`; :meth:`flush`
        drops them, as a cut character). The text is the same as the whole decode's."""
        ids, start, read = self._window, self._prefix_offset, self._read_offset
        prefix_text = self._prefix_text
        # waiting tokens that add no text (special tokens the decode skips) leave the window, where the text
        # without them is the same
        kept = [t for t in ids[read:] if self._decode([t])]
        if len(kept) < len(ids) - read and self._decode(ids[start:read] + kept) == new_text:
            ids[read:] = kept
            if len(kept) <= MAX_WAITING_TOKENS:
                return ""
        split = None
        for end in range(len(ids) - 1, max(read, len(ids) - 4), -1):
            head = self._decode(ids[start:end])
            if len(head) >= len(prefix_text) and len(new_text) > len(head) and new_text.startswith(head):
                split = end, head
                break
        if split is None or not split[1].startswith(prefix_text):  # (never seen) settle all the run
            split = len(ids), new_text if new_text.startswith(prefix_text) else prefix_text
        end, head = split
        self._prefix_offset = max(read, end - _CONTEXT_TOKENS)
        self._read_offset = end
        self._prefix_text = self._decode(ids[self._prefix_offset : end])
        return head[len(prefix_text) :]

    def _after_held(self, chunk: str) -> str:
        """``chunk`` after the U+FFFDs held before it, holding those it ends with in turn: text that ends in
        U+FFFD is shown only once a character follows (:meth:`_settle_run`), at a cost that does not grow with
        the run."""
        if not chunk:
            return ""
        text = chunk.rstrip(_REPLACEMENT)
        if not text:
            self._held_replacements += len(chunk)
            return ""
        held, self._held_replacements = self._held_replacements, len(chunk) - len(text)
        return _REPLACEMENT * held + text if held else text

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
