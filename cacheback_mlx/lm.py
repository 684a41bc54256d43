"""mlx-lm's API shape over this engine: an mlx-lm user switches by changing one import.

    from cacheback_mlx.lm import load, stream_generate, generate   # was: from mlx_lm import ...
    model, tokenizer = load("mlx-community/Qwen2.5-0.5B-Instruct-4bit")
    for r in stream_generate(model, tokenizer, "Hello", max_tokens=64):
        print(r.text, end="")

Responses have mlx-lm's GenerationResponse fields (text, token, logprobs, from_draft, prompt_tokens,
prompt_tps, generation_tokens, generation_tps, peak_memory, finish_reason), one per token as in
mlx-lm (the last one carries finish_reason "stop" with the EOS token, or "length"), plus the
drafting counters of the generation so far (passes, mat). `logprobs` is each token's
log-probabilities over the vocabulary as in mlx-lm, from the pass row that predicted it (the same
values within a pass's rounding; computed only when read). Differences: `from_draft` is True for
tokens that came from an accepted draft, and sampling is set with temperature / top_p / top_k / min_p / seed, or a
`sampler` from mlx-lm's make_sampler whose settings are read back (sampler_settings: sample-and-match needs the
distribution itself, so a sampler of one's own is refused). `logits_processors`
(mlx-lm's, e.g. make_logits_processors' penalties and biases) apply as in mlx-lm, every row of a
pass with the tokens before its own position (sampling.processed_rows). `prompt_cache` (a list from
mlx-lm's make_prompt_cache) carries a conversation as in mlx-lm: each call's prompt continues what
the list holds (prompt_cache.py: the keys and values stay in the engine's caches; trim with
trim_prompt_cache from here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx

from . import prompt_cache
from .api import DEFAULT_DRAFTER, Session, load_cached
from .errors import CachebackError
from .loader import FolderOptions, LoadedModel
from .prompt_cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from .sampling import SamplingParams

__all__ = ["load", "stream_generate", "generate", "batch_generate", "make_prompt_cache", "trim_prompt_cache",
           "can_trim_prompt_cache", "GenerationResponse", "BatchResponse"]

_sessions: dict[int, Session] = {}  # id(model) -> its Session (checked: same model object)
_loaded: dict[int, LoadedModel] = {}  # id(model) -> how it was loaded


@dataclass
class GenerationResponse:
    text: str
    token: int
    logprobs: object
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    passes: int = 0  # verify passes so far
    mat: float = 0.0  # mean tokens per pass so far


def load(path_or_hf_repo: str | None = None, tokenizer_config: dict | None = None, model_config: dict | None = None,
         adapter_path: str | None = None, lazy: bool = False, return_config: bool = False,
         revision: str | None = None, trust_remote_code: bool = False, dtype: str | None = None):
    """(model, tokenizer), or (model, tokenizer, config) with `return_config`, as mlx_lm.load
    returns them, for a GGUF file, an mlx-lm folder, a Hugging Face repo id or an alias; None is
    the embedded default model. mlx_lm.load's arguments mean what they mean there (tokenizer_config,
    model_config and revision apply to folders and repos; a GGUF's config is its model's args);
    `lazy` changes nothing (the weights are read at once); `dtype` is this package's own (see
    `doctor`)."""
    options = FolderOptions.of(tokenizer_config, model_config, revision, trust_remote_code)
    loaded = load_cached(path_or_hf_repo, dtype, adapter_path, options)
    _loaded[id(loaded.model)] = loaded
    if not return_config:
        return loaded.model, loaded.tokenizer
    config = loaded.config
    if config is None:  # a GGUF, a random or the default model: its mlx-lm args
        args = getattr(loaded.model, "args", None)
        config = {k: v for k, v in (vars(args) if args is not None else {}).items() if v is not None}
    return loaded.model, loaded.tokenizer, dict(config)


def _session(model, tokenizer, drafter: str, draft_budget: int | None) -> Session:
    session = _sessions.get(id(model))
    if session is None or session.loaded.model is not model or session.tokenizer is not tokenizer:
        loaded = _loaded.get(id(model))
        if loaded is None or loaded.model is not model or loaded.tokenizer is not tokenizer:  # mlx_lm.load
            args = getattr(model, "args", None)
            context = int(getattr(args, "max_position_embeddings", 0) or 4096)
            loaded = LoadedModel(model, tokenizer, type(model).__module__, "caller", context, "native", None)
        session = _sessions[id(model)] = Session(loaded, drafter, draft_budget=draft_budget)
    if session.drafter_name != drafter:
        session.set_drafter(drafter)
    return session


def stream_generate(model, tokenizer, prompt: str | Sequence[int] | mx.array, max_tokens: int = 256,
                    drafter: str = DEFAULT_DRAFTER, draft_budget: int | None = None, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int | None = None, min_p: float = 0.0,
                    **kwargs) -> Iterator[GenerationResponse]:
    """Generate from `prompt` (text, or token ids), one GenerationResponse per token."""
    settings = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    if kwargs.get("sampler") is not None:
        if settings != dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0):
            raise CachebackError("give either sampler= or temperature=, top_p=, top_k=, min_p=, not both")
        settings = sampler_settings(kwargs["sampler"])
    unknown = set(kwargs) - {"sampler", "logits_processors", "draft_model", "max_kv_size", "prefill_step_size",
                             "prompt_progress_callback", "num_draft_tokens", "kv_bits", "kv_group_size",
                             "quantized_kv_start", "prompt_cache"}
    unknown |= {k for k in ("draft_model", "max_kv_size") if kwargs.get(k) is not None}
    if unknown:
        raise CachebackError(f"unsupported arguments: {', '.join(sorted(unknown))}")
    if max_tokens == 0:
        raise CachebackError("max_tokens must be non-zero (use -1 for no limit)")
    sampling = SamplingParams(**settings, seed=seed, logits_processors=kwargs.get("logits_processors") or (),
                              logprobs=True)
    cache = kwargs.get("prompt_cache")
    before = prompt_cache.held(model, cache) if cache is not None else []  # the conversation so far
    session = _session(model, tokenizer, drafter, draft_budget)
    session.engine.set_eos(tokenizer.eos_token_ids)  # as mlx-lm reads them at each call (add_eos_token)
    session.engine.set_kv_quantization(kwargs.get("kv_bits"), kwargs.get("kv_group_size", 64),
                                       kwargs.get("quantized_kv_start", 5000))
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        ids = list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
    else:
        ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]
    limit = session.loaded.context_length if max_tokens < 0 else max_tokens
    given: list[int] = []  # the tokens handed out: with the prompt, what the prompt cache then holds
    try:
        yield from _responses(session, tokenizer, before + ids, len(ids), limit, sampling, given)
    except GeneratorExit:  # the caller stopped reading: the cache holds what it was given (an error: unchanged)
        if cache is not None:
            prompt_cache.hold(cache, before + ids + given)
        raise
    if cache is not None:
        prompt_cache.hold(cache, before + ids + given)


def _responses(session: Session, tokenizer, ids: list[int], prompt_tokens: int, limit: int,
               sampling: SamplingParams, given: list[int]) -> Iterator[GenerationResponse]:
    """mlx-lm's responses for a generation from `ids` (of which the last `prompt_tokens` are this
    call's prompt); each token handed out is added to `given`."""
    detok = tokenizer.detokenizer
    detok.reset()
    eng, n, last = session.engine, 0, None
    tic = time.perf_counter()

    def out(r: GenerationResponse) -> GenerationResponse:
        given.append(r.token)
        return r

    for step in eng.generate(ids, limit, sampling):
        for i, token in enumerate(step):
            n += 1
            detok.add_token(token)
            if last is not None:
                yield out(last)
            stats = eng.stats
            last = GenerationResponse(detok.last_segment, int(token), step.logprobs[i], i < len(step) - 1,
                                      prompt_tokens, _prompt_tps(stats), n,
                                      n / max(time.perf_counter() - tic - stats.prefill_s, 1e-9),
                                      mx.get_peak_memory() / 1e9, None, stats.passes, stats.mat)
    stats = eng.stats
    detok.finalize()
    stop = stats.stop_token
    if stop is not None:  # mlx-lm ends with the EOS token itself, finish_reason "stop"
        if last is not None:
            yield out(last)
        last = GenerationResponse(detok.last_segment, stop, stats.stop_logprobs, False, prompt_tokens,
                                  _prompt_tps(stats), n + 1, n / max(time.perf_counter() - tic - stats.prefill_s, 1e-9),
                                  mx.get_peak_memory() / 1e9, "stop", stats.passes, stats.mat)
    elif last is not None:
        last.text += detok.last_segment
        last.finish_reason = "length"
        last.passes, last.mat = stats.passes, stats.mat
    if last is not None:
        yield out(last)


