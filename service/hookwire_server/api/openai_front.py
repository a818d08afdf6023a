"""The OpenAI-compatible front: /v1/completions, /v1/chat/completions, /v1/models and
/health over HTTP, on a port of its own, in the gRPC server's process and event loop.

Production clients, gateways, load generators and evaluation harnesses speak OpenAI's
API; this front lets them reach hookwire's models unchanged, while every call is a
hookwire Generate call like any other: the same domain call (calls/generation.py, not a
gRPC client of this server), the same tenants, roles, limits and quotas, observed by
SCOPE_ALL / tagged hooks and Subscribe exactly as gRPC calls are, and steerable through
the body member ``hookwire`` (tags, a session, hooks as HookSpec JSON).

Libraries: FastAPI on Starlette for routing and responses, served by uvicorn, and
pydantic for the request bodies (api/openai_schema.py) -- the stack vLLM's own OpenAI
server uses, so that its behaviour (server-sent events, disconnects, HTTP/1.1 keep-alive)
is what OpenAI's clients already meet there. uvicorn runs as a task on the running loop
(``OpenAIFront.start``), without its signal handlers: the server's own stop stops it.

What a call becomes, and what comes back, is documented in docs/openai.md. Errors use
OpenAI's error body, with the message the gRPC status would carry, and an HTTP status for
each gRPC status (HTTP_STATUS); a call that fails before its first token answers with that
status, never with a 200 event stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, cast

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from google.protobuf import json_format

from hookwire.wire import codec
from hookwire.wire import ids as wire_ids
from hookwire.v1 import hook_pb2, model_service_pb2

from .. import errors
from ..auth import ANONYMOUS, MINIMUM_ROLE, Principal, TokenStore, Unauthenticated
from ..calls.generation import Generation
from ..engine.core import Engines
from ..limits import Limits, exceeded
from ..metrics import Metrics
from ..models.model_registry import ModelRegistry
from ..models.positions import position_limit
from ..rpc_context import CURRENT, RpcContext
from .openai_schema import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("hookwire.openai")
audit_log = logging.getLogger("hookwire.audit")

#: The HTTP status of each gRPC status a call can end with (OpenAI's codes where it
#: has one: 400 for a bad request, 429 for limits and quotas).
HTTP_STATUS: dict[str, int] = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "INTERNAL": 500,
    "UNKNOWN": 500,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
#: OpenAI's error ``type`` for each HTTP status.
ERROR_TYPE: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled",
    500: "server_error", 501: "not_implemented_error", 503: "service_unavailable", 504: "timeout_error",
}
#: The gRPC status name of each domain error (the names, not grpc's enum: this module
#: needs no grpc).
_CODE_OF: tuple[tuple[type[BaseException], str], ...] = (
    (errors.InvalidArgument, "INVALID_ARGUMENT"), (errors.NotFound, "NOT_FOUND"),
    (errors.FailedPrecondition, "FAILED_PRECONDITION"), (errors.ResourceExhausted, "RESOURCE_EXHAUSTED"),
    (errors.PermissionDenied, "PERMISSION_DENIED"), (errors.AlreadyExists, "ALREADY_EXISTS"),
    (errors.Unimplemented, "UNIMPLEMENTED"), (errors.Unavailable, "UNAVAILABLE"),
    (errors.DeadlineExceeded, "DEADLINE_EXCEEDED"), (Unauthenticated, "UNAUTHENTICATED"),
)
#: hookwire's finish reasons as OpenAI's (vLLM's "abort" for a call the server ended).
FINISH_REASON = {"length": "length", "eos": "stop", "stop": "stop", "rule": "stop",
                 "cancelled": "abort", "shutdown": "abort"}
#: The caller's own request id header (logged beside hookwire's, which the response's
#: header of the same name carries).
REQUEST_ID_HEADER = "x-request-id"


class HttpError(Exception):
    """A refusal the front makes itself (a body it cannot read, a field it does not
    serve): its HTTP status, gRPC status name, message and the field it names."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def code_of(exc: BaseException) -> str:
    """The gRPC status name a failure becomes (INTERNAL for an unexpected one)."""
    if isinstance(exc, HttpError):
        return exc.code
    for cls, code in _CODE_OF:
        if isinstance(exc, cls):
            return code
    return "INTERNAL"


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param,
                      "code": code}}


#: GenerateRequest's field names as a completions / chat body calls them: a domain
#: message names what the caller sent, in the caller's words.
_COMPLETION_WORDS = {"max_new_tokens": "max_tokens", "prompts": "prompt", "input_ids": "prompt",
                     "attention_mask": "prompt", "min_new_tokens": "min_tokens", "top_logprobs": "logprobs",
                     "prompt_logprobs": "logprobs", "hooks": "hookwire.hooks", "tags": "hookwire.tags",
                     "session_id": "hookwire.session_id"}
_CHAT_WORDS = {**_COMPLETION_WORDS, "max_new_tokens": "max_completion_tokens", "prompts": "messages",
               "input_ids": "messages", "attention_mask": "messages", "top_logprobs": "top_logprobs"}


