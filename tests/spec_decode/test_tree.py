"""Draft trees (speculative_token_tree): the shape's validation, greedy output identical to no speculation with
EAGLE and Medusa trees (tiny-llama with trained heads in every scheduler setting, smollm2-135m with its committed
heads), the tree walk keeping the target's distribution for sampled drafts, the accepted path's K/V where a chain's
would be, and the events and statistics a verification leaves."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.spec_decode.tree import SpecTree, walk_tree
from tests.spec_decode.test_eagle_medusa import heads  # noqa: F401 (the trained heads fixture)
from tests.spec_decode.test_spec_decoding import PARAMS, SETTINGS, _prompts, _reference, _settings

TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"  # 7 nodes, 3 deep
K = 3  # the chain depth the reference outputs and settings are sized for


def _tree_spec(method: str, folder: str | None = None, tree: str = TREE) -> dict:
    spec = {"method": method, "num_speculative_tokens": len(SpecTree.parse(tree)), "speculative_token_tree": tree}
    return spec if folder is None else {**spec, "model": folder}


# ---- the shape ----------------------------------------------------------------------------------------------------
def test_the_tree_shape_parents_depths_children_and_levels():
    tree = SpecTree.parse(TREE)
    assert tree.parents == (-1, 0, 0, 0, 1, 1, 2, 4)
    assert tree.depths == (0, 1, 1, 1, 2, 2, 2, 3)
    assert tree.children[0] == (1, 2, 3) and tree.children[1] == (4, 5) and tree.children[7] == ()
    assert tree.levels == ((1, 4), (4, 7), (7, 8))
    assert [tree.branch(i) for i in range(1, 8)] == [0, 1, 2, 0, 1, 0, 0]
    assert tree.path_to(7) == [1, 4, 7]
    assert SpecTree.parse("[(0,), (0, 0)]").is_chain and not tree.is_chain


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ("[(0,), (1, 0)]", "no parent"),
        ("[(0, 0), (0,)]", "breadth first"),
        ("[(1,), (0,)]", "breadth first"),
        ("[(0,), (0,)]", "twice"),
        ("[]", "non-empty"),
        ("[(0,), (-1,)]", ">= 0"),
        ("(0,", "list of tuples"),
        (str([(i,) for i in range(64)]), "at most 63"),
    ],
)
def test_bad_trees_are_refused_by_field(tree, message):
    with pytest.raises(ValueError, match="speculative_token_tree") as info:
        SpecTree.parse(tree)
    assert message in str(info.value)


def test_the_config_checks_the_tree_against_the_method_and_the_number_of_nodes():
    EngineConfig(model="tiny-llama", speculative_config=_tree_spec("eagle"))
    with pytest.raises(ValueError, match="num_speculative_tokens: must be the tree's number of nodes, 7, got 3"):
        EngineConfig(model="tiny-llama", speculative_config={**_tree_spec("eagle"), "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="speculative_token_tree: only for"):
        EngineConfig(model="tiny-llama", speculative_config={**_tree_spec("eagle"), "method": "ngram"})


# ---- greedy exactness -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_with_a_tree_is_identical_to_no_speculation(heads, method, setting):  # noqa: F811
    llm = LLM(
        model="tiny-llama", speculative_config=_tree_spec(method, heads[method]), **_settings("tiny-llama", K)[setting]
    )
    records = []
    llm.engine.subscribe(records.append)
    outs = llm.generate([list(p) for p in _prompts("tiny-llama")], PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == _reference("tiny-llama", setting, K)
    verified = [e for r in records for e in r.of_kind("spec.verified")]
    assert verified and all(e.tree_parents for e in verified)
    # both kinds of verdict ran: a branch other than the best kept, and a rejection before a leaf
    assert any(any(SpecTree.parse(TREE).branch(c) > 0 for c in e.accepted_path) for e in verified)
    assert any(not e.bonus for e in verified)
    assert llm.engine.kv_cache_manager.usage().used == 0


# ---- sampled drafts keep the target's distribution ----------------------------------------------------------------
V = 5
SIGNIFICANCE = 1e-4  # as tests/kernels/test_rejection.py: a correct sampler fails once in 10,000 seeds
SAMPLED_TREE = SpecTree.parse("[(0,), (1,), (0, 0), (0, 1)]")


def _p_value(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's chi-square statistic of counts against a distribution, and its degrees of freedom."""
    expected = probs.double() * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum()), len(probs) - 1


