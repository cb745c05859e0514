import os

# Eight CPU devices for the mesh tests; must be set before JAX initialises its backend. The tests check what the
# programs compute, not how fast: LLVM's optimisation level 0 for the CPU backend compiles them about a quarter faster
# (the suite is bound by compiling), and the matrix products still run in the libraries XLA calls.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")


import pytest  # noqa: E402

SESSION_VARIABLES = ("XDG_CACHE_HOME", "NUMBA_CACHE_DIR", "MPLCONFIGDIR", "TMPDIR")
"""Where the code under test (and every process a test starts, which inherits the environment) writes: JAX's
persistent compile cache (``mooncake_jax.model.compile_cache``: clusters and the coupled backend turn it on unless
given ``compile_cache=None``), numba's compiled Conductor kernels (else written beside the sources), matplotlib's
config folder and font list (else ``~/.config/matplotlib``, made even when only plotting), and the temporary folders
of instance-process logs and profiles (``tempfile``). Pointed at the session's temporary folder before any test
module is imported, so a run neither reads what an earlier run left (its time and its compile counts do not depend
on it) nor writes into the user's home; within the run the programs are shared by every test and every instance
process. pytest keeps the last three sessions' folders and removes older ones."""


@pytest.hookimpl(trylast=True)  # after pytest's tmp_path plugin has made the session's temporary folder
def pytest_configure(config):
    import tempfile

    base = config._tmp_path_factory.getbasetemp()
    for name in SESSION_VARIABLES:
        folder = base / name.lower()
        folder.mkdir(exist_ok=True)
        os.environ[name] = str(folder)
    tempfile.tempdir = os.environ["TMPDIR"]  # this process read TMPDIR already (for the session folder itself)
    from mooncake_jax.model.compile_cache import enable_compilation_cache

    # On from the start, not from whichever test first starts a cluster with the default ``compile_cache``: every
    # test then compiles alike whatever ran before it, and a program compiled again after the memory-mapping
    # guard below dropped the compiled programs is read back instead.
    enable_compilation_cache()

CLEAR_PROGRAMS_AT = 0.4
"""Share of the kernel's memory-mapping limit past which the compiled programs are dropped between test modules.
Each XLA:CPU program holds 100-250 mappings until it is freed (``mooncake_jax.model.map_budget``); the whole suite
in one process reached 43,363 of 65,530 by the eighth session and grows with every test, and past the limit the
next compile aborts the process with no Python error. Dropped only past this share, so most modules keep reusing
programs compiled by the ones before."""


@pytest.fixture(scope="module", autouse=True)
def _bounded_memory_mappings():
    """After each module, drop every compiled program once the process holds more than ``CLEAR_PROGRAMS_AT`` of the
    mappings it may (autouse, so torn down after the module's own fixtures have let their engines go)."""
    yield
    from mooncake_jax.model.map_budget import map_limit, maps_in_use

    limit, in_use = map_limit(), maps_in_use()
    if limit and in_use and in_use > CLEAR_PROGRAMS_AT * limit:
        import gc

        import jax

        gc.collect()
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="module")
def llm():
    """The tiny preset with 64-token prefill chunks (modules that need another engine define their own ``llm``)."""
    import mooncake_jax as mj

    return mj.LLM("tiny", prefill_chunk_size=64)


@pytest.fixture(scope="module")
def ref(llm):
    """The float64 reference forward over ``llm``'s weights."""
    from reference_model import reference_for

    return reference_for(llm.model)


@pytest.fixture
def random_file(tmp_path):
    """``open(nbytes, seed)``: a file of ``nbytes`` random bytes, its read-only descriptor and the bytes (closed at
    the test's end); the SSD read tests' shard."""
    import os

    import numpy as np

    fds = []

    def open_file(nbytes: int, seed: int):
        data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        path = tmp_path / f"shard{len(fds)}"
        path.write_bytes(data.tobytes())
        fds.append(os.open(path, os.O_RDONLY))
        return fds[-1], data

    yield open_file
    for fd in fds:
        os.close(fd)