def in_callers_words(message: str, *, chat: bool) -> str:
    """A Generate message whose leading field ("max_new_tokens: ...", "hooks[0].module:
    ...") is renamed to the body's field that became it."""
    words = _CHAT_WORDS if chat else _COMPLETION_WORDS
    end = len(message)
    for stop in (":", "[", "."):
        at = message.find(stop)
        if 0 < at < end:
            end = at
    head = message[:end]
    return words[head] + message[end:] if head in words else message


def _param_of(message: str) -> str | None:
    """The field a domain message names first ("max_new_tokens: ..." -> max_new_tokens)."""
    head, sep, _ = message.partition(": ")
    return head if sep and " " not in head else None


class _Call:
    """What one HTTP call of the front needs to answer: its context, the body's
    settings that shape the answer, and the prompts as the model sees them."""

    def __init__(self, rpc: RpcContext, *, chat: bool, model: str, n: int, stream: bool, usage: bool,
                 logprobs: int | None, echo: bool, prompt_texts: list[str] | None) -> None:
        self.rpc, self.chat, self.model, self.n, self.stream, self.usage = rpc, chat, model, n, stream, usage
        self.logprobs, self.echo, self.prompt_texts = logprobs, echo, prompt_texts
        self.created = int(time.time())
        #: Each sequence's prompt ids (from GenerateStarted), once the call started.
        self.prompt_ids: list[list[int]] = []


