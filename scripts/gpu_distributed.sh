#!/usr/bin/env bash
# Distributed calibration on 2 GPUs of one host, in one call (< 8 minutes; `bash scripts/gpu.sh
# distributed` runs it): a random-weight Llama-8B-shaped
# checkpoint (hidden 4096, intermediate 14336, 32 heads / 8 kv heads, LAYERS=32 layers), quantized
# layer by layer (lowbit.pipelines.layerwise) on 1 GPU and on NPROC=2 GPUs (torchrun, NCCL; calibration
# batches split across ranks, statistics reduced by lowbit.algorithms.distributed, rank 0 writes):
#   gptq  GPTQ W4A16 on the first GPTQ_LAYERS layers, 32,768 tokens (16 batches of 2 x 1024)
#   sq    SmoothQuant W8A8 + static scales on all LAYERS, 32,768 tokens (32 batches of 1 x 1024)
#   big   the same two at 131,072 tokens (GPTQ on BIG_LAYERS layers): the per-token work then
#         outweighs what does not divide over the GPUs (each group's Cholesky, the column loops'
#         latency, the output's writing on rank 0)
#   prof  torch.profiler over layer 1 of a 2-layer GPTQ run, on 1 and on 2 GPUs (not timed): the
#         top operators by device and by CPU time, and the kernel launches
#   host, trace  (not in the default RUNS) GPTQ with rank 1's Hessian sums in host memory;
#         the allocator's trace of one SmoothQuant layer
# wall time 1 vs 2 GPUs (target <= 0.6), peak memory per GPU over one layer's bf16 weights + the
# calibration activations (target <= 1.3), and whether the 2-GPU checkpoint is byte-identical to
# the 1-GPU one. GPTQ_CALIB / SQ_CALIB / GPTQ_BIG_CALIB / SQ_BIG_CALIB="batches sequences length".
# Before the timed runs, an untimed 1-layer GPTQ compiles the Triton kernels (so that no timed
# run pays it); each rank's steady per-layer phases are printed, and for GPTQ the whole
# checkpoint's extrapolation (wall + the layers not run at the steady s/layer). torch's CPU
# threads: the host's cores shared out over the processes.
# $OUT gets three files: distributed_steps.log (every step's output), distributed.json (every rank's
# summary, the comparisons, the profiles, the machine) and table_distributed.md; the table and the
# ratio and memory lines are printed last. Every step has its own timeout inside one DEADLINE (s).
# Runs from source (PYTHONPATH=src, nothing installed); needs torch (+ triton) and transformers.
# CPU rehearsal at tiny size (gloo, 2 processes), which checks every step of this script:
#   DEVICE=cpu OUT=/tmp/dist-out PYTHON=/path/to/venv/bin/python bash scripts/gpu_distributed.sh
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/out}"; mkdir -p "$out"
work="${WORK:-/tmp/lowbit-dist}"; rm -rf "$work"; mkdir -p "$work/json" "$work/warm"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DEVICE="${DEVICE:-cuda}"; NPROC="${NPROC:-2}"
if [[ "$DEVICE" == cpu ]]; then   # the rehearsal: tiny shapes unless given
    : "${LAYERS:=3}" "${GPTQ_LAYERS:=2}" "${HIDDEN:=128}" "${INTER:=384}" "${HEADS:=4}" "${KV:=2}" "${VOCAB:=97}"
    : "${GPTQ_CALIB:=4 2 16}" "${SQ_CALIB:=6 1 16}" "${DTYPE:=fp32}" "${BIG_LAYERS:=2}"
    : "${GPTQ_BIG_CALIB:=8 2 16}" "${SQ_BIG_CALIB:=12 1 16}"
