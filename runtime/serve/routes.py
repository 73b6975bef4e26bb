"""The endpoints of `ktrun serve` (FastAPI): /health, /v1/models, /metrics, /tokenize, /detokenize,
/tokenizer_info, and the generation routes /v1/completions and /v1/chat/completions:
validate (pydantic) -> tokenize / render the chat template -> length checks -> plan -> submit -> stream or collect.

Request bodies are read by KtrunRequest: at most --max-body-bytes (413 before reading more; a refused body is
drained so the client sees the 413), strict JSON (protocol.parse_json_body)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..defaults import API_TEMPERATURE, API_TOP_P
from . import responses as R
from .generation import ClientGone, Generation, Plan, decode
from .messages_api import MessagesAnswer
from .messages_request import CountTokensRequest, MessagesRequest
from .messages_request import to_chat as messages_to_chat
from .protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_param,
    parse_json_body,
)
from .reasoning import prompt_opens_thinking
from .responses_api import ResponsesAnswer
from .responses_request import ResponsesRequest
from .responses_request import to_chat as responses_to_chat
from .structured import compile_response_format, processor_factory
from .tool_parsers import PARSERS

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
DRAIN_LIMIT_BYTES = 64 << 20
ERRORS = {s: {"model": R.ErrorResponse} for s in (400, 401, 404, 413, 415, 500, 503)}


class KtrunRequest(Request):
    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            limit = self.app.state.ktrun.max_body_bytes
            length = self.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                await self._drain(int(length))
                raise ApiError(413, f"request body is {length} bytes, over the limit of {limit} bytes",
                               code="body_too_large", close=True)
            chunks, n = [], 0
            async for chunk in self.stream():
                n += len(chunk)
                if n > limit:
                    raise ApiError(413, f"request body is over the limit of {limit} bytes", code="body_too_large",
                                   close=True)
                chunks.append(chunk)
            self._body = b"".join(chunks)
            if not self._body:
                raise ApiError(400, "request body is empty: send a JSON object", code="invalid_json")
        return self._body

    async def _drain(self, n: int) -> None:
        """Read and drop a refused body (up to DRAIN_LIMIT_BYTES) so the client, still sending, gets our 413
        instead of a reset connection; beyond that the connection is just closed."""
        if n > DRAIN_LIMIT_BYTES:
            return
        async for _ in self.stream():
            pass

    async def json(self):
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json

    async def check_json_type(self) -> None:
        """A body sent as something other than JSON: 415 naming its Content-Type (read first, within the limit, so
        the client gets the answer). No Content-Type at all is read as JSON (as FastAPI does)."""
        ctype = self.headers.get("content-type")
        if ctype is None:
            return
        main = ctype.split(";", 1)[0].strip().lower()
        if main != "application/json" and not (main.startswith("application/") and main.endswith("+json")):
            await self.body()
            raise ApiError(415, f"the request body is sent as Content-Type {ctype!r}: send JSON with "
                                f"'Content-Type: application/json'", code="unsupported_media_type")


class KtrunRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            req = KtrunRequest(request.scope, request.receive)
            if req.method == "POST":
                await req.check_json_type()
            return await handler(req)

        return route


router = APIRouter(route_class=KtrunRoute)


def _json(obj: R.Out) -> JSONResponse:
    """The response model on the wire as responses.py serializes it (fields the server did not set left out)."""
    return JSONResponse(obj.dump())


def _state(request: Request):
    return request.app.state.ktrun


def _check_model(engine, model, optional=False) -> None:
    if model is None and optional:
        return
    if model != engine.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {engine.model_name!r}",
                       "not_found_error", "model_not_found", "model")


def _vocab(engine, model_vocab: bool = True) -> int | None:
    model_cfg = getattr(getattr(engine, "model", None), "cfg", None)
    vocab = getattr(model_cfg, "vocab_size", None) if model_vocab else None
    return vocab or getattr(engine.tokenizer, "vocab_size", None)


def _check_ids(engine, ids, param: str, model_vocab: bool = True) -> None:
    """Token ids in range: the model's vocabulary for prompts, the tokenizer's for /detokenize."""
    vocab = _vocab(engine, model_vocab)
    if isinstance(vocab, int) and any(not 0 <= t < vocab for t in ids):
        raise bad_param(param, f"token ids must be in [0, {vocab})")


def encode(tok, text: str, special: bool = True) -> list[int]:
    try:
        out = tok.encode(text, add_special_tokens=special)
    except TypeError:
        out = tok.encode(text)
    return list(getattr(out, "ids", out))


def render_chat(tok, messages: list[dict], tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
    """The conversation as the model's own chat template writes it (with the tool definitions, if any)."""
    extra = dict(kwargs or {})
    if tools:
        extra["tools"] = tools
    try:
        try:
            return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        except TypeError:
            return tok.apply_chat_template(messages, add_generation_prompt=True, **extra)
    except Exception as e:  # no template, or the template refused these messages (raise_exception / bad roles)
        if not isinstance(e, ValueError) and "jinja2" not in type(e).__module__:
            raise
        raise ApiError(400, f"the chat template cannot render these messages: {e}", code="chat_template_error",
                       param="messages") from None


