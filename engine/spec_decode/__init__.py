"""Speculative decoding: proposers (n-gram, draft model, EAGLE, Medusa) behind one interface (proposer.py),
verification by rejection sampling (engine/sample/rejection_sampler.py), the SpecDecoder that joins them (decoder.py).

The method names are EngineConfig's (SpeculativeMethod, engine/config.py: the config checks speculative_config.method
without importing this package); PROPOSERS registers each one's class, which the SpecDecoder imports. A new method is
its Proposer subclass, its name there and one line here (tests/test_arg_utils.py checks the two agree).
"""

# speculative_config.method -> "module:class" of its proposer (imported when an engine uses it)
PROPOSERS: dict[str, str] = {
    "ngram": "engine.spec_decode.ngram_proposer:NgramProposer",
    "draft_model": "engine.spec_decode.draft_model:DraftModelProposer",
    "eagle": "engine.spec_decode.eagle:EagleProposer",
    "medusa": "engine.spec_decode.medusa:MedusaProposer",
    "eagle3": "engine.spec_decode.eagle3:Eagle3Proposer",
}


def method_names() -> str:
    return ", ".join(repr(name) for name in PROPOSERS)
