"""Sub-commands of ``dspark-trt``; see ``dspark_trt.cli.COMMANDS``."""
