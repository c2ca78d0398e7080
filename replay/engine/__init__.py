"""The reference engine: an OpenAI-compatible server with real batching, compute and tracing.

It stands in for vLLM, SGLang or llama.cpp where no GPU engine is at hand, and reproduces how they
treat clients that disconnect, bugs included (``--behavior``). :func:`replay.engine.launch.running_engine`
starts one in a subprocess for tests, the demo and replay.
"""
