"""The drafter interface. Drafters see token ids only: no drafter module imports the engine or a
model (kvcache, positions, verify, engine, lm, loader).

The one exception is CARD, whose drafter runs a small draft model: that model lives in its own
package, cacheback_mlx/draft_model/ (the draft model, with the engine's caches and tree passes, and
the process it runs in), and drafters/card.py is the only drafter that reaches it."""

from __future__ import annotations

from typing import Sequence

from ..tree import DraftTree


class Drafter:
    """Proposes a DraftTree from the token history and learns from the tokens that were accepted.

    The engine calls, in order:
      learn(context_tokens)              optionally, text beside the sequence (an editor's code
                                         below the cursor): draft from it, it is not history
      observe(prompt_tokens)             once per request/turn with the new prompt tokens
      propose(history, budget, max_branching) -> tree
                                         each step; history[-1] is the root (last accepted token);
                                         max_branching=1 asks for a chain (models whose state
                                         cannot branch, e.g. recurrent layers); None: any tree
      catch_up()                         while that step's pass runs (the device busy): work left
                                         from the last observe() that this proposal did not need
      observe(accepted_tokens)           after each step, with the tokens just accepted
      recycle(picks)                     then, the model's pick at every row of that step's pass,
                                         accepted or not, and its `alternatives` next-best tokens
                                         there: (the row's token, (pick, next best, ...))
      end_request()                      when the generation ends
      stats() -> dict                    what the drafter wants reported (`generate --stats`)
      close()                            when the drafter is replaced (frees processes it runs)
    State persists across requests and turns until reset(), so later turns can get faster.
    """

    name = "base"
    alternatives = 0  # how many of the model's next-best tokens at each row recycle() hears beside its pick

    def reset(self) -> None:
        """Forget everything learned from earlier tokens (a new conversation)."""

    def observe(self, tokens: Sequence[int]) -> None:
        """Learn from tokens appended to the sequence (prompt tokens or accepted tokens)."""

    def catch_up(self) -> None:
        """Finish what the last observe() left for later (auto: the scorer's learning), while the
        model runs a pass: on a GPU the host would only wait there. observe() may leave work only
        where proposing before it is done still drafts well (auto's next proposal is scored one
        pass late); a drafter that gets no call does it at its next observe(), so replays that
        never call this draft the same. Default: nothing left."""

    def recycle(self, picks: Sequence[tuple[int, tuple[int, ...]]]) -> None:
        """What the model picked at each row of the last pass, the rows of drafts it rejected
        included: (the row's token, (the model's token after it there, then up to `alternatives`
        of its next-best tokens there, best first)). Default: ignored."""

    def learn(self, tokens: Sequence[int]) -> None:
        """Learn from text that is not part of the sequence (e.g. the code below an editor's
        cursor): it may be drafted from, but it does not extend the history. Default: ignored."""

    def propose(self, history: Sequence[int], budget: int, max_branching: int | None = None) -> DraftTree:
        """A tree of at most `budget` draft tokens to follow history[-1], with at most
        `max_branching` children per node when that is set."""
        return DraftTree.empty()

    def end_request(self) -> None:
        """A generation finished (drafters that learn across requests store it here)."""

    def stats(self) -> dict:
        """Drafter-specific figures worth reporting (e.g. a datastore's size); none by default."""
        return {}

    def close(self) -> None:
        """Release what the drafter holds outside Python objects (e.g. a draft process)."""


class NoDrafter(Drafter):
    """Plain decoding: never drafts, so every step is a single-token step."""

    name = "none"
