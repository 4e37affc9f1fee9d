"""One OpenAI answer being built from a request's step outputs: the whole response, or its stream
chunks in order (head, one per output, usage). `LLM.create_completion` / `create_chat_completion`
and the HTTP routes (`metatp.server.app`) build every answer here, so the routes keep only
parsing, SSE and auth, and an echo, a logprobs object or a usage count is computed one way.

An answer has `n` choices per prompt (choice i answers prompt i // n); its outputs are the
`StepOutput`s of each choice's request, the last one with its finish_reason. The shapes
themselves are `metatp.openai_api`'s.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable, Sequence

from metatp import openai_api as oai
from metatp.tool_answers import ReplyTokens, ToolStream, tool_answer

if TYPE_CHECKING:
    from metatp.tool_calls import ToolPlan

__all__ = ["TextAnswer", "ChatAnswer"]


class _Answer:
    """What both kinds share: ids, choices, usage, and the stream's closing usage chunk."""

    kind = ""

    def __init__(self, model: str, ids_list: list[list[int]], n: int, piece: Callable[[int], str],
                 stream_usage: bool = False) -> None:
        self.model, self.ids_list, self.n, self.piece = model, ids_list, n, piece
        self.stream_usage = stream_usage
        self.cid, self.created = oai.response_id(self.kind)
        self.n_gen = 0                              # tokens generated so far, over every choice

    @property
    def n_choices(self) -> int:
        return len(self.ids_list) * self.n

    def usage(self, n_gen: int) -> dict:
        """Usage: the prompts counted once however many samples each has (n)."""
        return oai.usage(sum(len(ids) for ids in self.ids_list), n_gen)

    def tail(self) -> list[dict]:
        """The stream's last chunk before [DONE]: usage, when the client asked for it."""
        return [self._chunk([], self.usage(self.n_gen))] if self.stream_usage else []

    def chunks(self, choice: int, out) -> list[dict]:
        """The stream chunks of one output, in order (none when it carries nothing to send)."""
        c = self.chunk(choice, out)
        return [] if c is None else [c]

    def chunk(self, choice: int, out) -> dict | None:
        """The stream chunk of one output (None when it carries nothing to send): its text and
        the logprobs of the tokens that text is made of (a token with no text, a special one,
        still sends its logprobs), so the stream carries every token the whole answer lists."""
        self.n_gen += out.token is not None
        if not (out.text or out.finish_reason or (self._wants_lp() and out.tokens)):
            return None
        return self._chunk([self._delta(choice, out)])

    def _wants_lp(self) -> bool:
        return False

    def _chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        raise NotImplementedError

    def _delta(self, choice: int, out) -> dict:
        raise NotImplementedError


class TextAnswer(_Answer):
    """A completion: optional echo of the prompt (with its logprobs: `scored[p]`, entries of
    `metatp.logprobs.prompt_logprobs`), generated logprobs (`logprobs` alternatives), vLLM's
    `prompt_logprobs`."""

    kind = "cmpl"

    def __init__(self, model: str, ids_list: list[list[int]], n: int, piece: Callable[[int], str],
                 detokenize: Callable[[list[int]], str], stream_usage: bool = False, echo: bool = False,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 scored: Sequence[list] | None = None, echo_text: Sequence[str] | None = None) -> None:
        super().__init__(model, ids_list, n, piece, stream_usage)
        self.echo, self.lp, self.n_prompt_lp, self.scored = echo, logprobs, prompt_logprobs, scored
        self.prefixes = ([*echo_text] if echo_text is not None else [detokenize(ids) for ids in ids_list]) \
            if echo else [""] * len(ids_list)

    def _chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        return oai.text_completion(self.cid, self.created, self.model, choices, use, stream_usage=self.stream_usage)

    def _wants_lp(self) -> bool:
        return self.lp is not None

    def _choice_lp(self, outs: list) -> dict | None:
        return None if self.lp is None else oai.completion_logprobs(outs, self.piece)

    def _delta(self, choice: int, out) -> dict:
        return oai.text_choice(choice, out.text, out.finish_reason, self._choice_lp([out]))

    def _echoed(self, choice: int) -> tuple[str, dict | None]:
        """The prompt's text and logprobs at the head of this choice (echo)."""
        p = choice // self.n
        if not self.echo:
            return "", None
        if self.lp is None:
            return self.prefixes[p], None
        return self.prefixes[p], oai.echo_logprobs(self.ids_list[p], [_top_k(e, self.lp) for e in self.scored[p]],
                                                   self.piece)

    def _with_prompt_lp(self, c: dict, choice: int) -> dict:
        if self.n_prompt_lp is not None:
            p = choice // self.n
            c["prompt_logprobs"] = oai.vllm_prompt_logprobs(
                self.ids_list[p], [e if e is None else (*_top_k(e, self.n_prompt_lp), e[2]) for e in self.scored[p]],
                self.piece)
        return c

    def head(self) -> list[dict]:
        """The stream's first chunks: the echoed prompt (and prompt logprobs), once per choice."""
        if not (self.echo or self.n_prompt_lp is not None):
            return []
        out = []
        for choice in range(self.n_choices):
            text, plp = self._echoed(choice)
            out.append(self._chunk([self._with_prompt_lp(oai.text_choice(choice, text, None, plp), choice)]))
        return out

    def whole(self, per: list[list]) -> dict:
        """The whole completion from every choice's outputs."""
        choices = []
        for choice, outs in enumerate(per):
            text, plp = self._echoed(choice)
            lp = oai.join_logprobs(plp, self._choice_lp(outs), len(text)) if self.lp is not None else None
            choices.append(self._with_prompt_lp(oai.text_choice(choice, text + "".join(o.text for o in outs),
                                                                outs[-1].finish_reason, lp), choice))
        n_gen = sum(o.token is not None for outs in per for o in outs)
        return oai.text_completion(self.cid, self.created, self.model, choices, self.usage(n_gen))