def sampler_settings(sampler) -> dict:
    """SamplingParams' settings (temperature, top_p, top_k, min_p, XTC's) of a sampler made by
    mlx-lm's make_sampler, read from the function it returns (drafts are checked against the
    distribution, so the settings are needed, not a draw); any other sampler: a one-line error."""
    from mlx_lm import sample_utils

    if sampler is sample_utils.greedy_sampler:
        return {"temperature": 0.0}
    own = CachebackError("pass temperature=, top_p=, top_k=, min_p= (or mlx-lm's make_sampler of them) "
                         "instead of a sampler of your own")

    def cells(fn) -> dict:
        return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))

    if (getattr(sampler, "__module__", None) != sample_utils.__name__
            or getattr(sampler, "__qualname__", None) != "make_sampler.<locals>.sampler"):
        raise own
    try:
        made = cells(sampler)
        out = {"temperature": float(made["temp"])}
        for method in made["sampling_methods"]:
            calls, values = set(method.__code__.co_names), cells(method)
            if calls == {"apply_top_p"}:
                out["top_p"] = float(values["top_p"])
            elif calls == {"apply_min_p"} and values["min_tokens_to_keep"] == 1:
                out["min_p"] = float(values["min_p"])
            elif calls == {"apply_top_k"}:
                out["top_k"] = int(values["top_k"])
            elif calls == {"apply_xtc"}:
                out.update(xtc_probability=float(values["xtc_probability"]),
                           xtc_threshold=float(values["xtc_threshold"]),
                           xtc_special=tuple(values["xtc_special_tokens"] or ()))
            else:
                raise own
    except (AttributeError, KeyError, TypeError):  # an mlx-lm whose make_sampler is built otherwise
        raise own from None
    return out


