"""The Python API: a Session wires a loaded model, a drafter and the engine; generate() and
stream_generate() are one-call forms on top of it. The CLI, chat REPL, server and bench use this."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator, Sequence

from jinja2.exceptions import TemplateError
from mlx.utils import tree_flatten

from . import cores
from .batch import Batch, Lane
from .budget import Sizer
from .costs import CostFile, CostTable, Measurement, PriorCost, load_or_measure, plan_measurement
from .drafters import drafter_names, drafter_parameters, make_drafter
from .engine import Engine, Stats
from .errors import CachebackError
from .loader import FolderOptions, LoadedModel, load
from .sampling import SamplingParams
from .tokenizer import vocab_fingerprint

DEFAULT_DRAFTER = "auto"

_loaded: dict[tuple, LoadedModel] = {}


def load_cached(model: str | LoadedModel | None = None, dtype: str | None = None,
                adapter_path: str | None = None, options: FolderOptions = FolderOptions()) -> LoadedModel:
    """load(), remembered per (model, dtype, adapters, options) so repeated API calls do not reload
    weights."""
    if isinstance(model, LoadedModel):
        if adapter_path is not None:
            raise CachebackError("adapters go with a model to load (a spec), not an already loaded one")
        return model
    key = (model, dtype, adapter_path and str(Path(adapter_path).expanduser().resolve()), repr(options))
    if key not in _loaded:
        _loaded[key] = load(model, dtype=dtype, adapter_path=adapter_path, options=options)
    return _loaded[key]


def truncate_left(ids: Sequence[int], context_length: int, max_tokens: int, keep_first: bool = False) -> list[int]:
    """llama.cpp's answer to a prompt longer than the context: drop tokens from the left (after
    the first one when `keep_first`, e.g. a BOS) so that the prompt and a reply of up to
    min(max_tokens, context/4) tokens fit."""
    ids = list(ids)
    room = context_length - max(1, min(max_tokens, context_length // 4))
    if len(ids) <= room:
        return ids
    head = ids[:1] if keep_first and ids else []
    return head + ids[len(ids) - (room - len(head)):]


def cost_file(loaded: LoadedModel) -> CostFile:
    """Where this machine keeps what a model's passes cost (costs.CostFile)."""
    params = sum(v.size for _, v in tree_flatten(loaded.model.parameters()))
    return CostFile(f"{loaded.name}|{loaded.dtype}|{vocab_fingerprint(loaded.tokenizer)}|{params}")


