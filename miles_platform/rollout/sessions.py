"""The TITO session server, Miles v1 (`--use-session-server`): linear, append-only sessions.

    POST   /sessions                              {evaluation?, temperature?, top_p?, top_k?} -> {session_id}
    GET    /sessions/{id}                         the record: token ids, log-probs, loss mask, turns
    DELETE /sessions/{id}
    POST   /sessions/{id}/v1/chat/completions     an OpenAI chat request with the full history

An agent sends OpenAI chat requests; the server owns the tokens. The first request renders the
chat template into input ids; after each model call it checkpoints prompt + output ids and the
engine's log-probs. A later request must extend the previous messages at the tail: only the
appended messages are tokenized (rollout/tito.py), and the joined ids go to the engine's
`/generate`. Retrying the latest turn rolls back one assistant checkpoint (to an empty session
when the first turn is retried); an earlier divergence, or a template that re-renders the history
differently, fails the session (HTTP 400 with the reason; its sample is not trained on).
TITO control fields (`input_ids`, `logprob_start_len`, `routed_experts_start_len`,
`return_sampling_mask`) are the server's: set by a client they are a 400. Unknown session: 404.
Image parts (a vision-language model: the server is given its `PromptVision`) render as one pad each
(chat.IMAGE_TEXT), expanded here to the image's patch count as the engine does, so the record's
token ids are the ones the trainer scores; every call sends the session's images so far as
`image_data`, and the record lists them (`image_data`, data URIs in order).
Every path needs the run's bearer token, as the engine's do. Runs in the rollout process on
loopback (RolloutManager starts it).
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from miles_platform.data.sample import make_turn
from miles_platform.rollout import chat
from miles_platform.rollout import client as engine_client
from miles_platform.rollout.engine_server import ServerHandle, serve_in_thread
from miles_platform.rollout.http_common import DEFAULT_MAX_REQUEST_BYTES, add_guards, error, json_body
from miles_platform.rollout.tito import AppendOnlyViolation, TitoTokenizer
from miles_platform.tls import client_tls

# open sessions at once; the run's server allows more when its rollouts need it (start_session_server)
DEFAULT_MAX_SESSIONS = 4096


class TooManySessions(Exception):
    pass


CONTROL_FIELDS = ("input_ids", "logprob_start_len", "routed_experts_start_len", "return_sampling_mask")


@dataclass
class Call:
    """One model call of a session: what undoing it (a retried turn) needs."""

    request_messages: list[dict[str, Any]]
    assistant: dict[str, Any]
    seen_text: str  # the rendered input the model was prompted with
    start: int  # len(session.tokens) before this call's appended suffix
    num_images: int  # session.images before this call
    num_turns: int  # session.turns entries before this call
    finish_reason: str
    weight_versions: tuple[int, int]
    # GLM-4.7: the model's stop token this call trimmed (token, log-prob, mask, support, the turn's end)
    trimmed: tuple | None = None


@dataclass
class Session:
    id: str
    evaluation: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)  # temperature / top_p / top_k
    tools: list | None = None
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # prompt + everything after
    log_probs: list[float] = field(default_factory=list)  # per token after the prompt
    loss_mask: list[int] = field(default_factory=list)
    support: list[list[int]] | None = None  # sampling-support replay
    routes: Any = None  # R3: int32 [len(tokens) - 1, num_layers, top_k], the latest answer's routed_experts
    turns: list[dict[str, Any]] = field(default_factory=list)  # make_turn entries over the response
    calls: list[Call] = field(default_factory=list)
    images: list[str] = field(default_factory=list)  # image parts' URLs so far, in order (image_data)
    failure: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def history(self, k: int) -> list[dict[str, Any]]:
        """The messages after call k-1 (k = 0: none)."""
        return [] if k == 0 else self.calls[k - 1].request_messages + [self.calls[k - 1].assistant]

    def rollback(self) -> None:
        c = self.calls.pop()
        n = c.start - len(self.prompt_ids)
        self.tokens, self.log_probs, self.loss_mask = (
            self.tokens[: c.start],
            self.log_probs[:n],
            self.loss_mask[:n],
        )
        if self.support is not None:
            self.support = self.support[:n]
        if self.routes is not None:
            self.routes = self.routes[: max(c.start - 1 + (c.trimmed is not None), 0)]
        self.turns = self.turns[: c.num_turns]
        if c.trimmed is not None:  # the stop token this call trimmed is the model's again
            tok, lp, mask, sup, end = c.trimmed
            self.tokens, self.log_probs, self.loss_mask = (
                self.tokens + [tok],
                self.log_probs + [lp],
                self.loss_mask + [mask],
            )
            if self.support is not None:
                self.support = self.support + [sup]
            self.turns[-1] = {**self.turns[-1], "end": end}
        self.images = self.images[: c.num_images]
        if not self.calls:
            self.prompt_ids, self.tokens = [], []

    def record(self) -> dict[str, Any]:
        v = [c.weight_versions for c in self.calls]
        return {
            "session_id": self.id,
            "evaluation": self.evaluation,
            "status": "failed" if self.failure else "active",
            "failure": self.failure,
            "num_calls": len(self.calls),
            "prompt_token_ids": list(self.prompt_ids),
            "response_token_ids": self.tokens[len(self.prompt_ids) :],
            "response_log_probs": list(self.log_probs),
            "loss_mask": list(self.loss_mask),
            "sampling_support": self.support,
            # R3: SGLang's encoding (base64 int32), one row per token but the last; None: not recorded
            "routed_experts": None if self.routes is None else _encode_routes(self.routes),
            "turns": self.turns,
            "finish_reason": self.calls[-1].finish_reason if self.calls else None,
            "weight_version_start": min((a for a, _ in v), default=0),
            "weight_version_end": max((b for _, b in v), default=0),
            "messages": self.history(len(self.calls)),
            "image_data": list(self.images),
        }


def _encode_routes(routes: Any) -> str:
    from miles_platform.models.moe import encode_routes

    return encode_routes(routes)


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Miles' `strict` matcher: role, content, reasoning_content, tool calls (id, name, arguments
    as JSON values, so reserialized arguments match), tool_call_id, name; empty values normalized."""
    return _norm(a) == _norm(b)


