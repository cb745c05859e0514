"""Run by ``test_hermetic.py`` in a pytest of its own (not collected by the suite: the name does not start with
``test_``): a cluster started with the default ``compile_cache`` ("the user's cache directory"), which before the
conftest's redirection wrote its programs into ``~/.cache/mooncake-jax/xla``, and a plot (the simulator's
experiments draw them), for which matplotlib made ``~/.config/matplotlib`` and its font list."""

import mooncake_jax as mj
from tiny_profile import PROFILE


def test_a_cluster_with_the_default_compile_cache_writes_into_the_session_folder(tmp_path_factory):
    from mooncake_jax.model.compile_cache import default_cache_dir

    session, cache = tmp_path_factory.getbasetemp(), default_cache_dir()
    assert cache.is_relative_to(session), (cache, session)
    with mj.Cluster.local("tiny", prefill=1, decode=1, warmup=False, profile_json=PROFILE) as cluster:
        assert len(cluster.generate([[3, 1, 4, 1, 5]], max_new_tokens=2)[0]) == 2
    assert any(cache.glob("*-cache")), f"no compiled program in {cache}"


def test_a_plot_keeps_matplotlib_s_folders_in_the_session_folder(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure()
    figure.savefig(tmp_path / "plot.png")
    plt.close(figure)
    assert (tmp_path / "plot.png").stat().st_size > 0
