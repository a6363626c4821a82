"""Speculative decoding: proposers (n-gram, draft model, EAGLE, Medusa) behind one interface (proposer.py),
verification by
rejection sampling (engine/sample/rejection_sampler.py), the SpecDecoder that joins them (decoder.py).

PROPOSERS is the one list of methods: EngineConfig validates speculative_config.method against it and the
SpecDecoder imports the named class. A new method is its Proposer subclass and one line here.
"""

# speculative_config.method -> "module:class" of its proposer (imported when an engine uses it)
PROPOSERS: dict[str, str] = {
    "ngram": "engine.spec_decode.ngram_proposer:NgramProposer",
    "draft_model": "engine.spec_decode.draft_model:DraftModelProposer",
    "eagle": "engine.spec_decode.eagle:EagleProposer",
    "medusa": "engine.spec_decode.medusa:MedusaProposer",
}


def method_names() -> str:
    return ", ".join(repr(name) for name in PROPOSERS)
