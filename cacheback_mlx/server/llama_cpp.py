"""llama.cpp's protocol: /health, /infill and /completion (llama.vim, llama.vscode, Continue, Tabby),
and its /tokenize, /detokenize, /apply-template, /props and /metrics.

Fields as llama.cpp reads them (tools/server/README.md): n_predict (-1: until EOS), n_indent,
t_max_predict_ms (once a line is complete, stop when generation has taken that long),
n_cmpl (several completions, answered as an array),
response_fields (only those fields, nested ones flattened: "timings/prompt_n"),
input_extra chunks ({text, filename}; other keys such as llama.vim's `time` are ignored).
`id_slot` is ignored: a request runs in the slot (KV cache) that reuses most of its prompt
(slots.py), reported back as `id_slot`. llama.vim pins FIM to slot 0 and its instruct prompts to
slot 1; choosing by content keeps those apart too, and also each file the editor flips between.
`n_predict: 0` only prefills (editors' warm-ups), so the next request reuses it.

/infill on a model without FIM tokens (the embedded default) completes in the prefix-only layout
(fim.py) and says so with `"fim": false`; `--strict-infill` answers 501 as llama.cpp does.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import Field

from ..fim import CompletionRules
from .core import Context, Job, encode_text, error
from .fields import TOKEN_LIMIT, Lenient, Sampling
from .logprobs import llama_cpp, token_bytes


class Chunk(Lenient):
    text: str = ""
    filename: str | None = None


class LlamaParams(Sampling):
    n_predict: int = Field(128, ge=-1, le=TOKEN_LIMIT)
    n_indent: int = Field(0, ge=0)
    t_max_predict_ms: float | None = Field(None, ge=0)
    n_cmpl: int = Field(1, ge=1, le=16)
    response_fields: list[str] | None = None


class InfillRequest(LlamaParams):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[Chunk] = []
    prompt: str = ""


class CompletionRequest(LlamaParams):
    prompt: str | list[int]


class TokenizeRequest(Lenient):
    content: str = ""
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(Lenient):
    tokens: list[int] = []


class TemplateRequest(Lenient):
    messages: list[dict[str, Any]] = Field(min_length=1)


def pick_fields(result: dict, fields: list[str] | None) -> dict:
    """llama.cpp's response_fields: only the paths asked for, "a/b" read from result["a"]["b"]."""
    if not fields:
        return result
    out = {}
    for path in fields:
        value: Any = result
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


def router(ctx: Context) -> APIRouter:
    api = APIRouter()
    session, gen = ctx.session, ctx.gen

    def result(job: Job, index: int = 0, fim: bool | None = None) -> dict:
        t = job.timings
        out = {"index": index, "content": job.text, "id_slot": job.slot, "stop": True, "model": ctx.model_id,
               "tokens_predicted": t.get("predicted_n", 0), "tokens_evaluated": len(job.ids),
               "tokens_cached": len(job.ids) + t.get("predicted_n", 0), "truncated": job.truncated,
               "stop_type": job.stop_type, "has_new_line": "\n" in job.text, "timings": t}
        if fim is not None:
            out["fim"] = fim
        if job.log is not None:
            out["completion_probabilities"] = llama_cpp(job.log.shown)
        return out

    async def answer(request: Request, req: LlamaParams, job: Job, fim: bool | None = None):
        if req.stream and job.max_tokens:
            def event(piece: str, done: bool) -> dict:
                if done:
                    out = result(job, fim=fim) | {"content": ""}
                    return out | ({"completion_probabilities": llama_cpp(job.log.take())} if job.log else {})
                out = {"index": 0, "content": piece, "stop": False, "id_slot": job.slot}
                return out | ({"completion_probabilities": llama_cpp(job.log.take())} if job.log else {})

            return StreamingResponse(gen.stream(request, job, event, done_marker=False), media_type="text/event-stream")
        runs = await gen.complete(request, job, req.n_cmpl)
        results = [pick_fields(result(run, i, fim), req.response_fields) for i, run in enumerate(runs)]
        return JSONResponse(results if req.n_cmpl > 1 else results[0] if results else {})

    @api.get("/health")
    def health():
        return {"status": "ok", "model": ctx.model_id, "drafter": session.drafter_name,
                "requests_waiting": gen.requests_waiting, "busy": gen.busy}

    @api.post("/tokenize")
    def tokenize(req: TokenizeRequest):
        """Token ids of `content` (special tokens' text read as those tokens); `with_pieces`: each
        with the text it adds (its bytes as a list where they are not whole characters)."""
        ids = session.tokenizer.encode(req.content, add_special_tokens=req.add_special)
        if not req.with_pieces:
            return {"tokens": ids}
        piece = token_bytes(session.tokenizer)

        def text(raw: bytes) -> str | list[int]:
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return list(raw)

        return {"tokens": [{"id": i, "piece": text(piece(i))} for i in ids]}

    @api.post("/detokenize")
    def detokenize(req: DetokenizeRequest):
        vocab = session.engine.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            return error(400, f"tokens: ids must be in [0, {vocab})")
        return {"content": session.tokenizer.decode(req.tokens)}

    @api.post("/apply-template")
    def apply_template(req: TemplateRequest):
        """The chat template's prompt for `messages`, as text."""
        return {"prompt": session.chat_text(req.messages)}

    @api.get("/metrics")
    def metrics():
        """Prometheus's text format (metrics.py)."""
        processing = gen.runner.active if gen.runner is not None else int(gen.turn.locked())
        return PlainTextResponse(gen.metrics.text(processing, gen.requests_waiting),
                                 media_type="text/plain; version=0.0.4")

    @api.get("/props")
    def props():
        """What llama.vscode reads (default_generation_settings.n_ctx) and llama.cpp's other keys."""
        return {"default_generation_settings": {"n_ctx": session.loaded.context_length, "model": ctx.model_id},
                "total_slots": gen.runner.lanes if gen.runner else session.engine.slots.n,
                "model_path": session.loaded.source,
                "build_info": "cacheback-mlx",
                "chat_template": getattr(session.tokenizer, "chat_template", None) or "",
                "infill": "fim" if session.loaded.fim else "prefix-only"}

    @api.post("/infill")
    async def infill(req: InfillRequest, request: Request):
        if ctx.strict_infill and not session.loaded.fim:
            return error(501, "Infill is not supported by this model: it has no fill-in-the-middle tokens "
                              "(serve without --strict-infill for prefix-only completion)", "not_supported_error")
        extra = [c.model_dump() for c in req.input_extra]
        job, fim = ctx.infill_job(req, req.input_prefix, req.input_suffix, extra, req.prompt,
                                  ctx.max_tokens(req.n_predict, 128), req.n_indent, req.t_max_predict_ms)
        return await answer(request, req, job, fim)

    @api.post("/completion")
    @api.post("/completions")
    async def completion(req: CompletionRequest, request: Request):
        ids = list(req.prompt) if isinstance(req.prompt, list) else encode_text(session, req.prompt)
        job = Job(ids, ctx.max_tokens(req.n_predict, 128), req, t_max_predict_ms=req.t_max_predict_ms or None)
        if req.n_indent:
            job.rules = CompletionRules(n_indent=req.n_indent)
        gen.check(job)
        return await answer(request, req, job)

    return api
