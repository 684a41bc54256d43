"""The `cacheback-mlx` command. Bad input ends with a one-line `error: ...` and exit code 1."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import click

from . import blas, malloc  # noqa: F401  (imported first: preloads OpenBLAS before mlx)
from .errors import CachebackError


def user_errors(fn):
    """Turn CachebackError (and other failures) into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        try:
            return fn(*args, **kw)
        except CachebackError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)
        except Exception as e:  # a bug, not bad input: still one line unless asked for details
            from .distributed import is_link_error

            if is_link_error(e):  # --distributed: another rank ended or died
                click.echo(f"error: lost a rank of the distributed group ({str(e).splitlines()[0]})", err=True)
                sys.exit(1)
            if os.environ.get("CACHEBACK_MLX_DEBUG"):
                raise
            click.echo(f"error: {type(e).__name__}: {e} (set CACHEBACK_MLX_DEBUG=1 for a traceback)", err=True)
            sys.exit(2)

    return wrapper


def drafter_option(fn):
    from .api import DEFAULT_DRAFTER

    fn = click.option("--drafter", default=DEFAULT_DRAFTER, show_default=True,
                      help="Drafter: auto, none, ngram, cacheback, pld, rest, ssd, card.")(fn)
    fn = click.option("--draft-budget", type=int, default=None,
                      help="The most draft tokens per verify pass (default 63; each pass takes as many as "
                           "pay for themselves, from the measured pass cost).")(fn)
    fn = click.option("--fixed-budget", is_flag=True,
                      help="Draft --draft-budget tokens every pass (default: per backend, 7 on a CPU) "
                           "instead of choosing per pass.")(fn)
    fn = click.option("--drafter-arg", "drafter_args", multiple=True, metavar="KEY=VALUE",
                      help="A drafter parameter, e.g. --drafter-arg tdl=32 (repeatable).")(fn)
    return fn


def distributed_option(fn):
    return click.option("--distributed", type=click.Choice(["tensor", "pipeline"]), default=None,
                        help="Run on a model sharded over the ranks mlx.launch started (mlx-lm folders "
                             "or repos): tensor or pipeline parallel. Rank 0 drafts and answers.")(fn)


def open_session(model, dtype, drafter, draft_budget, fixed_budget, drafter_args, distributed=None,
                 adapter_path=None):
    """The Session a command runs on. With --distributed, ranks > 0 follow rank 0 here and exit
    when it is done; rank 0 gets a Session whose engine announces each pass to them."""
    from .api import Session
    from .drafters import drafter_names, make_drafter

    params = parse_drafter_args(drafter_args)
    if not distributed:
        return Session(model, drafter, dtype=dtype, draft_budget=draft_budget, fixed_budget=fixed_budget,
                       adapter_path=adapter_path, **params)
    if adapter_path is not None:
        raise CachebackError("--adapter-path does not go with --distributed (mlx-lm shards the model as it loads "
                             "it; fuse the adapters into it first: mlx_lm.fuse)")
    import atexit

    from . import distributed as dist

    if drafter not in drafter_names():  # every rank fails alike, before joining
        make_drafter(drafter)
    node = dist.start(model, distributed, dtype, drafter)
    if node.rank > 0:
        dist.follow(node)
        sys.exit(0)
    leader = dist.Leader(node.group)
    atexit.register(leader.stop)
    return Session(node.loaded, drafter, draft_budget=draft_budget, fixed_budget=True, peers=leader, **params)


def penalty_option(fn):
    """--repetition-penalty and its window, as mlx-lm's logits processors apply them (sampling.penalties)."""
    fn = click.option("--repetition-context-size", "repetition_window", type=int, default=20, show_default=True,
                      help="Tokens the repetition penalty looks back over, the prompt's included (-1: all).")(fn)
    return click.option("--repetition-penalty", type=float, default=None,
                        help="Penalize tokens seen in the last tokens, as mlx-lm does (1: none).")(fn)


def model_option(fn):
    fn = click.option("--model", "-m", default=None,
                      help="GGUF file, mlx-lm folder, Hugging Face repo id, alias, or random:NAME[:OPTIONS] (a popular "
                           "model's shape with seeded random weights, no download; options q4, q8, f32, f16, bf16, "
                           "layers=N, seed=S; an unknown NAME lists the known ones) "
                           "(default: embedded SmolLM2-135M).")(fn)
    fn = click.option("--dtype", default=None, type=click.Choice(["float32", "float16", "bfloat16", "native"]),
                      help="Weight dtype (default: the fastest for the backend).")(fn)
    return fn


