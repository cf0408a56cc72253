"""Prefix-deduplicated forward: the packed trie gives the same log-probs/entropies as the padded duplicated batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arpo_algo.rollout.types import Group, Trajectory
from arpo_algo.train.tree_flex import tree_dense_mask
from arpo_algo.train.tree_forward import SeqSpec, build_dedup_batch, build_padded_batch, forward_token_stats

PROMPT = "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n"


def _segments_to_traj(tok, j: int, segments: list[tuple[str, bool]], reward: float) -> Trajectory:
    ids, mask = [], []
    for text, trained in segments:
        part = tok(text, add_special_tokens=False)["input_ids"]
        ids += part
        mask += [int(trained)] * len(part)
    # Behaviour log-probs: a deterministic function of (position, token) so a shared prefix has equal values.
    old = [(-0.5 - ((t * 7 + i) % 13) / 10.0) if m else 0.0 for i, (t, m) in enumerate(zip(ids, mask))]
    return Trajectory(
        traj_id=j, response_ids=ids, trained_mask=mask, old_logprobs=old, entropies=[0.0] * len(ids), reward=reward
    )


def make_groups(tok) -> list[Group]:
    """Two hand-built trees: group 0 has 4 trajectories (3 share a prefix with a tool result), group 1 has 3."""
    call = "Let me compute. <python>print(6*7)</python>"
    result = " <result>\n42\n</result>"
    g0 = [
        [(call, True), (result, False), ("The answer is <answer>42</answer><|im_end|>", True)],
        [(call, True), (result, False), ("So <answer>\\boxed{42}</answer><|im_end|>", True)],
        [(call[:12], True), ("I guess 41.<|im_end|>", True)],
        [("No idea.<|im_end|>", True)],
    ]
    g1 = [
        [("Think: 6*7=42", True), (" done<|im_end|>", True)],
        [("Think: 6*7=42", True), (", so 42<|im_end|>", True)],
        [("Think: 6*7=43<|im_end|>", True)],
    ]
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    prompt1 = tok(PROMPT.replace("6*7", "7*6"), add_special_tokens=False)["input_ids"]
    t0 = [_segments_to_traj(tok, j, s, r) for j, (s, r) in enumerate(zip(g0, [1.0, 0.5, 0.0, 0.0]))]
    t1 = [_segments_to_traj(tok, j, s, r) for j, (s, r) in enumerate(zip(g1, [1.0, 1.0, 0.0]))]
    # The shared prefixes are branches, as the sampler records them: a child copies its parent's tokens before its
    # branch point (so hard attribution with hard_scope="tree" counts them once).
    n = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    t0[1] = replace(t0[1], parent=0, branch_point=n(call) + n(result), kind="branch")
    t0[2] = replace(t0[2], parent=0, branch_point=n(call[:12]), kind="branch")
    t1[1] = replace(t1[1], parent=0, branch_point=n("Think: 6*7=42"), kind="branch")
    return [
        Group(prompt_index=0, prompt_ids=prompt, trajectories=t0),
        Group(prompt_index=1, prompt_ids=prompt1, trajectories=t1),
    ]


def _specs(groups: list[Group]) -> list[SeqSpec]:
    specs, seq = [], 0
    for gi, g in enumerate(groups):
        for t in g.trajectories:
            n = len(t.response_ids)
            specs.append(
                SeqSpec(
                    gi, seq, g.prompt_ids, t.response_ids, t.trained_mask, [t.reward] * n, [1.0] * n, t.old_logprobs
                )
            )
            seq += 1
    return specs


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_dedup_equals_padded(tiny_model_dir, impl):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=impl, dtype=torch.float32)
    specs = _specs(make_groups(tok))
    dup, ded = build_padded_batch(specs, tok.pad_token_id), build_dedup_batch(specs)
    assert ded.num_tokens < dup.num_tokens  # the shared prefixes (and the chat prompt) run once
    with torch.no_grad():
        lp1, e1 = forward_token_stats(model, dup, with_entropy=True)
        lp2, e2 = forward_token_stats(model, ded, with_entropy=True)
    assert dup.pair_node.numel() == ded.pair_node.numel() == sum(sum(s.trained) for s in specs)
    assert len(lp2) < len(lp1)  # each shared trained token is predicted once
    torch.testing.assert_close(lp2[ded.pair_node], lp1[dup.pair_node], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e2[ded.pair_node], e1[dup.pair_node], atol=1e-5, rtol=1e-5)
    # Pairs carry the per-trajectory data in the same order in both layouts.
    torch.testing.assert_close(ded.pair_adv, dup.pair_adv)
    assert torch.equal(ded.pair_seq, dup.pair_seq)


def test_packed_logprobs_match_independent_forwards(tiny_model_dir):
    """Each trajectory run alone (no padding, no packing) gives the same log-probs as the tree pack."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    groups = make_groups(tok)
    specs = _specs(groups)
    ded = build_dedup_batch(specs)
    with torch.no_grad():
        lp, _ = forward_token_stats(model, ded, with_entropy=False)
        got = lp[ded.pair_node].tolist()
        want = []
        for s in specs:
            ids = torch.tensor([s.prompt + s.response])
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            p = len(s.prompt)
            want += [float(logp[p + t - 1, s.response[t]]) for t, m in enumerate(s.trained) if m]
    assert got == pytest.approx(want, abs=1e-5)


