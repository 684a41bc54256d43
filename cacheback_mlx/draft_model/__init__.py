"""A small draft model that the CARD drafter (drafters/card.py) runs, with the engine's caches and
tree passes (kvcache, positions, verify): the one place a drafter's work touches a model.

runner.py   load_draft() and DraftRunner: the draft model grows CARD's token tree (drafters/card_tree.py)
worker.py   the draft process that runs a DraftRunner beside the target (DraftProcess: its handle)

Drafters themselves see token ids only (drafters/base.py); card.py reaches this package lazily.
"""
