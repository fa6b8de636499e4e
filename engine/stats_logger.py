"""The engine's periodic log line (vLLM's ``LoggingStatLogger``): throughput since the last
line, queues, KV-cache use and prefix-cache hits, every ``interval`` seconds while it works.
Off with ``disable_log_stats`` (``LLM``'s default, as vLLM's; the server logs unless
``--disable-log-stats``)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from engine.core.scheduler import SchedulerStats

log = logging.getLogger("engine.stats")


@dataclasses.dataclass
class StatsLogger:
    """Logs at most once per ``interval`` seconds; ``maybe_log`` is called after every step."""

    interval: float
    _last_time: float = dataclasses.field(default_factory=time.monotonic)
    _last_prompt: int = 0
    _last_generation: int = 0

    def maybe_log(self, counters, stats: Callable[[], SchedulerStats], now: float | None = None) -> str | None:
        """Log (and return) the line if ``interval`` has passed since the last one; ``counters``
        are the engine's totals (``EngineCounters``), ``stats()`` gives the scheduler's now. It is
        called only for a line: it walks every block table, which after every step would cost
        the host milliseconds at a few hundred sequences."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.interval or elapsed <= 0:
            return None
        prompt, generation = counters.prompt_tokens, counters.generation_tokens
        stats = stats()
        blocks = stats.blocks
        hit_rate = blocks.prefix_cache_hits / blocks.prefix_cache_queries if blocks.prefix_cache_queries else 0.0
        line = (f"Avg prompt throughput: {(prompt - self._last_prompt) / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {(generation - self._last_generation) / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"Swapped: {stats.num_swapped} reqs, KV cache usage: {100 * stats.kv_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * hit_rate:.1f}%, Preemptions: {stats.num_preemptions}")
        log.info(line)
        self._last_time, self._last_prompt, self._last_generation = now, prompt, generation
        return line
