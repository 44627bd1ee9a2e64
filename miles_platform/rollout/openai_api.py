"""The embedded engine's OpenAI-compatible routes: `POST /v1/chat/completions` (chat.py),
`POST /v1/completions` (completions.py) and `GET /v1/models`, streaming token by token.

Streaming (`stream: true`): every choice's request carries an `on_token` hook that the scheduler
calls after each token (EngineCore.submit_json). It appends (id, logprob, top) to a `TokenFeed`
and wakes the event loop at most once per burst; `stream_choices` hands the route each choice's
new tokens, and its /generate answer once it finished. `ChoiceText` turns tokens into text deltas,
holding back what the final text may not keep: a partial UTF-8 character, a stop string or its
start, and (tools parsed) the tool-call markup. The answer closes the choice: the rest of its text,
tool calls, finish_reason. A client that goes away does not stop its request: it runs to
max_tokens (the engine has no per-request abort).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from miles_platform.rollout import chat, completions
from miles_platform.rollout.engine_requests import Request as EngineRequest
from miles_platform.rollout.generate_hub.tool_call import CALL_START
from miles_platform.rollout.http_common import ENGINE_ERRORS, all_results, engine_error, json_body
from miles_platform.rollout.reasoning import REASONING_PARSERS, partial_tags, split_reasoning
from miles_platform.store.paths import partition_key

Token = tuple[int, float, Any]  # (id, logprob, top entries or None)
DONE = "data: [DONE]\n\n"


class TokenFeed:
    """The tokens of one request's choices as the scheduler thread produces them; `wait()` wakes
    the event loop when there are new ones (or a choice finished: `notify` is each future's
    done callback). One wake-up per burst, however many tokens it holds."""

    def __init__(self, n: int):
        self.loop = asyncio.get_running_loop()
        self.tokens: list[list[Token]] = [[] for _ in range(n)]
        self._wake = asyncio.Event()
        self._pending = False

    def on_token(self, index: int, r: EngineRequest) -> None:  # the scheduler thread
        top = r.output_top[-1] if r.lp_opts.top_k else None
        self.tokens[index].append((r.output_ids[-1], r.logprobs[-1], top))
        self.notify()

    def notify(self, *_) -> None:  # any thread; tokens are appended before
        if not self._pending:
            self._pending = True
            try:
                self.loop.call_soon_threadsafe(self._set)
            except RuntimeError:  # the event loop is gone (server shutting down)
                pass

    def _set(self) -> None:
        self._pending = False
        self._wake.set()

    async def wait(self) -> None:
        await self._wake.wait()
        self._wake.clear()


async def stream_choices(
    feed: TokenFeed, futures: list[Future]
) -> AsyncIterator[tuple[int, list[Token], Any]]:
    """(choice, its new tokens, its /generate answer or None while it runs), as they come. An engine
    error of a choice (paused past its timeout, stopped) is raised."""
    taken, running = [0] * len(futures), set(range(len(futures)))
    for f in futures:
        f.add_done_callback(feed.notify)
    while running:
        await feed.wait()
        for i in sorted(running):
            done = futures[i].done()  # before the tokens: all of them precede the answer
            new = feed.tokens[i][taken[i] :]
            taken[i] += len(new)
            if done:
                running.discard(i)
                yield i, new, futures[i].result()
            elif new:
                yield i, new, None


class ChoiceText:
    """One streamed choice's text: `grow` gives what may be sent as tokens arrive (never text the
    final answer will not hold), `finish` the rest of the final text. With a reasoning split
    (`reasoning`) each is a (reasoning_content, content) pair; without, the reasoning part is ""."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, holds: list[str] = (),
                 strip: bool = False, reasoning: chat.Reasoning | None = None,
                 stream_reasoning: bool = True) -> None:  # fmt: skip
        """`holds`: strings the text stops at (stop strings, tool-call markup); `strip`: the final
        text is stripped (chat content before tool calls), so whitespace waits too; `reasoning`:
        the thinking goes apart (as it comes, or once closed when not `stream_reasoning`)."""
        self.tokenizer, self.skip, self.strip = tokenizer, skip_special_tokens, strip
        self.holds = [h for h in holds if h]
        self.reasoning, self.stream_reasoning = reasoning, stream_reasoning
        self.tags = partial_tags(reasoning.parser) if reasoning else []
        self.ids: list[int] = []
        self.sent = ""
        self.sent_thought = ""

    def grow(self, ids: list[int]) -> tuple[str, str]:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip).rstrip("\ufffd")
        thought = ""
        if self.reasoning is not None:
            text = text[: len(text) - _partial_tail(text, self.tags)]  # a tag may be forming
            closed = REASONING_PARSERS[self.reasoning.parser].end in text
            thought, text = split_reasoning(text, self.reasoning.parser, self.reasoning.force)
            if not (self.stream_reasoning or closed or text):
                thought = ""  # SGLang's stream_reasoning false: the thinking goes once it closed
        return _delta(thought, self, "sent_thought"), _delta(self._safe(text), self, "sent")

    def finish(self, final: str, final_thought: str = "") -> tuple[str, str]:
        # differs only where the final text was trimmed (tool-call content is stripped)
        thought = (
            final_thought[len(self.sent_thought) :] if final_thought.startswith(self.sent_thought) else ""
        )
        rest = final[len(self.sent) :] if final.startswith(self.sent) else ""
        self.sent, self.sent_thought = final, final_thought
        return thought, rest

    def _safe(self, text: str) -> str:
        cut = min([i for i in (text.find(h) for h in self.holds) if i >= 0], default=len(text))
        text = text[:cut].rstrip("\ufffd")  # a multi-byte character split across tokens
        if self.strip:
            text = text.strip()
        return text[: len(text) - _partial_tail(text, self.holds)]