def sampling_options(fn):
    """The options of a sampled generation, as mlx-lm's generate and chat name them."""
    for option in reversed([
            click.option("--temp", default=0.0, show_default=True, help="Temperature; 0 = greedy."),
            click.option("--top-p", default=1.0, show_default=True),
            click.option("--top-k", default=0, show_default=True),
            click.option("--min-p", default=0.0, show_default=True,
                         help="Keep tokens at least this fraction of the likeliest one's probability (0: off)."),
            click.option("--seed", type=int, default=None),
            click.option("--xtc-probability", default=0.0, show_default=True,
                         help="XTC: at each token, with this probability, leave out the likeliest tokens but the "
                              "least likely of those above --xtc-threshold, as mlx-lm's (0: off)."),
            click.option("--xtc-threshold", default=0.1, show_default=True, help="XTC's threshold (0 to 0.5)."),
            click.option("--extra-eos-token", "extra_eos", multiple=True, metavar="TOKEN",
                         help="Also end the answer at this token (its id, its spelling in the vocabulary, or a "
                              "text that is one token; repeatable), as mlx-lm's --extra-eos-token.")]):
        fn = option(fn)
    return fn


def kv_options(fn):
    """mlx-lm's K/V cache quantization options (generate_step's kv_bits, kv_group_size, quantized_kv_start)."""
    for option in reversed([
            click.option("--kv-bits", type=int, default=None,
                         help="Keep the K/V cache in this many bits once it holds --quantized-kv-start tokens, as "
                              "mlx-lm's --kv-bits (default: full precision). Past that point the output is not "
                              "always mlx-lm's token for token (README, \"K/V cache quantization\")."),
            click.option("--kv-group-size", type=int, default=64, show_default=True,
                         help="Group size of the K/V cache quantization."),
            click.option("--quantized-kv-start", type=int, default=5000, show_default=True,
                         help="Cached tokens from which the K/V cache is quantized (with --kv-bits).")]):
        fn = option(fn)
    return fn


def adapter_option(fn):
    return click.option("--adapter-path", default=None,
                        help="Fine-tuned adapters on the model: the folder mlx_lm.lora wrote (adapter_config.json, "
                             "adapters.safetensors), as mlx-lm's --adapter-path.")(fn)


def parse_drafter_args(pairs) -> dict:
    """KEY=VALUE strings -> parameters; values become int, float or bool when they read as one."""
    params = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CachebackError(f"drafter arguments are KEY=VALUE, got {pair!r}")
        params[key.replace("-", "_")] = parse_value(value)
    return params


def parse_value(value: str):
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cacheback-mlx")
def main():
    """Local LLM runtime on MLX with lossless, training-free speculative decoding."""


@main.command()
@click.argument("prompt")
@model_option
@drafter_option
@click.option("--max-tokens", "-n", default=256, show_default=True)
@sampling_options
@penalty_option
@click.option("--chat/--raw", " /--ignore-chat-template", default=None,
              help="Use the chat template (default when the model has one); --raw, or mlx-lm's "
                   "--ignore-chat-template: the prompt as it is.")