class Session:
    """One model, its KV cache and a drafter. Keeps both across calls, so a conversation's later
    turns only prefill their new tokens and the drafter keeps what it learned."""

    def __init__(self, model: str | LoadedModel | None = None, drafter: str = DEFAULT_DRAFTER,
                 dtype: str | None = None, draft_budget: int | None = None, fixed_budget: bool = False,
                 peers=None, adapter_path: str | None = None, **drafter_params):
        """draft_budget caps the draft tokens per pass; each pass takes as many as pay for their
        rows by the model's pass cost (costs.py: a measured table if this machine has one, else a
        prior fitted to the engine's own passes; nothing is measured before the first token), or
        exactly draft_budget (default: per backend) with fixed_budget.
        peers: the other ranks of a sharded model (distributed.Leader); the budget is then fixed
        (measuring pass costs would run passes the other ranks do not mirror).
        adapter_path: fine-tuned adapters (mlx_lm.lora's folder) on the model (adapters.py)."""
        if drafter not in drafter_names():  # a bad name fails before the model loads
            make_drafter(drafter)
        self.loaded = load_cached(model, dtype, adapter_path)
        self.tokenizer = self.loaded.tokenizer
        self.fingerprint = vocab_fingerprint(self.tokenizer)
        first_drafter = self.make_drafter(drafter, **drafter_params)
        self.drafter_name, self.drafter_params = drafter, drafter_params
        self.engine = Engine(self.loaded.model, self.tokenizer.eos_token_ids, first_drafter,
                             self.loaded.context_length, draft_budget=draft_budget, peers=peers)
        self.cost_file = cost_file(self.loaded)
        self._measurement: Measurement | None = None
        self._batch: Batch | None = None  # several requests at once (batch())
        self._measure_tries = 0
        self._looked = time.monotonic()
        if not fixed_budget and peers is None:
            self.engine.set_sizer(Sizer(self.pass_cost()), draft_budget)

    def pass_cost(self) -> CostTable | PriorCost:
        """What this machine knows of this model's pass costs: its cost file's table or learned
        prior, else the prior from the model's shape. Never measures."""
        return self.cost_file.read(self.engine.buckets) or PriorCost.for_model(self.loaded.model, self.engine.buckets)

    def verify_cost(self, remeasure: bool = False) -> CostTable:
        """Seconds of a pass by rows and cached tokens for this model on this machine, measured now
        if it never was (`bench`; costs.load_or_measure); the engine's sizer uses it from then on."""
        table = load_or_measure(self.loaded.model, self.cost_file.key, self.loaded.context_length, self.engine.buckets,
                                vocab=self.engine.vocab_size, remeasure=remeasure)
        if self.engine.sizer is not None:
            self.engine.sizer.set_cost(table)
        return table

    def _prior(self) -> PriorCost | None:
        sizer = self.engine.sizer
        return sizer.cost if sizer is not None and isinstance(sizer.cost, PriorCost) else None

    def look_for_table(self, every: float = 2.0) -> None:
        """Take up a table another process measured meanwhile (checked at most every `every` s)."""
        if self._prior() is None or time.monotonic() - self._looked < every:
            return
        self._looked = time.monotonic()
        table = self.cost_file.read(self.engine.buckets)
        if isinstance(table, CostTable):
            self.engine.sizer.set_cost(table)

    def keep_learned(self, min_passes: int = 8) -> None:
        """Save what the prior learned from this process's passes, for the next process to start
        from (costs.CostFile.keep_learned: a measured table, or one learned from as much, stays)."""
        prior = self._prior()
        if prior is not None and prior.seen >= min_passes:
            self.cost_file.keep_learned(prior)

    def measure_step(self) -> bool:
        """One step (a pass) of measuring this model's table in idle time (`serve`): False when
        there is nothing to do now (a table is in use, another process of ours is busy or
        measuring, or two measurements came out under load). Once the table is complete and was
        measured quietly it is saved and priced by from then on."""
        prior = self._prior()
        if prior is None or self._measure_tries >= 2 or cores.share.others_busy():
            return False
        if self._measurement is None:
            if not self.cost_file.try_lock():
                return False  # another process is measuring: look_for_table takes its table up
            if isinstance(self.cost_file.read(), CostTable):  # measured meanwhile
                self.cost_file.unlock()
                self.look_for_table(every=0)
                return False
            self._measurement = plan_measurement(self.loaded.model, self.loaded.context_length,
                                                 self.engine.vocab_size, self.engine.buckets)
        with cores.share.busy():
            if self._measurement.step():
                return True
        table = self.cost_file.keep_measured(self._measurement, reference=prior.fastest_step())
        self._measurement, self._measure_tries = None, self._measure_tries + 1
        self.cost_file.unlock()
        if table is not None:
            self.engine.sizer.set_cost(table)
        return False

    @property
    def stats(self) -> Stats:
        """Counters of the last generation."""
        return self.engine.stats

    def make_drafter(self, name: str, **params):
        """A drafter for this model (tables tied to a tokenizer are checked against it)."""
        return make_drafter(name, fingerprint=self.fingerprint, target=self.loaded, **params)

    def set_drafter(self, name: str, **params) -> None:
        self.engine.set_drafter(self.make_drafter(name, **params))
        self.drafter_name, self.drafter_params = name, params

    def fresh_drafter(self) -> None:
        """A new drafter that has learned nothing, not even what a drafter keeps on disk (SSD's
        store): the baseline that shows what learning across requests brings."""
        params = dict(self.drafter_params)
        if "persist" in drafter_parameters(self.drafter_name):
            params["persist"] = False
        self.engine.reset_drafter(self.make_drafter(self.drafter_name, **params))

    def reset(self) -> None:
        self.engine.reset()

    def add_eos_tokens(self, tokens: Sequence[str]) -> list[int]:
        """Tokens that end a generation besides the model's own (mlx-lm's --extra-eos-token): each
        a token id (digits are an id first, as in mlx-lm), a token as the vocabulary spells it
        ("<|end|>"), or a text that is one token. Returns their ids; anything else is one line."""
        if not tokens:
            return []
        hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
        vocab = hf.get_vocab()
        ids = []
        for token in tokens:
            if token.isdigit() and int(token) < len(vocab):
                ids.append(int(token))
                continue
            if token in vocab:
                ids.append(vocab[token])
                continue
            encoded = list(hf.encode(token, add_special_tokens=False)) if token else []
            if len(encoded) != 1:
                raise CachebackError(f"{token!r} is not one token of {self.loaded.name}'s vocabulary "
                                     f"({len(encoded)} tokens); an end token is one token, its text or its id")
            ids.append(encoded[0])
        self.engine.set_eos(self.engine.eos_ids | set(ids))
        return ids

    def encode(self, prompt: str | Sequence[dict], chat: bool | None = None, system: str | None = None,
               tools: Sequence[dict] | None = None, template_args: dict | None = None) -> list[int]:
        """Token ids for a prompt: text (through the chat template when chat, the default for
        models that have one) or a list of chat messages; `tools` (OpenAI's function schemas) go
        to the template for models whose template has tool calls (tool_calls.py), and
        `template_args` are its other variables (e.g. enable_thinking)."""
        if isinstance(prompt, str) and not prompt.strip():
            raise CachebackError("empty prompt")
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if chat is None:
            chat = has_template or not isinstance(prompt, str)
        if not chat:
            return list(self.tokenizer.encode(prompt))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return list(self.tokenizer.encode(self.chat_text(messages, system, tools, template_args),
                                          add_special_tokens=False))

    def chat_text(self, messages: Sequence[dict], system: str | None = None, tools: Sequence[dict] | None = None,
                  template_args: dict | None = None) -> str:
        """The chat template's prompt for `messages`, as text (encode's arguments)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise CachebackError(f"model {self.loaded.name} has no chat template; use raw mode")
        messages = list(messages)
        if system is not None and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system}] + messages
        if not messages:
            raise CachebackError("empty prompt")
        extra = dict(template_args or {}) | ({"tools": list(tools)} if tools else {})
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        except (TemplateError, TypeError, ValueError) as e:  # its own checks (roles out of order), or
            raise CachebackError(f"chat template: {e}") from None  # values it cannot render

    def fit(self, prompt_ids: Sequence[int], max_tokens: int) -> tuple[list[int], bool]:
        """The prompt cut from the left to fit the context (truncate_left; a leading BOS stays),
        and whether it was cut."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        ids = list(prompt_ids)
        fitted = truncate_left(ids, self.loaded.context_length, max_tokens, keep_first=bool(ids) and ids[0] == bos)
        return fitted, len(fitted) < len(ids)

    def stream_ids(self, prompt_ids: Sequence[int], max_tokens: int = 256, sampling: SamplingParams = SamplingParams(),
                   context: Sequence[int] = (), truncate: bool = False, stop=None) -> Iterator[tuple[str, list[int]]]:
        """Yield (text piece, tokens) per step; the text pieces join into the full output.
        `context`: token ids beside the prompt the drafter may draft from, one list or several
        (learning.start_request).
        truncate: a prompt too long for the context loses its oldest tokens (default: an error).
        stop: asked between prefill chunks; True ends the prefill there (engine.Interrupted)."""
        if truncate:
            prompt_ids = self.fit(prompt_ids, max_tokens)[0]
        detok = self.tokenizer.detokenizer
        detok.reset()
        self.look_for_table()
        try:
            for tokens in self.engine.generate(prompt_ids, max_tokens, sampling, context, stop=stop):
                for t in tokens:
                    detok.add_token(t)
                yield detok.last_segment, tokens
        finally:
            self.keep_learned()
        detok.finalize()
        tail = detok.last_segment  # (reading it takes it: once)
        if tail:
            yield tail, []

    def stream(self, prompt: str | Sequence[dict], max_tokens: int = 256, chat: bool | None = None,
               system: str | None = None, truncate: bool = False, **sampling) -> Iterator[str]:
        ids = self.encode(prompt, chat=chat, system=system)
        for text, _ in self.stream_ids(ids, max_tokens, SamplingParams(**sampling), truncate=truncate):
            if text:
                yield text

    def generate(self, prompt: str | Sequence[dict], max_tokens: int = 256, **kw) -> str:
        return "".join(self.stream(prompt, max_tokens, **kw))

    def batch(self, lanes: int) -> Batch:
        """The session's batch of `lanes` lanes (batch.py), each with a drafter of this session's
        kind; kept, with the lanes' caches, for the next batch of as many lanes."""
        current = self._batch
        if current is None or current.n != lanes:
            self.reset_batch()
            self._batch = Batch(self.engine, lanes, lambda: self.make_drafter(self.drafter_name, **self.drafter_params))
        return self._batch

    def reset_batch(self) -> None:
        """Forget the batch's lanes: their caches and their drafters."""
        if self._batch is not None:
            self._batch.close()
        self._batch = None

    def generate_ids_batch(self, prompts: Sequence[Sequence[int]], max_tokens: int = 256,
                           sampling: SamplingParams = SamplingParams(), lanes: int | None = None) -> list[Lane]:
        """Every prompt (token ids) to its end, up to `lanes` at a time in one pass (default: all
        of them, at most 8), each joining as another finishes; the lanes in prompt order (their
        tokens, stats and finish_reason)."""
        batch = self.batch(lanes or min(len(prompts), 8))
        with cores.share.busy():
            return batch.run([dict(prompt=p, max_tokens=max_tokens, sampling=sampling) for p in prompts])

    def generate_batch(self, prompts: Sequence[str | Sequence[dict]], max_tokens: int = 256, chat: bool | None = None,
                       system: str | None = None, lanes: int | None = None, **sampling) -> list[str]:
        """The texts of several generations run together (generate_ids_batch)."""
        ids = [self.encode(p, chat=chat, system=system) for p in prompts]
        done = self.generate_ids_batch(ids, max_tokens, SamplingParams(**sampling), lanes)
        return [self.text_of(lane.tokens) for lane in done]

    def text_of(self, tokens: Sequence[int]) -> str:
        """The text of generated tokens, as streaming them gives it (the model's detokenizer)."""
        detok = self.tokenizer.detokenizer
        for t in tokens:
            detok.add_token(t)
        detok.finalize()
        return detok.text


def stream_generate(prompt: str | Sequence[dict], model: str | LoadedModel | None = None,
                    drafter: str = DEFAULT_DRAFTER, max_tokens: int = 256, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int | None = None, chat: bool | None = None,
                    system: str | None = None, **drafter_params) -> Iterator[str]:
    """Stream the text of one generation, piece by piece."""
    session = Session(model, drafter, **drafter_params)
    yield from session.stream(prompt, max_tokens, chat=chat, system=system, temperature=temperature,
                              top_p=top_p, top_k=top_k, seed=seed)


def generate(prompt: str | Sequence[dict], model: str | LoadedModel | None = None,
             drafter: str = DEFAULT_DRAFTER, max_tokens: int = 256, **kw) -> str:
    """The text of one generation (greedy unless temperature > 0)."""
    return "".join(stream_generate(prompt, model, drafter, max_tokens, **kw))

