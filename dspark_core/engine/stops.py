"""Stop conditions: EOS, max_tokens and stop strings, applied as tokens are committed."""

from __future__ import annotations

from collections.abc import Sequence

from dspark_core.engine.request import Request


class StopChecker:
    """Appends committed tokens to a request and says why it stops, if it does."""

    def __init__(self, eos_ids: Sequence[int], tokenizer) -> None:
        self.eos_ids = tuple(eos_ids)
        self.tokenizer = tokenizer

    def append(self, request: Request, tokens: list[int]) -> str | None:
        """Extend ``request.output``; return "stop"/"length" when it is finished, else None."""
        reason = None
        room = request.remaining
        # A step's caps are set when it is built, and the tokens committed since (the prefill's
        # first token, or with schedule overlap the previous step's) may leave less room than that:
        # a step can commit past max_tokens. Those tokens were never asked for, so an EOS among them
        # does not count: the request ends for length, as decoding one token at a time would have.
        if len(tokens) >= room:
            tokens, reason = tokens[:room], "length"
        if not request.params.ignore_eos:
            for i, token in enumerate(tokens):
                if token in self.eos_ids:
                    tokens, reason = tokens[:i], "stop"  # the EOS itself is not output
                    break
        request.output.extend(tokens)
        if self.tokenizer is None:
            return reason
        if request.params.stop and tokens:
            text = self.tokenizer.decode(request.output)
            if any(s in text for s in request.params.stop):
                # Keep the tokens up to the one that completed a stop string: decoding one token at a
                # time stops there, and a step that committed several must report the same tokens.
                for end in range(len(request.output) - len(tokens) + 1, len(request.output) + 1):
                    text = self.tokenizer.decode(request.output[:end])
                    hits = [text.index(s) for s in request.params.stop if s in text]
                    if hits:
                        del request.output[end:]
                        request.text = text[: min(hits)]
                        return "stop"
        if reason is not None:
            request.text = self.tokenizer.decode(request.output)
        return reason
