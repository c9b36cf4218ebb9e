"""Placement across nodes: a Ray cluster of three raylets on this machine (`ray.cluster_utils.Cluster`);
the recipe pins learners and rollout workers to the nodes that offer the resources it names."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cluster import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import json, os, subprocess, sys
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    learner_node = cluster.add_node(num_cpus=1, resources={"trainer_node": 1})
    rollout_node = cluster.add_node(num_cpus=1, resources={"rollout_node": 1})
    cluster.wait_for_nodes()
    try:
        proc = subprocess.run([sys.executable, "-m", "cluster.cli", "run", "recipes/quickstart.yaml", *sys.argv[1:]],
                              env={**os.environ, "RAY_ADDRESS": cluster.address}, capture_output=True, text=True)
        print("RESULT " + json.dumps({"learner": learner_node.node_id, "rollout": rollout_node.node_id,
                                      "rc": proc.returncode, "log": (proc.stdout + proc.stderr)[-3000:]}))
    finally:
        cluster.shutdown()
''')


@pytest.mark.slow
def test_roles_land_on_the_nodes_the_recipe_names(tmp_path):
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", *TINY_RUN, "trainer.steps=2", "cluster.placement=split",
                 "cluster.placement_strategy=SPREAD", "cluster.learner_resources={trainer_node: 1}",
                 "cluster.rollout_resources={rollout_node: 1}", "learner.num_cpus=1", "rollout.num_cpus=1"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**env, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    assert result["rc"] == 0, result["log"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    assert summary["actor_nodes"] == {"learner0": result["learner"], "rollout0": result["rollout"]}
