"""The GPU smoke kit (bench/gpu_smoke.py) runs end to end on CPU with gloo, so the kit itself is known to work
before the day a GPU is at hand: translate with C sharded over 2 ranks, finetune under ZeRO-3 and FSDP2 (the same
model, data and optimiser: the same losses), evaluate the export."""

import json
import math
import sys

import pytest

from tests.helpers.stage_fixtures import run_cmd

pytestmark = pytest.mark.slow


def test_gpu_smoke_kit_runs_on_cpu(tmp_path):
    proc = run_cmd([sys.executable, "-m", "bench.gpu_smoke", "--out", str(tmp_path), "--steps", "2",
                    "--quiet"], timeout=600)
    assert proc.stdout.rstrip().splitlines()[-1].startswith("OK"), proc.stdout
    rep = json.loads((tmp_path / "smoke.json").read_text())
    assert rep["ranks"] == 2 and rep["failures"] == []
    st = rep["stages"]
    for name in ("translate", "finetune ZeRO-3", "finetune FSDP2"):
        assert math.isfinite(st[name]["final_loss"]) and st[name]["tokens_per_s"] > 0, (name, st[name])
        assert st[name]["step_time_s"] > 0 and st[name]["cpu_rss_max_gib"] > 0
        assert "mfu" not in st[name]  # no GPU: no peak to divide by
    # two engines, one model: ZeRO-3 and FSDP2 take the same steps
    assert st["finetune ZeRO-3"]["final_loss"] == pytest.approx(st["finetune FSDP2"]["final_loss"], rel=1e-4)
    assert 0 < st["evaluate"]["bpb"] < 20
    assert (tmp_path / "runs" / "translate" / "P.safetensors").is_file()
    for line in ("translate", "finetune ZeRO-3", "finetune FSDP2", "evaluate"):
        assert line in proc.stdout
