"""A stand-in for the few vLLM V1 scheduler attributes the plugin reads (vLLM is not installed in .venv).

The real attributes are exercised by tests/vllm/ against a running vLLM; these fakes carry the same names
(vllm/v1/core/sched/scheduler.py Scheduler, vllm/v1/request.py Request, vllm 0.32).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FakeSamplingParams:
    max_tokens: int | None = None


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    sampling_params: FakeSamplingParams = field(default_factory=FakeSamplingParams)
    priority: int = 0
    arrival_time: float = 0.0  # time.time() seconds, as vLLM's Request


class FakeBlockPool:
    def __init__(self, num_gpu_blocks: int, num_free_blocks: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.num_free_blocks = num_free_blocks

    def get_num_free_blocks(self) -> int:
        return self.num_free_blocks


class FakeKVCacheManager:
    def __init__(self, block_pool: FakeBlockPool, blocks: dict[str, int]) -> None:
        self.block_pool = block_pool
        self.blocks = blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return (list(range(self.blocks.get(request_id, 0))),)


@dataclass
class FakeSchedulerConfig:
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # vllm/config/scheduler.py SchedulerConfig.policy: "fcfs" | "priority"


@dataclass
class FakeCacheConfig:
    block_size: int = 16


class FakeScheduler:
    def __init__(self, running, waiting, *, num_gpu_blocks=65, num_free_blocks=40, blocks=None,
                 max_num_seqs=8, max_num_batched_tokens=256) -> None:
        self.running = list(running)
        self.waiting = list(waiting)
        self.max_num_running_reqs = max_num_seqs
        self.max_num_scheduled_tokens = max_num_batched_tokens
        self.scheduler_config = FakeSchedulerConfig()
        self.cache_config = FakeCacheConfig()
        self.kv_cache_manager = FakeKVCacheManager(FakeBlockPool(num_gpu_blocks, num_free_blocks), blocks or {})
