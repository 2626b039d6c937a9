"""Builder: export of the prepared modules to engines (backends: aoti, tensorrt); checkpoints live in ``checkpoints/``, the engine format in ``engine/``."""
