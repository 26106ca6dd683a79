"""The OpenAI-compatible HTTP application: request parsing, responses, SSE, errors, metrics.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``"stream": true`` as
server-sent events), ``GET /v1/models``, ``GET /healthz``, ``GET /metrics`` (Prometheus text).
Extensions are top-level body fields (what the ``openai`` client sends through ``extra_body``):
``flash_context`` (``priority_class`` L0/L1/L2, ``prefetch_window``) and ``priority``; every
response carries ``"degraded"`` and a ``"flash"`` object. Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``; overload is 429/503 with ``Retry-After``.
"""

import asyncio
import json
import threading
import time
import uuid

from ..daemon.config import KEYS as CONFIG_KEYS
from ..errors import FlashError, KVUnsupported
from ..sysfs_shim.publisher import exposition
from .engine import Engine
from .generation import Generation
from .runner import quantiles
from .scheduler import CLASSES, SchedRequest

# Used when the tokenizer has no chat template (documented in docs/serve.md).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The keys of the tiered KV cache (deepseek_flash.kv): a request that gives any of them runs on a
# TieredCache of its own, built with ``TieredCache.for_model(model, gpu_tokens=..., ...)``.
KV_KEYS = ("kv_gpu_tokens", "kv_sink_tokens", "kv_page_tokens", "kv_top_k_pages", "kv_page_cache",
           "kv_host_bytes", "kv_spill_dir", "kv_prune_threshold")
FLASH_CONTEXT_KEYS = ("priority_class", "prefetch_window") + KV_KEYS


