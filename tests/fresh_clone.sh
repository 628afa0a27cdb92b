#!/usr/bin/env bash
# A new user's first commands from a fresh clone, checked: README's evaluation example on a built-in
# dataset (banking77, a small --limit, the smallest registry model) and `slotread decide` on
# examples/support.json. tests/test_fresh_clone.py runs it; by hand: `bash tests/fresh_clone.sh`.
#
# - `git clone` of the repository this script is in (its committed HEAD: uncommitted changes are not
#   in the clone) into a temporary folder, with an empty HOME, no SLOTREAD_* variables and nothing
#   beside the clone (no ../shared/data).
# - The clone is built into a wheel and installed, without dependencies, into a folder of its own
#   (pip --no-deps --no-build-isolation --target); the commands run that install's `slotread`, on the
#   Python of $PYTHON (default python3), which must hold slotread's dependencies (the tests' venv): so
#   the clone's code, and what its wheel ships, is what runs, with no network for packages.
# - The model cache is new and empty, except that files/ links to the GGUF files of an existing cache
#   ($SOURCE_CACHE, default ~/.cache/slotread), so the registry model is converted as on a first start
#   but not downloaded again (CI would otherwise fetch it on every run; missing there, it is fetched).
set -euo pipefail

repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
python=${PYTHON:-python3}
model=${MODEL:-smollm2-135m-instruct}
source_cache=${SOURCE_CACHE:-$HOME/.cache/slotread}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fail() {
    echo "fresh clone: $*" >&2
    exit 1
}

git clone -q "$repo" "$work/clone"
"$python" -m pip wheel -q --no-deps --no-build-isolation --wheel-dir "$work/wheel" "$work/clone" 2>"$work/pip.log" ||
    fail "building the wheel failed: $(cat "$work/pip.log")"
"$python" -m pip install -q --no-deps --target "$work/site" "$work"/wheel/slotread-*.whl 2>>"$work/pip.log" ||
    fail "installing the wheel failed: $(cat "$work/pip.log")"

mkdir -p "$work/home" "$work/cache/files"
if [ -d "$source_cache/files" ]; then
    for file in "$source_cache"/files/*; do
        [ -f "$file" ] && ln -s "$(realpath "$file")" "$work/cache/files/"
    done
fi
for variable in $(env | grep -o '^SLOTREAD_[A-Z_]*' || true); do
    unset "$variable"
done
export HOME="$work/home" SLOTREAD_CACHE="$work/cache" PYTHONPATH="$work/site" PATH="$work/site/bin:$PATH"
cd "$work/clone"

installed=$("$python" -P -c 'import slotread; print(slotread.__file__)')  # -P: as the command, not from the working directory
[[ $installed == "$work/site/"* ]] || fail "slotread imports from $installed, not from the installed clone"

# README, "Evaluate": the first example, on the smallest model and 4 items
slotread eval --model "$model" --dataset banking77 --limit 4 --out runs/b77 --no-progress \
    >"$work/eval.out" 2>"$work/eval.err" || fail "slotread eval failed: $(cat "$work/eval.err")"
grep -q "converting" "$work/eval.err" || fail "the first start did not say it was converting: $(cat "$work/eval.err")"
"$python" - "$work/eval.out" <<'EOF' || fail "unexpected eval output: $(cat "$work/eval.out")"
import csv, json, pathlib, sys
metrics = json.loads(pathlib.Path("runs/b77/metrics.json").read_text())
assert (metrics["dataset"], metrics["split"], metrics["items"]) == ("banking77", "test", 4), metrics
assert 0 <= metrics["accuracy"] <= 1 and metrics["nll"] > 0, metrics
rows = list(csv.DictReader(pathlib.Path("runs/b77/predictions.csv").open()))
assert len(rows) == 4 and all(0 <= int(row["id"]) < 3080 for row in rows), rows
assert pathlib.Path("runs/b77/reliability.png").stat().st_size > 10_000
assert "| banking77 | test | 4 |" in pathlib.Path(sys.argv[1]).read_text()
EOF
slotread eval table runs/*/ >"$work/table.out" || fail "slotread eval table failed"
grep -q "| $model | banking77 | test | 4 |" "$work/table.out" || fail "unexpected table: $(cat "$work/table.out")"

# README, "Set up": answer the example once without a server
slotread decide --model "$model" examples/support.json >"$work/decide.out" 2>"$work/decide.err" ||
    fail "slotread decide failed: $(cat "$work/decide.err")"
"$python" - "$work/decide.out" "$model" <<'EOF' || fail "unexpected decide output: $(cat "$work/decide.out")"
import json, math, sys
response = json.load(open(sys.argv[1]))
assert response["model"] == sys.argv[2]
answers = response["answers"]
assert list(answers) in (["urgent", "intent", "frustration"], ["urgent", "intent", "frustration", "escalate"]), answers
assert 0 <= answers["urgent"]["noul"] <= 1
intent = answers["intent"]
assert set(intent["probabilities"]) == {"card_arrival", "refund", "lost_or_stolen", "other"}
assert math.isclose(sum(intent["probabilities"].values()), 1, abs_tol=1e-9)
assert intent["choice"] == max(intent["probabilities"], key=intent["probabilities"].get)
assert 0 <= answers["frustration"]["score"] <= 4
assert "escalate" not in answers or 0 <= answers["escalate"]["noul"] <= 1  # asked only if urgent
assert response["usage"]["input_tokens"] > 0
EOF
echo "fresh clone: README's evaluation example and slotread decide ran from $(git -C "$repo" rev-parse --short HEAD)"
