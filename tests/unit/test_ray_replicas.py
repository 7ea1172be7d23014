"""Ray Serve's replicas, checked without starting Ray: the health check that has Serve replace a replica whose
engine died."""

import pytest


def test_a_replica_with_a_dead_engine_fails_its_health_check():
    """Ray Serve calls check_health on each replica and replaces one that raises."""
    from types import SimpleNamespace

    from scalenlp.serving.cluster import EngineReplica

    EngineReplica.check_health(SimpleNamespace(engine=SimpleNamespace(alive=True)))
    with pytest.raises(RuntimeError, match="engine stopped"):
        EngineReplica.check_health(SimpleNamespace(engine=SimpleNamespace(alive=False, error=ValueError("device lost"))))
