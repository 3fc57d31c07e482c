"""The engine-limit flags (vLLM's names, meanings and units), shared by every command that models an engine.

Owns: `add_engine_arguments` (the flags, in one argument group, with help that says what each limit means in vLLM
and its unit, and which scheduler rules to model) and `engine_from_args` (the ``EngineConfig`` they give). Used by
the predictor sidecar, the emulator and the cluster benchmark, so that the same flag means the same thing
everywhere. Imports only argparse and ``predictor.sim``.

Source: vLLM ``vllm/engine/arg_utils.py`` ``EngineArgs`` (``--max-num-seqs``, ``--max-num-batched-tokens``,
``--block-size``, ``--num-gpu-blocks-override``, ``--enable-chunked-prefill`` / ``--no-enable-chunked-prefill``)
and ``vllm/v1/core/sched/scheduler.py`` for how the scheduler applies them (``--scheduling-policy``:
``vllm/config/scheduler.py`` ``SchedulerConfig.policy``); ``--scheduling sglang`` models SGLang's
scheduler instead (``predictor.sim.scheduler``; SGLang's knobs map onto the same flags: ``--max-running-requests``
-> ``--max-num-seqs``, ``--chunked-prefill-size`` -> ``--max-num-batched-tokens``, ``--page-size`` ->
``--block-size``, ``max_total_num_tokens / page_size`` -> ``--num-gpu-blocks``).
"""

from __future__ import annotations

import argparse

from predictor.sim import EngineConfig
from predictor.sim.scheduler import SCHEDULING_POLICIES, SCHEDULING_STYLES


def add_engine_arguments(parser: argparse.ArgumentParser, defaults: EngineConfig | None = None,
                         kv_note: str = "", scheduling_note: str | None = None) -> None:
    """Adds ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--block-size``, ``--num-gpu-blocks``,
    ``--enable-chunked-prefill`` / ``--no-enable-chunked-prefill``, ``--scheduling`` and ``--scheduling-policy``
    (dests: the ``EngineConfig`` field names).

    Args:
        parser: the command's parser.
        defaults: the flags' defaults; None = ``EngineConfig()``.
        kv_note: appended to the help of the two KV-cache flags (e.g. where the command reads them instead).
        scheduling_note: given, ``--scheduling`` defaults to None (the command decides, e.g. from its backend) and
            this text says how; `engine_from_args` then reads None as the ``defaults``' rules.
    """
    defaults = EngineConfig() if defaults is None else defaults
    group = parser.add_argument_group("engine limits", "the instance's vLLM settings, with vLLM's names and meanings")
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                       help="vLLM --max-num-seqs: most requests in the engine's running batch at once, requests")
    group.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                       help="vLLM --max-num-batched-tokens: token budget of one engine step (prefill chunks plus "
                            "one token per decoding request), tokens; >= --max-num-seqs")
    group.add_argument("--block-size", type=int, default=defaults.block_size,
                       help="vLLM --block-size: tokens per KV-cache block, tokens" + kv_note)
    group.add_argument("--num-gpu-blocks", type=int, default=defaults.num_gpu_blocks,
                       help="vLLM's num_gpu_blocks (the '# GPU blocks' it logs at start; --num-gpu-blocks-override "
                            "sets it): KV-cache blocks of the instance, blocks" + kv_note)
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=defaults.enable_chunked_prefill,
                       help="vLLM --enable-chunked-prefill: a prompt larger than a step's remaining token budget is "
                            "prefilled over several steps; without it, it waits until it fits whole")
    group.add_argument("--scheduling", choices=SCHEDULING_STYLES,
                       default=defaults.scheduling if scheduling_note is None else None,
                       help=(scheduling_note or "") + "the backend's scheduler rules: vllm-v1 (one token budget "
                            "mixes prefill chunks and decodes; the last running request is preempted when KV runs out) or sglang (a step "
                            "is a prefill batch or a decode batch, never both; admission reserves KV for the running "
                            "requests' remaining max_new_tokens x new_token_ratio; decode retracts requests when KV "
                            "runs out). With sglang the limits are SGLang's: --max-num-seqs = "
                            "--max-running-requests, --max-num-batched-tokens = --chunked-prefill-size (a multiple "
                            "of --block-size = --page-size), --num-gpu-blocks = max_total_num_tokens / page_size")
    group.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=defaults.scheduling_policy,
                       help="vLLM --scheduling-policy: fcfs (first come, first served) or priority (the waiting "
                            "queue by each request's 'priority' body field, lower first, then arrival; a preemption "
                            "takes the running request with the largest (priority, arrival)); vllm-v1 only")


def engine_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of the flags `add_engine_arguments` added.

    Raises:
        ValueError: a limit out of range (``EngineConfig`` names it).
    """
    return EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                        enable_chunked_prefill=args.enable_chunked_prefill,
                        scheduling=args.scheduling or EngineConfig().scheduling,
                        scheduling_policy=args.scheduling_policy)