@click.option("--system", "--system-prompt", "system", default=None, help="System prompt (chat mode).")
@click.option("--stats", is_flag=True, help="Print tokens, passes, MAT and speed to stderr.")
@click.option("--json-schema", default=None, help="Keep the answer to this JSON schema (inline JSON, or a file).")
@click.option("--grammar", default=None, help="Keep the answer to this GBNF grammar (llama.cpp's; inline, or a file).")
@kv_options
@adapter_option
@distributed_option
@user_errors
def generate(prompt, model, dtype, drafter, draft_budget, fixed_budget, drafter_args, max_tokens, temp, top_p,
             top_k, min_p, seed, xtc_probability, xtc_threshold, extra_eos, repetition_penalty, repetition_window,
             chat, system, stats, json_schema, grammar, kv_bits, kv_group_size, quantized_kv_start, adapter_path,
             distributed):
    """Generate text for PROMPT ('-' reads stdin), streaming it to stdout."""
    from .constrained import Constrained, check, grammar_of
    from .sampling import SamplingParams, penalties, xtc_special

    processors = penalties(repetition_penalty, window=repetition_window)
    structure = None
    if json_schema is not None or grammar is not None:
        def read(value: str) -> str:  # a file's text, or the value itself
            if not os.path.isfile(value):
                return value
            with open(value, encoding="utf-8") as f:
                return f.read()

        structure = grammar_of(json_schema=read(json_schema)) if json_schema is not None else \
            grammar_of(gbnf=read(grammar))
    sampling = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                              xtc_probability=xtc_probability, xtc_threshold=xtc_threshold)  # checked first
    session = open_session(model, dtype, drafter, draft_budget, fixed_budget, drafter_args, distributed, adapter_path)
    session.add_eos_tokens(extra_eos)
    if xtc_probability > 0:
        sampling = dataclasses.replace(sampling, xtc_special=xtc_special(session.tokenizer, session.engine.eos_ids))
    session.engine.set_kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    if prompt == "-":
        prompt = sys.stdin.read()
    ids = session.encode(prompt, chat=chat, system=system)
    if structure is not None:
        check(structure, session.tokenizer, session.engine.eos_ids)
        processors += (Constrained(structure, session.tokenizer, session.engine.eos_ids, len(ids)),)
    sampling = dataclasses.replace(sampling, logits_processors=processors)
    for text, _ in session.stream_ids(ids, max_tokens, sampling):
        click.echo(text, nl=False)
    click.echo()
    if stats:
        s = session.stats
        click.echo(f"[{session.loaded.name} {session.loaded.dtype} drafter={drafter}] prompt {s.prompt_tokens} tok "
                   f"({s.prefill_s:.2f}s) | {s.tokens} tokens in {s.passes} passes, MAT {s.mat:.2f} | "
                   f"{s.tokens_per_s:.1f} tok/s | drafting {s.draft_s * 1e3:.1f} ms "
                   f"({100 * s.draft_s / max(s.decode_s, 1e-9):.1f}%, {s.draft_us_per_pass:.0f} us/pass)"
                   + (f", {s.learn_s * 1e3:.1f} ms more while passes ran" if s.learn_s else ""), err=True)
        drafter_stats = session.engine.drafter.stats()  # e.g. REST's datastore size
        if drafter_stats:
            click.echo(f"[{drafter}] " + ", ".join(f"{k} {v}" for k, v in drafter_stats.items()), err=True)


@main.command()
@model_option
@drafter_option
@click.option("--system", "--system-prompt", "system", default=None, help="System prompt.")
@click.option("--max-tokens", "-n", default=512, show_default=True)
@sampling_options
@penalty_option
@kv_options
@adapter_option
@distributed_option
@user_errors
def chat(model, dtype, drafter, draft_budget, fixed_budget, drafter_args, system, max_tokens, temp, top_p, top_k, min_p,
         seed, xtc_probability, xtc_threshold, extra_eos, repetition_penalty, repetition_window, kv_bits, kv_group_size,
         quantized_kv_start, adapter_path, distributed):
    """Chat with a model in the terminal (multi-turn, streaming; /help for commands)."""
    from .chat import run_chat
    from .sampling import SamplingParams, penalties, xtc_special

    sampling = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                              xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                              logits_processors=penalties(repetition_penalty, window=repetition_window))
    session = open_session(model, dtype, drafter, draft_budget, fixed_budget, drafter_args, distributed, adapter_path)
    session.add_eos_tokens(extra_eos)
    if xtc_probability > 0:
        sampling = dataclasses.replace(sampling, xtc_special=xtc_special(session.tokenizer, session.engine.eos_ids))
    session.engine.set_kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    run_chat(session, system, max_tokens, sampling)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8012, show_default=True)
@model_option
@drafter_option
@click.option("--api-key", default=None, envvar="CACHEBACK_MLX_API_KEY",
              help="Require Authorization: Bearer KEY (or x-api-key: KEY).")
@click.option("--max-body", default=1 << 20, show_default=True, help="Largest request body in bytes.")
@click.option("--strict-infill", is_flag=True,
              help="Answer /infill with 501 on models without FIM tokens, as llama.cpp does "
                   "(default: complete from the prefix, reported as \"fim\": false).")
@click.option("--batch-size", "-b", default=2048, show_default=True,
              help="Bounds /infill prompts as llama.cpp's batch size does: prefix <= 3/4, suffix <= 1/4 of it.")
@click.option("--infill-extra", default=0, show_default=True, type=click.IntRange(min=-1),
              help="Tokens of an editor's extra context chunks in a prefix-only /infill prompt (models "
                   "without FIM tokens), the oldest that fit; -1: all that fit. Chunks left out are still "
                   "drafted from. FIM prompts always take all that fit, as llama.cpp does.")
@click.option("--slots", default=4, show_default=True, type=click.IntRange(min=1),
              help="Sequences whose KV caches are kept at once (llama.cpp's slots): a request runs in the one "
                   "that reuses most of its prompt, so an editor flipping between files, or clients between "
                   "conversations, does not re-prefill each time. One with --distributed. With --parallel N > 1 "
                   "the N lanes are the slots: each keeps its sequence's caches.")
