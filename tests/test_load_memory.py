"""Loading streams experts one at a time: peak memory stays near the model's own size."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch
from transformers import AutoModelForCausalLM, MixtralConfig

_MEASURE = textwrap.dedent(
    """
    import json, sys
    import torch
    from specter.models.loader import build_dense, load_store

    def status_kib(field):
        # VmHWM is this process's own peak; ru_maxrss would carry the parent's peak across exec.
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    torch.set_num_threads(1)
    before = status_kib("VmRSS")
    loaded = build_dense(sys.argv[1])
    store = load_store(loaded)
    peak = status_kib("VmHWM")
    print(json.dumps({"delta": (peak - before) * 1024, "dense": loaded.dense_bytes, "experts": store.nbytes}))
    """
)


def test_peak_rss_while_loading_a_200mb_checkpoint(tmp_path):
    config = MixtralConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                           num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    del model
    size = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    assert size >= 200e6
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path)], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    own = report["dense"] + report["experts"]
    assert own >= 0.95 * size
    # Peak RSS growth over the pre-load baseline (imports) stays under 1.2 x what the model itself holds.
    assert report["delta"] < 1.2 * own, report
    print(f"checkpoint {size / 1e6:.0f} MB: peak RSS growth {report['delta'] / 1e6:.0f} MB "
          f"= {report['delta'] / own:.2f} x (dense + expert blobs)")
