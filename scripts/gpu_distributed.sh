#!/usr/bin/env bash
# Issue 14 on 2 GPUs of one host: a random-weight Llama-8B-shaped checkpoint (hidden 4096,
# intermediate 14336, 32 heads / 8 kv heads, LAYERS=32 layers), quantized layer by layer
# (lowbit.nn.layerwise) on 1 GPU and on NPROC=2 GPUs (torchrun, NCCL; the calibration batches
# split across ranks, statistics reduced by lowbit.nn.distributed, rank 0 writes):
#   GPTQ W4A16 on the first GPTQ_LAYERS layers, SmoothQuant W8A8 + static scales on all LAYERS;
# wall time 1 vs 2 GPUs, peak memory per GPU, and whether the 2-GPU checkpoint is byte-identical
# to the 1-GPU one. Logs + distributed.json under $OUT, the short table last.
# Every step has its own timeout inside one overall DEADLINE (seconds), so a hang costs one step.
# Runs from source (PYTHONPATH=src); needs torch + transformers, not compressed-tensors.
# CPU rehearsal at tiny size (gloo):  DEVICE=cpu LAYERS=2 GPTQ_LAYERS=1 HIDDEN=128 INTER=256 HEADS=4
#   KV=2 VOCAB=97 BATCHES=4 BATCH=1 SEQ=16 bash scripts/gpu_distributed.sh
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/out}"; mkdir -p "$out"
work="${WORK:-/tmp/lowbit-dist}"; rm -rf "$work"; mkdir -p "$work"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
DEVICE="${DEVICE:-cuda}"; NPROC="${NPROC:-2}"; DTYPE="${DTYPE:-bf16}"
LAYERS="${LAYERS:-32}"; GPTQ_LAYERS="${GPTQ_LAYERS:-4}"
HIDDEN="${HIDDEN:-4096}"; INTER="${INTER:-14336}"; HEADS="${HEADS:-32}"; KV="${KV:-8}"; VOCAB="${VOCAB:-128256}"
BATCHES="${BATCHES:-8}"; BATCH="${BATCH:-2}"; SEQ="${SEQ:-1024}"
DEADLINE="${DEADLINE:-510}"
T0=$(date +%s)
summary="$out/summary_distributed.txt"; : > "$summary"
py=(python3 benchmarks/distributed_calib.py)
dist=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" benchmarks/distributed_calib.py)

step() {  # step NAME LIMIT_S cmd...: run with min(LIMIT, time left) seconds, log to $out/NAME.log
    local name=$1 limit=$2; shift 2
    local left=$(( DEADLINE - ($(date +%s) - T0) - 15 ))
    (( limit > left )) && limit=$left
    if (( limit < 10 )); then echo "$name skipped (deadline)" | tee -a "$summary"; return 99; fi
    local t=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc ($(( $(date +%s) - t )) s, limit $limit s)" | tee -a "$summary"
    [[ $rc -ne 0 ]] && tail -n 15 "$out/$name.log"
    return $rc
}

{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda devices', torch.cuda.device_count())"
  df -h "$work" | tail -n 1; nproc; free -g | head -n 2; } > "$out/machine_distributed.txt" 2>&1
cat "$out/machine_distributed.txt"

shape=(--hidden "$HIDDEN" --intermediate "$INTER" --heads "$HEADS" --kv-heads "$KV" --vocab "$VOCAB" --dtype "$DTYPE")
calib=(--batches "$BATCHES" --batch "$BATCH" --seq-len "$SEQ" --dtype "$DTYPE" --device "$DEVICE")
step make 200 "${py[@]}" make --out "$work/ckpt" --layers "$LAYERS" "${shape[@]}" --device "$DEVICE" || true
step view 60 "${py[@]}" view --src "$work/ckpt" --out "$work/ckpt_gptq" --layers "$GPTQ_LAYERS" || true

