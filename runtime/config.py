"""Engine configuration: frozen dataclasses validated once, in `__post_init__`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from plait.runtime.protocol import JSON_WHITESPACE

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_POLICIES = ("lpm", "fcfs", "dfs-weight")
_QUANTIZATIONS = ("float32", "int8", "int4")
_KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def parse_size(name: str, value: str | int) -> int:
    """Bytes from an int or a string such as "20G", "512M", "1.5T" (binary units)."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected bytes or a size such as 20G, got {value!r}")
    if isinstance(value, int):
        number, unit = float(value), ""
    else:
        text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in _SIZE_UNITS else ""
        try:
            number = float(text[: len(text) - len(unit)])
        except ValueError:
            raise ValueError(
                f"{name}: expected bytes or a size such as 20G, got {value!r}"
            ) from None
    size = int(number * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"{name}: must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class ModelConfig:
    model_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    context_length: int | None = None
    # weights: None (a GGUF's blocks where the kernels read them, on the CPU; else the checkpoint's
    # dtype), float32 (every block dequantized), int8 / int4 (weight-only quantization)
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in _QUANTIZATIONS:
            raise ValueError(
                f"quantization: expected None or one of {', '.join(_QUANTIZATIONS)}, "
                f"got {self.quantization!r}"
            )
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length: must be positive, got {self.context_length}")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 1
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    disable_radix_cache: bool = False
    # "auto" (the model's dtype; bfloat16 for int8/int4 weights on the CPU), float32, bfloat16,
    # int8 (scaled)
    kv_cache_dtype: str = "auto"
    # tiers below the pool (runtime/kv_tiers/): a directory of KV blocks and its size limit, and
    # a Redis server shared between engines
    kv_disk: str | None = None
    kv_disk_size: str | int = "20G"
    kv_redis: str | None = None

    @property
    def kv_disk_bytes(self) -> int:
        return parse_size("kv_disk_size", self.kv_disk_size)

    @property
    def kv_tiers(self) -> bool:
        return self.kv_disk is not None or self.kv_redis is not None

    def __post_init__(self) -> None:
        self.kv_disk_bytes  # noqa: B018 (validates the size)
        if self.kv_disk is not None and not str(self.kv_disk).strip():
            raise ValueError("kv_disk: expected a directory, got an empty path")
        if self.kv_redis is not None and not str(self.kv_redis).startswith(_REDIS_SCHEMES):
            raise ValueError(
                f"kv_redis: expected a URL such as redis://host:6379/0, got {self.kv_redis!r}"
            )
        if self.kv_tiers and self.disable_radix_cache:
            name = "kv_disk" if self.kv_disk is not None else "kv_redis"
            raise ValueError(f"{name}: KV tiers need the radix cache (disable_radix_cache is set)")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: expected one of {', '.join(_KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not isinstance(self.page_size, int) or not 1 <= self.page_size <= 1024:
            raise ValueError(f"page_size: must be an integer in [1, 1024], got {self.page_size!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"max_total_tokens: must be at least page_size ({self.page_size}), "
                f"got {self.max_total_tokens}"
            )
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(
                f"mem_fraction_static: must be in (0, 1), got {self.mem_fraction_static}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    schedule_policy: str = "lpm"
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int = 2048
    max_queued_requests: int | None = None
    # decode steps (greedy or sampled) run back to back in one native call when nothing else is
    # queued (CPU)
    num_continuous_decode_steps: int = 16

    def __post_init__(self) -> None:
        if self.schedule_policy not in _POLICIES:
            raise ValueError(
                f"schedule_policy: expected one of {', '.join(_POLICIES)}, "
                f"got {self.schedule_policy!r}"
            )
        for name in (
            "max_running_requests",
            "max_prefill_tokens",
            "chunked_prefill_size",
            "num_continuous_decode_steps",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(
                f"max_queued_requests: must be positive, got {self.max_queued_requests}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    random_seed: int = 0
    check_invariants: bool = False  # verify page accounting and the tree after every step (tests)
    grammar_backend: str = "auto"  # constrained decoding: "auto" or a registered backend name
    grammar_compile_timeout: float = 30.0  # seconds a request waits for its constraint (then 400)
    grammar_compile_memory_mb: int = (
        4096  # a child process builds indexes under this; 0: in process
    )
    disable_jump_forward: bool = False
    json_whitespace: str = "conventional"  # JSON spacing: "conventional", "compact" or "flexible"
    json_max_digit_run: int = (
        24  # digits in a row under a JSON schema, where the schema allows fewer; 0: off
    )
    json_max_whitespace_run: int = 16  # whitespace characters in a row under a JSON schema; 0: off
    budget_closing: bool = True  # constrained requests near max_new_tokens close to a valid end
    speculative_algorithm: str | None = None  # None, "ngram", "self" or "draft_model"
    speculation: str = "auto"  # with a drafter: "auto" (measured per batch size), "always", "never"
    num_draft_tokens: int = 4
    draft_model_path: str | None = None
    draft_layers: int | None = None  # "self": draft with the target's first layers
    tp_size: int = 1  # tensor parallelism: ranks (processes) the model is sharded over
    cpu_threads: int | None = None  # None: every core, small steps may run on one; N: exactly N
    # batch-invariant inference: a request's logits do not depend on what runs beside it
    # (docs/engine.md, "Deterministic mode")
    deterministic: bool = False

    def __post_init__(self) -> None:
        algos = (None, "ngram", "self", "draft_model")
        if self.speculative_algorithm not in algos:
            raise ValueError(
                f"speculative_algorithm: expected one of None, ngram, self, draft_model, "
                f"got {self.speculative_algorithm!r}"
            )
        if self.speculation not in ("auto", "always", "never"):
            raise ValueError(
                f"speculation: expected one of auto, always, never, got {self.speculation!r}"
            )
        if self.speculation == "always" and self.speculative_algorithm is None:
            raise ValueError("speculation: 'always' needs a speculative_algorithm")
        if self.cpu_threads is not None and (
            isinstance(self.cpu_threads, bool)
            or not isinstance(self.cpu_threads, int)
            or self.cpu_threads < 1
        ):
            raise ValueError(
                f"cpu_threads: must be a positive integer or None, got {self.cpu_threads!r}"
            )
        if not 1 <= self.num_draft_tokens <= 32:
            raise ValueError(f"num_draft_tokens: must be in [1, 32], got {self.num_draft_tokens}")
        if self.speculative_algorithm == "draft_model" and not self.draft_model_path:
            raise ValueError("draft_model_path: required with speculative_algorithm='draft_model'")
        if self.grammar_compile_memory_mb < 0:
            raise ValueError(
                f"grammar_compile_memory_mb: must be >= 0, got {self.grammar_compile_memory_mb}"
            )
        if not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout: must be positive, got {self.grammar_compile_timeout}"
            )
        if self.json_whitespace not in JSON_WHITESPACE:
            raise ValueError(
                f"json_whitespace: expected one of {', '.join(JSON_WHITESPACE)}, "
                f"got {self.json_whitespace!r}"
            )
        for name in ("json_max_digit_run", "json_max_whitespace_run"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"{name}: must be a non-negative integer (0 is off), got {value!r}"
                )
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"draft_layers: must be positive, got {self.draft_layers}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size: must be a positive integer, got {self.tp_size!r}")
        if self.tp_size > 1 and self.model.quantization not in (None, "float32"):
            raise ValueError("tp_size: tensor parallelism does not support quantization yet")
        if self.tp_size > 1 and self.cache.kv_tiers:
            raise ValueError(
                "tp_size: tensor parallelism does not support KV tiers (kv_disk, kv_redis) yet"
            )
        if self.deterministic and self.speculative_algorithm and self.speculation == "auto":
            raise ValueError(
                "deterministic: with a speculative_algorithm, set speculation to 'always' or "
                "'never' ('auto' drafts where measured speeds say so, so which steps verify, and "
                "a seeded sample's draws, would depend on timing)"
            )
        if self.tp_size > 1 and self.deterministic:
            raise ValueError("deterministic: tensor parallelism does not support it yet")
        if self.tp_size > 1 and self.speculative_algorithm is not None:
            raise ValueError(
                "tp_size: tensor parallelism does not support speculative decoding yet"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Route flat keyword arguments (`page_size=16`, `dtype="float32"`) to their sub-config."""
        groups: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}}
        own = {
            "random_seed",
            "check_invariants",
            "grammar_backend",
            "grammar_compile_timeout",
            "grammar_compile_memory_mb",
            "disable_jump_forward",
            "json_whitespace",
            "json_max_digit_run",
            "json_max_whitespace_run",
            "budget_closing",
            "speculative_algorithm",
            "speculation",
            "num_draft_tokens",
            "draft_model_path",
            "draft_layers",
            "tp_size",
            "cpu_threads",
            "deterministic",
        }
        top: dict[str, Any] = {}
        owners = {
            name: group
            for group, klass in (
                ("model", ModelConfig),
                ("cache", CacheConfig),
                ("scheduler", SchedulerConfig),
            )
            for name in (f.name for f in fields(klass))
        }
        for key, value in kwargs.items():
            if key in owners:
                groups[owners[key]][key] = value
            elif key in own:
                top[key] = value
            else:
                known = sorted([*owners, *own])
                raise TypeError(
                    f"Engine: unknown argument {key!r}; known arguments are {', '.join(known)}"
                )
        return cls(
            model=ModelConfig(**groups["model"]),
            cache=CacheConfig(**groups["cache"]),
            scheduler=SchedulerConfig(**groups["scheduler"]),
            **top,
        )
