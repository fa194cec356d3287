"""Small files of the GenTD26 trace's columns, written by a test (the real trace is never part
of the project or its tests)."""

from __future__ import annotations

import csv
import random
from datetime import datetime, timedelta
from pathlib import Path

from app.bench.gentd26 import LATENCY_FILES, REQUEST_FILE

HEADER = ["gmt_create", "predict_type", "predict_status", "exec_time_seconds", "groupId",
          "prompt_length", "negative_prompt_length", "num_images_per_prompt",
          "num_inference_steps", "checkpoint_model_version_id", "num_lora"]


def write_requests(root: Path, rows: list[list[object]]) -> None:
    with (root / REQUEST_FILE).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HEADER)
        writer.writerows(rows)


def write_latencies(root: Path, values_ms: dict[str, list[object]]) -> None:
    for name, file in LATENCY_FILES.items():
        if name not in values_ms:
            continue
        with (root / file).open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["timestamp_anon", "value", "container_ip"])
            for k, v in enumerate(values_ms[name]):
                writer.writerow([1662859290.0 + k, v, f"ip{k % 3}"])


def request(at: datetime, model: str = "M0001", exec_s: float = 20.0, loras: int = 0,
            group: str = "G0001", status: str = "SUCCEED", steps: object = 30.0,
            images: object = 1.0) -> list[object]:
    return [f"{at:%Y-%m-%d %H:%M:%S}", "TXT_2_IMG", status, exec_s, group, 63.0, "",
            images, steps, model, loras]


def synthetic_trace(root: Path, days: int = 4, per_day: int = 40, seed: int = 7) -> None:
    """``per_day`` requests a day from 2024-11-20 on, bursty (a burst of 5 every few
    minutes), over 6 models, some with adapters; latencies of a few seconds."""
    rng = random.Random(seed)
    rows: list[list[object]] = []
    for day in range(days):
        t = datetime(2024, 11, 20) + timedelta(days=day, minutes=1)
        for _k in range(per_day):
            t += timedelta(seconds=rng.choice((0, 0, 0, 1, 240)))
            rows.append(request(t, model=f"M{rng.randrange(6):04d}",
                                exec_s=float(rng.randint(8, 40)),
                                loras=rng.choice((0, 0, 0, 1, 2)),
                                group=f"G{rng.randrange(3):04d}"))
    write_requests(root, rows)
    write_latencies(root, {
        "base": [rng.randint(2000, 40000) for _ in range(200)] + [0, "NULL"],
        "adapter": [rng.randint(2500, 8000) for _ in range(200)],
        "pipeline": [rng.randint(3000, 30000) for _ in range(50)],
    })
