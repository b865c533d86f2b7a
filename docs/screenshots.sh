#!/usr/bin/env bash
# Renders the README's screenshots with headless Chromium: the A/B report
# (examples/ab_memory --out DIR writes DIR/report.html) and the staircase memory timeline
# (examples/memory_patterns --pattern staircase writes DIR/staircase.timeline.html).
# The PNGs are written next to this script: docs/ab_report.png, docs/timeline_staircase.png.
#
#   docs/screenshots.sh [BUILD_DIR]        (default: build)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-$here/../build}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

"$build/examples/ab_memory" --model resnet --arch tiny --dataset synthetic --image-size 32 --batch 32 \
  --steps 3 --checkpoint none,blocks --amp off,bf16 --out "$tmp/ab" > /dev/null
"$build/examples/memory_patterns" --pattern staircase --device cpu --out "$tmp/patterns" > /dev/null

shot() {  # shot HTML PNG [HEIGHT]: 1,400 px wide (the width the pages are made to fit)
  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size="1400,${3:-900}" \
    --virtual-time-budget=5000 --screenshot="$2" "file://$1" 2> /dev/null
  # An 8-bit palette keeps the PNGs small when pngquant is around (they are < 300 KB anyway).
  if command -v pngquant > /dev/null; then pngquant --force --output "$2" 256 "$2" || true; fi
  echo "wrote $2 ($(stat -c %s "$2") bytes)"
}
# The report's top: headlines, the peak-versus-step-time chart and the first row of timelines.
shot "$tmp/ab/report.html" "$here/ab_report.png" 1200
shot "$tmp/patterns/staircase.timeline.html" "$here/timeline_staircase.png"
