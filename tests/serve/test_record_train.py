"""Training from recorded episodes: a record folder written by really serving the tiny model (the in-process agent,
its HF engine, the real recorder and reward route), read back as GRPO groups (arpo_algo.rollout.records) and trained
on by ``arpo train`` with ``training.records``: grouping, what is held, dropped and skipped, the folder checks, the
mismatch alarm against the recorded log-probs, and a resume that trains no episode twice."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from arpo_algo.cli.main import main
from arpo_algo.rollout.records import DROP_GRACE_S, RecordSource, read_lines
from arpo_algo.run.experiment import load_experiment
from arpo_base.errors import ArpoError, ConfigError
from serve.agents import AgentSpec
from serve.record import RecordConfig, Recorder, scope_of
from serve.runtime import Agent
from serve.schema import parse_chat_request
from tests.arpo_algo.run.test_train_cli import write_experiment

SCOPE = scope_of("client-key")
VOCAB = 10_000


@pytest.fixture(scope="module")
def agent(tiny_model_dir):
    a = Agent(
        AgentSpec(name="m", model_path=str(tiny_model_dir), session={"max_tool_calls": 1, "tools": {"python": {}}})
    )
    yield a
    a.front.close()


def serve_episode(agent, recorder, episode, task, reward=None, seed=0, turns=1):
    """Serve ``turns`` requests of one episode (each continuing the last reply) and post its reward. The random tiny
    model ends a reply at its end-of-sequence token or at one of the stop strings (which it writes often), well before
    the length limit."""
    messages = [{"role": "user", "content": f"Task {task}?"}]
    for t in range(turns):
        body = {"model": "m", "messages": messages, "max_tokens": 200, "seed": seed * 10 + t, "stop": list("eao ")}
        body["arpo"] = {"episode": episode, **({"task": task} if task else {})}
        out = agent.run(agent.prepare(parse_chat_request(json.dumps(body)), recorder, SCOPE), threading.Event(), None)
        assert not out["choices"][0]["message"]["arpo"]["record"]["unscoreable"]
        messages = [*messages, {"role": "assistant", "content": out["choices"][0]["message"]["content"]}]
        messages.append({"role": "user", "content": "And then?"})
    if reward is not None:
        recorder.post_reward({"episode": f"{SCOPE}/{episode}", "reward": reward})


@pytest.fixture(scope="module")
def served(agent, tmp_path_factory):
    """One folder served once: task A (a1 of two turns, a2), B (b1, b2 without a reward yet), C (c1) and two
    episodes without a task that start from the same prompt (p1, p2); each test works on a copy."""
    recorder = Recorder(RecordConfig(str(tmp_path_factory.mktemp("served") / "rec"), reward_deadline_s=600))
    serve_episode(agent, recorder, "a1", "A", 1.0, seed=1, turns=2)
    serve_episode(agent, recorder, "a2", "A", 0.0, seed=2)
    serve_episode(agent, recorder, "b1", "B", 1.0, seed=3)
    serve_episode(agent, recorder, "b2", "B", None, seed=4)
    serve_episode(agent, recorder, "c1", "C", 1.0, seed=5)
    serve_episode(agent, recorder, "p1", None, 0.5, seed=6)
    serve_episode(agent, recorder, "p2", None, 0.0, seed=7)
    return Path(recorder.config.dir)


def copy(served, dest, keep=None):
    """A private copy of the served folder with only the episodes ``keep`` names (None: all)."""
    shutil.copytree(served, dest)
    os.chmod(dest, 0o700)
    for f in (dest / SCOPE).iterdir():
        if keep is not None and f.name.partition(".")[0] not in keep:
            f.unlink()
    return dest


def write_episode(folder, name, turns, reward):
    path = folder / SCOPE / f"{name}.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in turns))
    reward = {"format": 1, "reward": reward, "turn_rewards": None, "turns": len(turns), "at": time.time()}
    path.with_suffix(".reward.json").write_text(json.dumps(reward))
    return path


def counts_of(metrics):
    return {k.rpartition("/")[2]: v for k, v in metrics.items() if k.startswith("rollout/records/")}


def test_groups_held_dropped_and_skipped_episodes_are_counted(served, tmp_path):
    folder = copy(served, tmp_path / "rec")
    [bad] = read_lines(folder / SCOPE / "a2.jsonl")
    bad["choices"][0]["response_ids"][0] = VOCAB + 5  # another tokenizer's id
    write_episode(folder, "bad", [bad], 1.0)
    # a copy of a2 whose last line was torn by a killed server: another episode of task A, its one good turn trained
    torn = write_episode(folder, "torn", read_lines(folder / SCOPE / "a2.jsonl"), 0.0)
    torn.write_text(torn.read_text() + '{"format": 1, "turn": 1, "prompt_ids": [1')

    # a turn that reached the file after the reward (a request in flight when it was posted) is not the episode's
    a2 = folder / SCOPE / "a2.jsonl"
    [late] = read_lines(a2)
    a2.write_text(a2.read_text() + json.dumps({**late, "turn": 1, "segment": 1}) + "\n")

    source = RecordSource(folder, VOCAB)
    groups, metrics = source.take(8, version=0)
    by = {g.task["id"].partition("/")[2]: g for g in groups}
    assert len(by) == 2 and "task:A" in by and any(k.startswith("prompt:") for k in by)
    a = by["task:A"]
    names = [t.reward_info["episode"].rpartition("/")[2] for t in a.trajectories]
    assert names == ["a1", "a2", "torn"]  # a1's two turns are one segment: one sequence; a2's late turn is not in
    assert counts_of(metrics) == {
        "trained": 5,
        "pending": 1,
        "held": 2,  # b1 (b2 may still be rewarded) and c1 (its reward is recent)
        "dropped": 0,
        "singletons": 0,
        "malformed": 1,
        "untrainable": 0,
        "unscoreable": 0,
    }
    assert [t.reward for t in a.trajectories] == [1.0, 0.0, 0.0]
    assert all(t.old_logprobs[i] < 0 for t in a.trajectories for i, m in enumerate(t.trained_mask) if m)
    assert all(t.policy_version == 0 for t in a.trajectories) and a.prompt_ids
    # nothing is taken twice; past the deadline the pending episode is dropped and the lone ones with it
    assert source.take(8, version=1)[0] == []
    later = time.time() + 600 + DROP_GRACE_S + 1
    groups, metrics = source.take(8, version=1, now=later)
    counts = counts_of(metrics)
    assert groups == [] and counts["dropped"] == 1 and counts["singletons"] == 2 and counts["held"] == 0
    state = source.get_state()
    assert len(state["consumed"]) == 9  # every episode of the folder, each once
    fresh = RecordSource(folder, VOCAB)
    fresh.set_state(json.loads(json.dumps(state)))
    assert fresh.take(8, version=2, now=later)[0] == [] and fresh.totals == source.totals


def test_an_iteration_waits_for_rewards_up_to_its_limit(served, tmp_path):
    folder = copy(served, tmp_path / "rec", keep={"a1", "a2"})
    rewards = {p: p.with_name(f".{p.name}.tmp") for p in (folder / SCOPE).glob("*.reward.json")}
    for p, hidden in rewards.items():
        p.rename(hidden)
    t0 = time.monotonic()
    with pytest.raises(ArpoError, match="is ready to train"):
        RecordSource(folder, VOCAB).wait(2, 0, wait_s=0.5)
    assert time.monotonic() - t0 >= 0.5
    post = threading.Timer(0.5, lambda: [h.rename(p) for p, h in rewards.items()])  # the rewards arrive, whole
    post.start()
    groups, metrics, waited = RecordSource(folder, VOCAB).wait(2, 0, wait_s=60)
    post.join()
    assert len(groups) == 1 and 0.5 <= waited < 60 and metrics["rollout/records/trained"] == 2


def test_a_task_is_an_id_recorded_with_its_episode(served):
    from serve.errors import APIError
    from serve.record import request_episode

    assert read_lines(served / SCOPE / "a2.jsonl")[0]["task"] == "A"
    assert read_lines(served / SCOPE / "p1.jsonl")[0]["task"] is None
    messages = [{"role": "user", "content": "Q"}]
    for bad in ("../x", "", "a" * 129, 7):
        with pytest.raises(APIError) as e:
            parse_chat_request(json.dumps({"model": "m", "messages": messages, "arpo": {"episode": "e", "task": bad}}))
        assert e.value.status == 400 and e.value.param == "arpo.task"
    alone = parse_chat_request(json.dumps({"model": "m", "messages": messages, "arpo": {"task": "t"}}))
    with pytest.raises(APIError, match="name the episode too") as e:
        request_episode(alone, {}, None)
    assert e.value.param == "arpo.task"


def test_grpo_is_over_episodes_not_sequences():
    from arpo_algo.core.advantages import episode_advantages, grpo_advantages

    # episode 0 has two sequences (two segments): the baseline is still the mean of the two episodes' rewards
    out = episode_advantages([[1, 2], [3], [4, 5]], [0, 0, 1], [1.0, 1.0, 0.0])
    a, b = grpo_advantages([1.0, 0.0])
    assert out.advantages == [[a, a], [a], [b, b]] and out.weights == [[1.0, 1.0], [1.0], [1.0, 1.0]]


def test_the_folder_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        RecordSource(tmp_path / "none", VOCAB)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="writable by other users") as e:
        RecordSource(shared, VOCAB)
    assert "chmod 700" in e.value.hint
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    with pytest.raises(ArpoError, match="no group of recorded episodes .* is ready"):
        RecordSource(empty, VOCAB).wait(2, 0, wait_s=0.0)


#: A records run as an experiment file holds it, with no [tree] section and no sampling setting.
RECORDS_RUN = {
    "model": {"path": "unused"},
    "env": {"id": "arpo/ToolMath-v0"},
    "training": {"records": "episodes/", "old_logprobs": "rollout"},
}


@pytest.mark.parametrize(
    "override, why",
    [("tree.budget=4", "no sampling tree is grown"), ("rollouts.temperature=0.7", "records its sampling settings")],
)
def test_a_tree_or_sampling_setting_is_refused_with_records(override, why):
    name, _, value = override.partition("=")
    exp = load_experiment(sections=RECORDS_RUN, overrides=[override])
    with pytest.raises(ConfigError) as e:
        exp.config.validate()
    assert e.value.message.startswith(f"{name} = {value} does nothing with training.records") and why in e.value.message
    assert e.value.hint.startswith(f"drop {name} from the experiment file or the --set")


@pytest.mark.parametrize("algorithm", ["arpo", "grpo", "aepo"])
def test_a_records_run_keeps_the_settings_that_act(algorithm):
    # each variant's preset (GRPO's and AEPO's [tree] values) is not the user's: a records run under it loads
    sections = {**RECORDS_RUN, "experiment": {"algorithm": algorithm}}
    load_experiment(sections=sections).config.validate()
    # the engine, its settings and the response budget run the evaluation; record_every writes the trained groups
    acting = ["rollouts.max_response_tokens=64", "rollouts.hf.max_batch_size=2", "rollouts.record_every=2"]
    load_experiment(sections=sections, overrides=acting).config.validate()


def train(exp, folder, *args):
    """``arpo train`` of the tiny experiment of the train command's tests, on the records of ``folder``."""
    records = [f"training.records='{folder}'", "training.old_logprobs='rollout'", "evaluation.every=0"]
    return [str(exp), *(x for r in records for x in ("--set", r)), "--no-progress", *args]


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_from_records_and_resume_without_training_twice(served, tiny_model_dir, tmp_path, capsys):
    folder = copy(served, tmp_path / "rec", keep={"a1", "a2", "p1", "p2"})
    exp = write_experiment(tmp_path, tiny_model_dir, iterations=1, tree=False)
    assert main(["train", *train(exp, folder, "--set", "training.old_logprobs='recompute'", "--dry-run")]) == 2
    assert 'training.old_logprobs = "rollout"' in capsys.readouterr().err
    assert main(["train", *train(exp, folder, "--set", "tree.budget=4", "--dry-run")]) == 2
    err = capsys.readouterr().err
    assert "tree.budget = 4 does nothing with training.records" in err and "Traceback" not in err
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert main(["train", *train(exp, shared, "--output", str(tmp_path / "refused"))]) == 2
    err = capsys.readouterr().err
    assert "writable by other users" in err and "chmod 700" in err and "Traceback" not in err
    out = tmp_path / "run"
    assert main(["train", *train(exp, folder, "--output", str(out))]) == 0
    first = [r for r in rows(out) if r["iteration"] == 1][0]
    assert first["rollout/records/trained"] == 2 and first["train/reward_mean"] == 0.5  # a1 and a2
    # the learner scored the served tokens as the server did: the alarm's statistic is at rounding level
    assert first["learner/kl_rollout"] < 1e-4 and first["learner/optimizer_steps"] >= 1
    ckpt = json.loads((out / "checkpoints" / "iter_000001" / "arpo_checkpoint.json").read_text())
    assert sorted(ckpt["records"]["consumed"]) == [f"{SCOPE}/a1", f"{SCOPE}/a2"]  # task A's reward came first
    # the second iteration takes the other group only: the checkpoint's position came back with the weights
    assert main(["train", *train(exp, folder, "--resume", str(out), "--set", "experiment.iterations=2")]) == 0
    second = [r for r in rows(out) if r["iteration"] == 2][0]
    assert second["rollout/records/trained"] == 4
    ckpt = json.loads((out / "checkpoints" / "iter_000002" / "arpo_checkpoint.json").read_text())
    assert sorted(ckpt["records"]["consumed"]) == sorted(f"{SCOPE}/{e}" for e in ("a1", "a2", "p1", "p2"))
    # nothing is left to train: the run stops with a clear line
    assert main(["train", *train(exp, folder, "--resume", str(out), "--set", "experiment.iterations=3")]) == 2
    assert "is ready to train" in capsys.readouterr().err


