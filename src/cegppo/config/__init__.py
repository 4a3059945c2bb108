"""Run configuration: the schema (:mod:`.schema`, every key documented there), loading YAML plus dotted
``key=value`` overrides (:mod:`.loading`), validation before any model loads (:mod:`.validation`), and the checks
that need the loaded data or tokenizer (:mod:`.data_checks`). This package imports no engine, data or reporting
module: names only the data layer knows (the built-in tasks) are checked there (:func:`cegppo.data.tasks.check_task`).
"""

from cegppo.config.data_checks import check_data, check_prompt_budget, prompt_budget_cuts
from cegppo.config.loading import (MAX_BASE_DEPTH, MAX_CONFIG_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES, load_config,
                                   load_yaml, parse_overrides, read_config_text, save_config)
from cegppo.config.schema import (AlgorithmConfig, Config, DataConfig, EvalConfig, LoggingConfig, ModelConfig,
                                  OptimConfig, RewardConfig, RolloutConfig, SFTConfig, TrainConfig)
from cegppo.config.validation import (CLI_EVAL_KEYS, EVAL_KEYS, GROUP_ESTIMATORS, MAX_INT, MAX_TIMEOUT_S,
                                      check_batch_tokens, check_eval_settings, check_type, eval_limit, validate)
from cegppo.errors import MAX_MESSAGE_CHARS, ConfigError, show

__all__ = [
    "AlgorithmConfig", "CLI_EVAL_KEYS", "Config", "ConfigError", "DataConfig", "EVAL_KEYS", "EvalConfig",
    "GROUP_ESTIMATORS", "LoggingConfig", "MAX_BASE_DEPTH", "MAX_CONFIG_BYTES", "MAX_INT", "MAX_MESSAGE_CHARS",
    "MAX_TIMEOUT_S", "MAX_YAML_DEPTH", "MAX_YAML_NODES", "ModelConfig", "OptimConfig", "RewardConfig",
    "RolloutConfig", "SFTConfig", "TrainConfig", "check_batch_tokens", "check_data", "check_eval_settings", "check_prompt_budget",
    "check_type", "eval_limit", "load_config", "load_yaml", "parse_overrides", "prompt_budget_cuts",
    "read_config_text", "save_config", "show", "validate",
]
