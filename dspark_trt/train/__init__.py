"""Training of the built-in default pair: a small Qwen3 target on the Python standard library, its
DSpark draft, and the DFlash and autoregressive baselines (``dspark-trt train``).

corpus (stdlib files, split by module) -> tokenizer (byte-level BPE) -> batches -> dense forwards
(cache-free, same modules as the runtime) -> objective (next-token CE; DSpark block loss) -> loop
-> checkpoints; ``ar_eval`` simulates speculative decoding with the autoregressive draft.
"""
