"""`workbench train-draft`: an EAGLE, EAGLE-3 or Medusa head for a target model, self-distilled on a CPU, no
outside data.

1. The target writes the data: it answers a bundled, varied prompt set (topics x kinds of request, through its
   chat template), greedily by default (the spec benchmark decodes greedily: the head learns the distribution it
   will see; `temperature` samples, seeded). The answers are kept in the cache by prompt and reused by later runs
   (a longer prompt set generates only its new prompts' answers).
2. The engine's own model reads each answer once more and gives its final hidden state at every position (exactly
   what the runner hands a proposer) and its greedy next token there, both kept beside the answers (for EAGLE-3,
   in a file of their own, also the residual stream entering the three layers its proposer reads).
3. The draft vocabulary is the tokens the target wrote most (the head reads out only those rows of the LM head).
4. Training, with a progress bar. EAGLE: the head reads (h_t, x_{t+1}) and learns h_{t+1} (smooth L1) and the
   target's next-token distribution read from its prediction (cross-entropy, weight `ce_weight`: 0.1 by
   default, as EAGLE's paper),
   unrolled over `unroll` draft steps as drafting chains it (EAGLE-3's training-time test): step j reads step
   j-1's predicted state and the next token, attending as the paged cache would. Medusa: head i reads h_t and
   learns the target's distribution at t+1+i, i.e. of token x_{t+2+i} (weights 0.8^i). EAGLE-3: the head
   reads fc(the three layers' states at t) and x_{t+1} and learns only the target's distribution at t+1 through
   its own LM head (started as the target's rows), unrolled as EAGLE's, each step reading the step before's
   pre-norm state (weights 0.8^j).
   After each epoch, the held-out acceptance estimate per draft position: how often the draft (argmax) equals the
   target's greedy token on held-out prompts' answers, the features being the target's own.
5. The head folder (fp16 safetensors, EAGLE-3's in vLLM's checkpoint layout; config, manifest with the command,
   seed, data, steps, loss and held-out acceptance), then the acceptance the engine really gets with it on held-out
   prompts (greedy).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.model.attention import AttentionMetadata, allocate_kv_caches
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import resolve_model
from engine.model.registry import load_model
from engine.spec_decode.draft_heads import DRAFT_IDS, save_head, trained_heads_dir
from engine.spec_decode.eagle import EagleHead
from engine.spec_decode.eagle3 import Eagle3Head, checkpoint_tensors
from engine.spec_decode.medusa import MedusaHeads
from workbench.draft_prompts import prompt_set

METHODS = ("eagle", "medusa", "eagle3")


@dataclass
class Sample:
    """One answer of the target: its tokens (prompt and answer), where the answer starts, the target's final
    hidden state at every position [T, H] and its greedy next token at every position [T]."""

    token_ids: list[int]
    prompt_len: int
    hidden: torch.Tensor
    greedy: torch.Tensor
    aux: torch.Tensor | None = None  # EAGLE-3's: the three target layers' states [T, 3H] (bf16 to halve the memory)

    @property
    def features(self) -> torch.Tensor:
        """What a trainer reads at each position: the final state, then the aux states where kept [T, H (+3H)]."""
        return self.hidden if self.aux is None else torch.cat((self.hidden, self.aux.float()), dim=-1)


def generate_answers(
    model: str, prompts: list[str], max_tokens: int, temperature: float, seeds: list[int]
) -> list[tuple[list[int], int]]:
    """The target's answers through its chat template, prompt i's drawn with seeds[i]: (prompt + answer token ids,
    prompt length) each."""
    # at most 64 at once: every answer's KV fits the default cache, so none is preempted and recomputed
    llm = LLM(model=model, seed=seeds[0], max_num_seqs=64)
    tok = llm.tokenizer
    if getattr(tok, "chat_template", None):
        ids = [
            list(
                tok.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for p in prompts
        ]
    else:
        ids = [tok.encode(p) for p in prompts]
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=s) for s in seeds]
    outs = llm.generate(ids, params, use_tqdm=True)
    return [(p + list(o.token_ids), len(p)) for p, o in zip(ids, outs)]


def cached_answers(
    model: str, prompts: list[str], max_tokens: int, temperature: float, seed: int, log: Callable[[str], None]
) -> tuple[list[tuple[list[int], int]], list[str], Path]:
    """The target's answers to `prompts` (prompt i drawn with seed + i), kept in the cache by prompt (and by its
    seed when sampling): a run reuses every answer an earlier run with these settings made, so a longer prompt set
    generates only its new prompts' answers. Returns the answers, their cache keys and the cache file."""
    path = trained_heads_dir() / model / f"answers-{max_tokens}-{temperature}-{seed}.json"
    known = json.loads(path.read_text()) if path.is_file() else {}
    keys = [p if temperature == 0 else f"{seed + i}|{p}" for i, p in enumerate(prompts)]
    missing = [i for i, key in enumerate(keys) if key not in known]
    log(
        f"{len(prompts) - len(missing)} answers from earlier runs ({path}), {len(missing)} to generate with {model} "
        f"(temperature {temperature}, up to {max_tokens} tokens)"
    )
    if missing:
        made = generate_answers(
            model, [prompts[i] for i in missing], max_tokens, temperature, [seed + i for i in missing]
        )
        known.update({keys[i]: list(answer) for i, answer in zip(missing, made)})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known))
    return [tuple(known[key]) for key in keys], keys, path