def _norm(m: dict[str, Any]) -> tuple:
    content, images = m.get("content"), ()
    if isinstance(content, list):
        parts = [p for p in content if isinstance(p, dict)]
        content, images = chat.content_text(parts), tuple(chat.image_uris([{"content": parts}]))
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        calls.append((c.get("id"), fn.get("name"), json.dumps(args, sort_keys=True)))
    return (m.get("role"), content or "", m.get("reasoning_content") or "", tuple(calls),
            m.get("tool_call_id") or "", m.get("name") or "", images)  # fmt: skip


def _extends(messages: list, history: list) -> bool:
    return len(messages) > len(history) and all(same_message(h, m) for h, m in zip(history, messages))


class SessionServer:
    """The sessions and the engine they generate with (`engine_url`: the router or the engine)."""

    def __init__(self, tokenizer: Any, engine_url: str, api_key: str | None, tito_model: str = "default",
                 replay: bool = False, lora_path=None, max_seq_len: int | None = None,
                 context_length: int = 1 << 20, moe_shape: tuple[int, int] | None = None,
                 max_sessions: int = DEFAULT_MAX_SESSIONS, chat_template_kwargs: dict | None = None,
                 vision: Any = None):  # fmt: skip
        """`lora_path`: a LoRA run's adapter name, or its AdapterName (the served version's name).
        `chat_template_kwargs`: the template arguments of every request (--apply-chat-template-kwargs),
        under a request's own.
        `moe_shape` (R3): the MoE model's (num_layers, top_k); training sessions then ask every
        call for `return_routed_experts` and the record carries the routes of the whole session.
        `vision` (a VLM: models/vlm.py PromptVision): image parts' pads are expanded with it; None:
        image parts are refused."""
        self.tok, self.tito = tokenizer, TitoTokenizer(tokenizer, tito_model)
        self.engine_url, self.api_key, self.replay, self._lora = engine_url, api_key, replay, lora_path
        self.max_seq_len, self.context_length = max_seq_len, context_length
        self.moe_shape, self.max_sessions = moe_shape, max_sessions
        self.sessions: dict[str, Session] = {}
        # SGLang's --tool-call-parser / --reasoning-parser (Miles' sessions proxy SGLang's chat route,
        # which splits answers with them): set by start_session_server from --sglang-*
        self.tool_call_parser: str | None = None
        self.reasoning_parser: str | None = None
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.vision = vision
        # TITO tokenization (chat templates: pure Python, the GIL held) on one thread of its own,
        # never on the event loop: a big chat stalled every other request (issue #49, item 9)
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="tito")
        self._http: httpx.AsyncClient | None = None

    @property
    def lora_path(self) -> str | None:
        from miles_platform.rollout.base_types import resolve_lora

        return resolve_lora(self._lora)

    @property
    def token_limit(self) -> int:
        return min(self.max_seq_len or self.context_length, self.context_length)

    def create(self, body: dict) -> Session:
        if len(self.sessions) >= self.max_sessions:
            raise TooManySessions(
                f"{len(self.sessions)} sessions are open, the server's limit: DELETE /sessions/<id> "
                "the finished ones (the agentic wrapper deletes each after reading its record)"
            )
        defaults = {k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None}
        s = Session(id=uuid.uuid4().hex, evaluation=bool(body.get("evaluation", False)), defaults=defaults)
        self.sessions[s.id] = s
        return s

    async def chat(self, s: Session, body: Any) -> tuple[dict[str, Any], chat.ChatRequest]:
        """One chat completion in session `s`: (the chat response, the parsed request)."""
        if isinstance(body, dict):
            bad = [k for k in CONTROL_FIELDS if body.get(k) is not None]
            if bad:
                raise chat.ChatError(
                    f"TITO control field(s) {bad} belong to the session server; leave them unset"
                )
            if body.get("lora_path") is not None and body["lora_path"] != self.lora_path:
                raise chat.ChatError(
                    f"lora_path {body['lora_path']!r}: the session server serves {self.lora_path!r}"
                )
        req = chat.parse_request(body)
        if req.n != 1:
            raise chat.ChatError("n must be 1 in a session (one trajectory per session)")
        sp = self._sampling_params(s, req)
        async with s.lock:
            if s.failure:
                raise chat.ChatError(f"session {s.id} failed earlier: {s.failure}")
            self._check_fits(s, req)
            plan = await asyncio.get_running_loop().run_in_executor(self._tokenize, self._plan, s, req)
            out = await self._generate(s, plan, sp)
            return self._commit(s, req, plan, out), req

    def _sampling_params(self, s: Session, req: chat.ChatRequest) -> dict[str, Any]:
        sp = dict(req.sampling_params)
        for k, v in s.defaults.items():
            if sp.get(k) is None:
                sp[k] = v
            elif k == "temperature" and not s.evaluation and sp[k] != v:
                raise chat.ChatError(
                    f"temperature={sp[k]}: this training session samples at {v} (the rollout's "
                    "temperature: the trainer scores log-probs at it); leave it unset"
                )
        return sp

    def _check_fits(self, s: Session, req: chat.ChatRequest) -> None:
        """Refuse, before tokenizing, new messages that cannot fit in what is left of the context."""
        new = req.messages[len(s.history(len(s.calls))) :] if s.calls else req.messages
        tools = None if s.calls else req.tools
        chat.check_fits(self.tok, new, tools, self.token_limit - len(s.tokens), f"session {s.id}'s request")

    def _plan(self, s: Session, req: chat.ChatRequest) -> dict[str, Any]:
        """Where the request attaches (v1): extend the latest checkpoint, or roll the latest call
        back (a retry); anything else fails the session. Returns the input ids and the suffix."""
        msgs, k = req.messages, len(s.calls)
        if msgs[-1].get("role") == "assistant":
            raise chat.ChatError(
                "the last message is the assistant's: nothing to generate (continue_final_message is not supported)"
            )
        tools = req.tools if req.tools is not None else s.tools
        if s.calls and req.tools is not None and s.tools is not None and req.tools != s.tools:
            raise chat.ChatError("tools changed within the session; omit tools to keep the session's")
        if k and not _extends(msgs, s.history(k)):
            if not (_extends(msgs, s.history(k - 1)) or k == 1):
                s.failure = (
                    f"not append-only: request {k + 1} rewrites the history before the latest turn "
                    f"(its {len(msgs)} messages do not extend the {len(s.history(k - 1))} messages of call {k - 1})"
                )
                raise AppendOnlyViolation(s.failure)
            s.rollback()  # a retry of the latest turn
            k -= 1
        kw = {**self.chat_template_kwargs, **req.chat_template_kwargs}
        if k == 0:
            ids, text = self.tito.first_prompt(msgs, tools, kw)
            images = chat.image_uris(msgs)
            ids = self._expand(ids, images)
            return {"tools": tools, "suffix": [], "suffix_text": "", "seen": text, "prompt": ids, "input": ids,
                    "images": images}  # fmt: skip
        hist, last = s.history(k), s.calls[k - 1]
        last_id = s.tokens[-1] if s.tokens else None
        try:
            ids, text, full, trim = self.tito.suffix(
                hist, msgs[len(hist) :], tools, kw, last.seen_text, last_id
            )
        except AppendOnlyViolation as e:
            s.failure = str(e)
            raise
        images = chat.image_uris(msgs[len(hist) :])
        ids = self._expand(ids, images)
        return {"tools": tools, "suffix": ids, "suffix_text": text, "seen": full, "trim": trim,
                "input": s.tokens[: len(s.tokens) - trim] + ids, "images": images}  # fmt: skip

    def _expand(self, ids: list[int], images: list[str]) -> list[int]:
        """The new messages' ids with each image part's pad expanded (the ids the engine runs)."""
        if not images:
            return ids
        if self.vision is None:
            raise chat.ChatError("image_url parts: the session server's model is not a vision-language model")
        try:
            return self.vision.expand(ids, images)
        except (ValueError, OSError) as e:  # a bad data URI, an undecodable image, a pad count off
            raise chat.ChatError(f"image_url parts: {type(e).__name__}: {e}") from None

    async def _generate(self, s: Session, plan: dict[str, Any], sp: dict[str, Any]) -> dict[str, Any]:
        ids = plan["input"]
        limit = self.token_limit
        if len(ids) >= limit:
            raise chat.ChatError(
                f"the session has {len(ids)} tokens: at --max-seq-len / the context ({limit})"
            )
        sp = {**sp, "max_new_tokens": min(sp.get("max_new_tokens") or limit, limit - len(ids))}
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
        if s.images or plan["images"]:  # a VLM session: every image so far (SGLang's image_data)
            body["image_data"] = s.images + plan["images"]
        if self.replay and not s.evaluation:
            body["return_sampling_mask"] = True
        if self.moe_shape is not None and not s.evaluation:
            body["return_routed_experts"] = True
        lora = self.lora_path
        if lora is not None:
            body["lora_path"] = lora
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=600.0, verify=client_tls())
        return await engine_client.post_generate(self.engine_url, body, self.api_key, client=self._http)

    def _commit(self, s: Session, req: chat.ChatRequest, plan: dict[str, Any], out: dict[str, Any]) -> dict:
        resp = chat.build_response(copy.copy(req), [out], self.tok, plan["input"],
                                   self.tool_call_parser or self.tito.tool_call_parser, self.reasoning_parser)  # fmt: skip
        for c in resp["choices"]:
            c.pop("meta_info", None)  # Miles: session responses omit meta_info (the record keeps it)
        msg = copy.deepcopy(resp["choices"][0]["message"])
        meta = out.get("meta_info") or {}
        out_ids = [int(t) for t in out.get("output_ids") or []]
        replay = self.replay and not s.evaluation
        if replay:
            lps = [float(x) for x in meta.get("output_token_sampling_logprobs") or []]
            sup = [[int(t) for t in x] for x in meta.get("output_token_sampling_mask") or []]
        else:
            lps, sup = [float(x[0]) for x in meta.get("output_token_logprobs") or []], None
        if len(lps) != len(out_ids) or (sup is not None and len(sup) != len(out_ids)):
            raise chat.ChatError(f"the engine returned {len(out_ids)} tokens and {len(lps)} log-probs")
        routes = None
        if self.moe_shape is not None and not s.evaluation:  # R3: this call fed the whole session
            from miles_platform.models.moe import decode_routes

            if meta.get("routed_experts") is None:
                raise chat.ChatError(
                    "--use-rollout-routing-replay: the engine returned no meta_info.routed_experts"
                )
            routes = decode_routes(meta["routed_experts"], *self.moe_shape)
            if len(routes) != len(plan["input"]) + len(out_ids) - 1:
                raise chat.ChatError(
                    f"routed_experts has {len(routes)} rows for {len(plan['input']) + len(out_ids)} tokens "
                    "(expected tokens - 1)"
                )
        if not s.calls:
            s.prompt_ids, s.tokens = list(plan["prompt"]), list(plan["prompt"])
            s.tools = plan["tools"]
            if replay:
                s.support = []
        base, trimmed = len(s.prompt_ids), None
        if plan.get("trim"):  # GLM-4.7: the model's stop token is not the next message's opener
            k = len(s.tokens) - 1
            last_turn = s.turns[-1]
            trimmed = (s.tokens[k], s.log_probs[k - base], s.loss_mask[k - base],
                       None if s.support is None else s.support[k - base], last_turn["end"])  # fmt: skip
            s.tokens, s.log_probs, s.loss_mask = (
                s.tokens[:k],
                s.log_probs[: k - base],
                s.loss_mask[: k - base],
            )
            if s.support is not None:
                s.support = s.support[: k - base]
            s.turns[-1] = {**last_turn, "end": min(last_turn["end"], k - base)}
        start, num_turns, num_images = len(s.tokens), len(s.turns), len(s.images)
        s.images = s.images + plan["images"]
        if plan["suffix"]:
            n = len(plan["suffix"])
            a = len(s.tokens) - base
            s.turns.append(
                make_turn(
                    _suffix_role(req.messages, len(s.history(len(s.calls)))), plan["suffix_text"], a, a + n
                )
            )
            s.tokens += plan["suffix"]
            s.log_probs += [0.0] * n
            s.loss_mask += [0] * n
            if s.support is not None:
                s.support += [[t] for t in plan["suffix"]]
        a = len(s.tokens) - base
        s.tokens += out_ids
        if routes is not None:
            s.routes = routes
        s.log_probs += lps
        s.loss_mask += [1] * len(out_ids)
        if s.support is not None:
            s.support += sup or [[t] for t in out_ids]
        fin = resp["choices"][0]["finish_reason"]
        calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in msg.get("tool_calls") or []
        ]
        s.turns.append(make_turn("assistant", out.get("text", ""), a, a + len(out_ids), fin, calls))
        v0 = int(meta.get("weight_version_start", meta.get("weight_version", 0)) or 0)
        v1 = int(meta.get("weight_version_end", meta.get("weight_version", 0)) or 0)
        s.calls.append(
            Call(list(req.messages), msg, plan["seen"], start, num_images, num_turns, fin, (v0, v1), trimmed)
        )
        return resp

    async def close(self) -> None:
        self._tokenize.shutdown(wait=False)
        if self._http is not None:
            await self._http.aclose()


