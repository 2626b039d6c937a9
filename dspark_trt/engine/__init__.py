"""The engine directory format, shared by the builder (writes it) and the runtime (reads it):
``manifest`` (manifest.json, checksums, checks on load), ``caches`` (the KV-cache layout),
``networks`` (loading the compiled AOTI packages / TensorRT plans). Never imports builder or runtime."""
