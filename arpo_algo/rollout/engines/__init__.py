"""Rollout engines: token ids in, token ids with logprobs and entropies out (see :mod:`arpo_algo.rollout.engines.base`)."""