class ApiError(Exception):
    """An error answered in OpenAI's shape with an HTTP status (and ``Retry-After`` if given)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _field(body: dict, name: str, kind, default=None, *, minimum=None, maximum=None, nullable=True):
    value = body.get(name, default)
    if value is None:
        if default is None and not nullable:
            raise ApiError(400, f"'{name}' is required", param=name, code="missing_required_parameter")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(400, f"'{name}' must be {names}, got {json.dumps(value)[:64]}", param=name,
                       code="invalid_type")
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        raise ApiError(400, f"'{name}' must be in [{minimum}, {maximum}], got {value}", param=name,
                       code="invalid_value")
    return value


# A text no token makes: where a streamed token's text goes in its chunk's envelope.
TEXT_MARK = "\x00flash-token-text\x00"


class Delivery:
    """Engine events into the event loop's queues with one wake-up for all that arrive together: a
    step's tokens for every row of the batch cost the loop one wake-up (and the engine thread one
    ``call_soon_threadsafe``), not one per row. ``urgent`` events (an L0 request's) are put first,
    so their streams resume -- and write -- ahead of the rest of the step's."""

    def __init__(self, loop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list = []

    def __call__(self, queue, item, urgent: bool = False) -> None:
        with self._lock:
            self._pending.append((not urgent, queue, item))
            if len(self._pending) > 1:
                return                      # a wake-up is already on its way
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        items.sort(key=lambda x: x[0])          # stable: urgent first, each in its order
        for _, queue, item in items:
            queue.put_nowait(item)


class ServeState:
    """What the routes share: the engine, the tokenizer, the served name, HTTP counters."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, *, chat_template: str | None = None,
                 closer=None, kv_spill_root=None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
        self.default_template = self.chat_template == DEFAULT_CHAT_TEMPLATE
        self.created = int(time.time())
        self.responses: dict[int, int] = {}
        self.closer = closer
        self._delivery = None
        self.event_loop: str | None = None       # the server's event loop class, once it runs
        import os

        self.kv_spill_root = None if kv_spill_root is None else os.path.realpath(kv_spill_root)

    # -- parsing ----------------------------------------------------------------------------------
    def parse_common(self, body: dict) -> dict:
        model = _field(body, "model", str, nullable=False)
        if model != self.model_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        if _field(body, "n", int, 1) != 1:
            raise ApiError(400, "only n=1 is supported", param="n", code="unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if _field(body, name, (int, float), 0) != 0:
                raise ApiError(400, f"'{name}' is not supported (only 0)", param=name, code="unsupported_value")
        if body.get("logprobs") not in (None, False, 0):
            raise ApiError(400, "'logprobs' is not supported", param="logprobs", code="unsupported_value")
        stop = body.get("stop")
        if stop is None:
            stops = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
            stops = tuple(stop)
        else:
            raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", param="stop",
                           code="invalid_type")
        ctx = _field(body, "flash_context", dict, {})
        for key in ctx:
            if key not in FLASH_CONTEXT_KEYS:
                raise ApiError(400, f"unknown flash_context key '{key}'; allowed: {', '.join(FLASH_CONTEXT_KEYS)}",
                               param="flash_context", code="invalid_value")
        cls = ctx.get("priority_class", "L1")
        if cls not in CLASSES:
            raise ApiError(400, f"flash_context.priority_class must be one of {', '.join(CLASSES)}, got {cls!r}",
                           param="flash_context", code="invalid_value")
        window = _field(ctx, "prefetch_window", int, None, minimum=0, maximum=1 << 20)
        kv = self.kv_options(ctx)
        stream_options = _field(body, "stream_options", dict, {})
        return dict(
            stream=_field(body, "stream", bool, False),
            temperature=float(_field(body, "temperature", (int, float), 1.0, minimum=0, maximum=2)),
            top_p=float(_field(body, "top_p", (int, float), 1.0, minimum=0, maximum=1)),
            seed=_field(body, "seed", int, None),
            priority=_field(body, "priority", int, 0),
            priority_class=cls, prefetch_window=window, stops=stops, kv_options=kv,
            include_usage=bool(stream_options.get("include_usage", False)),
        )

    def kv_options(self, ctx: dict) -> dict | None:
        """``TieredCache.for_model`` arguments from the ``kv_*`` keys of ``flash_context``, checked
        as the controller checks them in a config (400 naming the key); None when none is given.
        ``kv_spill_dir`` must lie inside the server's ``--kv-spill-root`` (relative: under it)."""
        given = {k: v for k, v in ctx.items() if k in KV_KEYS}
        if not given:
            return None
        options = {}
        for key, value in given.items():
            try:
                value = CONFIG_KEYS[key].parse(key, value)
            except FlashError as exc:
                raise ApiError(400, f"flash_context.{key}: {exc.message}", param=f"flash_context.{key}",
                               code="invalid_value") from None
            if key == "kv_spill_dir" and value is not None:
                value = self.spill_dir(given[key])
            options[key[len("kv_"):]] = value
        if options.get("host_bytes") is not None and options.get("spill_dir") is None:
            raise ApiError(400, "flash_context.kv_host_bytes needs kv_spill_dir (where pages past the host "
                           "budget go)", param="flash_context.kv_host_bytes", code="invalid_value")
        return options

    def spill_dir(self, value: str) -> str:
        root = self.kv_spill_root
        if root is None:
            raise ApiError(400, "flash_context.kv_spill_dir: this server takes no spill directory from "
                           "requests (start it with --kv-spill-root DIR)", param="flash_context.kv_spill_dir",
                           code="unsupported_value")
        import os

        path = os.path.realpath(os.path.join(root, value))
        if os.path.commonpath([path, root]) != root:
            raise ApiError(400, f"flash_context.kv_spill_dir: {value!r} is outside the server's spill root",
                           param="flash_context.kv_spill_dir", code="invalid_value")
        return path

    def max_tokens(self, body: dict, prompt_len: int, names=("max_tokens",), default=None) -> int:
        limit = self.engine.max_model_len
        asked = None
        for name in names:
            asked = _field(body, name, int, None, minimum=1)
            if asked is not None:
                break
        if asked is None:
            asked = default if default is not None else limit - prompt_len
        if prompt_len + asked > limit or prompt_len >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you "
                           f"requested {prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} for "
                           "the completion). Please reduce the prompt or the completion length.",
                           param="messages" if "max_completion_tokens" in names else "prompt",
                           code="context_length_exceeded")
        return asked

    def completion_prompt(self, body: dict) -> list:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            ids = list(prompt)
            vocab = self.engine.model.config.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise ApiError(400, f"token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
        else:
            raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list holding one of "
                           "them (batched prompts are not supported)", param="prompt", code="invalid_type")
        if not ids:
            raise ApiError(400, "'prompt' is empty", param="prompt", code="invalid_value")
        return ids

    def chat_prompt(self, body: dict) -> list:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages", code="invalid_type")
        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]",
                               code="invalid_type")
            content = m.get("content")
            if isinstance(content, list):
                try:
                    content = "".join(p["text"] for p in content if p.get("type") == "text")
                except (TypeError, KeyError, AttributeError):
                    raise ApiError(400, f"messages[{i}].content parts must be {{'type': 'text', 'text': ...}}",
                                   param=f"messages[{i}].content", code="invalid_type") from None
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                               param=f"messages[{i}].content", code="invalid_type")
            plain.append({"role": m["role"], "content": content})
        text = self.tokenizer.apply_chat_template(plain, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)
        # The template writes any special tokens itself.
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- running ----------------------------------------------------------------------------------
    def submit(self, prompt_ids: list, max_new: int, opts: dict, received: float | None = None):
        """Queue a generation; returns (generation, asyncio queue of engine events). Without
        ``opts["stream"]`` only the last event (done or error) is queued. ``received``: when the
        HTTP handler had the request (``time.monotonic``), the start of the response's
        ``flash.timing``."""
        queue: asyncio.Queue = asyncio.Queue()
        stream = opts["stream"]
        deliver = self.delivery(asyncio.get_running_loop())
        urgent = opts["priority_class"] == "L0"

        def on_event(kind, data):
            if stream or kind != "token":
                deliver(queue, (kind, data), urgent)

        req = SchedRequest(id=uuid.uuid4().hex, priority_class=opts["priority_class"], max_new_tokens=max_new,
                           temperature=opts["temperature"], top_p=opts["top_p"], priority=opts["priority"])
        eos = self.tokenizer.eos_token_id
        gen = Generation(req, prompt_ids, on_event, stop_strings=opts["stops"], seed=opts["seed"],
                         prefetch_window=opts["prefetch_window"], kv_options=opts["kv_options"],
                         stop_ids=frozenset() if eos is None else frozenset({eos}),
                         received_at=received)
        route = self.engine.submit(gen)
        if not route.admitted:
            overloaded = route.status == 429
            raise ApiError(route.status, f"{route.reason}; retry after {route.retry_after} s",
                           type="rate_limit_error" if overloaded else "server_error",
                           code="rate_limit_exceeded" if overloaded else "server_shutting_down",
                           retry_after=route.retry_after)
        return gen, queue

    def delivery(self, loop) -> "Delivery":
        """The event loop's ``Delivery`` (one per loop)."""
        current = self._delivery
        if current is None or current.loop is not loop:
            current = self._delivery = Delivery(loop)
        return current

    @staticmethod
    def timing(gen: Generation) -> dict:
        """``flash.timing``: where the request's time to first token went on the server, in ms
        from ``received_at`` (the HTTP handler had it; ``time.monotonic`` seconds, the clock of
        every stamp): ``queued`` (the scheduler took it), ``admitted`` (it joined the batch),
        ``first_token`` (the step that made its first token ended), ``first_write`` (the event loop
        had that token's chunk and handed it to the server to write; streams only). ``null`` for a stage not reached."""
        t0 = gen.received_at
        req = gen.sched

        def rel(t):
            return None if t is None or t0 is None else round((t - t0) * 1e3, 3)
        return {"received_at": None if t0 is None else round(t0, 6), "queued_ms": rel(req.arrival or None),
                "admitted_ms": rel(req.started), "first_token_ms": rel(gen.first_token_at),
                "first_write_ms": rel(gen.first_write_at)}

    def usage(self, gen: Generation) -> dict:
        return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": len(gen.output_ids),
                "total_tokens": len(gen.prompt_ids) + len(gen.output_ids)}

    def metrics(self) -> str:
        """Prometheus text exposition of the scheduler, the engine and the HTTP answers."""
        snap = self.engine.snapshot()
        families = {}

        def metric(name, kind, help_text, samples):
            families[f"deepseek_flash_serve_{name}"] = (kind, help_text, samples)

        outcomes = ("admitted", "refused_429", "refused_503", "finished")
        metric("requests_total", "counter", "Requests by priority class and outcome.",
               [({"class": c, "outcome": o}, snap[o][c]) for o in outcomes for c in CLASSES])
        metric("degrade_steps_total", "counter", "L2 degrade steps applied, by step.",
               [({"step": s}, n) for s, n in snap["degrade_steps"].items()])
        metric("preemptions_total", "counter", "Rows given back to an L0 request, by the class that gave it.",
               [({"class": c}, snap["preempted"][c]) for c in CLASSES])
        metric("degraded_requests_total", "counter", "Requests degraded at least once.",
               [({}, snap["degraded_requests"])])
        metric("queued", "gauge", "Requests waiting, by class.", [({"class": c}, snap["queued"][c]) for c in CLASSES])
        metric("running", "gauge", "Requests in the batch, by class.",
               [({"class": c}, snap["running"][c]) for c in CLASSES])
        metric("slots", "gauge", "Rows of the running batch (--max-batch).", [({}, snap["slots"])])
        metric("l0_reserved_slots", "gauge", "Rows held for L0.", [({}, snap["l0_reserved"])])
        metric("l2_headroom_ratio", "gauge",
               "Slots left by L0/L1 demand, averaged over the degrade window (L2 degrades below 0.1).",
               [({}, snap["l2_headroom"])])
        eng = snap["engine"]
        for key, help_text in [("steps", "Engine steps."), ("decode_steps", "Batched decode forwards."),
                               ("prefill_chunks", "Prefill forwards."), ("prompt_tokens", "Prompt tokens prefilled."),
                               ("generated_tokens", "Tokens generated."), ("cancelled", "Requests cancelled by their client."),
                               ("failed", "Requests failed by an engine error.")]:
            metric(f"{key}_total", "counter", help_text, [({}, eng[key])])
        samples = []
        for c in CLASSES:
            values = snap["ttft_ms"][c]
            for q, v in quantiles(values).items():
                samples.append(({"class": c, "quantile": str(q)}, round(v / 1e3, 6)))
        metric("time_to_first_token_seconds", "summary",
               "Time to first token over the last 4096 requests of each class.", samples)
        metric("http_responses_total", "counter", "HTTP answers by status code.",
               [({"code": str(code)}, n) for code, n in sorted(self.responses.items())])
        return exposition(families)


