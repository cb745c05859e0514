import os

# Eight CPU devices for the mesh tests; must be set before JAX initialises its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


import pytest  # noqa: E402


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
