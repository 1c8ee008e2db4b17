"""Properties of request validation and stream detokenization (no sockets)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_core.server.responses import TextDeltas
from dspark_core.server.schema import ApiError, check_lengths, parse_request
from dspark_core.server.testing import byte_tokenizer

TOKENIZER = byte_tokenizer()
# JSON proper: json.dumps would write inf as `Infinity`, which is not JSON (refused as invalid_json)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)
FIELDS = st.sampled_from(["prompt", "messages", "temperature", "max_tokens", "stream", "stop", "n", "model", "top_p",
                          "stream_options", "seed", "user", "ignore_eos", "return_token_ids", "max_completion_tokens",
                          "logprobs"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(FIELDS, JSON, max_size=6), st.booleans())
def test_any_body_is_accepted_or_refused_with_400(body, chat):
    try:
        request = parse_request(json.dumps(body).encode(), chat=chat)
    except ApiError as error:
        assert error.status == 400 and error.param and error.message.startswith(error.param.split("[")[0])
        return
    assert body["temperature"] == 0 and not isinstance(body["temperature"], bool)
    assert (request.messages if chat else request.prompt)


@given(st.integers(1, 300), st.one_of(st.none(), st.integers(1, 300)))
def test_check_lengths_never_exceeds_the_usable_context(prompt, max_tokens):
    try:
        granted = check_lengths(prompt, max_tokens, max_model_len=256, reserve=16, default_max_tokens=None)
    except ApiError as error:
        assert error.status == 400 and str(prompt) in error.message
        assert prompt >= 240 or (max_tokens is not None and prompt + max_tokens > 240)
        return
    assert granted >= 1 and prompt + granted <= 240
    assert granted == (max_tokens if max_tokens is not None else 240 - prompt)


# a small alphabet so that stop strings really occur: ASCII, pieces of "é" and "€", a special token
PIECES = [*b"aabb\n\nxyz", 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 257, 0, 200]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40), st.lists(st.integers(1, 5), max_size=40),
       st.sampled_from([(), ("ab",), ("\n\n", "xyz"), ("bba", "é")]))
def test_stream_pieces_add_up_to_the_final_text(ids, cuts, stop):
    """Mirror the service: each step's tokens reach the stream unless that step finishes the request
    (a stop string appeared); then the final, stop-cut text completes what was sent."""
    deltas, sent, out, at = TextDeltas(TOKENIZER, stop), "", [], 0
    final = None
    for cut in cuts + [len(ids)]:
        step = ids[at: at + cut]
        at += len(step)
        out += step
        text = TOKENIZER.decode(out)
        hits = [text.index(s) for s in stop if s in text]
        if hits:
            final = text[: min(hits)]
            break
        sent += deltas.add(step)
        assert text.startswith(sent)  # never anything that must be taken back
    if final is None:
        final = TOKENIZER.decode(out)
    assert final.startswith(sent)
    assert sent + deltas.finish(final) == final