def chat_prompt(tok, req) -> tuple[str, list[int]]:
    text = render_chat(tok, [m.for_template() for m in req.messages],
                       [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none"
                       else None, req.chat_template_kwargs)
    return text, encode(tok, text, special=False)   # the template already holds the BOS text


# -- simple routes ------------------------------------------------------------------------------------------------
@router.get("/health", response_model=R.HealthResponse, responses=ERRORS)
async def health(request: Request):
    _state(request).require_ready()
    return _json(R.HealthResponse())


@router.get("/v1/models", response_model=R.ModelList, responses=ERRORS)
async def models(request: Request):
    state = _state(request)
    engine = state.require_ready()
    return _json(R.ModelList(data=[R.ModelCard(id=engine.model_name, created=state.created,
                                               max_model_len=engine.ctx)]))


@router.get("/metrics", response_class=Response)
async def metrics(request: Request):
    from .metrics import CONTENT_TYPE

    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.post("/tokenize", response_model=R.TokenizeResponse, responses=ERRORS)
async def tokenize(body: TokenizeRequest, request: Request):
    engine = _state(request).require_ready()
    _check_model(engine, body.model, optional=True)
    if body.messages is not None:
        ids = chat_prompt(engine.tokenizer, ChatCompletionRequest(
            model=engine.model_name, messages=body.messages, tools=body.tools,
            chat_template_kwargs=body.chat_template_kwargs))[1]
    else:
        ids = encode(engine.tokenizer, body.prompt, body.add_special_tokens)
    return _json(R.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.ctx))


@router.post("/detokenize", response_model=R.DetokenizeResponse, responses=ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request):
    engine = _state(request).require_ready()
    _check_model(engine, body.model, optional=True)
    _check_ids(engine, body.tokens, "tokens", model_vocab=False)
    return _json(R.DetokenizeResponse(prompt=decode(engine.tokenizer, body.tokens)))


@router.get("/tokenizer_info", response_model=R.TokenizerInfo, responses=ERRORS)
async def tokenizer_info(request: Request):
    engine = _state(request).require_ready()
    tok = engine.tokenizer
    special = getattr(tok, "special_tokens", {}) or {}
    return _json(R.TokenizerInfo(eos_token=special.get("eos_token"), bos_token=special.get("bos_token"),
                                 pad_token=special.get("pad_token"), chat_template=getattr(tok, "chat_template", None),
                                 model_max_length=engine.ctx))


# -- generation ---------------------------------------------------------------------------------------------------
@router.post("/v1/completions", response_model=R.CompletionResponse, responses=ERRORS)
async def completions(body: CompletionRequest, request: Request):
    return await _generate(request, body, "completion")