def _tail(statistic: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


def _walks(num: int, seed: int) -> tuple[list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """`num` verifications of SAMPLED_TREE: two children of the root drawn from q, two of the first from q2[its
    token]; the target's p at the root and p2[token] at a node (both far from the drafts')."""
    gen = torch.Generator().manual_seed(seed)
    p, q = (torch.randn(V, generator=gen) * 1.5).softmax(-1), (torch.randn(V, generator=gen) * 1.5).softmax(-1)
    p2, q2 = (torch.randn(V, V, generator=gen) * 1.5).softmax(-1), (torch.randn(V, V, generator=gen) * 1.5).softmax(-1)
    out = []
    for _ in range(num):
        first = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
        second = torch.multinomial(q2[first[0]], 2, replacement=True, generator=gen).tolist()
        drafts = first + second
        target = torch.stack([p, p2[drafts[0]], p2[drafts[1]], p2[drafts[2]], p2[drafts[3]]])
        draft_probs = torch.stack([q, q, q2[drafts[0]], q2[drafts[0]]])
        uniform = torch.rand(4, generator=gen).tolist()
        verdict = walk_tree(SAMPLED_TREE, drafts, target, [0] * 5, draft_probs, uniform, False, gen)
        out.append(verdict.tokens)
    return out, p, p2, q


def test_the_tree_walk_keeps_the_target_distribution_of_sampled_drafts():
    """SpecInfer's sibling-by-sibling rule: the first token is distributed as the root's p (not as q, which the
    drafts follow), and a second one, after an accepted first a, as p2[a]."""
    walks, p, p2, q = _walks(20_000, seed=0)
    firsts = torch.bincount(torch.tensor([w[0] for w in walks]), minlength=V).double()
    assert _tail(*_p_value(firsts, p)) > SIGNIFICANCE
    assert _tail(*_p_value(firsts, q)) < SIGNIFICANCE  # the test can tell the two apart
    statistic, dof = 0.0, 0
    for a in range(V):
        seconds = torch.tensor([w[1] for w in walks if len(w) > 1 and w[0] == a], dtype=torch.long)
        s, d = _p_value(torch.bincount(seconds, minlength=V).double(), p2[a])
        statistic, dof = statistic + s, dof + d
    assert _tail(statistic, dof) > SIGNIFICANCE
    assert sum(len(w) > 1 for w in walks) > 2_000  # many walks went past the root


# ---- the accepted path's K/V, where a chain's would be ----------------------------------------------------------
def _forward(net, caches, tokens: list[int], positions: list[int], first_slot: int, seq_len: int, mask=None):
    """One sequence's new tokens at `positions`, written at consecutive slots from `first_slot` (one block table
    of consecutive blocks), over `seq_len` keys; `mask`: tree attention's rows."""
    from engine.model.attention import AttentionMetadata

    n = len(tokens)
    attn = AttentionMetadata(
        slot_mapping=torch.arange(first_slot, first_slot + n),
        block_tables=torch.arange(caches[0][0].shape[0], dtype=torch.int32)[None],
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        tree_mask=None if mask is None else torch.tensor(mask, dtype=torch.int64),
    )
    return net(torch.tensor(tokens), torch.tensor(positions), attn, caches)


@pytest.mark.parametrize("moved", [True, False])
def test_a_later_step_after_a_tree_attends_as_if_only_the_accepted_path_was_drafted(moved):
    """The target runs a prompt, then the tree (root: the prompt's last token) with the tree mask; the path (1,) ->
    (1, 0) is kept and its K/V moved; the next token's hidden state then equals a run that computed the prompt and
    that path as plain tokens. Without the move (the path's K/V left at their tree slots) it does not."""
    from engine.model.attention import allocate_kv_caches
    from engine.model.loader import resolve_model
    from engine.model.registry import load_model
    from engine.spec_decode.tree import move_kv

    net, _ = load_model(resolve_model("tiny-llama"), torch.float32, torch.device("cpu"))
    tree = SpecTree.parse(TREE)
    prompt = list(_prompts("tiny-llama")[0])
    drafts = [101, 102, 103, 104, 105, 106, 107]
    path = [2, 6]  # (1,) then (1, 0): neither the first branch, so both move
    n = len(prompt)
    with torch.inference_mode():
        caches = allocate_kv_caches(net, 16, 4, torch.float32, torch.device("cpu"))
        _forward(net, caches, prompt[:-1], list(range(n - 1)), 0, n - 1)
        root = n - 1
        positions = [root + d for d in tree.depths]
        tree_hidden = _forward(net, caches, [prompt[-1], *drafts], positions, root, root + 8, tree.masks)
        if moved:
            move_kv(caches, torch.tensor([root + c for c in path]), torch.tensor([root + 1, root + 2]))
        after = _forward(net, caches, [200], [root + 3], root + 3, root + 4)

        chain = allocate_kv_caches(net, 16, 4, torch.float32, torch.device("cpu"))
        path_tokens = [drafts[c - 1] for c in path]
        chain_hidden = _forward(net, chain, prompt + path_tokens, list(range(n + 2)), 0, n + 2)
        expected = _forward(net, chain, [200], [root + 3], root + 3, root + 4)
    # each kept node saw just its ancestors: its state is the chain's
    torch.testing.assert_close(tree_hidden[[0, *path]], chain_hidden[-3:], atol=1e-4, rtol=1e-4)
    if moved:
        torch.testing.assert_close(after, expected, atol=1e-4, rtol=1e-4)
    else:
        assert not torch.allclose(after, expected, atol=1e-2)


# ---- the events, the statistics and the view ------------------------------------------------------------------------
def test_a_trees_verifications_their_statistics_and_the_drawn_tree(heads, tmp_path):  # noqa: F811
    """A greedy and a sampled request with an EAGLE tree: each spec.verified names the tree and a path through it,
    the statistics by depth and by branch add up from the events, the events survive a trace, and the view draws
    the last tree with the path in green."""
    from bokeh.document import Document

    from engine import LLMEngine
    from workbench.trace import TraceWriter, read_trace
    from workbench.views import SpecDecodeView
    from workbench.views.spec import ACCEPTED_COLOR

    tree = SpecTree.parse(TREE)
    engine = LLMEngine(model="tiny-llama", speculative_config=_tree_spec("eagle", heads["eagle"]), seed=0)
    prompts = [list(p) for p in _prompts("tiny-llama")[:2]]
    engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    engine.add_request(prompts[1], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3))
    records = []
    with TraceWriter(tmp_path / "tree.jsonl", engine) as writer:
        engine.subscribe(writer)
        engine.subscribe(records.append)
        while engine.has_unfinished_requests():
            engine.step()
    assert read_trace(tmp_path / "tree.jsonl").records == records
    verified = [e for r in records for e in r.of_kind("spec.verified")]
    assert {e.rule for e in verified} == {"greedy", "sampled"}
    for e in verified:
        n = len(e.draft_token_ids)
        assert e.tree_parents == tree.parents[1 : n + 1]
        assert all(tree.parents[c] == prev for prev, c in zip((0, *e.accepted_path), e.accepted_path))
        assert e.accepted == tuple(c in e.accepted_path for c in range(1, n + 1))
        assert len(e.p_target) == len(e.p_draft) == n
    stats = engine.spec_stats
    assert stats.num_drafts == len(verified)
    assert stats.num_accepted_tokens == sum(len(e.accepted_path) for e in verified)
    by_depth = [sum(len(e.accepted_path) > d for e in verified) for d in range(tree.depth)]
    by_branch = [sum(tree.branch(c) == b for e in verified for c in e.accepted_path) for b in range(3)]
    assert stats.accepted_per_position == by_depth[: len(stats.accepted_per_position)]
    assert stats.accepted_per_branch == by_branch[: len(stats.accepted_per_branch)]
    assert sum(stats.accepted_per_branch) == stats.num_accepted_tokens > 0
    assert stats.drafted_per_position[0] == len(verified) and len(stats.drafted_per_branch) == 3

    view = SpecDecodeView()
    Document().add_root(view.panel.get_root())
    view.extend(records)
    view.flush()
    last = verified[-1]
    nodes = view.tree_nodes.source.data
    assert nodes["node"] == ["root", *(str(c) for c in range(1, len(last.draft_token_ids) + 1)), "emitted"]
    on_path = [nodes["color"][c] == ACCEPTED_COLOR for c in range(1, len(last.draft_token_ids) + 1)]
    assert on_path == list(last.accepted)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_greedy_with_a_tree_on_smollm2_is_identical_to_no_speculation(method):
    """The real model with its committed heads, several prompts: the tree keeps more than a chain's first branch."""
    prompts = [list(p) for p in _prompts("smollm2-135m")][:4]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.token_ids for o in LLM(model="smollm2-135m").generate(prompts, params, use_tqdm=False)]
    llm = LLM(model="smollm2-135m", speculative_config=_tree_spec(method))
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > 0 and len(stats.accepted_per_branch) > 1  # a second-best branch was kept


