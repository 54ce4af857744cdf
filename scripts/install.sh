#!/usr/bin/env bash
# All set-up on a fresh machine, used by the README's two commands and by CI.
#   bash scripts/install.sh          -> what the demo needs
#   bash scripts/install.sh --dev    -> plus test tools and (as root) Debian's headless Chromium
#                                       and redis-server
# torch goes first and explicitly: a bare `torch` requirement with nothing installed would
# pull PyPI's CUDA build (several GB) onto a CPU machine. scripts/torch_choice.py decides which
# build and from where (override: RADIXKV_TORCH_INDEX, RADIXKV_TORCH_SPEC).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
dev=0
browser=auto
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    --browser) browser=yes ;;
    --no-browser) browser=no ;;
    *) echo "install.sh: unknown option $arg (use --dev, --browser, --no-browser)" >&2; exit 2 ;;
  esac
done
say() { echo "install.sh: $* ($SECONDS s)"; }

if torch_version=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
  say "torch $torch_version is installed already: kept"
else
  choice=()  # a sentence, then pip's arguments, one a line (no mapfile: macOS ships bash 3.2)
  while IFS= read -r line; do choice+=("$line"); done < <("$PY" scripts/torch_choice.py)
  [ "${#choice[@]}" -ge 2 ] || { echo "install.sh: scripts/torch_choice.py gave no choice" >&2; exit 1; }
  say "torch: ${choice[0]} ..."
  "$PY" -m pip install -q "${choice[@]:1}"
fi
extras=demo
[ "$dev" = 1 ] && extras=dev,demo
say "radixkv and its extras ($extras), editable ..."
"$PY" -m pip install -q -e ".[$extras]"

# The shared-tier tests (tests/test_l2_*.py) start a real redis-server; only root can apt-get it.
if [ "$dev" = 1 ] && ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "install.sh: tests/test_l2_*.py skip without redis-server (as root: apt-get install redis-server)" >&2
  fi
fi

# The browser test drives Debian's Chromium; only root can apt-get it.
if [ "$dev" = 1 ] && [ "$browser" != no ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    say "Debian's Chromium for the browser test (apt-get) ..."
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  elif [ "$browser" = yes ]; then
    echo "install.sh: installing chromium needs root (apt-get install chromium chromium-driver)" >&2
    exit 1
  else
    say "Chromium not installed (needs root): the browser test will skip"
  fi
fi
say "done"
