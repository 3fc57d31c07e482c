"""Simulation core: THE model of one vLLM V1 engine instance (scheduler, KV blocks, step time, virtual clock).

Pure Python + numpy: no asyncio, no grpc, no I/O except reading/writing batch-time model files. Users: the vLLM
emulator (drives `Scheduler` in real time), the predictor and the cluster benchmark (`Engine`, virtual time).
"""

from predictor.sim.batch_time import (
    BatchTimeModel,
    LinearBatchTimeModel,
    ProfileRow,
    fit_linear,
    known_models,
    load_profile,
    mape,
)
from predictor.sim.engine import Engine, StepResult, measure_capacity_qps
from predictor.sim.kv_blocks import BlockPool, blocks_for_tokens
from predictor.sim.request import RequestStatus, SimRequest
from predictor.sim.scheduler import EngineConfig, ScheduledBatch, Scheduler, StepOutput

__all__ = [
    "BatchTimeModel",
    "BlockPool",
    "Engine",
    "EngineConfig",
    "LinearBatchTimeModel",
    "ProfileRow",
    "RequestStatus",
    "ScheduledBatch",
    "Scheduler",
    "SimRequest",
    "StepOutput",
    "StepResult",
    "blocks_for_tokens",
    "fit_linear",
    "known_models",
    "load_profile",
    "mape",
    "measure_capacity_qps",
]