def test_the_alarm_compares_the_recorded_log_probs(served, tiny_model_dir, tmp_path, capsys):
    folder = copy(served, tmp_path / "rec", keep={"p1", "p2"})
    for name in ("p1", "p2"):
        path = folder / SCOPE / f"{name}.jsonl"
        [turn] = read_lines(path)
        turn["choices"][0]["logprobs"] = [v - 3.0 for v in turn["choices"][0]["logprobs"]]  # not these weights'
        path.write_text(json.dumps(turn) + "\n")
    exp = write_experiment(tmp_path, tiny_model_dir, iterations=1, tree=False)
    assert main(["train", *train(exp, folder, "--output", str(tmp_path / "run"))]) != 0
    assert "the sampler's log-probs disagree with the learner's" in capsys.readouterr().err


@pytest.mark.slow  # two `arpo train` processes (about 35 s on two busy cores)
def test_a_killed_trainer_resumes_without_losing_or_repeating_an_episode(served, tiny_model_dir, tmp_path):
    """``kill -9`` of ``arpo train`` wherever it is once its first checkpoint exists: the resumed run trains every
    group once, whatever the killed one had trained after that checkpoint (its updates died with it)."""
    folder = copy(served, tmp_path / "rec")
    [b2] = read_lines(folder / SCOPE / "b2.jsonl")
    write_episode(folder, "b2", [b2], 0.0)  # three groups now: A, B and the prompt-keyed one
    exp = write_experiment(tmp_path, tiny_model_dir, iterations=3, tree=False)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "arpo_algo.cli", "train"]
    proc = subprocess.Popen([*cmd, *train(exp, folder, "--output", str(out))], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "iter_000001").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert subprocess.run([*cmd, *train(exp, folder, "--resume", str(out))], capture_output=True).returncode == 0
    ckpt = json.loads((out / "checkpoints" / "iter_000003" / "arpo_checkpoint.json").read_text())
    trained = {f"{SCOPE}/{e}" for e in ("a1", "a2", "b1", "b2", "p1", "p2")}
    assert set(ckpt["records"]["consumed"]) == trained and ckpt["records"]["totals"]["trained"] == 6
    assert ckpt["records"]["groups"] == 3