@click.option("--parallel", "-np", default=4, show_default=True, type=click.IntRange(min=1),
              help="Requests run at once, several sequences to a pass, each with its own drafts (continuous "
                   "batching; llama.cpp's -np); more wait for a free lane. 1: one request at a time. One with "
                   "--distributed.")
@adapter_option
@distributed_option
@kv_options
@user_errors
def serve(host, port, model, dtype, drafter, draft_budget, fixed_budget, drafter_args, api_key, max_body, strict_infill,
          batch_size, infill_extra, slots, parallel, adapter_path, distributed, kv_bits, kv_group_size,
          quantized_kv_start):
    """Serve completions over HTTP: llama.cpp /infill and /completion, OpenAI /v1/* (/v1/responses
    too), Ollama /api/*, Anthropic /v1/messages."""
    from click.core import ParameterSource

    from .server import serve as run_server

    if kv_bits is not None and parallel > 1 and not distributed:  # lanes of a batch keep full-precision caches
        if click.get_current_context().get_parameter_source("parallel") is not ParameterSource.DEFAULT:
            raise CachebackError("--kv-bits serves one request at a time: leave out --parallel or give --parallel 1")
        parallel = 1
    session = open_session(model, dtype, drafter, draft_budget, fixed_budget, drafter_args, distributed, adapter_path)
    session.engine.set_kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    mode = "FIM" if session.loaded.fim else "prefix-only (no FIM tokens)"
    adapters = f"; adapters {session.loaded.adapter}" if session.loaded.adapter else ""
    kv = (f"; K/V cache in {kv_bits} bits from {quantized_kv_start} tokens, one request at a time"
          if kv_bits is not None else "")
    click.echo(f"serving {session.loaded.name} on http://{host}:{port} (drafter {drafter}; infill: {mode}{adapters}"
               f"{kv})", err=True)
    run_server(session, host, port, api_key=api_key, max_body=max_body, strict_infill=strict_infill, batch=batch_size,
               infill_extra=None if infill_extra < 0 else infill_extra, slots=slots,
               parallel=1 if distributed else parallel)


@main.command("build-table")
@click.argument("corpus", nargs=-1, required=True)
@click.option("--out", "-o", required=True, help="Output .npz file.")
@model_option
@click.option("--ll", default=1, show_default=True, help="Leader length (tokens).")
@click.option("--fl", default=3, show_default=True, help="Follower length (tokens).")
@click.option("--lc", default=1 << 20, show_default=True, help="Leaders kept (the most frequent).")
@click.option("--fc", default=128, show_default=True, help="Followers kept per leader (the most frequent).")
@user_errors
def build_table(corpus, out, model, dtype, ll, fl, lc, fc):
    """Build a Cacheback frozen table from CORPUS (text files, folders, JSONL; gzipped too) for a model's tokenizer."""
    from .loader import load
    from .table_builder import build_table_from_files

    table = build_table_from_files(corpus, load(model, dtype).tokenizer, out, ll=ll, fl=fl, lc=lc, fc=fc)
    click.echo(f"{len(table)} leaders, {len(table.followers)} followers -> {out}")


@main.command("build-datastore")
@click.argument("corpus", nargs=-1, required=True)
@click.option("--out", "-o", required=True, help="Output folder.")
@model_option
@user_errors
def build_datastore(corpus, out, model, dtype):
    """Build a REST datastore (token ids + suffix array) from CORPUS for a model's tokenizer."""
    from tqdm import tqdm

    from .drafters.rest import save_datastore
    from .loader import load
    from .table_builder import corpus_texts
    from .tokenizer import vocab_fingerprint

    tokenizer = load(model, dtype).tokenizer
    docs = [tokenizer.encode(text, add_special_tokens=False)
            for _, text in tqdm(list(corpus_texts(corpus)), desc="tokenizing", unit=" docs")]
    meta = save_datastore(docs, out, fingerprint=vocab_fingerprint(tokenizer))
    click.echo(f"{meta['tokens']} tokens, suffix array built in {meta['build_seconds']} s -> {out}")


@main.command()
@model_option
@click.option("--prompts", default="spec_bench,humaneval", show_default=True, help="Prompt sets (comma list).")
@click.option("--categories", default=None, help="Only these categories/columns (comma list).")
@click.option("--per-category", default=2, show_default=True, help="Prompts per category.")
@click.option("--humaneval-prompts", type=int, default=None, help="HumanEval prompts (default: --per-category).")
@click.option("--max-tokens", "-n", default=128, show_default=True)
@click.option("--drafters", default="none,auto,cacheback,ngram", show_default=True,
              help="Drafters (comma list; none is always run). A variant adds parameters after colons and is "
                   "reported under that label: cacheback:frozen=false,cacheback:ll=2:fl=1.")
