"""Moved to ``dspark_trt.checkpoints.qwen3``; this name stays for ``dspark_trt.train`` until it imports that."""
from ..checkpoints.qwen3 import *  # noqa: F401,F403
