"""FlexAttention tree mask: the preorder tables, the block mask, and the model's log-probs against the dense mask.

torch 2.13's FlexAttention has no backward pass on CPU, so the CPU tests compare forward results (log-probs and
entropies) and the gradients are compared by the ``gpu`` test at the end.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers import AutoModelForCausalLM, AutoTokenizer

from arpo_algo.rollout.synthetic import make_group
from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_algo.train.learner_config import ALARM_OFF
from arpo_algo.train.tree_flex import (
    BLOCK,
    FLEX_TREE_IMPL,
    preorder_spans,
    register,
    tree_block_mask,
    tree_dense_mask,
)
from arpo_algo.train.tree_forward import build_dedup_batch, build_padded_batch, forward_token_stats
from arpo_base.errors import ConfigError
from tests.arpo_algo.train.test_tree_forward import _specs


def _random_forest(n: int, seed: int, roots: int = 3) -> list[int]:
    rng = random.Random(seed)
    # Long chains with occasional branching, like a packed ARPO tree (most nodes continue the previous one).
    return [-1 if v < roots else (v - 1 if rng.random() < 0.9 else rng.randrange(v)) for v in range(n)]


def _groups(model_dir, seed: int):
    """Two ARPO-shaped groups (8 branched trajectories each) of random token ids, about 500 packed tokens."""
    rng, vocab = random.Random(seed), len(AutoTokenizer.from_pretrained(model_dir))
    return [make_group(rng, vocab, i, prompt_len=60, prefix_len=40, branch=(20, 40)) for i in range(2)]


def _ancestor_mask(parent: list[int]) -> torch.Tensor:
    n = len(parent)
    mask = torch.zeros((n, n), dtype=torch.bool)
    for v in range(n):
        u = v
        while u >= 0:
            mask[v, u] = True
            u = parent[u]
    return mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_preorder_spans_give_the_ancestor_relation(seed):
    parent = _random_forest(300, seed)
    pre, end = preorder_spans(parent)
    assert sorted(pre) == list(range(len(parent)))  # a permutation: every node one preorder slot
    assert torch.equal(tree_dense_mask(torch.tensor(pre), torch.tensor(end)), _ancestor_mask(parent))
    with pytest.raises(ValueError, match="parents must come before their children"):
        preorder_spans([-1, 2, 0])


@pytest.mark.parametrize("n,chunk", [(300, 1 << 24), (300, 1), (BLOCK, 1 << 24), (50, 1 << 24)])
def test_block_mask_equals_torch_block_mask_of_the_same_tree(n, chunk):
    """Our chunked tile classification gives the tiles torch's own create_block_mask finds from the full mask."""
    parent = _random_forest(n, seed=n)
    pre, end = (torch.tensor(x) for x in preorder_spans(parent))
    ours = tree_block_mask(pre, end, chunk_elements=chunk)
    dense = _ancestor_mask(parent)
    ref = create_block_mask(lambda b, h, q, kv: dense[q, kv], B=1, H=1, Q_LEN=n, KV_LEN=n, device="cpu")
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        counts = getattr(ours, num)[0, 0]
        for row, k in enumerate(counts.tolist()):
            mine, theirs = getattr(ours, idx)[0, 0, row, :k], getattr(ref, idx)[0, 0, row, :k]
            assert sorted(mine.tolist()) == sorted(theirs.tolist())
    # The element mask the kernel evaluates in partial tiles is the ancestor mask.
    q, kv = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    assert torch.equal(ours.mask_mod(0, 0, q, kv), dense)


def test_block_mask_skips_tiles_of_a_branched_tree(tiny_model_dir):
    """On an ARPO-shaped micro-batch (two groups of 8 branched trajectories) whole tiles are empty."""
    groups = _groups(tiny_model_dir, 0)
    ded = build_dedup_batch(_specs(groups))
    mask = tree_block_mask(ded.tree_pre, ded.tree_end)
    n_tiles = mask.kv_num_blocks.shape[-1] ** 2
    listed = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    assert ded.num_tokens > 4 * BLOCK and listed < n_tiles


def _load(path, impl):
    register()
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.float32).eval()