def test_tree_mask_is_ancestor_mask(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    specs = _specs(make_groups(tok))
    ded = build_dedup_batch(specs)
    assert ded.attention_mask is None  # the packed tree travels as two O(N) tables; the mask is built on the device
    mask = tree_dense_mask(ded.tree_pre, ded.tree_end)
    n = mask.shape[0]
    assert mask.diagonal().all() and not mask.triu(1).any()  # self + earlier nodes only
    pos = ded.position_ids[0]
    # Every node attends to exactly depth+1 nodes (its ancestors and itself), one per position 0..depth.
    for v in range(n):
        cols = mask[v].nonzero().flatten()
        assert len(cols) == int(pos[v]) + 1
        assert sorted(pos[cols].tolist()) == list(range(int(pos[v]) + 1))


def test_merge_shared_counts_a_shared_token_once(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    specs = _specs(make_groups(tok))
    merged = build_dedup_batch(specs, merge_shared=True)
    plain = build_dedup_batch(specs)
    # Merged: one pair per (group, unique trained node); the weights add up to the copies they replace.
    assert merged.pair_node.numel() == plain.node_tok.numel() < plain.pair_node.numel()
    assert float(merged.pair_weight.sum()) == pytest.approx(float(plain.pair_weight.sum()))


@pytest.mark.parametrize("dedup", [True, False])
def test_chunked_head_equals_the_whole_head(tiny_model_dir, dedup):
    """forward_token_stats(head_chunk=...): same log-probs, entropies and gradients, chunk by chunk."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    specs = _specs(make_groups(tok))
    batch = build_dedup_batch(specs) if dedup else build_padded_batch(specs, tok.pad_token_id)
    results = []
    for chunk in (None, 4):
        model.zero_grad(set_to_none=True)
        lp, ent = forward_token_stats(model, batch, with_entropy=True, head_chunk=chunk)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        with torch.no_grad():
            lp_ng, _ = forward_token_stats(model, batch, with_entropy=False, head_chunk=chunk)
        torch.testing.assert_close(lp_ng, lp.detach())
    (lp1, e1, g1), (lp2, e2, g2) = results
    assert len(lp1) > 4  # several chunks
    torch.testing.assert_close(lp2, lp1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(e2, e1, atol=1e-6, rtol=1e-6)
    for name, g in g1.items():
        torch.testing.assert_close(g2[name], g, atol=1e-5, rtol=1e-4)  # float summation order, as above
