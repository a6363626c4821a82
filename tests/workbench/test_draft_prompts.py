"""The prompt set `workbench train-draft` learns from: stable where committed heads read it, varied, and apart from
the spec benchmark's prompts."""

import hashlib
import json
import re
from collections import Counter

from workbench import draft_prompts as dp
from workbench.bench import spec


def test_the_first_block_is_still_what_the_committed_heads_learned_from() -> None:
    """The heads' manifests name the set's first N prompts (`--num-prompts`): growing the set must only append."""
    first = dp.prompt_set()[: len(dp._TOPICS) * len(dp._KINDS)]
    assert len(first) == 5526
    assert hashlib.sha256(json.dumps(first).encode()).hexdigest()[:16] == "b4abca82596d7fed"


def test_the_second_block_asks_each_kind_equally_often_of_many_topics() -> None:
    prompts = dp.prompt_set()
    second = prompts[len(dp._TOPICS) * len(dp._KINDS) :]
    assert len(second) == len(dp._MORE_TOPICS) * dp.KINDS_PER_MORE_TOPIC
    kinds = dp._KINDS + dp._MORE_KINDS
    # a kind is its text around the topic: count each prompt's kind by the topic it was made from
    n = dp.KINDS_PER_MORE_TOPIC
    used = Counter(
        kind
        for t, topic in enumerate(dp._MORE_TOPICS)
        for kind in kinds
        if kind.format(topic) in second[n * t : n * t + n]
    )
    assert set(used) == set(kinds) and max(used.values()) - min(used.values()) <= 1
    assert len(set(prompts)) == len(prompts)  # no prompt twice, no topic in both blocks
    assert not set(dp._TOPICS) & set(dp._MORE_TOPICS)


def test_no_prompt_or_topic_of_the_spec_benchmark_is_bundled() -> None:
    """The benchmark measures acceptance on prompts the heads never saw: neither its prompts nor their subjects."""
    prompts = dp.prompt_set()
    assert not set(spec._CHAT) & set(prompts)
    subjects = ("tea", "teacher", "forest", "sky", "programmer", "black hole", "cat", "bees", "honey")
    topics = dp._TOPICS + dp._MORE_TOPICS
    found = [(s, t) for s in subjects for t in topics if re.search(rf"\b{s}\b", t, re.IGNORECASE)]
    assert found == []