def test_flex_logprobs_equal_the_dense_mask_on_cpu(tiny_model_dir):
    """Same weights, same packed tree: FlexAttention with the block mask = SDPA with the dense mask (forward)."""
    groups = _groups(tiny_model_dir, 1)
    specs = _specs(groups)
    dense_model, flex_model = _load(tiny_model_dir, "sdpa"), _load(tiny_model_dir, FLEX_TREE_IMPL)
    ded = build_dedup_batch(specs)
    assert ded.num_tokens > 4 * BLOCK  # several tiles, some partial, some full, some skipped
    with torch.no_grad():
        lp_d, ent_d = forward_token_stats(dense_model, ded, with_entropy=True)
        lp_f, ent_f = forward_token_stats(flex_model, ded, with_entropy=True)
    assert ded.block_mask is not None  # built once, kept on the batch for the next forward
    torch.testing.assert_close(lp_f, lp_d, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_f, ent_d, atol=1e-5, rtol=1e-5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the learner's bf16 autocast, on CPU
        lp_d16, _ = forward_token_stats(dense_model, ded, with_entropy=False)
        lp_f16, _ = forward_token_stats(flex_model, ded, with_entropy=False)
    torch.testing.assert_close(lp_f16, lp_d16, atol=2e-2, rtol=0)  # 2e-3 measured; a wrong mask moves them 0.1+
    # Anything but the packed tree (a padded batch) goes to SDPA unchanged: bit-identical results.
    dup = build_padded_batch(specs[:3], pad_id=0)
    with torch.no_grad():
        assert torch.equal(
            forward_token_stats(flex_model, dup, with_entropy=False)[0],
            forward_token_stats(dense_model, dup, with_entropy=False)[0],
        )


def test_rollout_engine_sharing_a_flex_model_decodes_as_with_sdpa(tiny_model_dir):
    """The in-process engine shares the learner's module: under FLEX_TREE_IMPL its decoding (its own masks, KV
    cache, prefix reuse) goes through SDPA and samples the same tokens with the same log-probs."""
    from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    outs = []
    for impl in ("sdpa", FLEX_TREE_IMPL):
        engine = HFEngine(model=_load(tiny_model_dir, impl), tokenizer=tok, seed=0)
        reqs = [
            GenRequest(i, tok.encode(text), SamplingParams(max_new_tokens=12, seed=i))
            for i, text in enumerate(["<|im_start|>user\nhi", "<|im_start|>user\nsolve 6*7 please"])
        ]
        first = engine.generate(reqs)
        ctx = reqs[1].token_ids + first[1].token_ids
        more = engine.generate(
            [GenRequest(9, ctx, SamplingParams(max_new_tokens=6, seed=9), prefix_key=first[1].cache_key)]
        )
        outs.append([(g.token_ids, g.logprobs) for g in first + more])
    for (ids_s, lp_s), (ids_f, lp_f) in zip(*outs):
        assert ids_f == ids_s and lp_f == pytest.approx(lp_s, abs=1e-6)


def test_flex_choices_are_validated(tiny_model_dir):
    with pytest.raises(ConfigError, match="tree_attention='flex' with attn_implementation='eager'"):
        LearnerConfig(tree_attention="flex", attn_implementation="eager").validate()
    with pytest.raises(ConfigError, match="tree_attention='sparse' is not one of"):
        LearnerConfig(tree_attention="sparse").validate()
    with pytest.raises(ConfigError, match="FlexAttention has no backward pass there") as err:
        Learner(tiny_model_dir, LearnerConfig(tree_attention="flex"), device="cpu")
    assert "dense" in err.value.hint
    assert Learner(tiny_model_dir, LearnerConfig(tree_attention="auto")).tree_attention == "dense"  # CPU


def _grads_and_logprobs(learner: Learner, groups) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    learner.model.train()
    learner.model.zero_grad(set_to_none=True)
    batches, norms = learner.prepare_batches(groups)
    lps = []
    for b, w in zip(batches, norms):
        with learner.autocast():
            lp_u, _ = forward_token_stats(learner.model, b, with_entropy=False)
        lp = lp_u[b.pair_node]
        (w * (lp - b.pair_old_logp).exp() * b.pair_adv).sum().neg().backward()
        lps.append(lp.detach().float())
    grads = {n: p.grad.float() for n, p in learner.model.named_parameters() if p.grad is not None}
    return grads, torch.cat(lps)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,lp_tol,grad_tol", [("fp32", 1e-4, 1e-4), ("bf16", 2e-2, 5e-2)])
def test_flex_gradients_equal_the_dense_mask_on_gpu(tiny_model_dir, precision, lp_tol, grad_tol):
    """The learner's forward + backward on CUDA: flex and dense give the same log-probs and gradients (relative to
    the largest gradient, within fp32 or bf16 rounding)."""
    groups = _groups(tiny_model_dir, 2)
    cfg = LearnerConfig(
        old_logprobs="rollout", micro_batch_tokens=100_000, precision=precision, **ALARM_OFF
    )  # hand-built behaviour log-probs
    dense = Learner(tiny_model_dir, replace(cfg, tree_attention="dense"), device="cuda")
    flex = Learner(tiny_model_dir, replace(cfg, tree_attention="flex"), device="cuda")
    assert flex.model.config._attn_implementation == FLEX_TREE_IMPL and dense.precision == flex.precision == precision
    g_d, lp_d = _grads_and_logprobs(dense, groups)
    g_f, lp_f = _grads_and_logprobs(flex, groups)
    torch.testing.assert_close(lp_f, lp_d, atol=lp_tol, rtol=0)
    scale = max(float(g.abs().max()) for g in g_d.values())
    assert scale > 0
    for name, g in g_d.items():
        assert float((g_f[name] - g).abs().max()) <= grad_tol * scale, name