@click.option("--drafter-arg", "drafter_args", multiple=True, metavar="NAME.KEY=VALUE",
              help="A drafter parameter, e.g. --drafter-arg cacheback.tdl=32 (repeatable).")
@click.option("--draft-budget", type=int, default=None, help="Draft tokens per pass (default: per backend).")
@click.option("--warmup", default=1, show_default=True,
              help="Warm-up questions (outside the prompt sets, not counted), at most 2.")
@click.option("--seed", type=int, default=None, help="Sample the prompts of each category at random with this seed "
              "(default: the first ones).")
@click.option("--no-mlx-lm", is_flag=True, help="Skip the plain mlx-lm baseline.")
@click.option("--data", type=click.Path(file_okay=False), default=None, help="Folder with spec_bench/ and humaneval/.")
@click.option("--json", "json_out", default=None, help="Write per-prompt records and the summary here.")
@click.option("--plot", "plot_out", default=None, help="Write a PNG of speedup per column and drafter.")
@click.option("--verify-cost", is_flag=True, help="Only measure one pass over B tokens relative to one token.")
@click.option("--contexts", default=None, help="With --verify-cost: the cached tokens to measure at (comma list; "
              "default 256,1024). Shown only; the table the engine keeps is measured at its own.")
@click.option("--record", "record_dir", default=None, type=click.Path(file_okay=False),
              help="Only record the model's greedy streams for the selected prompts into this folder (for --forced).")
@click.option("--forced", "forced_dir", default=None, type=click.Path(file_okay=False, exists=True),
              help="Run the prompts recorded in this folder (bench --record), every drafter accepting along the "
                   "recorded streams: the speed of this model at the recorded model's acceptance (projected).")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="Sample at this temperature (0: greedy). Each question's turns get a seed of their own, the "
                   "same for every drafter, so every drafter's text must still equal none's; mlx-lm samples its own.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="With --temperature: top-p.")
