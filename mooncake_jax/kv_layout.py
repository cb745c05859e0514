"""The layout of a KV block as an instance stores and sends it, and which layouts can exchange KV.

Every instance describes its blocks with one ``KVLayout`` (registered with the Conductor, and sent with every
request's KV from prefill to decode), so prefill and decode instances may differ in tensor parallelism, pipeline
stages, page size and dtype: the receiver converts (``transfer/relayout.py``). What no conversion can bridge (a
different layer count, KV head count or head_dim: another model) is refused when the instance registers, never
when a request's KV is already on its way.

Pure Python (no JAX): the Conductor imports it.
"""

from __future__ import annotations

import dataclasses
import json

KV_DTYPES = ("float32", "bfloat16", "float16")
"""dtypes a KV block may travel in (the engine's KV cache dtypes)."""


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """One instance's KV block: ``[layers, 2 (K, V), block_size, kv_heads, head_dim]`` of ``dtype`` on the wire
    (heads and layers gathered), plus how the sender's engine splits them: its KV heads over ``tensor`` devices
    and its layers into ``stage_layers`` (layer count per pipeline stage)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    tensor: int = 1
    stage_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("n_layers", "n_kv_heads", "head_dim", "block_size", "tensor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KV layout {name} must be a positive integer, got {value!r}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV layout dtype {self.dtype!r} is not one of {KV_DTYPES}")
        stages = tuple(self.stage_layers) or (self.n_layers,)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in stages) \
                or sum(stages) != self.n_layers:
            raise ValueError(f"KV layout stage_layers {list(stages)} must be positive and sum to the "
                             f"{self.n_layers} layers")
        object.__setattr__(self, "stage_layers", stages)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.n_layers, 2, self.block_size, self.n_kv_heads, self.head_dim)

    @property
    def stages(self) -> int:
        return len(self.stage_layers)

    def stage_ranges(self) -> list[tuple[int, int]]:
        """[start, stop) layers of every stage."""
        out, start = [], 0
        for n in self.stage_layers:
            out.append((start, start + n))
            start += n
        return out

    def head_groups(self) -> list[tuple[int, int]]:
        """[start, stop) KV heads each tensor-parallel device holds: an even split when ``tensor`` divides the
        heads, else each device holds the one head its query heads read (heads replicated over devices)."""
        h, t = self.n_kv_heads, self.tensor
        if h % t == 0:
            per = h // t
            return [(i * per, (i + 1) * per) for i in range(t)]
        if t % h == 0:
            return [(i * h // t, i * h // t + 1) for i in range(t)]
        raise ValueError(f"tensor={t} neither divides nor is a multiple of the {h} KV heads")

    def same_blocks(self, other: "KVLayout") -> bool:
        """Whether blocks of ``other`` are byte-for-byte blocks of this layout (no conversion needed)."""
        return self.block_shape == other.block_shape and self.dtype == other.dtype

    def describe(self) -> str:
        return (f"{self.dtype}[layers={self.n_layers}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"block={self.block_size}] tensor={self.tensor} stages={list(self.stage_layers)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"stage_layers": list(self.stage_layers)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, fields: dict) -> "KVLayout":
        if not isinstance(fields, dict):
            raise ValueError(f"a KV layout is an object, got {type(fields).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"unknown KV layout field(s) {unknown}; allowed: {sorted(names)}")
        try:
            return cls(**{**fields, "stage_layers": tuple(fields.get("stage_layers", ()))})
        except TypeError as e:
            raise ValueError(f"not a KV layout: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "KVLayout":
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a KV layout (bad JSON: {e}): {text[:200]!r}") from None
        return cls.from_dict(fields)


def exchange_problem(a: KVLayout, b: KVLayout) -> str | None:
    """Why KV of layout ``a`` cannot become KV of layout ``b`` (None when it can): layer count, KV heads and
    head_dim must agree; block size, dtype, tensor parallelism and stages are converted."""
    for name, what in (("n_layers", "layers"), ("n_kv_heads", "KV heads"), ("head_dim", "head_dim")):
        if getattr(a, name) != getattr(b, name):
            return (f"{what} differ: {getattr(a, name)} vs {getattr(b, name)} (KV is exchanged only between "
                    f"instances of one model: same layers, KV heads and head_dim)")
    return None
