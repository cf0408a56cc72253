"""Every field of RLlib's ``AlgorithmConfig``: the ones arpo reads, and for each other one, arpo's equivalent.

arpo's config subclasses RLlib's, so every RLlib setter and dict key reaches one of these fields. A field arpo does
not read would change nothing, so :func:`check_unused_fields` refuses it at validation when its value differs from
RLlib's default, with a hint naming what arpo uses instead. The table covers every field (a test walks them all), so
an RLlib upgrade that adds a field fails that test until the field is placed here.
"""

from __future__ import annotations

import functools
from typing import Any

from arpo_base.errors import ConfigError

#: Fields arpo reads (or RLlib's Algorithm machinery reads on arpo's behalf), with what reads them.
READ: dict[str, str] = {
    "env": "the environment the sampler and evaluation play (.environment())",
    "env_config": "the environment's keyword arguments (.environment(env_config=...))",
    "seed": "the seed of the learner, engine, sampler and prompt order (.debugging(seed=...))",
    "evaluation_interval": "how often train() evaluates; the same value as evaluation.every",
    "callbacks_class": "the callbacks fired (docs/howto/rllib.md#callbacks)",
    "callbacks_on_algorithm_init": "fired at the end of setup",
    "callbacks_on_sample_end": "fired after each iteration's groups are sampled",
    "callbacks_on_train_result": "fired by RLlib's train() with each result",
    "callbacks_on_evaluate_start": "fired when evaluate() starts",
    "callbacks_on_evaluate_end": "fired when evaluate() ends",
    "callbacks_on_checkpoint_loaded": "fired by RLlib after a checkpoint is restored",
    "num_cpus_for_main_process": "the CPUs of the main process's resource bundle (Tune's reservation)",
    "placement_strategy": "the strategy of the trial's placement group",
    # set by arpo itself or RLlib's own bookkeeping, not user settings
    "algo_class": "the Algorithm class the config builds (set by the variant)",
    "_is_online": "set to False by arpo: no EnvRunnerGroup is built",
    "_is_frozen": "RLlib's bookkeeping (a built Algorithm's config is frozen)",
    "_validate_config": "RLlib's bookkeeping (whether validate() runs)",
    "in_evaluation": "RLlib's bookkeeping (marks an evaluation config)",
}

_ROLLOUT_ACTORS = (
    "arpo's own sampler plays the env in this process or in its rollout actors: "
    ".llm_rollouts(num_rollout_actors=N, num_cpus_per_rollout_actor=..., actor_resources=...)"
)
_LEARNER = (
    "arpo owns its learner in the main process: .backend(learner_backend='ddp' or 'deepspeed', learner_workers=N) "
    "for data parallel, .training(...) for the update"
)
_MODULE = "the policy is a Hugging Face causal LM, not an RLModule: .training(model_path=...) and model.lora"
_API_STACK = "arpo uses neither of RLlib's API stacks (its own learner and sampler): leave .api_stack() unset"
_FRAMEWORK = "arpo's learner is torch only; its precision is training.precision and rollouts.dtype"
_EVALUATION = (
    "arpo's evaluation settings: .evaluation(every=N, num_prompts=..., split=..., samples=..., temperature=...)"
)
_OFFLINE = "arpo reads no RLlib offline data and writes none: rollouts.record_trees records the trees it samples"
_MULTI_AGENT = "arpo trains one policy (one agent); there is no multi-agent setting"
_CONNECTORS = "arpo has no connector pipelines: the environment's prompt and tool turns are the agent's input"
_EXPLORATION = "exploration is the tree's branching: .tree(...) and rollouts.temperature / top_p"
_BATCH = "a batch is training.prompts_per_step prompts, each sampled as one tree of tree.budget trajectories"
_EPOCHS = "the update's passes are training.ppo_epochs and training.mini_batches"
_FAULT = "arpo restarts nothing by itself: a failed rollout actor fails the run (Tune's FailureConfig retries trials)"
_CHECKPOINT = "arpo writes its own data-only checkpoints (policy/ plus arpo_checkpoint.json); nothing to choose"
_ITERATION = "one arpo iteration is one update (one training_step); its size is training.prompts_per_step"
_REPORTING = "arpo reports its own metrics each iteration (docs/concepts/architecture.md); no episode smoothing"
_EPISODE_CALLBACKS = (
    "arpo's sampler plays episodes without RLlib's EnvRunners, so episode and env-runner callbacks never fire: "
    "use on_sample_end (the iteration's groups) or on_train_result"
)
_DEPRECATED = "deprecated by RLlib itself and unused by arpo"
_RESOURCES = "arpo's resources: rollouts.device, backend.main_resources, the rollout actors' and learner ranks' own"