class ChatAnswer(_Answer):
    """A chat completion: the assistant's message per choice, with OpenAI's chat logprobs
    (`logprobs`: whether to report them). With a tool plan (`tools`, metatp.tool_calls) each
    choice's text is read for tool calls once it is whole; a stream sends the content that cannot
    turn into a call as it comes (`ToolStream`), holds the rest, and at the end sends the rest of
    the content or the tool calls (a call's id and name first, then its arguments)."""

    kind = "chatcmpl"

    def __init__(self, model: str, ids: list[int], n: int, piece: Callable[[int], str], stream_usage: bool = False,
                 logprobs: bool = False, tools: "ToolPlan | None" = None) -> None:
        super().__init__(model, [ids], n, piece, stream_usage)
        self.want_lp = logprobs
        self.tools = tools
        self.held: dict[int, list] = {}          # choice -> its outputs not sent yet (with tools)
        self.streams: dict[int, ToolStream] = {}     # choice -> what of its text has gone out (with tools)
        self.replies: dict[int, ReplyTokens] = {}    # choice -> its tokens' logprobs listed (a generic reply)

    def chunks(self, choice: int, out) -> list[dict]:
        if self.tools is None:
            return super().chunks(choice, out)
        self.n_gen += out.token is not None
        stream = self.streams.setdefault(choice, ToolStream(self.tools))
        outs = self.held.setdefault(choice, [])          # outputs whose logprobs have not gone out yet
        outs.append(out)
        if stream.replies:
            self.replies.setdefault(choice, ReplyTokens()).add(out.tokens)
        piece = stream.push(out.text)
        if out.finish_reason is None:
            if not piece:
                return []
            self.held[choice] = []
            return [self._chunk([oai.chat_delta(choice, piece, None, self._held_lp(choice, outs))])]
        del self.held[choice], self.streams[choice]
        content, calls, finish = stream.finish(out.finish_reason)
        content = (piece + (content or "")) or None
        lp = self._held_lp(choice, outs, final=True)
        self.replies.pop(choice, None)
        pieces = [oai.chat_delta(choice, content, None, lp)] if content else []
        pieces += [oai.chat_delta(choice, None, None, tool_calls=d) for d in oai.tool_call_deltas(calls)]
        pieces.append(oai.chat_delta(choice, None, finish, None if content else lp))
        return [self._chunk([p]) for p in pieces]

    def _chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        return oai.chat_chunk(self.cid, self.created, self.model, choices, use, stream_usage=self.stream_usage)

    def _wants_lp(self) -> bool:
        return bool(self.want_lp)

    def _choice_lp(self, outs: list) -> dict | None:
        return oai.chat_logprobs(outs, self.piece) if self.want_lp else None

    def _held_lp(self, choice: int, outs: list, final: bool = False) -> dict | None:
        """The logprobs going out with a tool plan's content: the held outputs' tokens, or for a
        generic-format reply its tokens not listed yet (`ReplyTokens`)."""
        reply = self.replies.get(choice)
        if reply is None:
            return self._choice_lp(outs)
        return self._tokens_lp(reply.take(final))

    def _tokens_lp(self, tokens: list) -> dict | None:
        return oai.chat_logprobs([SimpleNamespace(tokens=tokens)], self.piece) if self.want_lp else None

    def _delta(self, choice: int, out) -> dict:
        return oai.chat_delta(choice, out.text, out.finish_reason, self._choice_lp([out]))

    def head(self) -> list[dict]:
        """The stream's first chunks: the assistant role, once per choice."""
        return [self._chunk([oai.chat_delta(i, None, None, role=True)]) for i in range(self.n_choices)]

    def _choice(self, i: int, outs: list) -> dict:
        text, finish = "".join(o.text for o in outs), outs[-1].finish_reason
        if self.tools is None:
            return oai.chat_choice(i, text, finish, self._choice_lp(outs))
        content, calls, finish = tool_answer(self.tools, text, finish)
        lp = self._choice_lp(outs)
        if self.want_lp and ToolStream(self.tools).replies:      # a generic reply: its string's tokens
            reply = ReplyTokens()
            reply.add([t for o in outs for t in o.tokens])
            lp = self._tokens_lp(reply.take(final=True))
        return oai.chat_choice(i, content, finish, lp, calls)

    def whole(self, per: list[list]) -> dict:
        choices = [self._choice(i, outs) for i, outs in enumerate(per)]
        n_gen = sum(o.token is not None for outs in per for o in outs)
        return oai.chat_completion(self.cid, self.created, self.model, choices, self.usage(n_gen))


def _top_k(entry: tuple | None, k: int) -> tuple | None:
    """A prompt logprobs entry (logprob, top alternatives, ...) with its top `k` alternatives."""
    if entry is None:
        return None
    lp, top = entry[0], entry[1]
    return lp, dict(sorted(top.items(), key=lambda kv: (-kv[1], kv[0]))[:k])
