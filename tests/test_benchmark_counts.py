"""What the benchmarks count from a run's records (benchmarks/common.py), against hand counts on written records."""

import json
import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))


def write(folder, records):
    folder.mkdir(parents=True)
    (folder / "syncs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def row(replica, steps, tokens):
    return {"replica": replica, "steps": steps, "tokens": tokens}


def test_dropped_tokens_counts_the_steps_a_mix_landing_dropped_where_the_next_sync_merged_them(tmp_path):
    """Replica 0 took 3 steps in flight of sync 1 (64 tokens a step) and 2 of sync 2; the second sync counts them
    (192 tokens), the third would count sync 2's but is rolled back, the fourth counts them (128). Replica 1 took 4
    in flight of sync 1 but sat sync 2 out: those tokens were never merged and are not counted. The torch form
    (one folder, replica 0's in-flight steps, the next sync's tokens in its share): 3/10 of sync 2's 1,000."""
    from common import dropped_tokens

    first = [{"sync": 1, "committed": True, "in_flight_steps": 3, "tokens": 640, "replicas": [row(0, 10, 640)]},
             {"sync": 2, "committed": True, "in_flight_steps": 2, "tokens": 640, "replicas": [row(0, 10, 640)]},
             {"sync": 3, "committed": False, "in_flight_steps": 1, "tokens": 640, "replicas": [row(0, 10, 640)]},
             {"sync": 4, "committed": True, "tokens": 640, "replicas": [row(0, 10, 640)]}]
    second = [{"sync": 1, "committed": True, "in_flight_steps": 4, "tokens": 640, "replicas": [row(1, 10, 640)]},
              {"sync": 2, "committed": True, "tokens": 640, "replicas": [{"replica": 1, "participated": False}]}]
    write(tmp_path / "replica-0", first)
    write(tmp_path / "replica-1", second)
    assert dropped_tokens([tmp_path / "replica-0", tmp_path / "replica-1"]) == 3 * 64 + 2 * 64
    torch_run = [{"sync": 1, "committed": True, "in_flight_steps": 3, "tokens": 900, "replicas": [row(0, 9, 576)]},
                 {"sync": 2, "committed": True, "tokens": 1000, "replicas": [row(0, 10, 640), row(1, 5, 360)]}]
    write(tmp_path / "torch", torch_run)
    assert dropped_tokens([tmp_path / "torch"], whole_sync=True) == 300