fi
DTYPE="${DTYPE:-bf16}"
LAYERS="${LAYERS:-32}"; GPTQ_LAYERS="${GPTQ_LAYERS:-6}"; BIG_LAYERS="${BIG_LAYERS:-4}"
HIDDEN="${HIDDEN:-4096}"; INTER="${INTER:-14336}"; HEADS="${HEADS:-32}"; KV="${KV:-8}"; VOCAB="${VOCAB:-128256}"
read -r G_BATCHES G_BATCH G_SEQ <<< "${GPTQ_CALIB:-16 2 1024}"     # batches, sequences per batch, length
read -r S_BATCHES S_BATCH S_SEQ <<< "${SQ_CALIB:-32 1 1024}"
# the "big" runs: 4x the calibration tokens (131,072: half the GPTQ paper's 128 x 2048), where the
# per-token work (Hessians, forwards, held-out errors) outweighs what does not divide over GPUs
read -r GB_BATCHES GB_BATCH GB_SEQ <<< "${GPTQ_BIG_CALIB:-64 2 1024}"
read -r SB_BATCHES SB_BATCH SB_SEQ <<< "${SQ_BIG_CALIB:-128 1 1024}"
# torch's CPU threads: the host's cores shared out over the processes (on a host with few cores, two
# ranks with 4 threads each plus their reader threads oversubscribe it)
CORES=$(nproc 2>/dev/null || echo 4)
T1=$(( CORES < 4 ? CORES : 4 )); TN=$(( CORES / NPROC )); TN=$(( TN < 1 ? 1 : (TN > 4 ? 4 : TN) ))
DEADLINE="${DEADLINE:-470}"
T0=$(date +%s)
log="$out/distributed_steps.log"; : > "$log"   # not distributed.log: scripts/gpu.sh sends our stdout there
steps="$work/steps.txt"; : > "$steps"
PY="${PYTHON:-python3}"   # the interpreter with torch (the rehearsal passes its venv)
py=(env OMP_NUM_THREADS="$T1" "$PY" benchmarks/distributed_calib.py)
dist=(env OMP_NUM_THREADS="$TN" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" benchmarks/distributed_calib.py)

step() {  # step NAME LIMIT_S cmd...: run with min(LIMIT, time left) seconds, output appended to the log
    local name=$1 limit=$2; shift 2
    local left=$(( DEADLINE - ($(date +%s) - T0) - 20 ))
    (( limit > left )) && limit=$left
    if (( limit < 10 )); then echo "$name skipped (deadline)" | tee -a "$steps" "$log"; return 99; fi
    local t=$(date +%s)
    echo "===== $name (limit $limit s): $*" >> "$log"
    timeout --kill-after=10 "$limit" "$@" > "$work/step.log" 2>&1
    local rc=$?
    cat "$work/step.log" >> "$log"
    echo "$name rc=$rc ($(( $(date +%s) - t )) s, limit $limit s)" | tee -a "$steps" "$log"
    [[ $rc -ne 0 ]] && tail -n 12 "$work/step.log"
    grep -E "^rank [0-9]+/" "$work/step.log" || true
    return $rc
}

{ echo "===== machine"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda devices', torch.cuda.device_count())"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -n 1
  df -h "$work" | tail -n 1; echo "cpus $(nproc) (of $(getconf _NPROCESSORS_ONLN 2>/dev/null || echo ?) online); torch threads: 1 process $T1, $NPROC processes $TN each"
  free -g | head -n 2; } >> "$log" 2>&1
tail -n +2 "$log"

shape=(--hidden "$HIDDEN" --intermediate "$INTER" --heads "$HEADS" --kv-heads "$KV" --vocab "$VOCAB" --dtype "$DTYPE")
base=(--dtype "$DTYPE" --device "$DEVICE")
step make 150 "${py[@]}" make --out "$work/ckpt" --layers "$LAYERS" "${shape[@]}" --device "$DEVICE" || true
step view 30 "${py[@]}" view --src "$work/ckpt" --out "$work/ckpt_gptq" --layers "$GPTQ_LAYERS" || true

# RUNS picks the parts: gptq, sq (32,768 tokens: the runs of before), big (GPTQ and SmoothQuant at
# 131,072 tokens), prof (torch.profiler over one steady GPTQ layer on 1 and on 2 GPUs: not timed),
# host (GPTQ with rank 1's Hessian sums in host memory), trace (allocator traces of a SmoothQuant layer)
RUNS=",${RUNS:-gptq,sq,big,prof},"
pair() {  # pair KEY LIMIT run-args...: KEY_1 (1 GPU), KEY_2 (NPROC GPUs), the byte comparison; outputs removed
    local key=$1 limit=$2; shift 2
    step "${key}_1" "$limit" "${py[@]}" "$@" --out "$work/${key}_1" --json "$work/json/${key}_1" || true
    step "${key}_2" "$limit" "${dist[@]}" "$@" --out "$work/${key}_2" --json "$work/json/${key}_2" || true
    step "${key}_compare" 40 "${py[@]}" compare "$work/${key}_1" "$work/${key}_2" --json "$work/json/${key}_compare.json" || true
    rm -rf "$work/${key}_2"
    [[ $key == gptq && $RUNS == *,host,* ]] || rm -rf "$work/${key}_1"
}
gptq=(run --recipe w4a16 --method gptq "${base[@]}")
sq=(run --recipe w8a8-int8 --method rtn --smoothquant 0.5 --static "${base[@]}")
if [[ $RUNS == *,gptq,* || $RUNS == *,big,* || $RUNS == *,prof,* ]]; then
# Untimed: one GPTQ layer on 1 GPU first, so that every timed run finds the Triton kernels (block
# kernel, W4A16 GEMMs) compiled in the disk cache; before, only the 2-GPU run did (the 1-GPU run
# compiled them in its first layer, ~4 s of its 15 s).
step view_warm 30 "${py[@]}" view --src "$work/ckpt" --out "$work/ckpt_warm" --layers 1 || true
step gptq_warm 60 "${py[@]}" "${gptq[@]}" --ckpt "$work/ckpt_warm" --batches 2 --batch "$G_BATCH" --seq-len "$G_SEQ" \
    --out "$work/gptq_warm" --json "$work/warm/gptq_warm" || true
rm -rf "$work/gptq_warm"
fi
if [[ $RUNS == *,gptq,* ]]; then
pair gptq 100 "${gptq[@]}" --ckpt "$work/ckpt_gptq" --batches "$G_BATCHES" --batch "$G_BATCH" --seq-len "$G_SEQ"
fi
if [[ $RUNS == *,sq,* ]]; then
pair sq 100 "${sq[@]}" --ckpt "$work/ckpt" --batches "$S_BATCHES" --batch "$S_BATCH" --seq-len "$S_SEQ"
fi
if [[ $RUNS == *,big,* ]]; then
step view_big 30 "${py[@]}" view --src "$work/ckpt" --out "$work/ckpt_big" --layers "$BIG_LAYERS" || true
pair gptq_big 100 "${gptq[@]}" --ckpt "$work/ckpt_big" --batches "$GB_BATCHES" --batch "$GB_BATCH" --seq-len "$GB_SEQ"
pair sq_big 100 "${sq[@]}" --ckpt "$work/ckpt" --batches "$SB_BATCHES" --batch "$SB_BATCH" --seq-len "$SB_SEQ"
rm -rf "$work/ckpt_big"
fi
# Diagnostics after the measured runs (the first to be skipped when the deadline is near).
if [[ $RUNS == *,prof,* ]]; then   # layer 1 of 2 (layer 0 holds the one-off costs), profiled: not timed
step view_prof 30 "${py[@]}" view --src "$work/ckpt" --out "$work/ckpt_prof" --layers 2 || true
p=(--ckpt "$work/ckpt_prof" --batches "$G_BATCHES" --batch "$G_BATCH" --seq-len "$G_SEQ" --profile-layer 1)
step prof_1 60 "${py[@]}" "${gptq[@]}" "${p[@]}" --out "$work/prof_1" --json "$work/json/prof_1" || true
step prof_2 60 "${dist[@]}" "${gptq[@]}" "${p[@]}" --out "$work/prof_2" --json "$work/json/prof_2" || true
rm -rf "$work/prof_1" "$work/prof_2" "$work/ckpt_prof"
fi
if [[ $RUNS == *,host,* && $RUNS == *,gptq,* ]]; then
step gptq_host_2 100 "${dist[@]}" "${gptq[@]}" --ckpt "$work/ckpt_gptq" --batches "$G_BATCHES" --batch "$G_BATCH" \
    --seq-len "$G_SEQ" --terms-on-host --out "$work/gptq_host_2" --json "$work/json/gptq_host_2" || true
step gptq_host_compare 40 "${py[@]}" compare "$work/gptq_1" "$work/gptq_host_2" --json "$work/json/gptq_host_compare.json" || true
fi
rm -rf "$work/gptq_1" "$work/gptq_host_2"
trace_layer=$(( GPTQ_LAYERS > 2 ? 2 : GPTQ_LAYERS - 1 ))
sqt=("${sq[@]}" --ckpt "$work/ckpt_gptq" --batches "$S_BATCHES" --batch "$S_BATCH" --seq-len "$S_SEQ" --memory-trace-layer "$trace_layer")
if [[ $RUNS == *,trace,* ]]; then
step sq_trace_1 60 "${py[@]}" "${sqt[@]}" --out "$work/sq_trace_1" --json "$work/json/sq_trace_1" || true
step sq_trace_2 60 "${dist[@]}" "${sqt[@]}" --out "$work/sq_trace_2" --json "$work/json/sq_trace_2" || true
fi
rm -rf "$work/sq_trace_1" "$work/sq_trace_2" "$work/ckpt_gptq"
echo "steps took $(( $(date +%s) - T0 )) s" | tee -a "$steps"

"$PY" - "$out" "$work" "$NPROC" "$LAYERS" "$GPTQ_LAYERS" "$BIG_LAYERS" <<'PY' 2>&1 | tee "$out/table_distributed.md"
import json, sys
from pathlib import Path
out, work, nproc, layers, glayers, blayers = (Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                              sys.argv[5], sys.argv[6])
js = work / "json"
def ranks(p):
    return [json.loads(f.read_text()) for f in sorted(js.glob(p + ".rank*.json"))]
def cmp(p):
    f = js / p
    return json.loads(f.read_text()) if f.exists() else None
med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
peak = lambda r: r.get("peak_device_bytes", r["peak_rss_over_start_bytes"])
over = lambda r: peak(r) / (r["layer_bytes"] + r["activation_bytes"])   # this rank's own activations
fmt = lambda v, f: "-" if v is None else format(v, f)
gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"
def rank_line(key, rr):
    s = (f"  {key} world {rr.get('world', '?')} rank {rr['rank']}: phases "
         + ", ".join(f"{k} {v:.1f}" for k, v in rr["phase_seconds"].items())
         + ("; GPTQ " + ", ".join(f"{k} {v:.1f}" for k, v in rr["gptq_phase_seconds"].items())
            + f"; block kernel: {rr['gptq_block_kernel']}" if "gptq_phase_seconds" in rr else "")
         + "; threads " + ", ".join(f"{k} {v:.1f}" for k, v in rr.get("thread_seconds", {}).items()) + " (s)")
    pl = rr.get("phase_seconds_per_layer") or []
    if len(pl) > 1:      # steady state: the median of the layers after the first, phase by phase
        s += "; steady per layer (median of layers 1..) " + ", ".join(
            f"{k} {med([p[k] for p in pl[1:]]):.3f}" for k in pl[1])
        if "gptq_hessian" in pl[1]:   # the quantize phase outside GPTQ's timed parts: the groups' input forwards
            s += ", gptq_rest (forwards of the groups' inputs) " + f"{med([p['quantize'] - sum(v for k, v in p.items() if k.startswith('gptq_')) for p in pl[1:]]):.3f}"
    pp = rr.get("phase_peak_bytes")
    if pp:
        top = max(pp, key=lambda k: pp[k]["peak"])
        s += ("; peak GiB by phase " + ", ".join(f"{k} {gib(v['peak'])}" for k, v in pp.items())
              + f" (highest: {top}, layer {pp[top]['layer']}, {gib(pp[top]['allocated_at_start'])} allocated as it began)")
    return s
res = {"nproc": nproc, "steps": (work / "steps.txt").read_text().splitlines(),
       "machine": [l for l in (out / "distributed_steps.log").read_text().split("=====")[1].splitlines()[1:] if l]}
rows, lines = [], []
for key, label, nl in (("gptq", "GPTQ W4A16 (g128)", glayers), ("sq", "SmoothQuant W8A8 + static", layers),
                       ("gptq_big", "GPTQ W4A16 (g128)", blayers),
                       ("sq_big", "SmoothQuant W8A8 + static", layers)):
    one, many = ranks(f"{key}_1"), ranks(f"{key}_2")
    if not one and not many:
        continue
    label += f", {one[0]['tokens'] if one else '?'} tokens"
    ok1, okn = len(one) == 1, len(many) == nproc
    t1 = one[0]["wall_s"] if ok1 else None
    tn = max(r["wall_s"] for r in many) if okn else None
    s1 = med(one[0]["seconds_per_layer"][1:]) if ok1 else None     # steady state: without the first layer
    sn = max(med(r["seconds_per_layer"][1:]) for r in many) if okn else None
    o1 = over(one[0]) if ok1 else None
    on = max(over(r) for r in many) if okn else None
    c = cmp(f"{key}_compare.json")
    ident = None if c is None else c["identical"]
    r = res[key] = {"layers": int(nl), "t_1": t1, "t_n": tn, "ratio": tn / t1 if t1 and tn else None,
                    "s_per_layer_1": s1, "s_per_layer_n": sn, "ratio_per_layer": sn / s1 if s1 and sn else None,
                    "peak_1_bytes": peak(one[0]) if ok1 else None, "peak_n_bytes": max(map(peak, many)) if okn else None,
                    "peak_over_layer_plus_act_1": o1, "peak_over_layer_plus_act_n": on,
                    "identical": ident, "compare": c, "ranks_1": one, "ranks_n": many}
    base = (f"{gib(one[0]['layer_bytes'])} + {gib(one[0]['activation_bytes'])} / "
            f"{gib(many[0]['activation_bytes'])}") if ok1 and okn else "-"
    rows.append(f"| {label} | {nl} | {fmt(t1, '.1f')} | {fmt(tn, '.1f')} | {fmt(r['ratio'], '.2f')} | "
                f"{fmt(s1, '.2f')} / {fmt(sn, '.2f')} ({fmt(r['ratio_per_layer'], '.2f')}) | "
                f"{gib(r['peak_1_bytes'])} / {gib(r['peak_n_bytes'])} | {base} | "
                f"{fmt(o1, '.2f')} / {fmt(on, '.2f')} | {ident} |")
    verdict = lambda v, lim: "-" if v is None else ("PASS" if v <= lim else "MISS")
    mem = max([x for x in (o1, on) if x is not None], default=None)
    lines.append(f"{label}: wall {nproc} GPUs / 1 GPU = {fmt(r['ratio'], '.2f')} (target <= 0.6: "
                 f"{verdict(r['ratio'], 0.6)}; per layer after the first: {fmt(r['ratio_per_layer'], '.2f')}); peak / (layer + activations) = {fmt(o1, '.2f')} on 1 GPU, "
                 f"{fmt(on, '.2f')} per GPU on {nproc} (target <= 1.3: {verdict(mem, 1.3)}); "
                 f"{nproc}-GPU checkpoint byte-identical to the 1-GPU one: {ident}")
    if t1 and tn and s1 and sn and int(nl) < int(layers) and key.startswith("gptq"):
        # the run's one-off costs (wall minus its layers at the steady rate) + every layer of the
        # checkpoint at the steady rate: what the whole model would take, on paper
        e1, en = t1 + (int(layers) - int(nl)) * s1, tn + (int(layers) - int(nl)) * sn
        r["extrapolated_all_layers"] = {"layers": int(layers), "t_1": e1, "t_n": en, "ratio": en / e1}
        lines.append(f"  extrapolated to all {layers} layers (wall + the other layers at the steady s/layer): "
                     f"{e1:.1f} s / {en:.1f} s = {en / e1:.2f}")
    for rr in one[:1] + many:
        lines.append(rank_line(key, rr))
# torch.profiler over one steady GPTQ layer (not timed): where the device and the CPU spend it
for p in ("prof_1", "prof_2"):
    for rr in ranks(p):
        pr = rr.get("profile")
        if not pr:
            continue
        res.setdefault("profiles", {})[f"{p}.rank{rr['rank']}"] = pr
        top = lambda xs, k: "; ".join(f"{x['op'][:48]} x{x['count']} {x[k] / 1e3:.1f} ms" for x in xs[:10])  # noqa: E731
        lines.append(f"profile {p} rank {rr['rank']} layer {pr['layer']} (layer {rr['seconds_per_layer'][pr['layer']]:.2f} s "
                     f"under the profiler): device busy {pr['total_self_device_s']:.3f} s, CPU {pr['total_self_cpu_s']:.3f} s, "
                     f"{pr['launches']} kernel launches")
        lines.append("  by device time: " + top(pr["by_device_time"], "self_device_us"))
        lines.append("  by CPU time: " + top(pr["by_cpu_time"], "self_cpu_us"))
# diagnostics: GPTQ with rank 1's Hessian terms in host memory; the allocator traces
host = ranks("gptq_host_2")
if host:
    c = cmp("gptq_host_compare.json")
    res["gptq_terms_on_host"] = {"ranks": host, "compare": c}
    lines.append(f"GPTQ, {nproc} GPUs, Hessian terms of ranks > 0 in host memory: wall {max(r['wall_s'] for r in host):.1f} s, "
                 f"peak/GPU {gib(max(map(peak, host)))} GiB (peak / (layer + act) {max(map(over, host)):.2f}); "
                 f"byte-identical to the 1-GPU checkpoint: {None if c is None else c['identical']}")
    lines += [rank_line("gptq_host", rr) for rr in host]
for p in ("sq_trace_1", "sq_trace_2"):
    for rr in ranks(p):
        res.setdefault("memory_traces", {})[f"{p}.rank{rr['rank']}"] = rr.get("memory_trace")
        tr = rr.get("memory_trace")
        if not tr:
            continue
        lines.append(f"memory trace {p} rank {rr['rank']} layer {tr.get('layer')}: " + (
            tr["error"] if "error" in tr else
            f"peak {gib(tr['peak_bytes'])} GiB = {tr['peak_bytes'] / (rr['layer_bytes'] + rr['activation_bytes']):.2f} x "
            f"(layer + act); alive then: " + "; ".join(f"{x['where']} {x['bytes'] / 2**20:.0f} MiB"
                                                       for x in tr["live_at_peak"][:8])))
(out / "distributed.json").write_text(json.dumps(res, indent=1))
# the details first, then the table and the verdict lines: the last lines are what a tail shows
detail = lambda x: (x.startswith(" ") and not x.lstrip().startswith("extrapolated")) or x.startswith(("profile", "memory trace"))  # noqa: E731
print("\n".join(x for x in lines if detail(x)))
print()
print(f"| run | layers | 1 GPU s | {nproc} GPUs s | ratio | s/layer 1 / {nproc} (ratio) | peak/GPU GiB 1 / {nproc} "
      f"| layer + activations GiB (1 / {nproc}) | peak / (layer + act) 1 / {nproc} | checkpoint identical |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
print("\n".join(rows))
print()
print("\n".join(x for x in lines if not detail(x)))
PY