def _partial_tail(text: str, tags: list[str]) -> int:
    """The longest end of `text` that begins one of `tags` (and may still become it)."""
    return max(
        (k for h in tags for k in range(1, min(len(h), len(text) + 1)) if text.endswith(h[:k])), default=0
    )


def _delta(text: str, choice: ChoiceText, attr: str) -> str:
    """What of `text` is new since `choice.<attr>` was sent (nothing when it no longer extends it)."""
    sent = getattr(choice, attr)
    if len(text) <= len(sent) or not text.startswith(sent):
        return ""
    setattr(choice, attr, text)
    return text[len(sent) :]


def sse(payload: dict[str, Any]) -> str:
    return "data: " + orjson.dumps(payload).decode() + "\n\n"


def sse_error(e: Exception) -> str:
    """An engine error after the stream began (the status is sent): OpenAI's in-stream error."""
    resp = engine_error(e)
    body = orjson.loads(resp.body)["error"]
    return sse({"error": {**body, "code": resp.status_code}})


# ---------------------------------------------------------------------------- chat
async def chat_chunks(req: chat.ChatRequest, prompt_ids: list[int], feed: TokenFeed, futures: list[Future],
                      tokenizer: Any, parser: str = "qwen25",
                      reasoning: chat.Reasoning | None = None) -> AsyncIterator[str]:  # fmt: skip
    """`chat.completion.chunk`s: the role, reasoning_content and content deltas as tokens come, the
    rest with tool calls (`parser`'s), the finish reason; the usage chunk when asked; `[DONE]`."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": req.model}  # fmt: skip
    sp = req.sampling_params
    holds = [*(sp.get("stop") or []), *([CALL_START[parser]] if req.parses_tools else [])]
    skip = sp.get("skip_special_tokens", True)
    texts = [ChoiceText(tokenizer, skip, holds, req.parses_tools, reasoning, req.stream_reasoning)
             for _ in range(req.n)]  # fmt: skip

    def chunk(i: int, delta: dict, tokens: list[Token] = (), **finish) -> str:
        lps = None
        if req.logprobs and tokens:
            lps = {"content": [chat.token_logprob(tokenizer, lp, t, top) for t, lp, top in tokens]}
        choice = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": None, **finish}
        return sse({**head, "choices": [choice]})

    def text_delta(thought: str, text: str) -> dict:
        return {**({"reasoning_content": thought} if thought else {}), "content": text}

    for i in range(req.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    completion = 0
    try:
        async for i, tokens, out in stream_choices(feed, futures):
            if out is None:
                thought, text = texts[i].grow([t for t, _, _ in tokens])
                if thought or text or (req.logprobs and tokens):
                    yield chunk(i, text_delta(thought, text), tokens)
                continue
            msg, reason, matched = chat.assistant_message(req, out, parser, reasoning)
            delta = text_delta(*texts[i].finish(msg["content"] or "", msg["reasoning_content"] or ""))
            if msg["tool_calls"]:
                delta["tool_calls"] = msg["tool_calls"]
            if len(delta) > 1 or delta["content"] or (req.logprobs and tokens):
                yield chunk(i, delta, tokens)
            yield chunk(i, {}, finish_reason=reason, matched_stop=matched)
            completion += len(out.get("output_ids") or [])
    except ENGINE_ERRORS as e:
        yield sse_error(e)
        yield DONE
        return
    if req.include_usage:
        n = len(prompt_ids)
        usage = {"prompt_tokens": n, "completion_tokens": completion, "total_tokens": n + completion}
        yield sse({**head, "choices": [], "usage": usage})
    yield DONE


# ---------------------------------------------------------------------------- completions
async def completion_chunks(req: completions.CompletionRequest, feed: TokenFeed, futures: list[Future],
                            tokenizer: Any) -> AsyncIterator[str]:  # fmt: skip
    """`text_completion` chunks: text deltas (with log-probs) as tokens come, the rest and the
    finish reason; the usage chunk when asked; `[DONE]`."""
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model}  # fmt: skip
    sp = req.sampling_params
    texts = [
        ChoiceText(tokenizer, sp.get("skip_special_tokens", True), sp.get("stop") or []) for _ in futures
    ]
    outputs: list[dict] = [{}] * len(futures)

    def chunk(i: int, text: str, tokens: list[Token], reason=None, matched=None) -> str:
        lps = None
        if req.logprobs is not None:
            lps = completions.logprobs(tokenizer, tokens, len(texts[i].sent) - len(text))
        choice = {"index": i, "text": text, "logprobs": lps, "finish_reason": reason}
        if reason is not None:
            choice["matched_stop"] = matched
        return sse({**head, "choices": [choice]})

    try:
        async for i, tokens, out in stream_choices(feed, futures):
            if out is None:
                _, text = texts[i].grow([t for t, _, _ in tokens])
                if text or (req.logprobs is not None and tokens):
                    yield chunk(i, text, tokens)
                continue
            outputs[i] = out
            yield chunk(i, texts[i].finish(out.get("text", ""))[1], tokens, *completions.finish(out))
    except ENGINE_ERRORS as e:
        yield sse_error(e)
        yield DONE
        return
    if req.include_usage:
        yield sse({**head, "choices": [], "usage": completions.usage(req, outputs)})
    yield DONE


# ---------------------------------------------------------------------------- routes
def served_model_id(core: Any, served_model_name: str | None = None, run_name: str | None = None) -> str:
    """The id `/v1/models` lists and every OpenAI answer names: `--served-model-name` as given; a
    run's engine `<run>.v<NNNNNN>`, the policy version it serves (the Dagster partition key); else
    the checkpoint's absolute path."""
    if served_model_name:
        return served_model_name
    if run_name:
        return partition_key(run_name, core.weight_version)
    return core.model_path if "://" in core.model_path else os.path.abspath(core.model_path)


