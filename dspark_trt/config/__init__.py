"""Model configs, presets, the dtype table and ``ModelSource`` (what to load, and how).

``checks`` (``ConfigError``) <- ``qwen3``, ``v4`` (the configs) <- ``pair`` <- ``presets``; nothing
here imports the rest of the package.
"""
from .checks import ConfigError, read_json
from .pair import ModelPair
from .presets import PRESETS, get_preset, register_preset
from .qwen3 import DSparkConfig, Qwen3Config
from .v4 import DeepSeekV4Config, DSparkV4Config, YarnScaling

__all__ = ["ConfigError", "read_json", "ModelPair", "PRESETS", "get_preset", "register_preset",
           "DSparkConfig", "Qwen3Config", "DeepSeekV4Config", "DSparkV4Config", "YarnScaling"]
