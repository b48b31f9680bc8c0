#!/usr/bin/env bash
# How hybridkv and llama.cpp scale with cores on one GGUF file: `hybridkv bench --peer llama.cpp
# --quick --speculative off` once per thread count (each run both engines, same file, same
# threads), its JSON kept per count, then one table of every count. Made for a many-core machine
# (the README's "Thread scaling" figures came from it); needs llama-cpp-python like the bench.
#
#     scripts/thread_scaling.sh OUT_DIR CACHE_DIR "16 8 4 2" [bench args: --shape/--gguf/--model]
#
# Runs the counts in the order given, so that a run cut short keeps the ones that matter first.
set -u
out=$1 cache=$2 counts=$3
shift 3
py=${PYTHON:-python3}
mkdir -p "$out"
for n in $counts; do
    echo "== $(date +%T) bench at $n threads"
    $py -m hybridkv.cli bench --peer llama.cpp --quick --speculative off --threads "$n" \
        --cache-dir "$cache" --json "$out/bench-t$n.json" "$@" >>"$out/bench.log" 2>&1 \
        || { echo "bench at $n threads failed:"; tail -20 "$out/bench.log"; }
done
$py - "$out" <<'EOF'
import json, pathlib, sys

rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("bench-t*.json"), key=lambda p: int(p.stem[7:])):
    d = json.loads(f.read_text())
    s, run = d["scenarios"], d["run"]
    b1 = s["decode_b1"]
    rows.append(
        f"| {run['threads']} | {max(b1['read_gb_s_probes']):.1f} "
        f"| {s['prefill_512']['hybridkv']:.0f} / {s['prefill_512']['llama.cpp']:.0f} ({s['prefill_512']['ratio']:.2f}×) "
        f"| {b1['hybridkv']:.1f} / {b1['llama.cpp']:.1f} ({b1['ratio']:.2f}×) "
        f"| {b1['hybridkv_of_roofline']:.2f}× / {b1['llama_cpp_of_roofline']:.2f}× "
        f"| {s['decode_b8']['ratio']:.2f}× "
        f"| {s['chat_turn8_ttft']['hybridkv']:.0f} / {s['chat_turn8_ttft']['llama.cpp']:.0f} ({s['chat_turn8_ttft']['ratio']:.2f}×) "
        f"| {s['regenerate_ttft']['ratio']:.0f}× | {run['seconds']:.0f} |"
    )
if rows:
    print(f"file: {run['file']}")
    print("| threads | read GB/s | prefill_512 tok/s | decode_b1 ms | of roofline | decode_b8 | chat_turn8 ms | regenerate | s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
EOF