def openai_router(core: Any, max_request_bytes: int, served_model_name: str | None = None,
                  run_name: str | None = None, tool_call_parser: str | None = None,
                  reasoning_parser: str | None = None) -> APIRouter:  # fmt: skip
    """The three routes of the engine's app, naming the model `served_model_id`. Chat answers are
    split as SGLang's server with `--tool-call-parser` / `--reasoning-parser` splits them (the
    tool calls: qwen25's format when no parser is named; no reasoning split without one)."""
    tool_call_parser = tool_call_parser or "qwen25"
    app = APIRouter()
    # chat templates render on one thread of their own: jinja holds the GIL, and a pool of them
    # rendering big chats at once starved the engine's scheduler thread (issue #49, item 9)
    render_pool = ThreadPoolExecutor(1, thread_name_prefix="chat-render")

    def model_id() -> str:
        return served_model_id(core, served_model_name, run_name)

    async def submit(body: dict, n: int, stream: bool) -> tuple[list[Future], TokenFeed | None]:
        feed = TokenFeed(n) if stream else None
        futures, _ = await asyncio.to_thread(core.submit_json, body, feed.on_token if feed else None)
        return futures, feed

    def answer(payload: dict) -> Response:
        return Response(orjson.dumps(payload), media_type="application/json")

    def stream(chunks: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """Chat on a model with a chat template of its own (chat.render_prompt refuses others)."""
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        try:
            req = chat.parse_request(body)
            req.model = model_id()
            if req.input_ids is None:
                chat.check_fits(core.tokenizer, req.messages, req.tools, core.context_length)
            ids = await asyncio.get_running_loop().run_in_executor(
                render_pool, chat.render_prompt, core.tokenizer, req
            )
            gen = chat.generate_body(req, ids, core.context_length)
            futures, feed = await submit(gen, req.n, req.stream)
            if feed is not None:
                reasoning = chat.request_reasoning(req, reasoning_parser, core.tokenizer)
                return stream(
                    chat_chunks(req, ids, feed, futures, core.tokenizer, tool_call_parser, reasoning)
                )
            outputs = await all_results(futures)
            return answer(
                chat.build_response(req, outputs, core.tokenizer, ids, tool_call_parser, reasoning_parser)
            )
        except ENGINE_ERRORS as e:
            return engine_error(e)

    @app.post("/v1/completions")
    async def text_completions(request: Request):
        """The raw prompt continued, as /generate does: what a model without a chat template takes."""
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        try:
            req = completions.parse_request(body)
            req.model = model_id()
            gen = completions.generate_body(req)
            futures, feed = await submit(gen, len(req.prompts) * req.n, req.stream)
            if feed is not None:
                return stream(completion_chunks(req, feed, futures, core.tokenizer))
            return answer(completions.build_response(req, await all_results(futures), core.tokenizer))
        except ENGINE_ERRORS as e:
            return engine_error(e)

    @app.get("/v1/models")
    async def models():
        return chat.models_list(model_id(), core.model_path, core.context_length)

    return app