class OpenAIFront:
    """The ASGI app and its uvicorn server. ``start`` binds and serves on the running
    loop; ``stop`` ends it. Everything a call does goes through ``generation`` (the
    domain call gRPC's Generate makes), ``registry`` and ``tokens``."""

    def __init__(
        self, registry: ModelRegistry, generation: Generation, engines: Engines, tokens: TokenStore,
        metrics: Metrics, limits: Limits, ready: Callable[[], bool], *, client_certs: bool = False,
    ) -> None:
        self._registry, self._generation, self._engines = registry, generation, engines
        self._tokens, self._metrics, self._limits, self._ready = tokens, metrics, limits, ready
        self._client_certs = client_certs
        self._started = int(time.time())
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.app = self._build()

    # ------------------------------------------------------------------ serving

    async def start(self, host: str, port: int, *, tls_cert: str | None = None, tls_key: str | None = None,
                    tls_client_ca: str | None = None) -> int:
        """Binds ``host``:``port`` (0: a free port) and serves on the running loop;
        returns the port. OSError when the port is taken. HTTPS with ``tls_cert`` and
        ``tls_key``; client certificates required and verified with ``tls_client_ca``."""
        import socket

        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot listen on {host}:{port} for the OpenAI-compatible front (openai_port): "
                          f"{exc.strerror or exc}") from None
        sock.listen(2048)
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.app, log_config=None, access_log=False, lifespan="off", timeout_keep_alive=30,
            ssl_certfile=tls_cert, ssl_keyfile=tls_key, ssl_ca_certs=tls_client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca else ssl.CERT_NONE,
            # mTLS: each request's scope carries its connection's verified client certificate
            # subject (the ASGI TLS extension's client_cert_name), which uvicorn leaves out.
            http=_client_cert_protocol() if tls_client_ca else "auto",
        )
        self._server = _uvicorn_server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:  # bound already: this is uvicorn's own start-up
            if self._task.done():
                self._task.result()  # its failure
                raise OSError("the OpenAI-compatible front stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, grace: float) -> None:
        """Stops taking connections and ends open ones within ``grace`` seconds (streams
        in flight end with their calls, which the server's drain ends)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), max(grace, 0.1))
        except (asyncio.TimeoutError, Exception):
            self._server.force_exit = True
            self._task.cancel()
        self._server = self._task = None

    # ------------------------------------------------------------------ the app

    def _build(self) -> FastAPI:
        app = FastAPI(title="hookwire OpenAI-compatible front", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/health", self._health, methods=["GET"])
        app.add_api_route("/v1/models", self._models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self._model, methods=["GET"])
        app.add_exception_handler(StarletteHTTPException, self._http_exception)
        app.add_api_route("/v1/completions", self._completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self._chat, methods=["POST"])
        return app

    async def _health(self) -> Response:
        """200 exactly when gRPC readiness is SERVING (no token needed)."""
        ready = self._ready()
        return JSONResponse({"status": "ok" if ready else "not serving"}, status_code=200 if ready else 503,
                            headers={REQUEST_ID_HEADER: wire_ids.new_id(wire_ids.REQUEST)})

    async def _models(self, request: Request) -> Response:
        """GET /v1/models: the models that can generate."""
        return self._listing(request, None)

    async def _model(self, request: Request, model_id: str) -> Response:
        """GET /v1/models/{id} (the ``openai`` client's ``models.retrieve``)."""
        return self._listing(request, model_id)

    def _listing(self, request: Request, model_id: str | None) -> Response:
        rpc = self._context(request, "ListModels")
        started = time.perf_counter()
        try:
            principal = self._principal(request)
            rpc.principal = principal.name
            principal.require(MINIMUM_ROLE["ListModels"], "listing models")
            data = [{"id": host.name, "object": "model", "created": self._started, "owned_by": "hookwire",
                     "root": host.name, "parent": None, "max_model_len": self._max_len(host)}
                    for host in self._registry if host.can_generate and model_id in (None, host.name)]
            if model_id is not None and not data:
                raise HttpError(404, "NOT_FOUND", f"model: no model {model_id!r} that generates", "model")
            response: Response = JSONResponse(data[0] if model_id is not None else {"object": "list", "data": data})
            code = "OK"
        except Exception as exc:
            response, code = self._failure(rpc, exc), code_of(exc)
        self._done(rpc, code, response.status_code, started)
        response.headers[REQUEST_ID_HEADER] = rpc.request_id
        return response

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        """An unknown path or method, in OpenAI's error body (not FastAPI's {"detail"})."""
        status = int(getattr(exc, "status_code", 500))
        code = {404: "NOT_FOUND", 405: "UNIMPLEMENTED"}.get(status, "INVALID_ARGUMENT" if status < 500 else "INTERNAL")
        what = f"{request.method} {request.url.path}"
        message = {404: f"{what}: no such endpoint (the front serves /v1/completions, /v1/chat/completions, "
                        "/v1/models and /health)",
                   405: f"{what}: the method is not allowed on this endpoint"}.get(status, f"{what}: {exc}")
        return JSONResponse(error_body(status, code, message), status_code=status,
                            headers={REQUEST_ID_HEADER: wire_ids.new_id(wire_ids.REQUEST)})

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        rpc = self._context(request, "Generate")
        CURRENT.set(rpc)  # the Generate call takes its request id; log records carry it
        started = time.perf_counter()
        messages: AsyncGenerator[Any, None] | None = None
        try:
            principal = self._principal(request)
            rpc.principal = principal.name
            # Before the body is read or the chat template runs: a role that may not
            # generate costs nothing more.
            principal.require(MINIMUM_ROLE["Generate"], "generating")
            body = await self._read_body(request)
            kind = ChatCompletionRequest if chat else CompletionRequest
            try:
                # Off the event loop: a large body's validation would hold every other call.
                parsed: CompletionRequest | ChatCompletionRequest = await asyncio.to_thread(
                    kind.model_validate_json, body)
            except pydantic.ValidationError as exc:
                raise _validation_error(exc) from None
            for field, why in parsed.unserved():
                raise HttpError(400, "INVALID_ARGUMENT", f"{field}: {why}", field)
            generate, call = await self._request(parsed, rpc, chat=chat)
            messages = cast(AsyncGenerator[Any, None], self._generation.generate(generate, principal))
            # Up to the first tokens (or the end) before answering, each message turned into
            # its chunks: a call that fails before its first token (an event over
            # max_http_event_bytes included) answers with its HTTP status, not a 200 stream.
            state = _Answer(self, call)
            first: list[dict[str, Any]] = []  # (a non-streaming call's messages make no chunks)
            async for message in messages:
                first.extend(state.take(message))
                if not isinstance(message, bytes) and message.WhichOneof("kind") in ("tokens", "steps", "done"):
                    break
        except Exception as exc:
            if messages is not None:
                await messages.aclose()
            response = self._failure(rpc, exc, chat=chat)
            self._done(rpc, code_of(exc), response.status_code, started)
            return response
        headers = {REQUEST_ID_HEADER: rpc.request_id}
        if call.stream:
            return StreamingResponse(self._events(call, state, first, messages, started),
                                     media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"})
        try:
            answer = await self._collect(state, messages, request)
        except Exception as exc:
            response = self._failure(rpc, exc, chat=chat)
            self._done(rpc, code_of(exc), response.status_code, started)
            return response
        finally:
            await messages.aclose()
        self._done(rpc, "OK", 200, started)
        return JSONResponse(answer, headers=headers)

    # ------------------------------------------------------------------ requests

    async def _request(self, body: CompletionRequest | ChatCompletionRequest, rpc: RpcContext, *,
                       chat: bool) -> tuple[model_service_pb2.GenerateRequest, _Call]:
        """The GenerateRequest a body asks for, and what answering it needs."""
        out = model_service_pb2.GenerateRequest(model=body.model)
        n = body.n or 1
        prompt_texts: list[str] | None = None
        echo = False
        if isinstance(body, ChatCompletionRequest):
            host = self._registry.get(body.model)
            ids = await self._chat_ids(host, body)
            codec.encode_tensor_into(_long([ids]), out.input_ids)
            max_tokens = body.max_completion_tokens or body.max_tokens
            if max_tokens is None:  # the rest of the model's context, as vLLM's chat does
                limit = self._max_len(host)
                max_tokens = min(self._limits.max_new_tokens, max(1, limit - len(ids))) if limit \
                    else self._limits.max_new_tokens
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            prompt = body.prompt
            if isinstance(prompt, str):
                prompt = [prompt]
            if not prompt:
                raise HttpError(400, "INVALID_ARGUMENT", "prompt: no prompt", "prompt")
            if isinstance(prompt[0], str):
                out.prompts.extend(prompt)  # type: ignore[arg-type]
                prompt_texts = list(prompt)  # type: ignore[arg-type]
            else:
                rows = cast(list[list[int]], [prompt] if isinstance(prompt[0], int) else prompt)
                if any(not row for row in rows):
                    raise HttpError(400, "INVALID_ARGUMENT", "prompt: a prompt has no token ids", "prompt")
                # Counted before anything is padded: rows x the longest row could be large.
                if len(rows) * n > self._limits.max_tokenize_texts:
                    raise exceeded("prompt", f"{len(rows)} prompts x n {n}", self._limits.max_tokenize_texts,
                                   "max_tokenize_texts")
                longest = max(len(row) for row in rows)
                if longest > self._limits.max_prompt_tokens:
                    raise exceeded("prompt", f"a prompt of {longest} tokens", self._limits.max_prompt_tokens,
                                   "max_prompt_tokens")
                ids, mask = _left_padded(rows)
                codec.encode_tensor_into(ids, out.input_ids)
                codec.encode_tensor_into(mask, out.attention_mask)
            max_tokens = body.max_tokens or 16  # OpenAI's default for completions
            logprobs = body.logprobs
            echo = bool(body.echo)
            if echo and logprobs is not None:
                out.prompt_logprobs = logprobs
        if body.min_tokens and body.min_tokens > max_tokens:
            raise HttpError(400, "INVALID_ARGUMENT",
                            f"min_tokens: {body.min_tokens} is more than the {max_tokens} new tokens asked for", "min_tokens")
        out.max_new_tokens = max_tokens
        if body.temperature is not None:
            if body.temperature == 0:
                out.do_sample = False
            else:
                out.do_sample, out.temperature = True, body.temperature
        if body.top_p is not None:
            out.top_p = body.top_p
        if body.top_k is not None:
            out.top_k = max(0, body.top_k)  # vLLM's -1 and hookwire's 0 both disable it
        if body.seed is not None:
            out.seed = body.seed
        if body.stop is not None:  # "" too: Generate refuses an empty stop string, naming it
            out.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
        out.n = n
        if logprobs is not None:
            out.logprobs, out.top_logprobs = True, logprobs
        out.ignore_eos = bool(body.ignore_eos)
        out.min_new_tokens = body.min_tokens or 0
        if body.hookwire is not None:
            out.tags.extend(body.hookwire.tags)
            out.session_id = body.hookwire.session_id
            for i, spec in enumerate(body.hookwire.hooks):
                out.hooks.append(self._hook(spec, i))
        call = _Call(rpc, chat=chat, model=body.model, n=n, stream=bool(body.stream),
                     usage=bool(body.stream_options and body.stream_options.include_usage) or not body.stream,
                     logprobs=logprobs, echo=echo, prompt_texts=prompt_texts)
        return out, call

    def _hook(self, spec: dict[str, Any], i: int) -> hook_pb2.HookSpec:
        """One hook of ``hookwire.hooks`` from the proto's JSON mapping; a capture of whole
        tensors is refused (its events would not fit in a chunk: gRPC carries those)."""
        where = f"hookwire.hooks[{i}]"
        try:
            message = json_format.ParseDict(spec, hook_pb2.HookSpec())
        except json_format.ParseError as exc:
            raise HttpError(400, "INVALID_ARGUMENT", f"{where}: {exc}", where) from None
        for name in ("prehook", "posthook", "backward_prehook", "backward_hook"):
            action = getattr(message, name)
            whole = action.capture and not action.select and not action.HasField("summarize") \
                and not action.HasField("readout")
            if whole:
                raise HttpError(
                    400, "INVALID_ARGUMENT",
                    f"{where}.{name}: a capture of whole tensors does not travel over HTTP (each event must fit in "
                    f"max_http_event_bytes, {self._limits.max_http_event_bytes} bytes): capture a selection "
                    "(select), a summary (summarize) or a readout, or use hookwire's gRPC API for whole tensors",
                    f"{where}.{name}",
                )
        return message

    async def _chat_ids(self, host: Any, body: ChatCompletionRequest) -> list[int]:
        """The chat's prompt ids, from the model's own chat template (on its tokenizer's
        thread); 400 for a model without a tokenizer or a template."""
        tokenizer = host.tokenizer
        if tokenizer is None:
            why = f" ({host.tokenizer_problem})" if host.tokenizer_problem else ""
            raise HttpError(400, "FAILED_PRECONDITION",
                            f"messages: model {host.name!r} has no tokenizer{why}, so no chat template; use "
                            "/v1/completions with token ids", "messages")
        if not getattr(tokenizer, "chat_template", None):
            raise HttpError(400, "FAILED_PRECONDITION",
                            f"messages: model {host.name!r}'s tokenizer has no chat template; use /v1/completions "
                            "with the prompt formatted as the model expects", "messages")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        chars = sum(len(m["content"]) for m in messages)
        if chars > self._limits.max_tokenize_chars:
            raise exceeded("messages", f"{chars} characters in all", self._limits.max_tokenize_chars,
                           "max_tokenize_chars")

        def apply() -> list[int]:
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                    tokenize=True, return_dict=True)
            return [int(t) for t in encoded["input_ids"]]

        try:
            ids = await host.run_tokenizer(apply)
        except errors.HookwireServerError:
            raise
        except Exception as exc:  # the template refused the messages (its own raise_exception)
            raise HttpError(400, "INVALID_ARGUMENT", f"messages: the chat template refused them: {exc}",
                            "messages") from None
        if not ids:
            raise HttpError(400, "INVALID_ARGUMENT", "messages: the chat template made an empty prompt", "messages")
        if len(ids) > self._limits.max_prompt_tokens:
            raise exceeded("messages", f"{len(ids)} tokens", self._limits.max_prompt_tokens, "max_prompt_tokens")
        return ids

    def _max_len(self, host: Any) -> int | None:
        """The model's context length: vLLM's max_model_len, else its positions."""
        engine = self._engines.engine(host)
        value = getattr(engine, "max_model_len", None)
        if isinstance(value, int) and value > 0:
            return value
        limit = position_limit(host.module)
        return limit.positions if limit is not None else None

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 past max_http_body_bytes (and the server's
        max_message_bytes) before more is read."""
        from starlette.requests import ClientDisconnect

        limit, name = self._limits.max_http_body_bytes, "max_http_body_bytes"
        if self._limits.max_message_bytes < limit:
            limit, name = self._limits.max_message_bytes, "max_message_bytes"
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HttpError(413, "RESOURCE_EXHAUSTED",
                            f"request body: {declared} bytes, over the limit of {limit} ({name})")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HttpError(413, "RESOURCE_EXHAUSTED", f"request body: over the limit of {limit} bytes ({name})")
                chunks.append(chunk)
        except ClientDisconnect:
            raise HttpError(499, "CANCELLED", "the client went away while sending its body") from None
        return b"".join(chunks)

    # ------------------------------------------------------------------ answers

    async def _events(self, call: _Call, state: _Answer, first: list[dict[str, Any]],
                      messages: AsyncGenerator[Any, None], started: float) -> AsyncIterator[bytes]:
        """The event stream: ``first`` (the chunks of the messages up to the first tokens,
        which ``state`` took already), a chunk per step (and the events of its hooks), the
        finish reasons, the usage when asked, then [DONE]. Closing it (the client went
        away) cancels the call."""
        status, code = 200, "OK"
        try:
            for chunk in first:
                yield _sse(chunk)
            async for message in messages:
                for chunk in state.take(message):
                    yield _sse(chunk)
            for chunk in state.finish():
                yield _sse(chunk)
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: the call ends
            status, code = 499, "CANCELLED"
            raise
        except Exception as exc:  # after the first token: an error event, then the end
            failure = self._failure(call.rpc, exc, chat=call.chat)
            status, code = failure.status_code, code_of(exc)
            yield _sse(json.loads(bytes(failure.body)))
        finally:
            await messages.aclose()
            self._done(call.rpc, code, status, started)
        yield b"data: [DONE]\n\n"

    async def _collect(self, state: _Answer, messages: AsyncIterator[Any], request: Request) -> dict[str, Any]:
        """The whole answer of a call that did not ask to stream (``state`` took its first
        messages already); a client that went away meanwhile cancels it (checked at each
        step)."""
        async for message in messages:
            state.take(message)
            if await request.is_disconnected():  # (ends the call: see _generate)
                raise HttpError(499, "CANCELLED", "the client went away")
        return state.whole()

    # ------------------------------------------------------------------ context

    def _context(self, request: Request, method: str) -> RpcContext:
        client_id = request.headers.get(REQUEST_ID_HEADER, "")[:128]
        return RpcContext(method, wire_ids.new_id(wire_ids.REQUEST), "", client_id, front="http")

    def _principal(self, request: Request) -> Principal:
        """Who calls: ANONYMOUS without tokens; else the bearer token's principal."""
        if not self._tokens.enabled:
            return ANONYMOUS
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return self._tokens.authenticate(token.strip())
        # As gRPC: without a token, a verified client certificate's subject (mTLS) names
        # the principal, as "CN=..." (RFC 2253) or by its common name alone.
        tls = request.scope.get("extensions", {}).get("tls", {})
        subject = tls.get("client_cert_name")
        if subject:
            names = [subject] + [part for part in subject.split(",") if part.startswith("CN=")]
            try:
                return self._tokens.authenticate(None, names)
            except Unauthenticated:
                raise Unauthenticated(f"the client certificate {subject!r} names no principal: send "
                                      "'Authorization: Bearer <token>'") from None
        raise Unauthenticated("missing credentials: send 'Authorization: Bearer <token>'"
                              + (" or a client certificate" if self._client_certs else ""))

    def _failure(self, rpc: RpcContext, exc: BaseException, *, chat: bool | None = None) -> JSONResponse:
        """OpenAI's error body for a failure, with its HTTP status; an unexpected one is
        logged with an incident id, which the message names. ``chat``: a Generate call's
        (its fields renamed to the body's: in_callers_words)."""
        code = code_of(exc)
        if isinstance(exc, HttpError):
            status, message, param = exc.status, exc.message, exc.param
        elif isinstance(exc, errors.HookwireServerError):
            status, message = HTTP_STATUS.get(code, 500), str(exc)
            if chat is not None:
                message = in_callers_words(message, chat=chat)
            param = _param_of(message)
        else:
            incident = wire_ids.new_id("inc")
            log.error("internal error %s in %s", incident, rpc.method, exc_info=exc,
                      extra={"request_id": rpc.request_id})
            status, message, param = 500, f"internal error (incident {incident}); the server logged it", None
        return JSONResponse(error_body(status, code, message, param), status_code=status,
                            headers={REQUEST_ID_HEADER: rpc.request_id})

    def _done(self, rpc: RpcContext, code: str, status: int, started: float | None = None) -> None:
        """The call's RPC metric and audit line (front="http"): its gRPC status name
        ``code`` and its HTTP ``status``."""
        self._metrics.rpcs.labels(rpc.method, code, "http").inc()
        duration_ms = round((time.perf_counter() - started) * 1e3, 3) if started is not None else 0.0
        audit_log.info("rpc %s %s", rpc.method, code, extra={
            "method": rpc.method, "principal": rpc.principal or "(unauthenticated)", "request_id": rpc.request_id,
            "client_request_id": rpc.client_request_id, "code": code, "duration_ms": duration_ms, "front": "http",
            "http_status": status,
        })


class _Answer:
    """Turns one call's GenerateResponse messages into OpenAI's chunks (``take``,
    ``finish``) or its whole response (``whole``)."""

    def __init__(self, front: OpenAIFront, call: _Call) -> None:
        self.front, self.call = front, call
        self.host = front._registry.get(call.model)
        self.tokenizer = self.host.detokenizer
        self.limit = front._limits.max_http_event_bytes
        self.kind = "chat.completion.chunk" if call.chat else "text_completion"
        self.texts: list[str] = []
        self.generated: list[int] = []
        self.logprobs: list[list[dict[str, Any]]] = []
        self.reasons: list[str] = []
        self.stopped: list[dict[str, Any] | None] = []
        self.events: list[dict[str, Any]] = []
        self.all_events: list[dict[str, Any]] = []
        #: JSON bytes of all_events (a non-streaming answer's events, held to the end).
        self.held = 0
        self.prompt_logprobs: list[list[dict[str, Any]]] = []
        self.rows = 0

    # -- one message

    def take(self, message: Any) -> list[dict[str, Any]]:
        """The chunks a message makes (none for the start, an event or a notice)."""
        if isinstance(message, bytes):  # a chunked tensor: over any chunk's size
            raise exceeded("hookwire.hooks", "an event with a tensor too large for one message",
                           self.limit, "max_http_event_bytes", "use hookwire's gRPC API for whole tensors")
        kind = message.WhichOneof("kind")
        if kind == "started":
            self._started(message.started)
            return self._echo() if self.call.echo else self._roles()
        if kind in ("event", "batch"):
            for event in ([message.event] if kind == "event" else list(message.batch.events)):
                self._event(event)
            return []
        if kind == "notice":
            self._event_dict({"notice": json_format.MessageToDict(message.notice, preserving_proto_field_name=True)})
            return []
        if kind == "tokens":
            return self._step(message.tokens)
        if kind == "steps":
            return [chunk for step in message.steps.steps for chunk in self._step(step)]
        if kind == "done":
            self._done(message.done)
        return []

    def _started(self, started: Any) -> None:
        ids = codec.decode_tensor(started.input_ids, where="input_ids")
        mask = codec.decode_tensor(started.attention_mask, where="attention_mask")
        self.call.prompt_ids = [[int(t) for t, m in zip(row.tolist(), keep.tolist()) if m]
                                for row, keep in zip(ids, mask)]
        self.call.rpc.request_id = started.request_id or self.call.rpc.request_id
        self.rows = len(self.call.prompt_ids)
        self.texts = [""] * self.rows
        self.generated = [0] * self.rows
        self.logprobs = [[] for _ in range(self.rows)]
        self.reasons = [""] * self.rows
        self.stopped = [None] * self.rows
        self.prompt_logprobs = [[] for _ in range(self.rows)]

    def _event(self, event: Any) -> None:
        self._event_dict(json_format.MessageToDict(event, preserving_proto_field_name=True))

    def _event_dict(self, entry: dict[str, Any]) -> None:
        size = len(json.dumps(entry, separators=(",", ":")))
        if size > self.limit:
            raise exceeded("hookwire.hooks", f"an event of {size} bytes in JSON", self.limit, "max_http_event_bytes",
                           "select less, summarize, or use hookwire's gRPC API for large captures")
        if self.call.stream:  # it goes out with its step's chunk
            self.events.append(entry)
            return
        # A whole answer holds its events until the end: together they meet the limit.
        self.held += size
        if self.held > self.limit:
            raise exceeded("hookwire.hooks", f"events of {self.held} bytes in JSON in all", self.limit,
                           "max_http_event_bytes", "a non-streaming answer carries its events together: stream "
                           "(stream: true) for more, or use hookwire's gRPC API")
        self.all_events.append(entry)

    def _prompt_text(self, row: int) -> str:
        texts = self.call.prompt_texts
        if texts is not None:
            return texts[row // self.call.n]
        return self._decode(self.call.prompt_ids[row])

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _token(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else ""

    def _roles(self) -> list[dict[str, Any]]:
        if not (self.call.chat and self.call.stream):
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(self.rows)])]

    def _echo(self) -> list[dict[str, Any]]:
        for i in range(self.rows):
            self.texts[i] = self._prompt_text(i)
        if not self.call.stream:
            return []
        return [self._chunk([{"index": i, "text": self.texts[i], "logprobs": None, "finish_reason": None}
                             for i in range(self.rows)])]

    def _entry(self, token: int, values: Any) -> dict[str, Any]:
        """One position's log-probabilities as the front reports them (internal form)."""
        return {"token": token, "logprob": _json_logprob(values.logprob) if values is not None else None,
                "top": [(t, _json_logprob(v)) for t, v in zip(values.top_token_ids, values.top_logprobs)]
                if values is not None else []}

    def _step(self, step: Any) -> list[dict[str, Any]]:
        choices = []
        if step.prompt_logprobs:
            for i, run in enumerate(step.prompt_logprobs):
                prompt = self.call.prompt_ids[i]
                self.prompt_logprobs[i] = [{"token": prompt[0], "logprob": None, "top": []}] + [
                    self._entry(prompt[j + 1], values) for j, values in enumerate(run.tokens)]
        for i, token in enumerate(step.token_ids):
            if token < 0:
                continue
            text = step.texts[i] if i < len(step.texts) else ""
            self.texts[i] += text
            self.generated[i] += 1
            entry = self._entry(token, step.logprobs[i]) if i < len(step.logprobs) else None
            if entry is not None:
                self.logprobs[i].append(entry)
            if self.call.stream:
                offset = len(self.texts[i]) - len(text)
                logprobs = None
                if self.call.logprobs is not None and entry is not None:
                    entries = ([*self.prompt_logprobs[i], entry] if step.step == 0 and self.call.echo else [entry])
                    logprobs = self._logprobs(entries, offset - (len(self._prompt_text(i)) if step.step == 0
                                                                 and self.call.echo else 0))
                if self.call.chat:
                    choices.append({"index": i, "delta": {"content": text}, "logprobs": logprobs,
                                    "finish_reason": None})
                else:
                    choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": None})
        if not self.call.stream or (not choices and not self.events):
            return []
        return [self._chunk(choices)]

    def _done(self, done: Any) -> None:
        for i, sequence in enumerate(done.sequences):
            self.reasons[i] = sequence.finish_reason
            if sequence.finish_reason == "rule":
                self.stopped[i] = json_format.MessageToDict(sequence.stopped_by, preserving_proto_field_name=True)

    def _logprobs(self, entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
        """OpenAI's logprobs object of a choice (chat: ``content``; completions: the four lists)."""
        if self.call.chat:
            return {"content": [{
                "token": self._token(e["token"]), "logprob": e["logprob"],
                "bytes": list(self._token(e["token"]).encode()),
                "top_logprobs": [{"token": self._token(t), "logprob": v, "bytes": list(self._token(t).encode())}
                                 for t, v in e["top"]],
            } for e in entries]}
        tokens = [self._token(e["token"]) for e in entries]
        offsets, at = [], offset
        for e in entries:  # where each token's text starts in the choice's text (a special token adds none)
            offsets.append(at)
            at += len(self._decode([e["token"]]))
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [({self._token(t): v for t, v in e["top"]} if e["logprob"] is not None else None)
                                 for e in entries],
                "text_offset": offsets}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.call.rpc.request_id, "object": self.kind, "created": self.call.created,
                                 "model": self.call.model, "choices": choices}
        if self.events:
            chunk["hookwire"] = {"events": self.events}
            self.events = []
        return chunk

    # -- the end

    def _usage(self) -> dict[str, int]:
        prompt = sum(len(self.call.prompt_ids[i]) for i in range(0, self.rows, self.call.n))
        completion = sum(self.generated)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _finish_entry(self, i: int) -> dict[str, Any]:
        reason = FINISH_REASON.get(self.reasons[i], "length")
        return {"finish_reason": reason, **({"hookwire": {"stopped_by": self.stopped[i]}} if self.stopped[i] else {})}

    def finish(self) -> list[dict[str, Any]]:
        """The stream's last chunks: each choice's finish reason, then the usage when asked."""
        choices = []
        for i in range(self.rows):
            base = {"index": i, "delta": {}} if self.call.chat else {"index": i, "text": ""}
            choices.append({**base, "logprobs": None, **self._finish_entry(i)})
        out = [self._chunk(choices)]
        if self.call.usage:
            out.append({"id": self.call.rpc.request_id, "object": self.kind, "created": self.call.created,
                        "model": self.call.model, "choices": [], "usage": self._usage()})
        return out

    def whole(self) -> dict[str, Any]:
        """The non-streaming response."""
        choices = []
        for i in range(self.rows):
            entries = self.logprobs[i]
            logprobs = None
            if self.call.logprobs is not None:
                if self.call.echo:
                    entries = [*self.prompt_logprobs[i], *entries]
                logprobs = self._logprobs(entries, 0)
            if self.call.chat:
                choice = {"index": i, "message": {"role": "assistant", "content": self.texts[i]},
                          "logprobs": logprobs}
            else:
                choice = {"index": i, "text": self.texts[i], "logprobs": logprobs}
            choices.append({**choice, **self._finish_entry(i)})
        answer: dict[str, Any] = {
            "id": self.call.rpc.request_id, "object": "chat.completion" if self.call.chat else "text_completion",
            "created": self.call.created, "model": self.call.model, "choices": choices, "usage": self._usage(),
        }
        if self.all_events:
            answer["hookwire"] = {"events": self.all_events}
        return answer


