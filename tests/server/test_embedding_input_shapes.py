"""/v1/embeddings' ``input``: only OpenAI's token-id shapes (integers, or lists of integers) are refused as token-id
input; anything else that is no text (texts nested in lists, booleans, floats) is told the shape of texts to send.
Nested texts and booleans were answered "Token-id input is not supported by this server: send the text." (code
``unsupported_parameter``), for a caller who had sent text or no token ids."""

from __future__ import annotations

import pytest

from asyncinfer.server.errors import APIError
from asyncinfer.server.protocol import MAX_EMBED_INPUTS, parse_embedding

TEXTS = f"`input` must be a string or a list of 1 to {MAX_EMBED_INPUTS} strings."
TOKEN_IDS = "Token-id input is not supported by this server: send the text."


@pytest.mark.parametrize("value", [[["hello"]], [True], [[True, 1]], [[1.5]], [[1, "a"]], [[1], "a"]])
def test_what_is_no_token_ids_is_told_to_send_texts(value) -> None:
    with pytest.raises(APIError) as caught:
        parse_embedding({"input": value})
    assert (caught.value.status, caught.value.param, caught.value.message, caught.value.code) == (
        400, "input", TEXTS, None)


@pytest.mark.parametrize("value", [[1, 2, 3], [[1, 2], [3]], [[]], [[-1]]])
def test_token_ids_are_refused_as_token_id_input(value) -> None:
    with pytest.raises(APIError) as caught:
        parse_embedding({"input": value})
    assert (caught.value.status, caught.value.param, caught.value.message, caught.value.code) == (
        400, "input", TOKEN_IDS, "unsupported_parameter")