def create_app(state: ServeState):
    """The FastAPI application over ``state``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        loop = type(asyncio.get_running_loop())
        state.event_loop = f"{loop.__module__}.{loop.__qualname__}"
        yield
        # Shutting down: refuse new requests (503), let the batch finish, free the model.
        await asyncio.get_running_loop().run_in_executor(None, state.engine.close)
        if state.closer is not None:
            state.closer()

    app = FastAPI(title="deepseek-flash serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serve = state

    def error_response(err: ApiError):
        headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    class CountResponses:
        """Counts HTTP answers by status as a plain ASGI middleware: Starlette's ``@app.middleware``
        (``BaseHTTPMiddleware``) would pass every chunk of a streamed answer through a task and a
        memory stream of its own -- per token and row, in the interpreter the engine needs."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)

            async def counted(message):
                if message["type"] == "http.response.start":
                    code = message["status"]
                    state.responses[code] = state.responses.get(code, 0) + 1
                await send(message)
            return await self.app(scope, receive, counted)

    app.add_middleware(CountResponses)

    @app.exception_handler(ApiError)
    async def api_error(request, err: ApiError):
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return error_response(ApiError(err.status_code, str(err.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, err):
        return error_response(ApiError(400, str(err.errors()[:3]), code="invalid_request"))

    async def read_json(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"We could not parse the JSON body of your request: {exc}",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object", code="invalid_json")
        return body

    @app.get("/healthz")
    async def healthz():
        snap = state.engine.snapshot()
        draining = state.engine.scheduler.draining
        body = {"status": "draining" if draining else "ok", "model": state.model_name,
                "running": sum(snap["running"].values()), "queued": sum(snap["queued"].values()),
                "slots": snap["slots"]}
        return JSONResponse(body, status_code=503 if draining else 200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "deepseek-flash",
                                            "max_model_len": state.engine.max_model_len}]}

    async def run(request: Request, chat: bool):
        received = time.monotonic()
        body = await read_json(request)
        opts = state.parse_common(body)
        if chat:
            prompt = state.chat_prompt(body)
            max_new = state.max_tokens(body, len(prompt), ("max_completion_tokens", "max_tokens"))
        else:
            prompt = state.completion_prompt(body)
            max_new = state.max_tokens(body, len(prompt), default=16)
        gen, queue = state.submit(prompt, max_new, opts, received)
        ident = ("chatcmpl-" if chat else "cmpl-") + gen.sched.id
        created = int(time.time())
        if opts["stream"]:
            return StreamingResponse(stream(gen, queue, ident, created, chat, opts["include_usage"]),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            kind, data = await wait_done(request, gen, queue)
        finally:
            if gen.finish_reason is None:
                state.engine.cancel(gen)
        if kind == "error":
            raise to_api_error(data)
        choice = {"index": 0, "finish_reason": gen.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": gen.text}
        else:
            choice["text"] = gen.text
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": state.model_name, "choices": [choice], "usage": state.usage(gen),
                "degraded": bool(gen.sched.degraded), "flash": {**data, "timing": state.timing(gen)}}

    async def wait_done(request: Request, gen, queue):
        """The last engine event, watching for the client going away meanwhile (frees the row)."""
        last = asyncio.ensure_future(queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({last}, timeout=0.25)
                if done:
                    return last.result()
                if await request.is_disconnected():
                    state.engine.cancel(gen)
                    raise ApiError(499, "client closed the request", code="client_closed")
        finally:
            last.cancel()

    def to_api_error(exc) -> ApiError:
        if isinstance(exc, KVUnsupported):
            return ApiError(400, f"{exc.message} [{type(exc).__name__}]", param="flash_context",
                            code="unsupported_value")
        if isinstance(exc, FlashError):
            status = 503 if exc.code == 602 else 500
            return ApiError(status, f"{exc.message} [{type(exc).__name__}, code {exc.code}]",
                            type="server_error", code=type(exc).__name__)
        return ApiError(500, str(exc), type="server_error")

    async def stream(gen, queue, ident, created, chat, include_usage):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text, finish=None, extra=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {}
                if delta_text:
                    delta["content"] = delta_text
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta_text, "finish_reason": finish, "logprobs": None}
            payload = {"id": ident, "object": obj, "created": created, "model": state.model_name,
                       "choices": [choice], **(extra or {})}
            return f"data: {json.dumps(payload)}\n\n"

        # A token's chunk is this stream's constant envelope around the text (the same bytes as
        # ``chunk``, without encoding the envelope again for every token).
        head, tail = chunk(TEXT_MARK).split(json.dumps(TEXT_MARK))

        def token_chunk(delta_text):
            return f"{head}{json.dumps(delta_text)}{tail}" if delta_text else chunk(delta_text)

        try:
            if chat:
                yield chunk("", role=True)
            held = None
            while True:
                kind, data = held if held is not None else await queue.get()
                held = None
                if kind == "token":
                    # Tokens that arrived meanwhile go out in the same write.
                    out = [token_chunk(data["text"])]
                    while not queue.empty():
                        held = queue.get_nowait()
                        if held[0] != "token":
                            break
                        out.append(token_chunk(held[1]["text"]))
                        held = None
                    if gen.first_write_at is None:
                        gen.first_write_at = time.monotonic()
                    yield "".join(out)
                elif kind == "error":
                    yield f"data: {json.dumps(to_api_error(data).body())}\n\n"
                    return
                else:
                    yield chunk("", gen.finish_reason, {"degraded": bool(gen.sched.degraded),
                                                        "flash": {**data, "timing": state.timing(gen)}})
                    if include_usage:
                        usage = {"id": ident, "object": obj, "created": created, "model": state.model_name,
                                 "choices": [], "usage": state.usage(gen)}
                        yield f"data: {json.dumps(usage)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            # A client that went away mid-stream (or any other exit) frees its row.
            if gen.finish_reason is None:
                state.engine.cancel(gen)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, chat=False)

    return app
