# Two set-up commands on a fresh Debian/Ubuntu machine: `make demo` and `make test`.
# Both are idempotent: they install only what is missing.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# `make demo`'s prompt is the package's (h3serve.demo.shipped.DEMO_PROMPT), read once the venv exists.
PROMPT ?= $(shell $(BIN)/python -c 'from h3serve.demo.shipped import DEMO_PROMPT; print(DEMO_PROMPT)')

.PHONY: demo test lint typecheck fuzz ffmpeg chromium postgresql ceph venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	@touch $(STAMP)

ffmpeg:
	@command -v ffmpeg >/dev/null && command -v ffprobe >/dev/null || { \
	  echo "ffmpeg/ffprobe not found: installing them with apt-get"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo"; \
	  $$SUDO apt-get install -y ffmpeg || { $$SUDO apt-get update && $$SUDO apt-get install -y ffmpeg; } || { \
	    echo "error: could not install ffmpeg with apt-get; install ffmpeg and ffprobe by hand, then rerun make" >&2; \
	    exit 1; }; }

# The browser tests (tests/browser) drive Debian's Chromium through Playwright; no browser is downloaded.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  echo "chromium not found: installing it with apt-get (for the browser tests)"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo"; \
	  $$SUDO apt-get install -y chromium || { $$SUDO apt-get update && $$SUDO apt-get install -y chromium; } || { \
	    echo "error: could not install chromium with apt-get; install it by hand (or set H3SERVE_CHROMIUM)" >&2; \
	    exit 1; }; }

# The job-store tests start a throwaway PostgreSQL server (initdb + pg_ctl in a temp dir; as the postgres user
# when run as root). Debian puts its binaries in /usr/lib/postgresql/*/bin, off the PATH.
postgresql:
	@command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  echo "PostgreSQL's initdb not found: installing postgresql with apt-get (for the job-store tests)"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo"; \
	  $$SUDO apt-get install -y postgresql || { $$SUDO apt-get update && $$SUDO apt-get install -y postgresql; } || { \
	    echo "error: could not install postgresql with apt-get; install it by hand, then rerun make" >&2; \
	    exit 1; }; }

# The output-store tests start a throwaway single-node Ceph cluster with its S3 gateway (tests/ceph_gateway.py: one
# monitor, one memstore OSD, one radosgw on loopback, all under a temp dir; its daemons run as root).
ceph:
	@command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null && command -v radosgw >/dev/null || { \
	  echo "Ceph not found: installing ceph-mon, ceph-osd and radosgw with apt-get (for the output-store tests)"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo"; \
	  $$SUDO apt-get install -y ceph-mon ceph-osd radosgw || \
	    { $$SUDO apt-get update && $$SUDO apt-get install -y ceph-mon ceph-osd radosgw; } || { \
	    echo "error: could not install Ceph with apt-get; install ceph-mon ceph-osd radosgw by hand" >&2; \
	    exit 1; }; }

# The shipped demo checkpoint (h3serve/demo/checkpoint): a tiny H3 trained on the demo world (README).
demo: venv ffmpeg
	$(BIN)/h3serve generate "$(PROMPT)" -o demo.mp4 --duration 4 --steps 20 --seed 0
	@echo "wrote $$(pwd)/demo.mp4"
	@ffprobe -v error -show_entries stream=codec_name,width,height,r_frame_rate,nb_frames,sample_rate,channels \
	  -show_entries format=duration -of compact demo.mp4
	$(BIN)/h3serve check-demo demo.mp4 --prompt "$(PROMPT)"

test: venv ffmpeg chromium postgresql ceph lint typecheck
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=30

lint: venv
	$(BIN)/ruff check h3serve tests scripts

typecheck: venv
	$(BIN)/mypy

# The long randomised fuzz runs (never part of `make test`, whose fuzz tests replay fixed, recorded example sets):
# FUZZ_SEED picks the run (default: a new one, printed), FUZZ_EXAMPLES its size. What they find gets a fixed test.
fuzz: venv ffmpeg
	H3SERVE_FUZZ=1 $(BIN)/python -m pytest -q -m fuzz -p no:cacheprovider tests

clean:
	rm -rf $(VENV) demo.mp4 .pytest_cache