def test_tree_drafts_take_the_top_children_of_a_greedy_request_and_independent_draws_of_a_sampled_one():
    """What the sibling rule needs of the drafts: a sampled node's children are independent draws from the
    distribution it reports (pairs of siblings checked against the product), mapped from the draft vocabulary to the
    target's; a greedy node's are its best tokens, best first."""
    from engine.model.linear import Linear
    from engine.spec_decode.draft_heads import DraftVocab
    from engine.spec_decode.proposer import DraftRequest, tree_drafts

    tree = SpecTree.parse("[(0,), (1,), (0, 0)]")
    draft_ids = torch.tensor([6, 1, 3, 4, 7])  # a draft vocabulary of 5 of the target's 8 tokens
    vocab = DraftVocab(draft_ids, Linear(4, 8), 8)
    logits = {0: torch.tensor([1.0, 0.2, -0.5, 0.8, 0.0]), 1: torch.tensor([0.0, 1.5, 0.3, -1.0, 0.4])}

    def step(depth, nodes, tokens):
        return logits[depth].repeat(len(nodes), 1)

    gen = torch.Generator().manual_seed(0)
    sampled = [DraftRequest(str(i), [1, 2], [0], 3, 0.7, None) for i in range(8_000)]
    drafts = tree_drafts(sampled, tree, step, vocab, gen)
    root_dist = torch.softmax(logits[0] / 0.7, -1)
    expected = torch.zeros(8).index_copy_(0, draft_ids, root_dist)
    tokens, probs = drafts["0"]
    torch.testing.assert_close(probs[0], expected)  # nodes 1 and 2 were drawn from the root's distribution
    torch.testing.assert_close(probs[1], expected)
    to_draft = {int(t): i for i, t in enumerate(draft_ids)}
    pairs = torch.tensor([to_draft[d[0][0]] * 5 + to_draft[d[0][1]] for d in drafts.values()])
    observed = torch.bincount(pairs, minlength=25).double()
    assert _tail(*_p_value(observed, torch.outer(root_dist, root_dist).flatten())) > SIGNIFICANCE

    greedy = [DraftRequest("g", [1, 2], [0], 3, 0.0, None)]
    tokens, _ = tree_drafts(greedy, tree, step, vocab, gen)["g"]
    assert tokens == [6, 4, 1]  # the root's two best (draft ids 0 and 3), then node 1's best (draft id 1)


def test_a_guided_request_beside_a_tree_verifies_without_drafts(heads):  # noqa: F811
    """A grammar reads drafts as one sequence, which a tree's are not: the guided request gets none (its tokens
    are the plain engine's), while the request beside it verifies trees."""
    from engine import StructuredOutputsParams

    params = [
        SamplingParams(
            temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="(ab|abc){2,6}")
        ),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    ]
    base = LLM(model="tiny-llama")
    prompts = [base.tokenizer.encode("ababcabab abcab ab"), list(_prompts("tiny-llama")[0])]
    ref = base.generate(prompts, params, use_tqdm=False)
    llm = LLM(model="tiny-llama", speculative_config=_tree_spec("eagle", heads["eagle"]))
    records = []
    llm.engine.subscribe(records.append)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    verified = {e.request_id for r in records for e in r.of_kind("spec.verified")}
    assert verified == {outs[1].request_id}