@torch.inference_mode()
def target_features(
    model: str, sequences: list[tuple[list[int], int]], batch_tokens: int = 4096, aux: bool = False
) -> tuple[list[Sample], LlamaForCausalLM]:
    """The engine's model over each whole sequence (prefill, several per forward): the final hidden states the
    runner would hand a proposer, and the greedy token at each position."""
    net, _ = load_model(resolve_model(model), torch.float32, torch.device("cpu"))
    if aux:  # EAGLE-3's: the layers its proposer asks the engine's target for
        net.set_aux_hidden_state_layers(net.get_eagle3_aux_hidden_state_layers())
    block = 16
    longest = max(len(t) for t, _ in sequences)
    caches = allocate_kv_caches(
        net, -(-max(batch_tokens, longest) // block) + len(sequences), block, torch.float32, torch.device("cpu")
    )
    samples: list[Sample] = []
    i = 0
    while i < len(sequences):
        group = [sequences[i]]
        while (
            i + len(group) < len(sequences)
            and sum(len(t) for t, _ in group) + len(sequences[i + len(group)][0]) <= batch_tokens
        ):
            group.append(sequences[i + len(group)])
        lens = [len(t) for t, _ in group]
        blocks = [-(-n // block) for n in lens]
        first = [sum(blocks[:j]) for j in range(len(group))]
        tables = torch.zeros(len(group), max(blocks), dtype=torch.int32)
        for j, (b0, nb) in enumerate(zip(first, blocks)):
            tables[j, :nb] = torch.arange(b0, b0 + nb)
        slots = torch.cat([torch.arange(n) + b0 * block for n, b0 in zip(lens, first)])
        attn = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            query_start_loc=torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        )
        ids = torch.tensor([t for toks, _ in group for t in toks])
        positions = torch.cat([torch.arange(n) for n in lens])
        hidden = net(ids, positions, attn, caches)
        greedy = torch.cat([net.compute_logits(rows).argmax(-1) for rows in hidden.split(512)])
        kept = net.model.aux_hidden_states if aux else None
        # bfloat16 to halve the memory (4.9 GB for the 5,526 answers): the states entering deep layers reach 24,832
        # on smollm2, within float16's range too, but with a third of its headroom; non-finite states are refused
        if kept is not None and not torch.isfinite(kept).all():
            raise ValueError(f"the target's hidden states for EAGLE-3 are not finite at prompts {i}..{i + len(group)}")
        aux_rows = kept.bfloat16().split(lens) if kept is not None else [None] * len(lens)
        for (toks, plen), h, g, a in zip(group, hidden.split(lens), greedy.split(lens), aux_rows):
            samples.append(Sample(toks, plen, h.clone(), g.clone(), None if a is None else a.clone()))
        i += len(group)
    return samples, net


def cached_features(
    model: str, sequences: list[tuple[list[int], int]], keys: list[str], path: Path, aux: bool = False
) -> tuple[list[Sample], LlamaForCausalLM]:
    """`target_features`, kept by answer key beside the cached answers they were read from: they cost minutes on
    smollm2, and a second method's run (or another training setting, or a longer prompt set) reads the same ones."""
    known = torch.load(path) if path.is_file() else {}
    missing = [i for i, key in enumerate(keys) if key not in known]
    if missing:
        samples, net = target_features(model, [sequences[i] for i in missing], aux=aux)
        known.update({keys[i]: (s.hidden, s.greedy, s.aux) for i, s in zip(missing, samples)})
        torch.save(known, path)
    else:
        net, _ = load_model(resolve_model(model), torch.float32, torch.device("cpu"))
    return [Sample(toks, plen, *known[key]) for (toks, plen), key in zip(sequences, keys)], net


def draft_vocabulary(samples: list[Sample], size: int) -> tuple[torch.Tensor, float]:
    """The `size` tokens the target wrote or would write greedily most often, and the share of its answers'
    greedy tokens they cover."""
    counts: Counter[int] = Counter()
    for s in samples:
        counts.update(s.token_ids[s.prompt_len :])
        counts.update(s.greedy[s.prompt_len - 1 :].tolist())
    ids = sorted(t for t, _ in counts.most_common(size))
    chosen = set(ids)
    greedy = [t for s in samples for t in s.greedy[s.prompt_len - 1 :].tolist()]
    return torch.tensor(ids, dtype=torch.long), sum(t in chosen for t in greedy) / max(1, len(greedy))


def eagle_config(target_config: Any, intermediate_size: int, draft_vocab_size: int, target: str) -> dict:
    """A head's config.json: the target's attention shape, its own MLP width."""
    head_dim = (
        getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    )
    return {
        "method": "eagle",
        "architectures": ["EagleHead"],
        "target": target,
        "hidden_size": target_config.hidden_size,
        "intermediate_size": intermediate_size,
        "num_attention_heads": target_config.num_attention_heads,
        "num_key_value_heads": target_config.num_key_value_heads,
        "head_dim": head_dim,
        "rms_norm_eps": target_config.rms_norm_eps,
        "rope_parameters": dict(getattr(target_config, "rope_parameters", None) or {}),
        "max_position_embeddings": target_config.max_position_embeddings,
        "vocab_size": target_config.vocab_size,
        "draft_vocab_size": draft_vocab_size,
    }


def eagle3_config(target_config: Any, intermediate_size: int, draft_vocab_size: int, target: str) -> dict:
    """An EAGLE-3 head's config.json as vLLM reads one (a Llama config with ``LlamaForCausalLMEagle3``,
    ``draft_vocab_size`` and ``target_hidden_size``; rope_theta beside rope_parameters for older transformers),
    with our method and target."""
    config = eagle_config(target_config, intermediate_size, draft_vocab_size, target)
    return {
        **config,
        "method": "eagle3",
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "target_hidden_size": target_config.hidden_size,
        "tie_word_embeddings": False,
        "rope_theta": config["rope_parameters"].get("rope_theta"),
        "torch_dtype": "float16",
    }


def medusa_config(
    target_config: Any, num_heads: int, draft_vocab_size: int, target: str, num_hidden_layers: int = 1
) -> dict:
    return {
        "method": "medusa",
        "architectures": ["MedusaModel"],
        "target": target,
        "hidden_size": target_config.hidden_size,
        "num_heads": num_heads,
        "num_hidden_layers": num_hidden_layers,
        "vocab_size": target_config.vocab_size,
        "draft_vocab_size": draft_vocab_size,
    }


def new_head(config: dict, seed: int) -> EagleHead | MedusaHeads | Eagle3Head:
    """A freshly initialised head of the config's method (seeded): EAGLE's linear weights ~ N(0, 1/fan_in) with
    fc starting near the target's own state, Medusa's blocks at zero (each head starts as the LM head's guess)."""
    torch.manual_seed(seed)
    if config["method"] == "medusa":
        return MedusaHeads(config["hidden_size"], config["num_heads"], config["num_hidden_layers"])
    if config["method"] == "eagle3":
        return _new_eagle3_head(config)
    head = EagleHead(EagleHead.llama_config(config))
    for name, p in head.named_parameters():
        if "layernorm" in name:
            continue
        torch.nn.init.normal_(p, std=p.shape[1] ** -0.5 * (0.5 if name != "fc" else 0.1))
    with torch.no_grad():  # fc starts as "the target's state": the layer refines it
        hidden = config["hidden_size"]
        head.fc[:, hidden:] += torch.eye(hidden)
    return head


def _new_eagle3_head(config: dict) -> Eagle3Head:
    """fc starts as "the last aux layer's state" (the residual stream three layers before the end, close to what
    the target reads out) and the layer adds little to it at first; `init_readout` starts the readout as the
    target's."""
    head = Eagle3Head(Eagle3Head.llama_config(config), config["draft_vocab_size"])
    small = ("fc", "layers.0.o_proj", "layers.0.down_proj")  # what writes the residual stream
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=p.shape[1] ** -0.5 * (0.1 if name in small else 0.5))
    with torch.no_grad():
        hidden = config["hidden_size"]
        head.fc[:, -hidden:] += torch.eye(hidden)
    return head


def init_readout(head: Eagle3Head, net: LlamaForCausalLM, draft_ids: torch.Tensor) -> Eagle3Head:
    """An EAGLE-3 head's final norm and LM head start as the target's (its rows of the draft vocabulary)."""
    with torch.no_grad():
        head.norm.copy_(net.model.norm.weight.float())
        head.lm_head.copy_(net.lm_head.weight[draft_ids].float())
    return head


def head_tensors(head: torch.nn.Module, draft_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a head folder holds: its weights and its draft vocabulary (EAGLE-3: under vLLM's names)."""
    if isinstance(head, Eagle3Head):
        return checkpoint_tensors(head, draft_ids, head.config.vocab_size)
    return {**{k: v.detach().clone() for k, v in head.state_dict().items()}, DRAFT_IDS: draft_ids}


# ---- training -----------------------------------------------------------------------------------------------------
def _batches(samples: list[Sample], batch_size: int, max_len: int, rng: random.Random | None):
    """Batches of samples cut to `max_len`, padded: tokens [B, T], hidden [B, T, H], mask [B, T] (real rows)."""
    order = list(range(len(samples)))
    if rng is not None:
        rng.shuffle(order)
    for i in range(0, len(order), batch_size):
        group = [samples[j] for j in order[i : i + batch_size]]
        t = min(max_len, max(len(s.token_ids) for s in group))
        tokens = torch.zeros(len(group), t, dtype=torch.long)
        hidden = torch.zeros(len(group), t, group[0].features.shape[1])
        mask = torch.zeros(len(group), t, dtype=torch.bool)
        for b, s in enumerate(group):
            n = min(t, len(s.token_ids))
            tokens[b, :n] = torch.tensor(s.token_ids[:n])
            hidden[b, :n] = s.features[:n]
            mask[b, :n] = True
        yield tokens, hidden, mask


class UnrolledAttention:
    """Owns the keys and values of the EAGLE draft steps unrolled so far, so that each step attends as drafting
    does: step j's query at entry t sees step 0's entries up to t (the target-state entries drafting finds in its
    cache) and steps 1..j's entries at t (what the chain itself wrote there), EAGLE-3's training-time test.
    Step 0 alone is plain causal attention."""

    def __init__(self, batch_size: int, seq_len: int, scale: float) -> None:
        self.b, self.t, self.scale = batch_size, seq_len, scale
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def split(x: torch.Tensor) -> torch.Tensor:  # [B*T, heads, D] -> [B, heads, T, D]
            return x.reshape(self.b, self.t, x.shape[1], x.shape[2]).transpose(1, 2)

        group = q.shape[1] // k.shape[1]
        q = split(q)
        self.keys.append(split(k).repeat_interleave(group, dim=1))
        self.values.append(split(v).repeat_interleave(group, dim=1))
        causal = (q @ self.keys[0].transpose(-1, -2) * self.scale).masked_fill(self.future, float("-inf"))
        own = [(q * key).sum(-1, keepdim=True) * self.scale for key in self.keys[1:]]
        w = torch.cat([causal, *own], dim=-1).softmax(-1)
        out = w[..., : self.t] @ self.values[0]
        for j, value in enumerate(self.values[1:]):
            out = out + w[..., self.t + j : self.t + j + 1] * value
        return out.transpose(1, 2).reshape(self.b * self.t, -1, q.shape[-1])


class Trainer:
    """Owns one head's training: the target's embedding and draft-vocabulary LM head rows (frozen), the loss of the
    head's method (EAGLE: `steps` draft steps unrolled, feature regression plus `ce_weight` x cross-entropy), and
    its held-out acceptance estimate."""

    def __init__(
        self,
        head: EagleHead | MedusaHeads | Eagle3Head,
        method: str,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        draft_ids: torch.Tensor,
        steps: int = 1,
        ce_weight: float = 0.1,
    ) -> None:
        if steps < 1:
            raise ValueError(f"unroll: must be at least 1, got {steps}")
        if ce_weight < 0:
            raise ValueError(f"ce_weight: must be at least 0, got {ce_weight}")
        self.head, self.method = head, method
        self.embed = embed
        self.readout = lm_head[draft_ids].float()  # [V_draft, H]
        self.draft_ids = draft_ids
        self.steps, self.ce_weight = steps, ce_weight

    def logits(self, pred: torch.Tensor) -> torch.Tensor:
        """A predicted state's logits over the draft vocabulary: read by the target's LM head."""
        return pred @ self.readout.T

    def final_states(self, features: torch.Tensor) -> torch.Tensor:
        """The target's final states among a batch's features (whose distribution the head learns)."""
        return features

    def _eagle(self, head: EagleHead, tokens: torch.Tensor, hidden: torch.Tensor, noise: float) -> list[torch.Tensor]:
        """Predicted states of each unrolled draft step j, [B, T-1, H] each: entry t reads the step before's
        prediction at t (step 0: the target's h_t) and token x_{t+1+j}, at position t+j, and should match
        h_{t+1+j}. Entries past the sequence read token 0 and are masked out by the loss."""
        b, t = tokens.shape[0], tokens.shape[1] - 1
        h = hidden[:, :-1]
        if noise:  # EAGLE's feature noise: later draft steps read the head's own, imperfect states
            h = h + noise * torch.randn_like(h) * h.pow(2).mean(-1, keepdim=True).sqrt()
        padded = F.pad(tokens, (0, self.steps - 1))
        attend = UnrolledAttention(b, t, head.shape.head_dim**-0.5)
        preds = []
        for j in range(self.steps):
            embeds = F.embedding(padded[:, 1 + j : 1 + j + t], self.embed)
            positions = (torch.arange(t) + j).repeat(b)
            h = head(embeds.reshape(b * t, -1), h.reshape(b * t, -1), positions, attend).view(b, t, -1)
            preds.append(h)
        return preds

    def predictions(self, tokens: torch.Tensor, hidden: torch.Tensor, noise: float = 0.0) -> list[torch.Tensor]:
        """Per draft position i, the head's predicted states aligned so that entry t should match target's state
        at t+1+i: EAGLE one per unrolled step; Medusa one per head."""
        if isinstance(self.head, MedusaHeads):  # new_head builds the head of the config's method
            return list(self.head(hidden.flatten(0, 1)).view(len(self.head.blocks), *hidden.shape))
        assert isinstance(self.head, EagleHead), "EAGLE-3's trainer makes its own predictions"
        return self._eagle(self.head, tokens, hidden, noise)

    def loss(self, tokens: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor, noise: float) -> torch.Tensor:
        total = torch.zeros(())
        with torch.no_grad():  # the target's distribution at every position, once for all draft positions
            target_probs = F.softmax(self.final_states(hidden)[:, 1:] @ self.readout.T, dim=-1)
        for i, pred in enumerate(self.predictions(tokens, hidden, noise)):
            t = hidden.shape[1] - 1 - i  # positions whose target state t+1+i exists
            if t < 1:
                break
            pred, want = pred[:, :t], hidden[:, 1 + i : 1 + i + t]
            valid = mask[:, 1 + i : 1 + i + t]
            soft = target_probs[:, i : i + t]
            ce = -(soft * F.log_softmax(self.logits(pred), dim=-1)).sum(-1)
            if self.method == "eagle":
                reg = F.smooth_l1_loss(pred, want, reduction="none").mean(-1)
                total = total + ((reg + self.ce_weight * ce) * valid).sum() / valid.sum()
            else:
                total = total + 0.8**i * (ce * valid).sum() / valid.sum()
        return total

    @torch.no_grad()
    def acceptance(self, samples: list[Sample], max_len: int) -> list[float]:
        """Per draft position, how often the head's argmax equals the target's greedy token, over the answers'
        positions (the first draft position is the estimate the manifest keeps)."""
        hits: list[int] = []
        seen: list[int] = []
        for s in samples:
            tokens = torch.tensor(s.token_ids[:max_len])[None]
            hidden = s.features[:max_len][None]
            for i, pred in enumerate(self.predictions(tokens, hidden)):
                # the state at t predicts the token the target writes after position t+1+i
                lo, hi = s.prompt_len - 1, tokens.shape[1] - 1 - i
                if hi <= lo:
                    continue
                drafted = self.draft_ids[self.logits(pred[0, lo:hi]).argmax(-1)]
                want = s.greedy[1 + i + lo : 1 + i + hi]
                while len(hits) <= i:
                    hits.append(0)
                    seen.append(0)
                hits[i] += int((drafted == want).sum())
                seen[i] += hi - lo
        return [h / n for h, n in zip(hits, seen)]


class Eagle3Trainer(Trainer):
    """Trains an EAGLE-3 head (EAGLE-3's recipe): it reads the target's fused aux states and learns only the
    target's next-token distribution over the draft vocabulary, through its own LM head (no state to imitate),
    unrolled over `steps` draft steps that each read the step before's pre-norm state (training-time test), the
    loss of step j weighted 0.8^j. A batch's features are the final states, then the aux states."""

    def __init__(
        self, head: Eagle3Head, embed: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor, steps: int = 1
    ) -> None:
        super().__init__(head, "eagle3", embed, lm_head, draft_ids, steps)
        self.eagle3 = head
        self.hidden_size = head.config.hidden_size

    def logits(self, pred: torch.Tensor) -> torch.Tensor:
        return pred @ self.eagle3.lm_head.T

    def final_states(self, features: torch.Tensor) -> torch.Tensor:
        return features[..., : self.hidden_size]

    def predictions(self, tokens: torch.Tensor, hidden: torch.Tensor, noise: float = 0.0) -> list[torch.Tensor]:
        """The normed states of each unrolled draft step j, [B, T-1, H] each: entry t reads token x_{t+1+j} at
        position t+j and (step 0) the fused aux states at t, (later) step j-1's pre-norm state at t; its readout
        should match the target's distribution at t+1+j."""
        head, b, t = self.eagle3, tokens.shape[0], tokens.shape[1] - 1
        state = head.combine(hidden[:, :-1, self.hidden_size :].reshape(b * t, -1))
        if noise:  # as EAGLE's feature noise: later draft steps read the head's own, imperfect states
            # its scale is a constant: through sqrt, a padded row's zero state had an infinite gradient (0 * inf: NaN,
            # the NaN loss of every EAGLE-3 training on real answers, whose batches are padded)
            state = state + noise * torch.randn_like(state) * state.detach().pow(2).mean(-1, keepdim=True).sqrt()
        padded = F.pad(tokens, (0, self.steps - 1))
        attend = UnrolledAttention(b, t, head.shape.head_dim**-0.5)
        preds = []
        for j in range(self.steps):
            embeds = F.embedding(padded[:, 1 + j : 1 + j + t], self.embed).reshape(b * t, -1)
            normed, state = head(embeds, state, (torch.arange(t) + j).repeat(b), attend)
            preds.append(normed.view(b, t, -1))
        return preds


def train(
    trainer: Trainer,
    data: list[Sample],
    held_out: list[Sample],
    epochs: int,
    batch_size: int,
    max_len: int,
    lr: float,
    seed: int,
    noise: float = 0.1,
    log: Callable[[str], None] = print,
    progress: bool = True,
) -> dict[str, Any]:
    """AdamW with a linear warm-up and cosine decay; the held-out acceptance before training and after each epoch."""
    from tqdm import tqdm

    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = [p for p in trainer.head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps_per_epoch = -(-len(data) // batch_size)
    total = epochs * steps_per_epoch
    warmup = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, total))))
    )
    history: dict[str, Any] = {"untrained": trainer.acceptance(held_out, max_len), "epochs": []}
    log(f"held-out acceptance before training: {_fmt(history['untrained'])}")
    step, t0 = 0, time.perf_counter()
    for epoch in range(epochs):
        bar = tqdm(
            _batches(data, batch_size, max_len, rng),
            total=steps_per_epoch,
            desc=f"epoch {epoch + 1}/{epochs}",
            disable=not progress,
            file=sys.stderr,
        )
        losses = []
        for tokens, hidden, mask in bar:
            loss = trainer.loss(tokens, hidden, mask, noise)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        acc = trainer.acceptance(held_out, max_len)
        history["epochs"].append({"epoch": epoch + 1, "loss": sum(losses) / len(losses), "held_out_acceptance": acc})
        log(f"epoch {epoch + 1}: loss {history['epochs'][-1]['loss']:.4f}, held-out acceptance {_fmt(acc)}")
    history.update(steps=step, train_seconds=time.perf_counter() - t0)
    return history


