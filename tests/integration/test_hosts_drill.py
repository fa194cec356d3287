"""The drill across hosts, short: two network-namespace hosts, Redis with Sentinel and S3 on a
bridge; a host SIGKILLed mid-step, its link down and up, its worker hung (SIGSTOP) mid-step, a
``SENTINEL FAILOVER``. No accepted job is lost, each ends byte-identical to an uninterrupted
run, and every fault is survived."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from app.drills.hosts import SHORT_FAULTS, run_hosts_drill
from app.drills.netns import unavailable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WHY_NOT = unavailable()


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")
def test_two_hosts_survive_a_host_kill_a_link_flap_a_hung_worker_and_a_failover(
    tmp_path: Path,
) -> None:
    # given two hosts on namespaces, and the short list of faults
    # when the drill runs them under a steady load
    code = run_hosts_drill(tmp_path, hosts=2, faults=SHORT_FAULTS)

    # then every accepted job ended DONE and exact, and every fault was injected and survived
    report = json.loads((tmp_path / "reliability.json").read_text())
    assert report["jobs_submitted"] > 0
    assert report["jobs_lost"] == 0, report["lost"]
    assert report["exact"], report["inexact"]
    assert report["jobs_completed"] == report["jobs_submitted"]
    faults = {f["kind"]: f for f in report["faults"]}
    assert set(faults) == set(SHORT_FAULTS)
    for kind, fault in faults.items():
        assert fault["injected"] and fault["survived"], f"{kind}: {fault['detail']}"
        assert fault["recovery_s"] is not None
    assert code == 0
    # and nothing of the run is left: no namespace of its prefix, no process of its run dir
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          check=True).stdout
    assert report["namespaces_prefix"] not in left
    procs = subprocess.run(["pgrep", "-f", report["run_dir"]], capture_output=True, text=True,
                           check=False).stdout
    assert not procs.strip(), f"processes of the run still alive: {procs}"
