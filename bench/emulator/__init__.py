"""Emulated vLLM instance: an OpenAI-compatible HTTP server driven by ``predictor.sim`` in real time.

Modules: ``server`` (aiohttp app and the ``astrolabe emulator`` CLI), ``engine_loop`` (wall-clock driver of
``predictor.sim.Scheduler``), ``openai_api`` (request parsing, response shaping), ``metrics`` (vLLM V1
Prometheus names). Kept import-free so that ``import bench.emulator`` loads nothing heavy.
"""