@click.option("--top-k", type=int, default=0, show_default=True, help="With --temperature: top-k (0: off).")
@click.option("--min-p", type=float, default=0.0, show_default=True, help="With --temperature: min-p.")
@penalty_option
@kv_options
@adapter_option
@user_errors
def bench(model, dtype, prompts, categories, per_category, humaneval_prompts, max_tokens, drafters, drafter_args,
          draft_budget, warmup, seed, no_mlx_lm, data, json_out, plot_out, verify_cost, contexts, record_dir,
          forced_dir, temperature, top_p, top_k, min_p, repetition_penalty, repetition_window, kv_bits, kv_group_size,
          quantized_kv_start, adapter_path):
    """Speed of drafters vs plain decoding vs mlx-lm, per Spec-Bench column and HumanEval."""
    import datetime
    import platform
    from pathlib import Path

    import mlx.core as mx

    from . import bench as B
    from . import recording as R
    from .api import Session
    from .budget import Sizer
    from .costs import cpu_name
    from .sampling import SamplingParams, penalties

    if record_dir and forced_dir:
        raise CachebackError("--record and --forced do not go together (record first, then run forced)")
    sampling = None
    processors = penalties(repetition_penalty, window=repetition_window)
    if temperature or top_p != 1.0 or top_k or min_p or processors:
        if not temperature and (top_p != 1.0 or top_k or min_p):
            raise CachebackError("--top-p, --top-k and --min-p need a --temperature above 0")
        if record_dir or forced_dir:
            raise CachebackError("--record and --forced are greedy, with no penalty: no --temperature, "
                                 "no --repetition-penalty")
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                  logits_processors=processors)
    if kv_bits is not None and (record_dir or forced_dir or verify_cost):
        raise CachebackError("--kv-bits goes with a plain bench only (not --record, --forced or --verify-cost)")
    recording = R.load_recording(forced_dir) if forced_dir else None
    session = Session(model, "none", dtype=dtype, draft_budget=draft_budget, fixed_budget=True,
                      adapter_path=adapter_path)
    session.engine.set_kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    if recording is not None and recording.get("fingerprint") != session.fingerprint:
        raise CachebackError(f"{forced_dir} was recorded with another tokenizer ({recording.get('model')}); "
                             "a forced run needs the same vocabulary")
    if verify_cost:
        if contexts:
            from .costs import SIZES, measure

            try:
                at = tuple(int(c) for c in contexts.split(",") if c)
            except ValueError:
                raise CachebackError(f"--contexts takes numbers of tokens, got {contexts!r}") from None
            if not at or min(at) < 1 or max(at) + max(SIZES) >= session.loaded.context_length:
                raise CachebackError(f"--contexts must lie in [1, {session.loaded.context_length - max(SIZES) - 1}]")
            cost = measure(session.loaded.model, contexts=at, vocab=session.engine.vocab_size)
        else:
            cost = session.verify_cost(remeasure=True)  # also what per-step budgets use from now on
        for context in cost.contexts:
            row = cost.table[context]
            click.echo(f"{context} cached tokens:\n{'B':>4} {'ms':>8} {'x one token':>12}")
            for b, t in row.items():
                click.echo(f"{b:>4} {t * 1e3:>8.2f} {t / row[1]:>12.2f}")
        return
    sets = [s for s in prompts.split(",") if s]
    meta = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {cpu_name()}",
            "device": str(mx.default_device()), "model": session.loaded.name, "dtype": session.loaded.dtype,
            "draft_budget": draft_budget or "per pass", "max_tokens": max_tokens, "per_category": per_category,
            "humaneval_prompts": humaneval_prompts,
            "prompts": sets, "categories": categories, "seed": seed}
    if session.loaded.adapter:
        meta["adapters"] = session.loaded.adapter
    if temperature:
        meta["sampling"] = (f"temperature {temperature}, top_p {top_p}, top_k {top_k}, min_p {min_p}, "
                            "seeded per question")
    if processors:
        meta["repetition_penalty"] = f"{repetition_penalty} over {repetition_window} tokens"
    if kv_bits is not None:
        meta["kv_cache"] = f"{kv_bits} bits, group {kv_group_size}, from {quantized_kv_start} tokens"
    if recording is None:
        plist = B.select_prompts(sets, per_category, humaneval_prompts, categories.split(",") if categories else None,
                                 seed, Path(data) if data else B.DATA)
        if not plist:
            raise CachebackError("no prompts selected")
    if record_dir:
        from tqdm import tqdm

        records = [R.record_prompt(session, p, max_tokens) for p in tqdm(plist, desc="recording", unit=" prompt")]
        out = R.save_recording(record_dir, records, {**meta, "fingerprint": session.fingerprint})
        click.echo(f"{len(records)} prompts, {sum(len(t['out']) for r in records for t in r['turns'])} tokens -> {out}")
        return
    params: dict = {}
    for key, value in parse_drafter_args(drafter_args).items():
        name, _, k = key.partition(".")
        params.setdefault(name, {})[k] = value
    for name in ("ssd", "auto"):  # start empty: the saved buffer may hold these answers
        params.setdefault(name, {}).setdefault("persist", False)
    rows = {}  # every drafter is made (and a bad one refused) before the pass cost is measured
    for label in ["none"] + [n for n in drafters.split(",") if n and n != "none"]:
        name, *variant = label.split(":")  # e.g. cacheback:frozen=false:tdl=32, auto:budget=7
        args = {**params.get(name, {}), **parse_drafter_args(variant)}
        budget = args.pop("budget", None)  # budget=N: a fixed N per pass; default: chosen per pass
        fixed = budget is not None and budget != "auto"
        if fixed and (not isinstance(budget, int) or budget < 0):
            raise CachebackError(f"{label}: budget must be a number of tokens or 'auto'")
        rows[label] = (session.make_drafter(name, **args), fixed, budget)
    # the pass cost is measured only where a drafter's passes are sized by it (`none` drafts nothing)
    sized = any(not fixed and label != "none" for label, (_, fixed, _) in rows.items())
    cost = session.verify_cost() if sized else None
    instances = {label: B.Row(drafter, None if fixed or cost is None else Sizer(cost),
                              budget if fixed else draft_budget)
                 for label, (drafter, fixed, budget) in rows.items()}
    if recording is not None:
        meta.update({k: recording.get(k)
                     for k in ("max_tokens", "per_category", "humaneval_prompts", "categories", "seed")},
                    prompts=recording.get("prompt_sets"))
        records = recording["prompts"]
        if click.get_current_context().get_parameter_source("max_tokens") == click.core.ParameterSource.COMMANDLINE:
            records = R.cut_recording(records, max_tokens)  # each turn's first max_tokens tokens
            meta["max_tokens"] = max_tokens
        meta["forced"] = f"projected (acceptance of {recording.get('model')})"
        runs = R.run_forced_bench(session, records, instances, warmup=warmup, with_mlx_lm=not no_mlx_lm)
    else:
        runs = B.run_bench(session, plist, instances, max_tokens, warmup=warmup, with_mlx_lm=not no_mlx_lm,
                           sampling=sampling)
    summary = B.summarize(runs)
    click.echo(" ".join(f"{k}={v}" for k, v in meta.items()))
    click.echo(B.format_table(summary))
    if json_out:
        B.save_json(runs, summary, json_out, meta)
    if plot_out:
        B.plot(summary, plot_out)
    own_way = recording is not None or temperature > 0  # forced, or sampled: mlx-lm goes its own way
    bad = B.mismatches([r for r in runs if not own_way or r.drafter != B.MLX_LM])
    mlx_diff = B.mismatches(runs, reference=B.MLX_LM) if not no_mlx_lm and not own_way else []
    if mlx_diff:
        click.echo(f"note: none's tokens differ from mlx-lm's on {sum('none ' in m for m in mlx_diff)} prompt(s)",
                   err=True)
    logged = [r for r in runs if r.pass_log]
    slow = [(r, p) for r, passes in zip(logged, B.stalls([r.pass_log for r in logged], 10.0)) for p in passes]
    if slow:
        r, p = max(slow, key=lambda x: x[1][3])
        click.echo(f"note: {len(slow)} pass(es) took over 10x the median of their row count (the slowest "
                   f"{p[3]:.0f} ms, {p[0]} rows, on {r.prompt} with {r.drafter}; --json keeps every pass, "
                   "tools/slow_passes.py lists them)", err=True)
    if bad and temperature > 0:  # a draw near a boundary between two tokens: docs/BENCHMARKS.md §18
        for m in bad:
            click.echo(f"note: sampled, {m}", err=True)
        click.echo("note: a pass's logits differ from a step's by rounding, and a sampled draw can fall near enough to "
                   "the boundary between two tokens to be moved across it; each text is a draw from the model's "
                   "distribution", err=True)
    elif bad and kv_bits is not None:  # rounding moved across a quantization step (README)
        for m in bad + [m for m in mlx_diff if m.startswith("none ")]:
            click.echo(f"note: K/V quantized, {m}", err=True)
        click.echo("note: a pass's keys and values differ from a step's in their last bits, and quantizing can round "
                   "them to different steps; past the point where the cache turns quantized the tokens can part",
                   err=True)
    elif bad:
        for m in bad:
            click.echo(f"LOSSLESS CHECK FAILED: {m}", err=True)
        note = B.later_turn_note(bad + mlx_diff)
        if note:
            click.echo(note, err=True)
        sys.exit(1)


