"""The elastic run's rig (``areal/elastic/`` on its own): two real HTTP servers (the transport tests' SGLang
stand-in) for big-2 (tp1) and small-0 (tp2), the real router, cost model and upstream's StalenessManager; the
controller's calls are functions the tests see."""

from __future__ import annotations

import pytest

from tests.elastic.rig import CONFIG, SHAPES, Version, versioned_standin


@pytest.fixture
def servers():
    from tests.transport.sglang_standin import SGLangStandIn

    started = [SGLangStandIn(1), SGLangStandIn(2)]
    yield started
    for server in started:
        server.close()


@pytest.fixture
def rig(servers, tmp_path):
    """The elastic run over ``servers`` (shares 1/2 each); its recorded changes and relaunched servers."""
    pytest.importorskip("areal")
    from areal.infra.staleness_manager import StalenessManager

    from areal_hex_plugin.areal.elastic import ElasticRollout
    from areal_hex_plugin.areal.routing import ShareRouter
    from areal_hex_plugin.costmodel import CostModel
    from tests.elastic.plans import elastic_recipe

    recipe = elastic_recipe()
    router = ShareRouter([0.5, 0.5])
    changes, relaunched = [], []
    manager = StalenessManager(Version(), 16, 8, 1)

    def relaunch(rank):
        server = versioned_standin()
        relaunched.append(server)
        return server.address

    elastic = ElasticRollout(
        CONFIG,
        CostModel(recipe.cluster, recipe.workload, recipe.calibration),
        SHAPES,
        ["big-2/0", "small-0/1"],
        [s.address for s in servers],
        set_shares=router.set_shares,
        in_flight=lambda rank: router.outstanding[rank],
        staleness=lambda: manager,
        record=changes.append,
        relaunch=relaunch,
        lengths_file=str(tmp_path / "lengths.txt"),
    )
    elastic.shares = tuple(router.shares)  # as attach_elastic starts it
    yield elastic, router, changes, relaunched, manager
    elastic.stop()
    for server in relaunched:
        server.close()
