"""A copy that writes its destination with non-temporal (streaming) stores, compiled once per process by LLVM.

Why: a block put into the DRAM tier is written into a slot that nothing reads soon, out of every cache. glibc's
``memcpy`` (what ``np.copyto`` calls) streams only copies above its non-temporal threshold (99 MiB on the Intel Xeon
measured, from its cache sizes); below it the stores go through the cache, so every destination line is first read
from memory (a read for ownership) and later written back: three passes over memory where a streaming copy makes
two. Copying and hashing a block chunk by chunk (so that the hash reads from cache) needs chunks far below that
threshold, so every such copy paid the extra pass, and a 70B block's put cost about twice the whole-block
``np.copyto`` it is compared with (0.238 against 0.125 CPU s/GB; issue 15, eleventh pass). With this copy a chunk is
written with streaming stores while its source is read as usual, so the source is in the core's cache right after
and is hashed from there: one pass over each side, as the whole-block ``memcpy`` makes.

Measured on the Intel Xeon (207), 2 cores, CPU s/GB in one process (``docs/benchmarks/pool.md``, eleventh pass): a
160 MiB block, ``np.copyto`` whole 0.105-0.109 (streamed by glibc), ``np.copyto`` in chunks 0.16-0.18 (not), this
copy whole 0.105; this copy and XXH3 of each 256-512 KiB chunk 0.147-0.168 against 0.238 for the chunked
``np.copyto`` then XXH3.

The kernel is a few lines of LLVM IR built with llvmlite (numba's code generator, installed with numba) and
compiled for this CPU when first used (~50 ms): 64-byte loads and non-temporal stores to 64-byte-aligned addresses
(``vmovntps`` on AVX-512; LLVM splits the store on narrower vector units), then a store fence (``sfence`` on x86,
where streaming stores are weakly ordered; a full fence elsewhere), so a thread that later takes the pool's lock
sees every byte. The unaligned head and tail of a copy are ``memmove``'d. Where llvmlite is missing or cannot
compile for this machine ``streaming_copy`` returns None and callers copy with ``np.copyto``: the same bytes.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

import numpy as np

LINE_BYTES = 64

Copy = Callable[[int, int, int], None]
"""``copy(dst_address, src_address, n_bytes)``: addresses of memory the caller keeps alive during the call."""


def address(array: np.ndarray) -> int:
    """Where ``array``'s first byte lies in memory."""
    return array.__array_interface__["data"][0]


def writable_address(out: np.ndarray) -> int:
    """``address`` of a writable, non-empty ``out``, through ctypes: 2-5x cheaper than numpy's ``out.ctypes.data``
    (which builds an object; 5-8 us a call on a loaded machine, beside a 16-token record's read of 30-60) and about
    a quarter of ``address`` (0.45 against 1.6 us, quiet, AMD EPYC)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(out))


_built: list[Copy | None] = []  # once tried: [the copy] or [None]
_building = threading.Lock()


def streaming_copy() -> Copy | None:
    """The streaming copy, compiled on the first call (once per process, whichever thread asks first) and tried
    once on a small case, or None (one log line) where it cannot be built here."""
    if not _built:
        with _building:
            if not _built:
                _built.append(_built_and_tried())
    return _built[0]


def _built_and_tried() -> Copy | None:
    try:
        lines = _compile()
        copy = _with_edges(lines)
        src = np.arange(5 * LINE_BYTES + 7, dtype=np.uint8)
        dst = np.zeros(src.size + 2, np.uint8)
        copy(address(dst) + 1, address(src), src.size)  # unaligned head, whole lines, a tail
        if not np.array_equal(dst[1:-1], src) or dst[0] or dst[-1]:
            raise RuntimeError("the compiled copy gave wrong bytes")
    except Exception as err:  # noqa: BLE001 - an optional accelerator: np.copyto moves the same bytes
        logging.getLogger(__name__).warning("streaming copy unavailable (%s); copying with np.copyto", err)
        return None
    return copy


def _with_edges(lines: Callable[[int, int, int], None]) -> Copy:
    memmove = ctypes.memmove

    def copy(dst: int, src: int, n: int) -> None:
        head = min(-dst & (LINE_BYTES - 1), n)
        if head:
            memmove(dst, src, head)
        count = (n - head) >> 6
        if count:
            lines(dst + head, src + head, count)
        done = head + (count << 6)
        if done < n:
            memmove(dst + done, src + done, n - done)

    return copy


_ENGINES: list = []  # the JITs that hold compiled code: kept for the life of the process


def _compile() -> Callable[[int, int, int], None]:
    """``lines(dst, src, count)``: ``count`` 64-byte lines from ``src`` (any alignment) to ``dst`` (64-byte
    aligned) with streaming stores, then a store fence."""
    import llvmlite.binding as llvm
    from llvmlite import ir

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    triple = llvm.get_process_triple()
    i64 = ir.IntType(64)
    line = ir.VectorType(i64, LINE_BYTES // 8)
    module = ir.Module(name="stream_copy")
    module.triple = triple
    function = ir.Function(module, ir.FunctionType(ir.VoidType(), [i64, i64, i64]), name="stream_lines")
    dst, src, count = function.args
    entry, loop, done = (function.append_basic_block(name) for name in ("entry", "loop", "done"))
    builder = ir.IRBuilder(entry)
    builder.cbranch(builder.icmp_unsigned("==", count, i64(0)), done, loop)
    builder.position_at_end(loop)
    index = builder.phi(i64)
    index.add_incoming(i64(0), entry)
    offset = builder.mul(index, i64(LINE_BYTES))
    value = builder.load(builder.inttoptr(builder.add(src, offset), line.as_pointer()), align=1)
    store = builder.store(value, builder.inttoptr(builder.add(dst, offset), line.as_pointer()), align=LINE_BYTES)
    store.set_metadata("nontemporal", module.add_metadata([ir.IntType(32)(1)]))
    following = builder.add(index, i64(1))
    index.add_incoming(following, loop)
    builder.cbranch(builder.icmp_unsigned("<", following, count), loop, done)
    builder.position_at_end(done)
    if triple.startswith(("x86_64", "i386", "i686")):
        builder.call(module.declare_intrinsic("llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), [])), [])
    else:
        builder.fence("seq_cst")
    builder.ret_void()

    machine = llvm.Target.from_triple(triple).create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    passes = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
    passes.getModulePassManager().run(parsed, passes)
    engine = llvm.create_mcjit_compiler(parsed, machine)
    engine.finalize_object()
    _ENGINES.append(engine)
    kind = ctypes.CFUNCTYPE(None, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)  # releases the GIL
    return kind(engine.get_function_address("stream_lines"))