def _suffix_role(messages: list, n_history: int) -> str:
    """The role of the appended messages' turn: "tool" when tools answered, else "user"."""
    roles = {m.get("role") for m in messages[n_history:]}
    return "tool" if "tool" in roles else "user"


def create_session_app(server: SessionServer, api_key: str | None,
                       max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:  # fmt: skip
    app = FastAPI(title="miles-platform TITO session server")
    add_guards(app, api_key, max_request_bytes)

    def lookup(sid: str) -> Session | Response:
        s = server.sessions.get(sid)
        if s is None:
            return error(404, f"unknown session {sid!r} (never created, or deleted); POST /sessions first")
        return s

    @app.post("/sessions")
    async def create(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        if not isinstance(body, dict):
            return error(
                400, "POST /sessions takes a JSON object {evaluation?, temperature?, top_p?, top_k?}"
            )
        unknown = sorted(set(body) - {"evaluation", "temperature", "top_p", "top_k", "metadata"})
        if unknown:
            return error(
                400, f"unknown session fields {unknown}; allowed: evaluation, temperature, top_p, top_k"
            )
        try:
            return {"session_id": server.create(body).id}
        except TooManySessions as e:
            return error(429, str(e), retryable=True)

    @app.get("/sessions/{sid}")
    async def get(sid: str):
        s = lookup(sid)
        return (
            s
            if isinstance(s, Response)
            else Response(orjson.dumps(s.record()), media_type="application/json")
        )

    @app.delete("/sessions/{sid}")
    async def delete(sid: str):
        s = lookup(sid)
        if isinstance(s, Response):
            return s
        server.sessions.pop(sid, None)
        return {"session_id": sid, "deleted": True}

    @app.post("/sessions/{sid}/v1/chat/completions")
    async def chat_completions(sid: str, request: Request):
        s = lookup(sid)
        if isinstance(s, Response):
            return s
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        try:
            resp, req = await server.chat(s, body)
        except chat.ChatError as e:
            return error(400, str(e))
        except engine_client.EngineHTTPError as e:  # the engine refused the call: say why, not a 500
            msg = (e.body.get("error") or {}).get("message") if isinstance(e.body, dict) else None
            status = 400 if 400 <= e.status < 500 else 502
            return error(status, f"session {sid}: the engine answered HTTP {e.status}: {msg or e.body}")
        except httpx.HTTPError as e:
            return error(
                503, f"session {sid}: the engine did not answer: {type(e).__name__}: {e}", retryable=True
            )
        if req.stream:
            return StreamingResponse(
                iter(chat.sse_chunks(resp, req.include_usage)), media_type="text/event-stream"
            )
        return Response(orjson.dumps(resp), media_type="application/json")

    return app


class SessionServerHandle(ServerHandle):
    """`.url`, `.host`, `.port`, `.server` (the SessionServer), `.stop()`."""

    def __init__(self, server: SessionServer, thread):
        super().__init__(thread)
        self.server = server

    @property
    def host(self) -> str:
        return self._server.host


def start_session_server(cfg: Any, tokenizer: Any, engine_url: str, replay: bool = False,
                         lora_path=None, context_length: int = 1 << 20,
                         moe_shape: tuple[int, int] | None = None,
                         max_sessions: int = DEFAULT_MAX_SESSIONS, vision: Any = None) -> SessionServerHandle:  # fmt: skip
    """The run's session server (cfg: --session-server-ip/--session-server-port, --tito-model,
    --max-seq-len, --api-key) in a background thread; its /generate calls go to `engine_url`."""
    from miles_platform.config.rollout import template_kwargs

    server = SessionServer(tokenizer, engine_url, cfg.api_key, cfg.tito_model, replay, lora_path,
                           cfg.max_seq_len, context_length, moe_shape, max_sessions,
                           template_kwargs(getattr(cfg, "apply_chat_template_kwargs", None)), vision)  # fmt: skip
    sglang = {k.replace("_", "-"): v for k, v in (getattr(cfg, "sglang_args", None) or {}).items()}
    server.tool_call_parser, server.reasoning_parser = (
        sglang.get("tool-call-parser"),
        sglang.get("reasoning-parser"),
    )
    app = create_session_app(server, cfg.api_key)
    return SessionServerHandle(
        server, serve_in_thread(app, cfg.session_server_ip, cfg.session_server_port, "sessions")
    )
