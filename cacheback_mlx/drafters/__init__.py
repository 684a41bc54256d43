"""Drafter registry: drafters are chosen by name at run time."""

from __future__ import annotations

import importlib
import inspect

from ..errors import CachebackError
from .base import Drafter, NoDrafter

# name -> "module:Class" (imported on first use, so optional dependencies stay optional).
DRAFTERS: dict[str, str] = {
    "auto": "cacheback_mlx.drafters.auto:AutoDrafter",
    "none": "cacheback_mlx.drafters.base:NoDrafter",
    "ngram": "cacheback_mlx.drafters.ngram:NGramDrafter",
    "cacheback": "cacheback_mlx.drafters.cacheback:CachebackDrafter",
    "pld": "cacheback_mlx.drafters.pld:PromptLookupDrafter",
    "rest": "cacheback_mlx.drafters.rest:RestDrafter",
    "ssd": "cacheback_mlx.drafters.ssd:SsdDrafter",
    "card": "cacheback_mlx.drafters.card:CardDrafter",
}


def drafter_names() -> list[str]:
    return list(DRAFTERS)


def _class(name: str):
    if name not in DRAFTERS:
        raise CachebackError(f"unknown drafter {name!r}; known drafters: {', '.join(DRAFTERS)}")
    module, cls = DRAFTERS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise CachebackError(f"drafter {name!r} is not available: {e}") from None


def drafter_parameters(name: str) -> list[str]:
    """The parameters a drafter takes, by name."""
    return list(inspect.signature(_class(name)).parameters)


def make_drafter(name: str | Drafter, fingerprint: str | None = None, target=None, **params) -> Drafter:
    """A new drafter by name, with its parameters (e.g. make_drafter("ngram", max_draft=6)).

    fingerprint: the model tokenizer's (tokenizer.vocab_fingerprint), passed on to drafters whose
    offline tables are tied to one tokenizer (those that take a `fingerprint` argument).
    target: the target model as loaded (loader.LoadedModel), passed on to drafters that run a draft
    model of their own from it (those that take a `target` argument: CARD's self:N, its dtype)."""
    if isinstance(name, Drafter):
        return name
    klass = _class(name)
    if fingerprint is not None and "fingerprint" in inspect.signature(klass).parameters:
        params.setdefault("fingerprint", fingerprint)
    if target is not None and "target" in inspect.signature(klass).parameters:
        params.setdefault("target", target)
    try:
        return klass(**params)
    except (TypeError, ValueError) as e:
        raise CachebackError(f"bad parameters for drafter {name!r}: {e}") from None


__all__ = ["Drafter", "NoDrafter", "DRAFTERS", "drafter_names", "drafter_parameters", "make_drafter"]