def _uvicorn_server(config: Any) -> Any:
    """uvicorn's server without its signal handlers: the hookwire server's own SIGINT /
    SIGTERM handling stops it (OpenAIFront.stop)."""
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:  # uvicorn >= 0.29
            yield

        def install_signal_handlers(self) -> None:  # older uvicorn
            pass

    return Server(config)


#: OpenSSL's short names of a certificate subject's attributes (what gRPC's x509_subject
#: spells, RFC 2253).
_SHORT_NAMES = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU", "countryName": "C",
                "stateOrProvinceName": "ST", "localityName": "L", "emailAddress": "emailAddress",
                "domainComponent": "DC", "serialNumber": "serialNumber"}


def client_cert_name(peer: dict[str, Any] | None) -> str | None:
    """A verified peer certificate's subject (``ssl.SSLSocket.getpeercert()``) as RFC
    2253 spells it ("CN=svc,O=acme": the last attribute first), or None without one."""
    if not peer or not peer.get("subject"):
        return None
    parts = [f"{_SHORT_NAMES.get(key, key)}={value}" for rdn in peer["subject"] for key, value in rdn]
    return ",".join(reversed(parts))


def _client_cert_protocol() -> type:
    """uvicorn's HTTP/1.1 protocol (h11) whose requests carry their connection's client
    certificate subject in ``scope["extensions"]["tls"]["client_cert_name"]`` (the ASGI TLS
    extension; uvicorn does not fill it)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class ClientCertProtocol(H11Protocol):  # type: ignore[misc]  # uvicorn is untyped here
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            name = client_cert_name(transport.get_extra_info("peercert"))
            inner = self.app

            async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
                scope.setdefault("extensions", {})["tls"] = {"client_cert_name": name}
                await inner(scope, receive, send)

            self.app = app

    return ClientCertProtocol


def _json_logprob(value: float) -> float | None:
    """A log-probability JSON can carry: -inf (a token the model rules out) as -9999.0,
    as vLLM's OpenAI server reports it; NaN as null."""
    if value != value:
        return None
    return max(float(value), -9999.0)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _long(rows: list[list[int]]) -> Any:
    import numpy as np

    return np.asarray(rows, dtype=np.int64)


