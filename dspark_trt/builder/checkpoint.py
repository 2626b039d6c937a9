"""Moved to ``dspark_trt.checkpoints.files``; this name stays for ``dspark_trt.train`` until it imports that."""
from ..checkpoints.files import *  # noqa: F401,F403
