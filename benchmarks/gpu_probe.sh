#!/usr/bin/env bash
# GPU probe runs for docs/benchmarks.md (issue 2): single probes and the 3-thread cold start.
# Usage (repo root, on a CUDA machine):  OUT=results bash benchmarks/gpu_probe.sh [TRIALS] [TIMEOUT_S]
set -u
OUT=${OUT:-results}; mkdir -p "$OUT"
TRIALS=${1:-3}; TIMEOUT=${2:-90}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cw() { python3 -m cli.main "$@"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)" >> "$OUT/gpu.txt"
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
cw probe create_block_mask --device cuda:0 --json > "$OUT/probe_create_block_mask.json"; echo "create_block_mask rc=$?"
cw probe flex_attention --device cuda:0 --fresh-cache > "$OUT/probe_flex_attention.txt"; echo "flex cold rc=$?"
cw probe flex_attention --device cuda:0 > "$OUT/probe_flex_attention_warmdisk.txt"; echo "flex warm-disk rc=$?"
for i in $(seq 1 "$TRIALS"); do
  # each trial a new process with a fresh cache dir; the CLI os._exit()s after reporting a hang
  timeout $((TIMEOUT + 60)) python3 -m cli.main probe flex_attention --threads 3 --device 0 --timeout "$TIMEOUT" --json \
    > "$OUT/threads3_trial$i.json" 2> "$OUT/threads3_trial$i.err"
  echo "threads trial $i rc=$?"
done
python3 - "$OUT" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
for f in sorted(glob.glob(os.path.join(out, "threads3_trial*.json"))):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(f, "unreadable", e); continue
    print(os.path.basename(f), [(t["name"], t["outcome"], (t["error"] or "")[:90]) for t in d["threads"]],
          "stuck", d["fx_flag_stuck"], "wall", round(d["wall_s"], 2), "traces", d["traces"])
PY
