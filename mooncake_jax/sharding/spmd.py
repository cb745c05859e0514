"""Chunked pipeline-parallel prefill as ONE SPMD program over a global (stage, tensor) mesh.

``pipeline.PipelineRunner`` dispatches every (stage, chunk) step from one Python process to that stage's local
devices: it cannot span hosts, where every process must run the same programs in the same order. Here the whole
prefill is one jitted program over all devices (of every process, under ``jax.distributed``):

- every stage holds its layers' parameters stacked on a leading ``stage`` axis (``[S, L/S, ...]``, sharded over
  ``stage``, then by the rules table over ``tensor``) and its layers' KV pages the same way (``[S, kv_heads,
  L/S * num_pages, block_size, head_dim]``);
- ``jax.shard_map`` is manual over ``stage`` only (``tensor`` stays automatic, so GSPMD partitions each stage's
  matmuls over its tensor devices exactly as in the single-process layout);
- a circular schedule of C + S - 1 steps: at step t stage s works on chunk t - s; its output hidden states move to
  stage s + 1 by ``lax.ppermute`` (the only cross-stage traffic, once per chunk and boundary, as in CPP). Steps where
  a stage has no chunk (pipeline fill and drain) still compute, but write their KV to the scratch page only;
- the last stage's outputs leave the ``shard_map`` and the head (final norm, LM head, sampling) runs on the whole
  mesh. Logits and sampled tokens come back fully replicated, so process 0 (the control plane) reads them locally.

Decode runs the same program with one "chunk" of B sequences (T = 1): the stages run in turn.

A prefill of n chunks runs the program of ``chunk_slots(n)`` chunk slots and its last chunk's context table: the
engine's warm-up compiles every such shape a request can hit (``Engine.stacked_prefill_shapes``), so a prompt
longer than one chunk never waits for XLA in a serving instance.

Layers need to split evenly over the stages (a stacked ``stage`` axis has one size); the attention implementation
is the portable ``xla`` one (a Pallas kernel inside the manual ``stage`` region is not wired here).

``SpmdRunner`` has ``PipelineRunner``'s interface (``run``, ``kv``, ``read_blocks``, ``write_blocks``,
``block_until_ready``) so ``model.engine.Engine`` drives it unchanged; with a ``StepChannel`` (``multiprocess.py``)
process 0 sends every operation to the other processes of the instance before running it, and they run it too.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from ..model.attention import SCRATCH_PAGE, PagedBatch
from ..model.config import ModelConfig
from ..model.kv_cache import kv_shape, zeros_program
from ..model.kv_scatter import LogicalPages, as_logical, logical_pages, set_at, storage_dtype
from ..model.llama import Llama, Stage, _slice_layers, stacked_layers
from ..model.sampling import sample_out
from .mesh import MESH_AXES, STAGE, MeshSpec
from .rules import KV_PAGE_AXES, spec_for


def global_mesh(spec: MeshSpec, devices=None) -> Mesh:
    """A (stage, tensor) mesh over ``spec.devices`` devices of every process, in ``jax.devices()`` order: the
    devices of one process are consecutive, so a process holds whole stages whenever it has a multiple of
    ``spec.tensor`` devices (cross-process traffic is then only the ``ppermute`` between stages)."""
    devices = list(jax.devices() if devices is None else devices)
    if spec.devices != len(devices):
        raise ValueError(f"SPMD mesh {spec} needs {spec.devices} devices; {len(devices)} exist "
                         f"over {jax.process_count()} process(es)")
    grid = np.array(devices, dtype=object).reshape(spec.stage, spec.tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def _put(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value every process holds whole (each process fills its own shards)."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _axes_of(var: nnx.Variable) -> tuple:
    return tuple(var.get_metadata().get("out_sharding") or (None,) * var.get_value().ndim)


class SpmdLayout:
    """``spec.stage`` stages x ``spec.tensor`` devices as one global mesh; the engine builds an ``SpmdRunner``.

    ``channel``: the instance's ``step_channel.StepChannel`` when it spans several processes (None: one process).
    Layers always run scanned inside a stage (``build_runner`` ignores ``scan``): one layer body per program.
    """

    def __init__(self, cfg: ModelConfig, spec: MeshSpec, devices=None, channel=None):
        if cfg.n_layers % spec.stage:
            raise ValueError(f"SPMD pipeline: stage={spec.stage} does not divide {cfg.name}'s {cfg.n_layers} "
                             f"layers; choose a divisor of {cfg.n_layers}")
        if cfg.n_heads % spec.tensor:
            raise ValueError(f"tensor={spec.tensor} does not divide the {cfg.n_heads} attention heads of "
                             f"{cfg.name}; choose a divisor of {cfg.n_heads}")
        if cfg.attention not in ("auto", "xla"):  # a kernel inside the manual ``stage`` region is not wired
            raise ValueError(f"the SPMD pipeline (a multi-process instance) runs attention='xla' only ('auto' "
                             f"resolves to it there), got attention={cfg.attention!r}; use attention='xla', or one "
                             f"process to run the kernels")
        self.spec, self.channel = spec, channel
        self.mesh = global_mesh(spec, devices)
        per = cfg.n_layers // spec.stage
        self.stage_ranges = [(s * per, (s + 1) * per) for s in range(spec.stage)]

    def build_runner(self, model: Llama, num_pages: int, kv_dtype=None, scan: bool | None = None):
        return SpmdRunner(model, self, num_pages, kv_dtype, channel=self.channel)


class SpmdPrograms:
    """The jitted programs of one model on one mesh (statics: graphdefs, mesh, stage count, layers per stage)."""

    def __init__(self, model: Llama, mesh: Mesh):
        cfg = model.cfg
        self.cfg, self.mesh = cfg, mesh
        self.n_stages = mesh.shape[STAGE]
        self.per_stage = cfg.n_layers // self.n_stages
        self.layers_graphdef = nnx.split(_slice_layers(model.layers, 0, self.per_stage))[0]
        # The parts outside the layer stack (embedding, final norm, LM head), on the whole mesh.
        self.ends_graphdef, ends_state = nnx.split(_Ends(model))
        self.ends = self._place_ends(ends_state)
        self.layers = self._place_layers(nnx.state(model.layers))

    # ---- placement ------------------------------------------------------------------------------------------
    def _place_layers(self, state: nnx.State):
        """Stacked layer parameters [L, ...] as [S, L/S, ...]: stage-sharded, then by the rules over ``tensor``."""
        s, per = self.n_stages, self.per_stage

        def one(var):
            value = np.asarray(var.get_value())
            rest = spec_for(_axes_of(var)[1:], value.shape[1:], self.mesh)
            return _put(value.reshape((s, per) + value.shape[1:]), NamedSharding(self.mesh, P(STAGE, None, *rest)))

        return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def _place_ends(self, state: nnx.State):
        """Embedding, final norm, LM head: replicated over ``stage``, split by the rules over ``tensor``."""
        def one(var):
            value = np.asarray(var.get_value())
            return _put(value, NamedSharding(self.mesh, spec_for(_axes_of(var), value.shape, self.mesh)))

        return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def kv_sharding(self, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, P(STAGE, *spec_for(KV_PAGE_AXES, shape[1:], self.mesh)))

    def allocate_kv(self, num_pages: int, dtype) -> tuple[jax.Array, jax.Array]:
        shape = (self.n_stages,) + kv_shape(self.cfg, num_pages, self.per_stage)
        make = zeros_program(shape, storage_dtype(dtype), self.kv_sharding(shape))
        return make(), make()

    def replicated(self, tree):
        """Host inputs (numpy) as fully replicated global arrays (every process passes the same values)."""
        sharding = NamedSharding(self.mesh, P())
        return jax.tree.map(lambda x: _put(x, sharding), tree)


class _Ends(nnx.Module):
    """The parts of a model outside its layer stack: embedding, final norm and LM head (shared with ``Stage``)."""

    def __init__(self, model: Llama):
        self.cfg = nnx.static(model.cfg)
        self.embedding = model.embedding
        self.final_norm = model.final_norm
        self.lm_head = model.lm_head

    def embed(self, tokens):
        return jnp.take(self.embedding[...], tokens, axis=0)

    def head(self, x):
        return Stage.head(self, x)


def _stage_loop(layers_graphdef, per_stage: int, n_stages: int, layers, kv, x, positions, table, ctx_len, slots,
                n_chunks):
    """One stage's part of the circular schedule (inside ``shard_map``, manual over ``stage``).

    Local views: ``layers`` [1, L/S, ...], ``kv`` ([1, ...], [1, ...]); chunk inputs are whole: ``x`` [C, B, T, d]
    (embedded tokens; only stage 0 reads them), ``positions`` / ``slots`` [C, B, T], ``table`` [C, B, P], ``ctx_len``
    [C, B]; ``n_chunks`` (traced, <= C) of the C chunk slots are real (the rest is padding, never run). Returns the hidden states of every chunk after this stage ([1, C, B, T, d]; meaningful on the last
    stage) and this stage's KV.
    """
    stage = jax.lax.axis_index(STAGE)
    module = nnx.merge(layers_graphdef, jax.tree.map(lambda a: a[0], layers))
    k, v = kv[0][0], kv[1][0]
    scratch = jnp.full(slots.shape[1:], SCRATCH_PAGE * k.shape[2], slots.dtype)
    shift = [(i, (i + 1) % n_stages) for i in range(n_stages)]

    def step(t, carry):
        state, outputs, k, v = carry
        chunk = t - stage
        valid = (chunk >= 0) & (chunk < n_chunks)
        c = jnp.clip(chunk, 0, n_chunks - 1)
        inputs = jnp.where(stage == 0, x[c], state)
        batch = PagedBatch(table[c], ctx_len[c], jnp.where(valid, slots[c], scratch))
        y, (k, v) = stacked_layers(module, per_stage, inputs, positions[c], (k, v), batch)
        outputs = jnp.where(valid, outputs.at[c].set(y), outputs)
        if n_stages > 1:
            state = jax.lax.ppermute(y, STAGE, shift)
        return state, outputs, k, v

    # One loop body whatever the chunk count: compile time does not grow with the prompt's length.
    varying = lambda a: jax.lax.pcast(a, (STAGE,), to="varying")  # noqa: E731  (per-stage values in the carry)
    carry = (varying(jnp.zeros(x.shape[1:], x.dtype)), varying(jnp.zeros_like(x)), k, v)
    _, outputs, k, v = jax.lax.fori_loop(0, n_chunks + n_stages - 1, step, carry)  # C + S - 1 steps
    return outputs[None], (k[None], v[None])


@partial(jax.jit, static_argnames=("programs", "every_position", "mode"), donate_argnames=("kv",))
def spmd_forward(programs: "SpmdPrograms", layers, ends, kv, tokens, positions, table, ctx_len, slots, logits_index,
                 sampling, n_chunks, *, every_position: bool, mode: str):
    """The whole prefill (or one decode step) of C chunks: (sampled tokens of the last chunk or None, logits, kv).

    Logits: [C, B, V] at ``logits_index`` [C, B], or [C, B, T, V] with ``every_position``.
    """
    mesh = programs.mesh
    ends_module = nnx.merge(programs.ends_graphdef, ends)
    x = ends_module.embed(tokens)  # [C, B, T, d] on the whole mesh
    loop = partial(_stage_loop, programs.layers_graphdef, programs.per_stage, programs.n_stages)
    staged = jax.shard_map(loop, mesh=mesh, axis_names={STAGE},
                           in_specs=(P(STAGE), P(STAGE), P(), P(), P(), P(), P(), P()),
                           out_specs=(P(STAGE), P(STAGE)))
    hidden, kv = staged(layers, kv, x, positions, table, ctx_len, slots, n_chunks)
    hidden = hidden[-1]  # the last stage's outputs [C, B, T, d]
    if not every_position:
        hidden = jnp.take_along_axis(hidden, logits_index[:, :, None, None], axis=2)[:, :, 0]
    logits = ends_module.head(hidden)
    logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
    sampled = None if every_position else sample_out(logits[n_chunks - 1], sampling, mode)
    if sampled is not None:
        sampled = jax.lax.with_sharding_constraint(sampled, NamedSharding(mesh, P()))
    return sampled, logits, kv


def _rows(kv, pages, per_stage: int):
    """Rows [L/S, n] of ``pages`` in every stage-local layer of a stage-stacked cache."""
    num_pages = kv[0].shape[2] // per_stage
    return jnp.arange(per_stage, dtype=jnp.int32)[:, None] * num_pages + pages[None, :]


@partial(jax.jit, static_argnames=("per_stage", "mesh"))
def spmd_read_blocks(kv, pages, *, per_stage: int, mesh: Mesh):
    """Blocks [n, layers, 2, block_size, kv_heads, head_dim] of ``pages`` [n], replicated on the whole mesh."""
    rows = _rows(kv, pages, per_stage)
    both = as_logical(jnp.stack([kv[0][:, :, rows], kv[1][:, :, rows]]))  # [2, S, H, L/S, n, bs, D]
    out = jnp.transpose(both, (4, 1, 3, 0, 5, 2, 6))  # [n, S, L/S, 2, bs, H, D]
    out = out.reshape((out.shape[0], -1) + out.shape[3:])
    return jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P()))


@partial(jax.jit, static_argnames=("per_stage",), donate_argnames=("kv",))
def spmd_write_blocks(kv, pages, blocks, *, per_stage: int):
    """Write whole blocks [n, layers, 2, block_size, kv_heads, head_dim] into ``pages`` [n] of every layer."""
    rows = _rows(kv, pages, per_stage)
    n_stages = kv[0].shape[0]
    blocks = blocks.reshape((blocks.shape[0], n_stages, per_stage) + blocks.shape[2:])  # [n, S, L/S, 2, bs, H, D]
    k, v = kv
    k = set_at(k, (slice(None), slice(None), rows), jnp.transpose(blocks[:, :, :, 0], (1, 4, 2, 0, 3, 5)))
    v = set_at(v, (slice(None), slice(None), rows), jnp.transpose(blocks[:, :, :, 1], (1, 4, 2, 0, 3, 5)))
    return k, v


def chunk_slots(n_chunks: int) -> int:
    """Chunk slots of the program that runs ``n_chunks`` chunks: the next power of two, so prompts of any length
    share a few compiled programs (the loop runs only the real chunks; the padding slots cost memory only)."""
    return 1 << (n_chunks - 1).bit_length()


def _stack_chunks(steps) -> dict:
    """The steps' inputs stacked on a leading chunk axis of ``chunk_slots`` slots, padded to the widest chunk and
    context table: padded tokens write to the scratch page, padded table entries point at it (masked by
    ``ctx_len`` anyway); padding chunk slots are never run."""
    n_rows = steps[0].tokens.shape[0]
    width = max(s.tokens.shape[1] for s in steps)
    pages = max(s.batch.page_table.shape[1] for s in steps)
    c = chunk_slots(len(steps))
    tokens = np.zeros((c, n_rows, width), np.int32)
    positions = np.zeros((c, n_rows, width), np.int32)
    slots = np.full((c, n_rows, width), SCRATCH_PAGE, np.int32)
    table = np.full((c, n_rows, pages), SCRATCH_PAGE, np.int32)
    ctx_len = np.zeros((c, n_rows), np.int32)
    index = np.zeros((c, n_rows), np.int32)
    for i, s in enumerate(steps):
        t, p = s.tokens.shape[1], s.batch.page_table.shape[1]
        tokens[i, :, :t] = s.tokens
        positions[i, :, :t] = s.positions
        positions[i, :, t:] = s.positions[:, -1:] + np.arange(1, width - t + 1)
        slots[i, :, :t] = s.batch.write_slots
        table[i, :, :p] = s.batch.page_table
        ctx_len[i] = s.batch.ctx_len
        if s.logits_index is not None:
            index[i] = s.logits_index
    return dict(tokens=tokens, positions=positions, table=table, ctx_len=ctx_len, slots=slots, logits_index=index,
                n_chunks=np.int32(len(steps)))


class SpmdRunner:
    """``PipelineRunner``'s interface over one SPMD program (see the module docstring).

    Every operation that dispatches device work goes first to the other processes through ``channel`` (process 0
    only: the followers call ``execute`` with what they receive), so all processes run the same programs in the
    same order. Outputs come back as host numpy arrays (fully replicated results, read from local shards).
    """

    def __init__(self, model: Llama, layout: SpmdLayout, num_pages: int, kv_dtype=None, channel=None):
        self.layout = layout
        self.stages = layout.stage_ranges
        self.programs = SpmdPrograms(model, layout.mesh)
        self.channel = channel
        self._kv = self.programs.allocate_kv(num_pages, kv_dtype or model.cfg.param_dtype)
        self.dispatch_log = None  # PipelineRunner's schedule log: one program here, nothing to log

    chunk_slots = staticmethod(chunk_slots)
    """How many chunk slots the program of an n-chunk prefill has: the engine's warm-up compiles each multi-chunk
    shape a request can hit (``Engine.stacked_prefill_shapes``)."""

    # ---- what process 0 calls (the engine's interface) --------------------------------------------------------
    def run(self, steps, hooks=None, pages=None) -> list:
        if hooks is not None:
            raise ValueError("the SPMD pipeline runs whole prefills in one program: layer hooks are not supported")
        return self._dispatch("run", list(steps))

    def read_blocks(self, pages: np.ndarray) -> np.ndarray:
        return self._dispatch("read_blocks", np.asarray(pages, np.int32))

    def write_blocks(self, pages: np.ndarray, blocks: np.ndarray) -> None:
        self._dispatch("write_blocks", (np.asarray(pages, np.int32), np.asarray(blocks)))

    @property
    def kv(self) -> list[tuple[LogicalPages, LogicalPages]]:
        return [logical_pages(self._kv)]

    def block_until_ready(self) -> None:
        jax.block_until_ready(self._kv)

    def _dispatch(self, op: str, payload):
        if self.channel is not None:
            self.channel.send((op, payload))
        return self.execute(op, payload)

    # ---- what every process runs ------------------------------------------------------------------------------
    def execute(self, op: str, payload):
        """Run one operation (``run``, ``read_blocks``, ``write_blocks``) on this process's share of the mesh."""
        handler = self._ops.get(op)
        if handler is None:
            raise ValueError(f"unknown SPMD runner operation {op!r}; known: {sorted(self._ops)}")
        return handler(self, payload)

    def _run(self, steps) -> list:
        progs = self.programs
        last = steps[-1]
        every_position = last.logits_index is None
        stacked = progs.replicated(_stack_chunks(steps))
        sampling = progs.replicated(last.sampling)
        sampled, logits, self._kv = spmd_forward(
            progs, progs.layers, progs.ends, self._kv, stacked["tokens"], stacked["positions"], stacked["table"],
            stacked["ctx_len"], stacked["slots"], stacked["logits_index"], sampling, stacked["n_chunks"],
            every_position=every_position, mode=last.mode)
        logits = np.asarray(logits)
        sampled = None if sampled is None else jax.tree.map(np.asarray, sampled)
        return [(sampled if i == len(steps) - 1 else None, logits[i]) for i in range(len(steps))]

    def _read_blocks(self, pages) -> np.ndarray:
        out = spmd_read_blocks(self._kv, self.programs.replicated(pages), per_stage=self.programs.per_stage,
                               mesh=self.programs.mesh)
        return np.asarray(out)

    def _write_blocks(self, payload) -> None:
        pages, blocks = self.programs.replicated(payload)
        self._kv = spmd_write_blocks(self._kv, pages, blocks, per_stage=self.programs.per_stage)

    _ops = {"run": _run, "read_blocks": _read_blocks, "write_blocks": _write_blocks}
