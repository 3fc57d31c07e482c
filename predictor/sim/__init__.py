"""Simulation core: THE model of one vLLM V1 engine instance (scheduler, KV blocks, step time, virtual clock).

Pure Python + numpy: no asyncio, no grpc, no I/O except reading/writing batch-time model files. Users: the vLLM
emulator (drives `Scheduler` in real time), the predictor (`predict`, from an `InstanceSnapshot`) and the
cluster benchmark (`Engine`, virtual time).
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
from predictor.sim.block_hash import block_key, block_keys
from predictor.sim.engine import Engine, StepResult, measure_capacity_qps
from predictor.sim.kv_blocks import BlockPool, blocks_for_tokens
from predictor.sim.prefix_cache import PrefixCachePool
from predictor.sim.predict import Prediction, predict, predict_by_stepping
from predictor.sim.request import RequestStatus, SimRequest
from predictor.sim.scheduler import EngineConfig, ScheduledBatch, Scheduler, StepOutput
from predictor.sim.snapshot import InstanceSnapshot, RequestState

__all__ = [
    "BatchTimeModel",
    "BlockPool",
    "Engine",
    "EngineConfig",
    "InstanceSnapshot",
    "LinearBatchTimeModel",
    "Prediction",
    "PrefixCachePool",
    "ProfileRow",
    "RequestState",
    "RequestStatus",
    "ScheduledBatch",
    "Scheduler",
    "SimRequest",
    "StepOutput",
    "StepResult",
    "block_key",
    "block_keys",
    "blocks_for_tokens",
    "fit_linear",
    "known_models",
    "load_profile",
    "mape",
    "predict",
    "predict_by_stepping",
    "measure_capacity_qps",
]