def _fields(hint: str, names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), hint)


#: Fields arpo does not read, each with arpo's equivalent (or why there is none): set away from RLlib's default,
#: each is refused at validation.
REFUSED: dict[str, str] = {
    "gamma": "arpo rewards the trajectory's final answer, undiscounted; the advantage estimator is training.advantage",
    "lr": "arpo's learning rate is training.lr (.training(lr=...))",
    "grad_clip": "arpo's gradient clipping is training.grad_clip (.training(grad_clip=...))",
    "grad_clip_by": "arpo clips by global norm: training.grad_clip",
    "optimizer": "arpo's optimizer is AdamW: training.lr, training.weight_decay, training.lr_schedule",
    "_torch_lr_scheduler_classes": "arpo's schedule is training.lr_schedule with training.warmup_steps",
    "_torch_grad_scaler_class": "arpo's mixed precision is training.precision",
    "torch_skip_nan_gradients": "arpo skips a NaN update itself and stops after training.max_nan_updates",
    "log_gradients": "arpo logs learner/grad_norm every iteration",
    "log_level": "RLlib applies it in the setup() arpo replaces; set Python's: logging.getLogger('arpo_algo').setLevel",
    "custom_resources_for_main_process": "the main process's extra resources are backend.main_resources",
    **_fields(
        _ROLLOUT_ACTORS,
        "num_env_runners num_envs_per_env_runner num_cpus_per_env_runner num_gpus_per_env_runner "
        "custom_resources_per_env_runner env_runner_cls create_local_env_runner create_env_on_local_worker "
        "gym_env_vectorize_mode remote_worker_envs remote_env_batch_wait_ms validate_env_runners_after_construction "
        "max_requests_in_flight_per_env_runner sample_timeout_s rollout_fragment_length batch_mode "
        "episode_lookback_horizon sample_collector worker_cls env_task_fn render_env disable_env_checking "
        "auto_wrap_old_gym_envs action_space observation_space clip_rewards normalize_actions clip_actions "
        "_is_atari action_mask_key compress_observations episodes_to_numpy merge_env_runner_states "
        "broadcast_env_runner_states use_env_runner_state_server env_runner_state_server_max_concurrency "
        "_dont_auto_sync_env_runner_states ignore_final_observation sampler_perf_stats_ema_coef "
        "update_worker_filter_stats use_worker_filter_stats observation_filter synchronize_filters "
        "sync_filters_on_rollout_workers_timeout_s observation_fn preprocessor_pref enable_connectors "
        "enable_tf1_exec_eagerly",
    ),
    **_fields(
        _LEARNER,
        "num_learners num_cpus_per_learner num_gpus_per_learner custom_resources_per_learner local_gpu_idx "
        "_learner_class learner_config_dict torch_ddp_kwargs num_aggregator_actors_per_learner "
        "max_requests_in_flight_per_learner max_requests_in_flight_per_aggregator_actor",
    ),
    **_fields(
        _MODULE,
        "_rl_module_spec _model_config model _per_module_overrides algorithm_config_overrides_per_module "
        "export_native_model_files _disable_action_flattening _disable_preprocessor_api "
        "_disable_initialize_loss_from_dummy_batch _disable_execution_plan_api _enable_rl_module_api "
        "simple_optimizer _tf_policy_handles_more_than_one_loss",
    ),
    **_fields(_API_STACK, "enable_rl_module_and_learner enable_env_runner_and_connector_v2"),
    **_fields(
        _FRAMEWORK,
        "framework_str eager_tracing eager_max_retraces tf_session_args local_tf_session_args _fake_gpus "
        "torch_compile_learner torch_compile_learner_dynamo_backend torch_compile_learner_dynamo_mode "
        "torch_compile_learner_what_to_compile torch_compile_worker torch_compile_worker_dynamo_backend "
        "torch_compile_worker_dynamo_mode",
    ),
    **_fields(
        _EVALUATION,
        "evaluation_config evaluation_duration evaluation_duration_unit evaluation_num_env_runners "
        "evaluation_parallel_to_training evaluation_sample_timeout_s evaluation_unhealthy_workers_timeout_s "
        "evaluation_auto_duration_max_env_steps_per_sample evaluation_auto_duration_min_env_steps_per_sample "
        "evaluation_force_reset_envs_before_iteration evaluation_error_after_n_consecutive_skips "
        "custom_evaluation_function custom_async_evaluation_function enable_async_evaluation "
        "always_attach_evaluation_results off_policy_estimation_methods ope_split_batch_by_episode",
    ),
    **_fields(
        _OFFLINE,
        "input_ input_config input_read_method input_read_method_kwargs input_read_schema input_read_episodes "
        "input_read_sample_batches input_read_batch_size input_filesystem input_filesystem_kwargs "
        "input_compress_columns input_spaces_jsonable actions_in_input_normalized postprocess_inputs "
        "materialize_data materialize_mapped_data map_batches_kwargs iter_batches_kwargs "
        "prelearner_class prelearner_buffer_class prelearner_buffer_kwargs "
        "prelearner_module_synch_period prelearner_use_recorded_module_states dataset_num_iters_per_learner "
        "dataset_num_iters_per_eval_runner offline_data_class offline_sampling offline_loss_for_module_fn "
        "offline_evaluation_interval offline_evaluation_parallel_to_training offline_evaluation_duration "
        "offline_evaluation_timeout_s offline_evaluation_type offline_eval_runner_class "
        "offline_eval_batch_size_per_runner offline_eval_rl_module_inference_only "
        "offline_eval_runner_health_probe_timeout_s offline_eval_runner_restore_timeout_s num_offline_eval_runners "
        "num_cpus_per_offline_eval_runner num_gpus_per_offline_eval_runner custom_resources_per_offline_eval_runner "
        "max_requests_in_flight_per_offline_eval_runner restart_failed_offline_eval_runners "
        "ignore_offline_eval_runner_failures max_num_offline_eval_runner_restarts "
        "validate_offline_eval_runners_after_construction broadcast_offline_eval_runner_states "
        "shuffle_buffer_size output output_config output_compress_columns output_max_file_size "
        "output_max_rows_per_file output_write_remaining_data output_write_method output_write_method_kwargs "
        "output_filesystem output_filesystem_kwargs output_write_episodes",
    ),
    **_fields(
        _MULTI_AGENT,
        "policies policy_map_capacity policy_mapping_fn policies_to_train policy_states_are_swappable "
        "count_steps_by policy_map_cache checkpoint_trainable_policies_only",
    ),
    **_fields(
        _CONNECTORS,
        "_env_to_module_connector _module_to_env_connector _learner_connector "
        "add_default_connectors_to_env_to_module_pipeline add_default_connectors_to_module_to_env_pipeline "
        "add_default_connectors_to_learner_pipeline",
    ),
    **_fields(_EXPLORATION, "explore exploration_config _prior_exploration_config"),
    **_fields(_BATCH, "train_batch_size _train_batch_size_per_learner replay_sequence_length"),
    **_fields(_EPOCHS, "num_epochs minibatch_size shuffle_batch_per_epoch"),
    **_fields(
        _FAULT,
        "restart_failed_env_runners ignore_env_runner_failures max_num_env_runner_restarts "
        "delay_between_env_runner_restarts_s restart_failed_sub_environments "
        "num_consecutive_env_runner_failures_tolerance env_runner_health_probe_timeout_s "
        "env_runner_restore_timeout_s",
    ),
    **_fields(_CHECKPOINT, "_use_msgpack_checkpoints"),
    **_fields(
        _EPISODE_CALLBACKS,
        "callbacks_on_episode_created callbacks_on_episode_start callbacks_on_episode_step callbacks_on_episode_end "
        "callbacks_on_environment_created callbacks_on_env_runners_recreated callbacks_on_evaluate_offline_start "
        "callbacks_on_evaluate_offline_end callbacks_on_offline_eval_runners_recreated",
    ),
    **_fields(
        _ITERATION,
        "min_time_s_per_iteration min_train_timesteps_per_iteration min_sample_timesteps_per_iteration",
    ),
    **_fields(
        _REPORTING,
        "keep_per_episode_custom_metrics metrics_episode_collection_timeout_s metrics_num_episodes_for_smoothing "
        "stats_cls_lookup log_sys_usage fake_sampler",
    ),
    **_fields(
        _RESOURCES,
        "num_gpus extra_python_environs_for_driver extra_python_environs_for_worker",
    ),
    **_fields(
        _DEPRECATED,
        "buffer_size collect_metrics_timeout evaluation_num_episodes input_evaluation "
        "learning_starts metrics_smoothing_episodes min_iter_time_s min_sample_timesteps_per_reporting "
        "min_time_s_per_reporting min_train_timesteps_per_reporting monitor prioritized_replay "
        "prioritized_replay_alpha prioritized_replay_beta prioritized_replay_eps replay_batch_size replay_mode "
        "timesteps_per_iteration",
    ),
}


