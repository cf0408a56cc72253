"""Placement tables checked before work starts, and the bookkeeping of a restart after a lost node (the cluster
itself: tests/multinode)."""

from __future__ import annotations

import pytest

from arpo_algo.algorithms.arpo import ARPOConfig
from arpo_algo.algorithms.components import check_custom_feasible, resource_bundles
from arpo_algo.rollout.config import RolloutsConfig, per_actor
from arpo_algo.run.recovery import describe, is_node_loss, record_restart
from arpo_algo.train.backend_config import BackendConfig
from arpo_base.errors import ConfigError


def test_resource_tables_one_for_all_or_one_per_actor():
    assert per_actor(({"worker": 1},), 2) == [{"worker": 1.0}, {"worker": 1.0}]
    assert per_actor(({"node_a": 1}, {"node_b": 1}), 2) == [{"node_a": 1.0}, {"node_b": 1.0}]
    assert per_actor((), 2) == [{}, {}]
    with pytest.raises(ConfigError, match="has 3 tables but backend.learner_workers = 2"):
        BackendConfig.from_dict(
            {"learner_backend": "ddp", "learner_workers": 2, "worker_resources": [{"a": 1}, {"b": 1}, {"c": 1}]}
        )
    with pytest.raises(ConfigError, match="'CPU' is a built-in Ray resource"):
        RolloutsConfig(num_rollout_actors=1, actor_resources=({"CPU": 1},)).validate()
    with pytest.raises(ConfigError, match="node_a = 0 must be a number > 0"):
        RolloutsConfig(num_rollout_actors=1, actor_resources=({"node_a": 0},)).validate()
    with pytest.raises(ConfigError, match="collective_timeout_s must be > 0"):
        BackendConfig.from_dict({"learner_backend": "ddp", "collective_timeout_s": 0})
    with pytest.raises(ConfigError, match="worker_resources is set but learner_backend='local'"):
        BackendConfig.from_dict({"worker_resources": [{"node_a": 1}]})
    assert BackendConfig.from_dict(
        {"learner_backend": "ddp", "learner_workers": 2, "worker_resources": [{"node_a": 1}, {"node_b": 1}]}
    ).worker_bundles("cpu") == [{"CPU": 1.0, "node_a": 1.0}, {"CPU": 1.0, "node_b": 1.0}]


def test_main_resources_go_into_the_trials_first_bundle():
    cfg = ARPOConfig().training(model_path="unused").backend(main_resources={"node_a": 1})
    cfg.settings.validate()
    assert resource_bundles(cfg)[0] == {"CPU": 1.0, "GPU": 0.0, "node_a": 1.0}  # the bundle Tune runs the trial in
    with pytest.raises(ConfigError, match="'GPU' is a built-in Ray resource"):
        BackendConfig.from_dict({"main_resources": {"GPU": 1}})
    with pytest.raises(ConfigError, match="node_a = -1 must be a number > 0"):
        BackendConfig.from_dict({"main_resources": {"node_a": -1}})


def test_main_resources_are_refused_where_the_process_cannot_move(ray_session):
    """Only a process Ray placed (a Tune trial is an actor) can honour main_resources; in the driver they would be
    ignored without a word, so they are refused there."""
    import ray

    from arpo_algo.algorithms.base import _check_main_placement

    with pytest.raises(ConfigError, match="runs in the driver") as e:
        _check_main_placement({"node_a": 1.0})
    assert "arpo tune" in e.value.hint
    _check_main_placement({})  # nothing asked: nothing to refuse

    @ray.remote(num_cpus=0)
    class Trial:
        def check(self) -> str:
            _check_main_placement({"node_a": 1.0})
            return "placed"

    assert ray.get(Trial.remote().check.remote()) == "placed"


def test_custom_resources_the_cluster_lacks_are_named_with_what_it_has():
    have = {"CPU": 5.0, "GPU": 0.0, "node_a": 1.0, "worker": 4.0, "node:127.0.0.1": 3.0, "memory": 1e9}
    bundles = [{"CPU": 1.0}, {"CPU": 1.0, "node_a": 1.0}, {"CPU": 1.0, "node_c": 1.0}, {"CPU": 1.0, "worker": 1.0}]
    with pytest.raises(ConfigError) as e:
        check_custom_feasible(bundles, have, "the Ray cluster")
    assert "node_c = 1 (the Ray cluster has 0)" in str(e.value)
    assert "{'node_a': 1.0, 'worker': 4.0}" in str(e.value) and "node:" not in str(e.value)
    check_custom_feasible(bundles[:2] + bundles[3:], have, "the Ray cluster")  # all offered: no error
    with pytest.raises(ConfigError, match="node_a = 2"):  # two ranks cannot share the one node_a
        check_custom_feasible([{"CPU": 1.0}, {"node_a": 1.0}, {"node_a": 1.0}], have, "the Ray cluster")


def test_a_restart_drops_the_lines_after_the_checkpoint_and_counts_the_reruns():
    import ray.exceptions as rx

    history = [{"iteration": i} for i in range(4)]  # 0 = evaluation, 1..3 trained; checkpoint at 2
    restarts: list = []
    kept = record_restart(restarts, history, 4, 2, rx.ActorDiedError())
    assert kept == history[:3]
    assert restarts == [
        {"failed_iteration": 4, "resumed_from": 2, "rerun_iterations": [3, 4], "error": restarts[0]["error"]}
    ]
    assert restarts[0]["error"].startswith("ActorDiedError")
    peer = RuntimeError("\x1b[36mray::Rank.update()\x1b[39m\n[../gloo/pair.cc] Connection closed by peer")
    assert describe(peer) == "RuntimeError: [../gloo/pair.cc] Connection closed by peer"
    assert is_node_loss(rx.ActorDiedError()) and is_node_loss(rx.NodeDiedError("gone"))
    assert not is_node_loss(ValueError("a bug in our code is not retried"))