@main.command()
@click.option("--model", "model_spec", default=None, help="Also load this model and say what the engine makes of it.")
@click.option("--drafter", default=None, help="Also try this drafter on the model (16 tokens) and show its stats.")
@click.option("--drafter-arg", "drafter_args", multiple=True, metavar="KEY=VALUE",
              help="A drafter parameter (repeatable).")
@click.option("--rounding", is_flag=True,
              help="Also measure how far a verify pass's logits lie from one-token steps' on this machine, in the "
                   "model's dtype (of --model, else the default model; a few passes: slow for big models on a CPU).")
@adapter_option
@user_errors
def doctor(model_spec, drafter, drafter_args, rounding, adapter_path):
    """Show the backend, BLAS status and default settings; with --model, the model's family, its
    layer caches by kind and its verify path (draft trees, or chains and why), with --adapter-path
    the fine-tuned adapters on it (of the default model without --model); with --drafter, a
    short generation with that drafter and the drafter's own stats; with --rounding, how far a
    pass rounds from one-token steps here (rounding.py)."""
    import mlx.core as mx

    from .costs import cost_path
    from .engine import MAX_DRAFT, default_draft_budget

    click.echo(f"mlx {mx.__version__}, device {mx.default_device()}")
    click.echo(f"openblas: {blas.status}")
    if blas.weight_layout_wanted():
        click.echo("weights: float32 ones stored [in, out], the layout OpenBLAS multiplies fastest "
                   f"({blas.LAYOUT_ENV}=0: as loaded)")
    click.echo(f"malloc: {malloc.status}")
    malloc.raise_mlx_cache_limit()  # as the loader does
    click.echo(f"MLX buffer cache: {malloc.mlx_cache}")
    if mx.default_device() == mx.cpu:
        from . import activations, attention

        on = [name for name, used in (("attention (CACHEBACK_MLX_FAST_ATTENTION)", attention.enabled),
                                      ("SwiGLU (CACHEBACK_MLX_FAST_SILU)", activations.enabled)) if used]
        click.echo(f"engine's CPU kernels: {', '.join(on) or 'none: MLX its own'}")
    if mx.default_device().type == mx.DeviceType.gpu:
        click.echo(f"tf32: {'off' if os.environ.get('MLX_ENABLE_TF32') == '0' else 'on'} "
                   "(MLX_ENABLE_TF32; CUDA float32 matmuls)")
        from . import kernels

        if kernels.on_cuda() and kernels.enabled:
            click.echo("engine's GPU kernels: checking them (MLX compiles them in every process; seconds)...")
        click.echo(kernels.describe())
    from .kernels import exactness

    click.echo(exactness())
    from . import cores
    from .engine import RUN_AHEAD_ENV, run_ahead_default

    click.echo(f"plain steps start the next before their token is read ({RUN_AHEAD_ENV}): "
               f"{'on' if run_ahead_default() else 'off'}")
    click.echo(cores.share.describe())
    click.echo(f"draft budget: chosen per pass from the pass cost, at most {MAX_DRAFT} "
               f"(--fixed-budget: {default_draft_budget()} per pass); costs kept in {cost_path('').parent}")
    if (rounding or adapter_path) and model_spec is None:
        model_spec = "default"
    if model_spec is not None:
        from .drafters.base import NoDrafter
        from .engine import Engine
        from .footprint import model_bytes_per_step, model_shape, param_bytes
        from .loader import load

        loaded = load(model_spec, adapter_path=adapter_path)
        engine = Engine(loaded.model, [], NoDrafter(), loaded.context_length)
        info = engine.describe()
        click.echo(f"model: {loaded.name} ({loaded.source}), family {info['family']}, context {loaded.context_length}, "
                   f"dtype {loaded.dtype}" + (f"; {loaded.note}" if loaded.note else ""))
        shape = model_shape(loaded.model)
        layers = f"{shape['layers']}"
        if loaded.source == "random":
            from .random_models import total_layers

            layers += f" of {total_layers(loaded.name)}"
        experts = f", experts {shape['experts'][0]} of {shape['experts'][1]} active" if shape["experts"] else ""
        quant = ", ".join(f"{b}-bit (group {g})" for b, g in shape["quantized"]) or "not quantized"

        def size(n, unit=" GB", small=" MB"):
            return f"{n / 1e9:.2f}{unit}" if n >= 1e9 else f"{n / 1e6:.1f}{small}"

        click.echo(f"shape: hidden {shape['hidden']}, layers {layers}, heads {shape['heads']}, "
                   f"kv heads {shape['kv heads']}"
                   f"{experts}, vocab {shape['vocab']}, {size(shape['params'], 'B', 'M')} params")
        click.echo(f"weights: {size(param_bytes(loaded.model))} in memory, {quant}; "
                   f"read per decode step: {size(model_bytes_per_step(loaded.model))}")
        ends = [f"{loaded.tokenizer.convert_ids_to_tokens(i)} ({i})" for i in sorted(loaded.tokenizer.eos_token_ids)]
        click.echo(f"a reply ends at: {', '.join(ends) or 'no token'}")
        click.echo("layer caches: " + ", ".join(f"{k} x{v}" for k, v in info["caches"].items()))
        click.echo(f"verify: {info['verify']}; shape buckets: {info['shape buckets']}")
        from . import kernels

        if kernels.on_cuda() and kernels.enabled:  # the engine checked the kernels its layers take
            click.echo(f"with this model, {kernels.describe()}")
        click.echo(f"prompt: {info['prompt']}")
        from .sharing import describe, sharing

        click.echo(f"several requests at once (serve --parallel): "
                   f"{describe(sharing(engine), bool(engine.seq.cache.recurrent))}")
        from .api import cost_file
        from .costs import CostTable, PriorCost

        known = cost_file(loaded).read()
        click.echo("pass cost: " + (
            "a measured table" if isinstance(known, CostTable) else
            f"a line learned from {known.seen} timed passes" if isinstance(known, PriorCost) else
            "nothing known yet: a line from the model's shape, fitted to the first passes")
            + " (`serve` measures a table in its idle time; `bench --verify-cost` now)")
        if rounding:
            from .rounding import describe, measure

            click.echo(f"rounding ({loaded.dtype}): {describe(measure(loaded.model, loaded.tokenizer))}")
    if drafter is not None:
        from .api import Session

        session = Session(loaded if model_spec is not None else None, drafter, fixed_budget=True,
                          **parse_drafter_args(drafter_args))
        list(session.stream_ids(session.encode("Hello", chat=False), 16))
        s = session.stats
        click.echo(f"drafter {drafter}: 16 tokens in {s.passes} passes, MAT {s.mat:.2f}; "
                   + ", ".join(f"{k} {v}" for k, v in session.engine.drafter.stats().items()))
        session.engine.drafter.close()


if __name__ == "__main__":
    main()