@router.post("/v1/chat/completions", response_model=R.ChatCompletionResponse, responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await _generate(request, body, "chat")


# -- the Responses and Messages APIs: translated into a chat request, generated as chat, answered in their shapes --
@router.post("/v1/responses", responses=ERRORS)
async def responses_create(body: ResponsesRequest, request: Request):
    store = _state(request).responses
    chat, conversation = responses_to_chat(body, store)
    gen = await prepare(request, chat, "chat")
    return await ResponsesAnswer(gen, body, conversation, store).answer()


@router.get("/v1/responses/{response_id}", responses=ERRORS)
async def responses_get(response_id: str, request: Request):
    _state(request).require_ready()
    stored = _state(request).responses.get(response_id)
    if stored is None:
        raise ApiError(404, f"Response with id {response_id!r} not found", "invalid_request_error", "not_found",
                       "response_id")
    return JSONResponse(stored.response)


@router.post("/v1/messages", responses=ERRORS)
async def messages_create(body: MessagesRequest, request: Request):
    gen = await prepare(request, messages_to_chat(body), "chat")
    return await MessagesAnswer(gen, body).answer()


@router.post("/v1/messages/count_tokens", responses=ERRORS)
async def messages_count_tokens(body: CountTokensRequest, request: Request):
    engine = _state(request).require_ready()
    _check_model(engine, body.model)
    return JSONResponse({"input_tokens": len(chat_prompt(engine.tokenizer, messages_to_chat(body))[1])})


def _check_lengths(req, kind: str, n_prompt: int, ctx: int) -> int:
    if n_prompt == 0:
        raise bad_param("prompt", "the prompt is empty (0 tokens)")
    if n_prompt >= ctx:
        raise ApiError(400, f"the prompt is {n_prompt} tokens, over the context limit of {ctx} tokens "
                            f"(the prompt must leave room for at least 1 generated token)",
                       code="context_length_exceeded", param="messages" if kind == "chat" else "prompt")
    if req.max_tokens is None:
        return min(DEFAULT_COMPLETION_MAX_TOKENS, ctx - n_prompt) if kind == "completion" else ctx - n_prompt
    if n_prompt + req.max_tokens > ctx:
        raise ApiError(400, f"max_tokens={req.max_tokens} plus the prompt's {n_prompt} tokens is "
                            f"{n_prompt + req.max_tokens} tokens, over the context limit of {ctx} tokens",
                       code="context_length_exceeded", param="max_tokens")
    return req.max_tokens


async def _generate(request: Request, req, kind: str):
    gen = await prepare(request, req, kind)   # it submits to the engine once its response has started
    if req.stream:
        return StreamingResponse(gen.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        return _json(await gen.collect())
    except ClientGone:   # nobody to answer; the request is aborted and counted (499: client closed the request)
        return Response(status_code=499)


async def prepare(request: Request, req, kind: str) -> Generation:
    """A completion or chat request -> its Generation, not yet submitted (every check done). The Responses and
    Messages APIs translate their requests into a chat request and come here too."""
    state = _state(request)
    plan = Plan(kind=kind, model=req.model, prompt_ids=[], params=None, stream=req.stream,
                include_usage=req.include_usage, stop=list(req.stop or []))
    engine = state.require_ready()
    _check_model(engine, req.model)
    tok = engine.tokenizer
    prompt_text = None
    if kind == "chat":
        prompt_text, prompt_ids = chat_prompt(tok, req)
    elif isinstance(req.prompt, str):
        prompt_ids = encode(tok, req.prompt)
    else:
        _check_ids(engine, req.prompt, "prompt")
        prompt_ids = list(req.prompt)
    plan.prompt_ids = prompt_ids
    max_tokens = _check_lengths(req, kind, len(prompt_ids), engine.ctx)
    vocab = _vocab(engine)
    eos_ids = set(getattr(engine, "eos_ids", ()) or ())
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    for what, ids in (("logit_bias", list(bias)), ("stop_token_ids", req.stop_token_ids or [])):
        _check_ids(engine, ids, what)
    if req.n > state.max_batch:
        raise bad_param("n", f"n={req.n} is more than this server's --max-batch {state.max_batch}")
    plan.stop_ids = eos_ids | set(req.stop_token_ids or [])

    # what the text pipeline does: logprobs, echo, tools, reasoning
    if kind == "completion":
        plan.logprobs = req.logprobs
        plan.prompt_logprobs = req.echo and req.logprobs is not None
        if req.echo:
            plan.echo_text = req.prompt if isinstance(req.prompt, str) else decode(tok, prompt_ids)
    else:
        plan.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.tools and req.tool_choice not in (None, "none", "auto"):
            raise bad_param("tool_choice", "tool_choice 'required' or a named function is not supported: the call "
                            "markers differ per model and are not grammar-enforced here; use 'auto' (or 'none')")
        if req.tools and req.tool_choice != "none":
            plan.tool_parser = PARSERS.get(state.tool_parser_for(tok))
            if plan.tool_parser is None:
                raise bad_param("tools", "this model has no known tool-call format; start ktrun serve with "
                                f"--tool-call-parser ({', '.join(PARSERS)})")
            plan.tools = [t.model_dump(exclude_none=True) for t in req.tools]
            plan.parallel_tool_calls = req.parallel_tool_calls
        if state.reasoning_for(tok):
            separate = state.separate_reasoning if req.separate_reasoning is None else req.separate_reasoning
            plan.reasoning = separate
            plan.in_reasoning = separate and prompt_opens_thinking(prompt_text or "")
        plan.skip_special = plan.tool_parser is None and not plan.reasoning

    processors = []
    if req.response_format is not None and req.response_format.type != "text":
        if req.ignore_eos:
            raise bad_param("ignore_eos", "'ignore_eos' cannot be combined with 'response_format' (the grammar "
                                          "ends the output with EOS)")
        compiled = await run_in_threadpool(compile_response_format, req.response_format, tok, vocab or 0,
                                           sorted(eos_ids))
        processors.append(processor_factory(compiled))
    try:  # stop strings are matched here (TextStream), on the text sent, so the engine gets none
        plan.params = state.sampling_params_cls(
            max_tokens=max_tokens, temperature=API_TEMPERATURE if req.temperature is None else req.temperature,
            top_p=API_TOP_P if req.top_p is None else req.top_p, top_k=max(req.top_k or 0, 0), seed=req.seed, stop=[],
            ignore_eos=req.ignore_eos, min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias, stop_token_ids=list(req.stop_token_ids or []), n=req.n, logprobs=plan.logprobs,
            prompt_logprobs=(plan.logprobs or 0) if plan.prompt_logprobs else None, logits_processors=processors)
    except ValueError as e:
        raise ApiError(400, f"invalid sampling parameters: {e}", code="invalid_parameter") from None
    return Generation(state, plan, request)
