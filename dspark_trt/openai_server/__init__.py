"""OpenAI-compatible HTTP front end (``dspark-trt serve``, the default front end).

One background thread (``engine.EngineThread``) owns a continuous-batching ``Scheduler``; the
FastAPI app (``app.build_app``) admits requests from many HTTP clients into it and streams text
back. Modules, one job each: ``errors`` (OpenAI-style error bodies), ``protocol`` (request
validation), ``chat_template`` (jinja2 chat templates), ``detokenizer`` (incremental decoding),
``stop_strings`` (stop-string matching on decoded text), ``metrics`` (Prometheus),
``middleware`` (body size limit, API key), ``engine``, ``app`` and ``launch`` (uvicorn).
"""