def _left_padded(rows: list[list[int]]) -> tuple[Any, Any]:
    """Token id rows padded on the left to the longest (pad id 0, masked) and their
    attention mask, int64 arrays [rows, longest]."""
    import numpy as np

    width = max(len(row) for row in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask


def _union_tag(part: object) -> bool:
    """Whether a pydantic error location part names a union's member type ("str",
    "list[int]", "function-after[...]") rather than a field or an index."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict",
                                                              "constrained-int", "constrained-str"))


def _validation_error(exc: pydantic.ValidationError) -> HttpError:
    """400 naming the first field pydantic refused, in the body's own words."""
    first = exc.errors()[0]
    path = ".".join(str(p) for p in first.get("loc", ()) if not _union_tag(p))
    if first.get("loc", ())[:1] == ("prompt",) and any(_union_tag(p) for p in first.get("loc", ())):
        # Every form failed: say which forms there are, not why the first one did.
        return HttpError(400, "INVALID_ARGUMENT", "prompt: expected a text, a list of texts, a list of token ids "
                         "or a list of such lists (token ids are integers from 0 to 2**63 - 1)", "prompt")
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        message = f"{path}: hookwire does not serve this field"
    elif kind == "json_invalid":
        message = f"request body: not valid JSON ({first.get('msg', '')})"
        path = ""
    else:
        message = f"{path}: {first.get('msg', 'invalid')}" if path else str(first.get("msg", "invalid"))
    return HttpError(400, "INVALID_ARGUMENT", message, path or None)
