"""Ray Serve's replicas, checked without starting Ray: the deployment options (fixed or autoscaling), the health
check that has Serve replace a replica whose engine died, and how to install Ray where it is missing."""

import sys

import pytest

from scalenlp.errors import UserError


def test_a_replica_with_a_dead_engine_fails_its_health_check():
    """Ray Serve calls check_health on each replica and replaces one that raises."""
    from types import SimpleNamespace

    from scalenlp.serving.cluster import EngineReplica

    EngineReplica.check_health(SimpleNamespace(engine=SimpleNamespace(alive=True)))
    with pytest.raises(RuntimeError, match="engine stopped"):
        EngineReplica.check_health(SimpleNamespace(engine=SimpleNamespace(alive=False, error=ValueError("device lost"))))


def test_without_ray_says_how_to_install(monkeypatch):
    from scalenlp.serving import cluster

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(UserError, match=r"pip install 'scalenlp\[cluster\]'"):
        cluster._import_ray()


def test_replica_options_fixed_or_autoscaling():
    from scalenlp.serving.cluster import replica_options

    fixed = replica_options(2, None, max_batch=4, replica_cpus=0.5)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == 8 and fixed["ray_actor_options"] == {"num_cpus": 0.5}
    scaling = replica_options(1, 3, max_batch=4, replica_cpus=1)["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["target_ongoing_requests"]) == (1, 3, 4)
    with pytest.raises(UserError, match="max-replicas"):
        replica_options(3, 2, max_batch=4, replica_cpus=1)
