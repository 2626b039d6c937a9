"""HF checkpoints: safetensors files (``files``), per-architecture loaders and name remaps
(``qwen3``, ``v4``, picked by ``loaders.load_pair``), quantisation formats (``quant``), and
``prepare.prepare_models`` shared by the runtime and the builder. Imports config, models and
parallel; never builder or runtime."""
