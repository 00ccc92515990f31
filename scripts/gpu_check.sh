#!/usr/bin/env bash
# The one prepared GPU check: on a CUDA machine, in about 10 minutes on one GPU, run every job there and print one
# table with the device named. Never run yet: no GPU has been lent to this project (docs/gpu.md).
#   bash scripts/gpu_check.sh [OUT_DIR]          (in an environment with phantomclip, its test extras and CUDA torch)
# Runs: diagnose on the bundled model (fp32, bf16, fp16 recipes; and --engine vllm when vLLM imports), 5 train steps
# (local engine, snapshots at steps 0 and 5; and --engine vllm when vLLM imports), trace, trace --run on that run, and
# 2 TRL GRPO steps with PrecisionMonitor; then a table of what each wrote.
# A CPU dry run of the script's own plumbing (not a GPU check): DEVICE=cpu MODEL=tiny-random:30 bash scripts/gpu_check.sh
set -euo pipefail
out="${1:-gpu-check}"
device="${DEVICE:-cuda}"
model="${MODEL:-smollm2-135m}"
if [ "$device" != cpu ]; then
  python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: torch sees no CUDA device: run it on a GPU machine')"
fi
mkdir -p "$out"
run() {  # the command's output to $out/$name.log, its wall seconds to $out/$name.seconds
  local t0=$SECONDS
  echo "+ $*" >&2
  "$@" > "$out/$name.log" 2>&1
  echo $((SECONDS - t0)) > "$out/$name.seconds"
}

name=diagnose run timeout 300 phantomclip diagnose --device "$device" --model "$model" --trainer fp32,bf16,fp16 --json "$out/diagnose.json"
if python -c "import vllm" 2>/dev/null; then
  name=diagnose-vllm run timeout 300 phantomclip diagnose --device "$device" --model "$model" --engine vllm --trainer fp32,bf16 \
    --json "$out/diagnose-vllm.json"
fi
name=train run timeout 300 phantomclip train --device "$device" --model "$model" --steps 5 --keep-snapshots 5 \
  --out "$out/train"
if python -c "import vllm" 2>/dev/null; then
  name=train-vllm run timeout 300 phantomclip train --device "$device" --model "$model" --steps 5 --engine vllm \
    --out "$out/train-vllm"
fi
name=growth run timeout 300 phantomclip trace --device "$device" --run "$out/train" --json "$out/growth.json"
name=trace run timeout 300 phantomclip trace --device "$device" --model "$model" --n 8 --json "$out/trace.json"
name=trl run timeout 300 python - "$out" "$model" "$device" <<'EOF'
import json, sys
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from phantomclip.integrations.trl import PrecisionMonitor
from phantomclip.models.load import load_model

lm = load_model(sys.argv[2])
args = GRPOConfig(output_dir=f"{sys.argv[1]}/trl", per_device_train_batch_size=8, num_generations=8,
                  max_completion_length=32, max_steps=2, report_to=[], save_strategy="no", logging_steps=1, bf16=False,
                  use_cpu=sys.argv[3] == "cpu")
monitor = PrecisionMonitor(engine_dtype="bfloat16")
trainer = GRPOTrainer(model=lm.model, args=args, train_dataset=Dataset.from_dict({"prompt": ["Tell me a story."] * 16}),
                      reward_funcs=lambda completions, **kw: [-float(len(c)) for c in completions],
                      processing_class=lm.tokenizer, callbacks=[monitor])
trainer.train()
rows = [h for h in trainer.state.log_history if "precision/beta_abs_mean" in h]
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() and sys.argv[3] != "cpu" else "cpu"
json.dump({"device": name, "rows": rows}, open(f"{sys.argv[1]}/trl.json", "w"), indent=1)
EOF

python - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def seconds(name):
    p = out / f"{name}.seconds"
    return p.read_text().strip() if p.exists() else "-"
d = json.loads((out / "diagnose.json").read_text())
print(f"device: {d['device']['name']} (capability {d['device']['capability']}, torch {d['device']['torch']}, "
      f"CUDA {d['device']['cuda']})")
print(f"{'job':<16}{'seconds':>9}  figure")
for recipe, fig in d["recipes"].items():
    print(f"{'diagnose':<16}{seconds('diagnose'):>9}  {recipe}: mean |β| {fig['beta_abs_mean']:.4f}, "
          f"outside {100 * fig['outside_trust_region']:.2f}%")
if (out / "diagnose-vllm.json").exists():
    v = json.loads((out / "diagnose-vllm.json").read_text())
    for recipe, fig in v["recipes"].items():
        print(f"{'diagnose vllm':<16}{seconds('diagnose-vllm'):>9}  {recipe}: mean |β| {fig['beta_abs_mean']:.4f}")
rows = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
print(f"{'train 5 steps':<16}{seconds('train'):>9}  last step: reward {rows[-1]['reward/mean']:.2f}, "
      f"mean |β| {rows[-1]['mismatch/beta_abs_mean']:.4f}, phantom {100 * rows[-1]['clip/phantom_rate']:.2f}%")
if (out / "train-vllm").exists():
    rows = [json.loads(line) for line in (out / "train-vllm" / "metrics.jsonl").read_text().splitlines()]
    print(f"{'train vllm':<16}{seconds('train-vllm'):>9}  last step: reward {rows[-1]['reward/mean']:.2f}, "
          f"mean |β| {rows[-1]['mismatch/beta_abs_mean']:.4f}")
g = json.loads((out / "growth.json").read_text())
print(f"{'trace --run':<16}{seconds('growth'):>9}  mean |β| on the reference tokens by snapshot: "
      f"{[(r['step'], round(r['reference']['beta_abs_mean'], 4)) for r in g['snapshots']]}")
t = json.loads((out / "trace.json").read_text())
print(f"{'trace':<16}{seconds('trace'):>9}  mean |β| {t['beta']['beta_abs_mean']:.4f} over {t['tokens']} tokens")
trl = json.loads((out / "trl.json").read_text())
print(f"{'TRL 2 steps':<16}{seconds('trl'):>9}  precision/beta_abs_mean "
      f"{[round(r['precision/beta_abs_mean'], 4) for r in trl['rows']]}")
EOF
