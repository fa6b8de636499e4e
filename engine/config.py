"""The engine's settings (vLLM's names) and what follows from them once the model is known."""

from __future__ import annotations

import dataclasses
import numbers

from engine.core.block_manager import RESERVATIONS, BlockManagerConfig
from engine.core.scheduler import POLICIES, PREEMPTION_MODES, SchedulerConfig
from models import ModelConfig

# vLLM's dtype names → the weights' dtype. float16 runs where the platform computes it (a GPU).
DTYPES = {"auto": "float32", "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
          "float16": "float16", "half": "float16"}
FLOAT16_PLATFORMS = ("gpu", "cuda", "rocm")
_GIB = 2**30


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _at_least(value, low: int, optional: bool = False) -> bool:
    """An integer >= ``low`` (or None, when ``optional``)."""
    return (optional and value is None) or (_integer(value) and value >= low)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything a user can set; see ``LLM`` for the meaning of each field.

    ``model`` None is SmolLM2-135M-Instruct. ``dtype`` is the weights' (activations are
    float32); ``kv_cache_dtype`` the cache's. ``num_blocks`` fixes the device pool exactly;
    otherwise ``kv_cache_memory`` bytes decide it, or on a GPU or TPU
    ``gpu_memory_utilization`` of the device's memory less the weights and peak activations,
    and on a CPU 1 GiB (see :mod:`engine.worker.kv_cache_size`). ``swap_space`` is GiB
    of host blocks. ``max_num_batched_tokens`` (tokens per step; longer prompts are prefilled
    in chunks) defaults to max(2048, max_num_seqs). ``warmup`` compiles every step shape at
    start; without it each shape compiles the first time a step needs it.
    ``tensor_parallel_size`` splits the model over that many devices (see ``engine.worker.tensor_parallel``).
    ``async_scheduling`` dispatches a decode step before the previous one's tokens reach the
    host, where that cannot change what is generated (see ``engine.async_scheduling``).
    ``num_scheduler_steps`` > 1 runs that many decode steps in one dispatch, sampling on the
    device, whenever a step would only decode (see ``engine.multi_step``).
    ``stream_interval``: a streamed request (``output_kind`` cumulative or delta) gets its first
    token's output at once, then an output each time its longest sequence has grown by that
    many tokens, and its last when it ends (vLLM's): fewer outputs to build and deliver per step.
    ``generation_config``: "auto" takes the sampling defaults of the checkpoint's
    ``generation_config.json`` (``LLMEngine.default_sampling``; vLLM's), "vllm" ignores them.
    ``tokenizer``: another tokenizer (directory, hub ID or GGUF) than the model's.
    ``trust_remote_code``: accepted for vLLM's scripts; this engine runs no remote code either way,
    and a model that would need it is refused naming why. ``enforce_eager``: vLLM's switch
    off CUDA graphs; here it skips compiling every step shape at start (as ``warmup=False``),
    JAX always runs compiled programs. ``disable_log_stats``: no throughput and cache log line
    every ``log_stats_interval`` seconds. ``max_logprobs``: the most log-probabilities a request
    may ask for, per token and per prompt token (vLLM's 20).
    """

    model: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None
    preemption_mode: str | None = None
    reservation: str = "paged"
    policy: str = "fcfs"
    seed: int = 0
    warmup: bool = True
    tensor_parallel_size: int = 1
    async_scheduling: bool = True
    num_scheduler_steps: int = 1
    stream_interval: int = 1
    generation_config: str = "auto"
    tokenizer: str | None = None
    trust_remote_code: bool = False
    enforce_eager: bool = False
    disable_log_stats: bool = True
    log_stats_interval: float = 10.0
    max_logprobs: int = 20

    def __post_init__(self):
        for field in ("block_size", "num_blocks", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
                      "max_model_len", "seed", "tensor_parallel_size", "num_scheduler_steps", "stream_interval",
                      "max_logprobs"):
            value = getattr(self, field)  # NumPy integers are integers too
            if _integer(value) and type(value) is not int:
                object.__setattr__(self, field, int(value))
        checks = [
            (self.dtype in DTYPES, "dtype", f"one of {sorted(DTYPES)}", self.dtype),
            (self.kv_cache_dtype in DTYPES, "kv_cache_dtype", f"one of {sorted(DTYPES)}", self.kv_cache_dtype),
            (_integer(self.block_size) and self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size",
             "a power of two up to 256", self.block_size),
            (_at_least(self.num_blocks, 1, optional=True), "num_blocks", "None or an integer >= 1", self.num_blocks),
            (self.kv_cache_memory is None or (_number(self.kv_cache_memory) and self.kv_cache_memory >= 1),
             "kv_cache_memory", "None or a number of bytes >= 1", self.kv_cache_memory),
            (_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
             "gpu_memory_utilization", "a fraction of the device's memory in (0, 1]", self.gpu_memory_utilization),
            (_number(self.swap_space) and self.swap_space >= 0, "swap_space", "a number of GiB >= 0",
             self.swap_space),
            (_at_least(self.max_num_seqs, 1), "max_num_seqs", "an integer >= 1", self.max_num_seqs),
            (_at_least(self.max_num_batched_tokens, 1, optional=True), "max_num_batched_tokens",
             "None or an integer >= 1", self.max_num_batched_tokens),
            (_at_least(self.tensor_parallel_size, 1), "tensor_parallel_size", "an integer >= 1",
             self.tensor_parallel_size),
            (_at_least(self.max_model_len, 1, optional=True), "max_model_len", "None or an integer >= 1",
             self.max_model_len),
            (self.seed is None or _integer(self.seed), "seed", "an integer or None", self.seed),
            (self.preemption_mode in PREEMPTION_MODES, "preemption_mode", f"one of {PREEMPTION_MODES}",
             self.preemption_mode),
            (self.reservation in RESERVATIONS, "reservation", f"one of {RESERVATIONS}", self.reservation),
            (self.enable_prefix_caching in (None, True, False), "enable_prefix_caching", "None, True or False",
             self.enable_prefix_caching),
            (self.reservation == "paged" or not self.enable_prefix_caching, "reservation",
             "'paged' with enable_prefix_caching (the paper's Orca baselines have no prefix cache)",
             self.reservation),
            (self.policy in POLICIES, "policy", f"one of {POLICIES}", self.policy),
            (isinstance(self.async_scheduling, bool), "async_scheduling", "True or False", self.async_scheduling),
            (_at_least(self.num_scheduler_steps, 1), "num_scheduler_steps", "an integer >= 1 (1: a step per dispatch)",
             self.num_scheduler_steps),
            (_at_least(self.stream_interval, 1), "stream_interval",
             "an integer >= 1 (1: an output per token; more: one per that many tokens)", self.stream_interval),
            (self.tokenizer is None or isinstance(self.tokenizer, str), "tokenizer",
             "None (the model's) or a directory, hub ID or .gguf file", self.tokenizer),
            (isinstance(self.trust_remote_code, bool), "trust_remote_code", "True or False", self.trust_remote_code),
            (isinstance(self.enforce_eager, bool), "enforce_eager", "True or False", self.enforce_eager),
            (isinstance(self.disable_log_stats, bool), "disable_log_stats", "True or False", self.disable_log_stats),
            (_number(self.log_stats_interval) and self.log_stats_interval >= 0, "log_stats_interval",
             "a number of seconds >= 0", self.log_stats_interval),
            (_at_least(self.max_logprobs, 0), "max_logprobs", "an integer >= 0", self.max_logprobs),
            (self.generation_config in ("auto", "vllm"), "generation_config",
             "'auto' (the checkpoint's sampling defaults) or 'vllm' (SamplingParams' own)", self.generation_config),
        ]
        for ok, field, allowed, value in checks:
            if not ok:
                raise ValueError(f"{field} must be {allowed}, got {value!r}")

    @property
    def prefix_caching(self) -> bool:
        """``enable_prefix_caching``, where None is on for ``paged`` (vLLM's default) and off for
        the paper's Orca baselines, which have no prefix cache."""
        return self.reservation == "paged" if self.enable_prefix_caching is None else self.enable_prefix_caching

    @property
    def param_dtype(self) -> str:
        return DTYPES[self.dtype]

    @property
    def compiles_at_start(self) -> bool:
        """``warmup``, unless ``enforce_eager`` asks to skip it."""
        return self.warmup and not self.enforce_eager

    def check_platform(self, platform: str) -> None:
        """Refuse what ``platform`` (``jax.default_backend()``) cannot compute: float16 arithmetic
        runs on GPUs only (XLA:CPU emulates it, TPUs have none)."""
        for field, value in (("dtype", self.param_dtype), ("kv_cache_dtype", self.cache_dtype)):
            if value == "float16" and platform not in FLOAT16_PLATFORMS:
                raise ValueError(f"{field} float16 is not computed natively on {platform}; use 'bfloat16' (the "
                                 f"same memory) or 'float32'")

    @property
    def cache_dtype(self) -> str:
        """"auto" is the weights' dtype."""
        return self.param_dtype if self.kv_cache_dtype == "auto" else DTYPES[self.kv_cache_dtype]

    @property
    def batched_tokens(self) -> int:
        """``max_num_batched_tokens``, where None is max(2048, max_num_seqs)."""
        return max(2048, self.max_num_seqs) if self.max_num_batched_tokens is None else self.max_num_batched_tokens

    def model_len(self, model: ModelConfig) -> int:
        """Longest prompt plus output: the user's limit, or the model's (its positions, and its
        sliding window, if any: within the window, attending to the whole context is exact)."""
        if self.max_model_len and self.max_model_len > model.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's limit of "
                             f"{model.max_position_embeddings} positions; lower max_model_len")
        window = model.sliding_window
        if self.max_model_len and window and self.max_model_len > window:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's sliding window of {window} "
                             f"tokens; this engine attends to the whole context, which matches the model only "
                             f"within its window, so lower max_model_len to {window} or less")
        return self.max_model_len or min(model.max_position_embeddings, window or model.max_position_embeddings)

    def scheduler_config(self, model: ModelConfig, num_device_blocks: int, bytes_per_block: int) -> SchedulerConfig:
        """The scheduler's budgets. A sequence can never outgrow the device KV cache, so the
        context is at most what one sequence can hold there (:meth:`model_len` otherwise)."""
        blocks = BlockManagerConfig(
            block_size=self.block_size,
            num_device_blocks=num_device_blocks,
            num_host_blocks=int(self.swap_space * _GIB // bytes_per_block),
            enable_prefix_caching=self.prefix_caching,
            reservation=self.reservation,
            max_model_len=self.model_len(model),
        )
        blocks = dataclasses.replace(blocks, max_model_len=min(blocks.max_model_len, blocks.longest_sequence))
        return SchedulerConfig(
            max_num_batched_tokens=self.batched_tokens,
            max_model_len=blocks.max_model_len,
            max_num_seqs=self.max_num_seqs,
            preemption_mode=self.preemption_mode,
            policy=self.policy,
            block_manager=blocks,
            # What async scheduling's lookaheads need to cross block boundaries (not under a mesh,
            # where the engine runs without them).
            reserve_next_block=self.async_scheduling and self.tensor_parallel_size == 1,
        )
