"""Model manifests: the embedded default model, short aliases, fill-in-the-middle tokens."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=None)
def _read(name: str) -> dict:
    return json.loads(resources.files(__name__).joinpath(name).read_text())


def default_model() -> dict:
    return _read("default.json")


def resolve_alias(name: str) -> str | None:
    """The spec an alias stands for ("default" for the embedded model), or None."""
    return _read("aliases.json").get(name.lower())


def aliases() -> dict[str, str]:
    return dict(_read("aliases.json"))


def fim_tokens(vocab) -> dict | None:
    """The first FIM token set whose prefix/suffix/middle tokens are all in `vocab`."""
    for family, toks in _read("fim.json").items():
        if family.startswith("_"):
            continue
        if all(toks[k] in vocab for k in ("prefix", "suffix", "middle")):
            return {"family": family, **{k: v for k, v in toks.items() if k == "family" or v in vocab}}
    return None