@functools.cache
def rllib_defaults() -> dict[str, Any]:
    """The value of every field in a fresh RLlib ``AlgorithmConfig``."""
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    return dict(vars(AlgorithmConfig()))


@functools.cache
def _defaults_via_dict() -> dict[str, Any]:
    """The defaults after RLlib's dict path (Tune's): to_dict() writes some in another form (policies as tuples)."""
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    return dict(vars(AlgorithmConfig().update_from_dict(AlgorithmConfig().to_dict())))


#: Values RLlib's own validate() writes into a field (so a config validated twice is not refused the second time).
_SET_BY_RLLIB_VALIDATE: dict[str, tuple[Any, ...]] = {"simple_optimizer": (False,)}


def same_value(a: Any, b: Any) -> bool:
    """``a == b`` as a truth value; values whose ``==`` is not one (arrays) count as different."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality (arrays, spaces) count as changed
        return False


def check_unused_fields(config: Any, where: str) -> None:
    """Refuse the first field arpo does not read whose value differs from RLlib's default, naming arpo's equivalent."""
    defaults, via_dict = rllib_defaults(), _defaults_via_dict()
    for field, hint in REFUSED.items():
        value = getattr(config, field, defaults[field])
        accepted = (defaults[field], via_dict.get(field, defaults[field]), *_SET_BY_RLLIB_VALIDATE.get(field, ()))
        if not any(same_value(value, ok) for ok in accepted):
            raise ConfigError(
                f"{where}: RLlib's {field} = {value!r:.80} would change nothing in arpo, so it is refused", hint=hint
            )


#: The callbacks arpo fires (docs/howto/rllib.md#callbacks); RLlib's others belong to machinery arpo does not run.
FIRED_CALLBACKS = (
    "on_algorithm_init",
    "on_sample_end",
    "on_train_result",
    "on_evaluate_start",
    "on_evaluate_end",
    "on_checkpoint_loaded",
)


def check_callbacks(callbacks_class: Any, where: str) -> None:
    """Refuse a callbacks class that overrides a callback arpo never fires (episode, env-runner, policy ones)."""
    from ray.rllib.callbacks.callbacks import RLlibCallback

    classes = callbacks_class if isinstance(callbacks_class, list | tuple) else [callbacks_class]
    never = [m for m in dir(RLlibCallback) if m.startswith("on_") and m not in FIRED_CALLBACKS]
    for cls in classes:
        if not isinstance(cls, type):
            continue
        overridden = [m for m in never if getattr(cls, m, None) is not getattr(RLlibCallback, m)]
        if overridden:
            raise ConfigError(
                f"{where}: {cls.__name__} overrides {', '.join(overridden)}, which arpo never calls",
                hint=f"{_EPISODE_CALLBACKS}; arpo fires {', '.join(FIRED_CALLBACKS)}",
            )
