"""Moved to ``dspark_trt.checkpoints.loaders``; this name stays for ``dspark_trt.train`` until it imports that."""
from ..checkpoints.loaders import *  # noqa: F401,F403