gptq=(run --ckpt "$work/ckpt_gptq" --recipe w4a16 --method gptq "${calib[@]}")
step gptq_1 150 "${py[@]}" "${gptq[@]}" --out "$work/gptq_1" --json "$out/gptq_1" || true
step gptq_2 150 "${dist[@]}" "${gptq[@]}" --out "$work/gptq_2" --json "$out/gptq_2" || true
step gptq_compare 90 "${py[@]}" compare "$work/gptq_1" "$work/gptq_2" --json "$out/gptq_compare.json" || true
rm -rf "$work/gptq_1" "$work/gptq_2"

sq=(run --ckpt "$work/ckpt" --recipe w8a8-int8 --method rtn --smoothquant 0.5 --static "${calib[@]}")
step sq_1 120 "${py[@]}" "${sq[@]}" --out "$work/sq_1" --json "$out/sq_1" || true
step sq_2 120 "${dist[@]}" "${sq[@]}" --out "$work/sq_2" --json "$out/sq_2" || true
step sq_compare 90 "${py[@]}" compare "$work/sq_1" "$work/sq_2" --json "$out/sq_compare.json" || true
rm -rf "$work"
cat "$summary"
echo "total $(( $(date +%s) - T0 )) s (steps; the table follows)"

python3 - "$out" "$NPROC" "$LAYERS" "$GPTQ_LAYERS" <<'PY' | tee "$out/table_distributed.md"
import json, sys
from pathlib import Path
out, nproc, layers, glayers = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
def ranks(p):
    return [json.loads(f.read_text()) for f in sorted(out.glob(p + ".rank*.json"))]
def cmp(p):
    f = out / p
    return json.loads(f.read_text())["identical"] if f.exists() else None
rows, res = [], {"nproc": nproc}
for key, label, nl in (("gptq", "GPTQ W4A16", glayers), ("sq", "SmoothQuant W8A8 + static", layers)):
    one, many = ranks(f"{key}_1"), ranks(f"{key}_2")
    t1 = one[0]["wall_s"] if one else None
    tn = max(r["wall_s"] for r in many) if len(many) == nproc else None
    peak = lambda rs: max(r.get("peak_device_bytes", r["peak_rss_over_start_bytes"]) for r in rs) if rs else None
    base = (one[0]["layer_bytes"] + one[0]["activation_bytes"]) if one else None
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
    s1 = med(one[0]["seconds_per_layer"]) if one else None       # steady state: per decoder layer
    sn = max(med(r["seconds_per_layer"]) for r in many) if len(many) == nproc else None
    res[key] = {"layers": int(nl), "t_1": t1, "t_n": tn, "ratio": tn / t1 if t1 and tn else None,
                "s_per_layer_1": s1, "s_per_layer_n": sn, "ratio_per_layer": sn / s1 if s1 and sn else None,
                "peak_1_bytes": peak(one), "peak_n_bytes": peak(many), "layer_bytes": one[0]["layer_bytes"] if one else None,
                "activation_bytes": one[0]["activation_bytes"] if one else None,
                "peak_1_over_layer_plus_act": peak(one) / base if one else None,
                "identical": cmp(f"{key}_compare.json"), "ranks_1": one, "ranks_n": many}
    f = lambda v, fmt: "-" if v is None else format(v, fmt)
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"
    r = res[key]
    rows.append(f"| {label} | {nl} | {f(t1, '.1f')} | {f(tn, '.1f')} | {f(r['ratio'], '.2f')} | "
                f"{f(s1, '.2f')} / {f(sn, '.2f')} ({f(r['ratio_per_layer'], '.2f')}) | {gib(r['peak_1_bytes'])} | "
                f"{gib(r['peak_n_bytes'])} | {gib(r['layer_bytes'])} + {gib(r['activation_bytes'])} | "
                f"{f(r['peak_1_over_layer_plus_act'], '.2f')} | {r['identical']} |")
(out / "distributed.json").write_text(json.dumps(res, indent=1))
print(f"| run | layers | 1 proc s | {nproc} procs s | ratio | s/layer 1 / {nproc} (ratio) | peak/GPU 1 proc GiB "
      f"| peak/GPU {nproc} procs GiB | layer + activations GiB | peak 1 / (layer + act) | {nproc}-proc checkpoint identical |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
print("\n".join(rows))
PY
