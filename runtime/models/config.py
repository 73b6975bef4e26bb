"""ModelConfig and its parser live in the family registry (ktlayouts.families), shared with the converter; this
module keeps ktrun's old import path working (ktrun.models.config.ModelConfig, ConfigError, load_config)."""
from ktlayouts.families import ConfigError, ModelConfig, RopeConfig, load_config, parse_config, yarn_mscale

__all__ = ["ConfigError", "ModelConfig", "RopeConfig", "load_config", "parse_config", "yarn_mscale"]
