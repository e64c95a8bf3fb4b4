#!/usr/bin/env bash
# Submit an accuracy study to a Ray cluster as a Ray job: every run a Ray Tune trial, side by side across the nodes.
#
#   examples/cluster/submit_study.sh ADDRESS study=NAME runner=tune output_dir=SHARED_DIR [study options] [overrides]
#   examples/cluster/submit_study.sh http://127.0.0.1:8265 study=lstm_text runner=tune \
#       output_dir=/shared/studies/lstm_text max_concurrent_trials=8
#
# The job runs `python -m rayspec.study` with the arguments (submit.sh uploads the checkout and waits for the
# job). output_dir must be storage that every node mounts: each trial writes its run there, and the Tune
# experiments that resume an interrupted study (the same command again) live in its tune/ folder.
# max_concurrent_trials (default 1) caps the trials at once; null runs as many as the cluster's CPUs hold
# (one CPU per trial with the local executor, `threads` in the study file; add executor=ray for stage actors).
set -euo pipefail

ENTRY=rayspec.study exec "$(dirname "$0")/submit.sh" "$@"