def _prompt_tps(stats) -> float:
    return stats.prompt_tokens / stats.prefill_s if stats.prefill_s > 0 else 0.0


def generate(model, tokenizer, prompt, max_tokens: int = 256, verbose: bool = False, **kwargs) -> str:
    """The whole text, as mlx_lm.generate returns it."""
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs):
        text += last.text
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print(f"\nPrompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec\n"
              f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec "
              f"({last.passes} passes, {last.mat:.2f} tokens per pass)\nPeak memory: {last.peak_memory:.3f} GB")
    return text


@dataclass
class BatchResponse:
    """mlx-lm's BatchResponse fields: the texts, counters, and the token ids when asked for."""

    texts: list[str]
    stats: dict
    caches: list | None = None  # with return_prompt_caches: a prompt cache per prompt (prompt_cache.py)
    token_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None  # each token's log-probability, with return_logprobs


def batch_generate(model, tokenizer, prompts: Sequence[Sequence[int] | str], max_tokens: int | Sequence[int] = 128,
                   verbose: bool = False, return_token_ids: bool = False, return_logprobs: bool = False,
                   drafter: str = DEFAULT_DRAFTER,
                   draft_budget: int | None = None, lanes: int | None = None, prompt_caches: Sequence | None = None,
                   return_prompt_caches: bool = False, **kwargs) -> BatchResponse:
    """mlx_lm.batch_generate over this engine: every prompt (token ids, or text) runs in one
    batch, several sequences to a pass, each with its own drafts (batch.py). Sampling as in
    stream_generate (temperature / top_p / top_k / seed). `prompt_caches`: a prompt cache per
    prompt (or None), each prompt continuing what its cache holds; `return_prompt_caches`: new ones
    holding each prompt and its tokens, as mlx-lm's (the given ones are left as they were)."""
    session = _session(model, tokenizer, drafter, draft_budget)
    ids = [session.encode(p, chat=False) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    prompt_tokens = sum(len(p) for p in ids)  # this call's (mlx-lm's count)
    if prompt_caches is not None:
        if len(prompt_caches) != len(ids):
            raise CachebackError(f"prompt_caches: {len(prompt_caches)} caches for {len(ids)} prompts")
        ids = [(prompt_cache.held(model, c) if c is not None else []) + p for c, p in zip(prompt_caches, ids)]
    limits = list(max_tokens) if isinstance(max_tokens, Sequence) else [max_tokens] * len(ids)
    if len(limits) != len(ids):
        raise CachebackError(f"max_tokens: {len(limits)} limits for {len(ids)} prompts")
    unknown = set(kwargs) - {"temperature", "top_p", "top_k", "seed", "min_p", "sampler"}
    if unknown:
        raise CachebackError(f"batch_generate: unknown arguments {sorted(unknown)}")
    if kwargs.get("sampler") is not None:  # mlx-lm's make_sampler(...), as its batch_generate takes
        if set(kwargs) - {"sampler", "seed"}:
            raise CachebackError("give either sampler= or temperature=, top_p=, top_k=, min_p=, not both")
        kwargs.update(sampler_settings(kwargs["sampler"]))
    kwargs.pop("sampler", None)
    batch = session.batch(lanes or min(len(ids), 8))
    t0 = time.perf_counter()
    sampling = SamplingParams(**kwargs, logprobs=return_logprobs)
    done = batch.run([dict(prompt=p, max_tokens=n, sampling=sampling) for p, n in zip(ids, limits)])
    seconds = time.perf_counter() - t0
    tokens = sum(len(lane.tokens) for lane in done)
    stats = {"prompt_tokens": prompt_tokens, "generation_tokens": tokens, "wall_time": seconds,
             "generation_tps": tokens / seconds if seconds > 0 else 0.0, "passes": batch.passes}
    if verbose:
        print(f"[batch_generate] {len(ids)} prompts, {tokens} tokens in {seconds:.2f} s "
              f"({stats['generation_tps']:.1f} tokens-per-sec, {batch.passes} passes)")
    caches = None
    if return_prompt_caches:
        caches = [prompt_cache.make_prompt_cache(model) for _ in done]
        for c, p, lane in zip(caches, ids, done):  # a stop token is fed, as mlx-lm's caches have it
            prompt_cache.hold(c, p + lane.tokens + ([lane.stats.stop_token] if lane.finish_reason == "stop" else []))
    return BatchResponse([session.text_of(lane.tokens) for lane in done], stats, caches,
                         token_ids=[lane.tokens for lane in done] if return_token_ids else None,
                         logprobs=[lane.token_logprobs for lane in done] if return_logprobs else None)