def _fmt(acc: list[float]) -> str:
    return " ".join(f"{a:.1%}" for a in acc)


def engine_acceptance(
    model: str, method: str, folder: Path, prompts: list[str], k: int, max_tokens: int, seed: int
) -> dict[str, float]:
    """The acceptance the engine gets with the head on `prompts` (greedy, chat template)."""
    llm = LLM(
        model=model, seed=seed, speculative_config={"method": method, "model": str(folder), "num_speculative_tokens": k}
    )
    tok = llm.tokenizer
    ids = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        if getattr(tok, "chat_template", None)
        else tok.encode(p)
        for p in prompts
    ]
    llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    s = llm.engine.spec_stats
    return {
        "acceptance_rate": s.acceptance_rate,
        "mean_acceptance_length": s.mean_acceptance_length,
        "num_speculative_tokens": k,
    }


def train_draft(
    method: str,
    model: str = "smollm2-135m",
    out: str | None = None,
    num_prompts: int | None = None,
    max_tokens: int = 128,
    temperature: float = 0.0,
    epochs: int = 4,
    batch_size: int = 8,
    max_len: int = 256,
    lr: float = 2e-3,
    seed: int = 0,
    draft_vocab_size: int = 4096,
    intermediate_size: int = 768,
    num_heads: int = 4,
    num_hidden_layers: int = 1,
    k: int = 4,
    check_prompts: int = 8,
    unroll: int = 3,
    ce_weight: float = 0.1,
    command: str = "",
    log: Callable[[str], None] = print,
    progress: bool = True,
) -> dict[str, Any]:
    """Self-distil a head of `method` for `model` and write its folder (default: the cache's
    draft_heads/<model>/<method>); returns the manifest. `check_prompts` held-out prompts then run through the
    engine with the head (0: skip that check, which costs minutes on smollm2)."""
    if method not in METHODS:
        raise ValueError(f"method: must be one of {', '.join(METHODS)}, got {method!r}")
    t_start = time.perf_counter()
    prompts = prompt_set()[:num_prompts]
    held = [p for i, p in enumerate(prompts) if i % 10 == 9]
    t0 = time.perf_counter()
    sequences, keys, cached = cached_answers(model, prompts, max_tokens, temperature, seed, log)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    eagle3 = method == "eagle3"  # its features keep the three aux layers' states too, in a file of their own
    samples, net = cached_features(
        model, sequences, keys, cached.with_suffix(".eagle3.pt" if eagle3 else ".pt"), eagle3
    )
    feat_s = time.perf_counter() - t0
    train_set = [s for i, s in enumerate(samples) if i % 10 != 9]
    held_set = [s for i, s in enumerate(samples) if i % 10 == 9]
    draft_ids, coverage = draft_vocabulary(train_set, draft_vocab_size)
    log(
        f"{sum(len(s.token_ids) - s.prompt_len for s in samples)} answer tokens ({gen_s:.0f} s), features "
        f"({feat_s:.0f} s); draft vocabulary {len(draft_ids)} tokens covering {coverage:.1%} of greedy tokens"
    )
    if method == "medusa":
        config = medusa_config(net.config, num_heads, len(draft_ids), model, num_hidden_layers)
    else:
        make_config = eagle3_config if eagle3 else eagle_config
        config = make_config(net.config, intermediate_size, len(draft_ids), model)
    head = new_head(config, seed)
    embed, lm_head = net.model.embed_tokens.weight.detach().float(), net.lm_head.weight.detach().float()
    if isinstance(head, Eagle3Head):
        trainer: Trainer = Eagle3Trainer(init_readout(head, net, draft_ids), embed, lm_head, draft_ids, unroll)
    else:
        trainer = Trainer(head, method, embed, lm_head, draft_ids, unroll if method == "eagle" else 1, ce_weight)
    history = train(
        trainer, train_set, held_set or train_set[:4], epochs, batch_size, max_len, lr, seed, log=log, progress=progress
    )
    folder = Path(out) if out else trained_heads_dir() / model / method
    manifest: dict[str, Any] = {
        "method": method,
        "target": model,
        "command": command,
        "seed": seed,
        "data": {
            "prompts": len(prompts),
            "held_out_prompts": len(held),
            "temperature": temperature,
            "max_tokens": max_tokens,
            "train_tokens": sum(len(s.token_ids) for s in train_set),
            "answer_tokens": sum(len(s.token_ids) - s.prompt_len for s in samples),
            "source": "the target's own answers to workbench/draft_prompts.py's bundled prompt set",
        },
        "draft_vocab": {"size": len(draft_ids), "greedy_coverage": coverage},
        "training": {
            "epochs": epochs,
            "steps": history["steps"],
            "batch_size": batch_size,
            "max_len": max_len,
            "lr": lr,
            **({"unroll": unroll, "ce_weight": ce_weight} if method == "eagle" else {}),
            **({"unroll": unroll} if eagle3 else {}),
            "final_loss": history["epochs"][-1]["loss"] if history["epochs"] else None,
        },
        "held_out_acceptance": {"untrained": history["untrained"], "per_epoch": history["epochs"]},
        "seconds": {"generate": gen_s, "features": feat_s, "train": history["train_seconds"]},
    }
    save_head(folder, config, head_tensors(head, draft_ids), manifest)
    if held and check_prompts:
        t0 = time.perf_counter()
        manifest["engine_acceptance"] = engine_acceptance(
            model, method, folder, held[:check_prompts], min(k, num_heads) if method == "medusa" else k, 64, seed
        )
        manifest["engine_acceptance"]["prompts"] = len(held[:check_prompts])
        manifest["seconds"]["engine_check"] = time.perf_counter() - t0
        log(
            f"engine on held-out prompts: acceptance {manifest['engine_acceptance']['acceptance_rate']:.1%}, "
            f"{manifest['engine_acceptance']['mean_acceptance_length']:.2f} tokens per verification"
        )
    manifest["seconds"]["total"] = time.perf_counter() - t_start
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"wrote {folder} in {manifest['seconds']['total']:.0f} s")
    return manifest


def main(args: argparse.Namespace, command: str = "") -> dict[str, Any]:
    """`workbench train-draft` (its flags are in workbench/cli.py, which starts without torch)."""
    return train_draft(
        args.method,
        args.model,
        args.out,
        args.num_prompts,
        args.max_tokens,
        args.temperature,
        epochs=args.epochs,
        unroll=args.unroll,
        ce_weight=args.ce_weight,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        draft_vocab_size=args.draft_vocab_size,
        intermediate_size=args.intermediate_size,
        num_heads=args.num_heads,
        num_hidden_layers=args.num_hidden_layers,
        check_prompts=args.check_prompts,
        command=command,
    )
