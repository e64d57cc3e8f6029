"""bench.ddp under torchrun on CPU (gloo, two processes): the paper's CTR model, early under DDP."""
import json
import subprocess
import sys


def test_torchrun_trains_the_ctr_model_with_erase_like_eager_ddp(tmp_path):
    out = tmp_path / "ddp.json"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
         "bench.ddp", "--quick", "--out", str(out)],
        check=True, capture_output=True, text=True, timeout=600)
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"eager", "erase/aot_eager"}
    assert rows["eager"]["early_blocks"] == 0
    assert rows["erase/aot_eager"]["early_blocks"] == 3  # every block but the last, under DDP
    assert rows["erase/aot_eager"]["param_diff_vs_eager"] == 0.0
    assert rows["erase/aot_eager"]["world"] == 2
    assert rows["erase/aot_eager"]["qps_p90"] > 0 and rows["eager"]["ne"] == rows["eager"]["ne"]
